"""One-time tokens in Redis: :class:`RedisTokens` and :class:`AsyncRedisTokens`.

A token is stored under ``stateguard:token:<scope>:<sha256 of the token>``
with its TTL as the key's expiry; consuming runs one Lua script that turns a
live token into a tombstone naming the consuming call, so exactly one of
any number of concurrent consumers gets APPLIED and a retry whose reply was
lost recognises its own consume.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from contextlib import suppress
from datetime import timedelta
from typing import Any, Final

from .. import _kernel
from .._async import Awaited, Steps, run_steps
from ..result import Outcome, Result
from ..tables import MAX_KEY, MAX_SCOPE
from ..tokens import TOKEN_BYTES, OneTimeToken, token_digest
from .client import (
    DEFAULT_WAIT_TIMEOUT,
    _call_id,
    _check_socket_timeout,
    _check_wait,
    _not_durable,
    _RedisClient,
    _watch,
    _write_and_wait,
)

__all__ = ["AsyncRedisTokens", "RedisTokens"]


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
        """The Redis key of ``token`` in ``scope`` (the token itself never appears in it).

        For example::

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


def _caller() -> object:
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
        """Create a token for ``scope`` that expires after ``ttl`` and return it (one SET).

        For example::

                token = tokens.issue(scope="checkout:cart-7", ttl=timedelta(minutes=10))

            :raises InvalidArgument: bad ``scope`` or a ``ttl`` under 1 ms.
        """
        with _watch("redis_token.issue", scope):
            return run_steps(self._issue(scope, ttl))

    def consume(self, token: str, *, scope: str) -> Result:
        """Consume ``token`` once: APPLIED, REPEATED, or NOT_FOUND (unknown *or* expired).

        For example::

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
        """Create a token for ``scope`` that expires after ``ttl`` and return it (one SET).

        For example::

                token = await tokens.issue(scope="checkout:cart-7", ttl=timedelta(minutes=10))

            :raises InvalidArgument: bad ``scope`` or a ``ttl`` under 1 ms.
        """
        with _watch("redis_token.issue", scope):
            return await Awaited(self._issue(scope, ttl))

    async def consume(self, token: str, *, scope: str) -> Result:
        """Consume ``token`` once: APPLIED, REPEATED, or NOT_FOUND (unknown *or* expired).

        For example::

                r = await tokens.consume(form["token"], scope="checkout:cart-7")
                r.raise_for_outcome()     # NotFound for unknown or expired tokens

            :raises InvalidArgument: bad ``token`` or ``scope``; Redis was not called.
        """
        with _watch("redis_token.consume", scope) as box:
            box["outcome"] = (result := await Awaited(self._consume(token, scope))).outcome.name
            return result
