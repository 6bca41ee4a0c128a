"""Redis locks with fencing tokens: :class:`RedisLock` and :class:`AsyncRedisLock`.

redis-py's own lock plus a fencing token, a number that only grows, to pass
as ``fence=`` to a trigger or :func:`~stateguard.guarded_update`, so that a
holder whose lock expired while it was paused cannot overwrite a newer
holder's write.  Fences come from Redis or, with ``fences=engine``, from the
database.  The scripts are :mod:`~stateguard.redis.fences`', the handling of
asyncio cancellation :mod:`~stateguard.redis.cancellation`'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from types import TracebackType
from typing import Any

from sqlalchemy import Engine

from .. import _kernel
from .._async import Awaited, Steps, run_steps, step
from ..exceptions import InvalidArgument, LockLost, LockNotAcquired, ReplicationTimeout
from ..tables import MAX_KEY
from .cancellation import _cancel_swallowed, _give_back_uncut, _run_uncut
from .client import (
    DEFAULT_WAIT_TIMEOUT,
    _call_id,
    _check_socket_timeout,
    _check_wait,
    _RedisClient,
    _watch,
)
from .fences import _async_lock_class, _lock_class, _lock_key, _release_call, _release_refused, _take_fence

__all__ = ["AsyncRedisLock", "RedisLock"]


class _RedisLock(_RedisClient):
    """:class:`RedisLock` and :class:`AsyncRedisLock`: everything but blocking or awaiting."""

    _lock: Any
    _fences: Any

    def __init__(
        self,
        client: Any,
        name: str,
        *,
        ttl: float | timedelta,
        blocking_timeout: float | timedelta | None = None,
        sleep: float = 0.1,
        fences: Any = None,
        wait_replicas: int = 0,
        wait_timeout: float | timedelta = DEFAULT_WAIT_TIMEOUT,
    ) -> None:
        cls = _async_lock_class() if self._asynchronous else _lock_class()
        self._check_client(client)
        self.wait_replicas, wait_ms = _check_wait(wait_replicas, wait_timeout)
        _check_socket_timeout(type(self).__name__, client, self.wait_replicas, wait_ms)
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"{type(self).__name__} needs a non-empty str name, got {name!r}")
        try:
            name.encode()
        except UnicodeEncodeError:
            raise InvalidArgument(
                f"{type(self).__name__} name {name!r} holds a lone surrogate, which no Redis key can store; "
                f"pass valid text"
            ) from None
        seconds = _kernel.required_seconds(ttl, "ttl")
        if seconds < 0.001:
            raise InvalidArgument(f"ttl must be at least 1 millisecond, got {ttl!r}")
        if fences is not None:
            self._check_fences(fences)
            # The name is the primary key of its row in stateguard_fences.
            _kernel.check_text(name, "name", MAX_KEY)
        self.name = name
        self.ttl = seconds
        self.blocking_timeout = _kernel.seconds(blocking_timeout, "blocking_timeout", allow_zero=True)
        self._fences = fences
        self.key = _lock_key(name)
        self.fence_key = f"{self.key}:fence"
        self._lock = cls(
            client, self.key, timeout=seconds, sleep=sleep, blocking_timeout=self.blocking_timeout
        )
        self._lock.fences_from_database = fences is not None
        self._lock.wait_replicas = self.wait_replicas
        self._lock.wait_ms = wait_ms
        self._lock.label = f"{type(self).__name__} {name!r}"

    def _check_fences(self, fences: Any) -> None:
        """``fences=`` must be the kind of engine this class awaits or not."""
        if self._asynchronous:
            from sqlalchemy.ext.asyncio import AsyncEngine

            wanted: type[Any] = AsyncEngine
        else:
            wanted = Engine
        if not isinstance(fences, wanted):
            other = "RedisLock with an Engine" if self._asynchronous else "AsyncRedisLock with an AsyncEngine"
            raise InvalidArgument(
                f"{type(self).__name__}(fences=...) takes a sqlalchemy {wanted.__name__} whose database has "
                f"the stateguard_fences table, got {fences!r} (or use {other})"
            )

    @property
    def fence(self) -> int | None:
        """The fencing token of this thread's (task's) latest acquisition (``None`` before the first).

        ::

            lock.acquire()
            Payout.flow.send(session, 42, fence=lock.fence)
        """
        fence: int | None = getattr(self._lock.local, "fence", None)
        return fence

    def _database_fence(self) -> int | Coroutine[Any, Any, int]:
        """The next fence from the database, in a transaction of its own (a coroutine for AsyncEngine)."""
        if self._asynchronous:
            return self._async_database_fence()
        with self._fences.begin() as conn:
            return _take_fence(conn, self.name)

    async def _async_database_fence(self) -> int:
        async with self._fences.begin() as conn:
            fence: int = await conn.run_sync(_take_fence, self.name)
            return fence

    def _acquire(self, blocking_timeout: float | timedelta | None) -> Steps[int]:
        wait = _kernel.seconds(blocking_timeout, "blocking_timeout", allow_zero=True)
        if wait is None:
            wait = self.blocking_timeout
        local = self._lock.local
        # The owner token is this acquisition's identity: the script
        # recognises a lock already held by it (a retry after a lost reply).
        # If the call raises, the next acquire() of this thread (task) goes
        # on under the same token, so a lock the failed call did take is
        # recognised instead of staying held by nobody until its TTL.
        token = getattr(local, "pending_token", None) or _call_id()
        local.pending_token = token
        try:
            acquired = yield from self._call(self._lock.acquire, blocking_timeout=wait, token=token)
        except Exception as error:
            if not self.wait_replicas:
                raise
            # The script may have taken the lock before its WAIT failed: too
            # few replicas (ReplicationTimeout), or WAIT itself raised (the
            # socket timed out, the connection dropped).  Give it back, so
            # that no caller is left holding a lock it does not know about
            # and no holder runs on a lock a failover can hand to someone
            # else.  A give-back that fails keeps the owner token: this
            # thread's (task's) next acquire() takes the lock over.
            given_back = yield from self._give_back(token)
            if given_back:
                local.pending_token = None
            if isinstance(error, ReplicationTimeout):
                raise self._given_back(error, given_back) from None
            error.add_note(
                f"{type(self).__name__} {self.name!r}: "
                + (
                    "the lock this acquisition may have taken was given back (released on the Redis master)"
                    if given_back
                    else "giving back the lock this acquisition may have taken failed too: it stays held "
                    f"until its ttl ({self.ttl:g}s) ends, or until this thread's (task's) next acquire() "
                    "takes it over"
                )
            )
            raise
        local.pending_token = None
        if not acquired:
            raise LockNotAcquired(
                f"{type(self).__name__} {self.name!r} is held by someone else"
                f"{'' if wait is None else f'; gave up after {wait:g}s'}. "
                f"Retry later (retry_on_conflict() does this)"
            )
        if self._fences is not None:
            try:
                fence = yield from self._call(self._database_fence)
                # The fence counts only if this holder still has the lock now,
                # after the fence was issued: any later holder is granted the
                # lock after this moment, so it takes a larger fence.  Without
                # the check a holder whose lock expired while it waited for the
                # database (a busy pool, a slow statement) would get a fence
                # above the live holder's, and its writes would win.
                still = yield from self._call(self._lock.owned)
            except BaseException:
                # No holder runs without a fence: give the lock back, then
                # report the database's error or the cancellation (a failed
                # release only means the lock stays until its TTL ends).
                yield from self._give_back_unfenced()
                raise
            if self._asynchronous and _cancel_swallowed(self._lock):
                # Cancelled while the fence was taken or the lock checked, and the driver or
                # redis-py swallowed it: the task must not go on holding a lock it was told (by
                # the cancellation) it did not get.
                yield from self._give_back_unfenced()
                yield from step(asyncio.sleep(0))
                raise asyncio.CancelledError
            if not still:
                local.fence = None
                raise LockNotAcquired(
                    f"{type(self).__name__} {self.name!r} expired while its fence was taken from the "
                    f"database (ttl {self.ttl:g}s); another holder may have it now. Retry, with a ttl well "
                    f"above the database round trip (a free connection in the fences engine's pool)"
                )
            local.fence = fence
        fence = self.fence
        if fence is None:
            raise LockLost(f"{type(self).__name__} {self.name!r} was acquired but no fencing token came back")
        return fence

    def _give_back_unfenced(self) -> Steps[None]:
        """Release the lock this acquisition took but could not fence (the database's fence failed
        or the task was cancelled while waiting for it).

        With an async client the release runs in a task of its own, waited for through further
        cancellations (a TaskGroup shutting down, anyio's repeated delivery), which are then
        delivered: a cancelled task never ends holding a lock it was told it did not get.
        """
        lock = self._lock
        if not self._asynchronous:
            with suppress(Exception):
                yield from self._call(lock.release)
            return
        token = lock.local.token
        if token is None:  # pragma: no cover - the script just recorded it
            return
        lock.local.token = None
        lock.local.pending_token = token  # until the give-back succeeds: the next acquire() takes it over
        if (yield from step(_give_back_uncut(lock, token))):
            # A further cancellation came during the give-back: delivered now, after one more
            # await (a canceller that delivers again and again, anyio's scopes, then raises its own).
            yield from step(asyncio.sleep(0))
            raise asyncio.CancelledError

    def _give_back(self, token: str) -> Steps[bool]:
        """Release the lock if owner ``token`` holds it, on the master only (no WAIT); whether that ran.

        The lock of an acquisition that raised: a WAIT here could fail the
        same way as the acquisition's.  A release that does not reach the
        replicas only leaves the lock to its TTL after a failover.
        """
        lock = self._lock
        try:
            yield from self._call(lock.lua_fenced_release, **_release_call(lock, token))
        except Exception:
            return False
        return True

    def _given_back(self, error: ReplicationTimeout, given_back: bool) -> ReplicationTimeout:
        """An acquisition's ReplicationTimeout: says that the lock was given back and what ``.value`` is."""
        if given_back:
            state = "so the lock was given back (released on the master): this caller does not hold it"
        else:
            state = (
                f"and giving the lock back failed too: this caller does not hold it, but it stays taken "
                f"until its ttl ({self.ttl:g}s) ends or this thread's (task's) next acquire() takes it over"
            )
        value = (
            "None (with fences=engine no fence is taken for a lock given back)"
            if self._fences is not None
            else "the unused Redis fence the master handed out for it"
        )
        return ReplicationTimeout(
            f"{type(self).__name__} {self.name!r} was taken on the Redis master, but only "
            f"{error.acknowledged} of the {error.wanted} replicas asked for (wait_replicas) confirmed it "
            f"within {self._lock.wait_ms} ms, {state}. The error's .value is {value}. Retry later; check the "
            f"replicas (INFO replication), lower wait_replicas or raise wait_timeout",
            value=error.value,
            acknowledged=error.acknowledged,
            wanted=error.wanted,
        )

    def _release(self) -> Steps[None]:
        local = self._lock.local
        token = local.token
        with self._owner_errors("was released"):
            try:
                if not self._asynchronous:
                    yield from self._call(self._lock.release)
                    return
                # A task of its own that a cancellation cannot cut (a TaskGroup shutting down,
                # anyio's scope delivering again inside ``async with lock:``'s exit): cut, the
                # release would not reach Redis and the lock would stay until its TTL ends.
                if token is None:
                    yield from self._call(self._lock.release)  # redis-py's error: not held by this task
                    return  # pragma: no cover - it raised
                # Cleared first, as redis-py's sync lock does (the task-local token cannot be
                # reached from the release's own task); kept again below when the outcome is unknown.
                local.token = None
                job, cancelled = yield from step(_run_uncut(self._lock.do_release(token)))
                if cancelled:
                    error = None if job.cancelled() else job.exception()
                    if error is not None and not _release_refused(error):
                        local.token = token  # outcome unknown: kept for a second release()
                    yield from step(asyncio.sleep(0))
                    raise asyncio.CancelledError
                job.result()
            except Exception as error:
                if not _release_refused(error):
                    # The outcome is unknown (the reply may be lost): keep the
                    # token (redis-py's sync lock drops it first), so that a
                    # second release() finds its own marker if the first one ran.
                    local.token = token
                raise

    def _extend(self, additional: float | timedelta, replace_ttl: bool) -> Steps[None]:
        seconds = _kernel.required_seconds(additional, "additional")
        local = self._lock.local
        # The call's identity, kept after an error for a second extend() with
        # the same arguments: an extension that did run is not added twice.
        pending = getattr(local, "pending_extend", None)
        call = pending[0] if pending is not None and pending[1:] == (seconds, replace_ttl) else _call_id()
        local.extend_call = call
        local.pending_extend = (call, seconds, replace_ttl)
        with self._owner_errors("was extended"):
            try:
                yield from self._call(self._lock.extend, seconds, replace_ttl=replace_ttl)
            except ReplicationTimeout:
                local.pending_extend = None  # it was extended: the next extend() is a new one
                raise
        local.pending_extend = None

    def _owned(self) -> Steps[bool]:
        return bool((yield from self._call(self._lock.owned)))

    def _locked(self) -> Steps[bool]:
        return bool((yield from self._call(self._lock.locked)))

    def _exit(self, exc_type: type[BaseException] | None) -> Steps[None]:
        """The end of the block: release unless already released in it; the block's own error wins."""
        if self._lock.local.token is None:
            return
        try:
            yield from self._release()
        except (LockLost, ReplicationTimeout):
            if exc_type is None:
                raise

    @contextmanager
    def _owner_errors(self, when: str) -> Iterator[None]:
        """redis-py's lock errors as stateguard's: lost (expired) or never held here."""
        from redis.exceptions import LockError, LockNotOwnedError

        try:
            yield
        except LockNotOwnedError as error:
            raise LockLost(
                f"{type(self).__name__} {self.name!r} (fence {self.fence}) expired before it {when} "
                f"(ttl {self.ttl:g}s) and may belong to another holder now; writes made with its "
                f"fence after the expiry were refused by fenced updates, anything else was unprotected"
            ) from error
        except LockError as error:
            holder = "task" if self._asynchronous else "thread"
            raise InvalidArgument(
                f"{type(self).__name__} {self.name!r} is not held by this {holder}"
            ) from error

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} ttl={self.ttl:g}s fence={self.fence}>"


class RedisLock(_RedisLock):
    """A Redis lock (redis-py's) that hands out a fencing token on every acquisition.

    ``ttl`` (seconds or a ``timedelta``) is required: a holder that dies
    must not keep the lock forever.  The price of a TTL is that a holder
    paused longer than it (GC, a stalled VM, a slow call) loses the lock
    while it still believes it holds it.  The fencing token protects its
    writes: an integer, issued atomically with each acquisition, that only
    grows for this name.  Pass it as ``fence=`` to a trigger or
    :func:`~stateguard.guarded_update` on a model with a
    :func:`~stateguard.fence_column`, and the database refuses (STALE) a
    write carrying an older token than the last one it stored::

        lock = RedisLock(redis_client, "payout:42", ttl=timedelta(seconds=30))
        with lock as fence:
            Payout.flow.send(session, 42, fence=fence)
            session.commit()

    Entering waits up to ``blocking_timeout`` seconds (``None``: forever;
    ``0``: one try), polling every ``sleep`` seconds, then raises
    :class:`~stateguard.LockNotAcquired`.  Exiting releases the lock only
    if it is still ours (redis-py's compare-and-delete); if it expired it
    raises :class:`~stateguard.LockLost` (unless the block already raised)
    and leaves any newer holder's lock alone.  :meth:`extend` adds time.

    Where fences come from (use one mode for every holder of a name):

    * ``fences=engine`` (a SQLAlchemy ``Engine`` whose database has the
      ``stateguard_fences`` table): from the database, one upsert in its own
      transaction right after Redis granted the lock; fences 1, 2, 3 ... that
      never go back whatever Redis loses (restart, failover, eviction).  If
      the database fails, the lock is released and its error raised.  The
      only mode that is a guarantee::

          lock = RedisLock(redis_client, "payout:42", ttl=30, fences=engine)

    * no ``fences``: from Redis, ``max(INCR, server TIME in microseconds)``,
      so a Redis that restarted empty (or a promoted replica) still hands
      out bigger fences while its clock does not go back.  Fences are about
      1.8e15: store them in a ``BIGINT`` (:func:`~stateguard.fence_column`).

    Keys: ``stateguard:lock:{<name>}`` holds the owner token with the TTL,
    ``stateguard:lock:{<name>}:fence`` the Redis counter, and short-lived
    ``...:released:<token>`` / ``...:extended:<token>`` markers.  The braces
    are a Redis Cluster hash tag, so all of them live in one slot whatever
    braces the name holds; a name starting with ``}`` (which would make the
    tag empty) uses ``stateguard:lock:#{<sha256 of the name>}`` instead.

    Replicas: ``wait_replicas=N`` runs Redis ``WAIT N wait_timeout`` after
    each acquisition, extension and release, on the same connection (on a
    cluster, to the master of the lock's slot).  Fewer than ``N``
    confirmations raise :class:`~stateguard.ReplicationTimeout`: an
    acquisition gives the lock back first (a failover could hand it to a
    second holder; its ``.value`` is the unused Redis fence, ``None`` with
    ``fences``), an extension or release did happen on the master.  An
    acquisition whose WAIT fails in any other way (socket timeout, dropped
    connection) also gives the lock back, then re-raises redis' error.
    ``wait_replicas`` is at most 2**31 - 1, ``wait_timeout`` at most one hour
    and below the client's ``socket_timeout``::

        lock = RedisLock(cluster_client, "payout:42", ttl=30, fences=engine, wait_replicas=1)

    :raises InvalidArgument: a bad ``ttl``, ``blocking_timeout``,
        ``wait_replicas`` (an int from 0 to 2**31 - 1, 0 by default: no
        WAIT), ``wait_timeout`` (1 ms to 1 hour) or name, a client
        ``socket_timeout`` not above ``wait_timeout`` (with
        ``wait_replicas``), a ``fences`` that is not an ``Engine``, or (with
        ``fences``) a name over 255 characters.

    Lost replies: an acquisition, release or extension that ran but whose
    reply was lost is recognised when it runs again (redis-py retries on a
    dropped connection): acquired with its fence, released, extended once.
    With retries off it raises redis-py's ``ConnectionError``; call the same
    method again from the same thread to learn what the first call did.

    Like redis-py's lock, the token (and :attr:`fence`) is thread-local:
    share a lock object between threads only if each acquires it itself.
    For a ``redis.asyncio`` client use :class:`AsyncRedisLock`.
    """

    def acquire(self, *, blocking_timeout: float | timedelta | None = None) -> int:
        """Take the lock and return its new fencing token, or raise :class:`~stateguard.LockNotAcquired`.

        ``blocking_timeout`` overrides the one given to the constructor::

            fence = lock.acquire(blocking_timeout=0)   # one try
            try:
                ...
            finally:
                lock.release()
        """
        with _watch("redis_lock.acquire", self.name):
            return run_steps(self._acquire(blocking_timeout))

    def release(self) -> None:
        """Release the lock if it is still ours; :class:`~stateguard.LockLost` if it expired.

        Never deletes another holder's lock (the owner token is compared and
        the key deleted in one script)::

            lock.acquire()
            try:
                work()
            finally:
                lock.release()
        """
        with _watch("redis_lock.release", self.name):
            run_steps(self._release())

    def extend(self, additional: float | timedelta, *, replace_ttl: bool = False) -> None:
        """Add ``additional`` seconds to the remaining TTL (or set it, ``replace_ttl=True``).

        Raises :class:`~stateguard.LockLost` if the lock already expired; the
        fencing token stays the same::

            lock = RedisLock(r, "report", ttl=30)
            with lock as fence:
                for chunk in chunks:
                    process(chunk, fence)
                    lock.extend(30)
        """
        with _watch("redis_lock.extend", self.name):
            run_steps(self._extend(additional, replace_ttl))

    def owned(self) -> bool:
        """Whether this thread holds the lock right now (one ``GET``).

        For example::

            if not lock.owned():
                raise RuntimeError("lost the lock")
        """
        return run_steps(self._owned())

    def locked(self) -> bool:
        """Whether anyone holds the lock right now (one ``GET``).

        For example::

            if lock.locked():
                print("someone is running the payout")
        """
        return run_steps(self._locked())

    def __enter__(self) -> int:
        return self.acquire()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with _watch("redis_lock.release", self.name):
            run_steps(self._exit(exc_type))


class AsyncRedisLock(_RedisLock):
    """:class:`RedisLock` for a ``redis.asyncio`` client: the same keys, fences and errors, awaited.

    Built on redis-py's ``redis.asyncio.lock.Lock``; every method that talks
    to Redis is a coroutine, and ``async with`` takes and releases it::

        lock = AsyncRedisLock(redis.asyncio.Redis(), "payout:42", ttl=timedelta(seconds=30))
        async with lock as fence:
            await guarded_update(session, Payout, 42, {"sent": True},
                                 expected_version=version, fence=fence)
            await session.commit()

    The fencing counter and the lock key are the ones :class:`RedisLock`
    uses, so sync and async holders of one name exclude each other and
    share one growing sequence of fences.  ``fences=`` takes an
    ``AsyncEngine`` (the same ``stateguard_fences`` table and sequence as a
    :class:`RedisLock` with an ``Engine``)::

        lock = AsyncRedisLock(client, "payout:42", ttl=30, fences=async_engine)

    The owner token (and :attr:`fence`) belongs to the asyncio *task* that
    acquired, as the sync lock's belongs to a thread: one lock object may be
    shared by many tasks (a module-level lock in a web app), each waiting
    for and releasing only its own hold, so a task whose hold expired gets
    :class:`~stateguard.LockLost` instead of deleting the next task's lock.
    Acquire and release in the same task: bound the wait with
    ``blocking_timeout``, not ``asyncio.wait_for`` (which on Python 3.11 runs
    the acquisition in a task of its own).  A task cancelled while it waits
    gets :class:`asyncio.CancelledError` (also when redis-py's client swallows
    the cancellation inside a command: :meth:`acquire` notices the task's
    pending cancellation, gives back a lock it took meanwhile, and raises it).
    With ``fences=`` a task cancelled while the database hands out its fence
    gives the lock back too, in a task of its own that a further cancellation
    cannot cut.  A release (``release()``, the end of ``async with lock:``)
    runs in a task of its own as well: a task cancelled while it releases
    still releases, then gets its CancelledError.  A task cancelled while its
    acquisition is on the wire may leave the lock held until its TTL ends (as
    does a give-back or release that finds Redis down).
    """

    _asynchronous = True

    async def acquire(self, *, blocking_timeout: float | timedelta | None = None) -> int:
        """Take the lock and return its new fencing token, or raise :class:`~stateguard.LockNotAcquired`.

        ``blocking_timeout`` overrides the one given to the constructor::

            fence = await lock.acquire(blocking_timeout=0)   # one try
            try:
                ...
            finally:
                await lock.release()
        """
        # A cancellation already requested is delivered here, before anything is sent; after this,
        # one that redis-py's client swallows inside a command is noticed by the count (see
        # _AsyncFencedLock.do_acquire).
        await asyncio.sleep(0)
        task = asyncio.current_task()
        local = self._lock.local
        local.cancel_base = task.cancelling() if task is not None else None
        try:
            with _watch("redis_lock.acquire", self.name):
                return await Awaited(self._acquire(blocking_timeout))
        finally:
            local.cancel_base = None

    async def release(self) -> None:
        """Release the lock if this task still holds it; :class:`~stateguard.LockLost` if it expired.

        Never deletes another holder's lock::

            await lock.acquire()
            try:
                await work()
            finally:
                await lock.release()
        """
        with _watch("redis_lock.release", self.name):
            await Awaited(self._release())

    async def extend(self, additional: float | timedelta, *, replace_ttl: bool = False) -> None:
        """Add ``additional`` seconds to the remaining TTL (or set it, ``replace_ttl=True``).

        Raises :class:`~stateguard.LockLost` if the lock already expired; the
        fencing token stays the same::

            async with lock as fence:
                for chunk in chunks:
                    await process(chunk, fence)
                    await lock.extend(30)
        """
        with _watch("redis_lock.extend", self.name):
            await Awaited(self._extend(additional, replace_ttl))

    async def owned(self) -> bool:
        """Whether this task holds the lock right now (one ``GET``).

        For example::

            if not await lock.owned():
                raise RuntimeError("lost the lock")
        """
        return await Awaited(self._owned())

    async def locked(self) -> bool:
        """Whether anyone holds the lock right now (one ``GET``).

        For example::

            if await lock.locked():
                print("someone is running the payout")
        """
        return await Awaited(self._locked())

    async def __aenter__(self) -> int:
        return await self.acquire()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with _watch("redis_lock.release", self.name):
            await Awaited(self._exit(exc_type))
