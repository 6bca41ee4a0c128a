"""What every guarded write is built from: dialect capabilities, driver-error
mapping by code, what a mapped class looks like (:class:`ModelInfo`), and
pure statement pieces (SET clauses, bound key and value parameters, fence
conditions).

No I/O: statements run through :mod:`stateguard._write`, the kernel.  Every
dialect difference is a :class:`Backend` flag computed here.
"""

from __future__ import annotations

import datetime
import enum
import threading
import uuid
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Final

from sqlalchemy import (
    ColumnElement,
    Select,
    Table,
    and_,
    bindparam,
    delete,
    func,
    inspect,
    literal_column,
    or_,
    select,
    tuple_,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Mapper
from sqlalchemy.schema import Column
from sqlalchemy.sql import sqltypes
from sqlalchemy.sql.elements import ClauseElement
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.types import TypeDecorator

from .exceptions import (
    ConfigurationError,
    DeadlockDetected,
    InvalidArgument,
    LockNotAcquired,
    SerializationConflict,
    StateguardError,
    TransactionAborted,
)

__all__ = [
    "POSTGRESQL_FAMILY",
    "Backend",
    "ClauseElement",
    "ModelInfo",
    "aborted_transaction",
    "backend",
    "bindparam",
    "by_primary_key",
    "canonical_key",
    "classify_db_error",
    "conflict_error",
    "db_now_ms",
    "decode_key",
    "inexact_text_key",
    "integer_bounds",
    "is_duplicate_key",
    "key_order",
    "missing_own_table",
    "model_info",
    "numeric_digits",
    "purge_statement",
    "read_statement",
    "row_lock_minimums",
]

#: Marker stored in ``Column.info`` by :func:`stateguard.version_column`.
INFO_KEY: Final = "stateguard"

# --------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class Backend:
    """What stateguard needs to know about one dialect: capability flags, not dialect names.

    ``returning``: ``UPDATE ... RETURNING`` works (PostgreSQL, SQLite >= 3.35).
    ``last_insert_id``: MySQL/MariaDB, where ``SET v = LAST_INSERT_ID(v + 1)``
    hands the new value back in the OK packet (``cursor.lastrowid``) without
    another round trip.
    ``locking_read``: a plain SELECT inside a REPEATABLE READ transaction
    reads the transaction's old snapshot (InnoDB), while UPDATE reads the
    latest committed row; the follow-up read must be ``FOR UPDATE`` to see
    what the UPDATE saw.
    ``on_conflict``: ``INSERT ... ON CONFLICT DO NOTHING`` exists.
    ``row_locks``: ``SELECT ... FOR UPDATE`` exists (SQLite has one writer instead).
    ``driver_begins_lazily``: Python's sqlite3 sends no BEGIN before a
    SAVEPOINT or a SELECT (legacy transaction control).
    ``delete_limit_literal``: a batched DELETE takes its LIMIT as a literal
    (MySQL/MariaDB: no LIMIT inside an IN subquery).
    ``named_locks``: how the server's named (advisory) locks are held:
    ``"transaction"`` (PostgreSQL's ``pg_advisory_xact_lock``),
    ``"connection"`` (``GET_LOCK``), or ``""`` (none: SQLite).
    ``array_params``: a list of keys binds as one ARRAY parameter
    (PostgreSQL's ``= ANY(:keys)``), so a statement's text does not depend on
    how many keys it takes.
    ``trigger_functions``: ``CREATE FUNCTION ... RETURNS trigger`` (PL/pgSQL,
    PostgreSQL), where the legal-edges trigger of a state machine lives.
    ``backslash_escapes``: string literals in reflected SQL escape quotes
    with a backslash (MySQL/MariaDB).
    ``dml_cte``: an ``UPDATE``/``INSERT ... RETURNING`` may stand in a
    ``WITH`` clause, so two writes are one statement (PostgreSQL).

    One instance exists per distinct set of flags (see :func:`backend`), so
    a Backend is a cheap, identity-hashed memo key that does not grow with
    the number of engines.
    """

    name: str
    returning: bool
    last_insert_id: bool
    locking_read: bool
    on_conflict: bool
    row_locks: bool
    driver_begins_lazily: bool
    delete_limit_literal: bool
    named_locks: str
    array_params: bool
    trigger_functions: bool
    backslash_escapes: bool
    dml_cte: bool


#: Dialects that speak PostgreSQL's SQL for every statement stateguard builds.
POSTGRESQL_FAMILY: Final = ("postgresql", "cockroachdb")

_interned: dict[tuple[Any, ...], Backend] = {}
# Weak keys: an engine (and its dialect) that the application drops leaves nothing behind.
_backends: weakref.WeakKeyDictionary[Dialect, Backend] = weakref.WeakKeyDictionary()
_backends_lock = threading.Lock()


#: The last dialect asked about and its Backend: nearly every application has one
#: engine, and a hit here skips the weak-key lookup (which builds a weakref per call).
_last: tuple[Dialect | None, Backend | None] = (None, None)


def backend(dialect: Dialect) -> Backend:
    """The :class:`Backend` for a (connected) dialect."""
    global _last
    last_dialect, last_backend = _last
    if dialect is last_dialect and last_backend is not None:
        return last_backend
    found = _backends.get(dialect)
    if found is None:
        name = dialect.name
        mysql = name in ("mysql", "mariadb")
        sqlite = name == "sqlite"
        # CockroachDB (sqlalchemy-cockroachdb, a PGDialect subclass) speaks
        # PostgreSQL's SQL for everything stateguard writes: UPDATE/INSERT ...
        # RETURNING, ON CONFLICT DO NOTHING, = ANY(array), DML in a WITH clause,
        # FOR UPDATE [NOWAIT | SKIP LOCKED].  It has no pg_advisory_xact_lock
        # (named_locks "") and no PL/pgSQL trigger functions before 24.3, so the
        # legal-edges trigger is not installed there (trigger_functions False).
        pg_sql = name in POSTGRESQL_FAMILY
        flags = (
            name,
            bool(dialect.update_returning) and not mysql,
            mysql,
            mysql,
            pg_sql or sqlite,
            not sqlite,
            sqlite,
            mysql,
            "transaction" if name == "postgresql" else "connection" if mysql else "",
            pg_sql,
            name == "postgresql",
            mysql,
            pg_sql,
        )
        with _backends_lock:
            found = _interned.get(flags)
            if found is None:
                found = _interned[flags] = Backend(*flags)
            _backends[dialect] = found
    _last = (dialect, found)
    return found


# --------------------------------------------------------------------------
# Facts about the server, read once per dialect (one engine)
# --------------------------------------------------------------------------

_galera: weakref.WeakKeyDictionary[Dialect, bool] = weakref.WeakKeyDictionary()


def is_galera(conn: Connection) -> bool:
    """Whether ``conn`` talks to a node of a MariaDB Galera cluster (``wsrep_on`` is ``ON``).

    Read once per engine (``SHOW GLOBAL VARIABLES``, which every MySQL-family server answers,
    unlike ``@@wsrep_on``), on the first call that needs it; never asked of other databases.
    What changes on a Galera node: ``GET_LOCK`` is local to the node (advisory_lock refuses it),
    and a conflicting write on another node surfaces as error 1213 at COMMIT (DeadlockDetected).
    """
    dialect = conn.dialect
    found = _galera.get(dialect)
    if found is None:
        if dialect.name not in ("mysql", "mariadb"):
            found = False
        else:
            row = conn.exec_driver_sql("SHOW GLOBAL VARIABLES LIKE 'wsrep_on'").first()
            found = row is not None and str(row[1]).upper() == "ON"
        _galera[dialect] = found
    return found


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


def row_lock_minimums(dialect: Dialect) -> tuple[str, dict[str, tuple[int, ...] | None]] | None:
    """The server's name and the first version supporting each ``FOR UPDATE`` option.

    ``None`` when every option works (PostgreSQL) or the dialect has no row
    locks to configure (SQLite); a ``None`` version means "never" (MariaDB
    has no ``FOR UPDATE OF``).
    """
    if dialect.name not in ("mysql", "mariadb"):
        return None
    if getattr(dialect, "is_mariadb", False):
        return "MariaDB", {"nowait": (10, 3), "skip_locked": (10, 6), "of": None}
    return "MySQL", {"nowait": (8, 0, 1), "skip_locked": (8, 0, 1), "of": (8, 0, 1)}


def integer_bounds(column: Column[Any], dialect: Dialect) -> tuple[int, int] | None:
    """The smallest and largest integer ``column`` holds on ``dialect``, or ``None`` if it is no integer.

    The declared type decides, in the dialect's own form on the servers
    (``with_variant`` included): PostgreSQL ``INTEGER`` is 32-bit and refuses
    a wider bound parameter with an error that aborts the transaction;
    MySQL/MariaDB have 8-, 16-, 24-, 32- and 64-bit types, signed or
    ``UNSIGNED``.  SQLite stores any integer in up to 8 bytes, but a model
    tested on SQLite must refuse what its production database will refuse,
    so there the declared type's range applies too (a ``BigInteger`` with
    an ``Integer`` variant for SQLite's rowid stays 64-bit).
    """
    impl: Any = column.type if dialect.name == "sqlite" else column.type.dialect_impl(dialect)
    if isinstance(impl, TypeDecorator):
        impl = impl.impl_instance
    if not isinstance(impl, sqltypes.Integer):
        return None
    if isinstance(impl, sqltypes.BigInteger):
        bits = 64
    elif isinstance(impl, sqltypes.SmallInteger):
        bits = 16
    else:
        bits = _MYSQL_INTEGER_BITS.get(type(impl).__name__, 32)
    if getattr(impl, "unsigned", False):
        return 0, (1 << bits) - 1
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def numeric_digits(column: Column[Any]) -> tuple[int | None, int] | None:
    """``(precision, scale)`` of a fixed-point ``Numeric`` column, or ``None`` (floats and unscaled ones)."""
    impl: Any = column.type
    if isinstance(impl, TypeDecorator):
        impl = impl.impl_instance
    if not isinstance(impl, sqltypes.Numeric) or isinstance(impl, sqltypes.Float):
        return None
    scale = getattr(impl, "scale", None)
    if scale is None:
        return None
    return getattr(impl, "precision", None), int(scale)


#: MySQL's integer types narrower than INTEGER, by type name.
_MYSQL_INTEGER_BITS: Final = {"TINYINT": 8, "MEDIUMINT": 24}


# --------------------------------------------------------------------------
# Error mapping
# --------------------------------------------------------------------------

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


# --------------------------------------------------------------------------
# Models and keys
# --------------------------------------------------------------------------


class ModelInfo:
    """Everything about a mapped class that a guarded write needs, computed once."""

    __slots__ = (
        "attr_by_column",
        "bind_arguments",
        "column_by_attr",
        "fence_attr",
        "fence_column",
        "identity_class",
        "key_kinds",
        "key_limits",
        "mapper",
        "model",
        "pk_checks",
        "pk_columns",
        "pk_names",
        "pk_where",
        "table",
        "text_key",
        "version_attr",
        "version_column",
    )

    def __init__(self, model: type[Any]) -> None:
        mapper: Mapper[Any] = inspect(model)
        table = mapper.local_table
        if not isinstance(table, Table):
            raise ConfigurationError(
                f"{model.__name__} is not mapped to a single table; stateguard needs one"
            )
        self.model = model
        self.mapper = mapper
        #: What ``Session.connection()`` needs to pick the model's bind (per-model binds).
        self.bind_arguments: dict[str, Any] = {"mapper": mapper}
        self.table: Table = table
        self.identity_class = mapper._identity_class
        self.pk_columns: tuple[Column[Any], ...] = tuple(mapper.primary_key)  # type: ignore[arg-type]
        self.pk_names = tuple(f"sg_pk{i}" for i in range(len(self.pk_columns)))
        self.pk_where = and_(
            *(c == bindparam(n, type_=c.type) for c, n in zip(self.pk_columns, self.pk_names, strict=True))
        )
        self.pk_checks = tuple(_python_type(c) for c in self.pk_columns)
        #: Per key column (type, Numeric scale) for canonical_key/decode_key; False until computed.
        self.key_kinds: Any = False
        #: Whether a key part may be a str (checked for NUL and lone surrogates before any statement).
        self.text_key = any(t is str or t is None for t in self.pk_checks)
        #: Per Backend (a handful, interned): the integer range of each key column, or ``()``.
        self.key_limits: dict[Backend, tuple[tuple[int, int] | None, ...]] = {}
        self.column_by_attr: dict[str, Column[Any]] = {}
        self.attr_by_column: dict[Column[Any], str] = {}
        for prop in mapper.column_attrs:
            col = prop.columns[0]
            if isinstance(col, Column) and col.table is table:
                self.column_by_attr[prop.key] = col
                self.attr_by_column[col] = prop.key
        vcol = mapper.version_id_col
        if vcol is not None and vcol.table is not table:  # pragma: no cover - inheritance edge
            vcol = None
        self.version_column: Column[Any] | None = vcol  # type: ignore[assignment]
        self.version_attr = self.attr_by_column.get(vcol) if vcol is not None else None  # type: ignore[call-overload]
        self.fence_column: Column[Any] | None = None
        self.fence_attr: str | None = None
        for attr, col in self.column_by_attr.items():
            if col.info.get(INFO_KEY) == "fence":
                self.fence_column, self.fence_attr = col, attr

    def column(self, attr: str, *, role: str) -> Column[Any]:
        col = self.column_by_attr.get(attr)
        if col is None:
            raise InvalidArgument(
                f"{self.model.__name__} has no mapped column attribute {attr!r} "
                f"(used as {role}); known: {sorted(self.column_by_attr)}"
            )
        return col

    def bound_pk_where(self, params: Mapping[str, Any]) -> ColumnElement[bool]:
        return and_(
            *(
                c == bindparam(n, params[n], type_=c.type)
                for c, n in zip(self.pk_columns, self.pk_names, strict=True)
            )
        )

    def key_params(self, key: tuple[Any, ...]) -> dict[str, Any]:
        if len(key) == 1:
            return {"sg_pk0": key[0]}
        return dict(zip(self.pk_names, key, strict=True))


def _python_type(col: Column[Any]) -> type | None:
    try:
        return col.type.python_type
    except NotImplementedError:
        return None


_infos: dict[type, ModelInfo] = {}
_infos_lock = threading.Lock()


def model_info(model: type[Any]) -> ModelInfo:
    """The :class:`ModelInfo` of a mapped class (built once per class)."""
    found = _infos.get(model)
    if found is None:
        with _infos_lock:
            found = _infos.get(model)
            if found is None:
                found = _infos[model] = ModelInfo(model)
    return found


def public_key(key: tuple[Any, ...]) -> Any:
    return key[0] if len(key) == 1 else key


def _key_kinds(info: ModelInfo) -> tuple[tuple[type | None, int | None], ...] | None:
    """Per key column, the Python type and Numeric scale :func:`canonical_key` needs; ``None`` when
    every key column is an int or a str (nothing to canonicalise or decode)."""
    kinds = info.key_kinds
    if kinds is False:
        found = tuple(
            (_python_type(c), getattr(c.type, "scale", None) if _python_type(c) is Decimal else None)
            for c in info.pk_columns
        )
        kinds = info.key_kinds = None if all(t in (int, str) for t, _ in found) else found
    result: tuple[tuple[type | None, int | None], ...] | None = kinds
    return result


def canonical_key(info: ModelInfo, key: tuple[Any, ...]) -> tuple[Any, ...]:
    """``key`` spelled one way for the transition log and the counter ledger.

    The database matches ``1.5``, ``1.50`` and ``Decimal("1.500")`` to the
    same ``NUMERIC(10, 2)`` row; their JSON would differ, and a ref or
    request id would then apply twice.  Decimals, ints and floats of a
    Numeric key with a scale are quantized to it when that is exact.
    """
    kinds = _key_kinds(info)
    if kinds is None:
        return key
    out = []
    for value, (kind, scale) in zip(key, kinds, strict=True):
        if kind is Decimal and scale is not None and type(value) in (int, float, Decimal):
            # A float by its shortest repr (1.5, not 1.5000000000000000), as check_exact reads it.
            given = Decimal(repr(value)) if type(value) is float else Decimal(value)
            try:
                exact = given.quantize(Decimal(1).scaleb(-scale))
            except InvalidOperation:  # NaN, infinity, more digits than the context holds
                exact = None
            if exact is not None and exact == given:
                value = exact
        out.append(value)
    return tuple(out)


def inexact_text_key(info: ModelInfo, dialect: Dialect) -> bool:
    """Whether ``dialect``'s database may match a text key part to a row spelled otherwise.

    MariaDB's and MySQL's default collations ignore case and trailing spaces:
    ``'SKU-A'`` and ``'sku-a '`` find the row ``'sku-a'``.  A ``String`` key
    column without a binary (``*_bin``) collation there; type decorators
    (such as :class:`~stateguard.tables.ExactString`) declare their own.
    """
    if dialect.name not in ("mysql", "mariadb"):
        return False
    for column in info.pk_columns:
        kind = column.type
        if isinstance(kind, TypeDecorator) or not isinstance(kind, sqltypes.String):
            continue
        if isinstance(kind, sqltypes.Enum):
            continue
        collation = getattr(kind, "collation", None)
        if collation is None or not collation.endswith("_bin"):
            return True
    return False


def key_order(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """A sort key for primary keys (Enum members, which do not order, sort by value): rows are
    changed in this order by reserve() and release(), so the two cannot deadlock."""
    return tuple(v.value if isinstance(v, enum.Enum) else v for v in key)


def decode_key(info: ModelInfo, stored: Any) -> tuple[Any, ...]:
    """The key a ``row_key`` JSON (already parsed) stands for, as the key columns take it.

    JSON keeps ints and strs; the rest was written with ``str()`` (UUIDs,
    dates, Decimals, Enum members): turned back by the column's Python type,
    so ``release()`` finds the row it changed on every backend (SQLite's Uuid
    and Date types take only their own Python objects).
    """
    parts = tuple(stored) if isinstance(stored, list) else (stored,)
    kinds = _key_kinds(info)
    if kinds is None:
        return parts
    return tuple(_decode_part(value, kind) for value, (kind, _) in zip(parts, kinds, strict=True))


def _decode_part(value: Any, kind: type | None) -> Any:
    if kind is None or not isinstance(value, str) or kind is str:
        return value
    if issubclass(kind, enum.Enum):
        for member in kind:
            if str(member) == value or member.value == value or member.name == value:
                return member
        return value
    if kind is uuid.UUID:
        return uuid.UUID(value)
    if kind is datetime.datetime:
        return datetime.datetime.fromisoformat(value)
    if kind is datetime.date:
        return datetime.date.fromisoformat(value)
    if kind is datetime.time:
        return datetime.time.fromisoformat(value)
    if kind is Decimal:
        return Decimal(value)
    return value


# --------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------


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


def variant_key(items: tuple[tuple[str, Column[Any], Any], ...], has_sql: bool) -> Any:
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
    if backend.locking_read:
        stmt = stmt.with_for_update()
    return stmt


def by_primary_key(stmt: Any, table: Table, backend: Backend) -> Any:
    """``stmt``, a SELECT or UPDATE of ``table``'s rows named by a list of primary keys, held to
    the primary key on InnoDB (``FORCE INDEX (PRIMARY)``); unchanged elsewhere.

    In REPEATABLE READ a locking read or an UPDATE locks every row its plan visits, matched or
    not, until COMMIT.  For an IN list naming a good share of a table MariaDB's optimizer picks a
    full index scan (EXPLAIN type ``index``: 7 keys of a 10-row table), which locks the rows
    between and around the keys as well, out of key order: a batch waited on rows it never
    named, and two overlapping batches deadlocked.  Forced onto the primary key the plan is
    one unique lookup per key (type ``range``), each locking its own record alone.
    """
    if not backend.locking_read:
        return stmt
    if isinstance(stmt, Select):
        return stmt.with_hint(table, "FORCE INDEX (PRIMARY)", dialect_name=backend.name)
    return stmt.with_hint("FORCE INDEX (PRIMARY)", dialect_name=backend.name)


def purge_statement(
    table: Table, backend: Backend, batch: int, old: ColumnElement[bool] | None = None
) -> Any:
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
