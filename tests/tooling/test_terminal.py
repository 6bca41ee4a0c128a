"""Terminal output: colour only for a terminal without NO_COLOR, and the demo's progress on stderr."""

from __future__ import annotations

import io

import pytest

from stateguard.tooling import terminal

from ._helpers import Terminal


def test_colour_only_on_a_terminal_without_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    """Colour is used for a terminal, not for a pipe, and never when NO_COLOR is set."""
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert terminal.use_color(Terminal()) is True
    assert terminal.use_color(io.StringIO()) is False
    monkeypatch.setenv("NO_COLOR", "1")
    assert terminal.use_color(Terminal()) is False


def test_progress_on_a_terminal_is_one_line_redrawn_then_cleared() -> None:
    """On a terminal, progress is one line redrawn with \\r and erased when the scenario ends."""
    stream = Terminal()
    progress = terminal.StderrProgress(stream, delay=0.0, interval=0.0)
    progress.begin(1, 2, "state machine")
    progress.total(4)
    for _ in range(4):
        progress.advance()
    progress.end([])
    text = stream.getvalue()
    assert "\n" not in text
    assert "[1/2] state machine: 4/4 100%" in text
    assert text.endswith("\r\x1b[K")


def test_progress_in_a_log_is_one_line_per_scenario_after_a_second() -> None:
    """Not on a terminal: nothing while the run is short, then one plain line per finished scenario."""
    stream = io.StringIO()
    progress = terminal.StderrProgress(stream, delay=1.0)
    progress.begin(1, 2, "state machine")
    progress.total(2)
    progress.advance()
    progress.end([])
    assert stream.getvalue() == ""  # finished within the first second
    progress.started -= 5  # the run has now lasted more than a second
    progress.begin(2, 2, "insert-once")
    progress.total(3)
    for _ in range(3):
        progress.advance()
    progress.end([])
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and "\r" not in stream.getvalue()
    assert lines[0].startswith("stateguard demo: [2/2] insert-once: 3 deliveries in ")
    assert lines[0].endswith("invariant ok")
