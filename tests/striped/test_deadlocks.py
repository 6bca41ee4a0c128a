"""Deadlocks between striped calls: reserve() baskets take their items in sorted order, so with
plentiful stock none deadlock whatever the order of the mapping; separate calls in opposite orders can."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, bindparam, text
from sqlalchemy.orm import Session

from stateguard import (
    Outcome,
    SerializationConflict,
    StripedCounter,
)
from tests._support.striped_storms import (
    Stats,
    assert_invariant,
    new_item,
    run_threads,
)
from tests._support.striped_storms import unit as _unit
from tests.conftest import backends_with, capable

# ---------------------------------------------------------------- reserve in different orders


def test_reserve_baskets_in_different_orders(backend: Any, engine: Engine) -> None:
    counter = StripedCounter("basket", stripes=4)
    items = [f"it-{k}" for k in range(5)]
    start = 60
    for it in items:
        new_item(engine, counter, it, start)
    stats = Stats()

    def worker(i: int) -> list[tuple[dict[str, int], Any]]:
        rng = random.Random(500 + i)
        out = []
        for j in range(8):
            chosen = rng.sample(items, rng.randint(2, 5))
            if i % 2:
                chosen.reverse()
            basket = {it: rng.choice([1, 2, 3, 5, 16]) for it in chosen}
            ref = f"o-{i}-{j}"
            r = unit(engine, lambda s, b=basket, ref=ref: counter.reserve(s, b, ref=ref), stats)
            out.append((basket, r))
            if r.outcome is Outcome.APPLIED and rng.random() < 0.3:
                rel = unit(engine, lambda s, ref=ref: counter.release(s, ref), stats)
                assert rel.outcome is Outcome.APPLIED, rel
                out.append(({k: -v for k, v in basket.items()}, rel))
        return out

    results = [x for w in run_threads(12, worker) for x in w]
    expected = dict.fromkeys(items, start)
    for basket, r in results:
        if r.outcome is Outcome.APPLIED:
            for it, by in basket.items():
                expected[it] -= by
        else:
            assert r.outcome is Outcome.INSUFFICIENT, r
            assert r.key in basket, (r, basket)
            assert r.value is not None and r.value < basket[r.key], (r, basket)
    for it in items:
        assert_invariant(engine, counter, it, expected[it])
    # stock runs low here: documented deadlocks may reach the caller, typed (MariaDB: at once);
    # PostgreSQL retries its sweep in a savepoint, so they must stay rare there
    if backend.name == "postgresql":
        assert sum(stats.retryable.values()) <= 3, stats.retryable


def test_plentiful_stock_never_deadlocks(backend: Any, engine: Engine) -> None:
    """Every stripe holds far more than any `by`: the documented deadlock ("only when stock runs
    low") cannot arise, so no DeadlockDetected may reach the caller, for decrements or for
    reservations of several items named in different orders."""
    counter = StripedCounter("plenty", stripes=4)
    items = [f"pl-{k}" for k in range(4)]
    for it in items:
        new_item(engine, counter, it, 40_000)
    stats = Stats()

    def worker(i: int) -> list[tuple[dict[str, int], Any]]:
        rng = random.Random(700 + i)
        out = []
        for j in range(10):
            if j % 2:
                chosen = rng.sample(items, rng.randint(2, 4))
                basket = {it: rng.randint(1, 20) for it in chosen}
                r = unit(engine, lambda s, b=basket, ref=f"pl-{i}-{j}": counter.reserve(s, b, ref=ref), stats)
            else:
                it, by = rng.choice(items), rng.randint(1, 20)
                basket = {it: by}
                r = unit(engine, lambda s, it=it, by=by: counter.decrement(s, it, by=by), stats)
            assert r.outcome is Outcome.APPLIED, r
            out.append((basket, r))
        return out

    results = [x for w in run_threads(16, worker) for x in w]
    for it in items:
        assert_invariant(engine, counter, it, 40_000 - sum(b.get(it, 0) for b, _ in results))
    assert not stats.retryable, f"deadlocks with plentiful stock: {stats.retryable}"


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


# ---------------------------------------------------------------- storms


def test_neighbouring_items_plentiful_stock_mixed_calls_no_deadlock(backend: Any, engine: Engine) -> None:
    """16 threads, 12 items whose keys sort next to each other, fewer stripes than buyers, one call
    per transaction (reserve baskets, ref'd decrements, releases, increments): exact totals, every
    ref at most once, and no deadlock (plentiful stock)."""
    c = StripedCounter("near", stripes=4)
    items = [f"n-{n:02d}" for n in range(12)] + ["n-00 ", "N-00"]
    start = 100_000
    with Session(engine) as s, s.begin():
        for item in items:
            c.create(s, item, amount=start)
    stats = Stats()
    per_thread = 25 if capable(backend, "concurrent_writers") else 12

    def worker(i: int) -> dict[str, int]:
        rng = random.Random(i)
        net: Counter[str] = Counter()
        mine: list[tuple[str, dict[str, int]]] = []
        for k in range(per_thread):
            ref = f"w{i}-{k}"
            roll = rng.random()
            if roll < 0.4:
                basket = {it: rng.randint(1, 3) for it in rng.sample(items, rng.randint(2, 5))}
                r = unit(engine, lambda s, b=basket, ref=ref: c.reserve(s, b, ref=ref), stats)
                assert r.outcome is Outcome.APPLIED
                for it, by in basket.items():
                    net[it] -= by
                mine.append((ref, {it: -by for it, by in basket.items()}))
            elif roll < 0.65:
                it, by = rng.choice(items), rng.randint(1, 4)
                r = unit(engine, lambda s, it=it, by=by, ref=ref: c.decrement(s, it, by=by, ref=ref), stats)
                assert r.outcome is Outcome.APPLIED
                net[it] -= by
                mine.append((ref, {it: -by}))
            elif roll < 0.8:
                it, by = rng.choice(items), rng.randint(1, 4)
                r = unit(engine, lambda s, it=it, by=by, ref=ref: c.increment(s, it, by=by, ref=ref), stats)
                assert r.outcome is Outcome.APPLIED
                net[it] += by
                mine.append((ref, {it: by}))
            elif mine:
                old, deltas = mine.pop(rng.randrange(len(mine)))
                r = unit(engine, lambda s, old=old: c.release(s, old), stats)
                assert r.outcome is Outcome.APPLIED, r
                assert r.value == {it: -d for it, d in deltas.items()}
                for it, d in deltas.items():
                    net[it] -= d
                r = unit(engine, lambda s, old=old: c.release(s, old), stats)
                assert r.outcome is Outcome.REPEATED
        return dict(net)

    nets = run_threads(16, worker, timeout=80)
    expected = Counter({it: start for it in items})
    for n in nets:
        expected.update(n)
    for item in items:
        check_item(engine, c, item, expected[item])
    if capable(backend, "row_locks"):  # row locks taken in key order cannot deadlock
        assert stats.retryable["DeadlockDetected"] == 0, stats.retryable


# README: with plentiful stock there are no deadlocks between calls of one item or reserve() baskets
# (items taken in sorted order); separate calls taking items in opposite orders can deadlock, as
# with any row locks, when an item has no other free stripe (always with stripes=1).
@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_reserve_takes_items_in_sorted_order_whatever_the_mapping_order(backend: Any, engine: Engine) -> None:
    """A transaction holding x (1 stripe) and then taking y, and a reserve of {y, x} started in
    between: the reserve waits for x holding nothing, so both apply (a reserve taking y first
    would hold it while it waits for x: a deadlock)."""
    c = StripedCounter("opp", stripes=1)
    with Session(engine) as s, s.begin():
        c.create(s, "x", amount=1000)
        c.create(s, "y", amount=1000)
    holding_x, go = threading.Event(), threading.Event()
    ids: list[int] = []

    def in_order() -> Outcome:
        with Session(engine) as s, s.begin():
            assert c.decrement(s, "x", by=1).outcome is Outcome.APPLIED
            holding_x.set()
            assert go.wait(15)
            return c.decrement(s, "y", by=1).outcome

    def basket() -> Outcome:
        assert holding_x.wait(15)
        with Session(engine) as s, s.begin():
            ids.append(_connection_id(s, backend))
            return c.reserve(s, {"y": 1, "x": 1}, ref="opp-basket").outcome

    def waits_then_go(i: int) -> Outcome:
        if i == 0:
            return in_order()
        if i == 1:
            return basket()
        deadline = time.monotonic() + 15
        while _lock_waiters(backend, ids) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # polling a condition: the reserve waits for x
        assert _lock_waiters(backend, ids) == 1, "the reserve never waited for x"
        go.set()
        return Outcome.APPLIED

    assert run_threads(3, waits_then_go) == [Outcome.APPLIED] * 3
    assert totals(engine, c, ["x", "y"]) == {"x": 998, "y": 998}


@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_reserves_of_two_one_stripe_items_in_random_orders_never_deadlock(
    backend: Any, engine: Engine
) -> None:
    """12 threads reserve {x, y} (1 stripe each, plentiful stock) with the mapping in random orders,
    20 times each: no deadlock, exact totals."""
    c = StripedCounter("opp2", stripes=1)
    with Session(engine) as s, s.begin():
        c.create(s, "x", amount=10_000)
        c.create(s, "y", amount=10_000)
    stats = Stats()

    def worker(i: int) -> None:
        rng = random.Random(i)
        for k in range(20):
            basket = {"x": 1, "y": 2} if rng.random() < 0.5 else {"y": 2, "x": 1}
            r = unit(engine, lambda s, b=basket, k=k: c.reserve(s, b, ref=f"o{i}-{k}"), stats)
            assert r.outcome is Outcome.APPLIED

    run_threads(12, worker)
    assert stats.retryable["DeadlockDetected"] == 0, stats.retryable
    assert totals(engine, c, ["x", "y"]) == {"x": 10_000 - 240, "y": 10_000 - 480}


@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_separate_calls_in_opposite_orders_deadlock_as_the_readme_says(backend: Any, engine: Engine) -> None:
    """Two transactions decrementing 1-stripe items x and y in separate calls in opposite orders:
    each holds the only row the other needs, so one gets the retryable DeadlockDetected (as a
    plain UPDATE counter would) and the other applies; totals stay exact."""
    c = StripedCounter("opp3", stripes=1)
    with Session(engine) as s, s.begin():
        c.create(s, "x", amount=1000)
        c.create(s, "y", amount=1000)
    first_done = threading.Barrier(2)

    def worker(i: int) -> str:
        order = ("x", "y") if i == 0 else ("y", "x")
        try:
            with Session(engine) as s, s.begin():
                c.decrement(s, order[0], by=1)
                first_done.wait(15)
                return c.decrement(s, order[1], by=1).outcome.name
        except SerializationConflict as error:
            assert error.retryable
            return type(error).__name__

    assert sorted(run_threads(2, worker)) == ["APPLIED", "DeadlockDetected"]
    assert totals(engine, c, ["x", "y"]) == {"x": 999, "y": 999}


def _connection_id(session: Session, backend: Any) -> int:
    fn = "pg_backend_pid()" if backend.name == "postgresql" else "CONNECTION_ID()"
    return int(session.execute(text(f"SELECT {fn}")).scalar_one())


def _lock_waiters(backend: Any, ids: list[int], statement: str = "UPDATE ") -> int:
    """How many of the connections ``ids`` wait for a lock (other tests' waiters do not count).

    MariaDB: a statement on the stripes starting with ``statement`` (an UPDATE; a restripe's
    INSERT; ``""``: any) running for over 300 ms (the holder keeps what they need).  Not
    information_schema.innodb_trx: its cache is capped in size and leaves transactions out while
    other tests on the server hold many locks.
    """
    if not ids:
        return 0
    sql = (
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid IN :ids"
        if backend.name == "postgresql"
        else "SELECT count(*) FROM information_schema.processlist WHERE id IN :ids AND command = 'Query'"
        f" AND time_ms > 300 AND info LIKE '{statement}%stateguard_counter_stripes %'"
    )
    stmt = text(sql).bindparams(bindparam("ids", expanding=True))
    with backend.engine.connect() as conn:
        return int(conn.execute(stmt, {"ids": ids}).scalar_one())
