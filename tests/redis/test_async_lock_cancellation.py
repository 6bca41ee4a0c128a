"""AsyncRedisLock's owner token belongs to the task that acquired it: a task cancelled while it waits
for the lock gets CancelledError and never keeps the lock, also when redis-py's asyncio client
swallows the cancellation inside a command.

Cancels come the way production code sends them: ``asyncio.timeout()``, ``asyncio.wait_for``,
TaskGroup, anyio cancel scopes, ``async with lock:``, a cancel in the sleep between polls, a cancel
whose reply is lost, one lock object shared by several tasks, ``uncancel()``, an earlier handled
cancellation, ``blocking_timeout=0``, the give-back racing an expiry (LockLost), a second cancel
in the give-back, and a cancel while the lock is released.  The swallowing client is simulated
deterministically (:class:`~tests._support.redis_wire.Wire`); the only timeouts are liveness bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from stateguard import AsyncRedisLock, LockNotAcquired
from tests._support.redis_wire import (
    LIVENESS_BOUND,
    Real,
    Wire,
    _finish,
    _forever,
    clients,
)

VARIANTS = pytest.mark.parametrize("then_run", [False, True], ids=["not-taken", "taken-meanwhile"])


async def _finish_cancelled(task: asyncio.Task[Any]) -> None:
    """The cancelled ``task`` must end (within the liveness bound) with CancelledError."""
    await _finish(task)
    with pytest.raises(asyncio.CancelledError):
        task.result()


async def _cancel_on_the_wire(task: asyncio.Task[Any], wire: Wire) -> None:
    """Once ``task``'s command is on the wire, cancel it: the task must end with CancelledError."""
    await asyncio.wait_for(wire.in_flight.wait(), 5)
    task.cancel()
    await _finish_cancelled(task)


@dataclass
class Scene:
    """``holder`` (on the second client, ``other``) holds the lock unless ``then_run``; ``lock`` (on
    the first) is the lock under attack, its next acquire-script call swallowing the cancel."""

    other: Any
    holder: AsyncRedisLock
    lock: AsyncRedisLock
    wire: Wire
    then_run: bool

    async def check_nothing_kept(self, message: str = "the cancelled task's lock was not given back") -> None:
        """``then_run``: the lock the swallowed command took was given back (the key is gone); else
        the holder still owns the lock (and releases it)."""
        if self.then_run:
            assert not await self.other.exists(self.lock.key), message
        else:
            assert await self.holder.owned()
            await self.holder.release()


@contextlib.asynccontextmanager
async def scene(
    lock_name: str, *, then_run: bool, blocking_timeout: float | None = 1, sleep: float = 0.01
) -> AsyncIterator[Scene]:
    """The :class:`Scene` most attacks start from; ``wire.swallow(then_run=then_run)`` is queued."""
    async with clients() as (client, other):
        holder = AsyncRedisLock(other, lock_name, ttl=30)
        if not then_run:
            await holder.acquire()
        lock = AsyncRedisLock(client, lock_name, ttl=30, blocking_timeout=blocking_timeout, sleep=sleep)
        wire = Wire(client)
        wire.queue("acquire", wire.swallow(then_run=then_run))
        yield Scene(other, holder, lock, wire, then_run)


# --------------------------------------------------------------------------
# asyncio.timeout / wait_for / TaskGroup / anyio around acquire
# --------------------------------------------------------------------------


@pytest.mark.cancel
@VARIANTS
def test_timeout_around_acquire_with_swallowed_cancel_raises_timeout_error(
    redis_client: Any, lock_name: str, then_run: bool
) -> None:
    """``async with asyncio.timeout():`` whose cancel the client swallows: TimeoutError (the
    timeout recognises its own cancel), the task's cancelling() back to 0, no lock kept."""

    async def main() -> None:
        async with scene(lock_name, then_run=then_run) as s:

            async def work() -> tuple[str, int, bool]:
                try:
                    async with asyncio.timeout(0.05):  # fires while the command blocks
                        await s.lock.acquire()
                    return "acquired", 0, True  # pragma: no cover
                except TimeoutError:
                    task = asyncio.current_task()
                    assert task is not None
                    return "timeout", task.cancelling(), await s.lock.owned()

            outcome, cancelling, owned = await asyncio.wait_for(work(), LIVENESS_BOUND)
            assert (outcome, cancelling, owned) == ("timeout", 0, False)
            assert s.wire.log == ["swallowed"]
            await s.check_nothing_kept()

    asyncio.run(main())


@pytest.mark.cancel
@pytest.mark.parametrize("how", ["task.cancel", "asyncio.timeout"])
@pytest.mark.parametrize("blocking_timeout", [None, 30], ids=["forever", "30s"])
def test_swallowed_cancel_ends_the_wait_while_the_lock_stays_held(
    redis_client: Any, lock_name: str, how: str, blocking_timeout: float | None
) -> None:
    """The lock is held (and stays held) by someone else; the waiter's cancel is swallowed
    inside one poll.  The waiter must end with CancelledError / TimeoutError promptly, not keep
    polling until the holder lets go or blocking_timeout (default: forever) runs out: the
    cancelling() check only runs after redis-py's whole acquire loop returned, so
    ``async with asyncio.timeout(5): async with lock:`` with the default blocking_timeout does not
    bound the wait at all."""

    async def main() -> None:
        async with scene(lock_name, then_run=False, blocking_timeout=blocking_timeout) as s:

            async def work() -> int:
                if how == "asyncio.timeout":
                    async with asyncio.timeout(0.05):
                        return await s.lock.acquire()
                return await s.lock.acquire()

            task = asyncio.create_task(work())
            try:
                await asyncio.wait_for(s.wire.in_flight.wait(), 5)
                if how == "task.cancel":
                    task.cancel()
                await _finish(task)
                expected = asyncio.CancelledError if how == "task.cancel" else TimeoutError
                with pytest.raises(expected):
                    task.result()
                assert s.wire.log == ["swallowed"]
                assert await s.holder.owned()
            finally:
                await s.holder.release()  # lets a still-polling waiter end (after the failure)
                with contextlib.suppress(BaseException):
                    await task
                # the waiter must not have taken the lock the holder just let go
                assert not await s.other.exists(s.lock.key)

    asyncio.run(main())


@pytest.mark.cancel
@VARIANTS
def test_wait_for_around_acquire_with_swallowed_cancel(
    redis_client: Any, lock_name: str, then_run: bool
) -> None:
    """Python 3.11's ``asyncio.wait_for`` runs acquire in a task of its own and cancels that task at
    the timeout: TimeoutError, and no lock is left behind by the inner task (no one could release
    it: its owner token belongs to a finished task)."""

    async def main() -> None:
        async with scene(lock_name, then_run=then_run) as s:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(s.lock.acquire(), 0.05)
            assert s.wire.log == ["swallowed"]
            await s.check_nothing_kept("the inner task's lock was not given back")

    asyncio.run(main())


@pytest.mark.cancel
@VARIANTS
def test_taskgroup_sibling_failure_cancels_the_waiter(
    redis_client: Any, lock_name: str, then_run: bool
) -> None:
    """A TaskGroup child fails while a sibling waits for the lock: the group cancels the waiter (its
    cancel swallowed by the client); the group reports only the failure, the waiter's code after
    acquire never runs and it keeps no lock."""

    async def main() -> None:
        async with scene(lock_name, then_run=then_run) as s:
            ran_after_acquire: list[int] = []

            async def waiter() -> None:
                ran_after_acquire.append(await s.lock.acquire())

            async def failing() -> None:
                await s.wire.in_flight.wait()
                raise ValueError("sibling failed")

            with pytest.raises(ExceptionGroup) as caught:
                async with asyncio.timeout(LIVENESS_BOUND), asyncio.TaskGroup() as group:
                    group.create_task(waiter())
                    group.create_task(failing())
            assert [type(e) for e in caught.value.exceptions] == [ValueError]
            assert ran_after_acquire == [] and s.wire.log == ["swallowed"]
            await s.check_nothing_kept()

    asyncio.run(main())


@pytest.mark.cancel
@VARIANTS
def test_taskgroup_parent_cancelled_cancels_the_waiter(
    redis_client: Any, lock_name: str, then_run: bool
) -> None:
    """The task running a TaskGroup is cancelled (a request handler on shutdown): the waiting child
    is cancelled, its cancel swallowed, and the parent ends with CancelledError holding nothing."""

    async def main() -> None:
        async with scene(lock_name, then_run=then_run) as s:
            ran_after_acquire: list[int] = []

            async def waiter() -> None:
                ran_after_acquire.append(await s.lock.acquire())

            async def parent() -> None:
                async with asyncio.TaskGroup() as group:
                    group.create_task(waiter())

            await _cancel_on_the_wire(asyncio.create_task(parent()), s.wire)
            assert ran_after_acquire == [] and s.wire.log == ["swallowed"]
            await s.check_nothing_kept()

    asyncio.run(main())


@pytest.mark.cancel
@VARIANTS
def test_anyio_move_on_after_around_acquire(redis_client: Any, lock_name: str, then_run: bool) -> None:
    """anyio's cancel scopes (FastAPI / Starlette code) on asyncio: ``move_on_after`` fires inside
    the command, the client swallows it; the scope catches the cancellation, the lock is not kept
    and the task's cancelling() is back to 0 afterwards (anyio uncancels what it delivered)."""
    anyio = pytest.importorskip("anyio")

    async def main() -> None:
        async with scene(lock_name, then_run=then_run, blocking_timeout=None) as s:

            async def work() -> tuple[bool, bool, int, bool]:
                got = False
                with anyio.move_on_after(0.05) as scope:
                    await s.lock.acquire()
                    got = True
                task = asyncio.current_task()
                assert task is not None
                return got, scope.cancelled_caught, task.cancelling(), await s.lock.owned()

            try:
                result = await asyncio.wait_for(work(), LIVENESS_BOUND)
            finally:
                if not then_run:
                    await s.holder.release()
            assert result == (False, True, 0, False)
            # anyio delivers its cancel again on every loop cycle until the task leaves the scope:
            # with the lock free, the swallowed command's real run is cancelled before it reaches
            # Redis (redis-py 8.1 suspends while getting a connection), so nothing is taken.
            assert s.wire.log == (["swallowed", "re-cancelled"] if then_run else ["swallowed"])
            assert not await s.other.exists(s.lock.key)

    asyncio.run(main())


# --------------------------------------------------------------------------
# async with, blocking_timeout=0, where the cancel lands
# --------------------------------------------------------------------------


@pytest.mark.cancel
@VARIANTS
def test_async_with_body_never_runs_when_the_cancel_is_swallowed(
    redis_client: Any, lock_name: str, then_run: bool
) -> None:
    """``async with lock:`` cancelled while entering: the body never runs, CancelledError, no lock."""

    async def main() -> None:
        async with scene(lock_name, then_run=then_run) as s:
            body: list[int] = []

            async def work() -> None:
                async with s.lock as fence:
                    body.append(fence)

            await _cancel_on_the_wire(asyncio.create_task(work()), s.wire)
            assert body == [] and s.wire.log == ["swallowed"]
            await s.check_nothing_kept()

    asyncio.run(main())


@pytest.mark.cancel
@VARIANTS
def test_blocking_timeout_zero_swallowed_cancel_is_cancelled_not_lock_not_acquired(
    redis_client: Any, lock_name: str, then_run: bool
) -> None:
    """One try (``blocking_timeout=0``) whose only command swallows the cancel: CancelledError,
    never LockNotAcquired or a fence."""

    async def main() -> None:
        async with scene(lock_name, then_run=then_run, blocking_timeout=0) as s:
            await _cancel_on_the_wire(asyncio.create_task(s.lock.acquire()), s.wire)
            await s.check_nothing_kept()

    asyncio.run(main())


@pytest.mark.cancel
def test_cancel_in_the_sleep_between_polls(redis_client: Any, lock_name: str) -> None:
    """The real path (no swallowing): the cancel lands in the sleep after a poll found the lock
    held.  CancelledError at once; the same task may handle it, ``uncancel()`` and wait again."""

    async def main() -> None:
        async with clients() as (client, other):
            holder = AsyncRedisLock(other, lock_name, ttl=30)
            await holder.acquire()
            lock = AsyncRedisLock(client, lock_name, ttl=30, blocking_timeout=60, sleep=30)
            wire = Wire(client)
            polled = asyncio.Event()
            wire.queue("acquire", wire.after_reply(polled))
            retried = asyncio.Event()
            go_on = asyncio.Event()

            async def work() -> tuple[bool, int, int]:
                task = asyncio.current_task()
                assert task is not None
                try:
                    await lock.acquire()
                    raise AssertionError("acquired a held lock")  # pragma: no cover
                except asyncio.CancelledError:
                    cancelled = True
                    assert not await lock.owned()
                task.uncancel()
                retried.set()
                await go_on.wait()
                fence = await lock.acquire(blocking_timeout=0)
                await lock.release()
                return cancelled, task.cancelling(), fence

            task = asyncio.create_task(work())
            await asyncio.wait_for(polled.wait(), 5)  # the waiter is in its 30 s sleep now
            task.cancel()
            await asyncio.wait_for(retried.wait(), LIVENESS_BOUND)
            assert wire.log == ["ran:None"]
            await holder.release()
            go_on.set()
            cancelled, cancelling, fence = await asyncio.wait_for(task, LIVENESS_BOUND)
            assert cancelled and cancelling == 0 and fence >= 1
            assert not await other.exists(lock.key)

    asyncio.run(main())


@pytest.mark.cancel
@pytest.mark.lost_reply
def test_cancel_that_loses_the_acquisition_reply(redis_client: Any, lock_name: str) -> None:
    """Documented limit ("a task cancelled while its acquisition is on the wire may leave the lock
    held until its TTL ends"): the script took the lock, the cancel arrived before the reply was
    read.  The task gets CancelledError and does not own the lock (owned() is False, release() is
    refused); the key stays until its TTL, and that task's next acquire() takes it over (the
    pending owner token is recognised) instead of waiting for the TTL."""

    async def main() -> None:
        async with clients() as (client, other):
            lock = AsyncRedisLock(client, lock_name, ttl=30, blocking_timeout=0)
            third = AsyncRedisLock(other, lock_name, ttl=30, blocking_timeout=0)
            wire = Wire(client)
            ran = asyncio.Event()
            wire.queue("acquire", wire.lose_reply(ran))
            go_on = asyncio.Event()

            async def work() -> tuple[bool, int]:
                task = asyncio.current_task()
                assert task is not None
                with contextlib.suppress(asyncio.CancelledError):
                    await lock.acquire()
                    raise AssertionError("acquire returned despite the cancel")  # pragma: no cover
                owned = await lock.owned()
                task.uncancel()
                await go_on.wait()
                fence = await lock.acquire()  # takes over its own lost acquisition
                await lock.release()
                return owned, fence

            task = asyncio.create_task(work())
            await asyncio.wait_for(ran.wait(), 5)
            task.cancel()
            await asyncio.sleep(0)
            assert await other.exists(lock.key)  # held by nobody who knows it, until its TTL
            with pytest.raises(LockNotAcquired):
                await third.acquire()
            go_on.set()
            owned, fence = await asyncio.wait_for(task, LIVENESS_BOUND)
            assert not owned and fence >= 1
            assert not await other.exists(lock.key)

    asyncio.run(main())


# --------------------------------------------------------------------------
# earlier cancellations, uncancel(), a cancel pending before acquire
# --------------------------------------------------------------------------


@pytest.mark.cancel
@VARIANTS
def test_swallowed_cancel_after_an_earlier_handled_one_still_cancels(
    redis_client: Any, lock_name: str, then_run: bool
) -> None:
    """A task that handled a cancellation before (cancelling() stays 1) is cancelled again while it
    waits, and that cancel is swallowed: 1 -> 2 still counts, CancelledError, no lock kept."""

    async def main() -> None:
        async with scene(lock_name, then_run=then_run) as s:
            first_handled = asyncio.Event()
            counts: list[int] = []

            async def work() -> None:
                task = asyncio.current_task()
                assert task is not None
                with contextlib.suppress(asyncio.CancelledError):
                    await _forever()
                counts.append(task.cancelling())
                first_handled.set()
                try:
                    await s.lock.acquire()
                finally:
                    counts.append(task.cancelling())

            task = asyncio.create_task(work())
            await asyncio.sleep(0)
            task.cancel()
            await asyncio.wait_for(first_handled.wait(), 5)
            await _cancel_on_the_wire(task, s.wire)
            assert counts == [1, 2] and s.wire.log == ["swallowed"]
            await s.check_nothing_kept()

    asyncio.run(main())


@pytest.mark.cancel
@pytest.mark.parametrize("uncancel", [True, False], ids=["uncancelled", "left-cancelling"])
def test_retry_after_a_swallowed_cancel(redis_client: Any, lock_name: str, uncancel: bool) -> None:
    """The caller handles the CancelledError (with or without ``uncancel()``) and acquires again:
    only cancels during that call count, so it takes the lock; the first attempt left nothing."""

    async def main() -> None:
        async with clients() as (client, _other):
            lock = AsyncRedisLock(client, lock_name, ttl=30, blocking_timeout=0)
            wire = Wire(client)
            wire.queue("acquire", wire.swallow(then_run=True))
            again = asyncio.Event()

            async def work() -> tuple[int, int]:
                task = asyncio.current_task()
                assert task is not None
                with contextlib.suppress(asyncio.CancelledError):
                    await lock.acquire()
                    raise AssertionError("acquire returned despite the cancel")  # pragma: no cover
                assert not await lock.locked()  # given back
                if uncancel:
                    task.uncancel()
                await again.wait()
                fence = await lock.acquire()
                assert await lock.owned()
                await lock.release()
                return task.cancelling(), fence

            task = asyncio.create_task(work())
            await asyncio.wait_for(wire.in_flight.wait(), 5)
            task.cancel()
            again.set()
            cancelling, fence = await asyncio.wait_for(task, LIVENESS_BOUND)
            assert cancelling == (0 if uncancel else 1) and fence >= 1
            assert wire.log == ["swallowed"]

    asyncio.run(main())


@pytest.mark.cancel
def test_cancel_requested_just_before_acquire_and_swallowed(redis_client: Any, lock_name: str) -> None:
    """A cancel requested before acquire() starts but delivered inside its first command
    (``current_task().cancel()`` then ``await lock.acquire()``: the task is cancelled while it
    waits for the lock) is swallowed by the client: cancelling() was already 1 when acquire took
    its baseline, so acquire returns a fence and the task holds the lock, its cancel lost."""

    async def main() -> None:
        async with clients() as (client, other):
            lock = AsyncRedisLock(client, lock_name, ttl=30, blocking_timeout=0)
            wire = Wire(client)
            wire.queue("acquire", wire.swallow(then_run=True))
            body: list[int] = []

            async def work() -> None:
                task = asyncio.current_task()
                assert task is not None
                task.cancel()
                async with lock as fence:
                    body.append(fence)

            task = asyncio.create_task(work())
            await _finish(task)
            assert wire.log in ([], ["swallowed"])  # [] once the pending cancel is delivered first
            assert body == [], "the body ran under the lock although the task was cancelled"
            with pytest.raises(asyncio.CancelledError):
                task.result()
            assert not await other.exists(lock.key)

    asyncio.run(main())


# --------------------------------------------------------------------------
# one lock object, several tasks; the give-back vs another holder
# --------------------------------------------------------------------------


@pytest.mark.cancel
def test_shared_lock_object_cancelled_waiter_leaves_the_holder_alone(
    redis_client: Any, lock_name: str
) -> None:
    """A module-level lock shared by tasks: A holds it, B waits through the same object and is
    cancelled (swallowed).  B gets CancelledError, A still owns the lock and releases it."""

    async def main() -> None:
        async with clients(1) as (client,):
            lock = AsyncRedisLock(client, lock_name, ttl=30, blocking_timeout=1, sleep=0.01)
            wire = Wire(client)
            a_holds, a_go = asyncio.Event(), asyncio.Event()

            async def a() -> tuple[bool, bool]:
                await lock.acquire()
                a_holds.set()
                await a_go.wait()
                owned = await lock.owned()
                await lock.release()
                return owned, await lock.locked()

            ta = asyncio.create_task(a())
            await asyncio.wait_for(a_holds.wait(), 5)
            tb = asyncio.create_task(lock.acquire())
            wire.task = tb
            wire.queue("acquire", wire.swallow(then_run=False))
            await _cancel_on_the_wire(tb, wire)
            a_go.set()
            owned, still_locked = await asyncio.wait_for(ta, LIVENESS_BOUND)
            assert owned and not still_locked
            assert wire.log == ["swallowed"]

    asyncio.run(main())


@pytest.mark.cancel
@pytest.mark.parametrize("shared", [True, False], ids=["same-object", "other-object"])
def test_give_back_after_expiry_never_deletes_the_next_holder(
    redis_client: Any, lock_name: str, shared: bool
) -> None:
    """The cancelled waiter's swallowed command took the lock; before the give-back runs, that lock
    expires and another task takes it (through the same object, or another client).  The give-back
    finds the lock not its own (LockLost inside): the waiter still gets CancelledError, not
    LockLost, and the new holder's lock is untouched."""

    async def main() -> None:
        async with clients() as (client, other):
            lock = AsyncRedisLock(client, lock_name, ttl=30, blocking_timeout=1, sleep=0.01)
            rival = lock if shared else AsyncRedisLock(other, lock_name, ttl=30, blocking_timeout=0)
            wire = Wire(client)
            taken, go_on = asyncio.Event(), asyncio.Event()

            async def pause() -> None:
                taken.set()
                await go_on.wait()

            rival_holds, rival_go = asyncio.Event(), asyncio.Event()

            async def rival_task() -> bool:
                await rival.acquire(blocking_timeout=0)
                rival_holds.set()
                await rival_go.wait()
                owned = await rival.owned()
                await rival.release()
                return owned

            tb = asyncio.create_task(lock.acquire())
            wire.task = tb
            wire.queue("acquire", wire.swallow(then_run=True, after=pause))
            await asyncio.wait_for(wire.in_flight.wait(), 5)
            tb.cancel()
            await asyncio.wait_for(taken.wait(), 5)
            assert await other.delete(lock.key) == 1  # the waiter's hold "expires"
            ta = asyncio.create_task(rival_task())
            await asyncio.wait_for(rival_holds.wait(), 5)
            go_on.set()
            await _finish_cancelled(tb)
            assert await other.exists(lock.key), "the give-back deleted the next holder's lock"
            rival_go.set()
            assert await asyncio.wait_for(ta, LIVENESS_BOUND)
            assert not await other.exists(lock.key)

    asyncio.run(main())


@pytest.mark.cancel
def test_second_cancel_during_the_give_back_does_not_leave_the_task_holding(
    redis_client: Any, lock_name: str
) -> None:
    """The swallowed command took the lock; acquire starts giving it back, and a second cancel
    (the enclosing TaskGroup / shutdown) lands in that release before it reaches Redis.  The task
    gets CancelledError, but the lock stays held under its token: the task, once it handles the
    cancellation, ``owned()`` the lock it was told it did not get, and every other task waits for
    the TTL.  The give-back must not be interruptible (or must clear the task's token)."""

    async def main() -> None:
        async with clients() as (client, other):
            lock = AsyncRedisLock(client, lock_name, ttl=30, blocking_timeout=1, sleep=0.01)
            third = AsyncRedisLock(other, lock_name, ttl=30, blocking_timeout=0)
            wire = Wire(client)
            releasing, proceed = asyncio.Event(), asyncio.Event()
            wire.queue("acquire", wire.swallow(then_run=True))
            wire.queue("release", wire.stall(releasing, proceed))

            async def work() -> bool:
                task = asyncio.current_task()
                assert task is not None
                with contextlib.suppress(asyncio.CancelledError):
                    await lock.acquire()
                    raise AssertionError("acquire returned despite the cancel")  # pragma: no cover
                while task.uncancel():
                    pass
                return await lock.owned()

            task = asyncio.create_task(work())
            await asyncio.wait_for(wire.in_flight.wait(), 5)
            task.cancel()
            await asyncio.wait_for(releasing.wait(), 5)
            task.cancel()
            proceed.set()  # the connection comes: a give-back still running goes through now
            owned = await asyncio.wait_for(task, LIVENESS_BOUND)
            assert wire.log[0] == "swallowed"
            assert not owned, "the task owns the lock acquire() told it (CancelledError) it did not get"
            assert not await other.exists(lock.key), "the lock stays held until its TTL"
            await third.acquire()
            await third.release()

    asyncio.run(main())


# --------------------------------------------------------------------------
# anyio: level-triggered cancel scopes (delivered again on every loop cycle)
# --------------------------------------------------------------------------


@pytest.mark.cancel
def test_anyio_one_try_swallowed_cancel_stays_inside_the_scope(redis_client: Any, lock_name: str) -> None:
    """``with anyio.move_on_after(t): await lock.acquire(blocking_timeout=0)`` whose one
    command swallows the scope's cancel: the CancelledError acquire raises must be the scope's, so
    that the scope catches it and the code after it runs.  acquire raises a bare CancelledError
    (``raise asyncio.CancelledError from None``: no message, the LockNotAcquired as context), which
    anyio does not recognise as its own: it escapes the move_on_after and cancels the whole task (a
    FastAPI / Starlette request) instead."""
    anyio = pytest.importorskip("anyio")

    async def main() -> None:
        async with scene(lock_name, then_run=False, blocking_timeout=0) as s:

            async def work() -> tuple[bool, bool]:
                with anyio.move_on_after(0.05) as scope:
                    await s.lock.acquire()
                return scope.cancelled_caught, await s.lock.owned()

            try:
                task = asyncio.create_task(work())
                await _finish(task)
                assert not task.cancelled(), "the scope's cancel escaped move_on_after"
                assert task.result() == (True, False)
                assert s.wire.log == ["swallowed"]
                assert await s.holder.owned()
            finally:
                await s.holder.release()

    asyncio.run(main())


@pytest.mark.cancel
def test_anyio_give_back_is_not_cut_by_the_scopes_repeated_cancel(redis_client: Any, lock_name: str) -> None:
    """The lock is free; the client swallows every cancel while the acquisition is on the wire
    (the script takes the lock) while anyio's scope delivers its cancel again on each loop cycle.
    acquire gives the lock back and the scope catches the cancellation: no fence, not owned, free.
    (Held on redis-py 8.1: the give-back's release reached Redis before anyio's next delivery.)"""
    anyio = pytest.importorskip("anyio")

    async def main() -> None:
        async with clients() as (client, other):
            lock = AsyncRedisLock(client, lock_name, ttl=30, blocking_timeout=0)
            wire = Wire(client)

            async def hook(real: Real) -> Any:
                # On the wire until the scope's first cancel (swallowed), then the script runs
                # for real (it takes the lock) while every further cancel is swallowed too.
                try:
                    await _forever()
                except asyncio.CancelledError:
                    wire.log.append("swallowed")
                return await wire.swallow_all()(real)

            wire.queue("acquire", hook)
            fences: list[int] = []

            async def work() -> tuple[bool, bool]:
                # Not 0: a cancel due before acquire() starts is delivered before any command.
                with anyio.move_on_after(0.05) as scope:
                    fences.append(await lock.acquire())
                return scope.cancelled_caught, await lock.owned()

            caught, owned = await asyncio.wait_for(work(), LIVENESS_BOUND)
            assert wire.log and set(wire.log) == {"swallowed"}
            assert caught and fences == []
            assert not owned, "the task owns the lock acquire() told it (CancelledError) it did not get"
            assert not await other.exists(lock.key), "the lock stays held until its TTL"

    asyncio.run(main())


# --------------------------------------------------------------------------
# the give-back meets a Redis that crashed (a real server on a private port)
# --------------------------------------------------------------------------


@pytest.mark.cancel
@pytest.mark.restart
@pytest.mark.parametrize("server_state", ["down", "restarted-empty"])
def test_give_back_against_a_crashed_redis_still_ends_cancelled(
    lock_name: str, server_state: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The swallowed command took the lock; the Redis dies (SIGKILL) before the give-back reaches it,
    and is either still down or back, empty, by then.  The task must still end with CancelledError
    within the liveness bound (not the connection error, not a hang in redis-py's retries), say in
    the log that the lock could not be given back, and own nothing afterwards; once the server is
    back (it keeps nothing: a crash), another client takes the lock at once."""
    import redis.asyncio

    from tests._support.redis_server import RedisServer

    with RedisServer() as server:

        async def main() -> None:
            client = redis.asyncio.Redis.from_url(server.url, socket_timeout=2, socket_connect_timeout=2)
            other = redis.asyncio.Redis.from_url(server.url, socket_timeout=2, socket_connect_timeout=2)
            try:
                lock = AsyncRedisLock(client, lock_name, ttl=30, blocking_timeout=1, sleep=0.01)
                wire = Wire(client)
                wire.queue("acquire", wire.swallow(then_run=True))

                async def crash_then_release(real: Real) -> Any:
                    wire.log.append("release")
                    server.kill()  # SIGKILL by pid: the connection the release would use is dead
                    if server_state == "restarted-empty":
                        server.start()
                    return await real()

                wire.queue("release", crash_then_release)

                async def work() -> bool:
                    await lock.acquire()
                    return True  # pragma: no cover

                task = asyncio.create_task(work())
                await _cancel_on_the_wire(task, wire)
                assert wire.log[:2] == ["swallowed", "release"]
                if server.process is None:
                    server.start()
                assert await lock.owned() is False
                third = AsyncRedisLock(other, lock_name, ttl=30, blocking_timeout=0)
                assert await third.acquire(), "the lock stayed held after the crashed server came back"
                await third.release()
            finally:
                await client.aclose()
                await other.aclose()

        with caplog.at_level("WARNING", logger="stateguard"):
            asyncio.run(main())
    assert any("could not give back lock" in r.getMessage() for r in caplog.records), caplog.text


# --------------------------------------------------------------------------
# release: a cancel while the lock is being given up
# --------------------------------------------------------------------------


@pytest.mark.cancel
@pytest.mark.parametrize("how", ["release()", "async with"])
def test_cancel_while_the_release_is_on_its_way_still_releases(
    redis_client: Any, lock_name: str, how: str
) -> None:
    """The holder releases (``await lock.release()``, or the end of ``async with lock:``) and
    is cancelled while the release waits for a connection (a TaskGroup shutting down, a request
    cancelled).  The release must still reach Redis: cut there, the lock stayed held for its whole
    TTL and every other worker waited for it.  The task ends with CancelledError."""

    async def main() -> None:
        async with clients() as (client, other):
            lock = AsyncRedisLock(client, lock_name, ttl=30, blocking_timeout=1)
            wire = Wire(client)
            releasing, proceed = asyncio.Event(), asyncio.Event()
            wire.queue("release", wire.stall(releasing, proceed))

            async def work() -> None:
                if how == "release()":
                    await lock.acquire()
                    await lock.release()
                else:
                    async with lock:
                        pass

            task = asyncio.create_task(work())
            await asyncio.wait_for(releasing.wait(), 5)
            task.cancel()
            for _ in range(3):
                await asyncio.sleep(0)  # the cancel lands while the release is stalled
            proceed.set()
            await _finish_cancelled(task)
            assert not await other.exists(lock.key), "the lock stays held until its TTL"
            third = AsyncRedisLock(other, lock_name, ttl=30, blocking_timeout=0)
            await third.acquire()
            await third.release()

    asyncio.run(main())


@pytest.mark.cancel
@pytest.mark.lost_reply
def test_cancel_during_a_release_whose_reply_is_lost_keeps_the_token(
    redis_client: Any, lock_name: str
) -> None:
    """The release ran on Redis but its reply was lost (a connection error), and the task was
    cancelled meanwhile: CancelledError, and the task keeps its owner token (the outcome is
    unknown), so a second release() finds the release marker and succeeds instead of raising."""

    async def main() -> None:
        import redis.exceptions

        async with clients() as (client, other):
            lock = AsyncRedisLock(client, lock_name, ttl=30, blocking_timeout=1)
            wire = Wire(client)
            releasing, proceed = asyncio.Event(), asyncio.Event()

            async def run_then_lose(real: Real) -> Any:
                releasing.set()
                await proceed.wait()
                await real()
                raise redis.exceptions.ConnectionError("reply lost")

            wire.queue("release", run_then_lose)
            outcome: list[str] = []

            async def work() -> None:
                task = asyncio.current_task()
                assert task is not None
                await lock.acquire()
                try:
                    await lock.release()
                except asyncio.CancelledError:
                    while task.uncancel():
                        pass
                    outcome.append("cancelled")
                await lock.release()  # the same task again: its token was kept
                outcome.append("released again")

            task = asyncio.create_task(work())
            await asyncio.wait_for(releasing.wait(), 5)
            task.cancel()
            for _ in range(3):
                await asyncio.sleep(0)
            proceed.set()
            await asyncio.wait_for(task, LIVENESS_BOUND)
            assert outcome == ["cancelled", "released again"]
            assert not await other.exists(lock.key)

    asyncio.run(main())


@pytest.mark.cancel
def test_anyio_scope_cancelling_the_block_still_releases(redis_client: Any, lock_name: str) -> None:
    """``with anyio.move_on_after(t): async with lock: ...`` whose deadline passes inside the block:
    the scope catches its cancellation and the lock is released, though anyio cancels again at
    every await of the block's exit (the release runs in a task of its own)."""
    anyio = pytest.importorskip("anyio")

    async def main() -> None:
        async with clients() as (client, other):
            lock = AsyncRedisLock(client, lock_name, ttl=30, blocking_timeout=1)
            with anyio.move_on_after(0.05) as scope:
                async with lock:
                    await asyncio.sleep(5)
            assert scope.cancelled_caught
            assert not await other.exists(lock.key), "the lock stays held until its TTL"

    asyncio.run(main())
