"""Pure statement pieces every guarded write is built from: SET clauses with bound values
(:func:`set_clause`), the version increment, the fence condition, the read that sees what an
UPDATE just saw, the primary-key hint InnoDB needs and the insert that skips a taken key.

No I/O: :mod:`~stateguard._kernel.execute` runs what these build.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias, TypeVar

from sqlalchemy import ColumnElement, Select, Table, Update, bindparam, func, or_, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.schema import Column
from sqlalchemy.sql.elements import ClauseElement

from .backend import Backend
from .memo import memo
from .models import ModelInfo

__all__ = [
    "AnySelect",
    "by_primary_key",
    "fence_allows",
    "fence_condition",
    "insert_or_skip",
    "read_back",
    "read_statement",
    "set_clause",
    "value_params",
    "variant_key",
    "version_increment",
]

#: A SELECT of any columns (SQLAlchemy 2.1 types a Select by the tuple of its columns).
AnySelect: TypeAlias = "Select[*tuple[Any, ...]]"
#: A statement :func:`by_primary_key` holds to the primary key.
Keyed = TypeVar("Keyed", Select[Any], Update)


def set_clause(
    items: Iterable[tuple[str, Column[Any], Any]], *, embed: bool
) -> list[tuple[Column[Any], Any]]:
    """SET pairs: SQL expressions embedded, plain values as typed bind parameters."""
    pairs: list[tuple[Column[Any], Any]] = []
    for attr, col, value in items:
        if embed or isinstance(value, ClauseElement):
            pairs.append(
                (
                    col,
                    value
                    if isinstance(value, ClauseElement)
                    else bindparam(f"sg_v_{attr}", value, type_=col.type),
                )
            )
        else:
            pairs.append((col, bindparam(f"sg_v_{attr}", type_=col.type)))
    return pairs


def value_params(items: Iterable[tuple[str, Column[Any], Any]]) -> dict[str, Any]:
    return {f"sg_v_{attr}": value for attr, _, value in items if not isinstance(value, ClauseElement)}


def variant_key(items: tuple[tuple[str, Column[Any], Any], ...], has_sql: bool) -> tuple[Any, ...] | None:
    """Cache key for a statement variant, or ``None`` when it must not be cached.

    Plain values are bound, so only their names matter.  A SQL expression
    (``func.now()``) is embedded; it is cacheable when its SQLAlchemy cache
    key carries no bound literals of its own.
    """
    if not has_sql:
        return tuple(attr for attr, _, _ in items)
    parts: list[Any] = []
    for attr, _, value in items:
        if isinstance(value, ClauseElement):
            ck = value._generate_cache_key()
            if ck is None or ck.bindparams:
                return None
            parts.append((attr, ck.key))
        else:
            parts.append(attr)
    return tuple(parts)


def version_increment(col: Column[Any], backend: Backend) -> ColumnElement[Any]:
    """``version + 1``; on MySQL wrapped so the new value comes back in the OK packet."""
    expr: ColumnElement[Any] = col + 1
    if backend.last_insert_id:
        expr = func.last_insert_id(expr, type_=col.type)
    return expr


# --------------------------------------------------------------------------
# Fencing tokens
# --------------------------------------------------------------------------


def fence_condition(col: Column[Any], value: int | None = None) -> ColumnElement[bool]:
    """``fence IS NULL OR fence <= :fence``: only an older (or the same) holder's mark passes.

    Fencing tokens only grow and no two lock holders share one, so an equal
    token is the same holder writing again; an older one is a holder whose
    lock expired while it was paused.
    """
    return or_(col.is_(None), col <= bindparam("sg_fence", value, type_=col.type))


def fence_allows(found: Any, fence: int) -> bool:
    return found is None or found <= fence


# --------------------------------------------------------------------------
# Statements shared by the key tables
# --------------------------------------------------------------------------


def read_statement(info: ModelInfo, columns: Sequence[Column[Any]], backend: Backend) -> Select[Any]:
    """``SELECT columns WHERE pk`` that sees what an UPDATE just saw.

    On InnoDB a plain SELECT reads the REPEATABLE READ snapshot, which may
    predate the row the UPDATE found: the read is ``FOR UPDATE`` there.
    """
    stmt = select(*columns).where(info.pk_where)
    if backend.fresh_read_needs_lock:
        stmt = stmt.with_for_update()
    return stmt


def by_primary_key(stmt: Keyed, table: Table, backend: Backend) -> Keyed:
    """``stmt``, a SELECT or UPDATE of ``table``'s rows named by a list of primary keys, held to
    the primary key on InnoDB (``FORCE INDEX (PRIMARY)``); unchanged elsewhere.

    In REPEATABLE READ a locking read or an UPDATE locks every row its plan visits, matched or
    not, until COMMIT.  For an IN list naming a good share of a table MariaDB's optimizer picks a
    full index scan (EXPLAIN type ``index``: 7 keys of a 10-row table), which locks the rows
    between and around the keys as well, out of key order: a batch waited on rows it never
    named, and two overlapping batches deadlocked.  Forced onto the primary key the plan is
    one unique lookup per key (type ``range``), each locking its own record alone.
    """
    if not backend.locks_scanned_rows:
        return stmt
    if isinstance(stmt, Select):
        return stmt.with_hint(table, "FORCE INDEX (PRIMARY)", dialect_name=backend.name)
    return stmt.with_hint("FORCE INDEX (PRIMARY)", dialect_name=backend.name)


def read_back(info: ModelInfo, columns: Sequence[Column[Any]], backend: Backend) -> Select[Any]:
    """The memoised ``SELECT columns WHERE pk`` that sees what an UPDATE just saw (a 0-row follow-up)."""
    key = ("read", info, tuple(columns), backend.fresh_read_needs_lock)
    stmt: Select[Any] | None = memo.get(key)
    if stmt is None:
        stmt = memo.put(key, read_statement(info, columns, backend))
    return stmt


def insert_or_skip(backend: Backend, table: Table) -> postgresql.Insert | sqlite.Insert:
    """``INSERT ... ON CONFLICT DO NOTHING`` into ``table`` (PostgreSQL, SQLite: ``backend.on_conflict``);
    add ``.values()`` and ``.returning()``."""
    dialect_insert = sqlite.insert if backend.family == "sqlite" else postgresql.insert
    return dialect_insert(table).on_conflict_do_nothing()
