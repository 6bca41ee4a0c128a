"""Re-run a unit of work when the database says "someone else got there first"."""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Coroutine
from decimal import Decimal
from numbers import Real
from typing import Any, TypeVar, overload

from sqlalchemy import exc as sa_exc

from . import _kernel
from . import observe as _observe
from ._async import Awaited, Steps, run_steps, step
from .exceptions import InvalidArgument, LockNotAcquired, StateguardError
from .result import Outcome, Result

__all__ = ["retry_on_conflict"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The default ``sleep``, replaced by :func:`asyncio.sleep` in the async form (captured, so a
#: patched ``time.sleep`` cannot make the comparison fail).
_BLOCKING_SLEEP: Callable[[float], object] = time.sleep


#: How far back through ``__context__`` a database error is followed to the conflict it hid.
_CONTEXT_DEPTH = 8


def _retryable(error: BaseException, lock_not_acquired: bool) -> bool:
    """Whether ``error`` is a conflict worth running the unit of work again for.

    A database error raised while a conflict was being handled counts as that conflict: on
    MariaDB a deadlock rolls the whole transaction back, so leaving the caller's own
    ``with session.begin_nested():`` block sends ROLLBACK TO SAVEPOINT for a savepoint that no
    longer exists, and the driver's "SAVEPOINT ... does not exist" replaces the deadlock (kept
    as ``__context__``; under asyncio with the driver's own exception in between).  Only
    SQLAlchemy's errors and the driver errors they wrap are followed back (not stateguard's
    own): an application error raised from a conflict is the application's answer, not retried.
    """
    wrapped: BaseException | None = None  # the driver error the previous link wrapped
    for _ in range(_CONTEXT_DEPTH):
        if _retryable_here(error, lock_not_acquired):
            return True
        database = isinstance(error, sa_exc.SQLAlchemyError) and not isinstance(error, StateguardError)
        if not database and error is not wrapped:
            return False
        wrapped = error.orig if isinstance(error, sa_exc.DBAPIError) else None
        context = error.__context__
        if context is None:
            return False
        error = context
    return False


def _retryable_here(error: BaseException, lock_not_acquired: bool) -> bool:
    kind: type[BaseException] | None
    if isinstance(error, StateguardError):
        if not (error.retryable or _is_stale(error)):
            return False
        kind = type(error)
    elif isinstance(error, sa_exc.DBAPIError):
        # A serialization failure can surface at COMMIT, outside any stateguard
        # call (PostgreSQL SERIALIZABLE): recognise the driver error itself.
        kind = _kernel.classify_db_error(error)
        if kind is None:
            return False
    else:
        return False
    return lock_not_acquired or not issubclass(kind, LockNotAcquired)


def _is_stale(error: StateguardError) -> bool:
    from .exceptions import StaleVersion

    return isinstance(error, StaleVersion)


class _Policy:
    """One call's retry decisions, shared by the sync and async loops (only their waits differ)."""

    __slots__ = ("attempt", "attempts", "backoff", "deadline", "lock_not_acquired", "max_backoff", "start")

    def __init__(
        self,
        attempts: int,
        backoff: float,
        max_backoff: float,
        max_time: float | None,
        lock_not_acquired: bool,
    ) -> None:
        self.attempts = attempts
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.lock_not_acquired = lock_not_acquired
        self.deadline = None if max_time is None else time.monotonic() + max_time
        self.attempt = 0
        #: When the call began, if anything observes it (stateguard.observe), else None.
        self.start = time.perf_counter() if _observe.hooked or log.isEnabledFor(logging.DEBUG) else None

    def report(self, end: object) -> None:
        """One stateguard.observe event for the whole call: its last outcome and the retries it took."""
        if self.start is None:
            return
        error = end if isinstance(end, BaseException) else None
        if error is not None:
            outcome = type(end).__name__
        else:
            outcome = end.outcome.name if isinstance(end, Result) else "OK"
        _observe.deliver(
            _observe.GuardEvent(
                "retry_on_conflict",
                outcome,
                time.perf_counter() - self.start,
                model=end.model.__name__ if isinstance(end, Result) else None,
                retries=self.attempt - 1,
                error=error,
            ),
            log,
        )

    def _last(self) -> bool:
        return self.attempt >= self.attempts or (
            self.deadline is not None and time.monotonic() >= self.deadline
        )

    def retry_error(self, error: Exception) -> bool:
        """Whether to call again after ``error`` (else the caller re-raises it)."""
        if not _retryable(error, self.lock_not_acquired) or self._last():
            return False
        log.debug("stateguard: attempt %d hit %r, retrying", self.attempt, error)
        return True

    def retry_result(self, result: object) -> bool:
        """Whether to call again after ``result`` (a STALE Result with attempts left), else return it."""
        if not (isinstance(result, Result) and result.outcome is Outcome.STALE) or self._last():
            return False
        log.debug("stateguard: attempt %d was STALE, retrying", self.attempt)
        return True

    def delay(self) -> float:
        """Full jitter: uniform in [0, min(max_backoff, backoff * 2**(attempt-1))], cut at the deadline."""
        # The exponent is capped: 2**1100 does not fit a float (OverflowError with attempts > 1024),
        # and 2**64 times any positive backoff is past every max_backoff already.
        growth = 2.0 ** min(self.attempt - 1, 64)
        delay = random.uniform(0, min(self.max_backoff, self.backoff * growth))
        if self.deadline is not None:
            delay = min(delay, max(0.0, self.deadline - time.monotonic()))
        return delay


@overload
def retry_on_conflict(
    fn: Callable[[], Awaitable[T]],
    *,
    attempts: int = 5,
    backoff: float = 0.01,
    max_backoff: float = 1.0,
    max_time: float | None = None,
    lock_not_acquired: bool = True,
    sleep: Callable[[float], object] = time.sleep,
) -> Coroutine[Any, Any, T]: ...


@overload
def retry_on_conflict(
    fn: Callable[[], T],
    *,
    attempts: int = 5,
    backoff: float = 0.01,
    max_backoff: float = 1.0,
    max_time: float | None = None,
    lock_not_acquired: bool = True,
    sleep: Callable[[float], object] = time.sleep,
) -> T: ...


def retry_on_conflict(
    fn: Callable[[], Any],
    *,
    attempts: int = 5,
    backoff: float = 0.01,
    max_backoff: float = 1.0,
    max_time: float | None = None,
    lock_not_acquired: bool = True,
    sleep: Callable[[float], object] = time.sleep,
) -> Any:
    """Call ``fn()`` until it succeeds, retrying on conflicts; return its last result.

    ``fn`` must run a *whole* unit of work in its own transaction (read, decide,
    write, commit): at REPEATABLE READ and SERIALIZABLE a retry inside the same
    transaction would see the same snapshot and fail again.  ``fn`` is called
    again when it returns a STALE :class:`Result`, or raises
    :class:`SerializationConflict` / :class:`DeadlockDetected` /
    :class:`StaleVersion`, :class:`LockNotAcquired` (unless
    ``lock_not_acquired=False``), or a driver serialization failure, deadlock
    or lock timeout (also when raised by COMMIT), or a database error raised while
    one of those was being handled (leaving a ``begin_nested()`` block after a
    MariaDB deadlock ended the whole transaction raises "SAVEPOINT ... does not
    exist"; an application's own exception is never retried).  Serialization failures are
    recognised by code: SQLSTATE 40001 (PostgreSQL, and CockroachDB's
    ``restart transaction`` errors such as ``RETRY_SERIALIZABLE`` and
    ``RETRY_WRITE_TOO_OLD``), 40P01 and MySQL/MariaDB 1213 (deadlocks),
    InnoDB's 1020, SQLite's busy snapshot.  Waits between attempts grow exponentially
    from ``backoff`` (full jitter) up to ``max_backoff``; ``max_time`` bounds
    the total time.  After the last attempt the last result is returned (a
    STALE result) or the last error re-raised::

        def rename(order_id: int, note: str) -> Result:
            with Session(engine) as s, s.begin():
                order = s.get_one(Order, order_id)
                return guarded_update(s, Order, order, {"note": note},
                                      expected_version=order.version)

        r = retry_on_conflict(lambda: rename(42, "gift"))

    **asyncio**: given a coroutine function (or any callable whose call returns
    an awaitable, such as ``lambda: rename_async(42, "gift")``), the call
    returns a coroutine to await; each attempt is awaited and the waits use
    :func:`asyncio.sleep` (the event loop keeps running), never
    :func:`time.sleep`.  A ``sleep`` you pass may be a coroutine function or a
    plain function there (with a synchronous ``fn`` it must block: a ``sleep``
    returning an awaitable is :class:`~stateguard.InvalidArgument`)::

        async def rename_async(order_id: int, note: str) -> Result:
            async with AsyncSession(async_engine) as s, s.begin():
                order = await s.get_one(Order, order_id)
                return await guarded_update(s, Order, order, {"note": note},
                                            expected_version=order.version)

        r = await retry_on_conflict(lambda: rename_async(42, "gift"))

    Every argument is checked before ``fn`` first runs: ``attempts`` an int
    of at least 1, ``backoff``, ``max_backoff`` and ``max_time`` finite
    numbers of seconds >= 0 (``max_time`` may be ``None``), ``fn`` and
    ``sleep`` callables, ``lock_not_acquired`` a bool; anything else raises
    :class:`~stateguard.InvalidArgument` at the call, in both forms.
    """
    policy = _Policy(*_checked(fn, attempts, backoff, max_backoff, max_time, lock_not_acquired, sleep))
    if inspect.iscoroutinefunction(fn):
        return _retry_async(fn, policy, sleep, _NOTHING)
    done = run_steps(_attempts(fn, policy, sleep, _NOTHING, hand_over=True))
    if isinstance(done, _HandOver):
        # fn is a lambda or partial around a coroutine function (its first awaitable may come
        # on a later attempt): the caller awaits what we return, so the retries go there.
        return _retry_async(fn, policy, sleep, done.reply)
    return done


def _checked(
    fn: object,
    attempts: object,
    backoff: object,
    max_backoff: object,
    max_time: object,
    lock_not_acquired: object,
    sleep: object,
) -> tuple[int, float, float, float | None, bool]:
    """Every argument of :func:`retry_on_conflict` checked before ``fn`` is first called, or InvalidArgument.

    ``(attempts, backoff, max_backoff, max_time, lock_not_acquired)`` for :class:`_Policy`, the
    times as floats.
    """
    if not callable(fn):
        raise InvalidArgument(
            f"retry_on_conflict: fn must be a callable taking no arguments, got {fn!r}; "
            f"pass the unit of work itself or a lambda around it: retry_on_conflict(lambda: work(42))"
        )
    if type(attempts) is bool or not isinstance(attempts, int) or attempts < 1:
        raise InvalidArgument(
            f"retry_on_conflict: attempts must be an int of at least 1 (how many times fn may run), "
            f"got {attempts!r}; e.g. attempts=5"
        )
    if type(lock_not_acquired) is not bool:
        raise InvalidArgument(
            f"retry_on_conflict: lock_not_acquired must be True or False, got {lock_not_acquired!r}"
        )
    if not callable(sleep):
        raise InvalidArgument(
            f"retry_on_conflict: sleep must be a callable taking seconds (time.sleep, asyncio.sleep), "
            f"got {sleep!r}"
        )
    return (
        int(attempts),
        _seconds(backoff, "backoff", "backoff=0.01"),
        _seconds(max_backoff, "max_backoff", "max_backoff=1.0"),
        None if max_time is None else _seconds(max_time, "max_time", "max_time=30 (or None: no limit)"),
        lock_not_acquired,
    )


def _seconds(value: object, name: str, example: str) -> float:
    """``value`` as a float number of seconds: a finite real number >= 0 (not a bool), or InvalidArgument."""
    if type(value) is not bool and isinstance(value, Real | Decimal):
        try:
            seconds = float(value)
        except (OverflowError, ValueError):  # a Decimal or Fraction beyond float's range
            seconds = math.inf
        if math.isfinite(seconds) and seconds >= 0:
            return seconds
    raise InvalidArgument(
        f"retry_on_conflict: {name} must be a finite number of seconds >= 0, got {value!r}; e.g. {example}"
    )


class _HandOver:
    """An attempt of the synchronous form returned an awaitable: the rest of the loop is awaited."""

    __slots__ = ("reply",)

    def __init__(self, reply: Any) -> None:
        self.reply = reply


#: No attempt made yet: the loop makes the first one itself.
_NOTHING: Any = object()


def _attempts(
    fn: Callable[[], Any],
    policy: _Policy,
    sleep: Callable[[float], object],
    first: Any,
    *,
    hand_over: bool = False,
) -> Steps[Any]:
    """The retry loop, written once for both forms: each attempt and each wait is a step.

    ``first`` is the first attempt's awaitable when the synchronous form
    handed over (:class:`_HandOver`), else :data:`_NOTHING`.  With
    ``hand_over`` (the synchronous form) an attempt that returns an
    awaitable ends the loop with a :class:`_HandOver` instead.
    """
    while True:
        try:
            if first is _NOTHING:
                policy.attempt += 1
                reply = fn()
            else:
                reply, first = first, _NOTHING
            if hand_over and inspect.isawaitable(reply):
                return _HandOver(reply)
            result = yield from step(reply)
        except Exception as error:
            if not policy.retry_error(error):
                policy.report(error)
                raise
        else:
            if not policy.retry_result(result):
                policy.report(result)
                return result
        delay = policy.delay()
        if delay > 0:
            waited = sleep(delay)
            if hand_over and inspect.isawaitable(waited):
                if inspect.iscoroutine(waited):
                    waited.close()
                raise InvalidArgument(
                    f"retry_on_conflict: sleep={sleep!r} returned an awaitable, but fn is synchronous: "
                    f"pass a blocking sleep (the default time.sleep), or make fn a coroutine function"
                )
            yield from step(waited)


async def _retry_async(
    fn: Callable[[], Any], policy: _Policy, sleep: Callable[[float], object], first: Any
) -> Any:
    """The loop awaited: attempts are awaited, and the default sleep is :func:`asyncio.sleep`."""
    wait: Callable[[float], object] = asyncio.sleep if sleep is _BLOCKING_SLEEP else sleep
    return await Awaited(_attempts(fn, policy, wait, first))
