"""The striped counter's ref ledger: two counter objects of one name with different default stripe
counts agree, and refs are scoped per counter and per item."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from stateguard import (
    Outcome,
    RefConflict,
    StripedCounter,
)
from tests._support.striped_storms import Stats, run_threads
from tests._support.striped_storms import unit as _unit

# ---------------------------------------------------------------- helpers


def unit(engine: Engine, op: Callable[[Session], Any], stats: Stats, attempts: int = 60) -> Any:
    """``op`` in its own transaction; typed retryable errors are counted and retried (up to 60 times)."""
    return _unit(engine, op, stats, attempts)


def totals(engine: Engine, counter: StripedCounter, items: list[str]) -> dict[str, int | None]:
    with Session(engine) as s:
        return {i: counter.total(s, i) for i in items}


def check_item(engine: Engine, counter: StripedCounter, item: str, expected: int) -> list[int]:
    with Session(engine) as s:
        total, amounts = counter.total(s, item), counter.stripe_amounts(s, item)
    assert all(a >= 0 for a in amounts), amounts
    assert sum(amounts) == total == expected, (item, total, expected, amounts)
    return amounts


# ---------------------------------------------------------------- create, refs, savepoints


def test_two_counter_objects_same_name_different_default_stripes(engine: Engine) -> None:
    """16 threads create one item through objects of 8 and of 2 default stripes: one APPLIED, the
    item's amount is the winner's, and the other object then decrements across all its stripes."""
    c8, c2 = StripedCounter("twin", stripes=8), StripedCounter("twin", stripes=2)

    def create(i: int) -> tuple[int, Outcome]:
        counter, amount = (c8, 80) if i % 2 else (c2, 20)
        return amount, unit(engine, lambda s: counter.create(s, "t", amount=amount), Stats()).outcome

    results = run_threads(16, create)
    winners = [a for a, o in results if o is Outcome.APPLIED]
    assert len(winners) == 1 and Counter(o for _, o in results)[Outcome.REPEATED] == 15
    amounts = check_item(engine, c8, "t", winners[0])
    assert len(amounts) == (8 if winners[0] == 80 else 2)
    with Session(engine) as s, s.begin():
        other = c2 if winners[0] == 80 else c8
        assert other.decrement(s, "t", by=winners[0] - 1).outcome is Outcome.APPLIED
        short = other.decrement(s, "t", by=2)
        assert short.outcome is Outcome.INSUFFICIENT and short.value == 1
    check_item(engine, c8, "t", 1)


def test_refs_reused_across_items_and_counters(engine: Engine) -> None:
    stock, coupons = StripedCounter("stock-r", stripes=4), StripedCounter("coupon-r", stripes=4)
    with Session(engine) as s, s.begin():
        for c in (stock, coupons):
            for item in ("a", "b", "c"):
                c.create(s, item, amount=50)
    with Session(engine) as s, s.begin():
        assert stock.decrement(s, "a", by=2, ref="R").outcome is Outcome.APPLIED
        assert stock.decrement(s, "b", by=3, ref="R").outcome is Outcome.APPLIED
        assert coupons.decrement(s, "a", by=5, ref="R").outcome is Outcome.APPLIED
        assert coupons.increment(s, "c", by=7, ref="R").outcome is Outcome.APPLIED
    # a reserve under the used ref naming a used item and a new one: RefConflict, the caller commits
    with Session(engine) as s, s.begin():
        with pytest.raises(RefConflict):
            stock.reserve(s, {"a": 2, "c": 1}, ref="R")
        with pytest.raises(RefConflict):
            stock.reserve(s, {"a": 2, "b": 3, "c": 1}, ref="R")
        with pytest.raises(RefConflict):
            stock.reserve(s, {"a": 2}, ref="R")
        assert stock.reserve(s, {"a": 2, "b": 3}, ref="R").outcome is Outcome.REPEATED
    assert totals(engine, stock, ["a", "b", "c"]) == {"a": 48, "b": 47, "c": 50}
    with Session(engine) as s, s.begin():
        r = stock.release(s, "R")
        assert r.outcome is Outcome.APPLIED and r.value == {"a": 2, "b": 3}
        assert stock.release(s, "R").outcome is Outcome.REPEATED
        # released refs stay used: the same reservation again changes nothing
        assert stock.reserve(s, {"a": 2, "b": 3}, ref="R").outcome is Outcome.REPEATED
        assert stock.decrement(s, "a", by=2, ref="R").outcome is Outcome.REPEATED
    assert totals(engine, stock, ["a", "b", "c"]) == {"a": 50, "b": 50, "c": 50}
    assert totals(engine, coupons, ["a", "b", "c"]) == {"a": 45, "b": 50, "c": 57}
    with Session(engine) as s, s.begin():
        r = coupons.release(s, "R")
        assert r.outcome is Outcome.APPLIED and r.value == {"a": 5, "c": -7}
    assert totals(engine, coupons, ["a", "b", "c"]) == {"a": 50, "b": 50, "c": 50}
