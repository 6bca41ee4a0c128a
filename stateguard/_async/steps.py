"""Steps: an operation written once as a generator, run by a synchronous or an async caller.

Code that talks to something other than a session (a Redis client, an Engine
of its own: ``RedisLock``, ``Relay``) is written once as a generator of
:data:`Steps`, sans-I/O: each call it makes goes through ``yield from
step(reply)``, which returns a synchronous reply at once and awaits an
awaitable one.  A synchronous class runs the generator with :func:`run_steps`
(it never suspends); an async class awaits it as :class:`Awaited`::

    def _acquire(self) -> Steps[bool]:
        got = yield from step(self.client.set(key, token, nx=True, px=ttl_ms))
        return bool(got)

    run_steps(lock._acquire())        # a redis.Redis client
    await Awaited(lock._acquire())    # a redis.asyncio.Redis client
"""

from __future__ import annotations

import inspect
from collections.abc import Generator
from typing import Any, Generic, TypeVar

__all__ = ["Awaited", "Steps", "run_steps", "step"]

T = TypeVar("T")

#: An operation written once for sync and async callers: it makes its calls
#: with ``yield from step(reply)`` and returns its result.
Steps = Generator[Any, Any, T]


def step(reply: Any) -> Steps[Any]:
    """``reply`` itself, or what it resolves to when it is awaitable; use as ``yield from step(...)``."""
    # inspect.isawaitable looks at the type: an object whose __getattr__ answers every name
    # (an attribute-access dict, a permissive record) is a value, not an awaitable.
    if inspect.isawaitable(reply):
        reply = yield from reply.__await__()
    return reply


def run_steps(steps: Steps[T]) -> T:
    """The result of an operation whose calls all returned at once (a synchronous client's)."""
    try:
        next(steps)
    except StopIteration as done:
        result: T = done.value
        return result
    steps.close()
    raise RuntimeError("a synchronous call returned an awaitable: use the Async class")  # pragma: no cover


class Awaited(Generic[T]):
    """An operation as an awaitable: the event loop drives it through each awaited call."""

    __slots__ = ("_steps",)

    def __init__(self, steps: Steps[T]) -> None:
        self._steps = steps

    def __await__(self) -> Steps[T]:
        return self._steps
