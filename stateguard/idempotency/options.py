"""The options every idempotency face shares, defined and checked once: :class:`IdempotencyOptions`.

:func:`~stateguard.idempotent`, :func:`~stateguard.idempotent_function` and
the HTTP middleware (:mod:`stateguard.http`) take the same lease, ttl, mode,
serializer, heartbeat and non-retryable options with the same defaults; each
face turns them into one :class:`IdempotencyOptions` (through
:func:`options_of`, which checks an application's few distinct policies once
each) and the claim reads only that object.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Final, Literal

from .. import _kernel
from ..exceptions import InvalidArgument
from .serialization import JSON, Serializer

__all__ = [
    "DEFAULT_LEASE",
    "DEFAULT_MODE",
    "DEFAULT_TTL",
    "IdempotencyOptions",
    "Mode",
    "duration_ms",
    "options_of",
]

Mode = Literal["same_transaction", "separate"]

#: How long a claim is held before another caller may take it over.
DEFAULT_LEASE: Final = timedelta(seconds=60)
#: How long a key and its response are kept.
DEFAULT_TTL: Final = timedelta(hours=24)
#: The claim, the block's writes and the response commit together.
DEFAULT_MODE: Final[Mode] = "same_transaction"


def duration_ms(value: Any, what: str) -> int:
    """A lease, ttl or heartbeat interval (a :class:`~datetime.timedelta` of at least 1 ms) in ms."""
    return _kernel.duration_ms(value, what)


@dataclass(frozen=True, slots=True)
class IdempotencyOptions:
    """How keys are claimed and kept, checked when built (:class:`~stateguard.InvalidArgument`).

    ::

        options = IdempotencyOptions(lease=timedelta(minutes=5), mode="separate")
        options.lease_ms        # 300000

    :param lease: how long a claim is held before another caller may take it over.
    :param ttl: how long the key and its response are kept (not shorter than ``lease``).
    :param mode: ``"same_transaction"`` or ``"separate"``.
    :param serializer: stores responses and checkpoint data (JSON by default).
    :param heartbeat_every: separate mode: extend the lease this often (shorter than ``lease``).
    :param non_retryable: separate mode: exception classes that mark the key failed for good
        (one class is taken as a tuple of one).
    """

    lease: timedelta = DEFAULT_LEASE
    ttl: timedelta = DEFAULT_TTL
    mode: Mode = DEFAULT_MODE
    serializer: Serializer = JSON
    heartbeat_every: timedelta | None = None
    non_retryable: tuple[type[BaseException], ...] = ()
    #: ``lease`` in whole milliseconds.
    lease_ms: int = field(init=False, repr=False, compare=False)
    #: ``ttl`` in whole milliseconds.
    ttl_ms: int = field(init=False, repr=False, compare=False)
    #: ``heartbeat_every`` in seconds (``None``: no background heartbeat).
    heartbeat_seconds: float | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        lease, ttl, mode, heartbeat_every = self.lease, self.ttl, self.mode, self.heartbeat_every
        lease_ms = duration_ms(lease, "lease")
        ttl_ms = duration_ms(ttl, "ttl")
        if ttl_ms < lease_ms:
            raise InvalidArgument(f"ttl ({ttl}) must not be shorter than lease ({lease})")
        if mode not in ("same_transaction", "separate"):
            raise InvalidArgument(f"mode must be 'same_transaction' or 'separate', got {mode!r}")
        interval: float | None = None
        if heartbeat_every is not None:
            if mode != "separate":
                raise InvalidArgument(
                    "heartbeat_every needs mode='separate': in same_transaction mode the claim is invisible "
                    "to other transactions until it commits, so there is no lease to keep alive"
                )
            interval = duration_ms(heartbeat_every, "heartbeat_every") / 1000
            if interval * 1000 >= lease_ms:
                raise InvalidArgument(
                    f"heartbeat_every ({heartbeat_every}) must be shorter than lease ({lease})"
                )
        non_retryable: Any = self.non_retryable
        if isinstance(non_retryable, type):
            non_retryable = (non_retryable,)
        if not isinstance(non_retryable, tuple) or not all(
            isinstance(t, type) and issubclass(t, BaseException) for t in non_retryable
        ):
            raise InvalidArgument(
                f"non_retryable must be a tuple of exception classes, got {non_retryable!r}"
            )
        if non_retryable and mode != "separate":
            raise InvalidArgument(
                "non_retryable needs mode='separate': in same_transaction mode a failure rolls back with the "
                "transaction, so there is no failure record to keep"
            )
        if self.serializer is None:
            object.__setattr__(self, "serializer", JSON)
        object.__setattr__(self, "non_retryable", non_retryable)
        object.__setattr__(self, "lease_ms", lease_ms)
        object.__setattr__(self, "ttl_ms", ttl_ms)
        object.__setattr__(self, "heartbeat_seconds", interval)

    def without_heartbeat(self) -> IdempotencyOptions:
        """These options with no background heartbeat (for a face that keeps the lease alive itself)."""
        if self.heartbeat_every is None:
            return self
        serializer = None if self.serializer is JSON else self.serializer
        return options_of(self.lease, self.ttl, self.mode, serializer, None, self.non_retryable)


def _policy(lease: Any, ttl: Any, mode: Any, heartbeat_every: Any, non_retryable: Any) -> IdempotencyOptions:
    return IdempotencyOptions(lease, ttl, mode, JSON, heartbeat_every, non_retryable)


#: An application passes the same few policies (lease, ttl, mode ...) on every call: each is checked
#: once.  Only valid ones are kept (a refusal raises, and lru_cache keeps no exception).
_checked_policy: Final = functools.lru_cache(maxsize=64)(_policy)


#: The options of a call that passes none.
_DEFAULTS: Final = _policy(DEFAULT_LEASE, DEFAULT_TTL, DEFAULT_MODE, None, ())


def options_of(
    lease: Any,
    ttl: Any,
    mode: Any,
    serializer: Serializer | None,
    heartbeat_every: Any,
    non_retryable: Any,
) -> IdempotencyOptions:
    """The checked :class:`IdempotencyOptions` of a face's keyword arguments (``serializer=None``: JSON).

    :raises InvalidArgument: an option is wrong or contradicts another (nothing is written).
    """
    if (
        lease is DEFAULT_LEASE
        and ttl is DEFAULT_TTL
        and mode == DEFAULT_MODE
        and heartbeat_every is None
        and type(non_retryable) is tuple
        and not non_retryable
    ):
        # Every option left at its default (the most frequent call): no hashing of two timedeltas.
        options = _DEFAULTS
    else:
        try:
            options = _checked_policy(lease, ttl, mode, heartbeat_every, non_retryable)
        except TypeError:  # an unhashable argument: checked without the memo (and most likely refused)
            options = _policy(lease, ttl, mode, heartbeat_every, non_retryable)
    if serializer is None:
        return options
    # The caller's own serializer object, never an equal one memoised from another call.
    return replace(options, serializer=serializer)
