"""Cancellation of an asyncio task holding or taking a Redis lock: the give-back no cancellation cuts.

A task cancelled while it acquires must not end holding a lock it was told it
did not get, and one cancelled while it releases must still release: those
steps run in a task of their own (:func:`_run_uncut`) that is waited for
through any further cancellation, which is delivered afterwards.
:class:`_TaskLocal` keeps redis-py's owner token per task rather than per
thread, so tasks sharing one lock object never release each other's hold.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable
from typing import Any, Final, NoReturn, TypeVar

__all__ = []

log = logging.getLogger("stateguard.redis")

T = TypeVar("T")


def _cancel_swallowed(lock: Any) -> bool:
    """Whether the current task was cancelled since ``AsyncRedisLock.acquire`` began, though no
    CancelledError came out of the command just awaited (redis-py's asyncio client, a database
    driver, swallowed it): ``Task.cancelling()`` grew past the count acquire() noted."""
    base = getattr(lock.local, "cancel_base", None)
    task = asyncio.current_task()
    return base is not None and task is not None and task.cancelling() > base


async def _still_cancelled(lock: Any, token: str | bytes | None) -> NoReturn:
    """The task was cancelled during ``AsyncRedisLock.acquire`` and redis-py's asyncio client
    swallowed the CancelledError inside a command (it does, now and then): end the acquisition
    with CancelledError, at once (redis-py's loop would go on polling until the lock is free or
    ``blocking_timeout`` ends), giving back the lock first if ``token`` (this command) took it.

    The give-back (:func:`_give_back_uncut`) is waited for through any further cancellation, so
    the task never ends holding a lock it was told it did not get.  Then one ``await`` lets a
    canceller that cancels again and again (anyio's cancel scopes) deliver its own
    CancelledError, which it recognises; a plain ``task.cancel()`` or ``asyncio.timeout`` gets a
    fresh one.
    """
    if token is not None:
        await _give_back_uncut(lock, token)
    await asyncio.sleep(0)
    raise asyncio.CancelledError


async def _run_uncut(awaitable: Awaitable[T]) -> tuple[asyncio.Future[T], bool]:
    """Run ``awaitable`` to its end in a task of its own that a cancellation of the caller cannot
    cut: ``(its finished future, whether the caller was cancelled meanwhile)``.

    The caller reads the outcome from the future and delivers the cancellation itself.  wait(),
    not shield(): shield would raise the job's error into the caller, replacing its own.
    """
    job = asyncio.ensure_future(awaitable)
    cancelled = False
    while not job.done():
        try:
            await asyncio.wait((job,))
        except asyncio.CancelledError:
            cancelled = True
    return job, cancelled


async def _give_back_uncut(lock: Any, token: str | bytes) -> bool:
    """Release the lock ``token`` holds, in a task of its own that a cancellation of this one
    cannot cut; whether a cancellation arrived meanwhile (the caller delivers it).

    A give-back that fails (the server is down) is logged, never raised: the lock then stays
    until its TTL ends, and what the task must see is its cancellation or its own error.  On
    success the task's pending owner token is forgotten.
    """
    give_back, cancelled = await _run_uncut(lock.fenced_release(token))
    if give_back.cancelled() or give_back.exception() is not None:
        log.warning(
            "could not give back lock %r, taken by an acquisition that did not hand it out: if the "
            "server still has it, it is held until its ttl ends",
            lock.name,
            exc_info=None if give_back.cancelled() else give_back.exception(),
        )
    else:
        lock.local.pending_token = None
    return cancelled


class _TaskLocal:
    """Attributes private to the asyncio task that set them: redis-py's thread-local token, per task.

    redis-py's asyncio lock keeps its owner token in a ``threading.local``,
    which every task of an event loop shares: task A's lock expires, task B
    takes it through the same lock object, and A's release then reads B's
    token and deletes B's lock.  Keyed by task (weakly, so finished tasks
    drop out), A still holds its own token and gets LockLost.
    """

    __slots__ = ("_outside", "_tasks")

    _DEFAULTS: Final = {"token": None}

    def __init__(self) -> None:
        object.__setattr__(self, "_tasks", weakref.WeakKeyDictionary())
        object.__setattr__(self, "_outside", {})

    def _mine(self) -> dict[str, Any]:
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no running event loop
            task = None
        if task is None:
            outside: dict[str, Any] = self._outside
            return outside
        tasks: weakref.WeakKeyDictionary[asyncio.Task[Any], dict[str, Any]] = self._tasks
        return tasks.setdefault(task, {})

    def __getattr__(self, name: str) -> Any:
        mine = self._mine()
        if name in mine:
            return mine[name]
        if name in self._DEFAULTS:
            return self._DEFAULTS[name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        self._mine()[name] = value
