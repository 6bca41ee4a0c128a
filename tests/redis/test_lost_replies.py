"""Lost replies on Redis: a command that ran but whose reply
never came back is answered with what actually happened.

Each test puts tests/_support/faultproxy.FaultProxy between redis-py and the test Redis and cuts one
connection right after the script call reached the server, before its reply.  With redis-py's
default retries the call is sent again on a new connection and must recognise its own first
run; with retries off the caller gets a ConnectionError and a second call on the same object
recognises it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import create_engine, select

from stateguard import (
    AsyncRedisLock,
    AsyncRedisTokens,
    InvalidArgument,
    LockNotAcquired,
    Outcome,
    RedisLock,
    RedisTokens,
    create_tables,
)
from stateguard.tables import fences as fences_table
from tests._support.faultproxy import FaultProxy
from tests._support.redis_server import RedisServer
from tests.conftest import REDIS_URL

MINUTE = timedelta(minutes=1)


@pytest.fixture
def proxy(redis_client: Any) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of the test Redis."""
    kwargs = redis_client.connection_pool.connection_kwargs
    with FaultProxy(kwargs.get("host", "127.0.0.1"), kwargs.get("port", 6379)) as running:
        yield running


@pytest.fixture
def name(redis_client: Any) -> Iterator[str]:
    """A lock name / token scope unique to the test; its keys are deleted afterwards."""
    prefix = f"sgt-lost-{uuid.uuid4().hex[:12]}"
    yield prefix
    for pattern in (f"stateguard:token:{prefix}*", f"stateguard:lock:{{{prefix}*"):
        keys = list(redis_client.scan_iter(match=pattern))
        if keys:
            redis_client.delete(*keys)


def through(proxy: FaultProxy, *, retries: bool) -> Any:
    """A redis-py client connected through ``proxy``: redis-py's default retries, or none."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    db = int(REDIS_URL.rsplit("/", 1)[-1] or 0)
    if retries:
        return redis.Redis(host=proxy.host, port=proxy.port, db=db)
    return redis.Redis(host=proxy.host, port=proxy.port, db=db, retry=Retry(NoBackoff(), 0))


def async_through(proxy: FaultProxy) -> Any:
    """A redis.asyncio client through ``proxy`` with redis-py's default retries."""
    import redis.asyncio

    db = int(REDIS_URL.rsplit("/", 1)[-1] or 0)
    return redis.asyncio.Redis(host=proxy.host, port=proxy.port, db=db)


def warm(client: Any, name: str) -> None:
    """Run each script once, so the cut call is the EVALSHA itself (not a NOSCRIPT round)."""
    RedisTokens(client).consume("warm-up", scope=f"{name}-warm")
    lock = RedisLock(client, f"{name}-warm", ttl=5)
    with lock:
        lock.extend(1)


def cut_next_script(proxy: FaultProxy) -> None:
    proxy.cut_after_next_request(b"EVALSHA")


# --------------------------------------------------------------------------
# redis-py's default retries: the retried call recognises its first run
# --------------------------------------------------------------------------


@pytest.mark.lost_reply
def test_consume_whose_reply_was_lost_is_applied_once(
    proxy: FaultProxy, redis_client: Any, name: str
) -> None:
    """A consume that ran but lost its reply is retried by redis-py and still APPLIED, then REPEATED."""
    client = through(proxy, retries=True)
    warm(client, name)
    tokens = RedisTokens(client)
    token = tokens.issue(scope=name, ttl=MINUTE)
    cut_next_script(proxy)
    first = tokens.consume(token, scope=name)
    assert proxy.cuts == 1  # the script ran on the server and its reply was dropped
    assert first.outcome is Outcome.APPLIED  # not REPEATED: nobody else consumed it
    assert tokens.consume(token, scope=name).outcome is Outcome.REPEATED
    assert RedisTokens(redis_client).consume(token, scope=name).outcome is Outcome.REPEATED
    client.close()


@pytest.mark.lost_reply
def test_acquire_whose_reply_was_lost_holds_the_lock_with_a_fence(proxy: FaultProxy, name: str) -> None:
    """An acquisition that took the lock but lost its reply is acquired (not LockNotAcquired)."""
    client = through(proxy, retries=True)
    warm(client, name)
    lock = RedisLock(client, name, ttl=30, blocking_timeout=0)
    cut_next_script(proxy)
    fence = lock.acquire()
    assert proxy.cuts == 1
    assert lock.fence == fence and int(client.get(lock.fence_key)) == fence
    assert lock.owned()
    lock.release()
    assert not lock.locked()
    with lock as after:
        assert after > fence
    client.close()


@pytest.mark.lost_reply
def test_release_whose_reply_was_lost_is_released_not_lost(proxy: FaultProxy, name: str) -> None:
    """A release that ran but lost its reply returns normally (no LockLost), and the lock is free."""
    client = through(proxy, retries=True)
    warm(client, name)
    lock = RedisLock(client, name, ttl=30)
    with lock:
        cut_next_script(proxy)
    assert proxy.cuts == 1
    assert not lock.locked()
    with RedisLock(client, name, ttl=30, blocking_timeout=0):  # free for the next holder
        pass
    client.close()


@pytest.mark.lost_reply
def test_extend_whose_reply_was_lost_adds_its_time_once(proxy: FaultProxy, name: str) -> None:
    """An extend(20) that ran but lost its reply leaves about ttl + 20 s, not ttl + 40 s."""
    client = through(proxy, retries=True)
    warm(client, name)
    lock = RedisLock(client, name, ttl=10)
    with lock:
        cut_next_script(proxy)
        lock.extend(20)
        assert proxy.cuts == 1
        assert 25_000 < client.pttl(lock.key) <= 30_000
        lock.extend(5)  # a new call adds its own time
        assert 30_000 < client.pttl(lock.key) <= 35_000
    client.close()


@pytest.mark.lost_reply
def test_acquire_with_database_fences_whose_reply_was_lost_takes_one_fence(
    proxy: FaultProxy, name: str, tmp_path: Any
) -> None:
    """With fences=, a retried acquisition is acquired and the database hands out one fence, not two."""
    engine = create_engine(f"sqlite:///{tmp_path}/fences.db")
    create_tables(engine)
    client = through(proxy, retries=True)
    warm(client, name)
    lock = RedisLock(client, name, ttl=30, blocking_timeout=0, fences=engine)
    cut_next_script(proxy)
    with lock as fence:
        assert proxy.cuts == 1 and fence == 1
        assert lock.owned()
    with engine.connect() as conn:
        assert conn.execute(select(fences_table.c.fence)).scalar_one() == 1
    engine.dispose()
    client.close()


# --------------------------------------------------------------------------
# Retries off: a ConnectionError, and a second call recognises the first
# --------------------------------------------------------------------------


@pytest.mark.lost_reply
def test_without_retries_a_second_consume_recognises_the_first(
    proxy: FaultProxy, redis_client: Any, name: str
) -> None:
    """Retries off: the lost consume raises ConnectionError; the same object's next call is APPLIED."""
    import redis

    client = through(proxy, retries=False)
    warm(client, name)
    tokens = RedisTokens(client)
    token = tokens.issue(scope=name, ttl=MINUTE)
    cut_next_script(proxy)
    with pytest.raises(redis.ConnectionError):
        tokens.consume(token, scope=name)
    assert proxy.cuts == 1
    assert RedisTokens(redis_client).consume(token, scope=name).outcome is Outcome.REPEATED  # it did run
    assert tokens.consume(token, scope=name).outcome is Outcome.APPLIED  # the caller's own effect
    assert tokens.consume(token, scope=name).outcome is Outcome.REPEATED
    client.close()


@pytest.mark.lost_reply
def test_without_retries_a_second_acquire_and_release_recognise_the_first(
    proxy: FaultProxy, name: str
) -> None:
    """Retries off: acquire and release raise ConnectionError; calling again finds what the first did."""
    import redis

    client = through(proxy, retries=False)
    warm(client, name)
    lock = RedisLock(client, name, ttl=30, blocking_timeout=0)
    cut_next_script(proxy)
    with pytest.raises(redis.ConnectionError):
        lock.acquire()
    assert lock.locked()  # the lost call took it
    fence = lock.acquire()  # ...and this thread's next call is that same acquisition
    assert lock.owned() and fence == int(client.get(lock.fence_key))
    with pytest.raises(LockNotAcquired):
        RedisLock(client, name, ttl=30, blocking_timeout=0).acquire()

    cut_next_script(proxy)
    with pytest.raises(redis.ConnectionError):
        lock.release()
    assert not lock.locked()  # the lost call released it
    lock.release()  # recognised: released, not LockLost
    with pytest.raises(InvalidArgument):
        lock.release()  # now it is really not held any more
    client.close()


@pytest.mark.lost_reply
def test_without_retries_a_second_extend_does_not_add_twice(proxy: FaultProxy, name: str) -> None:
    """Retries off: a lost extend(20) raises ConnectionError; the same call again adds nothing more."""
    import redis

    client = through(proxy, retries=False)
    warm(client, name)
    lock = RedisLock(client, name, ttl=10)
    with lock:
        cut_next_script(proxy)
        with pytest.raises(redis.ConnectionError):
            lock.extend(20)
        lock.extend(20)
        assert 25_000 < client.pttl(lock.key) <= 30_000
    client.close()


# --------------------------------------------------------------------------
# The async classes share the algorithm: the same cuts
# --------------------------------------------------------------------------


@pytest.mark.lost_reply
def test_async_consume_acquire_extend_release_with_lost_replies(proxy: FaultProxy, name: str) -> None:
    """AsyncRedisTokens / AsyncRedisLock: each lost reply is retried and answered with what happened."""

    async def main() -> None:
        client = async_through(proxy)
        try:
            tokens = AsyncRedisTokens(client)
            await tokens.consume("warm-up", scope=name)
            token = await tokens.issue(scope=name, ttl=MINUTE)
            cut_next_script(proxy)
            assert (await tokens.consume(token, scope=name)).outcome is Outcome.APPLIED
            assert (await tokens.consume(token, scope=name)).outcome is Outcome.REPEATED

            lock = AsyncRedisLock(client, name, ttl=10, blocking_timeout=0)
            async with lock:
                await lock.extend(1)
            cut_next_script(proxy)
            fence = await lock.acquire()
            assert await lock.owned() and fence == int(await client.get(lock.fence_key))
            cut_next_script(proxy)
            await lock.extend(20)
            assert 25_000 < await client.pttl(lock.key) <= 30_000
            cut_next_script(proxy)
            await lock.release()
            assert not await lock.locked()
        finally:
            await client.aclose()

    asyncio.run(main())
    assert proxy.cuts == 4


@pytest.mark.lost_reply
def test_after_a_lost_consume_other_threads_never_inherit_its_identity(proxy: FaultProxy, name: str) -> None:
    """Retries off: after a lost consume, 16 other threads consuming through the same object (barrier)
    all get REPEATED (they did not consume it); the caller whose reply was lost gets APPLIED once.

    Without it, the other threads would be seen inheriting the lost call's id (one of them told to
    do the work, the real consumer told REPEATED).
    """
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import redis

    client = through(proxy, retries=False)
    warm(client, name)
    tokens = RedisTokens(client)
    token = tokens.issue(scope=name, ttl=MINUTE)
    cut_next_script(proxy)
    with pytest.raises(redis.ConnectionError):
        tokens.consume(token, scope=name)
    start = threading.Barrier(16, timeout=30)

    def other() -> Outcome:
        start.wait()
        return tokens.consume(token, scope=name).outcome

    with ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(lambda _: other(), range(16)))
    assert outcomes == [Outcome.REPEATED] * 16, outcomes
    assert tokens.consume(token, scope=name).outcome is Outcome.APPLIED  # the caller's own effect
    assert tokens.consume(token, scope=name).outcome is Outcome.REPEATED
    client.close()


# --------------------------------------------------------------------------
# wait_replicas: the write and its WAIT travel in one pipeline; both replies lost
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replicated() -> Iterator[tuple[RedisServer, RedisServer]]:
    """A private master and one replica of it, synced (as in tests/test_redis_failover.py)."""
    import redis

    with RedisServer(args=["--repl-diskless-sync-delay", "0"]) as master:
        with RedisServer(args=["--replicaof", master.host, str(master.port)]) as replica:
            client = redis.Redis(port=master.port)
            deadline = time.monotonic() + 20
            while (client.info("replication").get("slave0") or {}).get("state") != "online":
                assert time.monotonic() < deadline, "the private replica did not sync within 20 s"
                time.sleep(0.05)
            client.close()
            yield master, replica


@pytest.mark.lost_reply
@pytest.mark.failover
def test_writes_with_wait_replicas_whose_replies_were_lost_apply_once(
    replicated: tuple[RedisServer, RedisServer],
) -> None:
    """The script and its WAIT ran on the master, both replies were cut: redis-py sends the pipeline
    again, the script recognises its own first run, and WAIT counts the replica again.  A consume is
    APPLIED once (on the replica too), an acquisition holds the lock with one fence, a release frees it."""
    import redis

    master, replica = replicated
    name = f"sgt-lost-wait-{uuid.uuid4().hex[:8]}"
    on_replica = redis.Redis(port=replica.port)
    with FaultProxy(master.host, master.port) as proxy:
        client = redis.Redis(host=proxy.host, port=proxy.port)
        try:
            warm(client, name)
            tokens = RedisTokens(client, wait_replicas=1, wait_timeout=2)
            token = tokens.issue(scope=name, ttl=MINUTE)
            cut_next_script(proxy)
            assert tokens.consume(token, scope=name).outcome is Outcome.APPLIED
            assert proxy.cuts == 1
            assert on_replica.get(RedisTokens.key(name, token)).startswith(b"used:")
            assert tokens.consume(token, scope=name).outcome is Outcome.REPEATED

            lock = RedisLock(client, name, ttl=30, blocking_timeout=0, wait_replicas=1, wait_timeout=2)
            cut_next_script(proxy)
            fence = lock.acquire()
            assert proxy.cuts == 2
            assert lock.owned() and int(on_replica.get(lock.fence_key)) == fence
            cut_next_script(proxy)
            lock.release()
            assert proxy.cuts == 3
            assert not lock.locked() and on_replica.get(lock.key) is None
            with RedisLock(client, name, ttl=30, blocking_timeout=0) as after:
                assert after > fence
        finally:
            client.close()
            on_replica.close()
