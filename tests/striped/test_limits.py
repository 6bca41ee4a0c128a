"""Striped counters at BIGINT's limits: totals stay exact, the transaction stays usable, and a
restripe past the limit names the smallest stripe count that fits."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from stateguard import (
    InvalidArgument,
    Outcome,
    StripedCounter,
)

MAX = 2**63 - 1
LEDGER = "stateguard_counter_ledger"


def check_item(engine: Engine, counter: StripedCounter, item: str, expected: int) -> list[int]:
    with Session(engine) as s:
        total, amounts = counter.total(s, item), counter.stripe_amounts(s, item)
    assert all(a >= 0 for a in amounts), amounts
    assert sum(amounts) == total == expected, (item, total, expected, amounts)
    return amounts


def ledger(engine: Engine, counter: StripedCounter) -> list[tuple[Any, ...]]:
    with Session(engine) as s:
        rows = s.execute(
            text(f"SELECT ref, row_key, delta, released_at FROM {LEDGER} WHERE column_name = :c"),
            {"c": counter.name},
        ).all()
    return [tuple(r) for r in rows]


# ---------------------------------------------------------------- BIGINT limits


@pytest.mark.limits
def test_bigint_limits_exact_totals_and_usable_transaction(engine: Engine) -> None:
    c = StripedCounter("big", stripes=2)
    with Session(engine) as s, s.begin():
        assert c.create(s, "b", amount=MAX).outcome is Outcome.APPLIED
        assert c.stripe_amounts(s, "b") == [2**62, 2**62 - 1]
        assert c.increment(s, "b", by=2**62, ref="d1").outcome is Outcome.APPLIED  # fills stripe 1
        assert c.increment(s, "b", by=2**62 - 1).outcome is Outcome.APPLIED  # fills stripe 0
        assert c.stripe_amounts(s, "b") == [MAX, MAX]
        assert c.total(s, "b") == 2 * MAX
        for ref in ("over-1", "over-2"):
            with pytest.raises(InvalidArgument, match="BIGINT"):
                c.increment(s, "b", by=1, ref=ref)
        # nothing changed, no ledger row stayed, the transaction goes on
        assert c.total(s, "b") == 2 * MAX
        with pytest.raises(InvalidArgument, match="2"):
            c.restripe(s, "b", stripes=1)
        assert c.stripe_amounts(s, "b") == [MAX, MAX]
        assert c.restripe(s, "b", stripes=3).value == 2 * MAX
        assert sum(c.stripe_amounts(s, "b")) == 2 * MAX
        # larger than any stripe: taken from several
        assert c.decrement(s, "b", by=MAX, ref="big-order").outcome is Outcome.APPLIED
        assert c.total(s, "b") == MAX
    assert sorted(r[0] for r in ledger(engine, c)) == ["big-order", "d1"]
    with Session(engine) as s, s.begin():
        # the refused refs apply later: they left no trace
        assert c.increment(s, "b", by=1, ref="over-1").outcome is Outcome.APPLIED
        assert c.decrement(s, "b", by=MAX, ref="big-2").outcome is Outcome.APPLIED
        short = c.decrement(s, "b", by=2)
        assert short.outcome is Outcome.INSUFFICIENT and short.value == 1
        assert c.release(s, "big-order").outcome is Outcome.APPLIED
        assert c.total(s, "b") == MAX + 1
        with pytest.raises(InvalidArgument, match="at least 2 stripes"):
            c.restripe(s, "b", stripes=1)
    with Session(engine) as s:
        assert c.total(s, "b") == MAX + 1
        assert len(c.stripe_amounts(s, "b")) == 3
    assert sorted(r[0] for r in ledger(engine, c)) == ["big-2", "big-order", "d1", "over-1"]


@pytest.mark.limits
def test_restripe_past_bigint_names_the_smallest_count(engine: Engine) -> None:
    c = StripedCounter("big2", stripes=5)
    with Session(engine) as s, s.begin():
        c.create(s, "b", amount=MAX)
        for _ in range(4):
            c.increment(s, "b", by=MAX // 2)
        total = MAX + 4 * (MAX // 2)
        assert c.total(s, "b") == total
        need = -(-total // MAX)
        assert need == 3
        for k in (1, 2):
            with pytest.raises(InvalidArgument, match=f"at least {need} stripes"):
                c.restripe(s, "b", stripes=k)
        assert c.restripe(s, "b", stripes=need).value == total
    check_item(engine, c, "b", total)
