"""AsyncRedisTokens and AsyncRedisLock (redis.asyncio) against the test Redis server."""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest

from stateguard import (
    AsyncRedisLock,
    AsyncRedisTokens,
    InvalidArgument,
    LockLost,
    LockNotAcquired,
    NotFound,
    Outcome,
    RedisLock,
    RedisTokens,
    guarded_update,
)
from tests._support.lock_workers import LockBase, Payout
from tests.conftest import REDIS_URL

T = TypeVar("T")
MINUTE = timedelta(minutes=1)


@pytest.fixture
def prefix(redis_client: Any) -> Iterator[str]:
    """A scope / lock-name prefix unique to the test; its token and lock keys are deleted afterwards."""
    name = f"sgt-{uuid.uuid4().hex[:12]}"
    yield name
    for pattern in (f"stateguard:token:{name}*", f"stateguard:lock:{{{name}*"):
        keys = list(redis_client.scan_iter(match=pattern))
        if keys:
            redis_client.delete(*keys)


def run(main: Callable[[Any], Awaitable[T]]) -> T:
    """Run ``main(client)`` in a fresh event loop with a redis.asyncio client closed afterwards.

    The pool allows more than the 200 connections the widest test opens
    (redis-py's asyncio default of 100 raises MaxConnectionsError beyond it);
    a test that hangs fails after a minute instead of stalling CI.
    """
    import redis.asyncio

    async def go() -> T:
        client = redis.asyncio.Redis.from_url(REDIS_URL, max_connections=256)
        try:
            async with asyncio.timeout(60):
                return await main(client)
        finally:
            await client.aclose()

    return asyncio.run(go())


async def together(*coros: Coroutine[Any, Any, T]) -> list[T]:
    """Run ``coros`` as concurrent tasks and return their results; one failing cancels the others."""
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(c) for c in coros]
    return [t.result() for t in tasks]


class StartLine:
    """Holds tasks until all ``n`` have arrived, then releases them in one loop step.

    Used instead of asyncio.Barrier, whose Condition can hang when many
    waiters are cancelled at once on Python 3.11 (a failing test would
    stall instead of failing).
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.arrived = 0
        self.go = asyncio.Event()

    async def wait(self) -> None:
        self.arrived += 1
        if self.arrived == self.n:
            self.go.set()
        await self.go.wait()


# --------------------------------------------------------------------------
# AsyncRedisTokens
# --------------------------------------------------------------------------


def test_async_tokens_apply_once_then_repeat_and_keep_the_ttl(redis_client: Any, prefix: str) -> None:
    """An awaited token is APPLIED once and REPEATED after, and its tombstone keeps the remaining TTL."""

    async def main(client: Any) -> None:
        tokens = AsyncRedisTokens(client)
        token = await tokens.issue(scope=prefix, ttl=timedelta(seconds=30))
        key = AsyncRedisTokens.key(prefix, token)
        assert key == RedisTokens.key(prefix, token) and token not in key
        ttl_before = await client.pttl(key)
        assert 0 < ttl_before <= 30_000
        first = await tokens.consume(token, scope=prefix)
        assert first.outcome is Outcome.APPLIED and first.state == "consumed"
        assert (await client.get(key)).startswith(b"used:")  # names the call that consumed it
        ttl_after = await client.pttl(key)
        assert 0 < ttl_after <= ttl_before  # KEEPTTL: not reset, not made persistent
        again = await tokens.consume(token, scope=prefix)
        assert again.outcome is Outcome.REPEATED
        assert again.key == hashlib.sha256(token.encode()).hexdigest()
        assert 0 < await client.pttl(key) <= ttl_after

    run(main)


def test_async_tokens_unknown_other_scope_and_expired_are_not_found(redis_client: Any, prefix: str) -> None:
    """A forged token, another scope's token and an expired token all come back NOT_FOUND."""

    async def main(client: Any) -> None:
        tokens = AsyncRedisTokens(client)
        token = await tokens.issue(scope=prefix, ttl=timedelta(seconds=30))
        assert (await tokens.consume("forged", scope=prefix)).outcome is Outcome.NOT_FOUND
        assert (await tokens.consume(token, scope=f"{prefix}-other")).outcome is Outcome.NOT_FOUND
        short = await tokens.issue(scope=prefix, ttl=timedelta(milliseconds=100))
        await asyncio.sleep(0.3)
        expired = await tokens.consume(short, scope=prefix)
        assert expired.outcome is Outcome.NOT_FOUND
        with pytest.raises(NotFound):
            expired.raise_for_outcome()
        assert (await tokens.consume(token, scope=prefix)).outcome is Outcome.APPLIED

    run(main)


def test_200_tasks_consuming_one_token_get_exactly_one_applied(redis_client: Any, prefix: str) -> None:
    """200 asyncio tasks released together consume one token: one APPLIED, 199 REPEATED."""

    async def main(client: Any) -> Counter[Outcome]:
        tokens = AsyncRedisTokens(client)
        token = await tokens.issue(scope=prefix, ttl=MINUTE)
        barrier = StartLine(200)

        async def consumer() -> Outcome:
            await client.ping()  # open this task's pooled connection before the race
            await barrier.wait()
            return (await tokens.consume(token, scope=prefix)).outcome

        return Counter(await together(*(consumer() for _ in range(200))))

    assert run(main) == {Outcome.APPLIED: 1, Outcome.REPEATED: 199}


def test_async_consume_is_one_script_call(redis_client: Any, prefix: str) -> None:
    """Consuming sends one EVALSHA (no GET then SET) once the script is cached."""

    async def main(client: Any) -> list[str]:
        tokens = AsyncRedisTokens(client)
        token = await tokens.issue(scope=prefix, ttl=MINUTE)
        await tokens.consume("warm-up", scope=prefix)
        sent: list[str] = []
        original = client.execute_command

        async def spy(*args: Any, **kwargs: Any) -> Any:
            sent.append(str(args[0]).upper())
            return await original(*args, **kwargs)

        client.execute_command = spy
        try:
            assert (await tokens.consume(token, scope=prefix)).applied
        finally:
            del client.execute_command
        return sent

    assert run(main) == ["EVALSHA"]


def test_sync_and_async_tokens_are_interchangeable(redis_client: Any, prefix: str) -> None:
    """A token issued by RedisTokens is consumed by AsyncRedisTokens and the other way round."""
    sync_tokens = RedisTokens(redis_client)
    from_sync = sync_tokens.issue(scope=prefix, ttl=MINUTE)

    async def main(client: Any) -> str:
        tokens = AsyncRedisTokens(client)
        assert (await tokens.consume(from_sync, scope=prefix)).outcome is Outcome.APPLIED
        return await tokens.issue(scope=prefix, ttl=MINUTE)

    from_async = run(main)
    assert sync_tokens.consume(from_sync, scope=prefix).outcome is Outcome.REPEATED
    assert sync_tokens.consume(from_async, scope=prefix).outcome is Outcome.APPLIED


@pytest.mark.hostile
def test_async_tokens_bad_input_is_typed(redis_client: Any, prefix: str) -> None:
    """Bad tokens, scopes, ttls and clients of the wrong kind raise InvalidArgument before Redis is called."""

    async def main(client: Any) -> None:
        tokens = AsyncRedisTokens(client)
        for bad in (None, "", "x" * 256, "a\x00b"):
            with pytest.raises(InvalidArgument):
                await tokens.consume(bad, scope=prefix)  # type: ignore[arg-type]
        for ttl in (timedelta(0), 5):
            with pytest.raises(InvalidArgument):
                await tokens.issue(scope=prefix, ttl=ttl)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument):
            await tokens.issue(scope="", ttl=MINUTE)
        with pytest.raises(InvalidArgument, match=r"use AsyncRedisTokens"):
            RedisTokens(client)

    run(main)
    with pytest.raises(InvalidArgument, match=r"needs a redis client \(redis\.asyncio\.Redis\)"):
        AsyncRedisTokens(None)
    with pytest.raises(InvalidArgument, match=r"use RedisTokens"):
        AsyncRedisTokens(redis_client)
    assert list(redis_client.scan_iter(match=f"stateguard:token:{prefix}:*")) == []


# --------------------------------------------------------------------------
# AsyncRedisLock
# --------------------------------------------------------------------------


def test_50_tasks_contending_hold_the_lock_one_at_a_time_with_growing_fences(
    redis_client: Any, prefix: str
) -> None:
    """50 tasks (half sharing one lock object) never overlap inside the lock, and their fences grow."""
    name = f"{prefix}:contended"

    async def main(client: Any) -> tuple[int, list[int]]:
        shared = AsyncRedisLock(client, name, ttl=5, sleep=0.002)
        barrier = StartLine(50)
        inside = most = 0
        entered: list[int] = []

        async def worker(i: int) -> None:
            nonlocal inside, most
            lock = shared if i % 2 else AsyncRedisLock(client, name, ttl=5, sleep=0.002)
            await barrier.wait()
            async with lock as fence:
                inside += 1
                most = max(most, inside)
                entered.append(fence)
                assert lock.fence == fence
                await asyncio.sleep(0.002)  # let every other task try to get in
                assert await lock.owned()
                inside -= 1

        await together(*(worker(i) for i in range(50)))
        assert not await shared.locked()
        return most, entered

    most, fences = run(main)
    assert most == 1
    # Strictly increasing: seeded from the server clock, a fence need not be the last one plus one.
    assert fences == sorted(set(fences)) and len(fences) == 50
    assert int(redis_client.get(f"stateguard:lock:{{{name}}}:fence")) == fences[-1]


@pytest.mark.cancel
def test_blocking_timeout_zero_fails_at_once_without_consuming_a_fence(
    redis_client: Any, prefix: str
) -> None:
    """While the lock is held, blocking_timeout=0 raises LockNotAcquired at once and takes no fence."""
    name = f"{prefix}:busy"

    async def main(client: Any) -> None:
        async with AsyncRedisLock(client, name, ttl=5) as fence:
            waiter = AsyncRedisLock(client, name, ttl=5, blocking_timeout=0)
            started = time.monotonic()
            with pytest.raises(LockNotAcquired, match="is held by someone else; gave up after 0s") as caught:
                async with waiter:
                    pass  # pragma: no cover
            assert time.monotonic() - started < 0.5
            assert caught.value.retryable is True
            patient = AsyncRedisLock(client, name, ttl=5, blocking_timeout=0.3, sleep=0.01)
            started = time.monotonic()
            with pytest.raises(LockNotAcquired, match=r"gave up after 0\.3s"):
                await patient.acquire()
            assert 0.2 <= time.monotonic() - started < 1.5
            with pytest.raises(LockNotAcquired):
                await patient.acquire(blocking_timeout=0)
            assert int(await client.get(waiter.fence_key)) == fence
            assert waiter.fence is None and patient.fence is None

    run(main)


@pytest.mark.lost_reply
def test_expired_hold_raises_lock_lost_and_leaves_the_next_tasks_hold(redis_client: Any, prefix: str) -> None:
    """Two tasks share one lock: the one paused past its TTL gets LockLost, the next keeps its hold."""
    name = f"{prefix}:expired"

    async def main(client: Any) -> tuple[int, int, float]:
        lock = AsyncRedisLock(client, name, ttl=0.2, blocking_timeout=5, sleep=0.01)
        a_holds, b_holds, a_done = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def first() -> int:
            fence = await lock.acquire()
            a_holds.set()
            await b_holds.wait()  # the pause: a slow call past the TTL
            assert lock.fence == fence  # this task's fence, not the newer one
            assert not await lock.owned()
            with pytest.raises(LockLost, match=r"AsyncRedisLock .* expired before it was released"):
                await lock.release()
            a_done.set()
            return fence

        async def second() -> tuple[int, float]:
            await a_holds.wait()
            started = time.monotonic()
            fence = await lock.acquire()
            waited = time.monotonic() - started
            await lock.extend(5)
            token = await client.get(lock.key)
            b_holds.set()
            await a_done.wait()
            assert await lock.owned() and await client.get(lock.key) == token
            await lock.release()
            assert not await lock.locked()
            return fence, waited

        async with asyncio.TaskGroup() as group:
            a, b = group.create_task(first()), group.create_task(second())
        old, (new, waited) = a.result(), b.result()
        return old, new, waited

    old, new, waited = run(main)
    assert new > old
    assert waited > 0.1  # the second task really waited for the expiry


def test_a_task_cannot_release_another_tasks_hold(redis_client: Any, prefix: str) -> None:
    """The owner token is per task: another task releasing or extending it gets InvalidArgument."""
    name = f"{prefix}:mine"

    async def main(client: Any) -> None:
        lock = AsyncRedisLock(client, name, ttl=5)
        fence = await lock.acquire()

        async def intruder() -> None:
            assert lock.fence is None and not await lock.owned()
            with pytest.raises(InvalidArgument, match="is not held by this task"):
                await lock.release()
            with pytest.raises(InvalidArgument, match="is not held by this task"):
                await lock.extend(1)

        await asyncio.create_task(intruder())
        assert await lock.owned() and lock.fence == fence
        await lock.release()
        with pytest.raises(InvalidArgument, match="is not held by this task"):
            await lock.release()

    run(main)


def test_async_lock_error_in_block_wins_and_extend_fails_once_lost(redis_client: Any, prefix: str) -> None:
    """extend() adds time and raises LockLost after expiry; a block's own error wins over LockLost."""

    async def main(client: Any) -> None:
        lock = AsyncRedisLock(client, f"{prefix}:extend", ttl=0.2)
        with pytest.raises(LockLost, match="expired before it was released"):
            async with lock as fence:
                await lock.extend(timedelta(seconds=5))
                assert await client.pttl(lock.key) > 4000
                assert lock.fence == fence
                await lock.extend(0.05, replace_ttl=True)
                await asyncio.sleep(0.1)
                with pytest.raises(LockLost, match="expired before it was extended"):
                    await lock.extend(1)
        short = AsyncRedisLock(client, f"{prefix}:err", ttl=0.05)
        with pytest.raises(KeyError):
            async with short:
                await asyncio.sleep(0.1)
                raise KeyError("the real problem")
        async with short:
            await short.release()  # released inside the block: the exit does nothing

    run(main)


def test_sync_and_async_locks_share_the_lock_and_the_fence_counter(redis_client: Any, prefix: str) -> None:
    """RedisLock and AsyncRedisLock on one name exclude each other and draw fences from one counter."""
    name = f"{prefix}:both"
    sync_lock = RedisLock(redis_client, name, ttl=5)
    held = sync_lock.acquire()

    async def main(client: Any) -> int:
        lock = AsyncRedisLock(client, name, ttl=5)
        with pytest.raises(LockNotAcquired):
            await lock.acquire(blocking_timeout=0)
        sync_lock.release()
        async with lock as fence:
            assert sync_lock.locked()
            with pytest.raises(LockNotAcquired):
                sync_lock.acquire(blocking_timeout=0)
        return fence

    from_async = run(main)
    assert from_async > held
    assert sync_lock.acquire(blocking_timeout=0) > from_async
    assert int(redis_client.get(sync_lock.fence_key)) == sync_lock.fence
    sync_lock.release()


def test_async_lock_validates_its_arguments(redis_client: Any, prefix: str) -> None:
    """ttl is required and positive, names are non-empty strings, the client must be a redis.asyncio one."""

    async def main(client: Any) -> None:
        with pytest.raises(TypeError):
            AsyncRedisLock(client, "x")  # type: ignore[call-arg]
        for ttl in (0, -1, "5", True, 0.0001):
            with pytest.raises(InvalidArgument):
                AsyncRedisLock(client, "x", ttl=ttl)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="needs a non-empty str name"):
            AsyncRedisLock(client, "", ttl=1)
        with pytest.raises(InvalidArgument):
            AsyncRedisLock(client, "x", ttl=1, blocking_timeout=-1)
        lock = AsyncRedisLock(client, f"{prefix}:v", ttl=1)
        with pytest.raises(InvalidArgument):
            await lock.acquire(blocking_timeout="1")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="use AsyncRedisLock"):
            RedisLock(client, "x", ttl=1)
        assert repr(lock) == f"<AsyncRedisLock '{prefix}:v' ttl=1s fence=None>"

    run(main)
    with pytest.raises(InvalidArgument, match="use RedisLock"):
        AsyncRedisLock(redis_client, "x", ttl=1)
    with pytest.raises(InvalidArgument, match=r"needs a redis client"):
        AsyncRedisLock(object(), "x", ttl=1)


def test_async_lock_without_redis_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without redis-py installed, AsyncRedisLock raises ImportError naming the stateguard[redis] extra."""
    for module in ("redis", "redis.asyncio", "redis.asyncio.lock"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImportError, match=r"AsyncRedisLock needs the redis package.*stateguard\[redis\]"):
        AsyncRedisLock(object(), "x", ttl=1)


def test_fence_from_the_async_lock_refuses_a_stale_holders_sql_write(
    redis_client: Any, prefix: str, tmp_path: Path
) -> None:
    """Through an AsyncSession the expired holder's fenced update is STALE; the newer write stays."""
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    name = f"{prefix}:payout"

    async def main(client: Any) -> dict[str, Any]:
        engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'fence.db'}")
        try:
            async with engine.begin() as conn:
                await conn.run_sync(LockBase.metadata.create_all)
            async with AsyncSession(engine) as s, s.begin():
                s.add(Payout(id=1, holder=None))
            lock = AsyncRedisLock(client, name, ttl=0.2, blocking_timeout=5, sleep=0.01)
            a_holds, b_wrote, a_done = asyncio.Event(), asyncio.Event(), asyncio.Event()

            async def write(holder: str, fence: int) -> str:
                async with AsyncSession(engine) as s, s.begin():
                    version = (await s.get_one(Payout, 1)).version
                    r = await guarded_update(
                        s, Payout, 1, {"holder": holder}, expected_version=version, fence=fence
                    )
                    return r.outcome.name

            async def first() -> tuple[str, bool]:
                outcome, lost = "", False
                try:
                    async with lock as fence:
                        a_holds.set()
                        await b_wrote.wait()  # paused past the TTL while B took over and wrote
                        outcome = await write("A", fence)
                except LockLost:
                    lost = True
                finally:
                    a_done.set()
                return outcome, lost

            async def second() -> str:
                await a_holds.wait()
                async with lock as fence:
                    outcome = await write("B", fence)
                    await lock.extend(5)
                    b_wrote.set()
                    await a_done.wait()  # still held while A writes and exits
                    assert await lock.owned()
                return outcome

            async with asyncio.TaskGroup() as group:
                a, b = group.create_task(first()), group.create_task(second())
            (a_outcome, a_lost), b_outcome = a.result(), b.result()
            async with AsyncSession(engine) as s:
                row = await s.get_one(Payout, 1)
                return {"a": a_outcome, "a_lost": a_lost, "b": b_outcome, "row": (row.holder, row.fence)}
        finally:
            await engine.dispose()

    out = run(main)
    assert (out["a"], out["a_lost"], out["b"]) == ("STALE", True, "APPLIED")
    holder, fence = out["row"]
    assert holder == "B" and fence == int(redis_client.get(f"stateguard:lock:{{{name}}}:fence"))
