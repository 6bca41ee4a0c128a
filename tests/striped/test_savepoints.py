"""Striped calls inside the caller's savepoints: a rolled-back savepoint undoes every stripe
and ledger row written in it, alone and under a storm, on every backend."""

from __future__ import annotations

import random
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from stateguard import (
    Outcome,
    StripedCounter,
    retry_on_conflict,
)
from tests._support.striped_storms import (
    LEDGER,
    assert_invariant,
    ledger_refs,
    new_item,
    run_threads,
)

# ---------------------------------------------------------------- the caller's own savepoints


@pytest.mark.rollback
def test_caller_savepoint_rolled_back_undoes_everything(backend: Any, engine: Engine) -> None:
    counter = StripedCounter("sp", stripes=4)
    new_item(engine, counter, "a", 40)
    with Session(engine) as s, s.begin():
        assert counter.decrement(s, "a", by=3, ref="keep").outcome is Outcome.APPLIED
        sp = s.begin_nested()
        assert counter.decrement(s, "a", by=2, ref="r-small").outcome is Outcome.APPLIED
        assert counter.decrement(s, "a", by=25, ref="r-big").outcome is Outcome.APPLIED  # > any stripe
        assert counter.increment(s, "a", by=5, ref="r-inc").outcome is Outcome.APPLIED
        assert counter.release(s, "keep").outcome is Outcome.APPLIED
        assert counter.restripe(s, "a", stripes=2).outcome is Outcome.APPLIED
        sp.rollback()
        assert counter.total(s, "a") == 37
        assert len(counter.stripe_amounts(s, "a")) == 4
        # a rolled-back ref is free again, the kept one still REPEATED
        assert counter.decrement(s, "a", by=25, ref="r-big").outcome is Outcome.APPLIED
        assert counter.decrement(s, "a", by=3, ref="keep").outcome is Outcome.REPEATED
        sp2 = s.begin_nested()
        r = counter.decrement(s, "a", by=13)  # INSUFFICIENT inside the caller's savepoint
        assert r.outcome is Outcome.INSUFFICIENT and r.value == 12
        assert counter.decrement(s, "a", by=12).outcome is Outcome.APPLIED
        sp2.rollback()
        assert counter.total(s, "a") == 12
    assert_invariant(engine, counter, "a", 12)
    assert sorted(r for r, *_ in ledger_refs(engine, counter)) == ["keep", "r-big"]


@pytest.mark.rollback
def test_caller_savepoints_rolled_back_under_storm(backend: Any, engine: Engine) -> None:
    """A caller's own savepoint (``with session.begin_nested():``) around each decrement, rolled
    back for half of them, run through ``retry_on_conflict`` as the README says to.

    On MariaDB, once stock runs low, DeadlockDetected rolls the whole transaction back, so leaving
    the caller's ``begin_nested()`` block runs ROLLBACK TO SAVEPOINT on a savepoint that no longer
    exists: SQLAlchemy raises the driver's 1305 with the DeadlockDetected as ``__context__``.
    retry_on_conflict used to give up on it (9-15 of 96 units failed per run); it now follows a
    database error back to the conflict it hid.
    """
    counter = StripedCounter("spstorm", stripes=6)
    start = 400
    new_item(engine, counter, "a", start)
    escaped: list[str] = []

    class Undo(Exception):
        pass

    def worker(i: int) -> list[tuple[int, bool, str, Any]]:
        rng = random.Random(100 + i)
        out = []
        for j in range(8):
            by = rng.choice([1, 3, 7, 40, 80])
            keep = rng.random() < 0.5
            ref = f"sp-{i}-{j}"

            def op(by: int = by, keep: bool = keep, ref: str = ref) -> Any:
                with Session(engine) as s, s.begin():
                    try:
                        with s.begin_nested():
                            r = counter.decrement(s, "a", by=by, ref=ref)
                            if not keep:
                                raise Undo
                    except Undo:
                        pass
                    return r

            try:
                out.append((by, keep, ref, retry_on_conflict(op, attempts=10, backoff=0.005)))
            except Exception as error:  # reported below, with the error's context
                escaped.append(
                    f"{type(error).__name__}: {str(error)[:80]} <- {type(error.__context__).__name__}"
                )
        return out

    results = [x for w in run_threads(12, worker) for x in w]
    assert not escaped, f"{len(escaped)} units failed with non-retryable errors: {escaped[:3]}"
    applied = sum(by for by, keep, _, r in results if keep and r.outcome is Outcome.APPLIED)
    final = start - applied
    assert_invariant(engine, counter, "a", final)
    kept = {ref for _, keep, ref, r in results if keep and r.outcome is Outcome.APPLIED}
    assert {r for r, *_ in ledger_refs(engine, counter)} == kept
    for by, _, _, r in results:
        if r.outcome is Outcome.INSUFFICIENT:
            assert r.value < by


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


@pytest.mark.rollback
def test_savepoints_rolled_back_after_the_calls(engine: Engine) -> None:
    """Whatever ran in a SAVEPOINT rolled back afterwards left no trace: its refs apply again,
    a restripe rolled back leaves the old stripes, and later big decrements still see them all."""
    c = StripedCounter("sp", stripes=8)
    with Session(engine) as s, s.begin():
        c.create(s, "a", amount=80)
        c.create(s, "b", amount=80)
    with Session(engine) as s, s.begin():
        sp = s.begin_nested()
        c.decrement(s, "a", by=5, ref="o1")
        c.reserve(s, {"a": 1, "b": 2}, ref="o2")
        c.restripe(s, "a", stripes=3)
        c.increment(s, "b", by=9, ref="d1")
        sp.rollback()
        sp = s.begin_nested()
        c.restripe(s, "b", stripes=5)
        sp.rollback()
        assert len(c.stripe_amounts(s, "a")) == 8 and len(c.stripe_amounts(s, "b")) == 8
        assert c.decrement(s, "a", by=5, ref="o1").outcome is Outcome.APPLIED
        assert c.reserve(s, {"a": 1, "b": 2}, ref="o2").outcome is Outcome.APPLIED
        sp = s.begin_nested()
        assert c.release(s, "o2").outcome is Outcome.APPLIED
        sp.rollback()
        # bigger than any stripe: needs every stripe the rolled-back restripes dropped
        assert c.decrement(s, "a", by=70).outcome is Outcome.APPLIED
        assert c.decrement(s, "b", by=78).outcome is Outcome.APPLIED
    assert totals(engine, c, ["a", "b"]) == {"a": 4, "b": 0}
    with Session(engine) as s, s.begin():
        assert c.release(s, "o2").outcome is Outcome.APPLIED
        assert c.release(s, "o2").outcome is Outcome.REPEATED
        assert c.increment(s, "b", by=9, ref="d1").outcome is Outcome.APPLIED
    assert totals(engine, c, ["a", "b"]) == {"a": 5, "b": 11}
    assert sorted(r[0] for r in ledger(engine, c)) == ["d1", "o1", "o2", "o2"]


@pytest.mark.rollback
@pytest.mark.limits
def test_huge_basket_short_last_item_undoes_everything(engine: Engine) -> None:
    c = StripedCounter("basket", stripes=2)
    items = [f"sku-{n:04d}" for n in range(300)]
    with Session(engine) as s, s.begin():
        for item in items:
            c.create(s, item, amount=3)
    basket = dict.fromkeys(reversed(items), 2)
    basket["sku-0299"] = 4
    with Session(engine) as s, s.begin():
        r = c.reserve(s, basket, ref="huge")
        assert r.outcome is Outcome.INSUFFICIENT and r.key == "sku-0299" and r.value == 3
    assert set(totals(engine, c, items).values()) == {3}
    assert ledger(engine, c) == []
    with Session(engine) as s, s.begin():
        c.increment(s, "sku-0299", by=1)
        assert c.reserve(s, basket, ref="huge").outcome is Outcome.APPLIED
        assert c.reserve(s, basket, ref="huge").outcome is Outcome.REPEATED
    got = totals(engine, c, items)
    assert got["sku-0299"] == 0 and {got[i] for i in items[:-1]} == {1}
