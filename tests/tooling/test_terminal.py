"""Terminal output: colour only for a terminal without NO_COLOR, and the demo's progress on stderr."""

from __future__ import annotations

import io

import pytest

from stateguard.tooling import terminal
from tests.tooling._helpers import Terminal


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


def test_progress_in_a_log_is_one_line_per_scenario_ending_at_100_percent() -> None:
    """Not on a terminal: a plain line per finished scenario at once, with the share of scenarios done,
    a sign of life inside a long scenario, and a last line at 100%."""
    stream = io.StringIO()
    progress = terminal.StderrProgress(stream, delay=1.0, every=3600.0)
    progress.begin(1, 2, "state machine")
    progress.total(2)
    progress.advance()
    progress.end([])
    (first,) = stream.getvalue().splitlines()  # at once, not after the first second
    assert first.startswith("stateguard demo: [1/2] 50% state machine: 1 deliveries in ")
    progress.begin(2, 2, "insert-once")
    progress.total(3)
    progress.every = 0.0  # a long scenario: a line at each delivery now
    progress.advance()
    progress.every = 3600.0
    for _ in range(2):
        progress.advance()
    progress.end([])
    progress.done()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and "\x1b[" not in stream.getvalue()
    assert lines[1] == "stateguard demo: [2/2] insert-once: 1/3 deliveries (33%)"
    assert lines[2].startswith("stateguard demo: [2/2] 100% insert-once: 3 deliveries in ")
    assert lines[2].endswith("invariant ok")
    assert lines[3].startswith("stateguard demo: 100%: 2 scenarios in ") and len(lines) == 4


def test_progress_on_a_terminal_ends_with_a_line_at_100_percent() -> None:
    """On a terminal the redrawn line is cleared, and the run ends with one line at 100%."""
    stream = Terminal()
    progress = terminal.StderrProgress(stream, delay=0.0, interval=0.0)
    progress.begin(1, 1, "flash sale")
    progress.total(1)
    progress.advance()
    progress.end([])
    progress.done()
    assert stream.getvalue().endswith("\r\x1b[Kstateguard demo: 100%: 1 scenarios in 0.0s\n")
