"""Engine helpers: SQLite engines (sync and asyncio) configured for concurrent guarded writes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import Engine, create_engine, event

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = ["async_sqlite_engine", "sqlite_engine"]

#: Key in ``Connection.info``: how :func:`sqlite_engine` began the current transaction:
#: ``"immediate"`` or ``"deferred"`` once its BEGIN was sent, :data:`PENDING` before that.
BEGIN_MARK = "stateguard.begin"
#: :data:`BEGIN_MARK` of a ``begin="auto"`` transaction that has sent no statement yet: its first
#: statement decides the BEGIN, and a stateguard write starting it takes ``BEGIN IMMEDIATE``.
PENDING = "pending"

Begin = Literal["auto", "immediate", "deferred"]

#: First words of statements that only read: a transaction they start begins DEFERRED under "auto".
_READS = frozenset({"SELECT", "VALUES", "EXPLAIN", "PRAGMA"})


def sqlite_engine(
    url: str = "sqlite:///stateguard.db",
    *,
    begin: Begin = "auto",
    busy_timeout: float = 30.0,
    wal: bool = True,
    **kwargs: Any,
) -> Engine:
    """A SQLite engine for concurrent writers: WAL, a busy timeout, real BEGINs.

    stateguard is correct on a plain ``create_engine("sqlite:///file.db")``;
    this helper makes it faster and quieter under concurrency:

    * ``journal_mode=WAL`` so readers and the writer do not block each other;
    * ``busy_timeout`` so a writer waits for the lock instead of failing;
    * the driver's own transaction handling is replaced by explicit BEGINs
      (SQLAlchemy's documented recipe), so SAVEPOINTs are always nested in a
      real transaction and reads see one snapshot.

    ``begin`` says when a transaction takes SQLite's one write lock:

    * ``"auto"`` (the default): a transaction begins at its first statement.
      It begins ``BEGIN IMMEDIATE`` (holding the write lock) when that
      statement writes (INSERT, UPDATE, DELETE, DDL, a ``SELECT`` with
      ``with_for_update()``) or is a stateguard call that writes or locks
      (a trigger, a counter, ``insert_once``, ``guarded_update``,
      ``row_lock`` ...), which may read before it writes; otherwise it begins
      ``BEGIN`` (DEFERRED), so a read-only request never waits for a
      writer.  Your own unit of work that reads first and writes later
      upgrades its lock at the first write, and if another connection
      writes meanwhile SQLite refuses the upgrade at once ("database is
      locked"; inside stateguard calls a retryable
      :class:`~stateguard.SerializationConflict`): retry the unit
      (:func:`~stateguard.retry_on_conflict`), start it with its write, or
      opt into ``"immediate"``.
    * ``"immediate"``: every transaction begins ``BEGIN IMMEDIATE`` and holds
      the write lock from its start, also for read-only requests, which then
      wait behind a writer.
    * ``"deferred"``: every transaction begins ``BEGIN``; nothing takes the
      write lock early (:func:`~stateguard.row_lock` raises ``NotSupported``).

    ::

        engine = sqlite_engine("sqlite:///orders.db")
        sqlite_engine("sqlite:///orders.db", begin="immediate")   # every transaction holds the lock
    """
    _check_url(url, "sqlite_engine", "sqlite")
    engine = create_engine(url, **_sqlite_kwargs(busy_timeout, kwargs))
    _configure_sqlite(engine, begin=begin, busy_timeout=busy_timeout, wal=wal)
    return engine


def async_sqlite_engine(
    url: str = "sqlite+aiosqlite:///stateguard.db",
    *,
    begin: Begin = "auto",
    busy_timeout: float = 30.0,
    wal: bool = True,
    **kwargs: Any,
) -> AsyncEngine:
    """:func:`sqlite_engine` for asyncio: the same configuration on an aiosqlite ``AsyncEngine``.

    The listeners go on ``engine.sync_engine`` (SQLAlchemy's documented
    aiosqlite recipe), so ``begin`` works as there and
    :func:`~stateguard.row_lock` works on an ``AsyncSession`` too::

        engine = async_sqlite_engine("sqlite+aiosqlite:///orders.db")
        async with AsyncSession(engine) as session, session.begin():
            order = await row_lock(session, Order, 42)
    """
    from sqlalchemy.ext.asyncio import create_async_engine

    _check_url(url, "async_sqlite_engine", "sqlite+aiosqlite")
    engine = create_async_engine(url, **_sqlite_kwargs(busy_timeout, kwargs))
    _configure_sqlite(engine.sync_engine, begin=begin, busy_timeout=busy_timeout, wal=wal)
    return engine


def _check_url(url: str, what: str, scheme: str) -> None:
    if not url.startswith(scheme):
        raise ValueError(f"{what}() needs a {scheme}:// URL, got {url!r}")


def _writes(statement: str, context: Any) -> bool:
    """Whether ``statement``, the first of a ``begin="auto"`` transaction, needs the write lock."""
    if context is not None:
        if context.isinsert or context.isupdate or context.isdelete or context.isddl:
            return True
        compiled = getattr(context.compiled, "statement", None)
        # SQLite's compiler drops FOR UPDATE; holding the write lock is its honest equivalent.
        if getattr(compiled, "_for_update_arg", None) is not None:
            return True
    words = statement.split(None, 1)
    return not words or words[0].lstrip("(").upper() not in _READS


def _sqlite_kwargs(busy_timeout: float, kwargs: dict[str, Any]) -> dict[str, Any]:
    connect_args = dict(kwargs.pop("connect_args", {}))
    connect_args.setdefault("timeout", busy_timeout)
    return {"connect_args": connect_args, **kwargs}


def _configure_sqlite(engine: Engine, *, begin: Begin, busy_timeout: float, wal: bool) -> None:
    """The listeners both SQLite helpers install (on the sync engine behind an AsyncEngine)."""
    if begin not in ("auto", "immediate", "deferred"):
        raise ValueError(f"begin must be 'auto', 'immediate' or 'deferred', got {begin!r}")
    statement = "BEGIN IMMEDIATE" if begin == "immediate" else "BEGIN"

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        # Take transaction control away from the driver (it would not BEGIN
        # before a SAVEPOINT, and it always BEGINs DEFERRED).  aiosqlite's
        # adapted connection forwards the attribute to its sqlite3 connection.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
            if wal:
                cursor.execute("PRAGMA journal_mode = WAL")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        if begin == "auto":
            # Nothing is sent yet: the first statement (or a stateguard write,
            # through _kernel.connection_for) decides how the transaction begins.
            conn.info[BEGIN_MARK] = PENDING
            return
        conn.exec_driver_sql(statement)
        # Read by row_lock(): with "immediate" the transaction holds SQLite's
        # write lock from its first statement, the honest FOR UPDATE there.
        conn.info[BEGIN_MARK] = begin

    if begin != "auto":
        return

    @event.listens_for(engine, "before_cursor_execute")
    def _first_statement(
        conn: Any, cursor: Any, statement: str, _params: Any, context: Any, _many: bool
    ) -> None:
        if conn.info.get(BEGIN_MARK) != PENDING:
            return
        head = statement.lstrip()[:15].upper()
        if head.startswith("BEGIN"):
            # stateguard's own BEGIN IMMEDIATE (_kernel.sqlite_write_lock) or BEGIN before a savepoint.
            conn.info[BEGIN_MARK] = "immediate" if "IMMEDIATE" in head or "EXCLUSIVE" in head else "deferred"
            return
        # A reader begins DEFERRED and never waits for the write lock; a writer
        # begins IMMEDIATE (in WAL mode a deferred transaction that has read
        # cannot wait for the lock later: its upgrade fails at once if busy).
        # A SAVEPOINT first (begin_nested) begins DEFERRED: SQLite waits for
        # the lock, with the busy timeout, at the first write after it.
        immediate = _writes(statement, context) and not head.startswith("SAVEPOINT")
        cursor.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
        conn.info[BEGIN_MARK] = "immediate" if immediate else "deferred"
