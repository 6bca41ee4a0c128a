"""The public faces of idempotency keys: :func:`idempotent`, :func:`idempotent_function` and the purge.

Each face checks its arguments into an
:class:`~stateguard.idempotency.options.IdempotencyOptions` before anything
is written and hands the key to one :class:`~stateguard.idempotency.claim.Claim`;
:func:`idempotent_with` is the same entry for a face that holds its options
already (the HTTP middleware).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from .. import _kernel
from .._async import AsyncSession, DualContext, dual_bind
from ..exceptions import InvalidArgument
from ..tables import MAX_KEY, MAX_SCOPE, idempotency_keys
from .call import IdempotentCall
from .claim import Claim
from .options import DEFAULT_LEASE, DEFAULT_MODE, DEFAULT_TTL, IdempotencyOptions, Mode, options_of
from .serialization import Serializer, fingerprint_of

__all__ = ["idempotent", "idempotent_function", "idempotent_with", "purge_expired"]

R = TypeVar("R")
P = ParamSpec("P")
SessionT = TypeVar("SessionT", bound="Session | AsyncSession")


def idempotent_with(
    session: SessionT, options: IdempotencyOptions, *, scope: str, key: str, fingerprint: Any = None
) -> DualContext[IdempotentCall[SessionT]]:
    """:func:`idempotent` with its options already checked (an :class:`IdempotencyOptions`)::

        options = IdempotencyOptions(lease=timedelta(minutes=5), mode="separate")
        with idempotent_with(session, options, scope="webhooks", key=delivery_id) as call:
            ...

    :raises InvalidArgument: a bad ``scope``, ``key`` or ``fingerprint`` (nothing written).
    :raises NotSupported: ``heartbeat_every`` with an AsyncSession.
    """
    _kernel.check_text(scope, "scope", MAX_SCOPE)
    _kernel.check_text(key, "idempotency key", MAX_KEY)
    return Claim(session, scope, key, options, fingerprint_of(fingerprint))


def idempotent(
    session: SessionT,
    *,
    scope: str,
    key: str,
    fingerprint: Any = None,
    lease: timedelta = DEFAULT_LEASE,
    ttl: timedelta = DEFAULT_TTL,
    mode: Mode = DEFAULT_MODE,
    serializer: Serializer | None = None,
    heartbeat_every: timedelta | None = None,
    non_retryable: tuple[type[BaseException], ...] = (),
) -> DualContext[IdempotentCall[SessionT]]:
    """Run a block at most once per ``(scope, key)``; replay its stored response to retries.

    ::

        with idempotent(session, scope=f"payments:{client_id}", key=key, fingerprint=body) as call:
            if call.replayed:
                return call.response
            payment = Payment(amount=body["amount"]); session.add(payment); session.flush()
            return call.complete({"payment_id": payment.id})

    :param scope: a namespace for keys (put the client identity in it: keys
        are chosen by clients and must not collide across them); at most
        200 characters.
    :param key: the idempotency key, compared byte-exact, stored as given;
        at most 255 characters, not blank.
    :param fingerprint: the request (any JSON-serialisable value, or bytes);
        only its SHA-256 is stored.  The same key with another fingerprint
        raises :class:`~stateguard.IdempotencyKeyReused`.  ``None`` skips
        the check.
    :param lease: how long a claim is held before another caller may take it
        over (separate mode).
    :param ttl: how long the key and its response are kept: from completion
        (same transaction: from the claim, which commits with the completion).
    :param mode: ``"same_transaction"`` (the claim, the block's writes and the
        response commit together; an exception frees the key) or
        ``"separate"`` (the claim commits first; for outside side effects).
    :param serializer: stores responses and checkpoint data (JSON by default).
    :param heartbeat_every: separate mode: extend the lease from a background
        thread this often (shorter than ``lease``).
    :param non_retryable: separate mode: exception classes that mark the key
        failed for good (retries get :class:`~stateguard.RequestFailed`);
        any other exception releases the key for a retry.

    With an :class:`~sqlalchemy.ext.asyncio.AsyncSession`, use ``async with``;
    the call's methods are then awaited, and a task cancelled inside the
    block frees the key like an exception does.

    :raises InvalidArgument: bad arguments (nothing written).
    :raises RequestInProgress: on entering, another caller holds a live lease.
    :raises IdempotencyKeyReused: on entering, the key was used for another request.
    :raises RequestFailed: on entering, the key's request failed for good.
    """
    _kernel.check_text(scope, "scope", MAX_SCOPE)
    _kernel.check_text(key, "idempotency key", MAX_KEY)
    options = options_of(lease, ttl, mode, serializer, heartbeat_every, non_retryable)
    return Claim(session, scope, key, options, fingerprint_of(fingerprint))


def idempotent_function(
    *,
    scope: str | Callable[..., str],
    key: Callable[..., str],
    fingerprint: Callable[..., Any] | None = None,
    lease: timedelta = DEFAULT_LEASE,
    ttl: timedelta = DEFAULT_TTL,
    mode: Mode = DEFAULT_MODE,
    serializer: Serializer | None = None,
    heartbeat_every: timedelta | None = None,
    non_retryable: tuple[type[BaseException], ...] = (),
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a function whose first positional argument is the session: it runs once per key.

    ``key`` (and ``scope`` and ``fingerprint`` when callables) receive the
    function's own arguments.  The return value is stored as the response and
    returned to every replay (through the serializer)::

        @idempotent_function(scope="refunds", key=lambda session, refund_id, amount: refund_id,
                             fingerprint=lambda session, refund_id, amount: {"amount": amount})
        def refund(session: Session, refund_id: str, amount: int) -> dict:
            ...
            return {"refunded": amount}

    Options are those of :func:`idempotent`; they are checked when decorating.
    An ``async def`` function takes an AsyncSession and is awaited the same way.
    """
    if not callable(scope):
        _kernel.check_text(scope, "scope", MAX_SCOPE)
    options_of(lease, ttl, mode, serializer, heartbeat_every, non_retryable)
    if not callable(key):
        raise InvalidArgument(
            "key must be a callable that receives the function's arguments and returns the key"
        )

    def manager_for(
        fn: Callable[..., Any], session_type: type, args: Any, kwargs: Any
    ) -> DualContext[IdempotentCall[Any]]:
        if not args or not isinstance(args[0], session_type):
            raise InvalidArgument(
                f"{fn.__qualname__}() is @idempotent_function: its first positional argument must be "
                f"the {session_type.__name__}"
            )
        return idempotent(
            args[0],
            scope=scope(*args, **kwargs) if callable(scope) else scope,
            key=key(*args, **kwargs),
            fingerprint=None if fingerprint is None else fingerprint(*args, **kwargs),
            lease=lease,
            ttl=ttl,
            mode=mode,
            serializer=serializer,
            heartbeat_every=heartbeat_every,
            non_retryable=non_retryable,
        )

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        if inspect.iscoroutinefunction(fn):
            # async def f(session: AsyncSession, ...): the same, with `async with`.
            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                manager: DualContext[IdempotentCall[AsyncSession]] = manager_for(
                    fn, AsyncSession, args, kwargs
                )
                async with manager as call:
                    if call.replayed:
                        return call.response
                    return await call.complete(await fn(*args, **kwargs))

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            manager: DualContext[IdempotentCall[Session]] = manager_for(fn, Session, args, kwargs)
            with manager as call:
                if call.replayed:
                    return call.response  # type: ignore[no-any-return]
                return call.complete(fn(*args, **kwargs))

        return wrapper

    return decorate


@dual_bind
def purge_expired(bind: Engine | Connection | Session, *, batch: int = 1000) -> int:
    """Delete at most ``batch`` expired idempotency keys and return how many were deleted.

    With an :class:`~sqlalchemy.Engine` the batch runs in its own short
    transaction; with a ``Connection`` or ``Session`` in the caller's (the
    caller commits).  On PostgreSQL the batch skips rows locked by a claim in
    flight, so a purge never makes a claim wait; on MariaDB and SQLite a
    batch holds its locks only for one short DELETE.  Loop until it returns
    less than ``batch`` (``stateguard purge`` does)::

        while purge_expired(engine, batch=1000) == 1000:
            time.sleep(0.05)

    Expired keys are already ignored by claims; purging only reclaims space.

    :raises InvalidArgument: ``batch`` is not a positive int.
    """
    return _kernel.purge_rows(idempotency_keys, bind, batch)
