"""The engine behind every guarded write: statement building, outcome
classification inputs, key handling, dialect differences and error mapping.

Pure functions and small cached descriptions only; no I/O of its own except
through :func:`execute`.  The algorithms live in the public modules and call
into here; per-dialect behaviour is confined to :class:`Backend`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import (
    ColumnElement,
    Connection,
    CursorResult,
    Select,
    Table,
    Update,
    and_,
    bindparam,
    func,
    inspect,
    or_,
    select,
    text,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Mapper, Session
from sqlalchemy.orm.attributes import set_committed_value
from sqlalchemy.schema import Column
from sqlalchemy.sql.elements import ClauseElement

__all__ = [
    "Backend",
    "ClauseElement",
    "ModelInfo",
    "backend",
    "bindparam",
    "execute",
    "model_info",
]

from .exceptions import (
    ConfigurationError,
    DeadlockDetected,
    InvalidArgument,
    LockNotAcquired,
    SerializationConflict,
    StateguardError,
)

#: Marker stored in ``Column.info`` by :func:`stateguard.version_column`.
INFO_KEY: Final = "stateguard"

#: Plans cached per trigger/model beyond this many variants are built per call.
MAX_CACHED_VARIANTS: Final = 256


# --------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Backend:
    """What stateguard needs to know about one dialect.

    ``returning``: ``UPDATE ... RETURNING`` works (PostgreSQL, SQLite >= 3.35).
    ``last_insert_id``: MySQL/MariaDB, where ``SET v = LAST_INSERT_ID(v + 1)``
    hands the new value back in the OK packet (``cursor.lastrowid``) without
    another round trip.
    ``locking_read``: a plain SELECT inside a REPEATABLE READ transaction
    reads the transaction's old snapshot (InnoDB), while UPDATE reads the
    latest committed row; the follow-up read must be ``FOR UPDATE`` to see
    what the UPDATE saw.
    ``on_conflict``: ``INSERT ... ON CONFLICT DO NOTHING`` exists.
    """

    name: str
    returning: bool
    last_insert_id: bool
    locking_read: bool
    on_conflict: bool


_backends: dict[Dialect, Backend] = {}


def backend(dialect: Dialect) -> Backend:
    """The :class:`Backend` for a (connected) dialect, cached per dialect object."""
    found = _backends.get(dialect)
    if found is None:
        name = dialect.name
        mysql = name in ("mysql", "mariadb")
        found = Backend(
            name=name,
            returning=bool(dialect.update_returning) and not mysql,
            last_insert_id=mysql,
            locking_read=mysql,
            on_conflict=name in ("postgresql", "sqlite"),
        )
        _backends[dialect] = found
    return found


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
    args = getattr(orig, "args", ())
    if (
        args
        and isinstance(args[0], int)
        and type(orig).__module__.startswith(
            ("pymysql", "MySQLdb", "mysql", "mariadb", "asyncmy", "aiomysql")
        )
    ):
        # MySQL drivers: the error number is exact (SQLSTATE 40001 covers both
        # deadlocks and other rollbacks there), so it is checked first.
        if args[0] == _MYSQL_DEADLOCK:
            return DeadlockDetected
        if args[0] == _MYSQL_RECORD_CHANGED:
            return SerializationConflict
        if args[0] in (_MYSQL_LOCK_WAIT_TIMEOUT, _MYSQL_NOWAIT):
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
    kind = classify_db_error(error)
    if kind is None:
        return None
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


def execute(conn: Connection, stmt: Any, params: Mapping[str, Any] | None = None) -> CursorResult[Any]:
    """Run ``stmt`` on ``conn``, turning retryable driver conflicts into our errors."""
    try:
        return conn.execute(stmt, params)
    except sa_exc.DBAPIError as error:
        mapped = conflict_error(error)
        if mapped is None:
            raise
        raise mapped from error


# --------------------------------------------------------------------------
# Models and keys
# --------------------------------------------------------------------------


class ModelInfo:
    """Everything about a mapped class that a guarded write needs, computed once."""

    __slots__ = (
        "attr_by_column",
        "column_by_attr",
        "fence_attr",
        "fence_column",
        "identity_class",
        "mapper",
        "model",
        "pk_checks",
        "pk_columns",
        "pk_names",
        "pk_where",
        "read_cache",
        "table",
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
        self.table: Table = table
        self.identity_class = mapper._identity_class
        self.pk_columns: tuple[Column[Any], ...] = tuple(mapper.primary_key)  # type: ignore[arg-type]
        self.pk_names = tuple(f"sg_pk{i}" for i in range(len(self.pk_columns)))
        self.pk_where = and_(
            *(c == bindparam(n, type_=c.type) for c, n in zip(self.pk_columns, self.pk_names, strict=True))
        )
        self.pk_checks = tuple(_python_type(c) for c in self.pk_columns)
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
        self.read_cache: dict[Any, Select[Any]] = {}

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

    def read(self, columns: Sequence[Column[Any]], backend: Backend) -> Select[Any]:
        """``SELECT columns WHERE pk`` that sees what an UPDATE just saw (cached)."""
        cache_key = (tuple(columns), backend.locking_read)
        stmt = self.read_cache.get(cache_key)
        if stmt is None:
            stmt = select(*columns).where(self.pk_where)
            if backend.locking_read:
                stmt = stmt.with_for_update()
            self.read_cache[cache_key] = stmt
        return stmt


def _python_type(col: Column[Any]) -> type | None:
    try:
        return col.type.python_type
    except NotImplementedError:
        return None


_infos: dict[type, ModelInfo] = {}
_infos_lock = threading.Lock()


def model_info(model: type[Any]) -> ModelInfo:
    found = _infos.get(model)
    if found is None:
        with _infos_lock:
            found = _infos.get(model)
            if found is None:
                found = _infos[model] = ModelInfo(model)
    return found


def _bad_key(info: ModelInfo, target: Any, why: str) -> InvalidArgument:
    pk = ", ".join(
        f"{c.name}: {t.__name__ if t else '?'}" for c, t in zip(info.pk_columns, info.pk_checks, strict=True)
    )
    return InvalidArgument(
        f"{info.model.__name__}: {target!r} is not a valid target ({why}); pass a primary key "
        f"({pk}){' as a tuple' if len(info.pk_columns) > 1 else ''} or a loaded "
        f"{info.model.__name__} instance"
    )


def check_key_value(info: ModelInfo, value: Any, i: int, target: Any) -> None:
    expected = info.pk_checks[i]
    if value is None:
        raise _bad_key(info, target, "a primary key value is None")
    if expected is None or isinstance(value, expected):
        if expected is int and isinstance(value, bool):
            raise _bad_key(info, target, "a bool is not an integer key")
        return
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return
    if expected.__module__ == "decimal" and isinstance(value, int | float):
        return
    raise _bad_key(info, target, f"expected {expected.__name__}, got {type(value).__name__}")


def resolve_target(session: Session | None, info: ModelInfo, target: Any) -> tuple[tuple[Any, ...], Any]:
    """``(key tuple, instance or None)`` for a primary key or a mapped instance."""
    # Fast path: a scalar integer/str key of a single-column primary key.
    if len(info.pk_checks) == 1 and type(target) is info.pk_checks[0]:
        return (target,), None
    state = getattr(target, "_sa_instance_state", None)
    if state is not None:
        if not isinstance(target, info.model):
            raise InvalidArgument(
                f"expected a {info.model.__name__} instance or primary key, got a "
                f"{type(target).__name__} instance"
            )
        identity = state.identity
        if identity is None:
            if state.pending and session is not None and state.session_id == session.hash_key:
                # A pending instance has no row yet: flush it, as ORM autoflush would.
                session.flush()
                identity = state.identity
            if identity is None:
                raise InvalidArgument(
                    f"{info.model.__name__} instance {target!r} has no primary key yet "
                    f"(transient or not flushed); add it to the session and flush first"
                )
        return tuple(identity), target
    key = target if isinstance(target, tuple) else (target,)
    if len(key) != len(info.pk_columns):
        raise _bad_key(info, target, f"the primary key has {len(info.pk_columns)} column(s)")
    for i, value in enumerate(key):
        check_key_value(info, value, i, target)
    return key, None


def public_key(key: tuple[Any, ...]) -> Any:
    return key[0] if len(key) == 1 else key


def identity_instance(session: Session, info: ModelInfo, key: tuple[Any, ...]) -> Any:
    """The instance for ``key`` already in the session's identity map, if any (no SQL)."""
    identity_map = session.identity_map
    if not len(identity_map):
        return None
    return identity_map.get((info.identity_class, key, None))


def sync_instance(
    session: Session,
    instance: Any,
    committed: Mapping[str, Any],
    expire: Iterable[str] = (),
) -> None:
    """Make a loaded instance agree with the row we just wrote or read.

    ``committed`` values are known exactly and become the instance's committed
    state (so a later ORM flush's version check uses the new version); the
    ``expire`` attributes were changed by SQL expressions and reload on access.
    """
    for attr, value in committed.items():
        set_committed_value(instance, attr, value)
    expire = [a for a in expire if a not in committed]
    if expire and instance in session:
        session.expire(instance, expire)


# --------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------


def split_values(
    info: ModelInfo,
    values: Mapping[str, Any] | None,
    *,
    forbidden: Mapping[str, str],
) -> tuple[tuple[tuple[str, Column[Any], Any], ...], bool]:
    """Validate user ``values`` by attribute name.

    Returns ``((attr, column, value), ...)`` sorted by attribute and whether
    any value is a SQL expression (which must be embedded in the statement
    rather than bound).  ``forbidden`` maps attribute names that must not be
    set this way to the reason.
    """
    if not values:
        return (), False
    if not isinstance(values, Mapping):
        raise InvalidArgument(
            f"values must be a mapping of attribute names to values, got {type(values).__name__}"
        )
    items = []
    has_sql = False
    for attr in sorted(values):
        if not isinstance(attr, str):
            raise InvalidArgument(f"values keys must be attribute names (str), got {attr!r}")
        reason = forbidden.get(attr)
        if reason is not None:
            raise InvalidArgument(f"{info.model.__name__}.{attr} cannot be set through values: {reason}")
        col = info.column(attr, role="a values entry")
        if col.primary_key:
            raise InvalidArgument(
                f"{info.model.__name__}.{attr} is part of the primary key and cannot be set"
            )
        value = values[attr]
        if isinstance(value, ClauseElement):
            has_sql = True
        items.append((attr, col, value))
    return tuple(items), has_sql


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


def finish_update(stmt: Update, returning: Sequence[Column[Any]], backend: Backend) -> Update:
    if returning and backend.returning:
        stmt = stmt.returning(*returning)
    return stmt


# --------------------------------------------------------------------------
# Savepoints
# --------------------------------------------------------------------------


def ensure_real_transaction(conn: Connection) -> None:
    """Make sure the driver really has a transaction open before a SAVEPOINT.

    Python's sqlite3 (with its default, legacy transaction control) does not
    send BEGIN before a SAVEPOINT: the SAVEPOINT then starts its own
    transaction and RELEASE commits it, long before the session commits.
    Opening the transaction explicitly keeps the savepoint nested in it.
    """
    if conn.dialect.name != "sqlite":
        return
    if not _driver_in_transaction(conn):
        conn.exec_driver_sql("BEGIN")


def abandon_savepoint(savepoint: Any) -> None:
    """Roll back a SAVEPOINT (Connection or Session level) while an error propagates, keeping that error.

    MariaDB/MySQL roll the whole transaction back on a deadlock (1213),
    savepoints included: ``ROLLBACK TO SAVEPOINT`` then fails with 1305
    ("SAVEPOINT ... does not exist"), and raising that would hide the
    retryable :class:`DeadlockDetected`.  The caller's transaction is dead
    either way and must be rolled back.
    """
    if not savepoint.is_active:
        return
    with contextlib.suppress(sa_exc.DBAPIError):
        savepoint.rollback()


def _driver_in_transaction(conn: Connection) -> bool:
    """Whether SQLite's driver has a transaction open (sqlite3, or aiosqlite under SQLAlchemy's adapter)."""
    dbapi_conn = conn.connection.dbapi_connection
    flag = getattr(dbapi_conn, "in_transaction", None)
    if flag is None:
        # SQLAlchemy's aiosqlite adapter does not expose it; the aiosqlite
        # connection it wraps does (read from sqlite3's connection).
        flag = getattr(getattr(dbapi_conn, "_connection", None), "in_transaction", None)
    return True if flag is None else bool(flag)


# --------------------------------------------------------------------------
# Fencing tokens
# --------------------------------------------------------------------------


def check_fence(info: ModelInfo, fence: Any) -> None:
    if info.fence_column is None:
        raise InvalidArgument(
            f"{info.model.__name__} has no fence column, so fence= cannot be checked; "
            f"declare one with fence_column()"
        )
    if type(fence) is not int or fence < 0:
        raise InvalidArgument(f"fence must be a non-negative int (a fencing token), got {fence!r}")


def fence_condition(col: Column[Any], value: int | None = None) -> ColumnElement[bool]:
    """``fence IS NULL OR fence <= :fence``: only an older (or the same) holder's mark passes.

    Fencing tokens only grow and no two lock holders share one, so an equal
    token is the same holder writing again; an older one is a holder whose
    lock expired while it was paused.
    """
    return or_(col.is_(None), col <= bindparam("sg_fence", value, type_=col.type))


def fence_allows(found: Any, fence: int) -> bool:
    return found is None or found <= fence


def sqlite_write_lock(conn: Connection) -> None:
    """On SQLite, make sure the transaction holds the write lock before a read-then-write.

    SQLite has no row locks; its equivalent of ``SELECT ... FOR UPDATE`` is
    holding the database's write lock.  Python's sqlite3 (legacy transaction
    control) does not even BEGIN before a SELECT, so a read would run outside
    the transaction of the UPDATE that follows it.  Outside a transaction,
    start one with ``BEGIN IMMEDIATE``; inside a deferred transaction that has
    only read, the UPDATE's upgrade either succeeds or fails with a busy error
    (a retryable SerializationConflict), never silently on stale data.
    """
    if conn.dialect.name != "sqlite":
        return
    if not _driver_in_transaction(conn):
        execute(conn, _BEGIN_IMMEDIATE)


_BEGIN_IMMEDIATE = text("BEGIN IMMEDIATE")
