"""``StripedCounter.release()`` is all or nothing and gives a ref back exactly once: with every stripe
at BIGINT's top it keeps nothing, racing itself and decrements it applies once, and ``total()`` /
``restripe()`` above 2**63-1 are typed; every check re-reads the database afterwards."""

from __future__ import annotations

import random
import uuid
from collections import Counter
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from stateguard import (
    DeadlockDetected,
    InvalidArgument,
    Outcome,
    StripedCounter,
)
from tests._support.release_stock import AtkBase, _race, _unreleased
from tests._support.striped_storms import (
    Stats,
    assert_invariant,
    new_item,
    run_threads,
    unit,
)
from tests.conftest import Backend, capable
from tests.counters.test_ranges import BIG_MAX

# ---------------------------------------------------------------- release racing decrements


def test_release_races_release_and_decrements(backend: Any, engine: Engine) -> None:
    counter = StripedCounter("rel", stripes=4)
    start = 100
    new_item(engine, counter, "a", start)
    stats = Stats()
    refs = {f"r-{k}": 1 + k % 5 for k in range(24)}
    taken = 0
    for ref, by in refs.items():
        r = unit(engine, lambda s, ref=ref, by=by: counter.decrement(s, "a", by=by, ref=ref), stats)
        assert r.outcome is Outcome.APPLIED
        taken += by
    # an increment's ref too: its release takes units back and may find them sold
    r = unit(engine, lambda s: counter.increment(s, "a", by=20, ref="delivery"), stats)
    assert r.outcome is Outcome.APPLIED
    names = list(refs)

    def worker(i: int) -> list[tuple[str, Any]]:
        out = []
        if i < 12:  # two threads per ref, same moment
            for ref in names[(i % 6) * 4 : (i % 6) * 4 + 4]:
                out.append((ref, unit(engine, lambda s, ref=ref: counter.release(s, ref), stats)))
            if i == 0:
                out.append(("delivery", unit(engine, lambda s: counter.release(s, "delivery"), stats)))
            return out
        rng = random.Random(i)
        for _ in range(10):
            by = rng.choice([1, 3, 8, 20])
            out.append((f"dec{by}", unit(engine, lambda s, by=by: counter.decrement(s, "a", by=by), stats)))
        return out

    results = [x for w in run_threads(16, worker) for x in w]
    releases: dict[str, Counter[Outcome]] = {}
    total = start - taken + 20
    for ref, r in results:
        if ref in refs:
            releases.setdefault(ref, Counter())[r.outcome] += 1
            if r.outcome is Outcome.APPLIED:
                total += refs[ref]
        elif ref == "delivery":
            assert r.outcome in (Outcome.APPLIED, Outcome.INSUFFICIENT), r
            if r.outcome is Outcome.APPLIED:
                total -= 20
        elif r.outcome is Outcome.APPLIED:
            total -= int(ref[3:])
        else:
            assert r.outcome is Outcome.INSUFFICIENT and r.value < int(ref[3:]), (ref, r)
    for ref, c in releases.items():
        assert c == {Outcome.APPLIED: 1, Outcome.REPEATED: 1}, (ref, c)
    assert len(releases) == len(refs)
    assert_invariant(engine, counter, "a", total)


pytestmark = pytest.mark.tables(AtkBase.metadata)


# --------------------------------------------------------------------------
# Striped release
# --------------------------------------------------------------------------


def _stripes(engine: Any, c: StripedCounter, item: str) -> list[int]:
    with Session(engine) as s:
        return [int(x) for x in c.stripe_amounts(s, item)]


@pytest.mark.limits
def test_striped_release_with_every_stripe_at_the_top_keeps_nothing(
    engine: Any,
) -> None:
    c = StripedCounter("atk", stripes=3)
    item = "sku-" + uuid.uuid4().hex[:6]
    with Session(engine) as s, s.begin():
        c.create(s, item, amount=30)
        c.create(s, "other", amount=30)
        assert c.decrement(s, item, by=5, ref="o1").outcome is Outcome.APPLIED
        assert c.reserve(s, {item: 2, "other": 3}, ref="basket").outcome is Outcome.APPLIED
    # top every stripe up: an increment lands on a stripe with room; give each the smallest room left
    with Session(engine) as s, s.begin():
        amounts = c.stripe_amounts(s, item)
        for _ in range(500):  # the stripe an increment lands on is random: loop until all are full
            rooms = [BIG_MAX - a for a in c.stripe_amounts(s, item) if a < BIG_MAX]
            if not rooms:
                break
            c.increment(s, item, by=min(rooms))
    full = _stripes(engine, c, item)
    assert full == [BIG_MAX] * 3, (amounts, full)
    other_before = _stripes(engine, c, "other")
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            c.release(s, "o1")
        with pytest.raises(InvalidArgument):
            c.release(s, "basket")  # multi-item: 'other' must not be given back
    assert _stripes(engine, c, item) == full
    assert _stripes(engine, c, "other") == other_before
    assert _unreleased(engine, "o1") == 1
    assert _unreleased(engine, "basket") == 2
    with Session(engine) as s:
        assert c.total(s, item) == 3 * BIG_MAX
    # make room on one stripe; the release applies, once
    with Session(engine) as s, s.begin():
        assert c.decrement(s, item, by=10).outcome is Outcome.APPLIED
    with Session(engine) as s, s.begin():
        assert c.release(s, "basket").outcome is Outcome.APPLIED
        assert c.release(s, "basket").outcome is Outcome.REPEATED
    with Session(engine) as s:
        assert c.total(s, item) == 3 * BIG_MAX - 10 + 2
        assert c.total(s, "other") == 30
    assert _unreleased(engine, "basket") == 0


def test_striped_release_of_increment_units_gone_commit_keeps_nothing(engine: Any) -> None:
    c = StripedCounter("atk2", stripes=4)
    with Session(engine) as s, s.begin():
        c.create(s, "x", amount=0)
        c.create(s, "y", amount=10)
        assert c.increment(s, "x", by=9, ref="deliv").outcome is Outcome.APPLIED
        assert c.increment(s, "y", by=9, ref="deliv-y").outcome is Outcome.APPLIED
    with Session(engine) as s, s.begin():
        assert c.decrement(s, "x", by=5).outcome is Outcome.APPLIED
    before_x = _stripes(engine, c, "x")
    with Session(engine) as s, s.begin():
        r = c.release(s, "deliv")
        assert r.outcome is Outcome.INSUFFICIENT
    assert _stripes(engine, c, "x") == before_x
    assert all(a >= 0 for a in before_x)
    assert _unreleased(engine, "deliv") == 1
    with Session(engine) as s, s.begin():
        c.increment(s, "x", by=5)
    with Session(engine) as s, s.begin():
        assert c.release(s, "deliv").outcome is Outcome.APPLIED
        assert c.release(s, "deliv").outcome is Outcome.REPEATED
    with Session(engine) as s:
        assert c.total(s, "x") == 0
        assert all(a >= 0 for a in c.stripe_amounts(s, "x"))


def test_striped_release_racing_itself_from_8_threads(backend: Backend, engine: Any) -> None:
    c = StripedCounter("atk3", stripes=4)
    with Session(engine) as s, s.begin():
        c.create(s, "p", amount=100)
        c.create(s, "q", amount=100)
        assert c.reserve(s, {"p": 7, "q": 11}, ref="race").outcome is Outcome.APPLIED
    eng = backend.new_engine() if capable(backend, "concurrent_writers") else engine

    def one() -> Outcome:
        with Session(eng) as s, s.begin():
            return c.release(s, "race").outcome

    results, errors = _race([one] * 8)
    if eng is not engine:
        eng.dispose()
    with Session(engine) as s:
        totals = (c.total(s, "p"), c.total(s, "q"))
    applied = [r for r in results if r is Outcome.APPLIED]
    assert len(applied) <= 1, (results, errors)
    assert totals == ((100, 100) if applied else (93, 89)), (results, errors)
    assert not errors, errors
    assert sorted(r.name for r in results) == ["APPLIED"] + ["REPEATED"] * 7


# --------------------------------------------------------------------------
# total() above 2**63-1 and restripe into too few stripes
# --------------------------------------------------------------------------


@pytest.mark.limits
def test_total_above_bigint_and_restripe_too_few(engine: Any) -> None:
    c = StripedCounter("atk4", stripes=4)
    with Session(engine) as s, s.begin():
        c.create(s, "huge", amount=0)
        for _ in range(3):
            assert c.increment(s, "huge", by=BIG_MAX).outcome is Outcome.APPLIED
        assert c.increment(s, "huge", by=5).outcome is Outcome.APPLIED
    want = 3 * BIG_MAX + 5
    with Session(engine) as s:
        assert c.total(s, "huge") == want
    before = _stripes(engine, c, "huge")
    assert sum(before) == want and len(before) == 4
    for n in (1, 2, 3):
        with Session(engine) as s, s.begin():
            with pytest.raises(InvalidArgument) as info:
                c.restripe(s, "huge", stripes=n)
            assert "4" in str(info.value)
        assert _stripes(engine, c, "huge") == before
    # restripe to 4 or more keeps the total exactly
    with Session(engine) as s, s.begin():
        c.restripe(s, "huge", stripes=6)
    after = _stripes(engine, c, "huge")
    assert len(after) == 6 and sum(after) == want and all(0 <= a <= BIG_MAX for a in after)
    with Session(engine) as s:
        assert c.total(s, "huge") == want
    # back to exactly the minimum
    with Session(engine) as s, s.begin():
        c.restripe(s, "huge", stripes=4)
    assert sum(_stripes(engine, c, "huge")) == want
    # an increment with no room anywhere
    with Session(engine) as s, s.begin():
        c.create(s, "full", amount=0)
        c.increment(s, "full", by=BIG_MAX)
        c.restripe(s, "full", stripes=1)
        with pytest.raises(InvalidArgument):
            c.increment(s, "full", by=1)
        assert c.total(s, "full") == BIG_MAX
    with Session(engine) as s:
        assert c.total(s, "full") == BIG_MAX


@pytest.mark.limits
def test_create_with_amount_above_bigint(engine: Any) -> None:
    c = StripedCounter("atk5", stripes=4)
    amount = 3 * BIG_MAX
    # create() takes at most 2**63 - 1 (README: an amount is a BIGINT); more is refused, nothing sent.
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            c.create(s, "c", amount=amount)
    with Session(engine) as s:
        assert c.total(s, "c") is None
        assert c.stripe_amounts(s, "c") == []


@pytest.mark.limits
def test_striped_release_at_bigint_edge_values(engine: Any) -> None:
    c = StripedCounter("atk6", stripes=1)
    with Session(engine) as s, s.begin():
        c.create(s, "e", amount=BIG_MAX)
        assert c.decrement(s, "e", by=BIG_MAX, ref="all").outcome is Outcome.APPLIED
        assert c.total(s, "e") == 0
        assert c.increment(s, "e", by=1).outcome is Outcome.APPLIED
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            c.release(s, "all")
    assert _stripes(engine, c, "e") == [1]
    assert _unreleased(engine, "all") == 1
    with Session(engine) as s, s.begin():
        c.decrement(s, "e", by=1)
        assert c.release(s, "all").outcome is Outcome.APPLIED
        assert c.release(s, "all").outcome is Outcome.REPEATED
    assert _stripes(engine, c, "e") == [BIG_MAX]


def test_striped_release_of_spread_increment_racing_decrements(backend: Backend, engine: Any) -> None:
    """An increment's 20 units spread over 4 stripes; 7 threads take 1 each while one releases the
    increment.  Whatever the order, the total is exact and no stripe goes below zero."""
    c = StripedCounter("atk7", stripes=4)
    with Session(engine) as s, s.begin():
        c.create(
            s,
            "z",
            amount=0,
        )
        c.restripe(s, "z", stripes=1)
        assert c.increment(s, "z", by=20, ref="dl").outcome is Outcome.APPLIED
        c.restripe(s, "z", stripes=4)
        assert c.stripe_amounts(s, "z") == [5, 5, 5, 5]
    eng = backend.new_engine() if capable(backend, "concurrent_writers") else engine

    def job(release_it: bool) -> Any:
        def run() -> tuple[str, Outcome]:
            for attempt in range(20):
                try:
                    with Session(eng) as s, s.begin():
                        if release_it:
                            return ("rel", c.release(s, "dl").outcome)
                        return ("dec", c.decrement(s, "z", by=1).outcome)
                except DeadlockDetected:  # README: a MariaDB deadlock victim retries
                    if attempt == 19:
                        raise
            raise AssertionError("unreachable")

        return run

    results, errors = _race([job(True)] + [job(False)] * 7)
    if eng is not engine:
        eng.dispose()
    assert not errors, errors
    decs = sum(1 for k, o in results if k == "dec" and o is Outcome.APPLIED)
    rel = [o for k, o in results if k == "rel"]
    assert len(rel) == 1
    stripes = _stripes(engine, c, "z")
    assert all(a >= 0 for a in stripes), stripes
    expected = 20 - decs - (20 if rel[0] is Outcome.APPLIED else 0)
    assert sum(stripes) == expected, (results, stripes)
    assert _unreleased(engine, "dl") == (0 if rel[0] is Outcome.APPLIED else 1)
