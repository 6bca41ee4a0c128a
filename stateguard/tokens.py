"""One-time tokens (SCHEMES.md, scheme 6): issued with an expiry, consumed once.

The server hands out an unguessable token (a form's hidden field, an e-mail
link, a payment confirmation step); the client sends it back; one
conditional statement consumes it::

    UPDATE stateguard_tokens SET consumed_ms = :now
    WHERE token_hash = :h AND scope = :scope AND consumed_ms IS NULL AND expires_ms > :now

One row: APPLIED.  No row: one read says why: consumed already → REPEATED,
expired → REJECTED, unknown or of another scope → NOT_FOUND.  Concurrent
consumers of one token serialise on its row: PostgreSQL re-checks the WHERE
of a waiting UPDATE at READ COMMITTED against the committed row, InnoDB's
UPDATE reads the latest committed row, and SQLite has a single writer, so
exactly one of them sees ``consumed_ms IS NULL``.

Only a SHA-256 of the token is stored, so a leaked table (or backup) does
not leak usable tokens.  Consuming is not deleting: a consumed token stays
until it expires and :func:`purge_expired_tokens` removes it, so a replay is
told apart (REPEATED) from a forgery (NOT_FOUND).

:class:`RedisTokens` (and :class:`AsyncRedisTokens`, for ``redis.asyncio``)
do the same in Redis with one Lua script per consume.
"""

from __future__ import annotations

import hashlib
import inspect
import secrets
from datetime import timedelta
from typing import Any, ClassVar, Final

from sqlalchemy import Connection, Engine, bindparam, insert, select, update
from sqlalchemy.orm import Session

from . import _sql, _write
from ._async import dual
from .exceptions import InvalidArgument, SerializationConflict
from .result import Outcome, Result
from .tables import MAX_KEY, MAX_SCOPE, tokens

__all__ = [
    "AsyncRedisTokens",
    "OneTimeToken",
    "RedisTokens",
    "consume_token",
    "issue_token",
    "purge_expired_tokens",
]

#: Bytes of randomness in an issued token (256 bits; ``token_urlsafe`` makes 43 characters).
TOKEN_BYTES: Final = 32


class OneTimeToken:
    """The ``model`` of every token :class:`~stateguard.Result`.

    A token result's ``key`` is the SHA-256 (hex) of the token, never the
    token itself (results end up in logs and error messages); ``state`` is
    ``"consumed"``, ``"expired"`` or ``None`` (not found).
    """


def _now_ms() -> int:
    """The application's clock in integer epoch milliseconds (tests replace it)."""
    return _write.now_ms()


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _check_scope(scope: Any) -> str:
    return _write.check_text(scope, "scope", MAX_SCOPE)


def _check_token(token: Any) -> str:
    return _write.check_text(token, "token", MAX_KEY)


# --------------------------------------------------------------------------
# SQL
# --------------------------------------------------------------------------

# Built once; every value is a bound parameter, so SQLAlchemy's compiled cache
# serves each dialect after the first call.
_ISSUE: Final = insert(tokens).values(
    token_hash=bindparam("sg_hash"),
    scope=bindparam("sg_scope"),
    expires_ms=bindparam("sg_expires"),
    created_ms=bindparam("sg_now"),
)
_CONSUME: Final = (
    update(tokens)
    .where(
        tokens.c.token_hash == bindparam("sg_hash"),
        tokens.c.scope == bindparam("sg_scope"),
        tokens.c.consumed_ms.is_(None),
        tokens.c.expires_ms > bindparam("sg_now"),
    )
    .values(consumed_ms=bindparam("sg_now"))
)
_FIND: Final = select(tokens.c.consumed_ms, tokens.c.expires_ms).where(
    tokens.c.token_hash == bindparam("sg_hash"), tokens.c.scope == bindparam("sg_scope")
)
# InnoDB at REPEATABLE READ: a plain SELECT reads the transaction's snapshot,
# which may predate the consumption that made our UPDATE match nothing; a
# locking read sees the latest committed row, as the UPDATE did.
_FIND_LOCKING: Final = _FIND.with_for_update()


@dual
def issue_token(session: Session, *, scope: str, ttl: timedelta) -> str:
    """Create a one-time token for ``scope`` that expires after ``ttl``, and return it.

    The token (43 URL-safe characters, 256 random bits from :mod:`secrets`)
    is returned once and never stored: the table keeps its SHA-256.  The row
    is inserted in the session's transaction, so it exists once the caller
    commits::

        token = issue_token(session, scope=f"confirm-payment:{user.id}", ttl=timedelta(minutes=15))
        session.commit()
        send_link(user, token)

    :raises InvalidArgument: blank, oversize or non-str ``scope``, or a
        ``ttl`` under 1 ms; nothing was written.
    """
    _check_scope(scope)
    ttl_ms = _write.duration_ms(ttl, "ttl")
    token = secrets.token_urlsafe(TOKEN_BYTES)
    now = _now_ms()
    conn = session.connection()
    _write.execute(
        conn, _ISSUE, {"sg_hash": _hash(token), "sg_scope": scope, "sg_expires": now + ttl_ms, "sg_now": now}
    )
    return token


@dual
def consume_token(session: Session, token: str, *, scope: str) -> Result:
    """Consume ``token`` once: one conditional UPDATE in the session's transaction.

    - APPLIED: this call consumed it (do the work; ``on_commit`` callbacks run
      only for this outcome);
    - REPEATED: it was consumed before (a retry or a double submit);
    - REJECTED: it expired unused;
    - NOT_FOUND: no such token in ``scope`` (unknown, forged, purged, or
      issued for another scope).

    The consumption commits or rolls back with the caller's transaction: if
    the work fails and the transaction rolls back, the token is usable
    again.  ``raise_for_outcome()`` raises ``TransitionRejected`` for
    REJECTED and ``NotFound`` for NOT_FOUND::

        r = consume_token(session, form["token"], scope=f"confirm-payment:{user.id}")
        if r.outcome is Outcome.REPEATED:
            return already_done()
        r.raise_for_outcome()
        charge(...)

    :raises InvalidArgument: non-str, blank, oversize or NUL-containing
        ``token`` or ``scope``; nothing was sent to the database.
    """
    _check_token(token)
    _check_scope(scope)
    digest = _hash(token)
    params = {"sg_hash": digest, "sg_scope": scope, "sg_now": _now_ms()}
    if session.autoflush:
        session.flush()
    conn = session.connection()
    if _write.execute(conn, _CONSUME, params).rowcount == 1:
        return Result(Outcome.APPLIED, model=OneTimeToken, key=digest, state="consumed", session=session)
    backend = _sql.backend(conn.dialect)
    row = _write.execute(conn, _FIND_LOCKING if backend.locking_read else _FIND, params).first()
    if row is None:
        return Result(Outcome.NOT_FOUND, model=OneTimeToken, key=digest, trigger="consume", session=session)
    if row.consumed_ms is not None:
        return Result(
            Outcome.REPEATED, model=OneTimeToken, key=digest, state="consumed", value=row.consumed_ms
        )
    if row.expires_ms <= params["sg_now"]:
        return Result(
            Outcome.REJECTED,
            model=OneTimeToken,
            key=digest,
            trigger="consume",
            state="expired",
            value=row.expires_ms,
        )
    # Live and unconsumed, yet the UPDATE matched nothing: only a snapshot
    # older than the row (PostgreSQL REPEATABLE READ) can show this.
    raise SerializationConflict(  # pragma: no cover - needs a snapshot taken between two statements
        "the token's row changed while consume_token() read it; roll back and retry "
        "(retry_on_conflict() does this)"
    )


@dual
def purge_expired_tokens(bind: Engine | Connection | Session, *, batch: int = 1000) -> int:
    """Delete at most ``batch`` expired tokens and return how many were deleted.

    Consumed tokens stay until they expire (they make a replay REPEATED);
    expired ones answer REJECTED until purged and NOT_FOUND after.  With an
    :class:`~sqlalchemy.Engine` the batch runs in its own short transaction;
    with a ``Connection`` or ``Session`` it runs in the caller's, which the
    caller commits.  Call it in a loop (``stateguard purge`` does) until it
    returns less than ``batch``::

        while purge_expired_tokens(engine, batch=1000) == 1000:
            time.sleep(0.1)

    :raises InvalidArgument: ``batch`` is not a positive int.
    """
    return _write.purge_expired_rows(tokens, bind, batch, _now_ms)


# --------------------------------------------------------------------------
# Redis
# --------------------------------------------------------------------------

_LIVE: Final = "live"
_USED: Final = "used"

#: Consume in one atomic step.  A live token becomes a tombstone that keeps
#: the key's remaining TTL (KEEPTTL, Redis >= 6.0), so a second consume is
#: REPEATED until the token would have expired anyway.
_CONSUME_SCRIPT: Final = """
local v = redis.call('get', KEYS[1])
if not v then return 0 end
if v == ARGV[1] then
    redis.call('set', KEYS[1], ARGV[2], 'KEEPTTL')
    return 1
end
return 2
"""


def _redis_key(scope: str, digest: str) -> str:
    return f"stateguard:token:{scope}:{digest}"


def _check_redis_client(client: Any, owner: str, *, asynchronous: bool) -> None:
    """Refuse anything but a redis-py client of the kind ``owner`` drives (shared with the locks).

    A redis.asyncio client handed to a synchronous class would return
    coroutines that are never awaited (a token "issued" but never stored);
    a synchronous one handed to an async class fails on the first ``await``.
    Both are caught here, before anything is sent.
    """
    wanted = "redis.asyncio.Redis" if asynchronous else "redis.Redis"
    if client is None or not callable(getattr(client, "register_script", None)):
        raise InvalidArgument(f"{owner} needs a redis client ({wanted}), got {client!r}")
    if inspect.iscoroutinefunction(getattr(client, "execute_command", None)) is not asynchronous:
        other = owner.removeprefix("Async") if asynchronous else f"Async{owner}"
        raise InvalidArgument(
            f"{owner} needs a {'redis.asyncio' if asynchronous else 'synchronous'} client ({wanted}), "
            f"got {client!r}; use {other} with this client"
        )


class _RedisTokensBase:
    """Everything :class:`RedisTokens` and :class:`AsyncRedisTokens` share; they only add the I/O."""

    #: Whether the client's commands return awaitables (redis.asyncio).
    _asynchronous: ClassVar[bool] = False

    def __init__(self, client: Any) -> None:
        _check_redis_client(client, type(self).__name__, asynchronous=self._asynchronous)
        self.client = client
        self._consume = client.register_script(_CONSUME_SCRIPT)

    @staticmethod
    def key(scope: str, token: str) -> str:
        """The Redis key of ``token`` in ``scope`` (the token itself never appears in it)::

        RedisTokens.key("reset-password:42", token)   # 'stateguard:token:reset-password:42:9f86...'
        """
        return _redis_key(scope, _hash(token))

    @staticmethod
    def _ttl_ms(scope: str, ttl: timedelta) -> int:
        """Check :meth:`issue`'s arguments and return the TTL in milliseconds."""
        _check_scope(scope)
        return _write.duration_ms(ttl, "ttl")

    @staticmethod
    def _new_token(scope: str, ttl_ms: int) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        """A fresh token and the arguments of the ``SET`` that stores it.

        NX: a 256-bit collision will not happen, but if it did, the existing
        token must not be revived or shortened; the caller draws another.
        """
        token = secrets.token_urlsafe(TOKEN_BYTES)
        return token, (_redis_key(scope, _hash(token)), _LIVE), {"px": ttl_ms, "nx": True}

    @staticmethod
    def _consume_call(token: str, scope: str) -> tuple[str, dict[str, Any]]:
        """Check :meth:`consume`'s arguments; return the digest and the script's keys and args."""
        _check_token(token)
        _check_scope(scope)
        digest = _hash(token)
        return digest, {"keys": [_redis_key(scope, digest)], "args": [_LIVE, _USED]}

    @staticmethod
    def _outcome(digest: str, found: Any) -> Result:
        """The Result for the script's reply: 1 consumed now, 2 consumed before, 0 no such key."""
        found = int(found)
        if found == 1:
            return Result(Outcome.APPLIED, model=OneTimeToken, key=digest, state="consumed")
        if found == 2:
            return Result(Outcome.REPEATED, model=OneTimeToken, key=digest, state="consumed")
        return Result(Outcome.NOT_FOUND, model=OneTimeToken, key=digest, trigger="consume")


class RedisTokens(_RedisTokensBase):
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
    :func:`consume_token` keeps expired rows until purged and says
    REJECTED.)  Unlike the SQL version, a consumption is not part of any
    database transaction: if the work after it fails, issue a new token.

    :raises InvalidArgument: ``client`` is not a synchronous redis client.
    """

    def issue(self, *, scope: str, ttl: timedelta) -> str:
        """Create a token for ``scope`` that expires after ``ttl`` and return it (one SET)::

            token = tokens.issue(scope="checkout:cart-7", ttl=timedelta(minutes=10))

        :raises InvalidArgument: bad ``scope`` or a ``ttl`` under 1 ms.
        """
        ttl_ms = self._ttl_ms(scope, ttl)
        while True:
            token, args, options = self._new_token(scope, ttl_ms)
            if self.client.set(*args, **options):
                return token

    def consume(self, token: str, *, scope: str) -> Result:
        """Consume ``token`` once: APPLIED, REPEATED, or NOT_FOUND (unknown *or* expired)::

            r = tokens.consume(form["token"], scope="checkout:cart-7")
            r.raise_for_outcome()     # NotFound for unknown or expired tokens

        :raises InvalidArgument: bad ``token`` or ``scope``; Redis was not called.
        """
        digest, call = self._consume_call(token, scope)
        return self._outcome(digest, self._consume(**call))


class AsyncRedisTokens(_RedisTokensBase):
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

    :raises InvalidArgument: ``client`` is not a ``redis.asyncio`` client.
    """

    _asynchronous = True

    async def issue(self, *, scope: str, ttl: timedelta) -> str:
        """Create a token for ``scope`` that expires after ``ttl`` and return it (one SET)::

            token = await tokens.issue(scope="checkout:cart-7", ttl=timedelta(minutes=10))

        :raises InvalidArgument: bad ``scope`` or a ``ttl`` under 1 ms.
        """
        ttl_ms = self._ttl_ms(scope, ttl)
        while True:
            token, args, options = self._new_token(scope, ttl_ms)
            if await self.client.set(*args, **options):
                return token

    async def consume(self, token: str, *, scope: str) -> Result:
        """Consume ``token`` once: APPLIED, REPEATED, or NOT_FOUND (unknown *or* expired)::

            r = await tokens.consume(form["token"], scope="checkout:cart-7")
            r.raise_for_outcome()     # NotFound for unknown or expired tokens

        :raises InvalidArgument: bad ``token`` or ``scope``; Redis was not called.
        """
        digest, call = self._consume_call(token, scope)
        return self._outcome(digest, await self._consume(**call))
