"""What happens to idempotency keys, for listeners: :class:`IdempotencyEvent`, :func:`on_idempotency_event`.

Every decision of a claim (claimed, replayed, refused, taken over) and every
end of a call (completed, released, failed, lease lost) is one event, also
reported through :mod:`stateguard.observe` and logged at DEBUG on the
``stateguard.idempotency`` logger.  Nothing is built while nobody listens.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from .. import observe as _observe
from .options import Mode

__all__ = ["IdempotencyEvent", "emit", "log", "on_idempotency_event"]

log: Final = logging.getLogger("stateguard.idempotency")


@dataclass(frozen=True, slots=True)
class IdempotencyEvent:
    """One thing that happened to an idempotency key, as given to :func:`on_idempotency_event` listeners.

    ``kind`` is one of ``"claimed"`` (this call owns a new or expired key),
    ``"replayed"``, ``"in_progress"`` (RequestInProgress), ``"key_reused"``
    (IdempotencyKeyReused), ``"failed_replayed"`` (RequestFailed),
    ``"taken_over"`` (a dead or released claim was resumed), ``"completed"``,
    ``"released"``, ``"failed"`` (marked failed for good) and
    ``"lease_lost"``.
    """

    kind: str
    scope: str
    key: str
    attempt: int | None
    mode: Mode


_listeners: list[Callable[[IdempotencyEvent], object]] = []


def on_idempotency_event(listener: Callable[[IdempotencyEvent], object]) -> Callable[[], None]:
    """Call ``listener(event)`` for every :class:`IdempotencyEvent`; return a function that removes it.

    Listeners run synchronously in the thread of the call; an exception in a
    listener is logged and never breaks the request::

        counts = collections.Counter()
        remove = on_idempotency_event(lambda e: counts.update([e.kind]))
        ...
        remove()

    Every event is also logged at DEBUG on the ``stateguard.idempotency`` logger.
    """
    _listeners.append(listener)

    def remove() -> None:
        with contextlib.suppress(ValueError):
            _listeners.remove(listener)

    return remove


def emit(kind: str, scope: str, key: str, attempt: int | None, mode: Mode) -> None:
    """Report ``kind`` for this key to stateguard.observe, the DEBUG log and the listeners."""
    if _observe.hooked or log.isEnabledFor(logging.DEBUG):
        # The generic outcome event (stateguard.observe), also the DEBUG log line with its extra fields.
        _observe.deliver(
            _observe.GuardEvent("idempotency", kind, 0.0, scope=scope, retries=max(0, (attempt or 1) - 1)),
            log,
        )
    if not _listeners:
        return
    event = IdempotencyEvent(kind, scope, key, attempt, mode)
    for listener in tuple(_listeners):
        try:
            listener(event)
        except Exception:
            _observe.failed(listener, f"taking the idempotency event {kind!r}", log)
