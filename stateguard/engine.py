"""Engine helpers: a SQLite engine configured for concurrent guarded writes."""

from __future__ import annotations

from typing import Any, Literal

from sqlalchemy import Engine, create_engine, event

__all__ = ["sqlite_engine"]

#: Key in ``Connection.info``: how :func:`sqlite_engine` began the transaction.
BEGIN_MARK = "stateguard.begin"


def sqlite_engine(
    url: str = "sqlite:///stateguard.db",
    *,
    begin: Literal["immediate", "deferred"] = "immediate",
    busy_timeout: float = 30.0,
    wal: bool = True,
    **kwargs: Any,
) -> Engine:
    """A SQLite engine for concurrent writers: WAL, a busy timeout, real BEGINs.

    stateguard is correct on a plain ``create_engine("sqlite:///file.db")``;
    this helper makes it faster and quieter under concurrency:

    * ``journal_mode=WAL`` so readers do not block the writer;
    * ``busy_timeout`` so a writer waits for the lock instead of failing;
    * the driver's own transaction handling is replaced by explicit
      ``BEGIN IMMEDIATE`` (SQLAlchemy's documented recipe), so a transaction
      that reads before it writes holds the write lock from the start and
      cannot fail with ``SQLITE_BUSY_SNAPSHOT`` when it upgrades; SAVEPOINTs
      are always nested in a real transaction.

    ::

        engine = sqlite_engine("sqlite:///orders.db")
    """
    if not url.startswith("sqlite"):
        raise ValueError(f"sqlite_engine() needs a sqlite:// URL, got {url!r}")
    connect_args = dict(kwargs.pop("connect_args", {}))
    connect_args.setdefault("timeout", busy_timeout)
    engine = create_engine(url, connect_args=connect_args, **kwargs)
    statement = "BEGIN IMMEDIATE" if begin == "immediate" else "BEGIN"

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        # Take transaction control away from the driver (it would not BEGIN
        # before a SAVEPOINT, and it always BEGINs DEFERRED).
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
        conn.exec_driver_sql(statement)
        # Read by row_lock(): with "immediate" the transaction holds SQLite's
        # write lock from its first statement, the honest FOR UPDATE there.
        conn.info[BEGIN_MARK] = begin

    return engine
