"""Redis: one-time tokens and locks with fencing tokens (SCHEMES.md, schemes 6 and 8).

* :class:`RedisTokens`: :func:`~stateguard.issue_token` /
  :func:`~stateguard.consume_token` in Redis, one Lua script per consume.
* :class:`RedisLock`: redis-py's own lock plus a *fencing token*, a number
  that only grows, to pass as ``fence=`` to a trigger or
  :func:`~stateguard.guarded_update` so a holder whose lock expired while it
  was paused cannot overwrite a newer holder's write.
* :class:`AsyncRedisTokens` and :class:`AsyncRedisLock`: the same for a
  ``redis.asyncio`` client (same keys, scripts, fences and outcomes).
* :class:`RedisStreamSink`: an outbox :class:`~stateguard.outbox.Sink` that
  appends each event to a Redis stream (XADD, one pipeline per batch).

redis-py (the ``stateguard[redis]`` extra) is imported only by this module,
and only when a lock is built or an error mapped: ``import stateguard`` works
without it.

Each operation is written once, for both kinds of client, as a generator of
steps (``_issue``, ``_acquire`` ...; the bridge is ``stateguard._async``'s
``Steps``) that makes every Redis call through ``yield from self._call(fn,
...)``.  A synchronous client's reply comes back at once, so the generator
never suspends and ``run_steps`` runs it to its end; an async client returns
a coroutine, which ``step`` awaits by delegating to its ``__await__``, and the
async method awaits the whole generator (``Awaited``).  Keys, scripts,
validation, fencing and outcomes are therefore decided in one place; the
public classes only say whether they block or await.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import secrets
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal, NoReturn, TypeVar, cast

from sqlalchemy import Connection, Engine, text

from . import _kernel
from . import observe as _observe
from ._async import Awaited, Steps, run_steps, step
from .exceptions import InvalidArgument, LockLost, LockNotAcquired, NotSupported, ReplicationTimeout
from .result import Outcome, Result
from .tables import MAX_KEY, MAX_SCOPE
from .tokens import TOKEN_BYTES, OneTimeToken, token_digest

if TYPE_CHECKING:
    from collections.abc import Sequence

    from redis.asyncio.lock import Lock as AsyncLock
    from redis.lock import Lock

    from .outbox import OutboxEvent

__all__ = ["AsyncRedisLock", "AsyncRedisTokens", "RedisLock", "RedisStreamSink", "RedisTokens"]

log = logging.getLogger(__name__)

T = TypeVar("T")


# --------------------------------------------------------------------------
# Sync or async: the one place a Redis call is made
# --------------------------------------------------------------------------


def _watch(operation: str, scope: str) -> AbstractContextManager[dict[str, Any]]:
    """The stateguard.observe report of one Redis call (a no-op block while nothing listens)."""
    return _observe.watch(operation, log, scope=scope if isinstance(scope, str) else None, backend="redis")


class _RedisClient:
    """What every class here shares: the client check and :meth:`_call`."""

    #: Whether the client's commands return awaitables (redis.asyncio): the Async* classes.
    _asynchronous: ClassVar[bool] = False

    def _check_client(self, client: Any) -> None:
        """Refuse anything but a redis-py client of the kind this class drives.

        A redis.asyncio client handed to a synchronous class would return
        coroutines that are never awaited (a token "issued" but never
        stored); a synchronous one handed to an async class fails on the
        first ``await``.  Both are caught here, before anything is sent.
        """
        owner = type(self).__name__
        asynchronous = self._asynchronous
        wanted = "redis.asyncio.Redis" if asynchronous else "redis.Redis"
        if client is None or not callable(getattr(client, "register_script", None)):
            raise InvalidArgument(f"{owner} needs a redis client ({wanted}), got {client!r}")
        if inspect.iscoroutinefunction(getattr(client, "execute_command", None)) is not asynchronous:
            other = owner.removeprefix("Async") if asynchronous else f"Async{owner}"
            raise InvalidArgument(
                f"{owner} needs a {'redis.asyncio' if asynchronous else 'synchronous'} client ({wanted}), "
                f"got {client!r}; use {other} with this client"
            )

    def _call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Steps[Any]:
        """``fn(*args, **kwargs)``'s reply, awaited for an async client; use as ``yield from``."""
        return (yield from step(fn(*args, **kwargs)))


# --------------------------------------------------------------------------
# wait_replicas: a write, then WAIT, on one connection to the key's master
# --------------------------------------------------------------------------

#: ``wait_timeout``'s default (seconds): how long WAIT blocks for the replicas.
DEFAULT_WAIT_TIMEOUT: Final = 1.0

#: How many times a write with WAIT is sent again after the cluster moved the
#: key's slot (MOVED, a failover, CLUSTERDOWN, a refused connection), with
#: the slot map reloaded in between.  Every write here recognises its own
#: earlier run (call ids, owner tokens), so sending it again is safe.
_CLUSTER_ATTEMPTS: Final = 4


#: The largest ``wait_replicas``: Redis parses WAIT's count as a 64-bit
#: integer and refuses more; no deployment has anywhere near this many.
MAX_WAIT_REPLICAS: Final = 2**31 - 1

#: The longest ``wait_timeout`` (seconds): one hour.  WAIT blocks the call
#: (and holds its connection) that long when the replicas do not answer.
MAX_WAIT_TIMEOUT: Final = 3600.0
#: Largest ``RedisStreamSink(maxlen=...)``: Redis parses XADD's MAXLEN as a signed 64-bit
#: integer (``XADD s MAXLEN 9223372036854775808 * f v`` is "ERR value is not an integer or
#: out of range", Redis 7.0).
MAX_MAXLEN: Final = 2**63 - 1


def _check_wait(wait_replicas: Any, wait_timeout: Any) -> tuple[int, int]:
    """``(replicas, timeout in ms)`` from the constructor's ``wait_replicas`` and ``wait_timeout``."""
    if type(wait_replicas) is not int or not 0 <= wait_replicas <= MAX_WAIT_REPLICAS:
        raise InvalidArgument(
            f"wait_replicas must be an int from 0 (0: do not wait for replicas) to {MAX_WAIT_REPLICAS}, "
            f"got {wait_replicas!r}; set it to at most the number of replicas each master has"
        )
    seconds = _kernel.required_seconds(wait_timeout, "wait_timeout")
    if not 0.001 <= seconds <= MAX_WAIT_TIMEOUT:
        raise InvalidArgument(
            f"wait_timeout must be from 1 millisecond to {MAX_WAIT_TIMEOUT:g} s (one hour), "
            f"got {wait_timeout!r}"
        )
    return wait_replicas, max(1, int(seconds * 1000))


def _socket_timeout(client: Any) -> float | None:
    """The ``socket_timeout`` ``client`` was built with (a cluster's: its nodes'); ``None``: none, unknown."""
    kind = _cluster_kind(client)
    if kind == "sync":
        kwargs = getattr(getattr(client, "nodes_manager", None), "connection_kwargs", None)
    elif kind == "async":
        kwargs = getattr(client, "connection_kwargs", None)
    else:
        kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
    timeout = kwargs.get("socket_timeout") if isinstance(kwargs, dict) else None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        return None
    return float(timeout)


def _check_socket_timeout(owner: str, client: Any, wait_replicas: int, wait_ms: int) -> None:
    """With ``wait_replicas``, the client must wait for WAIT's reply longer than WAIT may block.

    Otherwise a WAIT that times out on the server times out in the socket
    first: the call raises redis' TimeoutError (and redis-py sends it
    again) instead of ReplicationTimeout.
    """
    if not wait_replicas:
        return
    timeout = _socket_timeout(client)
    if timeout is not None and timeout * 1000 <= wait_ms:
        raise InvalidArgument(
            f"{owner}: the client's socket_timeout ({timeout:g} s) is not above wait_timeout "
            f"({wait_ms / 1000:g} s): a WAIT that lasts its whole wait_timeout would time out in the socket. "
            f"Build the client with a socket_timeout above wait_timeout (leave a margin for the round trip), "
            f"or lower wait_timeout"
        )


def _cluster_kind(client: Any) -> str:
    """``"sync"`` / ``"async"`` for a redis-py cluster client, ``""`` for one server."""
    from redis.asyncio.cluster import RedisCluster as AsyncCluster
    from redis.cluster import RedisCluster

    if isinstance(client, RedisCluster):
        return "sync"
    if isinstance(client, AsyncCluster):
        return "async"
    return ""


def _one_connection(
    client: Any, asynchronous: bool, key: str, commands: list[tuple[Any, ...]]
) -> Steps[list[Any]]:
    """Send ``commands`` in order on one connection to the master of ``key``; their replies (errors included).

    WAIT counts the replicas that have every write made *on its own
    connection*, so the write and its WAIT must share one: a pipeline on a
    single-server client, or on the key's master in a cluster.
    """
    kind = _cluster_kind(client)
    if kind == "async":
        # redis.asyncio's cluster client has no per-node Redis client to open a
        # pipeline on: the node's own execute_pipeline (what its ClusterPipeline
        # uses) sends the commands on one of its connections.  Not public API:
        # tests/test_redis_failover.py exercises it with every redis-py upgrade.
        from redis.asyncio.cluster import PipelineCommand

        yield from step(client.initialize())
        node = client.get_node_from_key(key)  # the slot's master
        sent = [PipelineCommand(i, *command) for i, command in enumerate(commands)]
        try:
            yield from step(node.execute_pipeline(sent))
        except BaseException:
            with suppress(Exception):
                yield from step(node.disconnect())
            raise
        if any(_is_connection_error(c.result) for c in sent):
            with suppress(Exception):
                yield from step(node.disconnect())
        return [c.result for c in sent]
    target = client.get_redis_connection(client.get_node_from_key(key)) if kind == "sync" else client
    pipe = target.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    replies: list[Any] = yield from step(pipe.execute(raise_on_error=False))
    return replies


def _is_connection_error(reply: Any) -> bool:
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    return isinstance(reply, (RedisConnectionError, RedisTimeoutError))


def _moved(reply: Any) -> bool:
    """Whether ``reply`` (an error) says the key's slot is served elsewhere or not at all right now."""
    from redis.exceptions import AskError, ClusterDownError, MovedError, SlotNotCoveredError, TryAgainError

    moved = (AskError, ClusterDownError, MovedError, SlotNotCoveredError, TryAgainError)
    return isinstance(reply, moved) or _is_connection_error(reply)


def _write_and_wait(
    client: Any,
    asynchronous: bool,
    key: str,
    command: tuple[Any, ...],
    script: str | None,
    replicas: int,
    timeout_ms: int,
) -> Steps[tuple[Any, int]]:
    """Run ``command`` (a SET, or an EVALSHA of ``script``) and ``WAIT replicas ms`` on one connection.

    Returns the command's reply and how many replicas acknowledged.  On a
    cluster whose slot moved (failover, resharding) the slot map is reloaded
    and both are sent again, to the new master.
    """
    from redis.exceptions import NoScriptError

    cluster = bool(_cluster_kind(client))
    load = False
    attempt = 0
    while True:
        commands: list[tuple[Any, ...]] = [("SCRIPT", "LOAD", script)] if load and script is not None else []
        commands += [command, ("WAIT", replicas, timeout_ms)]
        try:
            replies = yield from _one_connection(client, asynchronous, key, commands)
        except Exception as error:
            if not (cluster and _moved(error)):
                raise
            replies = [error, error]
        reply, acknowledged = replies[-2], replies[-1]
        if isinstance(reply, NoScriptError) and not load:
            load = True
            continue
        if cluster and _moved(reply) and attempt + 1 < _CLUSTER_ATTEMPTS:
            attempt += 1
            # Let the cluster settle (a failover takes the node timeout), then reload its slot map.
            pause = min(1.0, 0.1 * 2**attempt)
            if asynchronous:
                yield from asyncio.sleep(pause).__await__()
            else:
                time.sleep(pause)
            with suppress(Exception):
                yield from step(client.nodes_manager.initialize())
            continue
        if isinstance(reply, BaseException):
            raise reply
        if isinstance(acknowledged, BaseException):
            raise acknowledged
        return reply, int(acknowledged)


def _not_durable(
    what: str, value: Any, acknowledged: int, replicas: int, timeout_ms: int
) -> ReplicationTimeout:
    return ReplicationTimeout(
        f"{what} on the Redis master, but only {acknowledged} of the {replicas} replicas asked for "
        f"(wait_replicas) confirmed it within {timeout_ms} ms: it is applied but not durable, and a failover "
        f"before it reaches a replica can lose it. The error's .value is the call's result; check the "
        f"replicas (INFO replication), lower wait_replicas or raise wait_timeout",
        value=value,
        acknowledged=acknowledged,
        wanted=replicas,
    )


# --------------------------------------------------------------------------
# One-time tokens
# --------------------------------------------------------------------------

_LIVE: Final = "live"
_USED: Final = "used"

#: Consume in one atomic step.  A live token becomes a tombstone that keeps
#: the key's remaining TTL (KEEPTTL, Redis >= 6.0), so a second consume is
#: REPEATED until the token would have expired anyway.  The tombstone names
#: the call that consumed it (``used:<call id>``): when that call's reply is
#: lost and the call runs again (redis-py retries on a dropped connection),
#: it finds its own id and is APPLIED again instead of REPEATED, so the only
#: caller that consumed the token is still told to do the work.  That rerun
#: writes the tombstone again (same value): with ``wait_replicas`` its WAIT
#: runs on a new connection, which only covers writes made on it, so the
#: rerun makes one, and a replica that has it has the first run's too.
_CONSUME_SCRIPT: Final = """
local v = redis.call('get', KEYS[1])
if not v then return 0 end
local mine = ARGV[2] .. ':' .. ARGV[3]
if v == ARGV[1] then
    redis.call('set', KEYS[1], mine, 'KEEPTTL')
    return 1
end
if v == mine then
    redis.call('set', KEYS[1], mine, 'KEEPTTL')
    return 1
end
return 2
"""

#: How many consumes whose outcome is unknown (the connection failed on the
#: way back) one RedisTokens object remembers, so that a second explicit
#: call for the same token recognises the first one's effect.
_PENDING_LIMIT: Final = 1024


def _call_id() -> str:
    """A fresh identity for one call, stored with its effect so that a retry of it recognises it."""
    return secrets.token_hex(16)


def _token_key(scope: str, digest: str) -> str:
    return f"stateguard:token:{scope}:{digest}"


def _consumed(digest: str, found: Any) -> Result:
    """The Result for the script's reply: 1 consumed now, 2 consumed before, 0 no such key."""
    found = int(found)
    if found == 1:
        return Result(Outcome.APPLIED, model=OneTimeToken, key=digest, state="consumed")
    if found == 2:
        return Result(Outcome.REPEATED, model=OneTimeToken, key=digest, state="consumed")
    return Result(Outcome.NOT_FOUND, model=OneTimeToken, key=digest, trigger="consume")


class _RedisTokens(_RedisClient):
    """:class:`RedisTokens` and :class:`AsyncRedisTokens`: everything but blocking or awaiting."""

    def __init__(
        self, client: Any, *, wait_replicas: int = 0, wait_timeout: float | timedelta = DEFAULT_WAIT_TIMEOUT
    ) -> None:
        self._check_client(client)
        self.wait_replicas, self._wait_ms = _check_wait(wait_replicas, wait_timeout)
        _check_socket_timeout(type(self).__name__, client, self.wait_replicas, self._wait_ms)
        self.client = client
        self._consume_script = client.register_script(_CONSUME_SCRIPT)
        # (caller, token key) -> the call id of a consume that raised (its reply may have been lost).
        self._pending: dict[tuple[Any, str], str] = {}

    @staticmethod
    def key(scope: str, token: str) -> str:
        """The Redis key of ``token`` in ``scope`` (the token itself never appears in it)::

        RedisTokens.key("reset-password:42", token)   # 'stateguard:token:reset-password:42:9f86...'
        """
        return _token_key(scope, token_digest(token))

    def _issue(self, scope: str, ttl: timedelta) -> Steps[str]:
        _kernel.check_text(scope, "scope", MAX_SCOPE)
        ttl_ms = _kernel.duration_ms(ttl, "ttl")
        while True:
            token = secrets.token_urlsafe(TOKEN_BYTES)
            # NX: a 256-bit collision will not happen, but if it did, the
            # existing token must not be revived or shortened: draw another.
            key = _token_key(scope, token_digest(token))
            if not self.wait_replicas:
                if (yield from self._call(self.client.set, key, _LIVE, px=ttl_ms, nx=True)):
                    return token
                continue
            stored, acknowledged = yield from _write_and_wait(
                self.client, self._asynchronous, key, ("SET", key, _LIVE, "PX", ttl_ms, "NX"), None,
                self.wait_replicas, self._wait_ms,
            )  # fmt: skip
            if stored:
                if acknowledged < self.wait_replicas:
                    raise _not_durable(
                        "the token was stored", token, acknowledged, self.wait_replicas, self._wait_ms
                    )
                return token

    def _consume(self, token: str, scope: str) -> Steps[Result]:
        _kernel.check_text(token, "token", MAX_KEY)
        _kernel.check_text(scope, "scope", MAX_SCOPE)
        digest = token_digest(token)
        key = _token_key(scope, digest)
        # A consume of this token through this object, by this caller (thread
        # or asyncio task), that raised may have run on the server: this call
        # goes on under its identity.  Another caller sharing the object (a
        # module-level RedisTokens) never inherits it: that caller did not
        # consume the token and must not be told APPLIED.
        pending = (_caller(), key)
        call = self._pending.pop(pending, None) or _call_id()
        acknowledged = self.wait_replicas
        try:
            if not self.wait_replicas:
                found = yield from self._call(self._consume_script, keys=[key], args=[_LIVE, _USED, call])
            else:
                found, acknowledged = yield from _write_and_wait(
                    self.client, self._asynchronous, key,
                    ("EVALSHA", self._consume_script.sha, 1, key, _LIVE, _USED, call), _CONSUME_SCRIPT,
                    self.wait_replicas, self._wait_ms,
                )  # fmt: skip
        except BaseException:
            if len(self._pending) >= _PENDING_LIMIT:
                with suppress(KeyError, RuntimeError, StopIteration):
                    del self._pending[next(iter(self._pending))]
            self._pending[pending] = call
            raise
        result = _consumed(digest, found)
        if result.outcome is Outcome.APPLIED and acknowledged < self.wait_replicas:
            # Only a consume that wrote (the tombstone) waits to be durable;
            # REPEATED and NOT_FOUND changed nothing.
            raise _not_durable(
                "the token was consumed", result, acknowledged, self.wait_replicas, self._wait_ms
            )
        return result


#: One marker object per thread: a thread's ident is reused once the thread has exited, and a new
#: thread must not inherit a dead one's pending consume.
_THREAD: Final = threading.local()


def _caller() -> Any:
    """Who is calling: the running asyncio task, else the thread (its own marker object)."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running event loop
        task = None
    if task is not None:
        return task
    marker = getattr(_THREAD, "marker", None)
    if marker is None:
        marker = _THREAD.marker = object()
    return marker


class RedisTokens(_RedisTokens):
    """One-time tokens in Redis: :meth:`issue` and :meth:`consume`, atomic on the server.

    ``client`` is a ``redis.Redis`` (or cluster) client; for a
    ``redis.asyncio`` client use :class:`AsyncRedisTokens`.  A token is
    stored under ``stateguard:token:<scope>:<sha256 of the token>`` with the
    TTL as the key's expiry; consuming runs one Lua script (never GET then
    DEL), so of any number of concurrent consumers exactly one gets APPLIED::

        tokens = RedisTokens(redis.Redis())
        token = tokens.issue(scope="reset-password:42", ttl=timedelta(minutes=30))
        ...
        r = tokens.consume(token, scope="reset-password:42")
        if r.applied:
            reset_password(42)

    Outcomes: APPLIED the first time; REPEATED afterwards while the
    tombstone lives (it keeps the token's remaining TTL); NOT_FOUND for an
    unknown token, a token of another scope, **and an expired token**: once
    Redis has expired the key, nothing tells an expired token from one that
    never existed, so Redis never answers REJECTED.  (The SQL
    :func:`~stateguard.consume_token` keeps expired rows until purged and
    says REJECTED.)  Unlike the SQL version, a consumption is not part of any
    database transaction: if the work after it fails, issue a new token.

    Lost replies: the tombstone names the consuming call, so a consume that
    redis-py retries after its reply was lost is still APPLIED.  With
    retries off it raises redis-py's ``ConnectionError``; call ``consume``
    again on the same object: it goes on under the failed call's identity.

    Replicas: Redis acknowledges a write before its replicas have it, so a
    failover can lose an issued token or bring a consumed one back.
    ``wait_replicas=N`` sends each issue and each consume with a Redis ``WAIT
    N wait_timeout`` on the same connection (on a ``redis.cluster.RedisCluster``,
    to the master of the token's slot; one round trip with the command, so a
    REPEATED or NOT_FOUND consume waits too, up to ``wait_timeout`` when
    fewer replicas answer) and raises :class:`~stateguard.ReplicationTimeout`
    when a write (an issue, an APPLIED consume) was confirmed by fewer than
    ``N`` replicas: the write happened on the master, ``error.value`` is the
    token or the Result::

        tokens = RedisTokens(redis.cluster.RedisCluster(host="redis-1"), wait_replicas=1)
        try:
            r = tokens.consume(token, scope="payout:42")
        except ReplicationTimeout as error:
            r = error.value      # consumed on the master, on no replica yet

    ``wait_replicas`` is an int from 0 to 2**31 - 1 (0, the default: no
    WAIT); ``wait_timeout`` (seconds or a timedelta, 1 ms to 1 hour, 1 s by
    default) bounds each WAIT and must be below the client's
    ``socket_timeout``.  A WAIT that fails itself (socket timeout, dropped
    connection) raises redis' error: an issue's token, if stored, went to
    nobody and expires with its ttl; a consume called again for the token
    by the same thread recognises its own earlier run.

    :raises InvalidArgument: ``client`` is not a synchronous redis client, a
        bad ``wait_replicas`` / ``wait_timeout``, or (with ``wait_replicas``)
        a client ``socket_timeout`` not above ``wait_timeout``.
    """

    def issue(self, *, scope: str, ttl: timedelta) -> str:
        """Create a token for ``scope`` that expires after ``ttl`` and return it (one SET)::

            token = tokens.issue(scope="checkout:cart-7", ttl=timedelta(minutes=10))

        :raises InvalidArgument: bad ``scope`` or a ``ttl`` under 1 ms.
        """
        with _watch("redis_token.issue", scope):
            return run_steps(self._issue(scope, ttl))

    def consume(self, token: str, *, scope: str) -> Result:
        """Consume ``token`` once: APPLIED, REPEATED, or NOT_FOUND (unknown *or* expired)::

            r = tokens.consume(form["token"], scope="checkout:cart-7")
            r.raise_for_outcome()     # NotFound for unknown or expired tokens

        :raises InvalidArgument: bad ``token`` or ``scope``; Redis was not called.
        """
        with _watch("redis_token.consume", scope) as box:
            box["outcome"] = (result := run_steps(self._consume(token, scope))).outcome.name
            return result


class AsyncRedisTokens(_RedisTokens):
    """:class:`RedisTokens` for a ``redis.asyncio`` client: the same keys, script and outcomes, awaited.

    Tokens issued by either class can be consumed by the other::

        tokens = AsyncRedisTokens(redis.asyncio.Redis())
        token = await tokens.issue(scope="reset-password:42", ttl=timedelta(minutes=30))
        ...
        r = await tokens.consume(token, scope="reset-password:42")
        if r.applied:
            await reset_password(42)

    Consuming is one script call, so any number of concurrent tasks (or
    processes) consuming one token get exactly one APPLIED.
    ``wait_replicas`` / ``wait_timeout`` work as in :class:`RedisTokens`
    (with a ``redis.asyncio.cluster.RedisCluster`` too)::

        tokens = AsyncRedisTokens(client, wait_replicas=1, wait_timeout=0.5)

    :raises InvalidArgument: ``client`` is not a ``redis.asyncio`` client, a
        bad ``wait_replicas`` / ``wait_timeout``, or (with ``wait_replicas``)
        a client ``socket_timeout`` not above ``wait_timeout``.
    """

    _asynchronous = True

    async def issue(self, *, scope: str, ttl: timedelta) -> str:
        """Create a token for ``scope`` that expires after ``ttl`` and return it (one SET)::

            token = await tokens.issue(scope="checkout:cart-7", ttl=timedelta(minutes=10))

        :raises InvalidArgument: bad ``scope`` or a ``ttl`` under 1 ms.
        """
        with _watch("redis_token.issue", scope):
            return await Awaited(self._issue(scope, ttl))

    async def consume(self, token: str, *, scope: str) -> Result:
        """Consume ``token`` once: APPLIED, REPEATED, or NOT_FOUND (unknown *or* expired)::

            r = await tokens.consume(form["token"], scope="checkout:cart-7")
            r.raise_for_outcome()     # NotFound for unknown or expired tokens

        :raises InvalidArgument: bad ``token`` or ``scope``; Redis was not called.
        """
        with _watch("redis_token.consume", scope) as box:
            box["outcome"] = (result := await Awaited(self._consume(token, scope))).outcome.name
            return result


# --------------------------------------------------------------------------
# Locks with fencing tokens
# --------------------------------------------------------------------------

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
    give_back, cancelled = await _run_uncut(lock.lua_fenced_release(**_release_call(lock, token)))
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

    def _database_fence(self) -> Any:
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
        """Whether this thread holds the lock right now (one ``GET``)::

        if not lock.owned():
            raise RuntimeError("lost the lock")
        """
        return run_steps(self._owned())

    def locked(self) -> bool:
        """Whether anyone holds the lock right now (one ``GET``)::

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
        """Whether this task holds the lock right now (one ``GET``)::

        if not await lock.owned():
            raise RuntimeError("lost the lock")
        """
        return await Awaited(self._owned())

    async def locked(self) -> bool:
        """Whether anyone holds the lock right now (one ``GET``)::

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


# --------------------------------------------------------------------------
# Outbox sink: a Redis stream
# --------------------------------------------------------------------------


class RedisStreamSink:
    """An outbox :class:`~stateguard.outbox.Sink`: each event is appended to a Redis stream.

    One ``XADD`` per event, the whole batch in one pipeline (one round
    trip).  The entry's fields are ``id`` (the outbox event id, as text),
    ``topic``, ``key`` (empty for an event without a key: a real key is
    never blank) and ``payload`` (JSON text).  A relay may publish an event
    twice (at least once), so a consumer deduplicates by ``id``::

        relay = Relay(engine, RedisStreamSink(redis.Redis(), stream="orders", maxlen=1_000_000))

        for _, entries in r.xread({"orders": last}, block=5000):
            for entry_id, fields in entries:
                with Session(engine) as session, session.begin():
                    if consume_once(session, "billing", fields[b"id"].decode()).applied:
                        bill(session, json.loads(fields[b"payload"]))

    ``maxlen`` trims the stream (``MAXLEN ~``, approximate unless
    ``approximate=False``); an event trimmed before a consumer read it is
    lost for that consumer, so size it for the slowest one.  With a
    ``redis.asyncio`` client, :meth:`publish` returns an awaitable: use it
    with :class:`~stateguard.outbox.AsyncRelay`.

    :raises InvalidArgument: no redis client, a blank or oversize
        ``stream``, a ``maxlen`` that is not an int from 1 to
        :data:`MAX_MAXLEN`.
    """

    __slots__ = ("approximate", "client", "maxlen", "stream")

    def __init__(
        self, client: Any, *, stream: str, maxlen: int | None = None, approximate: bool = True
    ) -> None:
        if client is None or not callable(getattr(client, "pipeline", None)):
            raise InvalidArgument(
                f"RedisStreamSink needs a redis client (redis.Redis or redis.asyncio), got {client!r}"
            )
        self.client = client
        self.stream = _kernel.check_text(stream, "stream", MAX_KEY)
        if maxlen is not None and (type(maxlen) is not int or not 1 <= maxlen <= MAX_MAXLEN):
            # Redis refuses a larger MAXLEN on every XADD ("value is not an integer or out of
            # range"): the relay would retry forever and publish nothing.
            raise InvalidArgument(
                f"maxlen must be an int from 1 to {MAX_MAXLEN} (what Redis's XADD MAXLEN takes) "
                f"or None, got {maxlen!r}"
            )
        self.maxlen = maxlen
        self.approximate = bool(approximate)

    def publish(self, events: Sequence[OutboxEvent]) -> Any:
        """XADD every event, in order, in one pipeline; the pipeline's reply (awaitable for an async client).

        A failed XADD raises (redis-py raises the first error of a pipeline):
        the relay then counts none of the batch as published.
        """
        pipe = self.client.pipeline(transaction=False)
        for event in events:
            fields = {
                "id": str(event.id),
                "topic": event.topic,
                "key": event.key or "",
                "payload": event.payload_json(),
            }
            pipe.xadd(self.stream, fields, maxlen=self.maxlen, approximate=self.approximate)
        return pipe.execute()
