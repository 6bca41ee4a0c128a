"""How a relay waits for work: woken by PostgreSQL's LISTEN/NOTIFY, or an adaptive poll elsewhere.

On PostgreSQL every statement that writes outbox events also calls
``pg_notify('stateguard_outbox', '')`` (:func:`notify_column`: one more
column of the INSERT's RETURNING, no extra round trip).  NOTIFY is
transactional: the notification is delivered when the transaction commits
and dropped when it rolls back, and the notifications of one transaction on
one channel with one payload are delivered as one.  A relay keeps a
connection of its own that LISTENs on the channel and, after a round that
found nothing, waits on it for up to ``idle_sleep``: an event is claimed
moments after its COMMIT.  A lost notification (the listening connection
was killed, the server restarted) loses no event: the relay reconnects, runs
a round at once, and the wait is bounded by ``idle_sleep`` anyway (the poll).
Where NOTIFY does not exist (MariaDB, SQLite, CockroachDB) or the driver
cannot listen, the relay polls adaptively: after a round that published, the
next empty round is followed by a short sleep that doubles up to
``idle_sleep``, so events that keep coming wait milliseconds and an idle
relay polls once per ``idle_sleep``.  See docs/explanation/relay.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy import Label, Select, func, literal, select

from .. import _kernel

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.ext.asyncio import AsyncEngine

log = logging.getLogger("stateguard.outbox")

#: The channel outbox writers NOTIFY and relays LISTEN on.
CHANNEL: Final = "stateguard_outbox"
#: The first sleep of the adaptive poll after a round that published (seconds); it doubles.
MIN_POLL_S: Final = 0.005
#: How long a listening wait blocks before it looks at the stop event again (seconds).
STOP_CHECK_S: Final = 0.05
#: The wait before the listening connection is made again after it failed (seconds; doubling).
RECONNECT_S: Final = 1.0
MAX_RECONNECT_S: Final = 30.0


def notifies(backend: _kernel.Backend) -> bool:
    """Whether outbox writes on ``backend`` NOTIFY the relays: PostgreSQL itself
    (CockroachDB, the other member of its SQL family, has no LISTEN/NOTIFY)."""
    return backend.listen_notify


def notify_column() -> Label[Any]:
    """``pg_notify('stateguard_outbox', '')``, to add to the RETURNING of a statement writing events."""
    return func.pg_notify(literal(CHANNEL), literal("")).label("sg_notify")


def notify_statement() -> Select[Any]:
    """``SELECT pg_notify('stateguard_outbox', '')``, for a path whose INSERT has no RETURNING."""
    return select(notify_column())


class Poll:
    """The adaptive poll: short sleeps while rounds keep publishing, doubling up to ``idle``."""

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next = MIN_POLL_S

    def worked(self) -> None:
        """A round published something: the next empty round sleeps briefly."""
        self._next = MIN_POLL_S

    def seconds(self, idle: float) -> float:
        """How long to sleep after an empty round (and double it for the next one)."""
        wait = min(self._next, idle)
        self._next = min(self._next * 2, idle)
        return wait


class _Reconnect:
    """When the listening connection may be tried again after a failure (doubling, bounded)."""

    __slots__ = ("_at", "_delay")

    def __init__(self) -> None:
        self._at = 0.0
        self._delay = RECONNECT_S

    def due(self) -> bool:
        return time.monotonic() >= self._at

    def failed(self) -> None:
        self._at = time.monotonic() + self._delay
        self._delay = min(self._delay * 2, MAX_RECONNECT_S)

    def succeeded(self) -> None:
        self._delay = RECONNECT_S


def _driver(dbapi_connection: Any) -> str:
    """The driver package of a DBAPI connection (``psycopg``, ``asyncpg`` ...)."""
    return type(dbapi_connection).__module__.split(".", 1)[0]


class Listener:
    """A LISTENing connection of a :class:`~stateguard.Relay` (psycopg 3), made on first use.

    :meth:`wait` returns at a notification, at ``stop``, or after the
    given seconds; at once after the connection was (re)made, since what was
    committed while nobody listened sent its notification to no one.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._raw: Any = None
        self._dbapi: Any = None
        self._retry = _Reconnect()
        #: The listening connection's server process id (pg_backend_pid), or None.
        self.backend_pid: int | None = None
        #: False once the engine's driver turned out unable to listen: the relay polls.
        self.usable = True

    def _connect(self) -> bool:
        """Open and LISTEN; ``True`` when it was (re)made just now."""
        try:
            raw = self.engine.raw_connection()
        except Exception as error:  # the database is down: poll, try again later
            self._retry.failed()
            log.warning("outbox relay: cannot open a LISTEN connection (%s); polling meanwhile", error)
            return False
        dbapi: Any = raw.driver_connection
        raw.detach()  # ours for as long as the relay runs, not the pool's
        if _driver(dbapi) != "psycopg":
            self.usable = False
            raw.close()
            return False
        try:
            dbapi.autocommit = True
            dbapi.execute(f'LISTEN "{CHANNEL}"')
            self.backend_pid = int(dbapi.info.backend_pid)
        except Exception as error:
            self._retry.failed()
            raw.close()
            log.warning("outbox relay: LISTEN failed (%s); polling meanwhile", error)
            return False
        self._raw, self._dbapi = raw, dbapi
        self._retry.succeeded()
        return True

    def wait(self, stop: threading.Event, seconds: float) -> bool:
        """Wait for a notification (``True``), ``stop`` or ``seconds``; ``False`` when it cannot listen
        (the caller polls)."""
        if self._raw is None:
            # Made just now: nobody listened a moment ago, so the caller looks at once.
            return self._retry.due() and self._connect()
        dbapi = self._dbapi
        deadline = time.monotonic() + seconds
        try:
            while not stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return True
                if any(True for _ in dbapi.notifies(timeout=min(left, STOP_CHECK_S), stop_after=1)):
                    for _ in dbapi.notifies(timeout=0):  # what else arrived: one round serves them all
                        pass
                    return True
        except Exception as error:  # the connection was killed, the server restarted
            log.warning("outbox relay: the LISTEN connection was lost (%s); reconnecting", error)
            self._drop()
            return self.wait(stop, max(0.0, deadline - time.monotonic()))
        return True

    def _drop(self) -> None:
        raw, self._raw, self.backend_pid = self._raw, None, None
        if raw is not None:
            with contextlib.suppress(Exception):  # a connection the server killed: nothing to close
                raw.close()

    def close(self) -> None:
        """Close the listening connection."""
        self._drop()


class AsyncListener:
    """A LISTENing connection of an :class:`~stateguard.AsyncRelay` (asyncpg or psycopg 3 async).

    The same promise as :class:`Listener`, awaited.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._dbapi: Any = None
        self._raw: Any = None
        self._woken: asyncio.Event | None = None
        self._lost = False
        self._retry = _Reconnect()
        self.backend_pid: int | None = None
        self.usable = True

    async def _connect(self) -> bool:
        try:
            raw = await self.engine.raw_connection()
        except Exception as error:
            self._retry.failed()
            log.warning("outbox relay: cannot open a LISTEN connection (%s); polling meanwhile", error)
            return False
        dbapi: Any = raw.driver_connection
        raw.detach()
        driver = _driver(dbapi)
        self._woken = asyncio.Event()
        self._lost = False
        try:
            if driver == "asyncpg":
                await dbapi.add_listener(CHANNEL, self._notified)
                dbapi.add_termination_listener(self._terminated)
                self.backend_pid = int(dbapi.get_server_pid())
            elif driver == "psycopg":
                await dbapi.set_autocommit(True)
                await dbapi.execute(f'LISTEN "{CHANNEL}"')
                self.backend_pid = int(dbapi.info.backend_pid)
            else:
                self.usable = False
                await _close_quietly(dbapi)
                return False
        except Exception as error:
            self._retry.failed()
            await _close_quietly(dbapi)
            log.warning("outbox relay: LISTEN failed (%s); polling meanwhile", error)
            return False
        self._dbapi, self._raw = dbapi, raw
        self._retry.succeeded()
        return True

    def _notified(self, *args: Any) -> None:
        if self._woken is not None:
            self._woken.set()

    def _terminated(self, *args: Any) -> None:
        self._lost = True
        self._notified()

    async def wait(self, stop: asyncio.Event, seconds: float) -> bool:
        """See :meth:`Listener.wait`."""
        if self._dbapi is None:
            if not self._retry.due():
                return False
            return await self._connect()
        deadline = time.monotonic() + seconds
        try:
            if _driver(self._dbapi) == "asyncpg":
                await self._wait_asyncpg(stop, seconds)
            else:
                await self._wait_psycopg(stop, deadline)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            self._lost = True
            log.warning("outbox relay: the LISTEN connection was lost (%s); reconnecting", error)
        if self._lost or _closed(self._dbapi):
            await self._drop()
            return await self.wait(stop, max(0.0, deadline - time.monotonic()))
        return True

    async def _wait_asyncpg(self, stop: asyncio.Event, seconds: float) -> None:
        woken = self._woken
        if woken is None:
            return
        if not woken.is_set():
            waiters = [asyncio.ensure_future(woken.wait()), asyncio.ensure_future(stop.wait())]
            try:
                await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()
        woken.clear()

    async def _wait_psycopg(self, stop: asyncio.Event, deadline: float) -> None:
        while not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            got = False
            async for _ in self._dbapi.notifies(timeout=min(left, STOP_CHECK_S), stop_after=1):
                got = True
            if got:
                async for _ in self._dbapi.notifies(timeout=0):
                    pass
                return

    async def _drop(self) -> None:
        dbapi, self._dbapi, self._raw, self.backend_pid = self._dbapi, None, None, None
        if dbapi is not None:
            await _close_quietly(dbapi)

    async def close(self) -> None:
        """Close the listening connection."""
        await self._drop()


def _closed(dbapi: Any) -> bool:
    """Whether an asyncpg or psycopg connection is closed (the server ended it)."""
    if dbapi is None:
        return False
    is_closed = getattr(dbapi, "is_closed", None)
    return bool(is_closed()) if callable(is_closed) else bool(getattr(dbapi, "closed", False))


async def _close_quietly(dbapi: Any) -> None:
    try:
        closed = dbapi.close()
        if asyncio.iscoroutine(closed):
            await closed
    except Exception:  # a connection the server killed: nothing left to close
        pass
