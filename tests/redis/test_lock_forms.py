"""RedisLock and AsyncRedisLock share their fencing (the _Fenced mixin): locks of both forms on one
name exclude each other with growing fences, an async lock cancelled while waiting never keeps the
lock (also when the client swallows the cancel), and a lost release reply still releases."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from stateguard import (
    AsyncRedisLock,
    LockNotAcquired,
    RedisLock,
)
from tests.conftest import REDIS_URL

# --------------------------------------------------------------------------
# RedisLock / AsyncRedisLock: the _Fenced mixin
# --------------------------------------------------------------------------


def test_sync_and_async_locks_on_one_name_exclude_each_other_with_growing_fences(
    redis_client: Any, lock_name: str
) -> None:
    """Both classes share the mixin's scripts: one fence sequence, one owner at a time, and each
    class's scripts registered on its own class (the sync class's must not serve the async one)."""
    import redis.asyncio

    fences: list[int] = []
    sync_lock = RedisLock(redis_client, lock_name, ttl=10, blocking_timeout=0)

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(REDIS_URL)
        try:
            alock = AsyncRedisLock(client, lock_name, ttl=10, blocking_timeout=0)
            for _ in range(3):
                fences.append(sync_lock.acquire())
                with pytest.raises(LockNotAcquired):
                    await alock.acquire()
                assert not await alock.owned() and await alock.locked()
                sync_lock.extend(5)
                sync_lock.release()
                fences.append(await alock.acquire())
                with pytest.raises(LockNotAcquired):
                    sync_lock.acquire()
                await alock.extend(5, replace_ttl=True)
                assert 0 < await client.pttl(alock.key) <= 5000
                await alock.release()
            assert not await alock.locked()
        finally:
            await client.aclose()

    asyncio.run(main())
    assert fences == sorted(fences) and len(set(fences)) == 6


@pytest.mark.cancel
def test_async_lock_cancelled_while_waiting_does_not_keep_the_lock(redis_client: Any, lock_name: str) -> None:
    import redis.asyncio

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(REDIS_URL)
        try:
            holder = AsyncRedisLock(client, lock_name, ttl=30)
            waiter = AsyncRedisLock(client, lock_name, ttl=30, blocking_timeout=3, sleep=0.01)
            await holder.acquire()
            task = asyncio.create_task(waiter.acquire())
            await asyncio.sleep(0.2)
            task.cancel()
            # redis-py 8.1's asyncio client now and then swallows a cancellation that arrives
            # inside a command (18 of 300 cancels in a plain redis-py loop on this machine): its
            # own Lock.acquire then returns False at blocking_timeout.  AsyncRedisLock notices the
            # pending cancellation and raises CancelledError all the same (see
            # test_async_lock_cancellation_swallowed_by_the_client_still_cancels).
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await holder.owned() and not await waiter.owned()
            await holder.release()
            assert not await client.exists(holder.key)
            third = AsyncRedisLock(client, lock_name, ttl=30, blocking_timeout=0)
            await third.acquire()
            await third.release()
        finally:
            await client.aclose()

    asyncio.run(main())


def _swallowing_evalsha(client: Any, *, then_run: bool) -> tuple[list[str], asyncio.Event]:
    """Make ``client``'s EVALSHA swallow a cancellation that arrives while it is in flight, as
    redis-py 8.1's asyncio client now and then does: the command then returns "not taken" (``None``),
    or with ``then_run`` runs for real (and may take the lock).  Returns a log of what it did and an
    event set whenever a command is in flight."""
    real = client.evalsha
    seen: list[str] = []
    in_flight = asyncio.Event()

    async def evalsha(*args: Any) -> Any:
        in_flight.set()
        try:
            await asyncio.sleep(0.5)  # the command "on the wire": where the cancel lands
        except asyncio.CancelledError:
            seen.append("swallowed")
            if not then_run:
                return None
        finally:
            in_flight.clear()
        return await real(*args)

    client.evalsha = evalsha
    return seen, in_flight


@pytest.mark.cancel
@pytest.mark.parametrize("then_run", [False, True], ids=["not-taken", "taken-meanwhile"])
def test_async_lock_cancellation_swallowed_by_the_client_still_cancels(
    redis_client: Any, lock_name: str, then_run: bool
) -> None:
    """A waiter cancelled inside a command whose client swallows the CancelledError still ends
    cancelled and never keeps the lock: not taken (the lock is held; the client then answers
    "held" until blocking_timeout), or taken by that very command (the lock was free; it is given
    back before CancelledError)."""
    import redis.asyncio

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(REDIS_URL)
        other = redis.asyncio.Redis.from_url(REDIS_URL)
        try:
            holder = AsyncRedisLock(other, lock_name, ttl=30)
            if not then_run:
                await holder.acquire()
            waiter = AsyncRedisLock(client, lock_name, ttl=30, blocking_timeout=2, sleep=0.01)
            seen, in_flight = _swallowing_evalsha(client, then_run=then_run)
            task = asyncio.create_task(waiter.acquire())
            await asyncio.wait_for(in_flight.wait(), 5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert seen == ["swallowed"], seen
            assert not await waiter.owned()
            if then_run:
                assert not await other.exists(holder.key), "the cancelled task's lock was not given back"
            else:
                assert await holder.owned()
                await holder.release()
        finally:
            await client.aclose()
            await other.aclose()

    asyncio.run(main())


@pytest.mark.cancel
def test_async_lock_earlier_handled_cancellation_does_not_cancel_acquire(
    redis_client: Any, lock_name: str
) -> None:
    """Only a cancellation requested during acquire() counts: a task that was cancelled before and
    handled it (its cancelling() count stays up) still takes a free lock."""
    import redis.asyncio

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(REDIS_URL)
        try:

            async def work() -> int:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(10)  # cancelled below, and the cancellation swallowed
                task = asyncio.current_task()
                assert task is not None and task.cancelling() == 1
                lock = AsyncRedisLock(client, lock_name, ttl=30, blocking_timeout=0)
                fence = await lock.acquire()
                await lock.release()
                return fence

            task = asyncio.create_task(work())
            await asyncio.sleep(0.05)
            task.cancel()
            assert await task >= 1
        finally:
            await client.aclose()

    asyncio.run(main())


@pytest.mark.lost_reply
def test_async_lock_lost_release_reply_is_released(redis_client: Any, lock_name: str) -> None:
    """Through the fault proxy: the release script ran, its reply was cut; redis-py's retry is
    answered with 'released', not LockLost, and the lock is free."""
    import redis.asyncio

    from tests._support.faultproxy import FaultProxy

    kwargs = redis_client.connection_pool.connection_kwargs
    with FaultProxy(kwargs.get("host", "127.0.0.1"), kwargs.get("port", 6379)) as proxy:

        async def main() -> None:
            client = redis.asyncio.Redis(host=proxy.host, port=proxy.port)
            try:
                lock = AsyncRedisLock(client, lock_name, ttl=10, blocking_timeout=0)
                async with lock:
                    await lock.extend(1)  # loads every script: the cut call is the EVALSHA
                await lock.acquire()
                proxy.cut_after_next_request(b"EVALSHA")
                await lock.release()
                assert not await lock.locked()
            finally:
                await client.aclose()

        asyncio.run(main())
        assert proxy.cuts == 1
