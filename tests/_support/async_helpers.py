"""Helpers for the AsyncSession tests: async URLs for the ``backend`` namespaces, and
a ``Side`` that drives one scenario through a Session or an AsyncSession.

A scenario is written once as an ``async def`` taking a :class:`Side`; every
stateguard call goes through ``await side.run(lambda: call(session, ...))``.
On the async side the call must return a coroutine, which is awaited; on the
sync side it must return the result itself.  Each side records what every
call returned (outcomes, keys, states, versions, exception types), so a test
runs the scenario on the sync driver and on each async driver and compares
the two records, besides the expectations asserted inside the scenario.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
from sqlalchemy import Engine, MetaData, event
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.orm import sessionmaker

from stateguard import (
    DeadlockDetected,
    HistoryEntry,
    Result,
    SerializationConflict,
    async_sqlite_engine,
    sqlite_engine,
)
from stateguard.tokens import OneTimeToken
from tests.conftest import Backend

T = TypeVar("T")
E = TypeVar("E", bound=BaseException)

#: Every async driver: (test id, conftest fixture giving the namespace).
ASYNC_TARGETS = {
    "aiosqlite": "sqlite",
    "asyncpg": "pg",
    "psycopg_async": "pg",
    "aiomysql": "mariadb",
}
SERVER_TARGETS = ["asyncpg", "psycopg_async", "aiomysql"]
PG_TARGETS = ["asyncpg", "psycopg_async"]


@dataclass
class AsyncTarget:
    """One async driver on one backend namespace (the same one ``backend`` gives the sync tests)."""

    driver: str
    backend: Backend
    url: str
    connect_args: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """``sqlite``, ``postgresql`` or ``mariadb``."""
        return self.backend.name

    def engine(self, *, helper: bool = False, **kw: Any) -> AsyncEngine:
        """A new AsyncEngine (create it inside the event loop that uses it; dispose it there)."""
        kw.setdefault("pool_size", 24)
        kw.setdefault("max_overflow", 8)
        kw.setdefault("pool_timeout", 120)
        if self.name == "sqlite":
            if helper:
                kw.setdefault("busy_timeout", 60)
                return async_sqlite_engine(self.url, **kw)
            return create_async_engine(self.url, connect_args={"timeout": 60}, **kw)
        return create_async_engine(self.url, connect_args=dict(self.connect_args), **kw)

    def sync_engine(self, *, helper: bool = False, **kw: Any) -> Engine:
        """The sync twin of :meth:`engine` (conftest's driver: psycopg, PyMySQL, sqlite3)."""
        if self.name == "sqlite" and helper:
            kw.setdefault("busy_timeout", 60)
            return sqlite_engine(self.backend.url, **kw)
        return self.backend.new_engine(**kw)


def async_target(driver: str, backend: Backend) -> AsyncTarget:
    """The async URL (and connect args) for ``backend``'s private namespace."""
    url = make_url(backend.url)
    if driver == "aiosqlite":
        return AsyncTarget(driver, backend, url.set(drivername="sqlite+aiosqlite").render_as_string(False))
    if driver == "aiomysql":
        return AsyncTarget(driver, backend, url.set(drivername="mysql+aiomysql").render_as_string(False))
    if driver == "psycopg_async":
        # psycopg takes libpq's options=-csearch_path=... as it is.
        return AsyncTarget(
            driver, backend, url.set(drivername="postgresql+psycopg_async").render_as_string(False)
        )
    if driver == "asyncpg":
        # asyncpg has no libpq options string: the schema goes in server_settings.
        options = str(url.query["options"])
        schema = options.removeprefix("-csearch_path=")
        bare = url.set(drivername="postgresql+asyncpg").difference_update_query(["options"])
        return AsyncTarget(
            driver,
            backend,
            bare.render_as_string(False),
            {"server_settings": {"search_path": schema}},
        )
    raise ValueError(driver)


def target_from(request: pytest.FixtureRequest) -> AsyncTarget:
    """Build the target of a fixture parametrized over :data:`ASYNC_TARGETS` keys."""
    driver: str = request.param
    backend: Backend = request.getfixturevalue(ASYNC_TARGETS[driver])
    return async_target(driver, backend)


# --------------------------------------------------------------------------
# Tables: created once per module and backend, emptied before each side
# --------------------------------------------------------------------------


class Tables:
    """A module's tables on each backend: created on first use, emptied by every later use.

    DDL is the slow part of these tests (about a second per MariaDB test for
    the ~16 tables involved), and each scenario runs twice, so the tables are
    created once per module and cleared between runs instead.
    """

    def __init__(self, *metadatas: MetaData, restart: tuple[str, ...] = ()) -> None:
        self.metadatas = metadatas
        self.restart = restart
        self.tables = [t for md in metadatas for t in reversed(md.sorted_tables)]
        self._engines: dict[str, Engine] = {}

    def ready(self, backend: Backend) -> None:
        """Create the tables on ``backend`` (first time) or delete every row (after)."""
        engine = self._engines.get(backend.name)
        if engine is None:
            for md in self.metadatas:
                md.drop_all(backend.engine)
                md.create_all(backend.engine)
            self._engines[backend.name] = backend.engine
            return
        with engine.begin() as conn:
            if engine.dialect.name == "postgresql":
                names = ", ".join(f'"{t.name}"' for t in self.tables)
                conn.exec_driver_sql(f"TRUNCATE {names} RESTART IDENTITY CASCADE")
            else:
                for table in self.tables:
                    conn.execute(table.delete())
        if engine.dialect.name in ("mysql", "mariadb"):
            # Autoincrement keys show up in results (insert_once): start both sides at 1.
            # ALTER TABLE is slow on InnoDB, so only for the tables named in ``restart``.
            with engine.begin() as conn:
                for name in self.restart:
                    conn.exec_driver_sql(f"ALTER TABLE `{name}` AUTO_INCREMENT = 1")

    def drop(self) -> None:
        """Drop the tables everywhere they were created."""
        for engine in self._engines.values():
            for md in reversed(self.metadatas):
                md.drop_all(engine)
        self._engines.clear()


# --------------------------------------------------------------------------
# One scenario, two sides
# --------------------------------------------------------------------------


def describe(value: Any) -> Any:
    """What a call returned, comparable between the sync and the async side."""
    if isinstance(value, Result):
        if value.model is OneTimeToken:
            # Tokens are random and their times are clocks: the outcome and state say it all.
            return ("OneTimeToken", value.outcome.name, value.state)
        model = getattr(value.model, "__name__", value.model)
        return (model, value.outcome.name, value.key, value.trigger, value.state, value.version, value.value)
    if isinstance(value, HistoryEntry):
        return (value.trigger, value.source, value.dest, value.request_id, value.metadata, value.version)
    if isinstance(value, dict):
        return {k: describe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [describe(v) for v in value]
    if value is None or isinstance(value, int | str | float | bool):
        return value
    state = sa_inspect(value, raiseerr=False)
    if state is not None and getattr(state, "identity", None) is not None:
        return (type(value).__name__, state.identity)
    return type(value).__name__


class Side:
    """A Session (sync) or AsyncSession (async) world in which one scenario runs."""

    def __init__(self, is_async: bool, maker: Callable[[], Any], log: list[Any], dialect: str) -> None:
        self.is_async = is_async
        #: ``sqlite``, ``postgresql`` or ``mysql`` (MariaDB).
        self.dialect = dialect
        self.maker = maker
        self.log = log

    @property
    def label(self) -> str:
        """``"async"`` or ``"sync"``."""
        return "async" if self.is_async else "sync"

    # -- sessions and transactions --------------------------------------

    @asynccontextmanager
    async def session(self) -> AsyncIterator[Any]:
        """A new Session or AsyncSession."""
        if self.is_async:
            async with self.maker() as s:
                yield s
        else:
            with self.maker() as s:
                yield s

    @asynccontextmanager
    async def begin(self, s: Any) -> AsyncIterator[None]:
        """``with s.begin()`` or ``async with s.begin()``."""
        if self.is_async:
            async with s.begin():
                yield
        else:
            with s.begin():
                yield

    @asynccontextmanager
    async def enter(self, cm: Any) -> AsyncIterator[Any]:
        """``with cm`` on the sync side, ``async with cm`` on the async side."""
        if self.is_async:
            async with cm as value:
                yield value
        else:
            with cm as value:
                yield value

    async def enter_only(self, cm: Any) -> Any:
        """Enter ``cm`` and never leave it: a worker that died inside the block."""
        if self.is_async:
            return await cm.__aenter__()
        return cm.__enter__()

    # -- calls --------------------------------------------------------------

    async def run(self, call: Callable[[], Any], *, record: bool = True) -> Any:
        """Call; on the async side the call must return a coroutine, which is awaited."""
        value = call()
        if self.is_async:
            assert inspect.iscoroutine(value), f"an AsyncSession call returned {value!r}, not a coroutine"
            value = await value
        else:
            assert not inspect.isawaitable(value), f"a Session call returned an awaitable {value!r}"
        if record:
            self.log.append(describe(value))
        return value

    async def q(self, call: Callable[[], Any]) -> Any:
        """:meth:`run` without recording (session plumbing: flush, commit, get)."""
        return await self.run(call, record=False)

    async def raises(self, kind: type[E], call: Callable[[], Any]) -> E:
        """Run ``call`` expecting ``kind``; record the exception's type."""
        with pytest.raises(kind) as info:
            await self.run(call, record=False)
        self.log.append(("raised", type(info.value).__name__))
        return info.value

    async def raises_entering(self, kind: type[E], cm: Any) -> E:
        """Entering ``cm`` (with / async with) must raise ``kind``; record it."""
        with pytest.raises(kind) as info:
            async with self.enter(cm):
                pytest.fail("the block must not run")
        self.log.append(("raised", type(info.value).__name__))
        return info.value

    # -- concurrency: tasks on the async side, threads on the sync side ----

    async def gather(self, *workers: Callable[[], Coroutine[Any, Any, T]]) -> list[T]:
        """Run the workers at once: asyncio tasks, or threads each with its own event loop."""
        if self.is_async:
            return list(await asyncio.gather(*(w() for w in workers)))
        results: list[Any] = [None] * len(workers)
        errors: list[BaseException] = []

        def run(i: int, worker: Callable[[], Coroutine[Any, Any, T]]) -> None:
            try:
                results[i] = asyncio.run(worker())
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=run, args=(i, w)) for i, w in enumerate(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        if errors:
            raise errors[0]
        return results

    def barrier(self, parties: int) -> Callable[[], Awaitable[None]]:
        """``await wait()`` until ``parties`` workers arrived (tasks or threads)."""
        if self.is_async:
            b = asyncio.Barrier(parties)

            async def wait_async() -> None:
                async with asyncio.timeout(30):
                    await b.wait()

            return wait_async
        tb = threading.Barrier(parties, timeout=30)

        async def wait_thread() -> None:
            tb.wait()

        return wait_thread


Scenario = Callable[[Side], Coroutine[Any, Any, None]]


#: Sync records by (backend, scenario, options): asyncpg and psycopg async share PostgreSQL's.
_sync_records: dict[tuple[str, str, bool, str], list[Any]] = {}


def run_both(
    target: AsyncTarget,
    scenario: Scenario,
    reset: Callable[[Engine], None],
    *,
    helper: bool = False,
    engine_kw: dict[str, Any] | None = None,
) -> tuple[list[Any], list[Any]]:
    """Run ``scenario`` on the sync driver, then on ``target``'s async driver; both records.

    ``reset(sync_engine)`` empties and seeds the tables before each side.  The sync
    record of a scenario is computed once per backend (both PostgreSQL drivers compare
    against the same psycopg run).
    """
    kw = dict(engine_kw or {})
    sync_engine = target.sync_engine(helper=helper, **kw)
    cache_key = (target.name, scenario.__qualname__, helper, repr(sorted(kw.items())))
    sync_log = _sync_records.get(cache_key)
    async_log: list[Any] = []
    try:
        if sync_log is None:
            sync_log = []
            reset(sync_engine)
            maker = sessionmaker(sync_engine, expire_on_commit=False)
            asyncio.run(scenario(Side(False, maker, sync_log, sync_engine.dialect.name)))
            _sync_records[cache_key] = sync_log
        reset(sync_engine)
    finally:
        sync_engine.dispose()

    async def main() -> None:
        engine = target.engine(helper=helper, **kw)
        try:
            maker = async_sessionmaker(engine, expire_on_commit=False)
            await scenario(Side(True, maker, async_log, engine.dialect.name))
        finally:
            await engine.dispose()

    asyncio.run(main())
    return sync_log, async_log


# --------------------------------------------------------------------------
# Retrying units of work in asyncio (retry_on_conflict takes a sync callable)
# --------------------------------------------------------------------------


async def retry_async(unit: Callable[[], Awaitable[T]], conflicts: list[str], attempts: int = 50) -> T:
    """Re-run ``unit`` after a serialization failure or deadlock, recording each one."""
    for attempt in range(1, attempts + 1):
        try:
            return await unit()
        except (SerializationConflict, DeadlockDetected) as error:
            conflicts.append(type(error).__name__)
            if attempt == attempts:
                raise
            await asyncio.sleep(0.001 * attempt)
    raise AssertionError("unreachable")


@contextmanager
def max_checked_out(engine: AsyncEngine) -> Iterator[list[int]]:
    """Track the most connections the engine's pool had checked out at once: ``[current, most]``."""
    seen = [0, 0]

    def out(*_: Any) -> None:
        seen[0] += 1
        seen[1] = max(seen)

    def back(*_: Any) -> None:
        seen[0] -= 1

    pool = engine.sync_engine.pool
    event.listen(pool, "checkout", out)
    event.listen(pool, "checkin", back)
    try:
        yield seen
    finally:
        event.remove(pool, "checkout", out)
        event.remove(pool, "checkin", back)


__all__ = [
    "ASYNC_TARGETS",
    "PG_TARGETS",
    "SERVER_TARGETS",
    "AsyncTarget",
    "Scenario",
    "Side",
    "Tables",
    "async_target",
    "describe",
    "max_checked_out",
    "retry_async",
    "run_both",
    "target_from",
]
