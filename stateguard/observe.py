"""Seeing what happened: one event for every guarded call.

Every public guarded call (a trigger, ``many``/``where``, ``guarded_update``,
the counters, ``insert_once``, ``consume_once``, the database and Redis tokens,
the locks, idempotency keys, ids) reports one :class:`GuardEvent` when it ends:
what ran, on which model or scope, with which outcome, how long it took, how
often stateguard retried inside it and on which backend::

    from stateguard import on_event

    remove = on_event(lambda e: print(e.operation, e.model, e.outcome, f"{e.duration * 1000:.1f} ms"))
    Order.flow.pay(session, 42)          # trigger Order APPLIED 0.4 ms
    remove()

Nothing is measured while no listener, no span factory and no DEBUG logging is
on: the call then costs one flag test more.  Listeners run synchronously in
the caller's thread, after the call; :mod:`stateguard.otel` turns the events
into OpenTelemetry metrics and spans; each event is also logged at DEBUG on
``stateguard.<module>`` with ``sg_*`` extra fields.  Observation never changes
what a call does or returns: an ``Exception`` from a listener, a span factory
or the log line is logged on ``stateguard.observe`` and swallowed; only
``KeyboardInterrupt``, ``SystemExit``, ``CancelledError`` and ``GeneratorExit``
propagate.  See ``docs/how-to/observability.md``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from .result import Result

__all__ = ["GuardEvent", "SpanFactory", "on_event", "on_span", "watch"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GuardEvent:
    """One guarded call that ended, as given to :func:`on_event` listeners.

    :ivar operation: what was called: ``"trigger"``, ``"many"``, ``"where"``,
        ``"guarded_update"``, ``"decrement"``, ``"increment"``, ``"reserve"``,
        ``"release"``, ``"insert_once"``, ``"consume_once"``, ``"issue_token"``,
        ``"consume_token"``, ``"redis_token.issue"``, ``"redis_token.consume"``,
        ``"row_lock"``, ``"advisory_lock"``, ``"redis_lock.acquire"``,
        ``"redis_lock.release"``, ``"zookeeper_lock.acquire"``,
        ``"zookeeper_lock.release"``, ``"idempotency"``, ``"next_id"``,
        ``"retry_on_conflict"`` ...
    :ivar outcome: the :class:`~stateguard.Outcome` name (``"APPLIED"``,
        ``"REPEATED"`` ...) for calls that return a Result; ``"OK"`` for calls
        that return something else; the exception's class name
        (``"LockNotAcquired"``, ``"InvalidArgument"``, ``"OperationalError"``)
        when the call raised; for ``"idempotency"`` the key's event kind
        (``"claimed"``, ``"replayed"``, ``"in_progress"`` ...).
    :ivar duration: seconds from the call to its end (``0.0`` for idempotency
        kinds that are points in time).
    :ivar model: the model's class name, or ``None``.
    :ivar scope: the scope, consumer, lock or counter name where the call has
        one instead of (or as well as) a model.
    :ivar trigger: the trigger's name for ``trigger`` / ``many`` / ``where``.
    :ivar retries: how often stateguard ran the decisive step again inside
        this call (``retry_on_conflict`` attempts after the first; Redis
        commands retried after a lost reply are the client's and not counted).
    :ivar backend: the SQL dialect name (``"postgresql"``, ``"mysql"``,
        ``"sqlite"``), ``"redis"``, ``"zookeeper"``, or ``None`` when unknown.
    :ivar error: the exception the call raised, or ``None``.
    :ivar counts: for calls on many rows (``many``: outcome per row; ``where``:
        the rows it applied to), rows per outcome name, e.g.
        ``{"APPLIED": 98, "REPEATED": 2}``; ``outcome`` is then the one outcome
        of all rows, or ``"MIXED"``.  ``None`` for single-row calls.
    """

    operation: str
    outcome: str
    duration: float
    model: str | None = None
    scope: str | None = None
    trigger: str | None = None
    retries: int = 0
    backend: str | None = None
    error: BaseException | None = None
    counts: dict[str, int] | None = None


Listener = Callable[[GuardEvent], object]
#: ``factory(operation, attributes) -> context manager`` entered around the call.
SpanFactory = Callable[[str, dict[str, Any]], AbstractContextManager[Any]]

_listeners: list[Listener] = []
_spans: list[SpanFactory] = []
#: True while anything listens; the one flag a guarded call tests on its fast path.
hooked = False


def _rehook() -> None:
    global hooked
    hooked = bool(_listeners or _spans)


def on_event(listener: Listener) -> Callable[[], None]:
    """Call ``listener(event)`` with a :class:`GuardEvent` after every guarded call; return a remover.

    ::

        import collections
        outcomes = collections.Counter()
        remove = on_event(lambda e: outcomes.update([(e.operation, e.outcome)]))
        ...
        remove()

    A listener that raises is logged on ``stateguard.observe`` and skipped;
    the call it reports on is not affected.
    """
    if not callable(listener) or _is_async(listener):
        from .exceptions import InvalidArgument

        raise InvalidArgument(
            f"on_event() needs a plain (not async) callable taking a GuardEvent, got {listener!r}: "
            f"listeners run synchronously after the call; hand the event to your loop yourself "
            f"(e.g. loop.call_soon_threadsafe(queue.put_nowait, event))"
        )
    _listeners.append(listener)
    _rehook()

    def remove() -> None:
        with contextlib.suppress(ValueError):
            _listeners.remove(listener)
        _rehook()

    return remove


def _is_async(fn: Any) -> bool:
    # An object whose __call__ is ``async def`` returns coroutines too.
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def on_span(factory: SpanFactory) -> Callable[[], None]:
    """Enter ``factory(operation, attributes)`` around every guarded call; return a remover.

    What :func:`stateguard.otel.instrument` uses to open one span per call,
    so the statements the call sends (SQLAlchemy's own instrumentation) nest
    under it.  ``attributes`` holds what is known before the call runs
    (``stateguard.operation``, and ``stateguard.model`` / ``stateguard.trigger``
    where the call names them)::

        remove = on_span(lambda op, attrs: tracer.start_as_current_span(f"stateguard {op}", attributes=attrs))

    A factory that raises, or whose context manager raises on entry or on
    exit, is logged on ``stateguard.observe`` and the call goes on as if it
    were not there; its ``__exit__`` cannot swallow the call's exception.
    """
    if not callable(factory):
        from .exceptions import InvalidArgument

        raise InvalidArgument(f"on_span() needs a callable returning a context manager, got {factory!r}")
    _spans.append(factory)
    _rehook()

    def remove() -> None:
        with contextlib.suppress(ValueError):
            _spans.remove(factory)
        _rehook()

    return remove


def logging_on(logger: logging.Logger) -> bool:
    """Whether ``logger`` would emit a DEBUG record (the logging module caches the answer)."""
    return logger.isEnabledFor(logging.DEBUG)


def _backend_of(session: Any, model: Any) -> str | None:
    try:
        bind = session.get_bind(mapper=model) if model is not None else session.get_bind()
    except Exception:  # an unbound session: the event still reports, without a backend
        return None
    return str(bind.dialect.name)


def _describe(operation: str, value: Any) -> tuple[str, str | None, str | None, dict[str, int] | None]:
    """(outcome, model name, trigger, counts per outcome) of a call's return value."""
    if isinstance(value, Result):
        return value.outcome.name, value.model.__name__, value.trigger, None
    if operation == "many" and isinstance(value, dict):
        counts: dict[str, int] = {}
        for result in value.values():
            name = result.outcome.name
            counts[name] = counts.get(name, 0) + 1
        return (
            (next(iter(counts)) if len(counts) == 1 else "MIXED" if counts else "APPLIED"),
            None,
            None,
            counts,
        )
    if operation == "where" and isinstance(value, list):
        return "APPLIED", None, None, {"APPLIED": len(value)}
    return "OK", None, None, None


def deliver(event: GuardEvent, logger: logging.Logger) -> None:
    """Give ``event`` to the listeners and, at DEBUG, to ``logger``; none of their errors escapes."""
    if logger.isEnabledFor(logging.DEBUG):
        try:
            _log_event(event, logger)
        except Exception:  # a logging filter that raises (handlers catch their own emit errors)
            failed(logger, "logging the event")
    for listener in tuple(_listeners):
        try:
            listener(event)
        except Exception:
            failed(listener, "taking the event")


def _log_event(event: GuardEvent, logger: logging.Logger) -> None:
    logger.debug(
        "%s %s%s: %s in %.2f ms",
        event.operation,
        event.model or event.scope or "",
        f".{event.trigger}" if event.trigger else "",
        event.outcome,
        event.duration * 1000,
        extra={
            "sg_operation": event.operation,
            "sg_model": event.model,
            "sg_scope": event.scope,
            "sg_trigger": event.trigger,
            "sg_outcome": event.outcome,
            "sg_duration_ms": event.duration * 1000,
            "sg_retries": event.retries,
            "sg_backend": event.backend,
        },
    )


def failed(observer: object, doing: str, logger: logging.Logger = log) -> None:
    """Log the exception being handled, raised by ``observer`` while ``doing``, on ``logger``; never raise.

    The one place an observer's error ends (see the module docstring): called
    from an ``except Exception`` block around every listener, span factory and
    event log line, here and in :mod:`stateguard.otel` / idempotency events.
    """
    # A logging filter that raises on this record too: observation stays silent rather than break the call.
    with contextlib.suppress(Exception):
        logger.exception(
            "stateguard observer %r failed while %s; the guarded call was not affected", observer, doing
        )


class _Spans:
    """The span factories' context managers around one call; none of their errors reaches the call.

    Each factory's manager is entered in order and exited in reverse, each in
    its own ``try``: one that fails to open is skipped, one that fails to
    close does not keep the others open, and the call's own exception (or its
    return) goes on unchanged.
    """

    __slots__ = ("_attributes", "_open", "_operation")

    def __init__(self, operation: str, attributes: dict[str, Any]) -> None:
        self._operation = operation
        self._attributes = attributes
        self._open: list[AbstractContextManager[Any]] = []

    def __enter__(self) -> None:
        for factory in tuple(_spans):
            try:
                manager = factory(self._operation, self._attributes)
                manager.__enter__()
            except Exception:
                failed(factory, f"opening the span of {self._operation}")
            else:
                self._open.append(manager)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        stop: BaseException | None = None
        while self._open:
            manager = self._open.pop()
            try:
                # Its return value is ignored: an observer cannot swallow the call's exception.
                manager.__exit__(exc_type, exc, tb)
            except Exception:
                failed(manager, f"closing the span of {self._operation}")
            except BaseException as caught:  # KeyboardInterrupt ...: close the others first
                stop = stop or caught
        if stop is not None:
            raise stop


def observe_session_call(
    session: Any,
    operation: str,
    logger: logging.Logger,
    fn: Callable[..., Any],
    /,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Run ``fn(session, *args, **kwargs)`` and report it (the slow path of a dual call).

    ``model`` / ``trigger`` come from the returned Result, or from keyword
    ``sg_model`` / ``sg_trigger`` hints given by the caller; ``scope`` from
    ``sg_scope`` (hints are never passed on to ``fn``).
    """
    model = kwargs.pop("sg_model", None)
    trigger = kwargs.pop("sg_trigger", None)
    scope = kwargs.pop("sg_scope", None)
    attributes: dict[str, Any] = {"stateguard.operation": operation}
    if model is not None:
        attributes["stateguard.model"] = getattr(model, "__name__", str(model))
    if trigger is not None:
        attributes["stateguard.trigger"] = trigger
    if scope is not None:
        attributes["stateguard.scope"] = scope
    start = time.perf_counter()
    error: BaseException | None = None
    value: Any = None
    with _Spans(operation, attributes) if _spans else contextlib.nullcontext():
        try:
            value = fn(session, *args, **kwargs)
        except BaseException as caught:
            error = caught
            raise
        finally:
            duration = time.perf_counter() - start
            try:
                counts: dict[str, int] | None = None
                if error is None:
                    outcome, model_name, trigger_name, counts = _describe(operation, value)
                else:
                    outcome, model_name, trigger_name = type(error).__name__, None, None
                model_name = model_name or attributes.get("stateguard.model")
                model_obj = value.model if isinstance(value, Result) else model
                deliver(
                    GuardEvent(
                        operation=operation,
                        outcome=outcome,
                        duration=duration,
                        model=model_name,
                        scope=scope,
                        trigger=trigger_name or trigger,
                        backend=_backend_of(session, model_obj),
                        error=error,
                        counts=counts,
                    ),
                    logger,
                )
            except Exception:  # describing an odd return value: the call's outcome still stands
                failed(deliver, f"reporting {operation}")
    return value


@contextlib.contextmanager
def observed(
    operation: str,
    logger: logging.Logger,
    *,
    model: str | None = None,
    scope: str | None = None,
    backend: str | None = None,
) -> Iterator[dict[str, Any]]:
    """Report the block as one call of ``operation`` (for calls that take no session).

    The block may set ``box["outcome"]`` (default ``"OK"``), ``box["retries"]`` and
    ``box["backend"]``::

        with observed("redis_token.consume", log, scope=scope, backend="redis") as box:
            result = ...
            box["outcome"] = result.outcome.name
    """
    box: dict[str, Any] = {"outcome": "OK", "retries": 0}
    attributes: dict[str, Any] = {"stateguard.operation": operation}
    if model is not None:
        attributes["stateguard.model"] = model
    if scope is not None:
        attributes["stateguard.scope"] = scope
    start = time.perf_counter()
    error: BaseException | None = None
    with _Spans(operation, attributes) if _spans else contextlib.nullcontext():
        try:
            yield box
        except BaseException as caught:
            error = caught
            raise
        finally:
            try:
                deliver(
                    GuardEvent(
                        operation=operation,
                        outcome=type(error).__name__ if error is not None else str(box["outcome"]),
                        duration=time.perf_counter() - start,
                        model=model,
                        scope=scope,
                        retries=int(box["retries"]),
                        backend=box.get("backend", backend),
                        error=error,
                    ),
                    logger,
                )
            except Exception:  # a box the block filled oddly: the block's outcome still stands
                failed(deliver, f"reporting {operation}")


def watch(
    operation: str,
    logger: logging.Logger,
    *,
    model: str | None = None,
    scope: str | None = None,
    backend: str | None = None,
) -> AbstractContextManager[dict[str, Any]]:
    """``observed()`` when anything listens (or ``logger`` is at DEBUG), else a no-op block.

    The block writes to the box it gets either way; unobserved, nobody reads it.
    """
    if hooked or logger.isEnabledFor(logging.DEBUG):
        return observed(operation, logger, model=model, scope=scope, backend=backend)
    return contextlib.nullcontext({})
