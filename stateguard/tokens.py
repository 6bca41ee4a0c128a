"""One-time tokens: issued with an expiry, consumed once.

The server hands out an unguessable token (a form's hidden field, an e-mail
link, a payment confirmation step); the client sends it back; one
conditional statement consumes it::

    UPDATE stateguard_tokens SET consumed_ms = db_now
    WHERE token_hash = :h AND scope = :scope AND consumed_ms IS NULL AND expires_ms > db_now

``db_now`` is the database's clock (:func:`stateguard._kernel.db_now_ms`), never
the application's.  One row: APPLIED.  No row: one read says why: consumed
already → REPEATED, expired → REJECTED, unknown or of another scope →
NOT_FOUND.  Concurrent consumers serialise on the token's row, so exactly
one of them sees ``consumed_ms IS NULL``.  Only a SHA-256 of the token is
stored, and consuming is not deleting (a replay is told apart from a
forgery until :func:`purge_expired_tokens` removes the row).
:class:`~stateguard.RedisTokens` does the same in Redis
(:mod:`stateguard.redis`).  See ``docs/explanation/schemes.md``.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta
from typing import Any, Final, Literal
from uuid import UUID

from sqlalchemy import Connection, Engine, bindparam, insert, select, update
from sqlalchemy.orm import Session

from . import _compat, _kernel
from ._async import dual, dual_bind
from .exceptions import SerializationConflict
from .result import Outcome, Result
from .tables import MAX_KEY, MAX_REQUEST_ID, MAX_SCOPE, tokens

__all__ = [
    "TOKEN_BYTES",
    "OneTimeToken",
    "consume_token",
    "issue_token",
    "purge_expired_tokens",
    "token_digest",
]

#: Bytes of randomness in an issued token (256 bits; ``token_urlsafe`` makes 43 characters).
TOKEN_BYTES: Final = 32


class OneTimeToken:
    """The ``model`` of every token :class:`~stateguard.Result`.

    A token result's ``key`` is the SHA-256 (hex) of the token, never the
    token itself (results end up in logs and error messages); ``state`` is
    ``"consumed"``, ``"expired"`` or ``None`` (not found).
    """


def token_digest(token: str) -> str:
    """The SHA-256 (hex) of ``token``: what is stored instead of it, and every token Result's ``key``.

    The database table and :class:`~stateguard.RedisTokens` both keep only
    this digest, so a leaked table or Redis dump leaks no usable token::

        token_digest("abc")   # 'ba7816bf8f01cfea...'
    """
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _check_scope(scope: Any) -> str:
    return _kernel.check_text(scope, "scope", MAX_SCOPE)


def _check_token(token: Any) -> str:
    return _kernel.check_text(token, "token", MAX_KEY)


# --------------------------------------------------------------------------
# SQL
# --------------------------------------------------------------------------

# Built once; every value is a bound parameter, so SQLAlchemy's compiled cache
# serves each dialect after the first call.  Expiry is stored and judged on the
# database's clock inside each statement: an application server whose clock
# runs ahead must not reject live tokens (nor one running behind accept
# expired ones).
_NOW: Final = _kernel.db_now_ms()
_ISSUE: Final = insert(tokens).values(
    token_hash=bindparam("sg_hash"),
    scope=bindparam("sg_scope"),
    expires_ms=_NOW + bindparam("sg_ttl"),
    created_ms=_NOW,
)
_CONSUME: Final = (
    update(tokens)
    .where(
        tokens.c.token_hash == bindparam("sg_hash"),
        tokens.c.scope == bindparam("sg_scope"),
        tokens.c.consumed_ms.is_(None),
        tokens.c.expires_ms > _NOW,
    )
    .values(consumed_ms=_NOW, consumed_by=bindparam("sg_by"))
)
_FIND: Final = select(
    tokens.c.consumed_ms, tokens.c.expires_ms, tokens.c.consumed_by, _NOW.label("db_now")
).where(tokens.c.token_hash == bindparam("sg_hash"), tokens.c.scope == bindparam("sg_scope"))
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

    The expiry is the database's clock at the INSERT plus ``ttl``, and
    :func:`consume_token` judges it on the database's clock too, so
    application servers whose clocks disagree agree on every token.

    :raises InvalidArgument: blank, oversize or non-str ``scope``, or a
        ``ttl`` under 1 ms; nothing was written.
    """
    _check_scope(scope)
    ttl_ms = _kernel.duration_ms(ttl, "ttl")
    token = secrets.token_urlsafe(TOKEN_BYTES)
    conn = _kernel.own_connection(session, tokens)
    params = {"sg_hash": token_digest(token), "sg_scope": scope, "sg_ttl": ttl_ms}
    _kernel.execute(conn, _ISSUE, params)
    return token


@dual
def consume_token(
    session: Session,
    token: str,
    *,
    scope: str,
    request_id: str | UUID | None = None,
    durability: Literal["replicated", "local"] | None = None,
) -> Result:
    """Consume ``token`` once: one conditional UPDATE in the session's transaction.

    - APPLIED: this call consumed it (do the work; ``on_commit`` callbacks run
      only for this outcome);
    - REPEATED: it was consumed before (a retry or a double submit);
      ``same_request`` is ``True`` when it was consumed by a call with this
      ``request_id`` (a retry after a lost COMMIT: the first attempt
      committed, its work is done);
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

    ``durability="replicated"`` (PostgreSQL with a synchronous standby): the
    transaction commits only once the standby applied it, and a COMMIT the
    standby did not confirm raises :class:`~stateguard.ReplicationTimeout`
    (see :func:`~stateguard.set_durability`, the engine-wide default;
    ``"local"`` opts this call out of it).

    :raises InvalidArgument: non-str, blank, oversize or NUL-containing
        ``token``, ``scope`` or ``request_id``; nothing was sent to the database.
    :raises NotSupported: ``durability="replicated"`` on a database or driver
        that cannot confirm it (SQLite, MariaDB, a driver other than psycopg).
    :raises ConfigurationError: ``durability="replicated"`` on a PostgreSQL with
        no synchronous standby; nothing was written.
    """
    _check_token(token)
    _check_scope(scope)
    if type(request_id) is UUID:
        request_id = str(request_id)  # new_request_id()'s UUID, stored as its canonical text
    if request_id is not None:
        _kernel.check_text(request_id, "request_id", MAX_REQUEST_ID)
    digest = token_digest(token)
    params = {"sg_hash": digest, "sg_scope": scope, "sg_by": request_id}
    if session.autoflush:
        session.flush()
    conn = _kernel.own_connection(session, tokens)
    watch = _kernel.durable(session, conn, durability) if durability is not None or _kernel.DURABLE else None
    if _kernel.execute(conn, _CONSUME, params).rowcount == 1:
        result = Result(Outcome.APPLIED, model=OneTimeToken, key=digest, state="consumed", session=session)
        return result if watch is None else watch.note(result)
    backend = _kernel.backend(conn.dialect)
    row = _kernel.execute(conn, _FIND_LOCKING if backend.fresh_read_needs_lock else _FIND, params).first()
    if row is None:
        result = Result(Outcome.NOT_FOUND, model=OneTimeToken, key=digest, trigger="consume", session=session)
    elif row.consumed_ms is not None:
        result = Result(
            Outcome.REPEATED,
            model=OneTimeToken,
            key=digest,
            state="consumed",
            value=row.consumed_ms,
            same_request=request_id is not None and row.consumed_by == request_id,
        )
    elif row.expires_ms <= row.db_now:
        result = Result(
            Outcome.REJECTED,
            model=OneTimeToken,
            key=digest,
            trigger="consume",
            state="expired",
            value=row.expires_ms,
        )
    else:
        # Live and unconsumed, yet the UPDATE matched nothing: only a snapshot
        # older than the row (PostgreSQL REPEATABLE READ) can show this.
        raise SerializationConflict(  # pragma: no cover - needs a snapshot taken between two statements
            "the token's row changed while consume_token() read it; roll back and retry "
            "(retry_on_conflict() does this)"
        )
    return result if watch is None else watch.note(result)


@dual_bind
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
    return _kernel.purge_rows(tokens, bind, batch)


#: Names this module defined before the 0.2 layout, and where they live now.
_MOVED: Final = {"RedisTokens": "stateguard.redis", "AsyncRedisTokens": "stateguard.redis"}


def __getattr__(name: str) -> Any:
    return _compat.moved(__name__, name, _MOVED)
