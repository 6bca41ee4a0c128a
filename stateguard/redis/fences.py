"""What a fenced Redis lock sends: its scripts, their keys and arguments, and the database's fence.

The acquire script takes the lock and issues the fencing token in one step
(a fence only when the lock was won); release and extend recognise their own
earlier run after a lost reply.  The classes here subclass redis-py's two
``Lock`` classes to run these scripts; with ``fences=engine`` the fence is
one upsert on ``stateguard_fences`` instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Final, Literal, cast

from sqlalchemy import Connection, text

from .. import _kernel
from .._async import Awaited, Steps, run_steps, step
from ..exceptions import InvalidArgument, NotSupported, ReplicationTimeout
from .cancellation import _cancel_swallowed, _still_cancelled, _TaskLocal
from .client import _not_durable, _write_and_wait

if TYPE_CHECKING:
    from redis.asyncio.lock import Lock as AsyncLock
    from redis.lock import Lock

__all__ = []


#: Acquire and issue the fencing token in one step: a fence only when SET NX
#: won, so a failed attempt never consumes one and no holder ever runs
#: without one.  KEYS share a hash slot (see RedisLock), as Lua requires on
#: Redis Cluster.  ARGV[1] is the owner token (new for each acquisition),
#: ARGV[2] the TTL in ms, ARGV[3] "1" when Redis issues the fence, "0" when
#: the database does (``fences=``: only the lock is taken here).
#:
#: A lock already held by ARGV[1] was taken by this very acquisition, whose
#: reply was lost (redis-py sends the script again on a new connection): it
#: is acquired, with the fence it got then (the counter has not moved since:
#: only acquisitions move it, and nobody else acquired while we held it).
#:
#: The counter is seeded from the server's clock: the fence is
#: max(INCR, TIME in microseconds), so a Redis that restarted without its
#: data (or a replica promoted with an older counter) still hands out a
#: bigger fence than any before, as long as its clock did not go back.  The
#: new value is stored as the exact decimal text of TIME (a Lua number would
#: be printed as 1.7e+15).  Lua numbers are doubles: exact up to 2**53,
#: centuries of microseconds away.
_ACQUIRE_SCRIPT: Final = """
local holder = redis.call('get', KEYS[1])
if holder == ARGV[1] then
    redis.call('pexpire', KEYS[1], ARGV[2])
    if ARGV[3] ~= '1' then return 0 end
    local issued = tonumber(redis.call('get', KEYS[2]))
    if issued then return issued end
elseif holder then
    return false
else
    redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
    if ARGV[3] ~= '1' then return 0 end
end
local fence = redis.call('incr', KEYS[2])
local now = redis.call('time')
local now_us = tonumber(now[1]) * 1000000 + tonumber(now[2])
if fence < now_us then
    redis.call('set', KEYS[2], now[1] .. string.format('%06d', tonumber(now[2])))
    fence = now_us
end
return fence
"""

#: Release: compare-and-delete, leaving KEYS[2] (``<lock>:released:<token>``)
#: for ARGV[2] ms, so that a release whose reply was lost and that runs again
#: finds its own marker and succeeds instead of reporting the lock lost.  A
#: missing lock without the marker really expired.  Acquirers never look at
#: the marker: the lock key is gone, the lock is free.  A rerun that finds
#: its marker writes it again, so that its WAIT (``wait_replicas``, on the
#: rerun's connection) covers the first run's delete.
_RELEASE_SCRIPT: Final = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    redis.call('del', KEYS[1], KEYS[3])
    redis.call('set', KEYS[2], '1', 'PX', ARGV[2])
    return 1
end
if redis.call('exists', KEYS[2]) == 1 then
    redis.call('set', KEYS[2], '1', 'PX', ARGV[2])
    return 1
end
return 0
"""

#: Extend: add ARGV[2] ms to the remaining TTL (or set it, ARGV[3] == "1")
#: while ARGV[1] holds the lock, recording the call's id ARGV[4] in KEYS[2]
#: (``<lock>:extended:<token>``, with the lock's new TTL): an extension that
#: runs again because its reply was lost finds its id and adds nothing twice
#: (it writes the id again, KEEPTTL, so that its WAIT covers the first run).
_EXTEND_SCRIPT: Final = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then return 0 end
if redis.call('get', KEYS[2]) == ARGV[4] then
    redis.call('set', KEYS[2], ARGV[4], 'KEEPTTL')
    return 1
end
local ttl = tonumber(ARGV[2])
if ARGV[3] ~= '1' then
    local left = redis.call('pttl', KEYS[1])
    if left < 0 then return 0 end
    ttl = ttl + left
end
redis.call('pexpire', KEYS[1], ttl)
redis.call('set', KEYS[2], ARGV[4], 'PX', ttl)
return 1
"""

#: How long a release marker lives at least (ms): longer than redis-py's
#: default retries take (10 tries, at most 1 s apart) and a caller's own
#: second call after a ConnectionError.
_RELEASED_MARKER_MS: Final = 60_000

# The fencing subclasses of redis-py's two Lock classes differ only in
# awaiting the scripts; these helpers are the rest of them.


def _lock_key(name: str) -> str:
    """The Redis key of lock ``name``; every other key of the lock appends to it.

    Redis Cluster hashes only the hash tag, the text between the first
    ``{`` and the first ``}`` after it, when that text is not empty.  The
    first ``{`` of ``stateguard:lock:{<name>}`` is always ours, so the tag is
    the name up to its first ``}`` and every key that appends to this one
    (fence, markers) lands in the same slot, whatever braces the name holds
    (``a}b{``, ``{}``, ``{a}{b}``).  Except when the name *starts* with
    ``}``: the tag would be empty, Redis would hash each whole key, and the
    script's keys would straddle slots (CROSSSLOT).  Those names get a tag
    made of their SHA-256 under a prefix no other name's key has.
    """
    if not name.startswith("}"):
        return f"stateguard:lock:{{{name}}}"
    return f"stateguard:lock:#{{{hashlib.sha256(name.encode()).hexdigest()}}}"


def _register_scripts(lock: Any) -> None:
    cls = type(lock)
    if cls.lua_acquire is None:
        cls.lua_acquire = lock.redis.register_script(_ACQUIRE_SCRIPT)
        cls.lua_fenced_release = lock.redis.register_script(_RELEASE_SCRIPT)
        cls.lua_fenced_extend = lock.redis.register_script(_EXTEND_SCRIPT)


def _text(token: Any) -> str:
    return token.decode() if isinstance(token, bytes) else str(token)


def _ttl_ms(lock: Any) -> int:
    if lock.timeout is None:  # RedisLock and AsyncRedisLock always set a ttl
        raise InvalidArgument("a fenced Redis lock needs a ttl")
    return max(1, int(lock.timeout * 1000))


def _acquire_call(lock: Any, token: Any) -> dict[str, Any]:
    """The keys and args of :data:`_ACQUIRE_SCRIPT` for ``lock`` (a redis-py Lock) and owner ``token``."""
    return {
        "keys": [lock.name, f"{lock.name}:fence"],
        "args": [token, _ttl_ms(lock), "0" if lock.fences_from_database else "1"],
        "client": lock.redis,
    }


def _release_call(lock: Any, token: Any) -> dict[str, Any]:
    """The keys and args of :data:`_RELEASE_SCRIPT` (the markers are named after the owner token)."""
    return {
        "keys": [lock.name, f"{lock.name}:released:{_text(token)}", f"{lock.name}:extended:{_text(token)}"],
        "args": [token, max(_RELEASED_MARKER_MS, _ttl_ms(lock))],
        "client": lock.redis,
    }


def _extend_call(lock: Any, additional: float, replace_ttl: bool) -> dict[str, Any]:
    """The keys and args of :data:`_EXTEND_SCRIPT`; the call id was set by :meth:`_RedisLock._extend`."""
    token = lock.local.token
    return {
        "keys": [lock.name, f"{lock.name}:extended:{_text(token)}"],
        "args": [token, max(1, int(additional * 1000)), "1" if replace_ttl else "0", lock.local.extend_call],
        "client": lock.redis,
    }


def _took(lock: Any, fence: Any) -> bool:
    """Record the fence the script returned (nil: the lock is held) where the owner token goes.

    With database fences the script returns 0 and :meth:`_RedisLock._acquire`
    records the database's fence right after.
    """
    if fence is None:
        return False
    lock.local.fence = None if lock.fences_from_database else int(fence)
    return True


def _release_refused(error: BaseException) -> bool:
    """Whether a release's error is a definite answer (the lock is not this owner's, or the release
    ran but too few replicas confirmed it) rather than an unknown outcome (a lost reply)."""
    from redis.exceptions import LockError

    return isinstance(error, (LockError, ReplicationTimeout))


def _done(lock: Any, done: Any, verb: str) -> Literal[True]:
    """A release or extend script's reply: 0 means the lock is no longer this owner's."""
    from redis.exceptions import LockNotOwnedError

    if not done:
        raise LockNotOwnedError(f"Cannot {verb} a lock that's no longer owned", lock_name=lock.name)
    return True


@contextmanager
def _needs_redis(owner: str) -> Iterator[None]:
    try:
        yield
    except ImportError as error:
        raise ImportError(f"{owner} needs the redis package: pip install 'stateguard[redis]'") from error


def _lock_script(
    lock: Any, asynchronous: bool, script: Any, source: str, call: dict[str, Any], what: str
) -> Steps[Any]:
    """One of the lock's scripts; with ``wait_replicas``, sent with a WAIT on one connection to its master.

    A script that wrote (an acquisition: any reply but nil; a release or an
    extension: 1) and reached fewer replicas than asked raises
    :class:`~stateguard.ReplicationTimeout`.
    """
    if not lock.wait_replicas:
        return (yield from step(script(**call)))
    keys, args = call["keys"], call["args"]
    reply, acknowledged = yield from _write_and_wait(
        lock.redis, asynchronous, keys[0], ("EVALSHA", script.sha, len(keys), *keys, *args), source,
        lock.wait_replicas, lock.wait_ms,
    )  # fmt: skip
    wrote = reply is not None if source is _ACQUIRE_SCRIPT else bool(reply)
    if wrote and acknowledged < lock.wait_replicas:
        value = int(reply) if source is _ACQUIRE_SCRIPT and not lock.fences_from_database else None
        raise _not_durable(f"{lock.label} {what}", value, acknowledged, lock.wait_replicas, lock.wait_ms)
    return reply


_fenced_classes: dict[str, Any] = {}


class _Fenced:
    """What the sync and the asyncio lock classes add to redis-py's lock: fencing scripts and options.

    Mixed in before redis-py's ``Lock`` (:func:`_lock_class`, :func:`_async_lock_class`);
    :class:`RedisLock` / :class:`AsyncRedisLock` set the options per lock.
    """

    asynchronous = False
    lua_acquire: Any = None
    lua_fenced_release: Any = None
    lua_fenced_extend: Any = None
    fences_from_database = False
    wait_replicas = 0
    wait_ms = 0
    label = "RedisLock"

    def register_scripts(self) -> None:
        super().register_scripts()  # type: ignore[misc]  # redis-py's Lock, next in the MRO
        _register_scripts(self)

    def _acquire_steps(self, token: str | bytes) -> Steps[Any]:
        call = _acquire_call(self, token)
        return _lock_script(self, self.asynchronous, self.lua_acquire, _ACQUIRE_SCRIPT, call, "was taken")

    def _release_steps(self, token: str | bytes) -> Steps[Any]:
        call = _release_call(self, token)
        return _lock_script(
            self, self.asynchronous, self.lua_fenced_release, _RELEASE_SCRIPT, call, "was released"
        )

    def fenced_release(self, token: str | bytes) -> Any:
        """The release script for owner ``token``, on the master only (no WAIT); awaitable when async."""
        return self.lua_fenced_release(**_release_call(self, token))

    def _extend_steps(self, additional_time: float, replace_ttl: bool) -> Steps[Any]:
        call = _extend_call(self, additional_time, replace_ttl)
        return _lock_script(
            self, self.asynchronous, self.lua_fenced_extend, _EXTEND_SCRIPT, call, "was extended"
        )


def _lock_class() -> type[Lock]:
    with _needs_redis("RedisLock"):
        from redis.lock import Lock
    if "sync" not in _fenced_classes:

        class _FencedLock(_Fenced, Lock):
            """redis-py's lock, acquiring with :data:`_ACQUIRE_SCRIPT` to get a fencing token."""

            def do_acquire(self, token: str) -> bool:
                return _took(self, run_steps(self._acquire_steps(token)))

            def do_release(self, expected_token: str) -> None:
                _done(self, run_steps(self._release_steps(expected_token)), "release")

            def do_extend(self, additional_time: float, replace_ttl: bool) -> Literal[True]:
                return _done(self, run_steps(self._extend_steps(additional_time, replace_ttl)), "extend")

        _fenced_classes["sync"] = _FencedLock
    cls: type[Lock] = _fenced_classes["sync"]
    return cls


def _async_lock_class() -> type[AsyncLock]:
    with _needs_redis("AsyncRedisLock"):
        from redis.asyncio.lock import Lock as AsyncLock
    if "async" not in _fenced_classes:

        class _AsyncFencedLock(_Fenced, AsyncLock):
            """redis-py's asyncio lock, acquiring with :data:`_ACQUIRE_SCRIPT`; its token is per task."""

            asynchronous = True
            label = "AsyncRedisLock"

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                # redis-py types ``local`` as threading.local | SimpleNamespace;
                # it only ever gets and sets attributes on it.
                self.local = cast(Any, _TaskLocal())

            async def do_acquire(self, token: str | bytes) -> bool:
                taken = _took(self, await Awaited(self._acquire_steps(token)))
                if _cancel_swallowed(self):
                    await _still_cancelled(self, token if taken else None)
                return taken

            async def do_release(self, expected_token: bytes) -> None:
                _done(self, await Awaited(self._release_steps(expected_token)), "release")

            async def do_extend(self, additional_time: float, replace_ttl: bool) -> Literal[True]:
                return _done(self, await Awaited(self._extend_steps(additional_time, replace_ttl)), "extend")

        _fenced_classes["async"] = _AsyncFencedLock
    cls: type[AsyncLock] = _fenced_classes["async"]
    return cls


def _take_fence(conn: Connection, name: str) -> int:
    """The next fencing token of lock ``name`` from ``stateguard_fences``: one statement, one round trip.

    PostgreSQL and SQLite (>= 3.35): an upsert that returns the new value.
    MySQL/MariaDB: ``LAST_INSERT_ID(expr)`` on both the insert and the update
    branch hands the new value back in the OK packet (``cursor.lastrowid``),
    with no ``SELECT LAST_INSERT_ID()`` after it.  The row lock the upsert
    takes orders concurrent acquirers of one name; the value it returns is
    committed before the fence is used.
    """
    backend = _kernel.backend(conn.dialect)
    if backend.last_insert_id:
        return int(_kernel.execute(conn, _FENCE_LAST_INSERT_ID, {"name": name}).lastrowid)
    if backend.on_conflict and backend.returning:
        return int(_kernel.execute(conn, _FENCE_RETURNING, {"name": name}).scalar_one())
    raise NotSupported(
        f"fences= needs PostgreSQL, MySQL/MariaDB or SQLite >= 3.35 (upsert with RETURNING); "
        f"{backend.name} has none: leave fences= out to take fences from Redis"
    )


_FENCE_RETURNING: Final = text(
    "INSERT INTO stateguard_fences (name, fence) VALUES (:name, 1) "
    "ON CONFLICT (name) DO UPDATE SET fence = stateguard_fences.fence + 1 RETURNING fence"
)
_FENCE_LAST_INSERT_ID: Final = text(
    "INSERT INTO stateguard_fences (name, fence) VALUES (:name, LAST_INSERT_ID(1)) "
    "ON DUPLICATE KEY UPDATE fence = LAST_INSERT_ID(fence + 1)"
)
