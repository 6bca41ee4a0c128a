"""OpenTelemetry for stateguard: outcome metrics and one span per guarded call.

Built on ``opentelemetry-api`` only (the ``otel`` extra); the application
brings the SDK and its exporters, as with any instrumented library::

    from stateguard.otel import instrument

    uninstrument = instrument()          # the global meter and tracer providers
    ...
    uninstrument()

From the :mod:`stateguard.observe` events it records a counter
``stateguard.calls`` (by operation, model, outcome and ``db.system``), a
histogram ``stateguard.duration`` (seconds), and a span ``stateguard
<operation>`` (kind INTERNAL) around every call, current while the call runs,
so the statements it sends nest under it when SQLAlchemy is instrumented.  A
span processor, exporter hook or metric instrument that raises is logged on
``stateguard.observe`` and never reaches the call.  See
``docs/how-to/observability.md``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from types import TracebackType
from typing import Any

from opentelemetry import metrics as otel_metrics
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from . import __version__
from .exceptions import InvalidArgument
from .observe import GuardEvent, failed, on_event, on_span

__all__ = ["instrument"]

_SCOPE = "stateguard"
#: The remover of the active instrumentation, if any (one at a time).
_active: Callable[[], None] | None = None
_current: contextvars.ContextVar[Span | None] = contextvars.ContextVar("stateguard_otel_span", default=None)


def instrument(
    *,
    meter_provider: otel_metrics.MeterProvider | None = None,
    tracer_provider: trace.TracerProvider | None = None,
    spans: bool = True,
    metrics: bool = True,
) -> Callable[[], None]:
    """Record stateguard's calls as OpenTelemetry metrics and spans; return the function that stops it.

    One instrumentation at a time: a second call before the first one's stop
    function ran is :class:`~stateguard.InvalidArgument` (it would count every
    call twice).

    :param meter_provider: where the metrics go (default: the global one).
    :param tracer_provider: where the spans go (default: the global one).
    :param spans: open one span per guarded call (``False``: metrics only).
    :param metrics: record the counter and the histogram (``False``: spans only).

    ::

        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.trace import TracerProvider

        stop = instrument(meter_provider=MeterProvider(...), tracer_provider=TracerProvider(...))
    """
    if not spans and not metrics:
        raise InvalidArgument("instrument() with spans=False and metrics=False records nothing; enable one")
    global _active
    if _active is not None:
        # A second instrumentation would count every call twice (app factories, test fixtures).
        raise InvalidArgument(
            "stateguard.otel.instrument() is already active; call the function the first instrument() "
            "returned before instrumenting again"
        )
    removers: list[Callable[[], None]] = []
    if metrics:
        meter = (meter_provider or otel_metrics.get_meter_provider()).get_meter(_SCOPE, __version__)
        calls = meter.create_counter(
            "stateguard.calls", unit="{call}", description="Guarded calls (rows for many/where) by outcome"
        )
        duration = meter.create_histogram(
            "stateguard.duration", unit="s", description="Duration of guarded calls"
        )

        def record(event: GuardEvent) -> None:
            attributes = _attributes(event)
            if event.counts is not None:
                for outcome, n in event.counts.items():
                    calls.add(n, {**attributes, "stateguard.outcome": outcome})
            else:
                calls.add(1, attributes)
            duration.record(event.duration, attributes)

        removers.append(on_event(record))
    if spans:
        tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer(_SCOPE, __version__)

        def span(operation: str, attributes: dict[str, Any]) -> _CallSpan:
            return _CallSpan(tracer, operation, attributes)

        def finish(event: GuardEvent) -> None:
            opened = _current.get()
            if opened is None or not opened.is_recording():
                return
            opened.set_attributes(_attributes(event))
            if event.counts is not None:
                for outcome, n in event.counts.items():
                    opened.set_attribute(f"stateguard.rows.{outcome}", n)
            if event.error is not None:
                opened.record_exception(event.error)
                opened.set_status(Status(StatusCode.ERROR, f"{type(event.error).__name__}: {event.error}"))

        removers.append(on_span(span))
        removers.append(on_event(finish))

    def uninstrument() -> None:
        global _active
        for remove in removers:
            remove()
        removers.clear()
        if _active is uninstrument:
            _active = None

    _active = uninstrument
    return uninstrument


class _CallSpan:
    """The span of one guarded call, current while the call runs.

    A span that cannot start (a span processor raising in ``on_start``) is
    logged and the call runs without one; its ``finish`` then finds no span
    rather than the enclosing call's (``_current`` is cleared first).  Ending
    it may raise (``on_end``): :class:`stateguard.observe` logs that, and the
    span is ended and detached by then (the SDK sets its end time and
    OpenTelemetry restores the context before ``on_end`` runs).
    """

    __slots__ = ("_attributes", "_operation", "_scope", "_token", "_tracer")

    def __init__(self, tracer: trace.Tracer, operation: str, attributes: dict[str, Any]) -> None:
        self._tracer = tracer
        self._operation = operation
        self._attributes = attributes
        self._scope: contextlib.AbstractContextManager[Span] | None = None
        self._token: contextvars.Token[Span | None] | None = None

    def __enter__(self) -> None:
        self._token = _current.set(None)
        try:
            scope = self._tracer.start_as_current_span(
                f"stateguard {self._operation}",
                kind=SpanKind.INTERNAL,
                attributes=self._attributes,
                record_exception=False,
                set_status_on_exception=False,
            )
            _current.set(scope.__enter__())
        except Exception:
            failed(self._tracer, f"starting the span of {self._operation}")
            return
        self._scope = scope

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self._scope is not None:
                self._scope.__exit__(exc_type, exc, tb)
        finally:
            if self._token is not None:
                _current.reset(self._token)


def _attributes(event: GuardEvent) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "stateguard.operation": event.operation,
        "stateguard.outcome": event.outcome,
    }
    if event.model is not None:
        attributes["stateguard.model"] = event.model
    if event.scope is not None:
        attributes["stateguard.scope"] = event.scope
    if event.trigger is not None:
        attributes["stateguard.trigger"] = event.trigger
    if event.backend is not None:
        attributes["db.system"] = event.backend
    if event.retries:
        attributes["stateguard.retries"] = event.retries
    return attributes
