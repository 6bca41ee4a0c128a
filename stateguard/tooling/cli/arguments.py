"""Argument types of the ``stateguard`` commands: each value is checked while parsing, before connecting.

Each is an argparse ``type``: it returns the value or raises
``argparse.ArgumentTypeError`` with a one-line reason, which argparse
reports as a usage error (exit code 2).
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable
from typing import TypeVar

from ...outbox.sinks.redis_streams import MAX_MAXLEN

#: The longest ``--pause``, ``--lease``, ``--idle`` and ``--stale`` (seconds), about 31 years.
#: Below every bound these values meet: ``time.sleep`` and threading's waits stop at 2**63 ns
#: of the monotonic clock (about 292 years less the uptime; ``time.sleep(9.3e9)`` is an
#: OverflowError), :class:`~datetime.timedelta` at 999999999 days, the databases' BIGINT
#: milliseconds at 2**63; and ``threading.TIMEOUT_MAX`` where a platform's is smaller.
MAX_SECONDS: float = min(1e9, threading.TIMEOUT_MAX)
#: The longest ``--outbox-retention`` and ``--consumed-retention`` (hours), about 114 years: as
#: milliseconds subtracted from the database's clock it stays far inside a BIGINT and inside
#: :class:`~datetime.timedelta` (``timedelta(hours=1e12)`` is an OverflowError).
MAX_HOURS = 1_000_000
#: Most ``demo --workers`` (each thread holds connections of its own: a server's
#: max_connections refuses far fewer) and ``demo --orders`` (the demo keeps its plan in memory).
MAX_WORKERS = 1000
MAX_ORDERS = 1_000_000
#: The largest ``--batch``, ``--max-batches`` and ``--limit``: a BIGINT, the largest LIMIT
#: every database takes (SQLite's driver raises OverflowError past it).
MAX_COUNT = 2**63 - 1
#: Longest text argument: Linux's MAX_ARG_STRLEN (128 KiB); a longer one never came from a shell.
MAX_TEXT = 131_072

N = TypeVar("N", int, float)


def shown(text: str, longest: int = 60) -> str:
    """``text`` quoted for a message (its repr: non-UTF-8 bytes escaped), cut to ``longest``."""
    shown = repr(text)
    if len(shown) <= longest:
        return shown
    return f"{shown[: longest - 4]}...{shown[-1]} ({len(text)} characters)"


def _plain_number(value: float) -> str:
    return str(int(value)) if value == int(value) else str(value)


def _number(
    convert: Callable[[str], N], what: str, *, least: N, most: N, unit: str = ""
) -> Callable[[str], N]:
    """An argparse ``type``: ``convert(text)``, refused with a one-line reason outside ``least..most``."""
    bound = f"at least {_plain_number(least)} and at most {_plain_number(most)}{unit}"

    def parse(text: str) -> N:
        try:
            value = convert(text)
        except (ValueError, OverflowError):  # int() of over 4300 digits is a ValueError too
            raise argparse.ArgumentTypeError(f"not {what}: {shown(text)}") from None
        if not least <= value <= most:  # written so that NaN is refused too
            raise argparse.ArgumentTypeError(f"must be {bound}, got {shown(text)}")
        return value

    return parse


positive_int = _number(int, "a whole number", least=1, most=MAX_COUNT)
worker_count = _number(int, "a whole number", least=1, most=MAX_WORKERS)
order_count = _number(int, "a whole number", least=1, most=MAX_ORDERS)
stream_length = _number(
    int, "a whole number", least=1, most=MAX_MAXLEN, unit=" (what Redis's XADD MAXLEN takes)"
)
nonnegative_seconds = _number(float, "a number", least=0.0, most=MAX_SECONDS, unit=" (seconds)")
positive_seconds = _number(float, "a number", least=0.001, most=MAX_SECONDS, unit=" (seconds)")
hours = _number(float, "a number", least=0.001, most=float(MAX_HOURS), unit=" (hours)")


def text_arg(text: str) -> str:
    """An argparse ``type`` for text: refused when not UTF-8, holding a NUL or longer than :data:`MAX_TEXT`.

    Python hands the command line's non-UTF-8 bytes over as lone surrogates
    (``os.fsdecode``): no database or Redis takes them.
    """
    if len(text) > MAX_TEXT:
        raise argparse.ArgumentTypeError(f"longer than {MAX_TEXT} characters: {shown(text)}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"not valid UTF-8: {shown(text)}") from None
    if "\x00" in text:
        raise argparse.ArgumentTypeError(f"contains a NUL character: {shown(text)}")
    return text
