"""The relay on an AsyncEngine: :class:`~stateguard.outbox.relay.Relay`'s cycle, awaited.

The cycle and the loop are :class:`~stateguard.outbox.relay._RelayCore`'s
generators of steps; this face runs each step on the event loop (the
database's through ``run_sync``, the sink's awaited when it is a coroutine).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Dialect

from .._async import Awaited, Steps, step
from ..exceptions import InvalidArgument
from .relay import _commit_conflicts, _RelayCore
from .wakeup import AsyncListener

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine  # noqa: F401 (named by _RelayCore["AsyncEngine"])

T = TypeVar("T")


class AsyncRelay(_RelayCore["AsyncEngine"]):
    """:class:`Relay` on an :class:`~sqlalchemy.ext.asyncio.AsyncEngine`: the same cycle, awaited.

    ::

        relay = AsyncRelay(async_engine, CallableSink(send_batch))
        await relay.run_once()
        await relay.run(stop)     # stop: an asyncio.Event

    The sink's ``publish`` may be a coroutine function (a ``redis.asyncio``
    client's :class:`~stateguard.RedisStreamSink`); a synchronous one
    runs in the event loop's thread.  ``run()`` keeps :meth:`Relay.run`'s
    promise; a cancellation ends it (after the batch in hand is given back).
    """

    @staticmethod
    def _dialect_of(engine: Any) -> Dialect:
        if type(engine).__name__ != "AsyncEngine" or not hasattr(engine, "sync_engine"):
            raise InvalidArgument(f"AsyncRelay needs an AsyncEngine, got {type(engine).__name__}")
        dialect: Dialect = engine.sync_engine.dialect
        return dialect

    async def run_once(self) -> int:
        """Claim one batch, publish what the sink takes, mark it published; see :meth:`Relay.run_once`."""
        return await Awaited(self._cycle())

    async def run(self, stop_event: asyncio.Event | None = None, *, idle_sleep: float = 1.0) -> None:
        """Run batches until ``stop_event`` is set (forever without one); see :meth:`Relay.run`."""
        await Awaited(self._serve(stop_event if stop_event is not None else asyncio.Event(), idle_sleep))

    def _db(self, fn: Callable[..., T], /, *args: Any) -> Steps[T]:
        return step(self._in_transaction(fn, args))

    async def _in_transaction(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        with _commit_conflicts():
            async with self._steps_engine.begin() as conn:
                return await conn.run_sync(fn, *args)

    def _open(self) -> Steps[Any]:
        return step(self._open_async())

    async def _open_async(self) -> Any:
        conn = await self._held_engine.connect()
        try:
            await conn.begin()
        except BaseException:
            await conn.close()
            raise
        return conn

    def _on(self, conn: Any, fn: Callable[..., T], /, *args: Any) -> Steps[T]:
        return step(conn.run_sync(fn, *args))

    def _end(self, conn: Any, commit: bool) -> Steps[None]:
        return step(self._end_async(conn, commit))

    @staticmethod
    async def _end_async(conn: Any, commit: bool) -> None:
        try:
            if commit:
                await conn.commit()
        finally:
            await conn.close()

    def _call_sink(self, fn: Callable[..., Any], /, *args: Any) -> Steps[Any]:
        return step(fn(*args))

    def _idle(self, stop: asyncio.Event, seconds: float) -> Steps[None]:
        return step(self._wait(stop, seconds))

    def _make_listener(self) -> AsyncListener:
        return AsyncListener(self.engine)

    @staticmethod
    async def _wait(stop: asyncio.Event, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)
