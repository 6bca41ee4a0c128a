"""OpenTelemetry for stateguard: outcome metrics and one span per guarded call.

Built on ``opentelemetry-api`` only (the ``otel`` extra); the application
brings the SDK and its exporters, as with any instrumented library::

    from stateguard.otel import instrument

    uninstrument = instrument()          # the global meter and tracer providers
    ...
    uninstrument()

What it records, from the :mod:`stateguard.observe` events:

- ``stateguard.calls``: a counter of guarded calls (rows, for ``many`` /
  ``where``) by ``stateguard.operation``, ``stateguard.model``,
  ``stateguard.outcome`` and ``db.system`` — graph REPEATED / REJECTED /
  INSUFFICIENT rates from it;
- ``stateguard.duration``: a histogram of call durations in seconds, by
  operation, model and outcome;
- a span ``stateguard <operation>`` (kind INTERNAL) around every call, current
  while the call runs, so the statements it sends nest under it when
  SQLAlchemy is instrumented (``opentelemetry-instrumentation-sqlalchemy``),
  and it nests under the application's own span.  It carries the same
  attributes; a call that raised has status ERROR and the exception recorded.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

from opentelemetry import metrics as otel_metrics
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from . import __version__
from .exceptions import InvalidArgument
from .observe import GuardEvent, on_event, on_span

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

        @contextlib.contextmanager
        def span(operation: str, attributes: dict[str, Any]) -> Iterator[None]:
            with tracer.start_as_current_span(
                f"stateguard {operation}",
                kind=SpanKind.INTERNAL,
                attributes=attributes,
                record_exception=False,
                set_status_on_exception=False,
            ) as opened:
                token = _current.set(opened)
                try:
                    yield
                finally:
                    _current.reset(token)

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
