"""The defaults page (docs/reference/defaults.md) is the code's defaults: every row matches a signature.

Each row names calls, options and defaults; the defaults are rendered from
the signatures (``inspect``) and the ``stateguard purge`` parser and compared
with the table's text, and every keyword option with a default of a listed
call must have a row.  A changed default fails here until the table says so.
"""

from __future__ import annotations

import argparse
import inspect
import re
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import stateguard
from stateguard.asgi import IdempotencyMiddleware
from stateguard.engine import async_sqlite_engine, sqlite_engine
from stateguard.ids import Snowflake
from stateguard.machine import bulk
from stateguard.redis import AsyncRedisLock, AsyncRedisTokens, RedisLock, RedisTokens
from stateguard.tooling.cli import build_parser

PAGE = Path(__file__).resolve().parent.parent.parent / "docs" / "reference" / "defaults.md"

#: The page's name of a call -> the callable whose signature holds its defaults.
CALLS: dict[str, Callable[..., Any]] = {
    "idempotent()": stateguard.idempotent,
    "idempotent_function()": stateguard.idempotent_function,
    "purge_expired()": stateguard.purge_expired,
    "purge_expired_tokens()": stateguard.purge_expired_tokens,
    "IdempotencyMiddleware": IdempotencyMiddleware.__init__,
    "issue_token()": stateguard.issue_token,
    "RedisTokens.issue()": RedisTokens.issue,
    "RedisTokens": RedisTokens.__init__,
    "AsyncRedisTokens": AsyncRedisTokens.__init__,
    "retry_on_conflict()": stateguard.retry_on_conflict,
    "RedisLock": RedisLock.__init__,
    "AsyncRedisLock": AsyncRedisLock.__init__,
    "advisory_lock()": stateguard.advisory_lock,
    "row_lock()": stateguard.row_lock,
    "Snowflake": Snowflake.__init__,
    "Trigger.many()": bulk.fire_many,
    "Trigger.where()": bulk.fire_where,
    "Relay": stateguard.Relay.__init__,
    "AsyncRelay": stateguard.AsyncRelay.__init__,
    "Relay.run()": stateguard.Relay.run,
    "AsyncRelay.run()": stateguard.AsyncRelay.run,
    "purge_published()": stateguard.purge_published,
    "purge_consumed()": stateguard.purge_consumed,
    "sqlite_engine()": sqlite_engine,
    "async_sqlite_engine()": async_sqlite_engine,
}


def _rows() -> list[tuple[list[str], list[str], list[str]]]:
    """(calls, options, default texts) per row of the table; an empty call cell repeats the row above."""
    section = PAGE.read_text(encoding="utf-8")
    rows: list[tuple[list[str], list[str], list[str]]] = []
    calls: list[str] = []
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith(("| call ", "|---")):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        calls = re.findall(r"`([^`]+)`", cells[0]) or calls
        options = re.findall(r"`([^`]+)`", cells[1])
        # "a / b" for two options; a trailing " (...)" is an explanation, not the value.
        defaults = [re.sub(r"\s+\(.*\)$", "", part.strip()) for part in cells[2].split(" / ")]
        rows.append((calls, options, defaults))
    return rows


def _seconds(value: float) -> str:
    return f"{value:g} s"


def render(value: Any) -> str:
    """A default as the table writes it."""
    if value is inspect.Parameter.empty:
        return "required"
    if value is None or isinstance(value, bool):
        return f"`{value}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
        return f"{seconds / 3600:g} h" if seconds % 3600 == 0 else _seconds(seconds)
    if isinstance(value, float):
        return _seconds(value)
    if isinstance(value, int):
        return "1 MiB" if value == 1024 * 1024 else str(value)
    if isinstance(value, tuple):
        return ", ".join(f"`{item}`" for item in value) if value else "`()`"
    if callable(value):
        module = getattr(value, "__module__", "") or ""
        name = value.__qualname__
        return f"`{name}`" if module.startswith("stateguard") else f"`{module}.{name}`"
    raise AssertionError(f"no rendering for {value!r}")


def _purge_defaults() -> dict[str, Any]:
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    purge = sub.choices["purge"]
    return {opt: action.default for action in purge._actions for opt in action.option_strings}


def _defaults_of(call: str) -> dict[str, Any]:
    if call == "stateguard purge":
        return _purge_defaults()
    params = inspect.signature(CALLS[call]).parameters.values()
    return {p.name: p.default for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def test_the_table_has_rows() -> None:
    """The section exists and has a row per documented option (a broken parse would pass everything)."""
    assert len(_rows()) >= 30


@pytest.mark.parametrize(("calls", "options", "defaults"), _rows(), ids=lambda v: "+".join(v))
def test_each_row_is_the_code_default(calls: list[str], options: list[str], defaults: list[str]) -> None:
    """Every option of a row has, in every call of the row, the default the row states."""
    assert len(options) == len(defaults), "one default per option, separated by ' / '"
    for call in calls:
        actual = _defaults_of(call)
        for option, written in zip(options, defaults, strict=True):
            assert option in actual, f"{call} has no option {option}"
            assert render(actual[option]) == written, f"{call}({option}=...)"


def test_every_default_of_a_listed_call_is_in_the_table() -> None:
    """A keyword option with a default of a listed call has a row (private ``_x`` options excepted)."""
    documented = {(call, option) for calls, options, _ in _rows() for call in calls for option in options}
    missing = [
        f"{call}: {name}"
        for call in CALLS
        for name, default in _defaults_of(call).items()
        if default is not inspect.Parameter.empty
        and not name.startswith("_")
        and (call, name) not in documented
    ]
    assert missing == []
