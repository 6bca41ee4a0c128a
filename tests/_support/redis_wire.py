"""A redis-py client whose ``evalsha`` a test steers per script (block and swallow a cancel, stall,
lose the reply), so the cancellation races of AsyncRedisLock are sequenced with events, not timing."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

from stateguard.redis.fences import _ACQUIRE_SCRIPT, _RELEASE_SCRIPT
from tests.conftest import REDIS_URL

ACQUIRE_SHA = hashlib.sha1(_ACQUIRE_SCRIPT.encode()).hexdigest()
RELEASE_SHA = hashlib.sha1(_RELEASE_SCRIPT.encode()).hexdigest()

#: Bound on how long a cancelled task may take to end when the promise holds (it takes
#: milliseconds); only reached when the test is failing.
LIVENESS_BOUND = 3.0

Real = Callable[[], Awaitable[Any]]
Hook = Callable[[Real], Awaitable[Any]]


async def _forever() -> None:
    await asyncio.Event().wait()


class Wire:
    """A redis.asyncio client's EVALSHA under the test's control.

    ``queue("acquire", hook)`` makes the next acquire-script call run ``hook(real)`` instead of
    going straight to Redis (``real()`` sends it); calls with an empty queue go through.  Only the
    calls of ``task`` (when set) are intercepted, so other tasks sharing the client are untouched.
    """

    def __init__(self, client: Any) -> None:
        self.real = client.evalsha
        self.hooks: dict[str, list[Hook]] = {"acquire": [], "release": []}
        self.log: list[str] = []
        self.in_flight = asyncio.Event()
        self.task: asyncio.Task[Any] | None = None
        client.evalsha = self._evalsha

    def queue(self, script: str, hook: Hook) -> None:
        self.hooks[script].append(hook)

    async def _evalsha(self, sha: str, *args: Any) -> Any:
        script = {ACQUIRE_SHA: "acquire", RELEASE_SHA: "release"}.get(sha)
        mine = self.task is None or asyncio.current_task() is self.task
        if script is None or not mine or not self.hooks[script]:
            return await self.real(sha, *args)
        hook = self.hooks[script].pop(0)
        return await hook(lambda: self.real(sha, *args))

    # ---- hooks -------------------------------------------------------------

    def swallow(self, *, then_run: bool, after: Callable[[], Awaitable[None]] | None = None) -> Hook:
        """Block "on the wire" until cancelled, swallow the CancelledError (redis-py's habit), then
        answer "not taken" (None) or run the script for real.  ``after`` runs before replying."""

        async def hook(real: Real) -> Any:
            self.in_flight.set()
            try:
                await _forever()
            except asyncio.CancelledError:
                self.log.append("swallowed")
            finally:
                self.in_flight.clear()
            reply = None
            if then_run:
                try:
                    reply = await real()
                except asyncio.CancelledError:
                    self.log.append("re-cancelled")
                    raise
            if after is not None:
                await after()
            return reply

        return hook

    def stall(self, flag: asyncio.Event, proceed: asyncio.Event) -> Hook:
        """Block before the command reaches Redis (waiting for a connection) until ``proceed`` is
        set; a cancel meanwhile is delivered."""

        async def hook(real: Real) -> Any:
            flag.set()
            try:
                await proceed.wait()
            except asyncio.CancelledError:
                self.log.append("stalled-cancelled")
                raise
            return await real()

        return hook

    def swallow_all(self) -> Hook:
        """Run the script for real, swallowing every cancel that arrives until its reply is in."""

        async def hook(real: Real) -> Any:
            self.in_flight.set()
            job = asyncio.ensure_future(real())
            while not job.done():
                try:
                    await asyncio.shield(job)
                except asyncio.CancelledError:
                    self.log.append("swallowed")
            return job.result()

        return hook

    def lose_reply(self, flag: asyncio.Event) -> Hook:
        """Run the script for real, then lose its reply to a cancel (delivered, not swallowed)."""

        async def hook(real: Real) -> Any:
            reply = await real()
            self.log.append(f"ran:{reply!r}")
            flag.set()
            await _forever()
            return reply  # pragma: no cover

        return hook

    def after_reply(self, flag: asyncio.Event) -> Hook:
        """Run the script for real and signal once the reply is in."""

        async def hook(real: Real) -> Any:
            reply = await real()
            self.log.append(f"ran:{reply!r}")
            flag.set()
            return reply

        return hook


@contextlib.asynccontextmanager
async def clients(n: int = 2) -> Any:
    import redis.asyncio

    made = [redis.asyncio.Redis.from_url(REDIS_URL) for _ in range(n)]
    try:
        yield made
    finally:
        for client in made:
            await client.aclose()


async def _finish(task: asyncio.Task[Any], bound: float = LIVENESS_BOUND) -> None:
    done, _ = await asyncio.wait({task}, timeout=bound)
    assert done, f"the cancelled task was still running after {bound}s"
