"""The two clocks stateguard reads: the database's, inside the deciding statement
(:func:`db_now_ms`, compiled per dialect), and the application's (:func:`now_ms`).

Every lease and expiry is judged, and stored, on the database's clock, so
application servers whose clocks disagree cannot take over live claims or
expire live tokens; the application's clock serves only what never leaves
the process (a Snowflake's timestamp, a local deadline).
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql import sqltypes
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.functions import FunctionElement

__all__ = ["db_now_ms", "now_ms"]


class _DbNowMs(FunctionElement[int]):
    """The database server's clock as integer epoch milliseconds, compiled per dialect (:func:`db_now_ms`)."""

    type = sqltypes.BigInteger()
    name = "sg_db_now_ms"
    inherit_cache = True


@compiles(_DbNowMs, "postgresql")
@compiles(_DbNowMs, "cockroachdb")
def _db_now_postgresql(element: Any, compiler: Any, **kw: Any) -> str:
    # statement_timestamp(), not now(): now() is the start of the transaction,
    # so inside a long transaction every lease written would end early and
    # every expiry be judged late.  One value for the whole statement.
    return "CAST(floor(extract(epoch FROM statement_timestamp()) * 1000) AS BIGINT)"


@compiles(_DbNowMs, "mysql")
@compiles(_DbNowMs, "mariadb")
def _db_now_mysql(element: Any, compiler: Any, **kw: Any) -> str:
    # UTC_TIMESTAMP(6) is the statement's start (like NOW(), not SYSDATE()) and
    # needs no time-zone conversion: UNIX_TIMESTAMP(NOW(3)) converts through the
    # session's time_zone and is ambiguous in the hour a DST change repeats.
    return "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)"


@compiles(_DbNowMs, "sqlite")
def _db_now_sqlite(element: Any, compiler: Any, **kw: Any) -> str:
    # SQLite's 'now' is the same for every use within one sqlite3_step() and
    # kept in whole milliseconds; round() absorbs the Julian-day float error.
    return "CAST(round((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)"


@compiles(_DbNowMs)
def _db_now_other(element: Any, compiler: Any, **kw: Any) -> str:
    raise sa_exc.CompileError(
        f"stateguard does not know the clock of dialect {compiler.dialect.name!r}; "
        f"it supports PostgreSQL, MariaDB/MySQL and SQLite"
    )


def db_now_ms() -> ColumnElement[int]:
    """The database's clock in integer epoch milliseconds, as a SQL expression.

    Every lease and expiry stateguard decides is judged, and stored, on this
    clock inside the deciding statement, never on the application's: an app
    server whose clock runs ahead (or behind) must not take over live claims
    or expire live tokens.  One value per statement on every backend (the
    statement's start), so a lease written late in a long transaction is not
    shorter than asked for.
    """
    return _DbNowMs()


def now_ms() -> int:
    """The application's clock in integer epoch milliseconds."""
    return time.time_ns() // 1_000_000
