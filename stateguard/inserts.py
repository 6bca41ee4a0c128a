"""Insert-once: let a unique key decide the first insert (SCHEMES.md, scheme 4).

PostgreSQL and SQLite use ``INSERT ... ON CONFLICT DO NOTHING RETURNING pk``:
one statement, and the returned row (not the row count, which psycopg reports
as -1 for a skipped insert with RETURNING) says whether it was inserted.

MySQL/MariaDB have no exact single-statement form: ``INSERT IGNORE`` also
turns strict-mode errors into warnings (a too-long key is truncated and may
then look like a duplicate of another key), and because SQLAlchemy's MySQL
dialects always set the found-rows client flag, ``ON DUPLICATE KEY UPDATE
pk = pk`` reports 1 for both outcomes.  There a plain INSERT runs and only a
duplicate-key error (1062) means REPEATED; every other error propagates.
InnoDB rolls back just the failing statement, so the surrounding transaction
stays usable either way, with no SAVEPOINT round trips.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy import insert
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from . import _sql
from ._async import dual
from .exceptions import InvalidArgument
from .result import Outcome, Result

__all__ = ["insert_once"]

_MYSQL_DUPLICATE_KEY = 1062

_plans: dict[Any, Any] = {}


def _build(info: _sql.ModelInfo, backend: _sql.Backend, items: tuple[tuple[str, Any, Any], ...]) -> Any:
    pairs = dict(_sql.set_clause(items, embed=False))
    if backend.name == "postgresql":
        return (
            postgresql.insert(info.table).values(pairs).on_conflict_do_nothing().returning(*info.pk_columns)
        )
    if backend.name == "sqlite":
        return sqlite.insert(info.table).values(pairs).on_conflict_do_nothing().returning(*info.pk_columns)
    return insert(info.table).values(pairs)


@dual
def insert_once(session: Session, model: type[Any], values: Mapping[str, Any]) -> Result:
    """Insert a row unless a row with the same unique key exists.

    APPLIED (``.key`` is the new primary key) when this call inserted it,
    REPEATED when a unique constraint already held that key; the session's
    transaction stays usable in both cases::

        r = insert_once(session, ProcessedMessage, {"message_id": msg.id})
        if r.applied:
            handle(msg)             # once per message, however often redelivered
    """
    if not isinstance(values, Mapping) or not values:
        raise InvalidArgument("insert_once needs a non-empty mapping of attribute names to values")
    info = _sql.model_info(model)
    items: list[tuple[str, Any, Any]] = []
    for attr in sorted(values):
        if not isinstance(attr, str):
            raise InvalidArgument(f"values keys must be attribute names (str), got {attr!r}")
        items.append((attr, info.column(attr, role="a values entry"), values[attr]))
    frozen = tuple(items)
    has_sql = any(isinstance(v, _sql.ClauseElement) for _, _, v in frozen)
    if session.autoflush:
        session.flush()
    conn = session.connection(bind_arguments={"mapper": info.mapper})
    backend = _sql.backend(conn.dialect)
    variant = _sql.variant_key(frozen, has_sql)
    cache_key = (model, conn.dialect, variant)
    stmt = _plans.get(cache_key) if variant is not None else None
    if stmt is None:
        stmt = _build(info, backend, frozen)
        if variant is not None and len(_plans) < _sql.MAX_CACHED_VARIANTS * 4:
            _plans[cache_key] = stmt
    params = _sql.value_params(frozen)
    given_key = tuple(values.get(info.attr_by_column[c]) for c in info.pk_columns)
    known_key = None if any(k is None for k in given_key) else _sql.public_key(given_key)
    if backend.on_conflict:
        row = _sql.execute(conn, stmt, params).first()
        if row is None:
            return Result(Outcome.REPEATED, model=model, key=known_key, session=session)
        return Result(Outcome.APPLIED, model=model, key=_sql.public_key(tuple(row)), session=session)
    try:
        result = _sql.execute(conn, stmt, params)
    except sa_exc.IntegrityError as error:
        # InnoDB rolled back only this statement: the transaction stays usable.
        args = getattr(error.orig, "args", ())
        if args and args[0] == _MYSQL_DUPLICATE_KEY:
            return Result(Outcome.REPEATED, model=model, key=known_key, session=session)
        raise
    inserted = result.inserted_primary_key
    key = _sql.public_key(tuple(inserted)) if inserted is not None else known_key
    return Result(Outcome.APPLIED, model=model, key=key, session=session)
