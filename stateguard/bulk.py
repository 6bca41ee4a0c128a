"""Bulk transitions: one conditional UPDATE for a whole batch, exact per-key outcomes.

PostgreSQL and SQLite (``UPDATE ... RETURNING``), per chunk::

    UPDATE t SET ... WHERE pk IN (:keys) AND state IN (:sources) RETURNING pk, version
    SELECT pk, state, version FROM t WHERE pk IN (:keys that did not apply)

The returned keys are exactly the rows this statement changed (PostgreSQL
re-checks each waiting row's WHERE at READ COMMITTED); only keys that did not
apply are read back, once, to tell REPEATED, REJECTED and NOT_FOUND apart.

MySQL/MariaDB have no ``UPDATE ... RETURNING``, so each chunk is::

    SELECT pk, state, version, (state IN (:sources) AND guard) FROM t
        WHERE pk IN (:keys) ORDER BY pk FOR UPDATE
    UPDATE t SET ... WHERE pk IN (:keys that may apply) AND state IN (:sources)

The locking read takes the batch's rows in key order (so two overlapping
batches cannot deadlock each other) and evaluates the trigger's condition on
the latest committed rows; with the rows locked, nobody can change them
before the UPDATE, so the rows it matched are exactly those the read said.
Two statements per chunk on every backend when some keys do not apply; one
on PostgreSQL and SQLite when all of them do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import ColumnElement, any_, bindparam, select, tuple_, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session

from . import _sql, _write
from .exceptions import InvalidArgument
from .result import Outcome, Result

if TYPE_CHECKING:
    from .machine import Trigger

__all__ = ["DEFAULT_CHUNK_SIZE", "fire_many", "fire_where"]

#: Keys per statement; large enough to amortise round trips, small enough to
#: stay far below every driver's bind-parameter limit.
DEFAULT_CHUNK_SIZE = 1000


def _keys_in(info: _sql.ModelInfo, backend: _sql.Backend | None = None) -> ColumnElement[bool]:
    if len(info.pk_columns) == 1:
        col = info.pk_columns[0]
        if backend is not None and backend.name == "postgresql":
            # One array parameter instead of thousands of bind parameters:
            # the statement text stays the same for every chunk size.
            return col == any_(bindparam("sg_keys", type_=postgresql.ARRAY(col.type)))
        return col.in_(bindparam("sg_keys", expanding=True))
    return tuple_(*info.pk_columns).in_(bindparam("sg_keys", expanding=True))


def _key_param(keys: Iterable[tuple[Any, ...]], single: bool) -> list[Any]:
    return [k[0] for k in keys] if single else list(keys)


def _resolve_many(
    session: Session, info: _sql.ModelInfo, targets: Iterable[Any]
) -> tuple[list[tuple[Any, ...]], dict[tuple[Any, ...], Any]]:
    if isinstance(targets, str | bytes) or not isinstance(targets, Iterable):
        raise InvalidArgument(f"many() takes an iterable of targets, got {targets!r}")
    keys: dict[tuple[Any, ...], Any] = {}
    for target in targets:
        key, instance = _write.resolve_target(session, info, target)
        if key not in keys or instance is not None:
            keys[key] = instance
    return list(keys), keys


def fire_many(
    trigger: Trigger,
    session: Session,
    targets: Iterable[Any],
    *,
    values: Mapping[str, Any] | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    metadata: Mapping[str, Any] | None = None,
) -> dict[Any, Result]:
    """Implementation of :meth:`Trigger.many`."""
    m = trigger.machine
    info = m.info
    if type(chunk_size) is not int or chunk_size < 1:
        raise InvalidArgument(f"chunk_size must be a positive int, got {chunk_size!r}")
    given, instances = _resolve_many(session, info, targets)
    try:
        keys = sorted(given)
    except TypeError:  # pragma: no cover - keys of one column type always compare
        keys = given
    items, _ = _write.split_values(info, values, forbidden=m._forbidden)
    if session.autoflush:
        session.flush()
    conn = session.connection(bind_arguments=m._bind_args)
    backend = _sql.backend(conn.dialect)
    pairs, state_cond, _ = trigger._parts(backend, items, embed=False, last_insert_id=False)
    keys_in = _keys_in(info, backend)
    single = len(info.pk_columns) == 1
    vcol = info.version_column
    state_col = m.state_column
    params_base = _sql.value_params(items)
    out: dict[Any, Result] = {}
    # A trigger with several sources needs each row's previous state for the
    # history: read it with the locking read (the path MySQL always takes).
    need_old = m.history_enabled and len(trigger.sources) > 1
    if m.history_enabled:
        from . import history

        history.check_request(None, metadata)
    elif metadata is not None:
        raise InvalidArgument(
            f"{m._where()} keeps no history; metadata needs StateMachine(..., history=True)"
        )
    applied_rows: list[tuple[tuple[Any, ...], Any, int | None, Any]] = []  # key, db state, version, source
    unapplied: list[tuple[tuple[Any, ...], Any, int | None] | tuple[tuple[Any, ...]]] = []
    read_cols: list[Any] = [*info.pk_columns, state_col]
    if vcol is not None:
        read_cols.append(vcol)
    npk = len(info.pk_columns)
    update_stmt = update(info.table).where(keys_in, state_cond).ordered_values(*pairs)
    if backend.name == "postgresql":
        # Lock the chunk's rows in key order before updating them: a plain
        # UPDATE locks rows in whatever order its plan visits them (physical
        # order under a sequential scan), and two overlapping batches locking
        # in different orders deadlock.  With the keys sorted across chunks
        # too, every batch takes its locks in ascending key order.
        locked = (
            select(*info.pk_columns).where(keys_in).order_by(*info.pk_columns).with_for_update().subquery()
        )
        update_stmt = (
            update(info.table)
            .where(*(c == locked.c[c.key] for c in info.pk_columns), state_cond)
            .ordered_values(*pairs)
        )

    for start in range(0, len(keys), chunk_size):
        chunk = keys[start : start + chunk_size]
        if backend.returning and not need_old:
            returning = [*info.pk_columns]
            if vcol is not None:
                returning.append(vcol)
            returning.append(state_col)
            rows = _write.execute(
                conn,
                update_stmt.returning(*returning),
                {**params_base, "sg_keys": _key_param(chunk, single)},
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
                found = _write.execute(
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
            _write.sqlite_write_lock(conn)
            probe = (
                select(*read_cols, state_cond.label("sg_ok"))
                .where(keys_in)
                .order_by(*info.pk_columns)
                .with_for_update()
            )
            found = _write.execute(conn, probe, {"sg_keys": _key_param(chunk, single)}).all()
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
                result = _write.execute(conn, update_stmt, {**params_base, "sg_keys": _key_param(ok, single)})
                if result.rowcount != len(ok):  # pragma: no cover - the rows are locked
                    raise RuntimeError(
                        f"stateguard: bulk {trigger!r} matched {result.rowcount} of {len(ok)} locked rows"
                    )
                for k in ok:
                    r = by_key[k]
                    old_state = m._from_db(r[npk])
                    dest = m.target_of(trigger.name, old_state)
                    version = r[npk + 1] + 1 if vcol is not None else None
                    applied_rows.append((k, m._to_db[dest], version, old_state))

    expire = [attr for attr, _, _ in items]
    for edge in trigger.edges:
        expire.extend(edge.values)
    if m.history_enabled and applied_rows:
        from . import history

        log_rows = [(k, src, m._from_db(st), v) for k, st, v, src in applied_rows]
        for start in range(0, len(log_rows), chunk_size):
            history.record(
                conn, trigger, log_rows[start : start + chunk_size], None, history.meta_of(metadata)
            )
    for key, db_state, version, _source in applied_rows:
        result_obj = trigger._applied(session, key, m._from_db(db_state), version)
        out[result_obj.key] = result_obj
        _sync(session, info, m.attr, instances.get(key), key, db_state, version, expire)
    for entry in unapplied:
        key = entry[0]
        public = _sql.public_key(key)
        if len(entry) == 1:
            out[public] = Result(
                Outcome.NOT_FOUND, model=info.model, key=public, trigger=trigger.name, session=session
            )
            continue
        db_state, version = entry[1], entry[2]
        state = m._from_db(db_state)
        outcome = Outcome.REPEATED if state in trigger.dests else Outcome.REJECTED
        out[public] = Result(
            outcome,
            model=info.model,
            key=public,
            trigger=trigger.name,
            state=state,
            version=version,
            session=session,
        )
        _sync(session, info, m.attr, instances.get(key), key, db_state, version, ())
    # Results in the order the keys were given.
    return {_sql.public_key(k): out[_sql.public_key(k)] for k in given}


def _sync(
    session: Session,
    info: _sql.ModelInfo,
    state_attr: str,
    instance: Any,
    key: tuple[Any, ...],
    db_state: Any,
    version: int | None,
    expire: Iterable[str],
) -> None:
    if instance is None:
        instance = _write.identity_instance(session, info, key)
        if instance is None:
            return
    committed: dict[str, Any] = {state_attr: db_state}
    if info.version_attr is not None and version is not None:
        committed[info.version_attr] = version
    _write.sync_loaded(session, info, key, instance, committed, expire)


def fire_where(
    trigger: Trigger,
    session: Session,
    condition: ColumnElement[bool],
    *,
    limit: int | None = None,
    values: Mapping[str, Any] | None = None,
) -> list[Any]:
    """Implementation of :meth:`Trigger.where`."""
    m = trigger.machine
    info = m.info
    if not isinstance(condition, ColumnElement):
        raise InvalidArgument(f"where() takes a SQL expression over {info.model.__name__}, got {condition!r}")
    if limit is not None and (type(limit) is not int or limit < 1):
        raise InvalidArgument(f"limit must be a positive int or None, got {limit!r}")
    items, _ = _write.split_values(info, values, forbidden=m._forbidden)
    if session.autoflush:
        session.flush()
    conn = session.connection(bind_arguments=m._bind_args)
    backend = _sql.backend(conn.dialect)
    pairs, state_cond, _ = trigger._parts(backend, items, embed=False, last_insert_id=False)
    params = _sql.value_params(items)
    npk = len(info.pk_columns)
    vcol = info.version_column
    state_col = m.state_column
    keys: list[tuple[Any, ...]]
    states: list[Any]
    versions: list[int | None]
    sources: list[Any]
    need_old = m.history_enabled and len(trigger.sources) > 1
    if backend.returning and not need_old:
        where: ColumnElement[bool]
        if limit is None:
            where = condition & state_cond
        else:
            pick = (
                select(*info.pk_columns).where(condition, state_cond).order_by(*info.pk_columns).limit(limit)
            )
            if backend.name == "postgresql":
                # Concurrent sweepers share the work instead of queueing on each other's rows.
                pick = pick.with_for_update(skip_locked=True)
            if npk == 1:
                where = info.pk_columns[0].in_(pick.scalar_subquery()) & state_cond
            else:
                where = tuple_(*info.pk_columns).in_(pick) & state_cond
        returning = [*info.pk_columns, state_col]
        if vcol is not None:
            returning.append(vcol)
        stmt = update(info.table).where(where).ordered_values(*pairs).returning(*returning)
        rows = sorted(_write.execute(conn, stmt, params).all(), key=lambda r: tuple(r[:npk]))
        keys = [tuple(r[:npk]) for r in rows]
        states = [r[npk] for r in rows]
        versions = [r[npk + 1] if vcol is not None else None for r in rows]
        sources = [trigger.sources[0]] * len(rows)
    else:
        cols: list[Any] = [*info.pk_columns, state_col]
        if vcol is not None:
            cols.append(vcol)
        pick = select(*cols).where(condition, state_cond).order_by(*info.pk_columns)
        if limit is not None:
            pick = pick.limit(limit)
        _write.sqlite_write_lock(conn)
        found = _write.execute(conn, pick.with_for_update(skip_locked=True), params).all()
        keys = [tuple(r[:npk]) for r in found]
        states, versions, sources = [], [], []
        if keys:
            single = npk == 1
            result = _write.execute(
                conn,
                update(info.table).where(_keys_in(info), state_cond).ordered_values(*pairs),
                {**params, "sg_keys": _key_param(keys, single)},
            )
            if result.rowcount != len(keys):  # pragma: no cover - the rows are locked
                raise RuntimeError(
                    f"stateguard: sweep {trigger!r} matched {result.rowcount} of {len(keys)} locked rows"
                )
            for r in found:
                old_state = m._from_db(r[npk])
                dest = m.target_of(trigger.name, old_state)
                sources.append(old_state)
                states.append(m._to_db[dest])
                versions.append(r[npk + 1] + 1 if vcol is not None else None)
    expire = [attr for attr, _, _ in items]
    for edge in trigger.edges:
        expire.extend(edge.values)
    if m.history_enabled and keys:
        from . import history

        log_rows = [
            (k, src, m._from_db(st), v) for k, st, v, src in zip(keys, states, versions, sources, strict=True)
        ]
        history.record(conn, trigger, log_rows, None, None)
    for key, db_state, version in zip(keys, states, versions, strict=True):
        trigger._applied(session, key, m._from_db(db_state), version)
        _sync(session, info, m.attr, None, key, db_state, version, expire)
    return [_sql.public_key(k) for k in keys]
