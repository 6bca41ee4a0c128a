"""Guarded counters: stock that never oversells and changes that never apply twice
(SCHEMES.md, scheme 3).

One statement decides::

    UPDATE stock SET amount = amount - :by [, version = version + 1]
    WHERE id = :id AND amount - :by >= :floor

It holds no lock across a read and needs no retry loop: under any number of
concurrent buyers the database serialises the row and each UPDATE re-checks
the bound against the latest amount.

With ``ref=`` the change is idempotent: a row ``(ref, table, key, column,
delta)`` goes into ``stateguard_counter_ledger`` in the same transaction, and
its unique key on ``(ref, table, key, column)`` decides whether this call is
the first.  The ledger row is inserted *before* the UPDATE, so a concurrent
twin with the same ref waits on the unique index and then sees REPEATED; an
INSUFFICIENT or NOT_FOUND call removes its ledger row again, so retrying the
same ref after a restock applies.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Integer,
    String,
    Table,
    UniqueConstraint,
    bindparam,
    delete,
    func,
    insert,
    select,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import QueryableAttribute

from . import _sql
from .exceptions import InvalidArgument, RefConflict
from .history import row_key
from .result import Outcome, Result
from .tables import metadata

__all__ = ["counter_ledger", "decrement", "increment", "release", "reserve"]

#: Longest ``ref`` accepted.
MAX_REF = 200

counter_ledger = Table(
    "stateguard_counter_ledger",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("ref", String(MAX_REF), nullable=False),
    Column("table_name", String(200), nullable=False),
    Column("row_key", String(255), nullable=False),
    Column("column_name", String(100), nullable=False),
    # The delta as exact decimal text: no float rounding on any backend.
    Column("delta", String(60), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()),
    Column("released_at", DateTime(timezone=True), nullable=True),
    UniqueConstraint("ref", "table_name", "row_key", "column_name", name="uq_stateguard_counter_ledger_ref"),
)

_MYSQL_DUPLICATE_KEY = 1062


class _Counter:
    """What a guarded change of one column needs, computed once per column and bound kind."""

    __slots__ = ("attr", "bound_column", "column", "info", "integer", "model", "plans")

    def __init__(self, column: Any, bound: Any, role: str) -> None:
        if not isinstance(column, QueryableAttribute):
            raise InvalidArgument(f"column must be a mapped attribute such as Stock.amount, got {column!r}")
        model: type[Any] = column.class_  # type: ignore[assignment]
        info = _sql.model_info(model)
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
        self.plans: dict[Any, Any] = {}


_counters: dict[tuple[Any, ...], _Counter] = {}


def _counter(column: Any, bound: Any, role: str) -> _Counter:
    if not isinstance(column, QueryableAttribute):
        return _Counter(column, bound, role)  # raises InvalidArgument
    bound_key = (bound.class_, bound.key) if isinstance(bound, QueryableAttribute) else None
    key = (column.class_, column.key, role, bound_key)
    found = _counters.get(key)
    if found is None:
        found = _counters[key] = _Counter(column, bound, role)
    return found


def _check_amount(by: Any, name: str = "by") -> None:
    if isinstance(by, bool) or not isinstance(by, int | float | Decimal) or not by > 0:
        raise InvalidArgument(f"{name} must be a positive number, got {by!r}")


def _check_bound(bound: Any, role: str) -> None:
    if bound is None or isinstance(bound, QueryableAttribute):
        return
    if isinstance(bound, bool) or not isinstance(bound, int | float | Decimal):
        raise InvalidArgument(
            f"the {role} must be a number, a column of the same model or None, got {bound!r}"
        )


def _check_ref(ref: Any) -> None:
    if ref is not None and (not isinstance(ref, str) or not ref or len(ref) > MAX_REF):
        raise InvalidArgument(f"ref must be a non-empty string of at most {MAX_REF} characters, got {ref!r}")


def _plan(counter: _Counter, backend: _sql.Backend, sign: int, has_bound: bool) -> tuple[Any, bool]:
    """``(UPDATE statement, uses LAST_INSERT_ID)`` for one backend and bound kind."""
    cache_key = (backend, sign, has_bound)
    found = counter.plans.get(cache_key)
    if found is not None:
        return found  # type: ignore[no-any-return]
    info, col = counter.info, counter.column
    new_value = col + bindparam("sg_delta", type_=col.type)
    conditions = [info.pk_where]
    if has_bound:
        limit = (
            counter.bound_column
            if counter.bound_column is not None
            else bindparam("sg_bound", type_=col.type)
        )
        conditions.append(new_value >= limit if sign < 0 else new_value <= limit)
    # MySQL's OK packet can carry the new value (LAST_INSERT_ID(expr)) only when
    # it is a non-negative integer: a decrement with a numeric floor >= 0.
    lid = (
        backend.last_insert_id and counter.integer and sign < 0 and has_bound and counter.bound_column is None
    )
    pairs: list[tuple[Any, Any]] = [
        (col, func.last_insert_id(new_value, type_=col.type) if lid else new_value)
    ]
    if info.version_column is not None:
        pairs.append((info.version_column, info.version_column + 1))
    stmt = update(info.table).where(*conditions).ordered_values(*pairs)
    if backend.returning:
        stmt = stmt.returning(col)
    counter.plans[cache_key] = (stmt, lid)
    return stmt, lid


def _change(
    session: Session,
    column: Any,
    target: Any,
    by: Any,
    sign: int,
    bound: Any,
    role: str,
    ref: str | None,
) -> Result:
    _check_amount(by)
    _check_bound(bound, role)
    _check_ref(ref)
    counter = _counter(column, bound, role)
    if isinstance(bound, QueryableAttribute) and counter.bound_column is None:  # pragma: no cover
        raise InvalidArgument(f"the {role} must be a column of {counter.model.__name__}")
    info = counter.info
    key, instance = _sql.resolve_target(session, info, target)
    if session.autoflush:
        session.flush()
    conn = session.connection(bind_arguments={"mapper": info.mapper})
    backend = _sql.backend(conn.dialect)
    delta = by * sign
    public = _sql.public_key(key)
    ledger_id = None
    if ref is not None:
        ledger_id = _claim(conn, backend, counter, key, ref, delta)
        if ledger_id is None:
            return Result(Outcome.REPEATED, model=counter.model, key=public, session=session)
    stmt, lid = _plan(counter, backend, sign, bound is not None)
    params = info.key_params(key)
    params["sg_delta"] = delta
    if bound is not None and counter.bound_column is None:
        params["sg_bound"] = bound
    result = _sql.execute(conn, stmt, params)
    value: Any = None
    if backend.returning:
        row = result.first()
        applied = row is not None
        if row is not None:
            value = row[0]
    else:
        applied = result.rowcount == 1
        if applied and lid:
            value = result.lastrowid
    if applied:
        if instance is None:
            instance = _sql.identity_instance(session, info, key)
        if instance is not None:
            committed = {} if value is None else {counter.attr: value}
            expire = [counter.attr]
            if info.version_attr is not None:
                expire.append(info.version_attr)
            _sql.sync_instance(session, instance, committed, expire)
        return Result(Outcome.APPLIED, model=counter.model, key=public, value=value, session=session)
    if ledger_id is not None:
        # Nothing changed: forget the claim, so the same ref can apply later.
        _sql.execute(conn, delete(counter_ledger).where(counter_ledger.c.id == ledger_id))
    row = _sql.execute(conn, info.read([counter.column], backend), info.key_params(key)).first()
    if row is None:
        return Result(Outcome.NOT_FOUND, model=counter.model, key=public, session=session)
    return Result(Outcome.INSUFFICIENT, model=counter.model, key=public, value=row[0], session=session)


def _claim(
    conn: Any, backend: _sql.Backend, counter: _Counter, key: tuple[Any, ...], ref: str, delta: Any
) -> Any:
    """Insert the ledger row; its id, or ``None`` when this ref already applied the same delta."""
    values = {
        "ref": ref,
        "table_name": counter.info.table.fullname,
        "row_key": row_key(key),
        "column_name": counter.column.name,
        "delta": str(delta),
    }
    if backend.on_conflict:
        dialect_insert = postgresql.insert if backend.name == "postgresql" else sqlite.insert
        stmt = (
            dialect_insert(counter_ledger)
            .values(values)
            .on_conflict_do_nothing()
            .returning(counter_ledger.c.id)
        )
        row = _sql.execute(conn, stmt).first()
        if row is not None:
            return row[0]
    else:
        _sql.ensure_real_transaction(conn)
        savepoint = conn.begin_nested()
        try:
            result = _sql.execute(conn, insert(counter_ledger).values(values))
        except sa_exc.IntegrityError as error:
            savepoint.rollback()
            if getattr(error.orig, "args", (None,))[0] != _MYSQL_DUPLICATE_KEY:
                raise
        else:
            savepoint.commit()
            return result.inserted_primary_key[0]  # type: ignore[index]
    existing = _sql.execute(
        conn,
        select(counter_ledger.c.delta).where(
            counter_ledger.c.ref == ref,
            counter_ledger.c.table_name == values["table_name"],
            counter_ledger.c.row_key == values["row_key"],
            counter_ledger.c.column_name == values["column_name"],
        ),
    ).scalar_one()
    if Decimal(existing) != Decimal(delta):
        raise RefConflict(
            f"ref {ref!r} already changed {counter.model.__name__}.{counter.attr} of "
            f"{_sql.public_key(key)!r} by {Decimal(existing).normalize()}, not {delta}; "
            f"use a new ref for a different change"
        )
    return None


def decrement(
    session: Session,
    column: Any,
    target: Any,
    *,
    by: int | float | Decimal = 1,
    floor: Any = 0,
    ref: str | None = None,
) -> Result:
    """Take ``by`` off a counter unless that would go below ``floor``: one UPDATE.

    ``floor`` is a number, another column of the same row, or ``None``
    (unbounded).  APPLIED (``.value`` is the new amount when the backend can
    say it in the same round trip), INSUFFICIENT (``.value`` is the amount
    found; nothing changed), NOT_FOUND, and with ``ref`` REPEATED::

        r = decrement(session, Stock.amount, sku_id, by=2, ref="order-42")
        if r.outcome is Outcome.INSUFFICIENT:
            raise OutOfStock(sku_id)
    """
    return _change(session, column, target, by, -1, floor, "floor", ref)


def increment(
    session: Session,
    column: Any,
    target: Any,
    *,
    by: int | float | Decimal = 1,
    ceiling: Any = None,
    ref: str | None = None,
) -> Result:
    """Add ``by`` to a counter unless that would go above ``ceiling``: one UPDATE.

    ::

        r = increment(session, Coupon.used, coupon_id, ceiling=Coupon.max_uses, ref=order_ref)
    """
    return _change(session, column, target, by, 1, ceiling, "ceiling", ref)


def reserve(session: Session, column: Any, amounts: Mapping[Any, Any], *, ref: str) -> Result:
    """Decrement several rows all-or-nothing (floor 0), idempotently per ``ref``.

    Rows are changed in primary-key order, so two reservations over the same
    items cannot deadlock.  If one target is short, everything is undone (a
    savepoint) and the result is INSUFFICIENT with ``.key`` the short target::

        r = reserve(session, Stock.amount, {sku_a: 2, sku_b: 1}, ref="order-42")
        r.raise_for_outcome()     # InsufficientQuantity(.target, .value)
    """
    if not isinstance(amounts, Mapping) or not amounts:
        raise InvalidArgument("reserve needs a non-empty mapping of targets to amounts")
    if ref is None:
        raise InvalidArgument("reserve needs a ref (it is idempotent per ref)")
    _check_ref(ref)
    counter = _counter(column, 0, "floor")
    resolved = []
    for target, by in amounts.items():
        _check_amount(by)
        key, _ = _sql.resolve_target(session, counter.info, target)
        resolved.append((key, by))
    resolved.sort(key=lambda kb: kb[0])
    if session.autoflush:
        session.flush()
    conn = session.connection(bind_arguments={"mapper": counter.info.mapper})
    _sql.ensure_real_transaction(conn)
    savepoint = conn.begin_nested()
    values: dict[Any, Any] = {}
    outcomes = set()
    try:
        for key, by in resolved:
            r = _change(session, column, key if len(key) > 1 else key[0], by, -1, 0, "floor", ref)
            if r.outcome in (Outcome.INSUFFICIENT, Outcome.NOT_FOUND):
                savepoint.rollback()
                return r
            values[r.key] = r.value
            outcomes.add(r.outcome)
    except BaseException:
        if savepoint.is_active:
            savepoint.rollback()
        raise
    savepoint.commit()
    outcome = Outcome.APPLIED if Outcome.APPLIED in outcomes else Outcome.REPEATED
    return Result(outcome, model=counter.model, key=ref, value=values, session=session)


def release(session: Session, column: Any, ref: str) -> Result:
    """Undo every change ``ref`` made to ``column`` (a cancelled order), exactly once.

    APPLIED the first time (``.value`` maps each key to the amount given
    back), REPEATED after, NOT_FOUND for a ref that changed nothing::

        release(session, Stock.amount, "order-42")
    """
    _check_ref(ref)
    if ref is None:
        raise InvalidArgument("release needs a ref")
    counter = _counter(column, None, "floor")
    info = counter.info
    if session.autoflush:
        session.flush()
    conn = session.connection(bind_arguments={"mapper": info.mapper})
    ledger = counter_ledger
    mine = (
        ledger.c.ref == ref,
        ledger.c.table_name == info.table.fullname,
        ledger.c.column_name == counter.column.name,
    )
    # Lock this ref's ledger rows, then mark the unreleased ones released: a
    # concurrent release of the same ref waits here and then finds none left.
    _sql.sqlite_write_lock(conn)
    rows = _sql.execute(
        conn,
        select(ledger.c.id, ledger.c.row_key, ledger.c.delta, ledger.c.released_at)
        .where(*mine)
        .order_by(ledger.c.row_key)
        .with_for_update(),
    ).all()
    if not rows:
        return Result(Outcome.NOT_FOUND, model=counter.model, key=ref, session=session)
    claimed = _sql.execute(
        conn,
        update(ledger)
        .where(*mine, ledger.c.released_at.is_(None))
        .values(released_at=func.current_timestamp()),
    ).rowcount
    if not claimed:
        return Result(Outcome.REPEATED, model=counter.model, key=ref, session=session)
    given_back: dict[Any, Any] = {}
    for row in rows:
        if row.released_at is not None:
            continue
        raw_key = json.loads(row.row_key)
        key = tuple(raw_key) if isinstance(raw_key, list) else (raw_key,)
        amount = -Decimal(row.delta)
        by: Any = int(amount) if counter.integer else amount
        stmt = (
            update(info.table)
            .where(info.pk_where)
            .values({counter.column: counter.column + bindparam("sg_delta", type_=counter.column.type)})
        )
        _sql.execute(conn, stmt, {**info.key_params(key), "sg_delta": by})
        given_back[_sql.public_key(key)] = by
        instance = _sql.identity_instance(session, info, key)
        if instance is not None:
            _sql.sync_instance(session, instance, {}, [counter.attr])
    return Result(Outcome.APPLIED, model=counter.model, key=ref, value=given_back, session=session)
