"""Observers that raise, for the tests that observers never change what stateguard does.

:class:`FailingProcessor` is an OpenTelemetry span processor raising when a span starts or ends
(added to a real SDK ``TracerProvider``); :class:`QuietHandler` is a logging handler that keeps
nothing, for a raising filter to sit on.  Everything they raise is an :class:`ObserverBug`.
"""

from __future__ import annotations

import logging

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

__all__ = ["FailingProcessor", "ObserverBug", "QuietHandler"]


class ObserverBug(RuntimeError):
    """What every broken observer raises."""


class FailingProcessor(SpanProcessor):
    """A span processor that raises when a span starts (``phase="start"``), or when it ends (``"end"``)."""

    def __init__(self, phase: str) -> None:
        self.phase = phase

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        if self.phase == "start":
            raise ObserverBug(f"span processor on_start: {span.name}")

    def on_end(self, span: ReadableSpan) -> None:
        if self.phase == "end":
            raise ObserverBug(f"span processor on_end: {span.name}")


class QuietHandler(logging.Handler):
    """A handler that keeps nothing (its filters still run)."""

    def emit(self, record: logging.LogRecord) -> None:
        pass
