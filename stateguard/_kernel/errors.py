"""Driver errors mapped to stateguard's typed errors, by the drivers' own codes.

psycopg's ``sqlstate``, PyMySQL/mysqlclient's ``args[0]`` error number and
sqlite3's ``sqlite_errorcode`` (Python 3.11+) decide, through SQLAlchemy's
wrapping (``DBAPIError.orig``), never the message text (SQLite's missing
table, which has no code of its own, is the one exception).  Every statement
stateguard runs goes through :func:`~stateguard._kernel.execute.execute`,
which raises what these functions return.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import exc as sa_exc

from ..exceptions import (
    ConfigurationError,
    DeadlockDetected,
    LockNotAcquired,
    SerializationConflict,
    StateguardError,
    TransactionAborted,
)

__all__ = [
    "aborted_transaction",
    "classify_db_error",
    "conflict_error",
    "is_duplicate_key",
    "missing_own_table",
    "out_of_range",
]

_PG_SERIALIZATION = "40001"
_PG_DEADLOCK = "40P01"
_PG_LOCK_NOT_AVAILABLE = "55P03"  # NOWAIT, lock_timeout
_MYSQL_LOCK_WAIT_TIMEOUT = 1205  # also what MariaDB's NOWAIT / WAIT n report
_MYSQL_NOWAIT = 3572  # MySQL 8's ER_LOCK_NOWAIT
_MYSQL_DEADLOCK = 1213
_MYSQL_RECORD_CHANGED = 1020  # innodb_snapshot_isolation=ON at REPEATABLE READ
_SQLITE_BUSY = 5  # primary result code; BUSY_SNAPSHOT is 517 (5 | 2 << 8)
_MYSQL_DUPLICATE_KEY = 1062
_MYSQL_NO_SUCH_TABLE = 1146
_PG_UNDEFINED_TABLE = "42P01"
_PG_OUT_OF_RANGE = "22003"  # numeric_value_out_of_range
_PG_IN_FAILED_TRANSACTION = "25P02"  # in_failed_sql_transaction: an earlier statement failed
_MYSQL_OUT_OF_RANGE = frozenset({1264, 1690})  # out of range value for column / in an expression
_MYSQL_DRIVERS = ("pymysql", "MySQLdb", "mysql", "mariadb", "asyncmy", "aiomysql")


def _mysql_errno(orig: Any) -> int | None:
    """The MySQL/MariaDB error number of a driver exception, or ``None`` for other drivers."""
    args = getattr(orig, "args", ())
    if args and isinstance(args[0], int) and type(orig).__module__.startswith(_MYSQL_DRIVERS):
        return args[0]
    return None


def is_duplicate_key(error: sa_exc.DBAPIError) -> bool:
    """Whether ``error`` is MySQL/MariaDB's duplicate-key error (1062) and nothing else."""
    return _mysql_errno(error.orig) == _MYSQL_DUPLICATE_KEY


def classify_db_error(error: BaseException) -> type[StateguardError] | None:
    """Which retryable conflict a driver error is, if any.

    Works through SQLAlchemy's wrapping (``DBAPIError.orig``) with the
    drivers' own codes, never by matching message text: psycopg's
    ``sqlstate``, PyMySQL/mysqlclient's ``args[0]`` error number, and
    sqlite3's ``sqlite_errorcode`` (Python 3.11+).
    """
    orig = error.orig if isinstance(error, sa_exc.DBAPIError) else error
    if orig is None:
        return None
    errno = _mysql_errno(orig)
    if errno is not None:
        # MySQL drivers: the error number is exact (SQLSTATE 40001 covers both
        # deadlocks and other rollbacks there), so it is checked first.
        if errno == _MYSQL_DEADLOCK:
            return DeadlockDetected
        if errno == _MYSQL_RECORD_CHANGED:
            return SerializationConflict
        if errno in (_MYSQL_LOCK_WAIT_TIMEOUT, _MYSQL_NOWAIT):
            return LockNotAcquired
        return None
    code = getattr(orig, "sqlite_errorcode", None)
    if isinstance(code, int):
        # SQLITE_BUSY (a writer held the lock past the busy timeout) and
        # SQLITE_BUSY_SNAPSHOT (a deferred read transaction could not be
        # upgraded to a write because another connection committed since).
        return SerializationConflict if code & 0xFF == _SQLITE_BUSY else None
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if sqlstate == _PG_DEADLOCK:
        return DeadlockDetected
    if sqlstate == _PG_SERIALIZATION:
        return SerializationConflict
    if sqlstate == _PG_LOCK_NOT_AVAILABLE:
        return LockNotAcquired
    return None


def conflict_error(error: sa_exc.DBAPIError) -> StateguardError | None:
    """The typed error for a driver error that says the transaction cannot go on, or ``None``.

    A retryable conflict (:func:`classify_db_error`), or a transaction an
    earlier failed statement aborted (:func:`aborted_transaction`): both mean
    "roll back first", and every caller that maps driver errors asks this.
    """
    kind = classify_db_error(error)
    if kind is None:
        return aborted_transaction(error)
    if kind is LockNotAcquired:
        return kind(
            f"a lock is held by another transaction ({error.orig!r}); roll the transaction back "
            f"and retry later (retry_on_conflict() does this)"
        )
    what = "a deadlock" if kind is DeadlockDetected else "a serialization conflict"
    return kind(
        f"the database aborted the statement because of {what} ({error.orig!r}); "
        f"roll the transaction back and run the unit of work again "
        f"(retry_on_conflict() does this)"
    )


def out_of_range(error: sa_exc.DBAPIError) -> StateguardError | None:
    """A ConfigurationError when the database refused a value a stateguard statement computed.

    Every value a call passes is checked against its column before it is sent,
    and counters guard their amounts in SQL, so what is left is ``version =
    version + 1`` on a row whose version is at its column type's maximum
    (PostgreSQL 22003, MySQL/MariaDB 1264 and 1690).
    """
    orig = error.orig
    if orig is None:
        return None
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if sqlstate != _PG_OUT_OF_RANGE and _mysql_errno(orig) not in _MYSQL_OUT_OF_RANGE:
        return None
    return ConfigurationError(
        f"the database refused a value this statement computed ({str(orig).splitlines()[0]}): most "
        f"likely a version column at its type's maximum (version_column() is INTEGER: 2,147,483,647 "
        f"writes of one row).  Roll the transaction back, then widen the column to BIGINT "
        f"(version_column(type_=BigInteger), and ALTER the table); nothing was written"
    )


def aborted_transaction(error: sa_exc.DBAPIError) -> StateguardError | None:
    """A TransactionAborted when the database refused the statement because an earlier one failed.

    PostgreSQL (and CockroachDB) ignore every command of a transaction after
    a failed statement until it ends, with SQLSTATE 25P02 (psycopg's
    ``InFailedSqlTransaction``, asyncpg's ``InFailedSQLTransactionError``).
    MySQL/MariaDB and SQLite go on after a failed statement, so they never
    report this.
    """
    orig = error.orig
    if orig is None:
        return None
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if sqlstate != _PG_IN_FAILED_TRANSACTION:
        return None
    return TransactionAborted(
        f"the transaction is aborted: an earlier statement in it failed, and the database ignores "
        f"every statement until the transaction ends ({type(orig).__name__}: "
        f"{str(orig).splitlines()[0] if str(orig) else 'in_failed_sql_transaction'}).  Roll it back "
        f"first (session.rollback(), or let its `with session.begin():` block end) and run the unit of "
        f"work again; the earlier error is the real one.  Nothing was written by this call.  A "
        f"statement that may fail without ending the transaction belongs in session.begin_nested()"
    )


def missing_own_table(error: sa_exc.DBAPIError) -> StateguardError | None:
    """A ConfigurationError when ``error`` says one of stateguard's own tables does not exist.

    By code on PostgreSQL (42P01) and MySQL/MariaDB (1146); SQLite has no
    code for it (SQLITE_ERROR), so there its message ``no such table`` is
    read.  Only tables named ``stateguard_*`` count: a user's missing table
    stays the driver's error.
    """
    orig = error.orig
    if orig is None:
        return None
    message = str(orig)
    if "stateguard_" not in message:
        return None
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    missing = (
        sqlstate == _PG_UNDEFINED_TABLE
        or _mysql_errno(orig) == _MYSQL_NO_SUCH_TABLE
        or (type(orig).__module__.startswith("sqlite3") and message.startswith("no such table"))
    )
    if not missing:
        return None
    return ConfigurationError(
        f"stateguard's tables are missing from this database ({message.splitlines()[0]}); create them "
        f"with `alembic upgrade stateguard@head` (see stateguard.migrations_location()) or "
        f"stateguard.create_tables(engine)"
    )
