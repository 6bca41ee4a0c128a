"""What the command line shows on a terminal: colour or not, the demo's and the relay's progress.

:class:`Progress` is what :func:`stateguard.tooling.demo.run_demo` reports to
(its base ignores every event); :class:`StderrProgress` draws it on stderr.
Both live here, away from the demo's mapped models, so that ``stateguard``
commands other than ``demo`` never import them::

    run_demo(engine, progress=StderrProgress(sys.stderr))
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from .demo.results import SchemeRow

__all__ = ["Progress", "RelayProgress", "ScanProgress", "StderrProgress", "isatty", "use_color"]


def isatty(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal (``False`` for a closed stream or one without ``isatty``)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def use_color(stream: TextIO) -> bool:
    """Colour only for a terminal, and never when ``NO_COLOR`` is set (https://no-color.org)."""
    return not os.environ.get("NO_COLOR") and isatty(stream)


class Progress:
    """Receives progress events; this base class ignores them (the CLI draws them)."""

    def begin(self, index: int, count: int, title: str) -> None:
        """Scenario ``index`` (1-based) of ``count`` starts."""

    def total(self, deliveries: int) -> None:
        """The running scenario will make ``deliveries`` deliveries."""

    def advance(self) -> None:
        """One delivery finished (called from worker threads)."""

    def end(self, rows: Sequence[SchemeRow]) -> None:
        """The running scenario finished."""

    def done(self) -> None:
        """Every scenario finished."""


class StderrProgress(Progress):
    """The demo's progress on stderr.

    On a terminal: one line redrawn in place (only once the run has taken
    longer than ``delay`` seconds), then a last line at 100%.  Otherwise
    (CI logs, pipes): one line per finished scenario with the share of
    scenarios done, a line every ``every`` seconds inside a long scenario,
    each flushed at once, the last one at 100%::

        stateguard demo: [1/6] 17% state machine: 2610 deliveries in 1.2s, invariant ok
    """

    def __init__(
        self, stream: TextIO, *, delay: float = 1.0, interval: float = 0.1, every: float = 5.0
    ) -> None:
        self.stream = stream
        self.tty = isatty(stream)
        self.delay = delay
        self.interval = interval
        self.every = every
        self._logged = time.monotonic()
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._title = ""
        self._index = 0
        self._count = 0
        self._done = 0
        self._total = 0
        self._scenario_started = self.started
        self._drawn = 0.0
        self._dirty = False

    def begin(self, index: int, count: int, title: str) -> None:
        with self._lock:
            self._index, self._count, self._title = index, count, title
            self._done = self._total = 0
            self._scenario_started = time.monotonic()

    def total(self, deliveries: int) -> None:
        with self._lock:
            self._total += deliveries
            self._draw(force=True)

    def advance(self) -> None:
        with self._lock:
            self._done += 1
            self._draw()

    def end(self, rows: Sequence[SchemeRow]) -> None:
        with self._lock:
            now = time.monotonic()
            if self.tty:
                self._clear()
                return
            verdict = "ok" if all(r.ok for r in rows) else "VIOLATED"
            share = 100 * self._index // max(1, self._count)
            self._write(
                f"stateguard demo: [{self._index}/{self._count}] {share}% {self._title}: "
                f"{self._done} deliveries in {now - self._scenario_started:.1f}s, invariant {verdict}"
            )

    def done(self) -> None:
        with self._lock:
            self._clear()
            self._write(
                f"stateguard demo: 100%: {self._count} scenarios in {time.monotonic() - self.started:.1f}s"
            )

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()
        self._logged = time.monotonic()

    def _draw(self, *, force: bool = False) -> None:
        if not self.tty:
            now = time.monotonic()
            if self._total and now - self._logged >= self.every:
                # A long scenario in a log: a sign of life with the share of the scenario done.
                self._write(
                    f"stateguard demo: [{self._index}/{self._count}] {self._title}: "
                    f"{self._done}/{self._total} deliveries ({100 * self._done // self._total}%)"
                )
            return
        now = time.monotonic()
        if now - self.started < self.delay or (not force and now - self._drawn < self.interval):
            return
        self._drawn = now
        share = f" {100 * self._done // self._total:3d}%" if self._total else ""
        where = f"[{self._index}/{self._count}] {self._title}"
        self.stream.write(f"\r\x1b[K{where}: {self._done}/{self._total}{share}")
        self.stream.flush()
        self._dirty = True

    def _clear(self) -> None:
        if self._dirty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._dirty = False


class RelayProgress:
    """``stateguard relay``'s progress on stderr: events published and the rate.

    On a terminal: one line redrawn in place every ``interval`` seconds.
    Otherwise (logs): one line every ``every`` seconds while events are being
    published.  :meth:`finish` always writes the summary line::

        progress = RelayProgress(sys.stderr, target="the Redis stream 'orders'")
        progress.update(relay_total)          # from time to time
        progress.finish(relay_total, "stopped by SIGTERM")
    """

    def __init__(
        self,
        stream: TextIO,
        *,
        stream_name: str = "",
        target: str | None = None,
        interval: float = 0.5,
        every: float = 10.0,
    ) -> None:
        self.stream = stream
        self.tty = isatty(stream)
        self.name = stream_name
        self.interval = interval
        self.every = every
        self.started = time.monotonic()
        self._last_time = self.started
        self._last_count = 0
        self._logged = 0
        self._dirty = False
        where = target if target is not None else f"the Redis stream {stream_name!r}"
        self.write(f"stateguard relay: publishing to {where}; SIGTERM or Ctrl-C stops")

    def write(self, line: str) -> None:
        """One line on the stream (clearing a redrawn line first)."""
        if self._dirty:
            self.stream.write("\r\x1b[K")
            self._dirty = False
        self.stream.write(line + "\n")
        self.stream.flush()

    def update(self, published: int) -> None:
        """``published`` events so far: redraw (terminal) or log a line when ``every`` seconds passed."""
        now = time.monotonic()
        if self.tty:
            if now - self._last_time < self.interval:
                return
            rate = (published - self._last_count) / max(now - self._last_time, 1e-9)
            self._last_time, self._last_count = now, published
            self.stream.write(f"\r\x1b[Kstateguard relay: {published} events published, {rate:,.0f}/s")
            self.stream.flush()
            self._dirty = True
        elif now - self._last_time >= self.every:
            if published != self._last_count:
                rate = (published - self._last_count) / (now - self._last_time)
                self.write(f"stateguard relay: {published} events published, {rate:,.0f}/s")
            self._last_time, self._last_count = now, published

    def finish(self, published: int, why: str) -> None:
        """The summary line: why the relay stopped, the total and the average rate."""
        elapsed = time.monotonic() - self.started
        rate = published / elapsed if elapsed > 0 else 0.0
        self.write(f"stateguard relay: {why}: {published} events published in {elapsed:.1f}s ({rate:,.0f}/s)")


class ScanProgress:
    """One line on a terminal naming the statement running and for how long, redrawn in place.

    Drawn only once a step has run longer than ``delay`` seconds (a
    ``GROUP BY`` over millions of rows), from a background thread, since one
    statement gives no progress of its own; cleared when the step ends,
    whatever happens.  Silent when the stream is no terminal or ``enabled``
    is false (``--json``)::

        progress = ScanProgress(sys.stderr)
        with progress.step("counting orders.status"):
            conn.execute(...)
    """

    def __init__(
        self, stream: TextIO, *, enabled: bool = True, delay: float = 0.5, interval: float = 0.1
    ) -> None:
        self.stream = stream
        self.active = enabled and isatty(stream)
        self.delay = delay
        self.interval = interval
        self.index = 0
        self.count = 0

    @contextmanager
    def step(self, title: str) -> Iterator[None]:
        """Run the body as step ``title``; the line is drawn while it runs and cleared when it ends."""
        self.index += 1
        if not self.active:
            yield
            return
        done = threading.Event()
        drawn = threading.Event()
        lock = threading.Lock()
        started = time.monotonic()
        where = f"[{self.index}/{self.count}] " if self.count else ""

        def tick() -> None:
            spinner = itertools.cycle("|/-\\")
            if done.wait(self.delay):
                return
            while not done.is_set():
                with lock:
                    if done.is_set():
                        return
                    elapsed = time.monotonic() - started
                    self.stream.write(
                        f"\r\x1b[Kstateguard inspect: {where}{title} {next(spinner)} {elapsed:.1f}s"
                    )
                    self.stream.flush()
                    drawn.set()
                done.wait(self.interval)

        thread = threading.Thread(target=tick, name="stateguard-inspect-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            with lock:
                done.set()
                if drawn.is_set():
                    self.stream.write("\r\x1b[K")
                    self.stream.flush()
            thread.join()
