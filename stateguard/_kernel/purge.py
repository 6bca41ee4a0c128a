"""Expired rows of stateguard's key tables, deleted in batches on the database's clock.

One batched DELETE per call (:func:`purge_rows`), built once per table and
backend (:func:`purge_statement`): PostgreSQL skips rows a claimant holds
right now, MySQL/MariaDB take the batch size as a literal LIMIT, SQLite
picks its victims by rowid.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Delete,
    Engine,
    Table,
    bindparam,
    delete,
    literal_column,
    select,
    tuple_,
)
from sqlalchemy.orm import Session

from .backend import Backend
from .backend import backend as backend_of
from .checks import check_batch
from .clock import db_now_ms
from .execute import execute, own_connection
from .memo import memo

__all__ = ["purge_rows", "purge_statement"]


def purge_rows(
    table: Table,
    bind: Engine | Connection | Session,
    batch: Any,
    old: ColumnElement[bool] | None = None,
    **params: Any,
) -> int:
    """Delete at most ``batch`` rows of ``table`` matching ``old`` (default: ``expires_ms`` has
    passed); return how many.  ``params`` are the bound values ``old`` names.

    Ages are judged on the database's clock (:func:`~stateguard._kernel.clock.db_now_ms`),
    as they were stored.  With an Engine the batch runs in its own short
    transaction; with a Connection or Session in the caller's.  ``old`` is
    the same for every call on ``table`` (its statement is built once).
    """
    values = {"sg_batch": check_batch(batch), **params}
    if isinstance(bind, Engine):
        with bind.begin() as conn:
            return _purge(table, conn, values, old)
    return _purge(table, own_connection(bind, table) if isinstance(bind, Session) else bind, values, old)


def _purge(table: Table, conn: Connection, params: dict[str, Any], old: ColumnElement[bool] | None) -> int:
    backend = backend_of(conn.dialect)
    batch = params["sg_batch"]
    key = ("purge", table, backend, batch if backend.delete_limit_literal else 0)
    stmt = memo.get_or_build(key, lambda: purge_statement(table, backend, batch, old))
    return int(execute(conn, stmt, params).rowcount)


def purge_statement(
    table: Table, backend: Backend, batch: int, old: ColumnElement[bool] | None = None
) -> Delete:
    """The batched DELETE of ``table``'s rows matching ``old`` (default: ``expires_ms`` passed on the
    database's clock), at most ``:sg_batch`` of them (``batch`` itself on MySQL/MariaDB)."""
    expired = table.c.expires_ms <= db_now_ms() if old is None else old
    cols = list(table.primary_key.columns)
    pk: Any = tuple_(*cols) if len(cols) > 1 else cols[0]
    if backend.row_locks and not backend.delete_limit_literal:
        # PostgreSQL.  SKIP LOCKED: rows a claimant holds right now are left
        # for the next batch instead of making the purge wait behind it (and
        # making the claimant wait behind the purge).  The outer WHERE repeats
        # the expiry: a row updated meanwhile is re-checked before it is deleted.
        victims = (
            select(*table.primary_key.columns)
            .where(expired)
            .limit(bindparam("sg_batch"))
            .with_for_update(skip_locked=True)
        )
        return delete(table).where(expired, pk.in_(victims))
    if backend.delete_limit_literal:
        # MySQL/MariaDB: no LIMIT inside an IN subquery and no subquery on the
        # table being deleted from, but DELETE itself takes a LIMIT (a literal
        # in SQLAlchemy, hence one statement per batch size).
        return delete(table).where(expired).with_dialect_options(mysql_limit=batch, mariadb_limit=batch)
    rowid: Any = literal_column("rowid")
    victims = select(rowid).select_from(table).where(expired).limit(bindparam("sg_batch"))
    return delete(table).where(expired, rowid.in_(victims.scalar_subquery()))
