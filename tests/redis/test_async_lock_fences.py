"""AsyncRedisLock(fences=async_engine) under cancellation:

    A task cancelled while it waits gets asyncio.CancelledError (also when redis-py's client
    swallows the cancellation inside a command: acquire() notices the task's pending cancellation,
    gives back a lock it took meanwhile, and raises it).  With fences= a task cancelled while the
    database hands out its fence gives the lock back too, in a task of its own that a further
    cancellation cannot cut.  A task cancelled while its acquisition is on the wire may leave the
    lock held until its TTL ends (as does a give-back that finds Redis down).

Real servers only: the shared PostgreSQL (both async drivers), the shared Redis, and private
redis-server processes (tests/_support/redis_server.py) for crashes.  Races are built deterministically:
the fence upsert is blocked by another connection's ``SELECT ... FOR UPDATE`` of the lock's row
(found waiting in pg_stat_activity), redis-py commands are intercepted per command (the ``Wire``
of tests/_support/redis_wire.py for EVALSHA, :class:`Gets` here for the ``GET`` of ``owned()``)
to stall or to swallow a cancel, and the lost COMMIT reply goes through tests/_support/faultproxy.py.
Timeouts are only liveness bounds.

After each scenario the checks are the same (:func:`after_the_attack`): the task ended as it must
(CancelledError / TimeoutError / the database's error), the Redis key is gone, ``lock.owned()``
is False in that task and its ``fence`` is None, another client takes the lock at once, and a
later ``acquire()`` by the same task works and gets a larger fence than any handed out before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from sqlalchemy import Engine, text

from stateguard import AsyncRedisLock, create_tables
from tests._support.async_helpers import AsyncTarget, async_target
from tests._support.redis_wire import LIVENESS_BOUND, Wire, _finish, clients

DRIVERS = pytest.mark.parametrize("driver", ["asyncpg", "psycopg_async"])


async def _forever() -> None:
    await asyncio.Event().wait()


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


class Gets:
    """The redis.asyncio client's ``GET`` (what redis-py's ``Lock.owned()`` sends) under the test's
    control, for the calls of ``task`` only: ``queue(hook)`` makes the next GET run ``hook(real)``."""

    def __init__(self, client: Any) -> None:
        self.real = client.get
        self.hooks: list[Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]]] = []
        self.log: list[str] = []
        self.in_flight = asyncio.Event()
        self.task: asyncio.Task[Any] | None = None
        client.get = self._get

    async def _get(self, *args: Any, **kwargs: Any) -> Any:
        mine = self.task is None or asyncio.current_task() is self.task
        if not mine or not self.hooks:
            return await self.real(*args, **kwargs)
        hook = self.hooks.pop(0)
        return await hook(lambda: self.real(*args, **kwargs))

    def swallow(self) -> Any:
        """Block on the wire until cancelled, swallow the CancelledError (redis-py's habit the
        promise names), then send the GET for real and answer."""

        async def hook(real: Callable[[], Awaitable[Any]]) -> Any:
            self.in_flight.set()
            try:
                await _forever()
            except asyncio.CancelledError:
                self.log.append("swallowed")
            return await real()

        return hook

    def stall(self) -> Any:
        """Block before the GET is sent until cancelled (the cancel is delivered)."""

        async def hook(real: Callable[[], Awaitable[Any]]) -> Any:
            self.in_flight.set()
            try:
                await _forever()
            except asyncio.CancelledError:
                self.log.append("stalled-cancelled")
                raise
            return await real()  # pragma: no cover

        return hook


@dataclass
class Outcome:
    """What the attacked task saw, recorded inside that task."""

    error: BaseException | None = None
    fence: int | None = None
    owned_after: bool | None = None
    fence_attr_after: int | None = None
    later_fence: int | None = None
    notes: list[str] = field(default_factory=list)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    go: asyncio.Event = field(default_factory=asyncio.Event)
    key_at_end: int | None = None


async def settle(out: Outcome, other: Any, key: str) -> None:
    """Wait (liveness bound) until the attacked acquire has ended, note whether Redis still holds
    the lock at that moment, and let the task go on to its later acquire()."""
    await asyncio.wait_for(out.ended.wait(), LIVENESS_BOUND)
    out.key_at_end = await other.exists(key)


def _waiting_upserts(sync_engine: Engine) -> int:
    with sync_engine.connect() as probe:
        return int(
            probe.scalar(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND query LIKE '%INSERT INTO stateguard_fences%' AND pid <> pg_backend_pid()"
                )
            )
            or 0
        )


async def wait_until_the_upsert_waits(sync_engine: Engine) -> None:
    """Liveness bound only: the fence upsert must start waiting for the blocker's row lock."""
    for _ in range(500):
        if await asyncio.to_thread(_waiting_upserts, sync_engine):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the fence upsert never waited for the blocker's row")


@contextlib.contextmanager
def row_blocked(sync_engine: Engine, name: str) -> Any:
    """Another transaction holds the lock's row in stateguard_fences (SELECT ... FOR UPDATE): the
    fence upsert waits for it.  The row must exist (take one fence first)."""
    blocker = sync_engine.connect()
    try:
        got = blocker.execute(
            text("SELECT fence FROM stateguard_fences WHERE name = :n FOR UPDATE"), {"n": name}
        ).scalar()
        assert got is not None, "take a fence first: the row must exist to be locked"
        yield blocker
    finally:
        blocker.rollback()
        blocker.close()


def engine_without_the_fences_table(target: AsyncTarget) -> Any:
    """An AsyncEngine on the same database whose search_path (pg_catalog) has no stateguard_fences."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.ext.asyncio import create_async_engine

    url = make_url(target.url)
    if target.driver == "asyncpg":
        return create_async_engine(url, connect_args={"server_settings": {"search_path": "pg_catalog"}})
    return create_async_engine(url.update_query_dict({"options": "-csearch_path=pg_catalog"}))


def _max_fence(sync_engine: Engine, name: str) -> int:
    with sync_engine.connect() as conn:
        return int(conn.scalar(text("SELECT fence FROM stateguard_fences WHERE name = :n"), {"n": name}) or 0)


@dataclass
class Setup:
    target: AsyncTarget
    sync_engine: Engine


@pytest.fixture
def setup(pg: Any, request: pytest.FixtureRequest) -> Any:
    driver = request.node.callspec.params["driver"]
    target = async_target(driver, pg)
    sync_engine = target.sync_engine()
    create_tables(sync_engine)
    try:
        yield Setup(target, sync_engine)
    finally:
        sync_engine.dispose()


async def baseline(lock: AsyncRedisLock) -> int:
    """One ordinary acquisition (creates the lock's row); its fence."""
    fence = await lock.acquire(blocking_timeout=0)
    await lock.release()
    return fence


async def record_then_retry(
    lock: AsyncRedisLock, out: Outcome, attack: Callable[[], Awaitable[int]], *, expect: type[BaseException]
) -> None:
    """Run ``attack`` in this task; record how it ended and, still in this task, what the lock
    says afterwards; then acquire again (the same task) and record that fence."""
    task = asyncio.current_task()
    assert task is not None
    try:
        out.fence = await attack()
    except BaseException as error:
        out.error = error
    if isinstance(out.error, asyncio.CancelledError):
        while task.uncancel():  # handled: the task goes on (as a retry loop would)
            pass
    out.ended.set()
    await out.go.wait()
    out.owned_after = await lock.owned()
    out.fence_attr_after = lock.fence
    if out.fence is not None:
        # The promise is broken (it got the lock although cancelled): clean up for the next checks.
        out.notes.append("acquire returned a fence despite the cancellation")
        if await lock.owned():
            await lock.release()
    if not isinstance(out.error, expect):
        return
    out.later_fence = await lock.acquire(blocking_timeout=2)
    await lock.release()


async def after_the_attack(
    out: Outcome,
    *,
    expect: type[BaseException],
    other: Any,
    key: str,
    name: str,
    engine: Any,
    before: int,
) -> None:
    assert out.fence is None, (
        f"acquire() returned fence {out.fence} to a task that was cancelled / whose fence failed; "
        f"it ended with {out.error!r}"
    )
    assert isinstance(out.error, expect), f"the task ended with {out.error!r}, not {expect.__name__}"
    assert not out.key_at_end, "Redis still held the lock when the failed acquire() had ended"
    assert out.owned_after is False, "lock.owned() says True in the task told it did not get the lock"
    assert out.fence_attr_after is None, f"lock.fence is {out.fence_attr_after} after a failed acquire"
    assert out.later_fence is not None and out.later_fence > before, (
        f"a later acquire() by the same task got {out.later_fence}, not a fence above {before}"
    )
    assert not await other.exists(key), "the lock is still held after the attacked task's retry released it"
    third = AsyncRedisLock(other, name, ttl=30, blocking_timeout=0, fences=engine)
    assert await third.acquire() > out.later_fence
    await third.release()


@dataclass
class Scene:
    """The lock under attack: ``lock`` on ``client`` takes its fences from ``engine`` and took one
    ordinary fence, ``before``, first; ``other`` is a second client (checks, other holders)."""

    engine: Any
    client: Any
    other: Any
    lock: AsyncRedisLock
    before: int

    async def end(self, task: asyncio.Task[Any], out: Outcome, *, expect: type[BaseException]) -> None:
        """Let the attacked ``task`` go on to its later acquire(), wait for it (liveness bound), then
        :meth:`check`."""
        out.go.set()
        await _finish(task)
        task.result()
        await self.check(out, expect=expect)

    async def check(self, out: Outcome, *, expect: type[BaseException]) -> None:
        """:func:`after_the_attack` for this lock."""
        await after_the_attack(
            out, expect=expect, other=self.other, key=self.lock.key, name=self.lock.name,
            engine=self.engine, before=self.before,
        )  # fmt: skip


@contextlib.asynccontextmanager
async def scene(
    setup: Setup, lock_name: str, *, engine: Any = None, **lock_options: Any
) -> AsyncIterator[Scene]:
    """A :class:`Scene` on ``setup``'s PostgreSQL (``engine``: the fences engine, a new one by
    default) and the shared Redis; the engine is disposed at the end."""
    engine = setup.target.engine() if engine is None else engine
    try:
        async with clients() as (client, other):
            options = {"ttl": 30, "blocking_timeout": 1, **lock_options}
            lock = AsyncRedisLock(client, lock_name, fences=engine, **options)
            yield Scene(engine, client, other, lock, await baseline(lock))
    finally:
        await engine.dispose()


# --------------------------------------------------------------------------
# 1. the ownership check after the fence: a command of redis-py's inside acquire()
# --------------------------------------------------------------------------


@pytest.mark.cancel
@DRIVERS
@pytest.mark.parametrize("how", ["swallowed", "delivered"])
def test_cancel_during_the_ownership_check_after_the_fence(
    setup: Setup, lock_name: str, driver: str, how: str
) -> None:
    """The fence came back; acquire() asks Redis (GET, ``owned()``) whether it
    still holds the lock, and the task is cancelled while that GET is on the wire.
    ``delivered``: redis-py raises the CancelledError.  ``swallowed``: redis-py swallows it inside
    the command (the case the promise names): acquire() must still notice the pending
    cancellation, give the lock back and raise CancelledError, never hand out a fence."""

    async def main() -> None:
        async with scene(setup, lock_name) as s:
            client, other, lock = s.client, s.other, s.lock
            gets = Gets(client)
            gets.hooks.append(gets.swallow() if how == "swallowed" else gets.stall())
            out = Outcome()
            task = asyncio.create_task(
                record_then_retry(lock, out, lambda: lock.acquire(), expect=asyncio.CancelledError)
            )
            gets.task = task
            await asyncio.wait_for(gets.in_flight.wait(), 5)
            assert await other.exists(lock.key)
            task.cancel()
            await settle(out, other, lock.key)
            await s.end(task, out, expect=asyncio.CancelledError)
            assert gets.log == ["swallowed" if how == "swallowed" else "stalled-cancelled"]

    asyncio.run(main())


@pytest.mark.cancel
@DRIVERS
def test_timeout_expires_during_the_ownership_check_and_redis_swallows_it(
    setup: Setup, lock_name: str, driver: str
) -> None:
    """``async with asyncio.timeout(...)`` around acquire(); the deadline passes while the GET
    of the ownership check is on the wire and redis-py swallows the cancellation: the block must end
    with TimeoutError (acquire re-raises the cancel), with the lock given back."""

    async def main() -> None:
        async with scene(setup, lock_name) as s:
            client, other, lock = s.client, s.other, s.lock
            gets = Gets(client)
            gets.hooks.append(gets.swallow())
            out = Outcome()
            scope: list[asyncio.Timeout] = []

            async def attack() -> int:
                async with asyncio.timeout(None) as cm:
                    scope.append(cm)
                    return await lock.acquire()

            task = asyncio.create_task(record_then_retry(lock, out, attack, expect=TimeoutError))
            gets.task = task
            await asyncio.wait_for(gets.in_flight.wait(), 5)
            scope[0].reschedule(asyncio.get_running_loop().time())  # the deadline passes now
            await settle(out, other, lock.key)
            await s.end(task, out, expect=TimeoutError)

    asyncio.run(main())


# --------------------------------------------------------------------------
# 2. a cancel while the database hands out the fence (the upsert waits on a row lock)
# --------------------------------------------------------------------------


@pytest.mark.cancel
@DRIVERS
@pytest.mark.parametrize("canceller", ["task.cancel", "asyncio.timeout", "taskgroup", "anyio"])
def test_cancelled_while_the_fence_upsert_waits(
    setup: Setup, lock_name: str, driver: str, canceller: str
) -> None:
    """The upsert of the fence waits for another transaction's row lock; the task is cancelled by
    ``canceller``: task.cancel(), the deadline of asyncio.timeout, a failing sibling in a
    TaskGroup, or anyio.move_on_after (whose cancel is delivered again on every loop cycle while
    the task runs inside the scope, i.e. through the driver's cleanup and the give-back)."""
    import anyio

    async def main() -> None:
        async with scene(setup, lock_name) as s:
            other, lock = s.other, s.lock
            out = Outcome()
            fire = asyncio.Event()
            expect: type[BaseException] = asyncio.CancelledError
            caught: list[bool] = []

            async def sibling() -> None:
                await fire.wait()
                raise ValueError("sibling failed")

            if canceller == "task.cancel":

                async def attack() -> int:
                    return await lock.acquire()

            elif canceller == "asyncio.timeout":
                expect = TimeoutError

                async def attack() -> int:
                    async with asyncio.timeout(None) as cm:
                        waiter = asyncio.create_task(fire.wait())
                        waiter.add_done_callback(lambda _: cm.reschedule(asyncio.get_running_loop().time()))
                        try:
                            return await lock.acquire()
                        finally:
                            waiter.cancel()

            elif canceller == "taskgroup":
                expect = ExceptionGroup  # the sibling's ValueError, and nothing of ours

                async def attack() -> int:
                    result: list[int] = []

                    async def acquirer() -> None:
                        result.append(await lock.acquire())

                    async with asyncio.TaskGroup() as tg:
                        tg.create_task(acquirer())
                        tg.create_task(sibling())
                    return result[0]  # pragma: no cover

            else:  # anyio
                expect = type(None)  # type: ignore[assignment]  # the scope catches it: no error

                async def attack() -> int:
                    with anyio.CancelScope() as cs:
                        waiter = asyncio.create_task(fire.wait())
                        waiter.add_done_callback(lambda _: cs.cancel())
                        try:
                            return await lock.acquire()
                        finally:
                            waiter.cancel()
                    caught.append(cs.cancelled_caught)
                    raise _ScopeCaught

            if canceller == "anyio":
                expect = _ScopeCaught

            with row_blocked(setup.sync_engine, lock_name):
                task = asyncio.create_task(record_then_retry(lock, out, attack, expect=expect))
                await wait_until_the_upsert_waits(setup.sync_engine)
                assert await other.exists(lock.key), "Redis should hold the lock while the fence is taken"
                if canceller == "task.cancel":
                    task.cancel()
                else:
                    fire.set()
                await settle(out, other, lock.key)
            out.go.set()  # the row is free again: the task's later acquire() can take a fence
            await _finish(task)
            task.result()
            if canceller == "taskgroup":
                assert isinstance(out.error, ExceptionGroup)
                assert [type(e) for e in out.error.exceptions] == [ValueError], out.error.exceptions
            if canceller == "anyio":
                assert caught == [True], "anyio's scope did not catch its own cancellation"
            await s.check(out, expect=expect)

    asyncio.run(main())


class _ScopeCaught(Exception):
    """Raised after an anyio scope caught its cancellation, so the recorder sees a clean end."""


@pytest.mark.cancel
@DRIVERS
@pytest.mark.parametrize("cancels", [2, 3])
def test_repeated_cancels_in_the_fence_and_the_give_back(
    setup: Setup, lock_name: str, driver: str, cancels: int
) -> None:
    """A cancel in the waiting fence upsert, then one or two more while the give-back's release
    waits for a connection (stalled): the give-back must still go through, and the task end with
    CancelledError holding nothing."""

    async def main() -> None:
        async with scene(setup, lock_name) as s:
            client, other, lock = s.client, s.other, s.lock
            wire = Wire(client)
            releasing, proceed = asyncio.Event(), asyncio.Event()
            wire.queue("release", wire.stall(releasing, proceed))
            out = Outcome()
            with row_blocked(setup.sync_engine, lock_name):
                task = asyncio.create_task(
                    record_then_retry(lock, out, lambda: lock.acquire(), expect=asyncio.CancelledError)
                )
                await wait_until_the_upsert_waits(setup.sync_engine)
                task.cancel()
                await asyncio.wait_for(releasing.wait(), 5)
                for _ in range(cancels - 1):
                    task.cancel()
                    for _ in range(3):
                        await asyncio.sleep(0)
                proceed.set()
                await settle(out, other, lock.key)
            await s.end(task, out, expect=asyncio.CancelledError)

    asyncio.run(main())


@pytest.mark.cancel
@DRIVERS
def test_two_tasks_share_the_lock_object_one_cancelled_in_its_fence(
    setup: Setup, lock_name: str, driver: str
) -> None:
    """Task A holds the Redis lock and waits for its fence (row blocked); task B, through the same
    lock object, polls for the lock.  A is cancelled: A gives the lock back (B's hold is B's
    alone), B gets it with a larger fence once the row is free, A owns nothing."""

    async def main() -> None:
        async with scene(setup, lock_name, blocking_timeout=5, sleep=0.01) as s:
            other, lock, before = s.other, s.lock, s.before
            out = Outcome()
            b_holds, b_go = asyncio.Event(), asyncio.Event()

            async def b_work() -> tuple[int, bool, bool]:
                fence = await lock.acquire()
                b_holds.set()
                await b_go.wait()
                owned = await lock.owned()
                await lock.release()
                return fence, owned, await lock.owned()

            with row_blocked(setup.sync_engine, lock_name):
                a = asyncio.create_task(lock.acquire())
                await wait_until_the_upsert_waits(setup.sync_engine)
                b = asyncio.create_task(b_work())
                for _ in range(3):
                    await asyncio.sleep(0.02)  # B polls the held lock (not needed for the race)
                a.cancel()
                await _finish(a)
                with pytest.raises(asyncio.CancelledError):
                    a.result()
            await asyncio.wait_for(b_holds.wait(), 5)
            b_go.set()
            b_fence, b_owned, b_owned_after = await asyncio.wait_for(b, LIVENESS_BOUND)
            assert b_fence > before and b_owned and not b_owned_after
            assert not await other.exists(lock.key)
            del out

    asyncio.run(main())


# --------------------------------------------------------------------------
# 3. the database step fails instead
# --------------------------------------------------------------------------


@pytest.mark.cancel
@DRIVERS
@pytest.mark.parametrize("failure", ["table-missing", "dead-port", "commit-reply-lost"])
def test_the_fence_fails_and_the_lock_is_given_back(
    setup: Setup, lock_name: str, driver: str, failure: str
) -> None:
    """The database step raises (stateguard_fences missing, the engine points at a closed port,
    the COMMIT of the fence ran but its reply was lost): acquire() raises that error, not a
    fence, and the lock is given back at once."""
    from sqlalchemy.engine import make_url

    from tests._support.faultproxy import FaultProxy

    async def main() -> None:
        good = setup.target.engine()
        proxy: FaultProxy | None = None
        bad: Any
        url = make_url(setup.target.url)
        if failure == "table-missing":
            bad = engine_without_the_fences_table(setup.target)
        elif failure == "dead-port":
            import socket

            from sqlalchemy.ext.asyncio import create_async_engine

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            bad = create_async_engine(url.set(port=port), connect_args=dict(setup.target.connect_args))
        else:
            from sqlalchemy.ext.asyncio import create_async_engine

            proxy = FaultProxy(url.host or "127.0.0.1", url.port or 5432)
            args = dict(setup.target.connect_args)
            purl = url.set(host="127.0.0.1", port=proxy.port)
            if driver == "asyncpg":
                args["ssl"] = False
            else:
                purl = purl.update_query_dict({"sslmode": "disable"})
            bad = create_async_engine(purl, connect_args=args, pool_pre_ping=False)
        try:
            async with clients() as (client, other):
                good_lock = AsyncRedisLock(client, lock_name, ttl=30, blocking_timeout=0, fences=good)
                before = await baseline(good_lock)
                lock = AsyncRedisLock(client, lock_name, ttl=30, blocking_timeout=0, fences=bad)
                if proxy is not None:
                    proxy.cut_after_next_request(b"COMMIT")
                out = Outcome()

                async def attack() -> int:
                    try:
                        return await lock.acquire()
                    finally:
                        out.notes.append(f"key-after:{await other.exists(lock.key)}")

                async def work() -> None:
                    try:
                        out.fence = await attack()
                    except BaseException as error:
                        out.error = error
                    out.owned_after = await lock.owned()
                    out.fence_attr_after = lock.fence
                    # a later acquire by the same task, through the same name on a good engine
                    out.later_fence = await good_lock.acquire()
                    await good_lock.release()

                await asyncio.wait_for(work(), 30)
                assert out.fence is None, f"acquire() returned a fence {out.fence} though its fence failed"
                assert isinstance(out.error, Exception) and not isinstance(out.error, asyncio.CancelledError)
                assert "redis" not in type(out.error).__module__, f"a Redis error replaced: {out.error!r}"
                assert out.notes == ["key-after:0"], (out.notes, out.error)
                assert out.owned_after is False and out.fence_attr_after is None
                lost = _max_fence(setup.sync_engine, lock_name)
                assert out.later_fence is not None and out.later_fence > max(before, lost - 1)
                if failure == "commit-reply-lost":
                    assert proxy is not None and proxy.cuts == 1
                    assert out.later_fence == lost and lost >= before + 2, (
                        "the fence the lost COMMIT took must stay used"
                    )
                third = AsyncRedisLock(other, lock_name, ttl=30, blocking_timeout=0, fences=good)
                assert await third.acquire() > out.later_fence
                await third.release()
        finally:
            await bad.dispose()
            await good.dispose()
            if proxy is not None:
                proxy.close()

    asyncio.run(main())


# --------------------------------------------------------------------------
# 4. the give-back meets a Redis that crashed (a private server)
# --------------------------------------------------------------------------


@pytest.mark.cancel
@pytest.mark.restart
@DRIVERS
@pytest.mark.parametrize("why", ["cancelled", "table-missing"])
def test_give_back_finds_redis_crashed(
    setup: Setup, lock_name: str, driver: str, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The fence step ends (a cancel in the waiting upsert, or the missing table) and Redis is
    killed (SIGKILL) just as the give-back is sent.  The task must still end with its own outcome
    (CancelledError / the database's error, never redis' ConnectionError), within the bound, and
    the log must say the lock could not be given back; once the server is back (empty, a crash),
    another client takes the lock at once and the same task acquires again with a larger fence."""
    import redis.asyncio

    from tests._support.redis_server import RedisServer

    with RedisServer() as server:

        async def main() -> None:
            good = setup.target.engine()
            bad = engine_without_the_fences_table(setup.target) if why == "table-missing" else good
            client = redis.asyncio.Redis.from_url(server.url, socket_timeout=2, socket_connect_timeout=2)
            other = redis.asyncio.Redis.from_url(server.url, socket_timeout=2, socket_connect_timeout=2)
            try:
                lock = AsyncRedisLock(client, lock_name, ttl=30, blocking_timeout=0, fences=bad)
                good_lock = AsyncRedisLock(client, lock_name, ttl=30, blocking_timeout=0, fences=good)
                before = await baseline(good_lock)
                wire = Wire(client)

                async def crash_then_release(real: Any) -> Any:
                    wire.log.append("release")
                    server.kill()
                    return await real()

                wire.queue("release", crash_then_release)
                out = Outcome()

                async def work() -> None:
                    task = asyncio.current_task()
                    assert task is not None
                    try:
                        out.fence = await lock.acquire()
                    except BaseException as error:
                        out.error = error
                    while task.uncancel():
                        pass
                    out.notes.append("ended")
                    await restarted.wait()
                    out.owned_after = await lock.owned()
                    out.fence_attr_after = lock.fence
                    out.later_fence = await good_lock.acquire()
                    await good_lock.release()

                restarted = asyncio.Event()
                if why == "cancelled":
                    with row_blocked(setup.sync_engine, lock_name):
                        task = asyncio.create_task(work())
                        wire.task = None
                        await wait_until_the_upsert_waits(setup.sync_engine)
                        task.cancel()
                        for _ in range(int(LIVENESS_BOUND / 0.01)):
                            if out.notes:
                                break
                            await asyncio.sleep(0.01)
                else:
                    task = asyncio.create_task(work())
                    for _ in range(int(LIVENESS_BOUND / 0.01)):
                        if out.notes:
                            break
                        await asyncio.sleep(0.01)
                assert out.notes == ["ended"], "the task did not end its acquisition within the bound"
                assert wire.log == ["release"]
                server.start()
                restarted.set()
                await asyncio.wait_for(task, 10)
                assert out.fence is None
                if why == "cancelled":
                    assert isinstance(out.error, asyncio.CancelledError), repr(out.error)
                else:
                    assert isinstance(out.error, Exception) and "redis" not in type(out.error).__module__, (
                        repr(out.error)
                    )
                assert out.owned_after is False and out.fence_attr_after is None
                assert out.later_fence is not None and out.later_fence > before
                third = AsyncRedisLock(other, lock_name, ttl=30, blocking_timeout=0, fences=good)
                assert await third.acquire() > out.later_fence
                await third.release()
            finally:
                await client.aclose()
                await other.aclose()
                if bad is not good:
                    await bad.dispose()
                await good.dispose()

        with caplog.at_level(logging.WARNING, logger="stateguard"):
            asyncio.run(main())
    assert any("could not give back lock" in r.getMessage() for r in caplog.records), caplog.text


# --------------------------------------------------------------------------
# 5. a cancel while the fence waits for a connection of the engine's pool
# --------------------------------------------------------------------------


@pytest.mark.cancel
@DRIVERS
@pytest.mark.parametrize("when", ["while-waiting", "as-the-connection-comes-back"])
def test_cancel_while_waiting_for_a_pooled_connection(
    setup: Setup, lock_name: str, driver: str, when: str
) -> None:
    """The fences engine has one connection, held elsewhere: acquire() waits for it in the pool.
    ``while-waiting``: cancelled there.  ``as-the-connection-comes-back``: the holder returns the
    connection and the cancel is requested right after (the race of Python 3.11's wait_for, which
    returned the result and swallowed such a cancel).  Either way: CancelledError, lock given back."""
    from sqlalchemy import event

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with scene(
            setup, lock_name, engine=setup.target.engine(pool_size=1, max_overflow=0, pool_timeout=30)
        ) as s:
            other, lock, engine = s.other, s.lock, s.engine
            out = Outcome()
            held = await engine.connect()
            queue = engine.sync_engine.pool._pool._queue  # type: ignore[attr-defined]
            task = asyncio.create_task(
                record_then_retry(lock, out, lambda: lock.acquire(), expect=asyncio.CancelledError)
            )
            for _ in range(500):
                if queue._getters:  # the acquisition waits for the pool's connection
                    break
                await asyncio.sleep(0.01)
            else:  # pragma: no cover
                raise AssertionError("acquire never waited for the pool")
            assert await other.exists(lock.key)
            if when == "while-waiting":
                task.cancel()
                await settle(out, other, lock.key)
                await held.close()
            else:

                def on_checkin(*_: Any) -> None:
                    loop.call_soon(task.cancel)

                event.listen(engine.sync_engine.pool, "checkin", on_checkin)
                await held.close()
                event.remove(engine.sync_engine.pool, "checkin", on_checkin)
                await settle(out, other, lock.key)
            await s.end(task, out, expect=asyncio.CancelledError)

    asyncio.run(main())
