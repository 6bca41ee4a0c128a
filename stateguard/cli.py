"""The ``stateguard`` command line (standard library ``argparse`` only).

::

    $ stateguard demo --db postgresql+psycopg://postgres@127.0.0.1:5432/test

Exit codes: 0 ok, 1 an invariant was violated or problems were found,
2 usage error (bad arguments, unreachable database, missing driver).
:func:`main` takes the arguments and returns the exit code, so it can be
tested without a subprocess.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, TextIO

from sqlalchemy import Engine, create_engine
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url

from . import __version__
from .demo import Progress, SchemeRow, render, run_demo
from .engine import sqlite_engine

__all__ = ["main"]

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2

DEFAULT_DB = "sqlite:///stateguard-demo.db"

_EXIT_CODES = """\
exit codes:
  0  ok
  1  an invariant was violated or problems were found
  2  usage error (bad arguments, unreachable database, missing driver)
"""

#: Which extra installs the driver a URL names (for the "not installed" hint).
_EXTRAS = {"psycopg": "postgres", "pymysql": "mysql"}


class UsageError(Exception):
    """Reported as one line on stderr, exit code 2."""


# --------------------------------------------------------------------------
# Terminal output
# --------------------------------------------------------------------------


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def use_color(stream: TextIO) -> bool:
    """Colour only for a terminal, and never when ``NO_COLOR`` is set (https://no-color.org)."""
    return not os.environ.get("NO_COLOR") and _isatty(stream)


class StderrProgress(Progress):
    """Progress on stderr, shown only once the run has taken longer than ``delay`` seconds.

    On a terminal: one line redrawn in place.  Otherwise (CI logs): one line
    per finished scenario.
    """

    def __init__(self, stream: TextIO, *, delay: float = 1.0, interval: float = 0.1) -> None:
        self.stream = stream
        self.tty = _isatty(stream)
        self.delay = delay
        self.interval = interval
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
            elif now - self.started > self.delay:
                verdict = "ok" if all(r.ok for r in rows) else "VIOLATED"
                self.stream.write(
                    f"stateguard demo: [{self._index}/{self._count}] {self._title}: "
                    f"{self._done} deliveries in {now - self._scenario_started:.1f}s, invariant {verdict}\n"
                )
                self.stream.flush()

    def _draw(self, *, force: bool = False) -> None:
        if not self.tty:
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


# --------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------


def _safe(url: URL) -> str:
    return url.render_as_string(hide_password=True)


def _first_line(error: BaseException) -> str:
    orig = getattr(error, "orig", None) or error
    args: tuple[Any, ...] = tuple(getattr(orig, "args", ()))
    if len(args) == 2 and isinstance(args[0], int) and isinstance(args[1], str) and args[1]:
        # PyMySQL's (code, message) pair reads better as "message (code)".
        return f"{args[1].splitlines()[0]} ({args[0]})"
    text = str(orig).strip()
    return text.splitlines()[0].strip() if text else type(orig).__name__


def open_engine(db: str, *, workers: int) -> Engine:
    """An engine for ``db`` that has connected once, or :class:`UsageError` saying why not.

    SQLite URLs go through :func:`stateguard.sqlite_engine` (WAL, busy
    timeout, ``BEGIN IMMEDIATE``); the pool has room for every worker.
    """
    try:
        url = make_url(db)
    except sa_exc.ArgumentError as error:
        raise UsageError(f"not a database URL: {db!r} (e.g. {DEFAULT_DB})") from error
    backend = url.get_backend_name()
    pool: dict[str, Any] = {"pool_size": workers, "max_overflow": workers}
    try:
        if backend == "sqlite":
            database = url.database or ""
            if database in ("", ":memory:") or url.query.get("mode") == "memory":
                # Every worker needs its own connection to the same database.
                raise UsageError("the demo needs a SQLite file, e.g. sqlite:///stateguard-demo.db")
            engine = sqlite_engine(db, **pool)
        else:
            connect_args: dict[str, Any] = {}
            timeout_known = url.get_driver_name() in ("psycopg", "psycopg2", "pymysql")
            if timeout_known and "connect_timeout" not in url.query:
                # An unreachable host should fail in seconds, not after the OS's TCP timeout.
                connect_args["connect_timeout"] = 5
            engine = create_engine(url, connect_args=connect_args, **pool)
    except sa_exc.NoSuchModuleError as error:
        raise UsageError(f"unknown database URL scheme {url.drivername!r} in {_safe(url)}") from error
    except ImportError as error:
        driver = url.get_driver_name()
        extra = _EXTRAS.get(driver)
        if extra is not None:
            hint = f"pip install 'stateguard[{extra}]'"
        elif backend == "postgresql":
            hint = "install it, or use postgresql+psycopg:// with pip install 'stateguard[postgres]'"
        elif backend in ("mysql", "mariadb"):
            hint = f"install it, or use {backend}+pymysql:// with pip install 'stateguard[mysql]'"
        else:
            hint = "install it"
        raise UsageError(f"the {driver} driver for {backend} is not installed ({error}); {hint}") from error
    try:
        with engine.connect():
            pass
    except sa_exc.SQLAlchemyError as error:
        engine.dispose()
        raise UsageError(f"cannot connect to {_safe(url)}: {_first_line(error)}") from error
    return engine


# --------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _cmd_demo(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    engine = open_engine(args.db, workers=args.workers)
    try:
        report = run_demo(
            engine,
            workers=args.workers,
            orders=args.orders,
            seed=args.seed,
            progress=StderrProgress(err),
        )
    except sa_exc.SQLAlchemyError as error:
        err.write(f"stateguard demo: database error: {_first_line(error)}\n")
        return EXIT_PROBLEMS
    finally:
        engine.dispose()
    out.write(render(report, color=use_color(out)) + "\n")
    out.flush()
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``stateguard`` and its commands."""
    parser = argparse.ArgumentParser(
        prog="stateguard",
        description="Safe retried, duplicated and concurrent writes for SQLAlchemy.",
        epilog=_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"stateguard {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo = commands.add_parser(
        "demo",
        help="fire duplicate and concurrent requests at a database and check the invariants",
        description=(
            "Create the sg_demo_* tables (dropped and recreated on every run), then fire\n"
            "duplicate and concurrent pay / ship / cancel requests from many worker threads,\n"
            "as retries, redeliveries and double-clicks would, for each scheme: state machine,\n"
            "optimistic version check, insert-once.  Prints one row per scheme and checks\n"
            "that side effects ran exactly once per APPLIED call."
        ),
        epilog=_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument(
        "--db",
        default=DEFAULT_DB,
        metavar="URL",
        help=(
            f"SQLAlchemy database URL (default: {DEFAULT_DB}, a file in the current folder; "
            "e.g. postgresql+psycopg://postgres@127.0.0.1:5432/test or "
            "mysql+pymysql://root@127.0.0.1:3306/test)"
        ),
    )
    demo.add_argument("--workers", type=_positive, default=8, metavar="N", help="worker threads (default: 8)")
    demo.add_argument(
        "--orders", type=_positive, default=200, metavar="N", help="orders per scheme (default: 200)"
    )
    demo.add_argument(
        "--seed", type=int, default=None, metavar="N", help="seed of the request plan (default: random)"
    )
    demo.set_defaults(handler=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``stateguard`` command line and return its exit code.

    ::

        $ stateguard demo --orders 50
        >>> main(["demo", "--db", "sqlite:///demo.db", "--orders", "50"])
        0
    """
    parser = build_parser()
    try:
        args = parser.parse_args(None if argv is None else list(argv))
    except SystemExit as exit_:
        # argparse exits itself for --help (0) and usage errors (2).
        status = exit_.code
        return status if isinstance(status, int) else (EXIT_OK if status is None else EXIT_USAGE)
    out, err = sys.stdout, sys.stderr
    try:
        code = int(args.handler(args, out, err))
    except UsageError as error:
        err.write(f"stateguard {args.command}: {error}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        err.write("\nstateguard: interrupted\n")
        return 130
    return code
