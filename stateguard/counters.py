"""Guarded counters: stock that never oversells and changes that never apply twice.

One statement decides::

    UPDATE stock SET amount = amount - :by [, version = version + 1]
    WHERE id = :id AND amount - :by >= :floor

It holds no lock across a read and needs no retry loop: the database
serialises the row and each UPDATE re-checks the bound against the latest
amount.  With ``ref=`` the change is idempotent: a row ``(ref, table, key,
column, delta)`` goes into ``stateguard_counter_ledger`` in the same
transaction, *before* the UPDATE, and its unique key decides whether this
call is the first (a concurrent twin waits on the index, then sees
REPEATED); an INSUFFICIENT or NOT_FOUND call removes its ledger row again.
The ledger INSERT is ``ON CONFLICT DO NOTHING RETURNING id`` on PostgreSQL
and SQLite; on MariaDB a plain INSERT whose duplicate-key error (1062) InnoDB
rolls back as a single statement, and a twin that waited reads the row back
with a locking read (a plain read would see its REPEATABLE READ snapshot).
Twins waiting on a first caller that ends INSUFFICIENT can deadlock on
MariaDB: a retryable :class:`~stateguard.DeadlockDetected`.  The ledger's
statements, claims and the release algorithm are shared with striped counters
and live in :mod:`stateguard._ledger`.  See
``docs/explanation/schemes.md`` and ``docs/how-to/stock.md``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any, Literal

from sqlalchemy import Connection, Update, bindparam, func, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import QueryableAttribute

from . import _kernel
from ._async import dual
from ._ledger import LedgerTarget, Shortfall, ledger_claim, ledger_forget, ledger_release, reserve_all
from .exceptions import InvalidArgument
from .result import Outcome, Result
from .tables import DIGEST_PREFIX, MAX_REF, ROW_KEY_LENGTH, counter_ledger, row_key

__all__ = ["counter_ledger", "decrement", "increment", "release", "reserve"]


class _Counter:
    """What a guarded change of one column needs, computed once per column and bound kind."""

    __slots__ = ("attr", "bound_column", "changed", "column", "info", "integer", "model")

    def __init__(self, column: Any, bound: Any, role: str) -> None:
        if not isinstance(column, QueryableAttribute):
            raise InvalidArgument(f"column must be a mapped attribute such as Stock.amount, got {column!r}")
        model: type[Any] = column.class_  # type: ignore[assignment]
        info = _kernel.model_info(model)
        col = info.column_by_attr.get(column.key)
        if col is None:
            raise InvalidArgument(f"{model.__name__}.{column.key} is not a mapped column")
        try:
            python_type = col.type.python_type
        except NotImplementedError:  # pragma: no cover - exotic types
            python_type = object
        if python_type is bool or not issubclass(python_type, int | float | Decimal):
            raise InvalidArgument(f"{model.__name__}.{column.key} is not an integer or numeric column")
        if col is info.version_column or col.primary_key:
            raise InvalidArgument(f"{model.__name__}.{column.key} is the version or a key column")
        self.model = model
        self.info = info
        self.column = col
        self.attr = column.key
        self.integer = issubclass(python_type, int)
        self.bound_column = None
        if isinstance(bound, QueryableAttribute):
            bcol = info.column_by_attr.get(bound.key) if bound.class_ is model else None
            if bcol is None:
                raise InvalidArgument(
                    f"the {role} {bound!r} must be a number or a column of {model.__name__} (the same row)"
                )
            self.bound_column = bcol
        #: What a change leaves stale on a loaded instance: the column and the version.
        self.changed = (self.attr,) + ((info.version_attr,) if info.version_attr is not None else ())

    @property
    def name(self) -> str:
        return f"{self.model.__name__}.{self.attr}"


def _counter(column: Any, bound: Any, role: str) -> _Counter:
    if not isinstance(column, QueryableAttribute):
        return _Counter(column, bound, role)  # raises InvalidArgument
    bound_key = (bound.class_, bound.key) if isinstance(bound, QueryableAttribute) else None
    key = ("counter-column", column.class_, column.key, role, bound_key)
    found: _Counter | None = _kernel.memo.get(key)
    if found is None:
        found = _kernel.memo.put(key, _Counter(column, bound, role))
    return found


def _finite_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal):
        return False
    if isinstance(value, int):
        return True
    return value.is_finite() if isinstance(value, Decimal) else math.isfinite(value)


def _check_amount(counter: _Counter, by: Any) -> None:
    if not _finite_number(by) or not by > 0:
        raise InvalidArgument(f"by must be a positive number, got {by!r}")
    if counter.integer and not isinstance(by, int):
        # PostgreSQL would round 1.5 on assignment and SQLite would store a REAL
        # in the INTEGER column: neither is the change the caller asked for.
        raise InvalidArgument(f"{counter.name} is an integer column: by must be an int, got {by!r}")


def _check_bound(counter: _Counter, bound: Any, role: str) -> None:
    if bound is None or isinstance(bound, QueryableAttribute):
        return
    if not _finite_number(bound):
        raise InvalidArgument(
            f"the {role} must be a number, a column of {counter.model.__name__} or None, got {bound!r}"
        )
    if counter.integer and not isinstance(bound, int):
        raise InvalidArgument(
            f"{counter.name} is an integer column: the {role} must be an int, got {bound!r}"
        )


def _check_ref(ref: Any) -> None:
    if ref is not None and (not isinstance(ref, str) or not ref or len(ref) > MAX_REF):
        raise InvalidArgument(f"ref must be a non-empty string of at most {MAX_REF} characters, got {ref!r}")
    if ref is not None:
        _kernel.check_storable(ref, "ref")


def _room(limits: tuple[int, int] | None, sign: int, by: int) -> int | None:
    """The ``sg_room`` of a change of ``by``: the farthest amount it may start from (``None``: no guard).

    ``by`` fits the column (checked before), so this does too.
    """
    if limits is None:
        return None
    return limits[1] - by if sign > 0 else limits[0] + by


def _plan(
    counter: _Counter, backend: _kernel.Backend, sign: int, has_bound: bool, lid: bool, guard: bool = False
) -> Update:
    """The guarded UPDATE for one backend, direction, bound kind and value-return mode (cached).

    ``guard``: an integer column whose range is known gets ``amount <= :sg_room``
    (``>=`` for a decrement), ``sg_room`` being the column's largest (smallest)
    integer minus (plus) ``by``: the database then never computes a value the
    column cannot hold (PostgreSQL's "bigint out of range" aborts the
    transaction, MariaDB refuses it in strict mode, SQLite turns it into a
    REAL), and a change that would leave the range matches no row.  It comes
    before the bound's ``amount + :delta`` so that is not computed either.
    """
    cache_key = ("counter", counter, backend, sign, has_bound, lid, guard)
    found: Update | None = _kernel.memo.get(cache_key)
    if found is not None:
        return found
    info, col = counter.info, counter.column
    new_value = col + bindparam("sg_delta", type_=col.type)
    conditions = [info.pk_where]
    if guard:
        room = bindparam("sg_room", type_=col.type)
        conditions.append(col <= room if sign > 0 else col >= room)
    if has_bound:
        limit = (
            counter.bound_column
            if counter.bound_column is not None
            else bindparam("sg_bound", type_=col.type)
        )
        conditions.append(new_value >= limit if sign < 0 else new_value <= limit)
    pairs: list[tuple[Any, Any]] = [
        (col, func.last_insert_id(new_value, type_=col.type) if lid else new_value)
    ]
    if info.version_column is not None:
        # The row changed: an ORM holder of the old version must see it as stale.
        pairs.append((info.version_column, info.version_column + 1))
    stmt = update(info.table).where(*conditions).ordered_values(*pairs)
    if backend.returning:
        stmt = stmt.returning(col)
    return _kernel.memo.put(cache_key, stmt)


def _ledger_key(counter: _Counter, key: tuple[Any, ...]) -> str:
    """The ledger's ``row_key`` of ``key``, or InvalidArgument if only its digest fits the column.

    ``release`` reads the keys of a ref back from the ledger, which a digest
    cannot give; refused before any statement.
    """
    stored = row_key(_kernel.canonical_key(counter.info, key))
    if stored.startswith(DIGEST_PREFIX):
        raise InvalidArgument(
            f"{counter.model.__name__} key {_kernel.public_key(key)!r} is too long for a ref'd counter "
            f"change: the ledger stores keys of at most {ROW_KEY_LENGTH} characters as JSON; "
            f"use a shorter key or change it without ref="
        )
    return stored


def _target(counter: _Counter) -> LedgerTarget:
    return LedgerTarget(counter.info.table.fullname, counter.column.name, counter.name)


def _claim(
    conn: Connection, backend: _kernel.Backend, counter: _Counter, key: tuple[Any, ...], ref: str, delta: Any
) -> Any:
    """Insert the ledger row; its id, or ``None`` when this ref already applied the same delta."""
    return ledger_claim(
        conn, backend, _target(counter), _ledger_key(counter, key), _kernel.public_key(key), ref, delta
    )


def _apply(
    session: Session,
    conn: Connection,
    backend: _kernel.Backend,
    counter: _Counter,
    key: tuple[Any, ...],
    instance: Any,
    by: Any,
    sign: int,
    bound: Any,
    ref: str | None,
) -> Result:
    """Claim the ref (if any), run the guarded UPDATE, classify; input already checked."""
    info = counter.info
    delta = -by if sign < 0 else by
    public = _kernel.public_key(key)
    ledger_id = None
    if ref is not None:
        # The row's own spelling of a text key (MariaDB's case-insensitive collations).
        ledger_id = _claim(
            conn, backend, counter, _kernel.stored_key(conn, info, key) if info.text_key else key, ref, delta
        )
        if ledger_id is None:
            return Result(
                Outcome.REPEATED, model=counter.model, key=public, session=session, same_request=True
            )
    numeric_bound = bound is not None and counter.bound_column is None
    # MySQL's OK packet carries LAST_INSERT_ID(expr) as an unsigned integer, so
    # it can return the new value only when that is certainly a non-negative
    # integer: a decrement of an integer column with a number floor >= 0.
    lid = backend.last_insert_id and counter.integer and sign < 0 and numeric_bound and bound >= 0
    limits = _kernel.integer_limits(conn, counter.column)
    room = _room(limits, sign, by)
    stmt = _plan(counter, backend, sign, bound is not None, lid, room is not None)
    params = info.key_params(key)
    params["sg_delta"] = delta
    if numeric_bound:
        params["sg_bound"] = bound
    if room is not None:
        params["sg_room"] = room
    applied, returned = _kernel.run_guarded(
        conn, stmt, params, returning=backend.returning, last_insert_id=lid
    )
    value: Any = None if returned is None else returned[0]
    if applied:
        _kernel.sync_loaded(
            session, info, key, instance, {} if value is None else {counter.attr: value}, counter.changed
        )
        return Result(Outcome.APPLIED, model=counter.model, key=public, value=value, session=session)
    if ledger_id is not None:
        # Nothing changed: forget the claim, so the same ref can apply later.
        ledger_forget(conn, backend, ledger_id)
    # One read tells a missing row from a short one; on MariaDB a locking read,
    # which sees the latest committed row as the UPDATE did.
    read = _kernel.read_back(info, [counter.column], backend)
    row = _kernel.execute(conn, read, info.key_params(key)).first()
    if row is None:
        return Result(Outcome.NOT_FOUND, model=counter.model, key=public, session=session)
    if (
        bound is None
        and limits is not None
        and room is not None
        and (row[0] > room if sign > 0 else row[0] < room)
    ):
        # No bound to cross: the range guard stopped it.  (With a bound, which fits the
        # column, leaving the range crosses the bound first: INSUFFICIENT.)
        raise InvalidArgument(
            f"{'adding' if sign > 0 else 'taking'} {by} {'to' if sign > 0 else 'from'} {counter.name} "
            f"of {public!r} ({row[0]}) would exceed the column's range: on this database it holds "
            f"integers from {limits[0]} to {limits[1]}; nothing changed"
        )
    return Result(Outcome.INSUFFICIENT, model=counter.model, key=public, value=row[0], session=session)


def _change(
    session: Session,
    column: Any,
    target: Any,
    by: Any,
    sign: int,
    bound: Any,
    role: str,
    ref: str | None,
    durability: Literal["replicated", "local"] | None = None,
) -> Result:
    counter = _counter(column, bound, role)
    _check_amount(counter, by)
    _check_bound(counter, bound, role)
    _check_ref(ref)
    key, instance = _kernel.resolve_target(session, counter.info, target)
    if ref is not None:
        _ledger_key(counter, key)
    integers = [(counter.column, by, "by")]
    if counter.bound_column is None and bound is not None:
        integers.append((counter.column, bound, role))
    conn = _kernel.connection_for(session, counter.info, (key,), integers)
    # The engine's default durability guards counters with a ref only; the keyword, any change.
    if durability is not None or (ref is not None and _kernel.DURABLE):
        watch = _kernel.durable(session, conn, durability)
        if watch is not None:
            backend = _kernel.backend(conn.dialect)
            result = _apply(session, conn, backend, counter, key, instance, by, sign, bound, ref)
            watch.note(result)
            return result
    return _apply(session, conn, _kernel.backend(conn.dialect), counter, key, instance, by, sign, bound, ref)


@dual
def decrement(
    session: Session,
    column: Any,
    target: Any,
    *,
    by: int | float | Decimal = 1,
    floor: Any = 0,
    ref: str | None = None,
    durability: Literal["replicated", "local"] | None = None,
) -> Result:
    """Take ``by`` off a counter unless that would go below ``floor``: one UPDATE.

    ``column`` is a mapped integer or numeric attribute (``Stock.amount``),
    ``target`` a primary key or a loaded instance.  ``floor`` is a number,
    another column of the same row (``Stock.reserved``), or ``None``
    (unbounded).  Outcomes:

    - APPLIED: ``.value`` is the new amount when the backend reports it in
      the same round trip (PostgreSQL and SQLite always; MariaDB for an
      integer column with a number floor >= 0), else ``None``;
    - INSUFFICIENT: the floor would be crossed, nothing changed, ``.value``
      is the amount found;
    - NOT_FOUND: no such row;
    - with ``ref``: REPEATED when this ref already applied the same change
      (even if stock ran out since); :class:`~stateguard.RefConflict` when it
      applied a different ``by``.  An INSUFFICIENT call leaves no trace of
      its ref, so retrying it after a restock applies.

    ::

        r = decrement(session, Stock.amount, sku_id, by=2, ref="order-42")
        if r.outcome is Outcome.INSUFFICIENT:
            raise OutOfStock(sku_id, left=r.value)

    ``durability="replicated"``: the transaction commits only once a
    synchronous standby applied it, or its commit raises
    :class:`~stateguard.ReplicationTimeout`; an engine's
    :func:`~stateguard.set_durability` default applies to calls with a ``ref``.

    :raises InvalidArgument: bad column, ``by``, ``floor``, ``ref`` or target;
        nothing was sent to the database.
    :raises NotSupported: ``durability="replicated"`` on SQLite, MariaDB or
        a driver other than psycopg.
    :raises ConfigurationError: ``durability="replicated"`` with no
        synchronous standby; nothing was changed.
    """
    return _change(session, column, target, by, -1, floor, "floor", ref, durability)


@dual
def increment(
    session: Session,
    column: Any,
    target: Any,
    *,
    by: int | float | Decimal = 1,
    ceiling: Any = None,
    ref: str | None = None,
    durability: Literal["replicated", "local"] | None = None,
) -> Result:
    """Add ``by`` to a counter unless that would go above ``ceiling``: one UPDATE.

    The mirror of :func:`decrement`: ``ceiling`` is a number, another column
    of the same row, or ``None`` (unbounded, the default); the same outcomes
    and ``ref`` rules apply (INSUFFICIENT means the ceiling would be
    crossed).  ``.value`` is the new amount on PostgreSQL and SQLite and
    ``None`` on MariaDB::

        r = increment(session, Coupon.used, coupon_id, ceiling=Coupon.max_uses, ref=order_ref)
        if not r:
            r.raise_for_outcome()   # InsufficientQuantity: the coupon is used up

    ``durability`` as for :func:`decrement`.
    """
    return _change(session, column, target, by, 1, ceiling, "ceiling", ref, durability)


@dual
def reserve(
    session: Session,
    column: Any,
    amounts: Mapping[Any, Any],
    *,
    ref: str,
    durability: Literal["replicated", "local"] | None = None,
) -> Result:
    """Decrement several rows all-or-nothing (floor 0), idempotently per ``ref``.

    ``amounts`` maps targets (primary keys or instances) to positive amounts.
    Rows are changed in primary-key order whatever the mapping's order, so
    two reservations over the same items cannot deadlock.  Outcomes:

    - APPLIED: every row changed; ``.value`` maps each key to its new amount
      (``None`` where the backend does not report it), ``.key`` is ``ref``;
    - REPEATED: this ref already reserved exactly these rows;
    - INSUFFICIENT / NOT_FOUND: a target was short or missing; everything this
      call did was undone (a savepoint), ``.key`` is that target and
      ``.value`` the amount found.

    Reusing a ref for a different reservation (another amount, rows of
    which only some were reserved under it, or fewer rows than it reserved) raises
    :class:`~stateguard.RefConflict` and changes nothing::

        r = reserve(session, Stock.amount, {sku_a: 2, sku_b: 1}, ref="order-42")
        r.raise_for_outcome()     # InsufficientQuantity(.target, .value)

    ``durability`` as for :func:`decrement`.
    """
    counter = _counter(column, 0, "floor")
    if ref is None:
        raise InvalidArgument("reserve needs a ref (it is idempotent per ref)")
    _check_ref(ref)
    if not isinstance(amounts, Mapping) or not amounts:
        raise InvalidArgument("reserve needs a non-empty mapping of targets to amounts")
    resolved: dict[tuple[Any, ...], tuple[Any, Any]] = {}
    for target, by in amounts.items():
        _check_amount(counter, by)
        key, instance = _kernel.resolve_target(session, counter.info, target)
        if key in resolved:
            raise InvalidArgument(
                f"reserve got {counter.model.__name__} {_kernel.public_key(key)!r} twice; "
                f"give each row once with its total amount"
            )
        _ledger_key(counter, key)
        resolved[key] = (by, instance)
    amounts_checked = [(counter.column, by, "an amount") for by, _ in resolved.values()]
    conn = _kernel.connection_for(session, counter.info, list(resolved), amounts_checked)
    watch = _kernel.durable(session, conn, durability) if durability is not None or _kernel.DURABLE else None
    backend = _kernel.backend(conn.dialect)

    def apply(key: tuple[Any, ...]) -> Result:
        by, instance = resolved[key]
        return _apply(session, conn, backend, counter, key, instance, by, -1, 0, ref)

    done = reserve_all(
        conn, backend, _target(counter), ref, sorted(resolved, key=_kernel.key_order), apply,
        lambda key: _ledger_key(counter, key),
    )  # fmt: skip
    if isinstance(done, Result):
        return done if watch is None else watch.note(done)
    outcome = next(iter(done.values())).outcome
    values = {key: r.value for key, r in done.items()}
    result = Result(
        outcome,
        model=counter.model,
        key=ref,
        value=values,
        session=session,
        same_request=outcome is Outcome.REPEATED,
    )
    return result if watch is None else watch.note(result)


@dual
def release(
    session: Session, column: Any, ref: str, *, durability: Literal["replicated", "local"] | None = None
) -> Result:
    """Undo every change ``ref`` made to ``column`` (a cancelled order), exactly once.

    APPLIED the first time (``.value`` maps each key to the amount given
    back, the opposite of what the ref took), REPEATED after, NOT_FOUND for a
    ref that changed nothing.  Concurrent releases of the same ref serialise
    on its ledger rows, so exactly one gives anything back.  A released ref
    stays used: a later :func:`decrement` with it is REPEATED.

    Releasing an increment's ref takes its units back as a decrement would
    (floor 0): INSUFFICIENT when they are gone (sold since), with ``.key``
    the short row and ``.value`` its amount; then nothing changed and the
    ref is not released (release it after a restock)::

        if release(session, Stock.amount, "order-42"):
            notify_restock()

    ``durability`` as for :func:`decrement`.

    :raises InvalidArgument: a bad ref; or giving the units back would take
        an integer column past its range (the row was refilled to the top
        since): nothing was given back and the ref is not released, even if
        the caller commits.
    """
    counter = _counter(column, None, "floor")
    if ref is None:
        raise InvalidArgument("release needs a ref")
    _check_ref(ref)
    info = counter.info
    conn = _kernel.connection_for(session, info)
    watch = _kernel.durable(session, conn, durability) if durability is not None or _kernel.DURABLE else None
    backend = _kernel.backend(conn.dialect)
    limits = _kernel.integer_limits(conn, counter.column)

    def undo_entries(rows: Sequence[Any]) -> list[tuple[Any, Any]]:
        undo: list[tuple[tuple[Any, ...], Any]] = []
        for row in rows:
            delta = -Decimal(row.delta)
            key = _kernel.decode_key(info, json.loads(row.row_key))
            undo.append((key, int(delta) if counter.integer else delta))
        # The same row order as reserve() (keys, not their JSON text: 10 sorts after
        # 2), so a release and a reservation over the same rows cannot deadlock.
        undo.sort(key=lambda item: _kernel.key_order(item[0]))
        return undo

    def give_back(key: tuple[Any, ...], amount: Any) -> Shortfall | None:
        params = {**info.key_params(key), "sg_delta": amount}
        if amount >= 0:
            # Guarded by the column's range: the row may have been refilled to the top since the
            # ref took from it, and the database must not compute a value the column cannot hold.
            room = _room(limits, 1, amount)
            stmt = _plan(counter, backend, 1, False, False, room is not None)
            if room is not None:
                params["sg_room"] = room
            applied, _ = _kernel.run_guarded(conn, stmt, params, returning=backend.returning)
            if not applied and limits is not None:
                read = _kernel.read_back(info, [counter.column], backend)
                row = _kernel.execute(conn, read, info.key_params(key)).first()
                if row is not None:  # a missing row has nothing to give back to (as ever)
                    raise InvalidArgument(
                        f"releasing ref {ref!r} would add {amount} to {counter.name} of "
                        f"{_kernel.public_key(key)!r} ({row[0]}), past the column's range: on this database "
                        f"it holds integers from {limits[0]} to {limits[1]}; nothing was given back and "
                        f"the ref is not released (take units off the row, then release again)"
                    )
        else:
            # Taking an increment's units back: guarded by floor 0 as a decrement is (and by the
            # range, which only an amount below the floor can leave).
            room = _room(limits, -1, -amount)
            stmt = _plan(counter, backend, -1, True, False, room is not None)
            if room is not None:
                params["sg_room"] = room
            applied, _ = _kernel.run_guarded(
                conn, stmt, {**params, "sg_bound": 0}, returning=backend.returning
            )
            if not applied:
                read = _kernel.read_back(info, [counter.column], backend)
                row = _kernel.execute(conn, read, info.key_params(key)).first()
                if row is not None:
                    return Shortfall(_kernel.public_key(key), row[0])
        _kernel.sync_loaded(session, info, key, None, {}, counter.changed)
        return None

    found = ledger_release(conn, backend, _target(counter), ref, undo_entries, give_back)
    if isinstance(found, Outcome):
        same = found is Outcome.REPEATED
        result = Result(found, model=counter.model, key=ref, session=session, same_request=same)
    elif isinstance(found, Shortfall):
        result = Result(
            Outcome.INSUFFICIENT, model=counter.model, key=found.key, value=found.value, session=session
        )
    else:
        given_back = {_kernel.public_key(key): amount for key, amount in found}
        result = Result(Outcome.APPLIED, model=counter.model, key=ref, value=given_back, session=session)
    return result if watch is None else watch.note(result)
