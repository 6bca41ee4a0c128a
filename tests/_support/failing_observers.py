"""Observers that raise, for the tests that observers never change what stateguard does.

:class:`FailingProcessor` is an OpenTelemetry span processor raising when a span starts or ends
(added to a real SDK ``TracerProvider``); :class:`QuietHandler` is a logging handler that keeps
nothing, for a raising filter to sit on; :func:`raising_listener_and_span` registers, for a block,
an outcome listener that raises on every event and a span hook that raises where it is told.
Everything they raise is an :class:`ObserverBug`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

from stateguard.observe import on_event, on_span

__all__ = ["FailingProcessor", "ObserverBug", "QuietHandler", "RaisingSpan", "raising_listener_and_span"]


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


class RaisingSpan:
    """A span (what an ``on_span`` hook returns) whose entry (``where="enter"``) or exit raises."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __enter__(self) -> None:
        if self.where == "enter":
            raise ObserverBug("span entry broke")

    def __exit__(self, *exc: object) -> None:
        if self.where == "exit":
            raise ObserverBug("span exit broke")


@contextmanager
def raising_listener_and_span(where: str) -> Iterator[None]:
    """For the block: an ``on_event`` listener raising on every event, and an ``on_span`` hook raising
    when it is called (``where="factory"``) or returning a span raising on entry or exit."""

    def listener(_event: Any) -> None:
        raise ObserverBug("listener broke")

    def span(_operation: str, _attributes: dict[str, Any]) -> RaisingSpan:
        if where == "factory":
            raise ObserverBug("span factory broke")
        return RaisingSpan(where)

    remove = [on_event(listener), on_span(span)]
    try:
        yield
    finally:
        for undo in remove:
            undo()
