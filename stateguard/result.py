"""The outcome of a guarded write, shared by every stateguard operation."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session

from . import _commit
from .exceptions import (
    InsufficientQuantity,
    NotFound,
    OutcomeError,
    StaleVersion,
    TransitionRejected,
)

__all__ = ["Outcome", "Result"]


class Outcome(enum.Enum):
    """What a guarded write found (the outcomes are explained in ``docs/explanation/schemes.md``)."""

    #: This call was the first application: run the side effects.
    APPLIED = "applied"
    #: It had already been applied (by this request or a twin): no side effects.
    REPEATED = "repeated"
    #: The current state does not allow it.
    REJECTED = "rejected"
    #: The optimistic version check failed: someone else changed the row.
    STALE = "stale"
    #: A guarded counter would cross its bound.
    INSUFFICIENT = "insufficient"
    #: No such row.
    NOT_FOUND = "not_found"


_ERRORS: dict[Outcome, type[OutcomeError]] = {
    Outcome.REJECTED: TransitionRejected,
    Outcome.STALE: StaleVersion,
    Outcome.NOT_FOUND: NotFound,
    Outcome.INSUFFICIENT: InsufficientQuantity,
}


class Result:
    """The result of one guarded write.

    ``outcome`` says what happened; ``state``, ``version`` and ``value`` carry
    what the database reported or what was found, when known (``None``
    otherwise).  A result is truthy only when it was applied::

        r = Order.flow.pay(session, 42)
        if r.applied:
            r.on_commit(send_receipt, 42)
        else:
            r.raise_for_outcome()   # no-op for REPEATED

    ``same_request`` is ``True`` on a REPEATED result decided by the identity
    the call carried, which the first application stored in its own
    transaction: a trigger's ``request_id`` found in the transition history,
    a counter's ``ref`` found in the ledger, :func:`insert_once`'s unique key,
    :func:`consume_once`'s ``(consumer, message_id)``.  A retry whose first
    attempt lost its reply (the COMMIT ran, its acknowledgement never came)
    learns from it that the first attempt committed.  A REPEATED read from the
    row's state alone (the row is already where the trigger leads, moved there
    by any request) has ``same_request`` ``False``::

        r = Invoice.flow.pay(session, 7, request_id=rid)   # the retry
        if r.same_request:
            ...  # the first attempt with rid committed: its effects are in the database
    """

    __slots__ = (
        "_session",
        "expected_version",
        "key",
        "model",
        "outcome",
        "same_request",
        "state",
        "trigger",
        "value",
        "version",
    )

    def __init__(
        self,
        outcome: Outcome,
        *,
        model: type[Any],
        key: Any,
        trigger: str | None = None,
        state: Any = None,
        version: int | None = None,
        value: Any = None,
        expected_version: int | None = None,
        session: Session | None = None,
        same_request: bool = False,
    ) -> None:
        self.outcome = outcome
        self.model = model
        self.key = key
        self.trigger = trigger
        self.state = state
        self.version = version
        self.value = value
        self.expected_version = expected_version
        self.same_request = same_request
        self._session = session

    @property
    def applied(self) -> bool:
        """``True`` when this call applied the change."""
        return self.outcome is Outcome.APPLIED

    def __bool__(self) -> bool:
        return self.outcome is Outcome.APPLIED

    def raise_for_outcome(self) -> Result:
        """Return ``self`` for APPLIED and REPEATED, raise the typed error otherwise.

        ``TransitionRejected`` for REJECTED, ``StaleVersion`` for STALE,
        ``NotFound`` for NOT_FOUND and ``InsufficientQuantity`` for
        INSUFFICIENT.
        """
        error = _ERRORS.get(self.outcome)
        if error is not None:
            raise error(self)
        return self

    def on_commit(self, fn: Callable[..., object], /, *args: Any, **kwargs: Any) -> None:
        """Call ``fn(*args, **kwargs)`` after the session's outermost transaction commits.

        Only an APPLIED result schedules anything: for any other outcome this
        does nothing, so a duplicate request never repeats the side effect.
        A rollback (of the whole transaction, or of a savepoint the call ran
        in) drops the callback.  The session is no longer in a transaction
        when it runs; use a new session for further database work.
        """
        if self.outcome is Outcome.APPLIED and self._session is not None:
            _commit.schedule(self._session, fn, args, kwargs)

    def __repr__(self) -> str:
        parts = [f"{self.outcome.name}", f"key={self.key!r}"]
        if self.trigger is not None:
            parts.append(f"trigger={self.trigger!r}")
        if self.state is not None:
            parts.append(f"state={self.state!r}")
        if self.version is not None:
            parts.append(f"version={self.version!r}")
        if self.value is not None:
            parts.append(f"value={self.value!r}")
        if self.same_request:
            parts.append("same_request=True")
        model = getattr(self.model, "__name__", self.model)
        return f"<Result {model} {' '.join(parts)}>"
