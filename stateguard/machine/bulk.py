"""Bulk transitions: one conditional UPDATE for a whole batch, exact per-key outcomes.

PostgreSQL and SQLite (``UPDATE ... RETURNING``), per chunk::

    UPDATE t SET ... WHERE pk IN (:keys) AND state IN (:sources) RETURNING pk, version
    SELECT pk, state, version FROM t WHERE pk IN (:keys that did not apply)

On PostgreSQL the UPDATE first locks the chunk's rows in key order and judges
the locked rows (see :func:`_locked_update`); only keys that did not apply are
read back, once, to tell REPEATED, REJECTED and NOT_FOUND apart.
MySQL/MariaDB have no ``UPDATE ... RETURNING``, so each chunk is a locking
read in key order (which evaluates the trigger's condition on the latest
committed rows) and then the UPDATE of the keys that may apply, both held to
the primary key with ``FORCE INDEX (PRIMARY)`` (:func:`stateguard._kernel.by_primary_key`):
InnoDB locks every row a plan visits, and an IN list naming most of a small
table would otherwise scan the whole index out of key order.  History rows and
outbox events go in one multi-row INSERT per chunk (more when they outgrow one
statement: :func:`stateguard._kernel.insert_rows`).  See
``docs/how-to/sweepers.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import ColumnElement, Connection, Update, any_, bindparam, select, tuple_, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session
from sqlalchemy.schema import Column
from sqlalchemy.sql import util as sql_util
from sqlalchemy.sql import visitors

from .. import _kernel
from ..exceptions import InvalidArgument
from ..result import Outcome, Result
from . import compile, events, history

if TYPE_CHECKING:
    from .trigger import Trigger

__all__ = ["DEFAULT_CHUNK_SIZE", "fire_many", "fire_where"]

#: Keys per statement; large enough to amortise round trips, small enough to
#: stay far below every driver's bind-parameter limit.
DEFAULT_CHUNK_SIZE = 1000

#: An applied row: (key, database state, version, source state).
_Moved = tuple[tuple[Any, ...], Any, int | None, Any]


def _keys_in(info: _kernel.ModelInfo, backend: _kernel.Backend | None = None) -> ColumnElement[bool]:
    if len(info.pk_columns) == 1:
        col = info.pk_columns[0]
        if backend is not None and backend.array_params:
            # One array parameter instead of thousands of bind parameters:
            # the statement text stays the same for every chunk size.
            return col == any_(bindparam("sg_keys", type_=postgresql.ARRAY(col.type)))
        return col.in_(bindparam("sg_keys", expanding=True))
    return tuple_(*info.pk_columns).in_(bindparam("sg_keys", expanding=True))


def _key_param(keys: Iterable[tuple[Any, ...]], single: bool) -> list[Any]:
    return [k[0] for k in keys] if single else list(keys)


def _resolve_many(
    session: Session, info: _kernel.ModelInfo, targets: Iterable[Any]
) -> tuple[list[tuple[Any, ...]], dict[tuple[Any, ...], Any]]:
    if isinstance(targets, str | bytes) or not isinstance(targets, Iterable):
        raise InvalidArgument(f"many() takes an iterable of targets, got {targets!r}")
    keys: dict[tuple[Any, ...], Any] = {}
    for target in targets:
        key, instance = _kernel.resolve_target(session, info, target)
        if key not in keys or instance is not None:
            keys[key] = instance
    return list(keys), keys


class _Batch:
    """What many() and where() share: the checked values, the connection and the SET clause."""

    __slots__ = ("backend", "conn", "items", "npk", "pairs", "params", "state_cond", "trigger", "vcol")

    def __init__(
        self,
        trigger: Trigger,
        session: Session,
        values: Mapping[str, Any] | None,
        keys: Sequence[tuple[Any, ...]] = (),
    ) -> None:
        m = trigger.machine
        info = m.info
        self.trigger = trigger
        self.items, _ = _kernel.split_values(info, values, forbidden=m._forbidden)
        self.conn: Connection = _kernel.connection_for(
            session, info, keys, _kernel.value_integers(self.items)
        )
        self.backend = _kernel.backend(self.conn.dialect)
        self.pairs, self.state_cond, _ = compile.parts(
            trigger, self.backend, self.items, embed=False, last_insert_id=False
        )
        self.params = _kernel.value_params(self.items)
        self.npk = len(info.pk_columns)
        self.vcol = info.version_column

    def moved(self, key: tuple[Any, ...], row: Any) -> _Moved:
        """The applied row for a locked ``row`` (pk..., state, version) the UPDATE then moved."""
        m = self.trigger.machine
        npk = self.npk
        old_state = m.codec.from_db(row[npk])
        dest = m.target_of(self.trigger.name, old_state)
        version = row[npk + 1] + 1 if self.vcol is not None else None
        return key, m.codec.to_db(dest), version, old_state

    def update_locked(self, stmt: Update, keys: list[tuple[Any, ...]], what: str) -> None:
        """Run ``stmt``, the UPDATE of rows this transaction has locked and found eligible."""
        result = _kernel.execute(self.conn, stmt, {**self.params, "sg_keys": _key_param(keys, self.npk == 1)})
        if result.rowcount != len(keys):  # pragma: no cover - the rows are locked
            raise RuntimeError(
                f"stateguard: {what} {self.trigger!r} matched {result.rowcount} of {len(keys)} locked rows"
            )

    def finish(
        self,
        session: Session,
        applied_rows: list[_Moved],
        instances: Mapping[tuple[Any, ...], Any],
        chunk_size: int,
        meta: Any,
    ) -> list[Result]:
        """Log the applied rows (``chunk_size`` per INSERT), sync loaded instances; the APPLIED results."""
        trigger = self.trigger
        m = trigger.machine
        from_db = m.codec.from_db
        expire = [attr for attr, _, _ in self.items]
        for edge in trigger.edges:
            expire.extend(edge.values)
        if (m.history_enabled or trigger.topic is not None) and applied_rows:
            log_rows = [(k, src, from_db(st), v) for k, st, v, src in applied_rows]
            for start in range(0, len(log_rows), chunk_size):
                chunk = log_rows[start : start + chunk_size]
                if m.history_enabled:
                    history.record(self.conn, trigger, chunk, None, meta)
                if trigger.topic is not None:
                    events.record(self.conn, trigger, chunk, None, meta)
        out = []
        for key, db_state, version, _source in applied_rows:
            out.append(trigger._applied(session, key, from_db(db_state), version))
            _sync(session, m.info, m.attr, instances.get(key), key, db_state, version, expire)
        return out


def _locked_update(batch: _Batch, keys_in: ColumnElement[bool]) -> Update:
    """PostgreSQL: the chunk's UPDATE of rows it first locks in key order, judged on the locked rows.

    ::

        WITH sg_locked AS MATERIALIZED (SELECT pk AS sg_0, <columns the condition reads> FROM t
                                        WHERE pk = ANY(:keys) ORDER BY pk FOR UPDATE)
        UPDATE t SET ... FROM sg_locked
        WHERE t.pk = sg_locked.sg_0 AND t.pk = ANY(:keys) AND <condition over sg_locked>

    Locked in key order: a plain UPDATE locks rows in whatever order its plan
    visits them (physical order under a sequential scan), and two overlapping
    batches locking in different orders deadlock; with the keys sorted across
    chunks too, every batch takes its locks in ascending key order.

    Judged on the locked rows, not on ``t``: at READ COMMITTED a condition on
    ``t`` filters on the statement's snapshot, so a row that a transaction this
    one waited for moved *into* a source state (a refund back to ``pending``)
    was left out, and read back in its new state as REJECTED.  A row FOR UPDATE
    waited for comes out of the lock as its latest committed version, so the
    condition over ``sg_locked`` sees what the row holds; the UPDATE of an
    outdated ``t`` row re-checks it on the latest one (EvalPlanQual).  The CTE
    is MATERIALIZED so that PostgreSQL cannot push the condition below the
    lock (it does into a plain subquery, which filters on the snapshot again).
    It selects every key of the chunk whatever its state, so no row can be
    left out before it is locked.
    """
    info = batch.trigger.machine.info
    table = info.table
    pks = info.pk_columns
    read = [c for c in visitors.iterate(batch.state_cond) if isinstance(c, Column) and c.table is table]
    cols = [*pks, *dict.fromkeys(c for c in read if c not in pks)]
    # Named apart from the table's columns: PostgreSQL does not qualify a column in SET
    # (``balance = balance - 100``), which the FROM item would make ambiguous.
    locked = (
        select(*(c.label(f"sg_{i}") for i, c in enumerate(cols)))
        .where(keys_in)
        .order_by(*pks)
        .with_for_update()
        .cte("sg_locked")
        .prefix_with("MATERIALIZED")
    )
    on_locked = sql_util.ClauseAdapter(locked).traverse(batch.state_cond)
    return (
        update(table)
        .where(*(c == locked.c[f"sg_{i}"] for i, c in enumerate(pks)), keys_in, on_locked)
        .ordered_values(*batch.pairs)
    )


def fire_many(
    trigger: Trigger,
    session: Session,
    targets: Iterable[Any],
    *,
    values: Mapping[str, Any] | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    metadata: Mapping[str, Any] | None = None,
) -> dict[Any, Result]:
    """Fire the trigger on many rows with one UPDATE per chunk; a Result per key.

    Outcomes are exact per key (APPLIED / REPEATED / REJECTED / NOT_FOUND),
    also when other transactions move some of the same rows concurrently;
    see :mod:`stateguard.machine.bulk` for the statements each backend runs::

        results = Order.flow.ship.many(session, [1, 2, 3], values={"note": "batch 7"})
        results[2].outcome

    Awaited when given an AsyncSession, like the trigger itself.
    """
    m = trigger.machine
    info = m.info
    if type(chunk_size) is not int or chunk_size < 1:
        raise InvalidArgument(f"chunk_size must be a positive int, got {chunk_size!r}")
    given, instances = _resolve_many(session, info, targets)
    try:
        keys = sorted(given)
    except TypeError:  # pragma: no cover - keys of one column type always compare
        keys = given
    batch = _Batch(trigger, session, values, keys)
    conn, backend, state_cond, npk, vcol = batch.conn, batch.backend, batch.state_cond, batch.npk, batch.vcol
    keys_in = _keys_in(info, backend)
    single = npk == 1
    state_col = m.state_column
    # A trigger with several sources needs each row's previous state for the
    # history and the events: read it with the locking read (the path MySQL always takes).
    need_old = (m.history_enabled or trigger.topic is not None) and len(trigger.sources) > 1
    if m.history_enabled or trigger.topic is not None:
        history.check_request(None, metadata)
    elif metadata is not None:
        raise InvalidArgument(
            f"{m._where()} keeps no history and {trigger.name!r} writes no events; metadata needs "
            f"StateMachine(..., history=True) or events"
        )
    applied_rows: list[_Moved] = []
    unapplied: list[tuple[tuple[Any, ...], Any, int | None] | tuple[tuple[Any, ...]]] = []
    read_cols: list[Any] = [*info.pk_columns, state_col]
    if vcol is not None:
        read_cols.append(vcol)
    update_stmt = _kernel.by_primary_key(
        update(info.table).where(keys_in, state_cond).ordered_values(*batch.pairs), info.table, backend
    )
    if backend.returning and backend.row_locks:
        update_stmt = _locked_update(batch, keys_in)

    for start in range(0, len(keys), chunk_size):
        chunk = keys[start : start + chunk_size]
        if backend.returning and not need_old:
            returning = [*info.pk_columns]
            if vcol is not None:
                returning.append(vcol)
            returning.append(state_col)
            rows = _kernel.execute(
                conn,
                update_stmt.returning(*returning),
                {**batch.params, "sg_keys": _key_param(chunk, single)},
            ).all()
            done = set()
            for row in rows:
                key = tuple(row[:npk])
                done.add(key)
                applied_rows.append(
                    (key, row[-1], row[npk] if vcol is not None else None, trigger.sources[0])
                )
            rest = [k for k in chunk if k not in done]
            if rest:
                found = _kernel.execute(
                    conn, select(*read_cols).where(keys_in), {"sg_keys": _key_param(rest, single)}
                ).all()
                by_key = {tuple(r[:npk]): r for r in found}
                for k in rest:
                    r = by_key.get(k)
                    unapplied.append(
                        (k,) if r is None else (k, r[npk], r[npk + 1] if vcol is not None else None)
                    )
        else:
            # No UPDATE RETURNING: lock the batch in key order and let the
            # database evaluate the trigger's condition on the latest rows.
            _kernel.sqlite_write_lock(conn)
            probe = _kernel.by_primary_key(
                select(*read_cols, state_cond.label("sg_ok"))
                .where(keys_in)
                .order_by(*info.pk_columns)
                .with_for_update(),
                info.table,
                backend,
            )
            found = _kernel.execute(conn, probe, {"sg_keys": _key_param(chunk, single)}).all()
            by_key = {tuple(r[:npk]): r for r in found}
            ok: list[tuple[Any, ...]] = []
            for k in chunk:
                r = by_key.get(k)
                if r is None:
                    unapplied.append((k,))
                elif r[-1]:
                    ok.append(k)
                else:
                    unapplied.append((k, r[npk], r[npk + 1] if vcol is not None else None))
            if ok:
                batch.update_locked(update_stmt, ok, "bulk")
                applied_rows.extend(batch.moved(k, by_key[k]) for k in ok)

    out = {
        r.key: r
        for r in batch.finish(session, applied_rows, instances, chunk_size, history.meta_of(metadata))
    }
    for entry in unapplied:
        key = entry[0]
        if len(entry) == 1:
            result = trigger._result(Outcome.NOT_FOUND, session, key)
        else:
            db_state, version = entry[1], entry[2]
            result = trigger._found(session, key, db_state, version)
            _sync(session, info, m.attr, instances.get(key), key, db_state, version, ())
        out[result.key] = result
    # Results in the order the keys were given.
    return {_kernel.public_key(k): out[_kernel.public_key(k)] for k in given}


def _sync(
    session: Session,
    info: _kernel.ModelInfo,
    state_attr: str,
    instance: Any,
    key: tuple[Any, ...],
    db_state: Any,
    version: int | None,
    expire: Iterable[str],
) -> None:
    committed: dict[str, Any] = {state_attr: db_state}
    if info.version_attr is not None and version is not None:
        committed[info.version_attr] = version
    _kernel.sync_loaded(session, info, key, instance, committed, expire)


def fire_where(
    trigger: Trigger,
    session: Session,
    condition: ColumnElement[bool],
    *,
    limit: int | None = None,
    values: Mapping[str, Any] | None = None,
) -> list[Any]:
    """Fire the trigger on every row matching ``condition`` (a sweeper); the applied keys.

    Rows not in a source state are left alone.  With ``limit``, at most
    that many rows, in primary-key order; concurrent sweepers skip each
    other's locked rows instead of waiting (on PostgreSQL and MariaDB, rows any
    other transaction holds are skipped, so an empty result does not prove that
    no row matches)::

        expired = Order.flow.cancel.where(session, Order.created_at < cutoff, limit=500)

    Awaited when given an AsyncSession, like the trigger itself.
    """
    m = trigger.machine
    info = m.info
    if not isinstance(condition, ColumnElement):
        raise InvalidArgument(f"where() takes a SQL expression over {info.model.__name__}, got {condition!r}")
    if limit is not None:
        if type(limit) is not int or limit < 1:
            raise InvalidArgument(f"limit must be a positive int or None, got {limit!r}")
        limit = _kernel.check_batch(limit, "limit")
    batch = _Batch(trigger, session, values)
    conn, backend, state_cond, npk, vcol = batch.conn, batch.backend, batch.state_cond, batch.npk, batch.vcol
    state_col = m.state_column
    applied_rows: list[_Moved]
    need_old = (m.history_enabled or trigger.topic is not None) and len(trigger.sources) > 1
    if backend.returning and not need_old:
        where: ColumnElement[bool]
        if limit is None:
            where = condition & state_cond
        else:
            pick = (
                select(*info.pk_columns).where(condition, state_cond).order_by(*info.pk_columns).limit(limit)
            )
            if backend.row_locks:
                # Concurrent sweepers share the work instead of queueing on each other's rows.
                pick = pick.with_for_update(skip_locked=True)
                # A MATERIALIZED CTE is evaluated exactly once per statement: a
                # LIMIT .. SKIP LOCKED subquery inside IN (...) may be run again
                # (a rescan, an EvalPlanQual recheck after a concurrent update)
                # and pick other rows, so the UPDATE could move more than ``limit``.
                picked = pick.cte("sg_picked").prefix_with("MATERIALIZED")
                pick = select(*picked.c)
            if npk == 1:
                where = info.pk_columns[0].in_(pick.scalar_subquery()) & state_cond
            else:
                where = tuple_(*info.pk_columns).in_(pick) & state_cond
        returning = [*info.pk_columns, state_col]
        if vcol is not None:
            returning.append(vcol)
        stmt = update(info.table).where(where).ordered_values(*batch.pairs).returning(*returning)
        rows = sorted(_kernel.execute(conn, stmt, batch.params).all(), key=lambda r: tuple(r[:npk]))
        source = trigger.sources[0]
        applied_rows = [
            (tuple(r[:npk]), r[npk], r[npk + 1] if vcol is not None else None, source) for r in rows
        ]
    else:
        cols: list[Any] = [*info.pk_columns, state_col]
        if vcol is not None:
            cols.append(vcol)
        pick = select(*cols).where(condition, state_cond).order_by(*info.pk_columns)
        if limit is not None:
            pick = pick.limit(limit)
        _kernel.sqlite_write_lock(conn)
        found = _kernel.execute(conn, pick.with_for_update(skip_locked=True), batch.params).all()
        keys = [tuple(r[:npk]) for r in found]
        if keys:
            sweep = _kernel.by_primary_key(
                update(info.table).where(_keys_in(info), state_cond).ordered_values(*batch.pairs),
                info.table,
                backend,
            )
            batch.update_locked(sweep, keys, "sweep")
        applied_rows = [batch.moved(k, r) for k, r in zip(keys, found, strict=True)]
    # One INSERT logs the whole sweep, one more writes its events.
    batch.finish(session, applied_rows, {}, max(len(applied_rows), 1), None)
    return [_kernel.public_key(k) for k, _, _, _ in applied_rows]
