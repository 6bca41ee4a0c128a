"""The guarded-write kernel: every stateguard statement runs through here.

One place for what every guarded write shares, whatever scheme it serves:

- :func:`connection_for`: the session's connection for a model (autoflush
  first, per-model binds honoured);
- :func:`execute` and :func:`run_guarded`: run one statement, map retryable
  driver conflicts to typed errors, and decode what the database said
  (``RETURNING`` row, affected-row count, or MySQL's ``LAST_INSERT_ID``);
- :class:`InsertOnce`: insert-or-detect-duplicate for every dialect, without
  poisoning the transaction;
- :func:`sync_loaded`: make a loaded ORM instance agree with the row written
  or read;
- checks of keys and values before anything is sent (:func:`resolve_target`,
  :func:`split_values`, :func:`check_text` ...);
- savepoint and SQLite transaction helpers;
- :data:`memo`: the one bounded memo of built statements.

Dialect differences are :class:`~stateguard._sql.Backend` flags; the
algorithms live in the feature modules and call into here.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from datetime import timedelta
from decimal import Decimal
from typing import Any, Final, TypeVar

from sqlalchemy import (
    Column,
    Connection,
    CursorResult,
    Engine,
    Enum,
    String,
    Table,
    Text,
    cast,
    event,
    func,
    insert,
    lambda_stmt,
    literal_column,
    select,
    text,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import instance_state, set_committed_value
from sqlalchemy.sql import util as sql_util
from sqlalchemy.sql.base import Executable
from sqlalchemy.sql.elements import ClauseElement, ColumnElement
from sqlalchemy.sql.lambdas import StatementLambdaElement

from . import _sql
from .engine import BEGIN_MARK, PENDING
from .exceptions import ConfigurationError, InvalidArgument

__all__ = [
    "DeferredSavepoint",
    "InsertOnce",
    "Memo",
    "abandon_savepoint",
    "check_batch",
    "check_exact",
    "check_fence",
    "check_integer",
    "check_json_shape",
    "check_statement_size",
    "check_storable",
    "check_string",
    "check_text",
    "connection_for",
    "dumps_json",
    "duration_ms",
    "ensure_real_transaction",
    "execute",
    "identity_instance",
    "insert_rows",
    "json_text",
    "key_bounds",
    "memo",
    "needs_size_check",
    "now_ms",
    "own_bind",
    "own_connection",
    "purge_rows",
    "read_back",
    "required_seconds",
    "resolve_target",
    "run_guarded",
    "seconds",
    "split_values",
    "sqlite_write_lock",
    "stored_key",
    "sync_loaded",
    "value_integers",
]

T = TypeVar("T")


# --------------------------------------------------------------------------
# The statement memo
# --------------------------------------------------------------------------


class Memo:
    """A bounded memo of built statements, shared by every guarded write.

    Keys name what a statement depends on: its owner (a trigger, a model's
    :class:`~stateguard._sql.ModelInfo`, a table), the
    :class:`~stateguard._sql.Backend` (interned per capability set, so an
    application that creates an engine per tenant adds no entries) and the
    call variant.  A hit is one ``dict.get``; when full, the oldest entry is
    dropped (insertion order), so a workload that churns through variants
    cannot grow it without bound.
    """

    __slots__ = ("_data", "_lock", "maxsize")

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._data: dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any:
        """The memoised value for ``key``, or ``None``."""
        return self._data.get(key)

    def put(self, key: Hashable, value: T) -> T:
        """Remember ``value`` under ``key`` (evicting the oldest entry when full); return it."""
        with self._lock:
            data = self._data
            if key not in data and len(data) >= self.maxsize:
                del data[next(iter(data))]
            data[key] = value
        return value

    def get_or_build(self, key: Hashable, build: Callable[[], T]) -> T:
        """The memoised value for ``key``, built by ``build()`` on a miss."""
        found = self._data.get(key)
        if found is None:
            found = self.put(key, build())
        return found

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        """Forget everything (tests)."""
        with self._lock:
            self._data.clear()


#: The statement memo of every guarded write.
memo: Final = Memo(4096)

_frozen_ids = itertools.count(1)


def frozen(stmt: Executable) -> StatementLambdaElement:
    """``stmt`` with its SQL cache key computed once, for statements run on every call of a hot path.

    SQLAlchemy looks up the compiled form of a statement by a cache key that
    it recomputes, by walking the whole statement, at every execution: a few
    microseconds for a one-table UPDATE, about 30 for the idempotency claim's
    CTE.  A lambda statement (:func:`sqlalchemy.lambda_stmt`) is keyed by its
    code and ``track_on`` instead: here a number unique to this call, so two
    frozen statements never share a compiled form.  ``stmt`` must be complete
    and never change (its bound parameters get their values at execution, as
    usual); the result executes, compiles and renders exactly like ``stmt``
    (``schema_translate_map`` and events included).
    """
    return lambda_stmt(lambda: stmt, track_on=[f"stateguard.frozen.{next(_frozen_ids)}"])


# --------------------------------------------------------------------------
# Connections and execution
# --------------------------------------------------------------------------


def connection_for(
    session: Session,
    info: _sql.ModelInfo,
    keys: Iterable[tuple[Any, ...]] = (),
    integers: Iterable[tuple[Column[Any], Any, str]] = (),
) -> Connection:
    """The session's connection for ``info``'s model, after an autoflush.

    Per-model binds (``Session(binds={Model: engine})``) are honoured, and
    the flush sends pending ORM changes first, as a query would.

    ``keys`` (primary keys of the model) and ``integers`` (``(column, value,
    what)``: a version, a fence, an amount, a value of ``values=``) are
    checked against the range their column holds on this connection's
    database before any statement is sent: PostgreSQL refuses an
    out-of-range parameter with an error that aborts the caller's
    transaction, the others would answer NOT_FOUND for a row that cannot
    exist.  Strings among them (and str key parts) are checked by
    :func:`check_string`.  Anything refused is :class:`InvalidArgument`.
    """
    if session.autoflush:
        session.flush()
    conn = session.connection(bind_arguments=info.bind_arguments)
    if keys:
        bounds = key_bounds(conn, info)
        if bounds is not None:
            for key in keys:
                for value, column, limits in zip(key, info.pk_columns, bounds, strict=True):
                    if limits is not None and type(value) is int and not limits[0] <= value <= limits[1]:
                        raise _out_of_range(info, column, value, limits, "primary key")
        if info.text_key:
            for key in keys:
                for value in key:
                    if type(value) is str:
                        check_string(info, None, value, "primary key")
    for column, value, what in integers:
        if type(value) is str:
            check_string(info, column, value, what)
            continue
        check_integer(conn, info, column, value, what)
        if type(value) is not int and isinstance(value, Decimal | float):
            check_exact(info, column, value, what)
    if conn.info.get(BEGIN_MARK) == PENDING:
        # sqlite_engine(begin="auto"): a stateguard write starts this
        # transaction, and may read before it writes; take the write lock now.
        sqlite_write_lock(conn)
    return conn


def own_connection(session: Session, table: Table | None) -> Connection:
    """The session's connection for ``table``, one of stateguard's own tables (:func:`own_bind`)."""
    return session.connection(bind_arguments={"bind": own_bind(session, table)})


def own_bind(session: Session, table: Table | None) -> Engine | Connection:
    """Where the session runs statements on ``table``, one of stateguard's own tables (``None``: no
    table, e.g. an advisory lock).

    ``Session(bind=engine)`` and binds that name the table (``binds={Base:
    engine, **dict.fromkeys(stateguard.tables.metadata.sorted_tables,
    engine)}``) are used as SQLAlchemy resolves them.  With per-model binds
    that say nothing about stateguard's tables (``Session(binds={Base:
    engine})``) the one engine every bind points to is used: the same
    transaction as the model's writes.  Binds to several engines must say
    where stateguard's tables live (ConfigurationError otherwise).
    """
    try:
        return session.get_bind() if table is None else session.get_bind(clause=table)
    except sa_exc.UnboundExecutionError:
        pass
    # SQLAlchemy 2.1 has Session.binds; 2.0 keeps them private (read only on this rare path).
    binds: Mapping[Any, Any] = (
        getattr(session, "binds", None) or getattr(session, "_Session__binds", None) or {}
    )
    engines = {b.engine if isinstance(b, Connection) else b for b in binds.values()}
    if len(engines) == 1:
        [engine] = engines
        found: Engine = engine
        return found
    raise ConfigurationError(
        f"this Session binds no engine for {'stateguard' if table is None else table.name} "
        f"({'no binds' if not engines else f'per-model binds to {len(engines)} engines'}); bind "
        f"stateguard's tables where they live: Session(binds={{Base: engine, "
        f"**dict.fromkeys(stateguard.tables.metadata.sorted_tables, engine)}})"
    )


def value_integers(items: Iterable[tuple[str, Column[Any], Any]]) -> list[tuple[Column[Any], Any, str]]:
    """The int, str, Decimal and float values among ``(attr, column, value)`` items, as
    :func:`connection_for` checks them.

    A value of a plain ``String`` column that is not a str (bytes, an int, a
    UUID) is InvalidArgument here: drivers store it as they please (psycopg
    bytes as ``\\x..`` text, an int as its digits, asyncpg refuses it) or fail
    with an error that aborts a PostgreSQL transaction.
    """
    found = []
    for attr, col, value in items:
        kind = type(value)
        if (
            kind is not str
            and value is not None
            and not isinstance(value, str | ClauseElement)
            and isinstance(col.type, String)
            and not isinstance(col.type, Enum)
        ):
            raise InvalidArgument(
                f"values[{attr!r}] is for the text column {col.name}, so it must be a str, "
                f"got {kind.__name__} {value!r:.60}"
            )
        if kind is int or kind is str or (kind is not bool and isinstance(value, Decimal | float)):
            # A Decimal or float is checked against a NUMERIC(p, s) column's digits: the database
            # would round away extra decimal places, or refuse too many digits with an error that
            # aborts a PostgreSQL transaction.
            found.append((col, value, f"values[{attr!r}]"))
    return found


def check_string(info: _sql.ModelInfo, column: Column[Any] | None, value: str, what: str) -> None:
    """Raise InvalidArgument for a str no database would store as given.

    NUL (PostgreSQL refuses it in text; refused everywhere, so a model tested
    on SQLite refuses what production refuses), a lone surrogate (no UTF-8
    for it: the driver would raise UnicodeEncodeError), and for a value of a
    ``String(n)`` column more than ``n`` characters (PostgreSQL aborts the
    transaction, MariaDB refuses it in strict mode, SQLite would store it).
    """
    check_storable(value, f"{info.model.__name__} {what}")
    length = None if column is None else getattr(column.type, "length", None)
    if isinstance(length, int) and len(value) > length:
        raise InvalidArgument(
            f"{info.model.__name__} {what} is {len(value)} characters long; "
            f"column {column.name} holds at most {length}"  # type: ignore[union-attr]
        )


def key_bounds(conn: Connection, info: _sql.ModelInfo) -> tuple[tuple[int, int] | None, ...] | None:
    """The integer range of each primary-key column on ``conn``'s database (``None``: no integer key)."""
    backend = _sql.backend(conn.dialect)
    found = info.key_limits.get(backend)
    if found is None:
        bounds = tuple(_sql.integer_bounds(c, conn.dialect) for c in info.pk_columns)
        found = info.key_limits[backend] = bounds if any(bounds) else ()
    return found or None


def integer_limits(conn: Connection, column: Column[Any]) -> tuple[int, int] | None:
    """The integers ``column`` holds on ``conn``'s database (memoised); ``None`` for other columns."""
    memo_key = ("int-bounds", column, _sql.backend(conn.dialect))
    limits = memo.get(memo_key)
    if limits is None:
        limits = memo.put(memo_key, _sql.integer_bounds(column, conn.dialect) or ())
    return limits or None


def check_integer(conn: Connection, info: _sql.ModelInfo, column: Column[Any], value: Any, what: str) -> None:
    """Raise InvalidArgument when the int ``value`` does not fit ``column`` on ``conn``'s database."""
    if type(value) is not int:
        return
    limits = integer_limits(conn, column)
    if limits and not limits[0] <= value <= limits[1]:
        raise _out_of_range(info, column, value, limits, what)
    if not limits:
        # Not an integer column: an int for a NUMERIC(p, s) one must fit its p - s digits.
        check_exact(info, column, value, what)


def check_exact(info: _sql.ModelInfo, column: Column[Any], value: Decimal | float | int, what: str) -> None:
    """Raise InvalidArgument when ``value`` has more decimal places (or digits) than ``column`` stores.

    A ``Numeric(10, 2)`` column rounds ``0.004`` to ``0.00`` on assignment:
    ``decrement(..., by=Decimal("0.004"))`` would apply again and again while
    taking nothing.  Floats are judged by their shortest repr (``0.1`` has one
    decimal place).
    """
    digits = _sql.numeric_digits(column)
    if digits is None:
        return
    precision, scale = digits
    exact = value if isinstance(value, Decimal) else Decimal(value if isinstance(value, int) else repr(value))
    if not exact.is_finite():
        raise InvalidArgument(f"{what} must be a finite number, got {value!r}")
    exponent = exact.as_tuple().exponent
    places = -exponent if isinstance(exponent, int) and exponent < 0 else 0
    if places > scale:
        raise InvalidArgument(
            f"{info.model.__name__}.{column.name} stores {scale} decimal place(s); {what}={value!r} "
            f"has {places} and would be rounded by the database; nothing was sent"
        )
    if precision is not None and abs(exact) >= Decimal(10) ** (precision - scale):
        raise InvalidArgument(
            f"{info.model.__name__}.{column.name} is NUMERIC({precision}, {scale}): {what}={value!r} "
            f"has too many digits before the decimal point; nothing was sent"
        )


def _out_of_range(
    info: _sql.ModelInfo, column: Column[Any], value: int, limits: tuple[int, int], what: str
) -> InvalidArgument:
    return InvalidArgument(
        f"{info.model.__name__}.{column.name} cannot hold {value} ({what}): on this database it "
        f"holds integers from {limits[0]} to {limits[1]}; nothing was sent"
    )


def execute(conn: Connection, stmt: Any, params: Mapping[str, Any] | None = None) -> CursorResult[Any]:
    """Run ``stmt`` on ``conn``, turning retryable driver conflicts (and an already aborted
    transaction, missing stateguard tables) into our errors."""
    try:
        return conn.execute(stmt, params)
    except sa_exc.DBAPIError as error:
        mapped = _sql.conflict_error(error) or _sql.missing_own_table(error) or _sql.out_of_range(error)
        if mapped is None:
            raise
        raise mapped from error


#: Bytes of values one multi-row INSERT of :func:`insert_rows` carries at most (beyond its first
#: row): well under MySQL 5.7's default max_allowed_packet (4 MiB; MariaDB's is 16 MiB).
_INSERT_BYTES: Final = 2 << 20
#: What a row of :func:`insert_rows` takes besides its large value (other values, SQL, escapes).
_ROW_OVERHEAD: Final = 512


def insert_or_skip(backend: _sql.Backend, table: Any) -> Any:
    """``INSERT ... ON CONFLICT DO NOTHING`` into ``table`` (PostgreSQL, SQLite: ``backend.on_conflict``);
    add ``.values()`` and ``.returning()``."""
    dialect_insert = sqlite.insert if backend.name == "sqlite" else postgresql.insert
    return dialect_insert(table).on_conflict_do_nothing()


def insert_rows(conn: Connection, table: Any, rows: Sequence[Mapping[str, Any]], row_bytes: int = 0) -> None:
    """INSERT ``rows`` (mappings with the same keys) in as few multi-row statements as will go.

    Values may be SQL expressions (``db_now_ms()``).  One statement takes at
    most the dialect's bind-parameter limit (SQLAlchemy's
    ``insertmanyvalues_max_parameters``: 32,700, 999 on SQLite before 3.32;
    psycopg refuses a statement of more than 65,535) and, for rows carrying
    ``row_bytes`` of values each, about :data:`_INSERT_BYTES` (MySQL/MariaDB
    drop the connection on a statement over ``max_allowed_packet``, error 2006).
    """
    if not rows:
        return
    per = max(1, conn.dialect.insertmanyvalues_max_parameters // max(1, len(rows[0])))
    per = min(per, max(1, _INSERT_BYTES // (row_bytes + _ROW_OVERHEAD)))
    for start in range(0, len(rows), per):
        part = rows[start : start + per]
        if len(part) == 1:
            execute(conn, insert(table).values(part[0]))
        else:
            execute(conn, insert(table).values(list(part)))


def run_guarded(
    conn: Connection, stmt: Any, params: Mapping[str, Any], *, returning: bool, last_insert_id: bool = False
) -> tuple[bool, Sequence[Any] | None]:
    """Run a guarded UPDATE; ``(applied, values)``.

    ``returning``: the statement has a ``RETURNING`` clause, and the row it
    returns (not the row count, which psycopg reports as -1 in some cases)
    says whether it matched; ``values`` is that row.  Otherwise the affected
    row count decides, and with ``last_insert_id`` (MySQL/MariaDB, where
    ``SET v = LAST_INSERT_ID(expr)`` hands the new value back in the OK
    packet) ``values`` is ``(lastrowid,)``.
    """
    result = execute(conn, stmt, params)
    if returning:
        row = result.first()
        return row is not None, row
    if result.rowcount == 1:
        return True, (result.lastrowid,) if last_insert_id else None
    return False, None


class InsertOnce:
    """An INSERT that reports whether it created the row or found its unique key taken.

    PostgreSQL and SQLite: ``INSERT ... ON CONFLICT DO NOTHING RETURNING``;
    the returned row, not the row count (psycopg reports -1 for a skipped
    insert), says which.  MySQL/MariaDB have no exact single-statement form:
    ``INSERT IGNORE`` also turns strict-mode errors into warnings (a too-long
    key is truncated and may then look like a duplicate of another key), and
    because SQLAlchemy's MySQL dialects set the found-rows client flag,
    ``ON DUPLICATE KEY UPDATE pk = pk`` reports 1 for both outcomes.  There a
    plain INSERT runs and only a duplicate-key error (1062) means "taken";
    InnoDB rolls back just the failing statement, so the surrounding
    transaction stays usable with no SAVEPOINT round trips.

    ``values`` maps columns (or names) to bound parameters or SQL
    expressions; ``returning`` are the columns handed back for a new row
    (on MySQL: the primary key SQLAlchemy reports).  Built once per table and
    variant; each dialect's statement is built on first use.

    ``read`` and ``where`` (optional) name the row that holds the unique key
    and what to read of it: :meth:`insert_or_read` then hands back the
    existing row in the same statement where the database allows it.
    """

    __slots__ = ("_statements", "read", "returning", "table", "values", "where")

    def __init__(
        self,
        table: Table,
        values: Mapping[Any, Any],
        returning: Sequence[Column[Any]],
        *,
        read: Sequence[ColumnElement[Any]] = (),
        where: ColumnElement[bool] | None = None,
    ) -> None:
        self.table = table
        self.values = dict(values)
        self.returning = tuple(returning)
        self.read = tuple(read)
        self.where = where
        self._statements: dict[str, Any] = {}

    def _read_statement(self, backend: _sql.Backend) -> Any:
        """PostgreSQL: the INSERT in a CTE, and the existing row when it inserted nothing, in one statement.

        ``WITH ins AS (INSERT ... ON CONFLICT DO NOTHING RETURNING 1) SELECT (SELECT
        CAST(json_build_array(read) AS TEXT) FROM table WHERE key) WHERE NOT EXISTS (SELECT 1 FROM
        ins)``: no row when the INSERT created the row, else one row of one text column, the existing
        row's ``read`` values as a JSON array (NULL when the row that stopped the INSERT is not
        visible to the statement).  No row for the common case, one column rather than one per
        value, and text rather than json: the driver describes every result column and builds a
        loader per column at every execution (psycopg builds a Column object each, and a json
        loader costs more than a text one), and SQLAlchemy builds a Row per row fetched.
        """
        name = f"{backend.name}:read"
        stmt = self._statements.get(name)
        if stmt is None:
            if self.where is None or not self.read:
                raise TypeError("InsertOnce.insert_or_read needs read= and where=")
            inserted = (
                postgresql.insert(self.table)
                .values(self.values)
                .on_conflict_do_nothing()
                .returning(literal_column("1"))
                .cte("sg_inserted")
            )
            # The read goes through an alias: its columns render as ``sg_row.col``, not each
            # qualified by the table (with schema_translate_map, every qualified name is one more
            # substitution in the SQL text at every execution).
            row = self.table.alias("sg_row")
            to_row = sql_util.ClauseAdapter(row)
            existing = (
                select(cast(func.json_build_array(*(to_row.traverse(c) for c in self.read)), Text))
                .select_from(row)
                .where(to_row.traverse(self.where))
                .scalar_subquery()
            )
            claim = select(existing.label("sg_record")).where(
                ~select(literal_column("1")).select_from(inserted).exists()
            )
            # Frozen: run on every claim, and its cache key is costly to compute (a CTE and a subquery).
            stmt = self._statements[name] = frozen(claim)
        return stmt

    def insert_or_read(
        self, conn: Connection, params: Mapping[str, Any]
    ) -> tuple[bool, Sequence[Any] | None]:
        """Insert the row, or read the one that holds its key: ``(inserted, values)``.

        ``(True, None)``: this call inserted it.  ``(False, values)``: the key
        was taken and ``values`` are ``read`` of the holder (in order) as the
        statement saw it.  ``(False, None)``: taken, but not read here:
        MySQL/MariaDB and SQLite always (no single-statement form that does not
        write the existing row), and PostgreSQL when the INSERT waited for a
        twin that committed meanwhile (at READ COMMITTED the statement's
        snapshot predates the twin's row); the caller reads it with its own
        statement.  ``read`` values travel as JSON: strings, integers,
        booleans and NULLs come back as they are.
        """
        backend = _sql.backend(conn.dialect)
        if not backend.dml_cte:
            return self(conn, params) is not None, None
        row: Any = execute(conn, self._read_statement(backend), params).first()
        if row is None:
            return True, None
        record = row[0]
        if record is None:
            return False, None
        values: list[Any] = json.loads(record)
        return False, values

    def statement(self, backend: _sql.Backend) -> Any:
        """The INSERT this object runs on ``backend``."""
        stmt = self._statements.get(backend.name)
        if stmt is None:
            if backend.on_conflict:
                stmt = insert_or_skip(backend, self.table).values(self.values).returning(*self.returning)
            else:
                stmt = insert(self.table).values(self.values)
            self._statements[backend.name] = stmt
        return stmt

    def __call__(self, conn: Connection, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        """Run it: the ``returning`` values of the new row, or ``None`` when the key was taken."""
        backend = _sql.backend(conn.dialect)
        stmt = self.statement(backend)
        if backend.on_conflict:
            # A twin's uncommitted row with the same key makes this INSERT wait;
            # once the twin commits it does nothing (no row returned).
            row = execute(conn, stmt, params).first()
            return None if row is None else tuple(row)
        try:
            result = execute(conn, stmt, params)
        except sa_exc.IntegrityError as error:
            # InnoDB rolled back only this statement: the transaction stays usable.
            if _sql.is_duplicate_key(error):
                return None
            raise
        inserted = result.inserted_primary_key
        return tuple(inserted) if inserted is not None else ()


# --------------------------------------------------------------------------
# Loaded instances
# --------------------------------------------------------------------------


def identity_instance(session: Session, info: _sql.ModelInfo, key: tuple[Any, ...]) -> Any:
    """The instance for ``key`` already in the session's identity map, if any (no SQL)."""
    identity_map = session.identity_map
    if not len(identity_map):
        return None
    return identity_map.get((info.identity_class, key, None))


def sync_loaded(
    session: Session,
    info: _sql.ModelInfo,
    key: tuple[Any, ...],
    instance: Any,
    committed: Mapping[str, Any],
    expire: Iterable[str] = (),
) -> None:
    """Make the loaded instance of ``key`` (``instance``, or the identity map's) agree with the row.

    ``committed`` values are known exactly and become the instance's
    committed state (so a later ORM flush's version check uses the new
    version); the ``expire`` attributes were changed by SQL expressions and
    reload on access.  Nothing happens when the row is not loaded.

    Only an instance of this session is synced: one of another session, or a
    detached one, only named the row (its session would not expire it when
    this transaction or savepoint rolls back, so it would go on showing values
    the database never kept); this session's own instance of the row, if
    loaded, is synced instead.
    """
    if instance is None or instance_state(instance).session_id != session.hash_key:
        instance = identity_instance(session, info, key)
        if instance is None:
            return
    for attr, value in committed.items():
        set_committed_value(instance, attr, value)
    expire = [a for a in expire if a not in committed]
    if expire and instance in session:
        session.expire(instance, expire)
    _journal(session, info, instance, (*committed, *expire))


# --------------------------------------------------------------------------
# Savepoints and loaded instances
# --------------------------------------------------------------------------
#
# A value synced into a loaded instance inside a SAVEPOINT is only true while
# that savepoint stands.  When it is rolled back (reserve() ending
# INSUFFICIENT, an idempotent() block that raises, the user's own
# begin_nested()), the row is back to its old value but the instance still
# holds the new one, and its next flush would write it back: a lost update.
# The Session itself cannot know (set_committed_value does not make the
# instance dirty, and reserve() uses a Connection-level savepoint), so each
# connection keeps a journal of what was synced under each open savepoint,
# fed by SQLAlchemy's savepoint events, and a rolled-back savepoint expires
# those attributes: they reload from the database on the next access.

# Both live in the Connection object's own __dict__: Connection.info belongs to the pooled DBAPI
# connection (it outlives the Connection and is three properties deep), and a Connection lives
# for one Session transaction.  A Connection the application keeps across transactions is why
# the journal is tagged with the root transaction it belongs to.
_JOURNAL: Final = "_stateguard_savepoints"
_DEFERRED: Final = "_stateguard_deferred_savepoint"


def _frames(conn: Connection, *, create: bool = False) -> list[Any] | None:
    """The savepoint journal of ``conn``'s current transaction: ``[(name, [(session, instance,
    attrs), ...]), ...]``, outermost first; ``None`` when there is none (one left by an earlier
    transaction of the same Connection reads as none)."""
    state = conn.__dict__
    entry: tuple[Any, list[Any]] | None = state.get(_JOURNAL)
    root = conn._transaction
    if entry is None or entry[0] is not root:
        if not create or root is None:
            return None
        entry = state[_JOURNAL] = (root, [])
    return entry[1]


def _open_savepoints(conn: Connection) -> list[str]:
    """The names of the savepoints open on ``conn``, outermost first (SQLAlchemy's own chain)."""
    names: list[str] = []
    nested = conn._nested_transaction
    while nested is not None:
        names.append(nested._savepoint)
        nested = nested._previous_nested
    names.reverse()
    return names


def _journal(session: Session, info: _sql.ModelInfo, instance: Any, attrs: tuple[str, ...]) -> None:
    if not attrs:
        return
    conn = session.connection(bind_arguments=info.bind_arguments)
    if conn._nested_transaction is None:
        # A whole-transaction rollback expires every loaded instance already (Session.rollback).
        return
    hook_engine(conn)
    stack = _frames(conn, create=True)
    if stack is None:
        return
    known = {frame[0] for frame in stack}
    missing: list[tuple[str, list[Any]]] = [(n, []) for n in _open_savepoints(conn) if n not in known]
    if missing:
        # Opened before stateguard's hooks were on this engine (the application's begin_nested()
        # before its first guarded write), so never announced to them; everything since was, so
        # these are the outermost.
        stack[:0] = missing
    stack[-1][1].append((session, instance, attrs))


def _pop_to(conn: Connection, name: str) -> list[Any]:
    """Remove the frame of savepoint ``name`` and any still open inside it; what they journaled."""
    stack = _frames(conn)
    entries: list[Any] = []
    if not stack or all(frame_name != name for frame_name, _ in stack):
        return entries
    while stack:
        frame_name, frame = stack.pop()
        entries.extend(frame)
        if frame_name == name:
            break
    return entries


def _savepoint_statement(conn: Connection, statement: str) -> str | None:
    """Journal a ``SAVEPOINT`` / ``RELEASE SAVEPOINT`` / ``ROLLBACK TO SAVEPOINT`` about to be sent;
    the savepoint's name (``None``: not such a statement)."""
    words = statement.split()
    if len(words) == 2 and words[0] == "SAVEPOINT":
        stack = _frames(conn, create=True)
        if stack is not None:
            stack.append((words[1], []))
        return words[1]
    if len(words) == 3 and words[0] == "RELEASE" and words[1] == "SAVEPOINT":
        # Released: its syncs now stand or fall with the enclosing savepoint (or transaction).
        entries = _pop_to(conn, words[2])
        stack = _frames(conn)
        if stack and entries:
            stack[-1][1].extend(entries)
        return words[2]
    if len(words) == 4 and words[0] == "ROLLBACK" and words[1] == "TO" and words[2] == "SAVEPOINT":
        for session, instance, attrs in _pop_to(conn, words[3]):
            if instance in session:
                session.expire(instance, list(attrs))
        return words[3]
    return None


# --------------------------------------------------------------------------
# The statement hook, registered per engine on first use
# --------------------------------------------------------------------------
#
# One dialect-level hook (do_execute and its two siblings: each statement
# about to reach the cursor) journals savepoints and opens a deferred one.
# It is registered on an engine's dialect the first time stateguard needs it
# there (a loaded instance synced inside a savepoint, a deferred savepoint),
# never on a class: an engine stateguard never wrote through pays nothing,
# and on one it did the application's statements pay one short call each.
# A dialect hook, not a Connection event: any Connection-level listener
# makes SQLAlchemy build a joined event dispatcher for every new Connection
# of the engine (about a third more Python calls for a one-statement
# transaction); the dialect's dispatch is built once.

_HOOKED: Final[weakref.WeakSet[Any]] = weakref.WeakSet()
_HOOK_LOCK: Final = threading.Lock()


def hook_engine(conn: Connection) -> None:
    """Make sure stateguard's statement hook is registered on ``conn``'s engine (once per dialect)."""
    dialect = conn.dialect
    if dialect in _HOOKED:
        return
    with _HOOK_LOCK:
        if dialect in _HOOKED:
            return
        event.listen(dialect, "do_execute", _on_execute)
        event.listen(dialect, "do_executemany", _on_execute)
        event.listen(dialect, "do_execute_no_params", _on_execute_no_params)
        _HOOKED.add(dialect)


def hooked(engine: Engine) -> bool:
    """Whether stateguard's statement hook is registered on ``engine`` (for tests)."""
    return engine.dialect in _HOOKED


def _on_execute(cursor: Any, statement: str, parameters: Any, context: Any) -> bool:
    conn: Connection = context.root_connection
    head = statement[:9]
    if head == "SAVEPOINT" or head == "RELEASE S" or head == "ROLLBACK ":
        _before_savepoint_statement(conn, statement)
    elif _DEFERRED in conn.__dict__:
        _open_deferred(conn)
    return False  # not executed here: SQLAlchemy sends the statement


def _on_execute_no_params(cursor: Any, statement: str, context: Any) -> bool:
    return _on_execute(cursor, statement, None, context)


def _before_savepoint_statement(conn: Connection, statement: str) -> None:
    # SQLAlchemy's own savepoint management (SAVEPOINT sa_savepoint_1 ..., sent when a Session
    # provisions one) does not open the block's savepoint: a nested transaction the block begins
    # is the block savepoint's child, and SQLAlchemy sends the parent's SAVEPOINT first.  A
    # savepoint the application sends itself (exec_driver_sql("SAVEPOINT mine")) is a statement
    # of the block like any other: the block's savepoint goes out before it, so releasing or
    # rolling back to it cannot take the block's savepoint with it.
    words = statement.split(None, 4)
    name = words[-1] if len(words) >= 2 else ""
    if _DEFERRED in conn.__dict__ and not name.lower().startswith("sa_savepoint_"):
        _open_deferred(conn)
    _savepoint_statement(conn, statement)


def _open_deferred(conn: Connection) -> None:
    deferred: DeferredSavepoint = conn.__dict__.pop(_DEFERRED)
    if deferred._paused:
        conn.__dict__[_DEFERRED] = deferred
        return
    # Forgotten here: one left by an earlier transaction of this Connection is not opened.
    if deferred._root is conn._transaction:
        deferred.open()


# --------------------------------------------------------------------------
# Checks of keys and values (nothing is sent before they pass)
# --------------------------------------------------------------------------


def _bad_key(info: _sql.ModelInfo, target: Any, why: str) -> InvalidArgument:
    pk = ", ".join(
        f"{c.name}: {t.__name__ if t else '?'}" for c, t in zip(info.pk_columns, info.pk_checks, strict=True)
    )
    return InvalidArgument(
        f"{info.model.__name__}: {target!r} is not a valid target ({why}); pass a primary key "
        f"({pk}){' as a tuple' if len(info.pk_columns) > 1 else ''} or a loaded "
        f"{info.model.__name__} instance"
    )


def check_key_value(info: _sql.ModelInfo, value: Any, i: int, target: Any) -> None:
    """Raise InvalidArgument unless ``value`` fits primary-key column ``i`` of ``info``'s model."""
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


def resolve_target(session: Session | None, info: _sql.ModelInfo, target: Any) -> tuple[tuple[Any, ...], Any]:
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


def split_values(
    info: _sql.ModelInfo,
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


def check_fence(info: _sql.ModelInfo, fence: Any) -> None:
    """Raise InvalidArgument unless the model has a fence column and ``fence`` is a fencing token."""
    if info.fence_column is None:
        raise InvalidArgument(
            f"{info.model.__name__} has no fence column, so fence= cannot be checked; "
            f"declare one with fence_column()"
        )
    if type(fence) is not int or fence < 0:
        raise InvalidArgument(f"fence must be a non-negative int (a fencing token), got {fence!r}")


def check_text(value: Any, what: str, limit: int) -> str:
    """``value`` if it is a non-blank str of at most ``limit`` characters without NUL, else InvalidArgument.

    Keys are stored as given (no stripping, no case folding), so ``"a"`` and
    ``"a "`` are two keys; a blank key is almost always a client bug.
    """
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be a str, got {type(value).__name__}")
    if not value or value.isspace():  # blank: what strip() would empty, without building a copy
        raise InvalidArgument(f"{what} must not be blank, got {value!r}")
    if len(value) > limit:
        raise InvalidArgument(f"{what} is {len(value)} characters long; the limit is {limit}")
    check_storable(value, what)
    return value


def json_encoder(*, sort_keys: bool = False) -> Callable[[Any], str]:
    """A function that turns a value into strict, compact JSON text (no NaN or Infinity, UTF-8 kept).

    The same text and the same errors as ``json.JSONEncoder(...).encode``, which builds a new C
    encoder (and a closure) at every call: this one is built once.  It skips the encoder's
    circular-reference bookkeeping (a dict of ids per call); a value that refers to itself ends in
    RecursionError, and only then is the standard encoder asked, so a cycle is reported as the
    ValueError it gives (and a value nested too deeply as its RecursionError).
    """
    standard = json.JSONEncoder(
        sort_keys=sort_keys, allow_nan=False, ensure_ascii=False, separators=(",", ":")
    )
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - CPython always has the C encoder
        return standard.encode
    fast = make(
        None, standard.default, json.encoder.encode_basestring, None, ":", ",", sort_keys, False, False
    )
    join = "".join

    def encode(value: Any) -> str:
        try:
            return join(fast(value, 0))
        except RecursionError:
            return standard.encode(value)

    return encode


#: Compact JSON text as stateguard stores it (no NaN or Infinity: other JSON readers refuse them).
dumps_json: Final = json_encoder()


def json_text(value: Any, what: str, max_depth: int) -> str:
    """``value`` as the JSON text stateguard stores (:func:`dumps_json`), or InvalidArgument before any
    statement: non-str object keys or nesting past ``max_depth`` (:func:`check_json_shape`), what JSON
    cannot carry (NaN, Infinity, sets, objects), and lone surrogates (no UTF-8 for them; MariaDB's
    JSON_VALID refuses even their escapes)."""
    check_json_shape(value, what, max_depth)
    try:
        text = dumps_json(value)
    except (TypeError, ValueError, RecursionError) as error:
        raise InvalidArgument(
            f"{what} must be JSON-serialisable (dict, list, str, int, finite float, bool, None): "
            f"{error}; nothing was written"
        ) from None
    return check_storable(text, what)


def check_json_shape(value: Any, what: str, max_depth: int) -> None:
    """Refuse what JSON would change or could not carry: non-str object keys (JSON turns ``1`` into
    ``"1"``), nesting past ``max_depth`` (InvalidArgument; nothing was written)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            if depth >= max_depth:
                raise InvalidArgument(f"{what} nests deeper than {max_depth} levels; nothing was written")
            for k, v in item.items():
                if not isinstance(k, str):
                    raise InvalidArgument(
                        f"{what} object keys must be str (JSON would turn {k!r} into a string); "
                        f"nothing was written"
                    )
                stack.append((v, depth + 1))
        elif isinstance(item, list | tuple):
            if depth >= max_depth:
                raise InvalidArgument(f"{what} nests deeper than {max_depth} levels; nothing was written")
            stack.extend((v, depth + 1) for v in item)


def check_storable(value: str, what: str) -> str:
    """``value`` unless it holds a NUL or a lone surrogate (no database stores either: InvalidArgument)."""
    if "\x00" in value:
        raise InvalidArgument(f"{what} must not contain NUL characters")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            message = f"{what} contains a lone surrogate ({error.reason}): {value!r:.80}"
            raise InvalidArgument(message) from None
    return value


#: Texts shorter than this (in characters, 4 UTF-8 bytes each at most) are not checked against
#: the server's statement size: a max_allowed_packet under 256 KiB is not supported (MariaDB's
#: default is 16 MiB, MySQL's 64 MiB).
_SIZE_CHECK_FROM: Final = 16 * 1024
#: What a statement needs besides the checked text (keys, other values, SQL).
_STATEMENT_OVERHEAD: Final = 16 * 1024
_PACKET_INFO: Final = "stateguard.max_allowed_packet"
_MAX_PACKET: Final = text("SELECT @@max_allowed_packet")


def needs_size_check(conn: Connection, value: str) -> bool:
    """Whether :func:`check_statement_size` has anything to check (a large text on MySQL/MariaDB)."""
    return len(value) >= _SIZE_CHECK_FROM and conn.dialect.name in ("mysql", "mariadb")


def check_statement_size(conn: Connection, value: str, what: str) -> None:
    """Raise InvalidArgument when ``value`` cannot travel in one statement to ``conn``'s server.

    MySQL/MariaDB refuse a statement longer than ``max_allowed_packet`` with
    error 1153 and drop the connection (the transaction is gone).  The limit
    is read once per DBAPI connection, only for large texts; the MySQL
    drivers escape ``\\ ' " NUL \\n \\r ^Z`` client-side, so those count twice.
    PostgreSQL (1 GB per value) and SQLite (1e9 bytes) need no check here.
    """
    if len(value) < _SIZE_CHECK_FROM or conn.dialect.name not in ("mysql", "mariadb"):
        return
    info = conn.info
    packet = info.get(_PACKET_INFO)
    if packet is None:
        packet = info[_PACKET_INFO] = int(execute(conn, _MAX_PACKET).scalar_one())
    size = len(value.encode("utf-8")) + sum(value.count(c) for c in "\\'\"\x00\n\r\x1a")
    if size + _STATEMENT_OVERHEAD > packet:
        raise InvalidArgument(
            f"{what} is {size} bytes as sent; this server accepts statements of at most {packet} bytes "
            f"(max_allowed_packet): store less, or raise max_allowed_packet; nothing was sent"
        )


_ONE_MS: Final = timedelta(milliseconds=1)


def duration_ms(value: Any, what: str) -> int:
    """A positive :class:`~datetime.timedelta` as whole milliseconds, else InvalidArgument."""
    if not isinstance(value, timedelta):
        raise InvalidArgument(f"{what} must be a datetime.timedelta, got {value!r}")
    ms = value // _ONE_MS
    if ms < 1:
        raise InvalidArgument(f"{what} must be at least 1 millisecond, got {value!r}")
    return ms


def seconds(value: Any, what: str, *, allow_zero: bool) -> float | None:
    """Seconds (an int, a float or a :class:`~datetime.timedelta`) as a float; ``None`` stays ``None``.

    Negative, NaN or (unless ``allow_zero``) zero durations and any other
    type are InvalidArgument.
    """
    if value is None:
        return None
    if isinstance(value, timedelta):
        result = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        result = float(value)
    else:
        raise InvalidArgument(f"{what} must be seconds (int or float) or a timedelta, got {value!r}")
    if result < 0 or (result == 0 and not allow_zero) or result != result:
        raise InvalidArgument(f"{what} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return result


def required_seconds(value: Any, what: str) -> float:
    """A finite positive duration in seconds; ``None``, infinity and what :func:`seconds` refuses are
    InvalidArgument (no ``assert``: validation must also hold under ``python -O``)."""
    if value is None:
        raise InvalidArgument(f"{what} is required: pass seconds (int or float) or a timedelta")
    result = seconds(value, what, allow_zero=False)
    if result is None or result == float("inf"):
        raise InvalidArgument(f"{what} must be a finite duration, got {value!r}")
    return result


#: The largest LIMIT every database takes (a BIGINT); a larger batch or limit means "all" anyway.
MAX_LIMIT: Final = 2**63 - 1


def check_batch(batch: Any, what: str = "batch") -> int:
    """``batch`` if it is a positive int (at most :data:`MAX_LIMIT`: a larger one is that), else
    InvalidArgument."""
    if type(batch) is not int or batch < 1:
        raise InvalidArgument(f"{what} must be a positive int, got {batch!r}")
    return min(batch, MAX_LIMIT)


def now_ms() -> int:
    """The application's clock in integer epoch milliseconds."""
    return time.time_ns() // 1_000_000


# --------------------------------------------------------------------------
# Transactions and savepoints
# --------------------------------------------------------------------------


def ensure_real_transaction(conn: Connection) -> None:
    """Make sure the driver really has a transaction open before a SAVEPOINT.

    Python's sqlite3 (with its default, legacy transaction control) does not
    send BEGIN before a SAVEPOINT: the SAVEPOINT then starts its own
    transaction and RELEASE commits it, long before the session commits.
    Opening the transaction explicitly keeps the savepoint nested in it.
    """
    if _sql.backend(conn.dialect).driver_begins_lazily and not _driver_in_transaction(conn):
        # Its callers (reserve, idempotent) write next: under sqlite_engine(begin="auto") the
        # transaction they start takes the write lock here, outside their savepoint.
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.info.get(BEGIN_MARK) == PENDING else "BEGIN")


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


class DeferredSavepoint:
    """A Session SAVEPOINT sent only when something else runs a statement on the connection.

    ``session.begin_nested()`` is lazy already for the Session's own use (the
    SAVEPOINT goes out when the savepoint first needs its connection); this
    also covers a statement sent on the Connection directly (one fetched
    before, ``exec_driver_sql`` ...): the statement hook opens the savepoint
    first.  Statements sent inside :meth:`paused` do not open it.
    So a block that sends nothing costs no SAVEPOINT and no RELEASE, and a
    block that does has all of its statements inside the savepoint, rolled
    back with it.  :meth:`close` (or the end of the transaction) forgets it.
    """

    __slots__ = ("_bind_arguments", "_conn", "_paused", "_root", "nested", "session")

    def __init__(self, session: Session, conn: Connection, bind_arguments: dict[str, Any]) -> None:
        self.session = session
        self._conn = conn
        self._bind_arguments = bind_arguments
        self._paused = False
        self.nested = session.begin_nested()
        self._root = conn._transaction
        hook_engine(conn)
        conn.__dict__[_DEFERRED] = self

    def open(self) -> None:
        """Send the SAVEPOINT now (no-op if it is out already or the savepoint has ended)."""
        self.close()
        if self.nested.is_active:
            self._paused = True
            try:
                ensure_real_transaction(self._conn)
                self.session.connection(bind_arguments=self._bind_arguments)
            finally:
                self._paused = False

    def paused(self) -> DeferredSavepoint:
        """``with savepoint.paused() as conn``: the connection, for stateguard's own statements that
        must not open the savepoint (a plain class, not a generator: it runs on every call)."""
        return self

    def __enter__(self) -> Connection:
        self._paused = True
        return self._conn

    def __exit__(self, *exc_info: object) -> None:
        self._paused = False

    def close(self) -> None:
        """Stop watching the connection (the savepoint itself is left as it is)."""
        state = self._conn.__dict__
        if state.get(_DEFERRED) is self:
            del state[_DEFERRED]

    def end(self) -> None:
        """The block succeeded: stop watching, and commit the savepoint (RELEASE only if it was sent).

        A savepoint nothing ran in (no connection of any bind joined it, nothing is pending to
        flush, and it is still the session's innermost transaction) is only closed:
        ``SessionTransaction.commit()`` would flush, fire ``before_commit`` and merge an empty
        snapshot into its parent, three times the cost of the whole bookkeeping.
        """
        self.close()
        nested = self.nested
        if not nested.is_active:
            return
        session = self.session
        # SQLAlchemy's own attributes, read with fallbacks that take the commit() path: the
        # SessionTransaction's connections, the session's innermost transaction, and
        # Session._is_clean() (nothing new, deleted or modified: what flush() checks first).
        is_clean = getattr(session, "_is_clean", None)
        if (
            not getattr(nested, "_connections", True)
            and getattr(session, "_transaction", None) is nested
            and is_clean is not None
            and is_clean()
        ):
            nested.close()
        else:
            nested.commit()


def _driver_in_transaction(conn: Connection) -> bool:
    """Whether SQLite's driver has a transaction open (sqlite3, or aiosqlite under SQLAlchemy's adapter)."""
    dbapi_conn = conn.connection.dbapi_connection
    flag = getattr(dbapi_conn, "in_transaction", None)
    if flag is None:
        # SQLAlchemy's aiosqlite adapter does not expose it; the aiosqlite
        # connection it wraps does (read from sqlite3's connection).
        flag = getattr(getattr(dbapi_conn, "_connection", None), "in_transaction", None)
    return True if flag is None else bool(flag)


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
    if _sql.backend(conn.dialect).driver_begins_lazily and not _driver_in_transaction(conn):
        execute(conn, _BEGIN_IMMEDIATE)


_BEGIN_IMMEDIATE = text("BEGIN IMMEDIATE")


# --------------------------------------------------------------------------
# Expired rows of the key tables
# --------------------------------------------------------------------------


def purge_rows(
    table: Table,
    bind: Engine | Connection | Session,
    batch: Any,
    old: ColumnElement[bool] | None = None,
    **params: Any,
) -> int:
    """Delete at most ``batch`` rows of ``table`` matching ``old`` (default: ``expires_ms`` has
    passed); return how many.  ``params`` are the bound values ``old`` names.

    Ages are judged on the database's clock (:func:`~stateguard._sql.db_now_ms`),
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
    backend = _sql.backend(conn.dialect)
    batch = params["sg_batch"]
    key = ("purge", table, backend, batch if backend.delete_limit_literal else 0)
    stmt = memo.get_or_build(key, lambda: _sql.purge_statement(table, backend, batch, old))
    return int(execute(conn, stmt, params).rowcount)


def stored_key(conn: Connection, info: _sql.ModelInfo, key: tuple[Any, ...]) -> tuple[Any, ...]:
    """``key`` as the row spells it, where the database matches text keys inexactly (else ``key``).

    On MariaDB/MySQL with a case-insensitive collation ``'SKU-A'`` updates
    the row ``'sku-a'``: the transition log, the counter ledger and the
    outbox must record the row's own spelling, or one ref (or request id)
    applies once per spelling and one row's events get several keys.  One
    primary-key read, only for such models and only where a ref, a request
    id or an event needs it.
    """
    backend = _sql.backend(conn.dialect)
    flag = memo.get(("inexact-key", info, backend))
    if flag is None:
        flag = memo.put(("inexact-key", info, backend), _sql.inexact_text_key(info, conn.dialect))
    if not flag:
        return key
    stmt = memo.get(("stored-key", info))
    if stmt is None:
        stmt = memo.put(("stored-key", info), select(*info.pk_columns).where(info.pk_where))
    row = execute(conn, stmt, info.key_params(key)).first()
    return key if row is None else tuple(row)


def read_back(info: _sql.ModelInfo, columns: Sequence[Column[Any]], backend: _sql.Backend) -> Any:
    """The memoised ``SELECT columns WHERE pk`` that sees what an UPDATE just saw (a 0-row follow-up)."""
    key = ("read", info, tuple(columns), backend.locking_read)
    stmt = memo.get(key)
    if stmt is None:
        stmt = memo.put(key, _sql.read_statement(info, columns, backend))
    return stmt
