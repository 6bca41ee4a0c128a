"""Re-run a unit of work when the database says "someone else got there first"."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import exc as sa_exc

from . import _sql
from .exceptions import LockNotAcquired, StateguardError
from .result import Outcome, Result

__all__ = ["retry_on_conflict"]

log = logging.getLogger("stateguard")

T = TypeVar("T")


def _retryable(error: BaseException, lock_not_acquired: bool) -> bool:
    kind: type[BaseException] | None
    if isinstance(error, StateguardError):
        if not (error.retryable or _is_stale(error)):
            return False
        kind = type(error)
    elif isinstance(error, sa_exc.DBAPIError):
        # A serialization failure can surface at COMMIT, outside any stateguard
        # call (PostgreSQL SERIALIZABLE): recognise the driver error itself.
        kind = _sql.classify_db_error(error)
        if kind is None:
            return False
    else:
        return False
    return lock_not_acquired or not issubclass(kind, LockNotAcquired)


def _is_stale(error: StateguardError) -> bool:
    from .exceptions import StaleVersion

    return isinstance(error, StaleVersion)


def retry_on_conflict(
    fn: Callable[[], T],
    *,
    attempts: int = 5,
    backoff: float = 0.01,
    max_backoff: float = 1.0,
    max_time: float | None = None,
    lock_not_acquired: bool = True,
    sleep: Callable[[float], object] = time.sleep,
) -> T:
    """Call ``fn()`` until it succeeds, retrying on conflicts; return its last result.

    ``fn`` must run a *whole* unit of work in its own transaction (read, decide,
    write, commit): at REPEATABLE READ and SERIALIZABLE a retry inside the same
    transaction would see the same snapshot and fail again.  ``fn`` is called
    again when it returns a STALE :class:`Result`, or raises
    :class:`SerializationConflict` / :class:`DeadlockDetected` /
    :class:`StaleVersion`, :class:`LockNotAcquired` (unless
    ``lock_not_acquired=False``), or a driver serialization failure, deadlock
    or lock timeout (also when raised by COMMIT).  Waits between attempts grow exponentially
    from ``backoff`` (full jitter) up to ``max_backoff``; ``max_time`` bounds
    the total time.  After the last attempt the last result is returned (a
    STALE result) or the last error re-raised::

        def rename(order_id: int, note: str) -> Result:
            with Session(engine) as s, s.begin():
                order = s.get_one(Order, order_id)
                return guarded_update(s, Order, order, {"note": note},
                                      expected_version=order.version)

        r = retry_on_conflict(lambda: rename(42, "gift"))
    """
    if attempts < 1:
        raise ValueError("attempts must be at least 1")
    deadline = None if max_time is None else time.monotonic() + max_time
    attempt = 0
    while True:
        attempt += 1
        try:
            result = fn()
        except Exception as error:
            if not _retryable(error, lock_not_acquired) or attempt >= attempts or _past(deadline):
                raise
            log.debug("stateguard: attempt %d hit %r, retrying", attempt, error)
        else:
            if not (isinstance(result, Result) and result.outcome is Outcome.STALE):
                return result
            if attempt >= attempts or _past(deadline):
                return result
            log.debug("stateguard: attempt %d was STALE, retrying", attempt)
        delay = random.uniform(0, min(max_backoff, backoff * (2 ** (attempt - 1))))
        if deadline is not None:
            delay = min(delay, max(0.0, deadline - time.monotonic()))
        if delay > 0:
            sleep(delay)


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline
