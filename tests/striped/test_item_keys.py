"""Striped counter item keys: odd strings are separate items with their own refs, never merged
when created concurrently, and a 200-character item needing JSON escapes works with a ref."""

from __future__ import annotations

import unicodedata
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from stateguard import (
    Outcome,
    RefConflict,
    StripedCounter,
)
from tests._support.striped_storms import Stats, run_threads
from tests._support.striped_storms import unit as _unit

LEDGER = "stateguard_counter_ledger"


# ---------------------------------------------------------------- helpers


def unit(engine: Engine, op: Callable[[Session], Any], stats: Stats, attempts: int = 60) -> Any:
    """``op`` in its own transaction; typed retryable errors are counted and retried (up to 60 times)."""
    return _unit(engine, op, stats, attempts)


def totals(engine: Engine, counter: StripedCounter, items: list[str]) -> dict[str, int | None]:
    with Session(engine) as s:
        return {i: counter.total(s, i) for i in items}


def ledger(engine: Engine, counter: StripedCounter) -> list[tuple[Any, ...]]:
    with Session(engine) as s:
        rows = s.execute(
            text(f"SELECT ref, row_key, delta, released_at FROM {LEDGER} WHERE column_name = :c"),
            {"c": counter.name},
        ).all()
    return [tuple(r) for r in rows]


# ---------------------------------------------------------------- item keys


ODD_ITEMS = [
    "A",
    "a",
    "x",
    "x ",
    " x",
    "x\t",
    unicodedata.normalize("NFC", "café"),
    unicodedata.normalize("NFD", "café"),
    "ß",
    "ss",
    "İ",
    "i̇",
    "\U0001f600" * 200,
    "z" * 199 + " ",
    "z" * 200,
    "emoji-\U0001f6d2-\u202e-rtl",
]


@pytest.mark.hostile
def test_odd_item_keys_are_separate_items_with_refs(engine: Engine) -> None:
    """Keys are compared as given: "A"/"a", "x"/"x ", NFC/NFD, 200 emoji are distinct items, each
    with its own total, its own ledger entry under one shared ref, and released exactly."""
    c = StripedCounter("odd", stripes=3)
    assert len(set(ODD_ITEMS)) == len(ODD_ITEMS)
    with Session(engine) as s, s.begin():
        for n, item in enumerate(ODD_ITEMS):
            assert c.create(s, item, amount=100 + n).outcome is Outcome.APPLIED
    with Session(engine) as s, s.begin():
        for n, item in enumerate(ODD_ITEMS):
            r = c.decrement(s, item, by=n + 1, ref="order-odd")
            assert r.outcome is Outcome.APPLIED, (item, r)
        for n, item in enumerate(ODD_ITEMS):
            with pytest.raises(RefConflict):
                with s.begin_nested():
                    c.decrement(s, item, by=n + 2, ref="order-odd")
            assert c.decrement(s, item, by=n + 1, ref="order-odd").outcome is Outcome.REPEATED
    got = totals(engine, c, ODD_ITEMS)
    assert got == {item: 100 + n - (n + 1) for n, item in enumerate(ODD_ITEMS)}
    with Session(engine) as s, s.begin():
        r = c.release(s, "order-odd")
        assert r.outcome is Outcome.APPLIED
        assert r.value == {item: n + 1 for n, item in enumerate(ODD_ITEMS)}
        assert c.release(s, "order-odd").outcome is Outcome.REPEATED
    assert totals(engine, c, ODD_ITEMS) == {item: 100 + n for n, item in enumerate(ODD_ITEMS)}


@pytest.mark.hostile
def test_odd_keys_created_concurrently_never_merge(backend: Any, engine: Engine) -> None:
    """16 threads create keys that a case- or pad-insensitive collation would merge: all APPLIED."""
    c = StripedCounter("oddc", stripes=2)
    items = ["K", "k", "K ", "k ", "K  ", "k\u00a0", "K\u200b", "\uff2b"] * 2
    results = run_threads(16, lambda i: unit(engine, lambda s: c.create(s, items[i], amount=i + 1), Stats()))
    outcomes = Counter(r.outcome for r in results)
    assert outcomes == {Outcome.APPLIED: 8, Outcome.REPEATED: 8}
    got = totals(engine, c, items[:8])
    for i, item in enumerate(items[:8]):
        assert got[item] in (i + 1, i + 9), (item, got)


# README: items are "str keys of up to 200 characters" with "the same ref ledger": an item whose
# JSON outgrows the ledger's 255-character row_key is stored there as given.
@pytest.mark.limits
def test_an_item_of_200_characters_needing_json_escapes_works_with_a_ref(engine: Engine) -> None:
    """200 characters of quotes, backslashes or control characters take a ref'd decrement like any item."""
    c = StripedCounter("esc", stripes=2)
    items = ['"' * 200, "\\" * 200, "\x01" * 200, "C:\\stock\\" + "x" * 100 + '"' * 91]
    with Session(engine) as s, s.begin():
        for item in items:
            assert len(item) <= 200
            assert c.create(s, item, amount=10).outcome is Outcome.APPLIED
    with Session(engine) as s, s.begin():
        for item in items:
            assert c.decrement(s, item, by=1, ref="o-esc").outcome is Outcome.APPLIED
    assert set(totals(engine, c, items).values()) == {9}
