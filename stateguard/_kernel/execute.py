"""Running a guarded write: the session's connection for a model, one statement, its outcome.

:func:`connection_for` flushes, honours per-model binds and checks keys and
values against this database before anything is sent; :func:`execute` runs a
statement and turns driver errors into typed ones (:mod:`.errors`);
:func:`run_guarded` decodes what a guarded UPDATE said (a ``RETURNING`` row,
the affected-row count, or MySQL's ``LAST_INSERT_ID``); :class:`InsertOnce`
inserts or detects a taken key on every dialect without poisoning the
transaction.  The SQLite helpers at the end make its driver's lazy BEGIN
behave like the other databases' transactions.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal
from typing import Any, Final

from sqlalchemy import (
    Column,
    Connection,
    CursorResult,
    Engine,
    Executable,
    Insert,
    Table,
    Text,
    cast,
    event,
    func,
    insert,
    literal_column,
    select,
    text,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Session
from sqlalchemy.sql import util as sql_util
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.lambdas import StatementLambdaElement

from ..engine import BEGIN_MARK, PENDING
from ..exceptions import ConfigurationError, InvalidArgument, StateguardError
from .backend import Backend, is_galera
from .backend import backend as backend_of
from .checks import check_exact, check_integer, check_string, key_bounds, out_of_range_error
from .errors import conflict_error, is_duplicate_key, missing_own_table, out_of_range
from .memo import frozen, memo
from .models import ModelInfo, inexact_text_key
from .statements import insert_or_skip

__all__ = [
    "SIZE_CHECK_FROM",
    "InsertOnce",
    "check_statement_size",
    "connection_for",
    "connection_for_key",
    "ensure_causal_writes",
    "ensure_real_transaction",
    "execute",
    "insert_rows",
    "mapped_error",
    "needs_size_check",
    "own_bind",
    "own_connection",
    "run_guarded",
    "sqlite_write_lock",
    "stored_key",
]

# --------------------------------------------------------------------------
# Connections
# --------------------------------------------------------------------------


def connection_for(
    session: Session,
    info: ModelInfo,
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
    backend = backend_of(conn.dialect)
    if keys:
        # The memo key_bounds fills, read here first: this runs on every guarded write.
        bounds = info.key_limits.get(backend)
        if bounds is None:
            bounds = key_bounds(conn, info) or ()
        if bounds:
            for key in keys:
                for value, column, limits in zip(key, info.pk_columns, bounds, strict=True):
                    if limits is not None and type(value) is int and not limits[0] <= value <= limits[1]:
                        raise out_of_range_error(info, column, value, limits, "primary key")
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
    # Connection.info is three properties deep: asked only where sqlite_engine() can have set it.
    if backend.driver_begins_lazily and conn.info.get(BEGIN_MARK) == PENDING:
        # sqlite_engine(begin="auto"): a stateguard write starts this
        # transaction, and may read before it writes; take the write lock now.
        sqlite_write_lock(conn)
    if backend.may_be_galera:
        ensure_causal_writes(conn)
    return conn


def connection_for_key(session: Session, info: ModelInfo, value: Any) -> tuple[Connection, Backend]:
    """:func:`connection_for` for one row named by a one-column key ``value``, and the connection's Backend.

    The same flush, binds and checks, written out for the most frequent guarded
    write (a trigger fired on one scalar primary key): no tuples of keys to walk.
    """
    if session.autoflush:
        session.flush()
    conn = session.connection(bind_arguments=info.bind_arguments)
    backend = backend_of(conn.dialect)
    bounds = info.key_limits.get(backend)
    if bounds is None:
        bounds = key_bounds(conn, info) or ()
    if bounds:
        limits = bounds[0]
        if limits is not None and type(value) is int and not limits[0] <= value <= limits[1]:
            raise out_of_range_error(info, info.pk_columns[0], value, limits, "primary key")
    if info.text_key and type(value) is str:
        check_string(info, None, value, "primary key")
    if backend.driver_begins_lazily and conn.info.get(BEGIN_MARK) == PENDING:
        sqlite_write_lock(conn)
    if backend.may_be_galera:
        ensure_causal_writes(conn)
    return conn, backend


def own_connection(session: Session, table: Table | None) -> Connection:
    """The session's connection for ``table``, one of stateguard's own tables (:func:`own_bind`)."""
    conn = session.connection(bind_arguments={"bind": own_bind(session, table)})
    if backend_of(conn.dialect).may_be_galera:
        ensure_causal_writes(conn)
    return conn


#: Key in the pooled DBAPI connection's ``info`` (kept across checkouts, cleared when the
#: connection is replaced): stateguard has raised this connection's ``wsrep_sync_wait``.
CAUSAL_MARK: Final = "stateguard.causal"
#: The ``wsrep_sync_wait`` bits stateguard needs: 1 (reads: SELECT, BEGIN), 2 (UPDATE, DELETE) and
#: 4 (INSERT, REPLACE).  MariaDB waits only for a transaction's first statement (and for each
#: autocommit one), so whatever statement begins a transaction must wait: a transaction begun by
#: an INSERT (the application's row, flushed by stateguard's own call) left the guarded UPDATE
#: after it unwaited, and its REJECTED on a lagging node committed.
CAUSAL_BITS: Final = 7


def ensure_causal_writes(conn: Connection) -> None:
    """On a Galera node, make ``conn``'s UPDATEs and reads wait until the node has applied every
    write the cluster committed before them (``wsrep_sync_wait`` bits 1, 2 and 4); elsewhere nothing.

    A Galera node applies the writesets of the other nodes asynchronously: a
    conditional UPDATE on a node that has not applied a transition committed
    elsewhere matches 0 rows and reads the old state, and stateguard would
    answer REJECTED, STALE or NOT_FOUND for a change the cluster has made.  (A
    write that *matches* a stale row is safe: certification fails it at COMMIT
    with 1213, DeadlockDetected.)  Setting ``wsrep_sync_wait`` for the
    classifying read alone is not enough: the UPDATE itself has to wait.

    Sent once per pooled DBAPI connection (``SET SESSION wsrep_sync_wait =
    @@session.wsrep_sync_wait | 7``: bits the application set are kept): on the
    first stateguard call through it, and, once an engine is known to be a
    Galera node, at the checkout of each of its connections not raised yet
    (a new one, one the pool replaced, one whose setting the application
    lowered), before the transaction's first statement.  MariaDB waits only at
    a transaction's first statement, so a SET sent by stateguard's first call
    in a transaction that the application's own read began comes too late for
    that transaction; raising at checkout closes that for every connection
    after the engine's first.  The SET is session state: the application's own
    statements on those connections wait too (see
    docs/explanation/clusters-galera.md).
    """
    record = conn.connection.info
    if CAUSAL_MARK in record:
        return
    if is_galera(conn):
        _watch_session_settings(conn.engine)
        conn.exec_driver_sql(f"SET SESSION wsrep_sync_wait = @@session.wsrep_sync_wait | {CAUSAL_BITS}")
    record[CAUSAL_MARK] = True


#: A SET naming ``wsrep_sync_wait`` (the application's own ``SET SESSION wsrep_sync_wait = 0``
#: for a fast read, ``= DEFAULT``, ``SET @@wsrep_sync_wait``): the mark is dropped before it runs.
#: Reads of the variable (``SELECT @@session.wsrep_sync_wait``) keep it.
_SETS_SYNC_WAIT: Final = re.compile(r"\s*SET\b[^;]*wsrep_sync_wait", re.IGNORECASE)
_watched: weakref.WeakSet[Engine] = weakref.WeakSet()
_watched_lock = threading.Lock()


def _watch_session_settings(engine: Engine) -> None:
    """Forget :data:`CAUSAL_MARK` on a connection of ``engine`` whenever a statement sent through
    it sets ``wsrep_sync_wait``, so stateguard's next call there raises the bits again.

    The mark says "this session waits"; an application that lowers the setting on a pooled
    connection stateguard raised earlier (its own reads need not wait) would otherwise leave
    stateguard's later UPDATEs there unwaited, and a lagging node would answer REJECTED,
    NOT_FOUND or STALE for changes the cluster has made, silently.  Statements sent on the raw
    DBAPI connection are not seen (SQLAlchemy's events only see its own).
    """
    base: Engine = getattr(engine, "_proxied", engine)  # Engine.execution_options(): the engine
    with _watched_lock:
        if base in _watched:
            return
        _watched.add(base)
    dialect = base.dialect

    def raise_at_checkout(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        _raise_at_checkout(dialect, dbapi_connection, record)

    event.listen(base, "before_cursor_execute", _forget_raise)
    event.listen(base, "checkout", raise_at_checkout)


def _forget_raise(conn: Connection, cursor: Any, statement: str, *args: Any) -> None:
    if _SETS_SYNC_WAIT.match(statement) is not None:
        conn.connection.info.pop(CAUSAL_MARK, None)


def _raise_at_checkout(dialect: Dialect, dbapi_connection: Any, record: Any) -> None:
    """A Galera engine's connection, as the pool hands it out: raised before anything runs on it.

    A transaction that the application begins with its own read (``s.get(Order, 1)``, then a
    guarded call) waits at that read; raised only by the guarded call, it would not wait at all.
    The DBAPI cursor, not SQLAlchemy's Connection (there is none yet at checkout).

    A pooled connection the server dropped meanwhile (a node restarted, the connection killed)
    fails the SET: that is a :class:`~sqlalchemy.exc.DisconnectionError`, on which the pool
    replaces the connection and hands out a new one, raised in turn (as ``pool_pre_ping`` does;
    nothing has run on it yet, so nothing is lost).  Any other error propagates.
    """
    info = record.info
    if CAUSAL_MARK in info:
        return
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"SET SESSION wsrep_sync_wait = @@session.wsrep_sync_wait | {CAUSAL_BITS}")
    except dialect.loaded_dbapi.Error as error:
        if dialect.is_disconnect(error, dbapi_connection, cursor):
            raise sa_exc.DisconnectionError(
                f"stateguard could not raise wsrep_sync_wait on a pooled connection: {error}"
            ) from error
        raise
    finally:
        with contextlib.suppress(Exception):  # a dropped connection's cursor may fail to close
            cursor.close()
    info[CAUSAL_MARK] = True


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


# --------------------------------------------------------------------------
# Execution
# --------------------------------------------------------------------------


def execute(conn: Connection, stmt: Executable, params: Mapping[str, Any] | None = None) -> CursorResult[Any]:
    """Run ``stmt`` on ``conn``, turning retryable driver conflicts (and an already aborted
    transaction, missing stateguard tables) into our errors."""
    try:
        return conn.execute(stmt, params)
    except sa_exc.DBAPIError as error:
        mapped = mapped_error(error)
        if mapped is None:
            raise
        raise mapped from error


def mapped_error(error: sa_exc.DBAPIError) -> StateguardError | None:
    """What :func:`execute` raises instead of ``error`` (``None``: the driver's error itself)."""
    return conflict_error(error) or missing_own_table(error) or out_of_range(error)


#: Bytes of values one multi-row INSERT of :func:`insert_rows` carries at most (beyond its first
#: row): well under MySQL 5.7's default max_allowed_packet (4 MiB; MariaDB's is 16 MiB).
_INSERT_BYTES: Final = 2 << 20
#: What a row of :func:`insert_rows` takes besides its large value (other values, SQL, escapes).
_ROW_OVERHEAD: Final = 512


def insert_rows(
    conn: Connection, table: Table, rows: Sequence[Mapping[str, Any]], row_bytes: int = 0
) -> None:
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
    conn: Connection,
    stmt: Executable,
    params: Mapping[str, Any],
    *,
    returning: bool,
    last_insert_id: bool = False,
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

    __slots__ = ("_reads", "_statements", "read", "returning", "table", "values", "where")

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
        self._reads: dict[str, StatementLambdaElement] = {}

    def _read_statement(self, backend: Backend) -> StatementLambdaElement:
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
        stmt = self._reads.get(backend.name)
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
            stmt = self._reads[backend.name] = frozen(claim)
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
        backend = backend_of(conn.dialect)
        if not backend.dml_cte:
            return self(conn, params) is not None, None
        stmt = self._read_statement(backend)
        result = execute(conn, stmt, params)
        if result.rowcount == 0:
            # The INSERT created the row (no row returned), told without a fetch; the result, a
            # client-side cursor with nothing in it, is dropped as it is.  A driver that counts no
            # rows for a SELECT (-1) takes the fetch below.
            return True, None
        row: Any = result.first()
        if row is None:
            return True, None
        record = row[0]
        if record is None:
            return False, None
        values: list[Any] = json.loads(record)
        return False, values

    def statement(self, backend: Backend) -> Insert:
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
        backend = backend_of(conn.dialect)
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
            if is_duplicate_key(error):
                return None
            raise
        inserted = result.inserted_primary_key
        return tuple(inserted) if inserted is not None else ()


#: Texts shorter than this (in characters, 4 UTF-8 bytes each at most) are not checked against
#: the server's statement size: a max_allowed_packet under 256 KiB is not supported (MariaDB's
#: default is 16 MiB, MySQL's 64 MiB).
SIZE_CHECK_FROM: Final = 16 * 1024
#: What a statement needs besides the checked text (keys, other values, SQL).
_STATEMENT_OVERHEAD: Final = 16 * 1024
_PACKET_INFO: Final = "stateguard.max_allowed_packet"
_MAX_PACKET: Final = text("SELECT @@max_allowed_packet")


def needs_size_check(conn: Connection, value: str) -> bool:
    """Whether :func:`check_statement_size` has anything to check (a large text on MySQL/MariaDB)."""
    return len(value) >= SIZE_CHECK_FROM and backend_of(conn.dialect).packet_limit


def check_statement_size(conn: Connection, value: str, what: str) -> None:
    """Raise InvalidArgument when ``value`` cannot travel in one statement to ``conn``'s server.

    MySQL/MariaDB refuse a statement longer than ``max_allowed_packet`` with
    error 1153 and drop the connection (the transaction is gone).  The limit
    is read once per DBAPI connection, only for large texts; the MySQL
    drivers escape ``\\ ' " NUL \\n \\r ^Z`` client-side, so those count twice.
    PostgreSQL (1 GB per value) and SQLite (1e9 bytes) need no check here.
    """
    if len(value) < SIZE_CHECK_FROM or not backend_of(conn.dialect).packet_limit:
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


def stored_key(conn: Connection, info: ModelInfo, key: tuple[Any, ...]) -> tuple[Any, ...]:
    """``key`` as the row spells it, where the database matches text keys inexactly (else ``key``).

    On MariaDB/MySQL with a case-insensitive collation ``'SKU-A'`` updates
    the row ``'sku-a'``: the transition log, the counter ledger and the
    outbox must record the row's own spelling, or one ref (or request id)
    applies once per spelling and one row's events get several keys.  One
    primary-key read, only for such models and only where a ref, a request
    id or an event needs it.
    """
    backend = backend_of(conn.dialect)
    flag = memo.get(("inexact-key", info, backend))
    if flag is None:
        flag = memo.put(("inexact-key", info, backend), inexact_text_key(info, backend))
    if not flag:
        return key
    stmt = memo.get(("stored-key", info))
    if stmt is None:
        stmt = memo.put(("stored-key", info), select(*info.pk_columns).where(info.pk_where))
    row = execute(conn, stmt, info.key_params(key)).first()
    return key if row is None else tuple(row)


# --------------------------------------------------------------------------
# SQLite's transactions
# --------------------------------------------------------------------------


def ensure_real_transaction(conn: Connection) -> None:
    """Make sure the driver really has a transaction open before a SAVEPOINT.

    Python's sqlite3 (with its default, legacy transaction control) does not
    send BEGIN before a SAVEPOINT: the SAVEPOINT then starts its own
    transaction and RELEASE commits it, long before the session commits.
    Opening the transaction explicitly keeps the savepoint nested in it.
    """
    if backend_of(conn.dialect).driver_begins_lazily and not _driver_in_transaction(conn):
        # Its callers (reserve, idempotent) write next: under sqlite_engine(begin="auto") the
        # transaction they start takes the write lock here, outside their savepoint.
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.info.get(BEGIN_MARK) == PENDING else "BEGIN")


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
    if backend_of(conn.dialect).driver_begins_lazily and not _driver_in_transaction(conn):
        execute(conn, _BEGIN_IMMEDIATE)


_BEGIN_IMMEDIATE = text("BEGIN IMMEDIATE")
