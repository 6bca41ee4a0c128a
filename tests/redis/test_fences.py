"""Fencing tokens never go back, even when Redis restarts empty.

Each test starts its own Redis on a private port (tests/_support/redis_server.py) and
crashes it mid-test: the shared test Redis is never restarted.  Two modes:
fences from Redis (seeded from the server's clock) and fences from the
database (``fences=``, the ``stateguard_fences`` table).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, select
from sqlalchemy.orm import Session

from stateguard import (
    AsyncRedisLock,
    InvalidArgument,
    LockNotAcquired,
    RedisLock,
    create_tables,
    drop_tables,
    guarded_update,
)
from stateguard.tables import fences as fences_table
from tests._support.async_helpers import ASYNC_TARGETS, AsyncTarget, target_from
from tests._support.lock_workers import LockBase, Payout
from tests._support.redis_server import RedisServer
from tests.conftest import Backend, count_statements


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    """A private Redis (no persistence) that the tests of this module crash and restart."""
    with RedisServer() as running:
        yield running


@pytest.fixture
def client(server: RedisServer) -> Iterator[Any]:
    """A redis-py client of the private server, with redis-py's default retries."""
    import redis

    c = redis.Redis(host=server.host, port=server.port)
    c.flushall()
    yield c
    c.close()


@pytest.fixture
def db(backend: Backend) -> Iterator[Engine]:
    """The backend with stateguard's tables and the Payout table (one row, never written)."""
    engine = backend.engine
    drop_tables(engine)
    create_tables(engine)
    backend.create(LockBase.metadata)
    with Session(engine) as s, s.begin():
        s.add(Payout(id=1, holder=None))
    yield engine
    drop_tables(engine)


def fenced_write(engine: Engine, holder: str, fence: int) -> str:
    """Write the Payout row as ``holder`` with ``fence`` (read fresh, so only the fence can refuse it)."""
    with Session(engine) as s, s.begin():
        version = s.get_one(Payout, 1).version
        return guarded_update(
            s, Payout, 1, {"holder": holder}, expected_version=version, fence=fence
        ).outcome.name


def stored(engine: Engine) -> tuple[str | None, int | None]:
    """The Payout row's holder and fence."""
    with Session(engine) as s:
        row = s.execute(select(Payout.holder, Payout.fence).where(Payout.id == 1)).one()
        return row.holder, row.fence


@pytest.mark.restart
@pytest.mark.parametrize("mode", ["redis", "database"])
def test_a_paused_holder_is_fenced_out_after_redis_restarts_empty(
    mode: str, backend: Backend, db: Engine, server: RedisServer, client: Any
) -> None:
    """A holder paused while Redis restarted empty gets STALE; the next holder's fence is bigger."""
    fences = db if mode == "database" else None
    lock = RedisLock(client, "payout:1", ttl=30, fences=fences)
    seen = []
    for _ in range(3):  # a few holders before A: with a plain INCR, A's fence is 4
        with lock as fence:
            seen.append(fence)
    a_fence = lock.acquire()  # A holds the lock... and stalls
    seen.append(a_fence)

    server.restart()  # everything Redis knew is gone, A's lock included

    b = RedisLock(client, "payout:1", ttl=30, blocking_timeout=0, fences=fences)
    with b as b_fence:  # the lock is free: Redis forgot A
        seen.append(b_fence)
        assert fenced_write(db, "B", b_fence) == "APPLIED"
    assert fenced_write(db, "A", a_fence) == "STALE"  # A wakes up: refused
    assert stored(db) == ("B", b_fence)
    assert seen == sorted(set(seen)), seen  # strictly increasing across the restart
    if mode == "database":
        assert seen == [1, 2, 3, 4, 5]


@pytest.mark.restart
@pytest.mark.clock
def test_redis_fences_come_from_the_server_clock(client: Any) -> None:
    """Without fences=, a fence is at least the Redis server's TIME in microseconds, else INCR."""
    lock = RedisLock(client, "clock", ttl=5)
    seconds, micros = client.time()
    with lock as first:
        pass
    assert first >= seconds * 1_000_000 + micros
    assert int(client.get(lock.fence_key)) == first
    client.set(lock.fence_key, first + 10**9)  # ahead of the clock (a burst): INCR still wins
    with lock as second:
        assert second == first + 10**9 + 1
    client.set(lock.fence_key, 6)  # an old counter (fences from before this release): the clock wins
    with lock as third:
        assert third > second - 10**9


@pytest.mark.restart
def test_database_fence_is_one_statement_per_acquisition(db: Engine, client: Any) -> None:
    """With fences=, each acquisition runs exactly one statement (the upsert), and a failed try runs none."""
    lock = RedisLock(client, "one-statement", ttl=5, blocking_timeout=0, fences=db)
    with count_statements(db) as statements:
        with lock as fence:
            assert fence == 1
            with pytest.raises(LockNotAcquired):
                RedisLock(client, "one-statement", ttl=5, blocking_timeout=0, fences=db).acquire()
        assert len(statements) == 1, statements.statements
        with lock as fence:
            assert fence == 2
        assert len(statements) == 2
    with db.connect() as conn:
        assert conn.execute(select(fences_table.c.fence)).scalars().all() == [2]


@pytest.mark.restart
def test_a_holder_whose_lock_expired_while_taking_its_fence_gets_none(db: Engine, client: Any) -> None:
    """A's fence statement waits past A's ttl while B takes the lock and fence 1: A must not come back
    with fence 2 (its writes would beat the live holder's); it gets LockNotAcquired, B's writes win.

    The case: a busy pool in front of the fences engine.
    """
    slow = threading.Event()
    b_fence: list[int] = []

    @event.listens_for(db, "before_cursor_execute")
    def pause(*_: Any) -> None:
        if slow.is_set() and threading.current_thread().name == "holder-a":
            slow.clear()
            time.sleep(1.0)  # A's ttl is 0.3 s: it expires while A waits for its fence

    def holder_a(out: list[Any]) -> None:
        try:
            out.append(RedisLock(client, "expiring", ttl=0.3, blocking_timeout=0, fences=db).acquire())
        except LockNotAcquired as error:
            out.append(error)

    a_result: list[Any] = []
    slow.set()
    a = threading.Thread(target=holder_a, args=(a_result,), name="holder-a")
    a.start()
    time.sleep(0.5)  # A holds the Redis lock, its ttl has run out, its fence statement is still waiting
    b_lock = RedisLock(client, "expiring", ttl=30, blocking_timeout=5, fences=db)
    b_fence.append(b_lock.acquire())
    a.join(10)
    event.remove(db, "before_cursor_execute", pause)
    assert b_fence == [1]
    [a_outcome] = a_result
    assert isinstance(a_outcome, LockNotAcquired), a_outcome
    assert fenced_write(db, "b", b_fence[0]) == "APPLIED"
    b_lock.release()


@pytest.mark.restart
def test_database_failure_after_redis_granted_releases_the_lock(backend: Backend, client: Any) -> None:
    """If the database cannot hand out the fence, the Redis lock is released and the database error raised."""
    engine = backend.engine
    drop_tables(engine)  # no stateguard_fences table
    lock = RedisLock(client, "no-table", ttl=30, blocking_timeout=0, fences=engine)
    with pytest.raises(Exception, match="stateguard_fences") as caught:
        lock.acquire()
    assert not isinstance(caught.value, LockNotAcquired)
    assert not lock.locked()  # not held for the TTL by a holder without a fence
    assert lock.fence is None


@pytest.mark.restart
def test_fences_argument_is_checked(client: Any, tmp_path: Any) -> None:
    """fences= takes an Engine (AsyncEngine for AsyncRedisLock) and a name that fits the fences table."""
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_engine(f"sqlite:///{tmp_path}/f.db")
    async_engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path}/f.db")
    import redis.asyncio

    async_client = redis.asyncio.Redis()
    try:
        for wrong in ("sqlite://", Session(engine), async_engine):
            with pytest.raises(InvalidArgument, match="fences"):
                RedisLock(client, "x", ttl=1, fences=wrong)
        with pytest.raises(InvalidArgument, match="fences"):
            AsyncRedisLock(async_client, "x", ttl=1, fences=engine)
        with pytest.raises(InvalidArgument, match="name"):
            RedisLock(client, "x" * 256, ttl=1, fences=engine)
        RedisLock(client, "x" * 256, ttl=1)  # Redis alone takes any name
    finally:
        engine.dispose()
        asyncio.run(async_engine.dispose())
        asyncio.run(async_client.aclose())


@pytest.fixture(params=list(ASYNC_TARGETS))
def target(request: pytest.FixtureRequest) -> AsyncTarget:
    """Each async driver on its backend's private namespace."""
    return target_from(request)


@pytest.mark.restart
def test_async_lock_takes_database_fences_that_survive_a_restart(
    target: AsyncTarget, server: RedisServer
) -> None:
    """AsyncRedisLock(fences=AsyncEngine): fences 1, 2, then 3 after Redis restarted empty."""
    import redis.asyncio

    sync_engine = target.sync_engine()
    drop_tables(sync_engine)
    create_tables(sync_engine)
    LockBase.metadata.drop_all(sync_engine)
    LockBase.metadata.create_all(sync_engine)
    with Session(sync_engine) as s, s.begin():
        s.add(Payout(id=1, holder=None))

    async def main() -> list[int]:
        engine = target.engine()
        client = redis.asyncio.Redis(host=server.host, port=server.port)
        try:
            await client.flushall()
            lock = AsyncRedisLock(client, "async-payout", ttl=30, blocking_timeout=0, fences=engine)
            async with lock as first:
                pass
            old = await lock.acquire()
            await asyncio.to_thread(server.restart)
            async with AsyncRedisLock(
                client, "async-payout", ttl=30, blocking_timeout=0, fences=engine
            ) as new:
                pass
            return [first, old, new]
        finally:
            await client.aclose()
            await engine.dispose()

    try:
        assert asyncio.run(main()) == [1, 2, 3]
        assert fenced_write(sync_engine, "B", 3) == "APPLIED"
        assert fenced_write(sync_engine, "A", 2) == "STALE"
    finally:
        LockBase.metadata.drop_all(sync_engine)
        drop_tables(sync_engine)
        sync_engine.dispose()


@pytest.mark.restart
def test_restart_helper_loses_everything_and_keeps_its_port(server: RedisServer, client: Any) -> None:
    """tests/_support/redis_server.py: a restart is a crash without persistence on the same port."""
    client.set("k", "v")
    port, before = server.port, server.restarts
    started = time.monotonic()
    server.restart()
    assert time.monotonic() - started < 20
    assert (server.port, server.restarts) == (port, before + 1)
    assert client.get("k") is None  # redis-py reconnected by itself; the data is gone
