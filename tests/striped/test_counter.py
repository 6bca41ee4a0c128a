"""Striped counters (stateguard.striped) on every backend: outcomes, the ref ledger, statement counts,
bad input that sends nothing, and process storms (8 processes on one hot item) where stock runs out,
refs are redelivered, decrements larger than any stripe compete with small ones, and restripes run
under concurrent decrements."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import event, func, select, text
from sqlalchemy.orm import Session

from stateguard import (
    InsufficientQuantity,
    InvalidArgument,
    NotFound,
    Outcome,
    RefConflict,
    StripedCounter,
    _kernel,
    async_sqlite_engine,
    create_tables,
    drop_tables,
)
from stateguard.striped import MAX_AMOUNT, SPACE, stripe_ids
from stateguard.tables import counter_ledger, counter_stripes
from tests._support import striped_workers as w
from tests._support.processes import worker_context
from tests.conftest import Backend, backends_with, capable, count_statements

WORKERS = 8


@pytest.fixture(scope="module")
def pool8() -> Iterator[tuple[Any, ProcessPoolExecutor]]:
    """Eight separate worker processes and a manager for barriers, shared by the module."""
    ctx = worker_context()
    with ctx.Manager() as manager, ProcessPoolExecutor(WORKERS, mp_context=ctx) as pool:
        yield manager, pool


def _run(pool8: tuple[Any, ProcessPoolExecutor], fn: Any, args: list[tuple[Any, ...]]) -> list[Any]:
    manager, pool = pool8
    barrier = manager.Barrier(len(args))
    futures = [pool.submit(fn, *a, barrier) for a in args]
    return [f.result(timeout=300) for f in futures]


def _ledger(engine: Any, counter: StripedCounter) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            select(counter_ledger.c.ref, counter_ledger.c.delta).where(
                counter_ledger.c.table_name == counter_stripes.name,
                counter_ledger.c.column_name == counter.name,
                counter_ledger.c.released_at.is_(None),
            )
        ).all()
    return {ref: int(delta) for ref, delta in rows}


def _unreleased(engine: Any, counter: StripedCounter, ref: str) -> tuple[int, int]:
    """How many ledger entries of ``ref`` are not released, and the sum of their deltas."""
    with engine.connect() as conn:
        deltas = (
            conn.execute(
                select(counter_ledger.c.delta).where(
                    counter_ledger.c.table_name == counter_stripes.name,
                    counter_ledger.c.column_name == counter.name,
                    counter_ledger.c.ref == ref,
                    counter_ledger.c.released_at.is_(None),
                )
            )
            .scalars()
            .all()
        )
    return len(deltas), sum(int(d) for d in deltas)


def _stripes(engine: Any, counter: StripedCounter, item: str) -> list[int]:
    with Session(engine) as s:
        return counter.stripe_amounts(s, item)


# --------------------------------------------------------------------------
# Outcomes on every backend
# --------------------------------------------------------------------------


def test_outcomes_and_ref_ledger(engine: Any) -> None:
    """create splits evenly; decrement APPLIED / REPEATED / INSUFFICIENT (total found) / NOT_FOUND;
    a different amount under a used ref is RefConflict; an INSUFFICIENT ref applies after a restock."""
    c = StripedCounter("stock", stripes=4)
    with Session(engine) as s, s.begin():
        assert c.create(s, "sku", amount=10).outcome is Outcome.APPLIED
        assert c.create(s, "sku", amount=99).outcome is Outcome.REPEATED
        assert c.stripe_amounts(s, "sku") == [3, 3, 2, 2]
        r = c.decrement(s, "sku", by=2, ref="o1")
        assert r.outcome is Outcome.APPLIED and r.key == "sku" and r.value is None
        again = c.decrement(s, "sku", by=2, ref="o1")
        assert again.outcome is Outcome.REPEATED and again.same_request
        with pytest.raises(RefConflict):
            c.decrement(s, "sku", by=3, ref="o1")
        assert c.total(s, "sku") == 8
        short = c.decrement(s, "sku", by=9, ref="o2")
        assert short.outcome is Outcome.INSUFFICIENT and short.value == 8
        with pytest.raises(InsufficientQuantity):
            short.raise_for_outcome()
        missing = c.decrement(s, "nope", by=1, ref="o3")
        assert missing.outcome is Outcome.NOT_FOUND
        with pytest.raises(NotFound):
            missing.raise_for_outcome()
        assert c.total(s, "nope") is None and c.stripe_amounts(s, "nope") == []
        assert c.increment(s, "sku", by=5, ref="restock").outcome is Outcome.APPLIED
        assert c.increment(s, "sku", by=5, ref="restock").outcome is Outcome.REPEATED
        assert c.increment(s, "nope", by=5).outcome is Outcome.NOT_FOUND
        # o2 left no trace: after the restock (13 in all) it applies.
        assert c.decrement(s, "sku", by=9, ref="o2").outcome is Outcome.APPLIED
        assert c.total(s, "sku") == 4
        assert sum(c.stripe_amounts(s, "sku")) == 4
    assert _ledger(engine, c) == {"o1": -2, "restock": 5, "o2": -9}


def test_release_of_an_increment_whose_units_are_gone_is_insufficient(engine: Any) -> None:
    """An increment's ref released after its units were sold: INSUFFICIENT with the stripes and the
    ledger unchanged (no negative stripe, so no later decrement of a total of 0 applies); units
    spread over several stripes are taken back from all of them, never below zero."""
    c = StripedCounter("stock", stripes=4)
    for _ in range(5):  # the stripe each change lands on is random
        item = f"sku-{uuid.uuid4().hex[:8]}"
        with Session(engine) as s, s.begin():
            c.create(s, item, amount=0)
            assert c.increment(s, item, by=3, ref="delivery-" + item).applied
        with Session(engine) as s, s.begin():
            assert c.decrement(s, item, by=3).applied
        with Session(engine) as s, s.begin():
            r = c.release(s, "delivery-" + item)
            assert (r.outcome, r.key, r.value) == (Outcome.INSUFFICIENT, item, 0)
        assert _stripes(engine, c, item) == [0, 0, 0, 0]
        assert _ledger(engine, c)["delivery-" + item] == 3
        with Session(engine) as s, s.begin():
            assert c.increment(s, item, by=3).applied
            assert c.decrement(s, item, by=1).applied
            assert c.restripe(s, item, stripes=4).applied  # [1, 1, 0, 0]: no stripe holds 2
            assert c.increment(s, item, by=1).applied
        assert sorted(_stripes(engine, c, item)) in ([0, 1, 1, 1], [0, 0, 1, 2])
        with Session(engine) as s, s.begin():
            assert c.release(s, "delivery-" + item).value == {item: -3}
            assert c.release(s, "delivery-" + item).outcome is Outcome.REPEATED
        assert _stripes(engine, c, item) == [0, 0, 0, 0]
        assert "delivery-" + item not in _ledger(engine, c)
        with Session(engine) as s, s.begin():
            assert c.decrement(s, item, by=1).outcome is Outcome.INSUFFICIENT


@pytest.mark.limits
def test_an_increment_past_the_bigint_range_is_refused_and_changes_nothing(engine: Any) -> None:
    """A stripe never goes past 2**63 - 1: an increment lands on a stripe with room, and when none
    has room it is InvalidArgument with nothing changed and the transaction usable (no driver error
    on PostgreSQL/MariaDB, no REAL stripe on SQLite)."""
    top = MAX_AMOUNT
    c = StripedCounter("stock", stripes=2)
    with Session(engine) as s, s.begin():
        c.create(s, "big", amount=2**62)  # [2**61, 2**61]
        assert c.increment(s, "big", by=top - 2**61).applied
        assert c.increment(s, "big", by=top - 2**61, ref="last-room").applied
        assert c.stripe_amounts(s, "big") == [top, top]
        for ref in (None, "no-room"):
            with pytest.raises(InvalidArgument, match="would exceed the BIGINT range"):
                c.increment(s, "big", by=1, ref=ref)
        assert c.stripe_amounts(s, "big") == [top, top]
        assert c.decrement(s, "big", by=3).applied
        assert sorted(c.stripe_amounts(s, "big")) == [top - 3, top]
        with pytest.raises(InvalidArgument, match="would exceed the BIGINT range"):
            c.increment(s, "big", by=4)
        assert c.increment(s, "big", by=3, ref="no-room").applied  # the refused ref left no trace
        assert c.stripe_amounts(s, "big") == [top, top]
        c.create(s, "one", amount=top, stripes=1)
        with pytest.raises(InvalidArgument, match="would exceed the BIGINT range"):
            c.increment(s, "one", by=top)
        assert c.total(s, "one") == top
        # A total past 2**63 - 1 is read exactly (SQLite's SUM would fail with "integer overflow"),
        # and it cannot be restriped onto fewer stripes than it needs: refused, nothing changed.
        assert c.total(s, "big") == 2 * top
        with pytest.raises(InvalidArgument, match="at least 2 stripes"):
            c.restripe(s, "big", stripes=1)
        assert c.stripe_amounts(s, "big") == [top, top]
        assert c.restripe(s, "big", stripes=3).value == 2 * top
        assert c.total(s, "big") == 2 * top and max(c.stripe_amounts(s, "big")) <= top
    assert _ledger(engine, c) == {"last-room": top - 2**61, "no-room": 3}


@pytest.mark.limits
def test_a_release_past_the_bigint_range_is_refused_and_gives_nothing_back(engine: Any) -> None:
    """Units given back to an item whose stripes were refilled to the top since: InvalidArgument,
    all or nothing (an item given back first is undone too), the ref stays unreleased (a caller
    that catches the error and commits loses no units), and it applies once there is room."""
    top = MAX_AMOUNT
    c = StripedCounter("stock", stripes=1)
    with Session(engine) as s:
        c.create(s, "a", amount=100)
        c.create(s, "b", amount=100)
        assert c.reserve(s, {"a": 30, "b": 40}, ref="order").applied
        assert c.increment(s, "b", by=top - 60).applied
        assert c.stripe_amounts(s, "b") == [top]
        with pytest.raises(InvalidArgument, match="would exceed the BIGINT range"):
            c.release(s, "order")
        assert c.stripe_amounts(s, "a") == [70] and c.stripe_amounts(s, "b") == [top]
        s.commit()  # the caller swallowed the error and committed
    assert _unreleased(engine, c, "order") == (2, -70)
    with Session(engine) as s, s.begin():
        assert c.stripe_amounts(s, "a") == [70]
        assert c.decrement(s, "b", by=40).applied
        r = c.release(s, "order")
        assert r.outcome is Outcome.APPLIED and r.value == {"a": 30, "b": 40}
        assert c.stripe_amounts(s, "a") == [100] and c.stripe_amounts(s, "b") == [top]
    assert _unreleased(engine, c, "order") == (0, 0)


def test_a_decrement_larger_than_any_stripe_takes_from_several(engine: Any) -> None:
    """8 stripes of 5: a decrement of 33 succeeds (slow path), 8 more is INSUFFICIENT, 7 empties it."""
    c = StripedCounter("big", stripes=8)
    with Session(engine) as s, s.begin():
        c.create(s, "sku", amount=40)
        assert c.stripe_amounts(s, "sku") == [5] * 8
        assert c.decrement(s, "sku", by=33).outcome is Outcome.APPLIED
        assert c.total(s, "sku") == 7 and min(c.stripe_amounts(s, "sku")) >= 0
        assert c.decrement(s, "sku", by=8).value == 7
        assert c.decrement(s, "sku", by=7).outcome is Outcome.APPLIED
        assert c.stripe_amounts(s, "sku") == [0] * 8


def test_reserve_is_all_or_nothing_and_release_gives_back_once(engine: Any) -> None:
    """reserve of two items undoes the first when the second is short; release gives back once."""
    c = StripedCounter("res", stripes=3)
    with Session(engine) as s, s.begin():
        c.create(s, "a", amount=5)
        c.create(s, "b", amount=1)
        short = c.reserve(s, {"b": 2, "a": 2}, ref="r1")
        assert short.outcome is Outcome.INSUFFICIENT and short.key == "b" and short.value == 1
        assert (c.total(s, "a"), c.total(s, "b")) == (5, 1)
        ok = c.reserve(s, {"b": 1, "a": 2}, ref="r2")
        assert ok.outcome is Outcome.APPLIED and ok.key == "r2"
        assert c.reserve(s, {"b": 1, "a": 2}, ref="r2").outcome is Outcome.REPEATED
        # A smaller basket under the ref of a bigger one is another reservation, not a repeat.
        with pytest.raises(RefConflict, match="also reserved 1 other"):
            c.reserve(s, {"a": 2}, ref="r2")
        assert (c.total(s, "a"), c.total(s, "b")) == (3, 0)
        back = c.release(s, "r2")
        assert back.outcome is Outcome.APPLIED and back.value == {"a": 2, "b": 1}
        assert c.release(s, "r2").outcome is Outcome.REPEATED
        assert c.release(s, "never").outcome is Outcome.NOT_FOUND
        assert (c.total(s, "a"), c.total(s, "b")) == (5, 1)
        # A released ref stays used.
        assert c.decrement(s, "a", by=2, ref="r2").outcome is Outcome.REPEATED


def test_restripe_keeps_the_total(engine: Any) -> None:
    """restripe to 1, 7 and 3 stripes keeps the total and spreads it evenly; NOT_FOUND for no item."""
    c = StripedCounter("re", stripes=4)
    with Session(engine) as s, s.begin():
        c.create(s, "sku", amount=22)
        c.decrement(s, "sku", by=3)
        for k in (1, 7, 3):
            r = c.restripe(s, "sku", stripes=k)
            assert r.outcome is Outcome.APPLIED and r.value == 19
            amounts = c.stripe_amounts(s, "sku")
            assert len(amounts) == k and sum(amounts) == 19 and max(amounts) - min(amounts) <= 1
        assert c.restripe(s, "nope", stripes=2).outcome is Outcome.NOT_FOUND
        stored = s.execute(
            select(counter_stripes.c.item, counter_stripes.c.stripe).order_by(counter_stripes.c.stripe)
        ).all()
    # Where there are row locks a restripe leaves the item's gate row (stripe -1), and none for "nope".
    gate = [("sku", -1)] if _kernel.backend(engine.dialect).row_locks else []
    assert stored == gate + [("sku", stripe) for stripe in stripe_ids(3)]


def test_the_restripe_gate_is_no_stripe(engine: Any) -> None:
    """A restripe leaves the item's gate row (stripe -1, amount 0; where there are row locks), and
    nothing counts or uses it: totals, stripe amounts, increments (it has room), a decrement that
    sweeps every stripe, the next restripe."""
    c = StripedCounter("gate", stripes=4)
    with Session(engine) as s, s.begin():
        c.create(s, "g", amount=10)
        assert c.restripe(s, "g", stripes=2).value == 10
        for _ in range(20):
            assert c.increment(s, "g", by=1).applied
        assert c.total(s, "g") == 30 and len(c.stripe_amounts(s, "g")) == 2
        assert c.decrement(s, "g", by=30).applied  # more than any stripe: takes from both
        assert c.total(s, "g") == 0 and c.stripe_amounts(s, "g") == [0, 0]
        assert c.increment(s, "g", by=7).applied
        assert c.restripe(s, "g", stripes=3).value == 7
        assert c.stripe_amounts(s, "g") == [3, 2, 2]
        gate = s.execute(
            select(counter_stripes.c.stripes, counter_stripes.c.amount).where(
                counter_stripes.c.counter == "gate", counter_stripes.c.stripe < 0
            )
        ).all()
    assert gate == ([(0, 0)] if _kernel.backend(engine.dialect).row_locks else [])


@pytest.mark.limits
def test_the_longest_items_round_trip_through_the_ledger(engine: Any) -> None:
    """200-character items (CJK, emoji, quotes) are stored exactly, and release finds them again."""
    c = StripedCounter("long", stripes=2)
    items = ["界" * 200, "😀" * 200, '"\\' * 40 + "x" * 80, "a" * 199 + " "]
    with Session(engine) as s, s.begin():
        for item in items:
            c.create(s, item, amount=3)
        r = c.reserve(s, dict.fromkeys(items, 2), ref="long-ref")
        assert r.outcome is Outcome.APPLIED
        assert c.release(s, "long-ref").value == dict.fromkeys(items, 2)
        assert [c.total(s, item) for item in items] == [3, 3, 3, 3]
        assert c.total(s, "a" * 199) is None


def test_items_whose_json_outgrows_the_ledger_column_are_stored_as_given(engine: Any) -> None:
    """An item whose JSON passes the ledger's 255 characters is stored as ``=`` and the item, applies once
    and is released exactly; an item whose JSON fits is still stored as JSON (rows written before match)."""
    c = StripedCounter("asgiven", stripes=2)
    escaped = ['"' * 200, "\\" * 200, "\x01" * 200, "=" + '"' * 199]
    plain = ["=x", '"\\' * 40 + "x" * 80]
    with Session(engine) as s, s.begin():
        for item in escaped + plain:
            c.create(s, item, amount=5)
        for item in escaped + plain:
            assert c.decrement(s, item, by=2, ref="r-esc").outcome is Outcome.APPLIED
            assert c.decrement(s, item, by=2, ref="r-esc").outcome is Outcome.REPEATED
            with pytest.raises(RefConflict):
                with s.begin_nested():
                    c.decrement(s, item, by=1, ref="r-esc")
        stored = set(
            s.execute(select(counter_ledger.c.row_key).where(counter_ledger.c.ref == "r-esc")).scalars()
        )
        assert stored == {"=" + item for item in escaped} | {json.dumps(item) for item in plain}
        assert c.reserve(s, dict.fromkeys(escaped + plain, 2), ref="r-esc").outcome is Outcome.REPEATED
        with pytest.raises(RefConflict):
            c.reserve(s, dict.fromkeys(escaped, 2), ref="r-esc")
        assert c.release(s, "r-esc").value == dict.fromkeys(escaped + plain, 2)
        assert {c.total(s, item) for item in escaped + plain} == {5}


def test_counters_share_the_table_without_mixing(engine: Any) -> None:
    """Two counters with the same item key are separate amounts and separate ref ledgers."""
    a, b = StripedCounter("a"), StripedCounter("b")
    with Session(engine) as s, s.begin():
        a.create(s, "x", amount=3)
        b.create(s, "x", amount=5)
        assert a.decrement(s, "x", by=1, ref="same").outcome is Outcome.APPLIED
        assert b.decrement(s, "x", by=1, ref="same").outcome is Outcome.APPLIED
        assert (a.total(s, "x"), b.total(s, "x")) == (2, 4)


def test_fast_path_statement_counts(engine: Any, backend: Backend) -> None:
    """A decrement with a free stripe is 1 statement on PostgreSQL and SQLite (2 on MariaDB: no
    UPDATE of a table read in its own subquery), plus 1 for a ref's ledger row."""
    c = StripedCounter("count", stripes=4)
    with Session(engine) as s, s.begin():
        c.create(s, "sku", amount=100)
    fast = 1 if capable(backend, "update_returning") else 2
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as counted:
            assert c.decrement(s, "sku", by=1).outcome is Outcome.APPLIED
        # MariaDB: the pick wraps around (a third statement) when nothing at or below the start fits.
        assert len(counted) == fast, counted.statements
        with count_statements(engine) as counted:
            assert c.decrement(s, "sku", by=1, ref="one").outcome is Outcome.APPLIED
        assert len(counted) == fast + 1, counted.statements
    if backend.name == "postgresql":
        assert "FOR UPDATE SKIP LOCKED" in counted.statements[-1]


@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_a_buyer_finding_every_stripe_busy_waits_for_one_not_all(backend: Backend, engine: Any) -> None:
    """Two open transactions hold the item's two stripes; a third buyer's fast path finds none
    free.  Stock is plentiful, so it waits for one stripe (a read without locks, then one guarded
    UPDATE) instead of locking every stripe in order: once the holders commit it applies, and it
    never sent the sweep (``ORDER BY stripe FOR UPDATE``).  Before, such sweeps made the next
    buyers find every stripe busy too, and on MariaDB half the purchases of a flash sale ended
    in the sweep."""
    c = StripedCounter("busy", stripes=2)
    with Session(engine) as s, s.begin():
        c.create(s, "sku", amount=20)
    holders = [Session(engine), Session(engine)]
    try:
        for h in holders:
            h.begin()
            assert c.decrement(h, "sku", by=1).outcome is Outcome.APPLIED
        # Each holds its own stripe (SKIP LOCKED sent the second one to the other stripe).
        sent: list[str] = []
        done = threading.Event()
        result: list[Any] = []

        def buy() -> None:
            with Session(engine) as s, s.begin():
                conn = s.connection()
                event.listen(conn, "before_cursor_execute", lambda *a: sent.append(a[2]))
                result.append(c.decrement(s, "sku", by=1))
            done.set()

        buyer = threading.Thread(target=buy)
        buyer.start()
        assert not done.wait(0.5), "the buyer should wait: both stripes are held"
        for h in holders:
            h.commit()
        assert done.wait(30)
        buyer.join()
    finally:
        for h in holders:
            h.close()
    assert result[0].outcome is Outcome.APPLIED
    assert not [q for q in sent if "ORDER BY" in q and "FOR UPDATE" in q and "SKIP LOCKED" not in q], sent
    with Session(engine) as s:
        assert c.total(s, "sku") == 17


def _hold_stripe(session: Session, item: str, stripe: int) -> None:
    """Lock one stripe in ``session``'s transaction, as PostgreSQL leaves a stripe locked when a
    fast path's pick re-checked it after a concurrent commit had emptied it."""
    session.execute(
        select(counter_stripes.c.stripe)
        .where(counter_stripes.c.item == item, counter_stripes.c.stripe == stripe)
        .with_for_update()
    ).all()


def test_two_buyers_each_holding_a_stripe_take_more_than_any_stripe_without_deadlock(pg: Backend) -> None:
    """Two transactions each hold one stripe already (the first and the last of four stripes of 10)
    and both decrement 15, more than any stripe.  Before, both locked every stripe in order and
    each waited for the other's held stripe, which no savepoint can free: a deadlock every round
    until one raised DeadlockDetected.  Now a decrement takes from the stripes nobody holds and
    waits for a busy one only after giving back what it took: both apply, no error."""
    eng = pg.engine
    drop_tables(eng)
    create_tables(eng)
    c = StripedCounter("held", stripes=4)
    with Session(eng) as s, s.begin():
        c.create(s, "sku", amount=40)
    first, last = stripe_ids(4)[0], stripe_ids(4)[-1]
    barrier = threading.Barrier(2)
    results: dict[int, Any] = {}

    def buy(stripe: int) -> None:
        try:
            with Session(eng) as s, s.begin():
                s.execute(text("SET LOCAL deadlock_timeout = '200ms'"))
                _hold_stripe(s, "sku", stripe)
                barrier.wait(10)
                results[stripe] = c.decrement(s, "sku", by=15)
        except Exception as e:
            results[stripe] = e

    threads = [threading.Thread(target=buy, args=(st_,)) for st_ in (first, last)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert [getattr(r, "outcome", r) for r in results.values()] == [Outcome.APPLIED] * 2, results
    with Session(eng) as s:
        assert c.total(s, "sku") == 10
    drop_tables(eng)


@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_a_decrement_past_the_total_is_insufficient_without_waiting_for_a_holder(
    backend: Backend, engine: Any
) -> None:
    """A buyer holds a stripe (an open transaction that took 1 of 10); another asks for 11.  On
    PostgreSQL a read without locks settles it: INSUFFICIENT at once, with the committed total (the
    holder's uncommitted decrement still shows its unit).  MariaDB's plain reads show an older
    snapshot, so its decrement locks every stripe: it waits for the holder, then reports 9."""
    c = StripedCounter("short", stripes=2)
    with Session(engine) as s, s.begin():
        c.create(s, "sku", amount=10)
    done = threading.Event()
    result: list[Any] = []

    def buy() -> None:
        with Session(engine) as s, s.begin():
            result.append(c.decrement(s, "sku", by=11))
        done.set()

    with Session(engine) as holder, holder.begin():
        assert c.decrement(holder, "sku", by=1).outcome is Outcome.APPLIED
        buyer = threading.Thread(target=buy)
        buyer.start()
        if backend.name == "postgresql":
            assert done.wait(10), "the decrement waited for the holder"
        else:
            assert not done.wait(0.5), "MariaDB's decrement should wait for the holder's stripe"
    assert done.wait(30)
    buyer.join()
    assert result[0].outcome is Outcome.INSUFFICIENT
    assert result[0].value == (10 if backend.name == "postgresql" else 9)
    with Session(engine) as s:
        assert c.total(s, "sku") == 9


def test_each_stripe_is_picked_about_equally(engine: Any) -> None:
    """400 decrements of 1 from 4 stripes of 1000 take about 100 from each (a random start)."""
    c = StripedCounter("spread", stripes=4)
    with Session(engine) as s, s.begin():
        c.create(s, "sku", amount=4000)
        for _ in range(400):
            c.decrement(s, "sku", by=1)
        taken = [1000 - a for a in c.stripe_amounts(s, "sku")]
    assert sum(taken) == 400 and min(taken) >= 50, taken


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("call", "why"),
    [
        (lambda c, s: c.decrement(s, "", by=1), "blank"),
        (lambda c, s: c.decrement(s, "x" * 201, by=1), "limit is 200"),
        (lambda c, s: c.decrement(s, "a\x00b", by=1), "NUL"),
        (lambda c, s: c.decrement(s, "\ud800", by=1), "surrogate"),
        (lambda c, s: c.decrement(s, 7, by=1), "must be a str"),
        (lambda c, s: c.decrement(s, "sku", by=0), "from 1"),
        (lambda c, s: c.decrement(s, "sku", by=True), "must be an int"),
        (lambda c, s: c.decrement(s, "sku", by=1.0), "must be an int"),
        (lambda c, s: c.increment(s, "sku", by=2**63), "from 1"),
        (lambda c, s: c.decrement(s, "sku", by=1, ref=""), "ref"),
        (lambda c, s: c.decrement(s, "sku", by=1, ref="r" * 201), "ref"),
        (lambda c, s: c.restripe(s, "sku", stripes=0), "from 1 to 1024"),
        (lambda c, s: c.restripe(s, "sku", stripes=1025), "from 1 to 1024"),
        (lambda c, s: c.create(s, "sku", amount=-1), "from 0"),
        (lambda c, s: c.create(s, "sku", stripes=2000), "from 1 to 1024"),
        (lambda c, s: c.reserve(s, {}, ref="r"), "non-empty"),
        (lambda c, s: c.reserve(s, {"sku": 1}, ref=None), "needs a ref"),
        (lambda c, s: c.release(s, None), "needs a ref"),
    ],
)
def test_bad_input_sends_nothing(engine: Any, call: Any, why: str) -> None:
    """Bad items, amounts, refs and stripe counts are InvalidArgument before any statement."""
    c = StripedCounter("bad", stripes=2)
    with Session(engine) as s, s.begin():
        c.create(s, "sku", amount=5)
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as counted, pytest.raises(InvalidArgument, match=why):
            call(c, s)
        assert len(counted) == 0
        assert c.stripe_amounts(s, "sku") == [3, 2]


def test_an_engine_or_connection_where_a_session_belongs_is_refused(engine: Any) -> None:
    """Every call refuses an Engine, a Connection or None with InvalidArgument naming what to pass,
    and sends nothing."""
    c = StripedCounter("wrong", stripes=2)
    calls = [
        lambda x: c.create(x, "sku", amount=1),
        lambda x: c.decrement(x, "sku", by=1),
        lambda x: c.increment(x, "sku", by=1),
        lambda x: c.reserve(x, {"sku": 1}, ref="r"),
        lambda x: c.release(x, "r"),
        lambda x: c.total(x, "sku"),
        lambda x: c.restripe(x, "sku", stripes=2),
    ]
    with engine.connect() as conn, count_statements(engine) as counted:
        for wrong, hint in (
            (engine, "Session\\(engine\\)"),
            (conn, "Session\\(bind=connection\\)"),
            (None, "Session"),
        ):
            for call in calls:
                with pytest.raises(InvalidArgument, match=hint):
                    call(wrong)
    assert len(counted) == 0


@pytest.mark.rollback
def test_savepoint_rollback_undoes_striped_changes_and_keeps_loaded_objects_right(engine: Any) -> None:
    """Decrements, a reserve and a release inside a SAVEPOINT that is rolled back leave the stripes
    and the ref ledger as they were (the refs apply again afterwards), and ORM objects the block
    added or changed roll back with it."""
    from tests._support.models import Invoice

    c = StripedCounter("sp", stripes=3)
    with Session(engine) as s, s.begin():
        Invoice.metadata.create_all(s.connection(), tables=[Invoice.__table__])
        c.create(s, "a", amount=30)
        c.create(s, "b", amount=30)
        s.add(Invoice(id=1, status="sent"))
    with Session(engine) as s, s.begin():
        inv = s.get_one(Invoice, 1)
        assert c.decrement(s, "a", by=2, ref="kept").applied
        before = c.stripe_amounts(s, "a"), c.stripe_amounts(s, "b")
        sp = s.begin_nested()
        inv.status = "void"
        s.add(Invoice(id=2, status="sent"))
        assert c.decrement(s, "a", by=25, ref="big").applied  # more than a stripe: the slow path
        assert c.reserve(s, {"a": 1, "b": 2}, ref="order").applied
        assert c.release(s, "kept").applied
        s.flush()
        sp.rollback()
        assert (c.stripe_amounts(s, "a"), c.stripe_amounts(s, "b")) == before
        assert inv.status == "sent" and s.get(Invoice, 2) is None
        # The rolled-back refs were never applied; the kept one is still held.
        assert c.decrement(s, "a", by=25, ref="big").applied
        assert c.release(s, "kept").applied
        assert c.total(s, "a") == 30 - 25
    with Session(engine) as s:
        assert c.total(s, "a") == 5 and c.total(s, "b") == 30
    Invoice.metadata.drop_all(engine, tables=[Invoice.__table__])


@pytest.mark.hostile
def test_bad_counter_definitions() -> None:
    """A blank or oversize name, or a stripe count outside 1..1024, is refused at definition."""
    for bad in ("", " ", "n" * 101):
        with pytest.raises(InvalidArgument):
            StripedCounter(bad)
    for stripes in (0, 1025, 2.0):
        with pytest.raises(InvalidArgument):
            StripedCounter("ok", stripes=stripes)  # type: ignore[arg-type]


def test_async_session(tmp_path: Any) -> None:
    """Every call is awaited on an AsyncSession (aiosqlite), through the one sync/async bridge."""
    from sqlalchemy.ext.asyncio import AsyncSession

    async def main() -> None:
        eng = async_sqlite_engine(f"sqlite+aiosqlite:///{tmp_path}/a.db")
        await create_tables(eng)
        c = StripedCounter("async", stripes=2)
        async with AsyncSession(eng) as s, s.begin():
            assert (await c.create(s, "sku", amount=4)).outcome is Outcome.APPLIED
            assert (await c.decrement(s, "sku", by=3, ref="a")).outcome is Outcome.APPLIED
            assert (await c.increment(s, "sku", by=1)).outcome is Outcome.APPLIED
            assert (await c.restripe(s, "sku", stripes=3)).value == 2
            assert (await c.reserve(s, {"sku": 1}, ref="b")).outcome is Outcome.APPLIED
            assert (await c.release(s, "a")).value == {"sku": 3}
            assert await c.total(s, "sku") == 4
            amounts = await c.stripe_amounts(s, "sku")
            assert len(amounts) == 3 and sum(amounts) == 4
        await drop_tables(eng)
        await eng.dispose()

    asyncio.run(main())


# --------------------------------------------------------------------------
# A model of the counter, checked against every backend's database (hypothesis)
# --------------------------------------------------------------------------

_OPS = st.lists(
    st.tuples(
        st.sampled_from(["dec", "inc", "restripe", "release"]),
        st.integers(1, 12),
        st.sampled_from(["r1", "r2", "r3", None]),
    ),
    max_size=12,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stock=st.integers(0, 30), stripes=st.integers(1, 6), ops=_OPS)
@example(stock=5, stripes=4, ops=[("dec", 5, None), ("dec", 1, None)])
@example(stock=3, stripes=2, ops=[("dec", 2, "r1"), ("release", 1, "r1"), ("dec", 2, "r1")])
@example(stock=0, stripes=3, ops=[("inc", 4, "r1"), ("release", 1, "r1"), ("dec", 1, None)])
@example(stock=0, stripes=1, ops=[("inc", 1, "r1"), ("dec", 1, "r2"), ("release", 1, "r1")])
def test_matches_a_model(engine: Any, stock: int, stripes: int, ops: list[tuple[str, int, Any]]) -> None:
    """Any sequence of decrements, increments (with or without refs, a used ref with another amount
    being RefConflict), restripes and releases keeps the total where a one-number model has it."""
    # Not random.randrange: hypothesis seeds the random module the same for every example.
    c = StripedCounter(f"model-{uuid.uuid4().hex}", stripes=stripes)
    total, refs, released = stock, dict[str, int](), set[str]()
    with Session(engine) as s, s.begin():
        assert c.create(s, "item", amount=stock).outcome is Outcome.APPLIED
        for op, n, ref in ops:
            if op in ("dec", "inc") and ref in refs and refs[ref] != (-n if op == "dec" else n):
                with pytest.raises(RefConflict):
                    (c.decrement if op == "dec" else c.increment)(s, "item", by=n, ref=ref)
            elif op == "dec":
                r = c.decrement(s, "item", by=n, ref=ref)
                if ref in refs:
                    assert r.outcome is Outcome.REPEATED
                elif n <= total:
                    assert r.outcome is Outcome.APPLIED
                    total -= n
                    if ref is not None:
                        refs[ref] = -n
                else:
                    assert r.outcome is Outcome.INSUFFICIENT and r.value == total
            elif op == "inc":
                r = c.increment(s, "item", by=n, ref=ref)
                if ref in refs:
                    assert r.outcome is Outcome.REPEATED
                else:
                    assert r.outcome is Outcome.APPLIED
                    total += n
                    if ref is not None:
                        refs[ref] = n
            elif op == "restripe":
                assert c.restripe(s, "item", stripes=n).value == total
            elif ref is not None:
                r = c.release(s, ref)
                if ref not in refs:
                    assert r.outcome is Outcome.NOT_FOUND
                elif ref in released:
                    assert r.outcome is Outcome.REPEATED
                elif refs[ref] > total:
                    # An increment's units, taken back, are gone: nothing changes, the ref stays.
                    assert r.outcome is Outcome.INSUFFICIENT and r.value == total
                else:
                    assert r.outcome is Outcome.APPLIED
                    total -= refs[ref]
                    released.add(ref)
            assert c.total(s, "item") == total


# --------------------------------------------------------------------------
# Storms: 8 processes, one hot item
# --------------------------------------------------------------------------


def test_storm_sells_exactly_the_stock_once_per_ref(
    engine: Any, backend: Backend, pool8: tuple[Any, ProcessPoolExecutor]
) -> None:
    """8 processes, stock S on 8 stripes, 2S purchases of 1-3 units with refs, a fifth of them
    redelivered to another process, then 1-unit buys until INSUFFICIENT: exactly S sold, every ref
    applied at most once and REPEATED on redelivery, the stripes summing to the ledger, INSUFFICIENT
    only once the item is truly empty."""
    stock = 120
    with Session(engine) as s, s.begin():
        w.COUNTER.create(s, w.ITEM, amount=stock)
    rng = random.Random(19)
    purchases = [(f"p{i}", rng.randint(1, 3)) for i in range(2 * stock)]
    plans: list[list[tuple[str, int]]] = [[] for _ in range(WORKERS)]
    for i, p in enumerate(purchases):
        plans[i % WORKERS].append(p)
        if rng.random() < 0.2:
            plans[(i + rng.randint(1, WORKERS - 1)) % WORKERS].append(p)
    for plan in plans:
        rng.shuffle(plan)
    reports = _run(pool8, w.storm_buyer, [(backend.name, backend.url, i, plans[i]) for i in range(WORKERS)])

    applied: Counter[str] = Counter()
    qty_of: dict[str, int] = {}
    for report in reports:
        for ref, qty, outcome in report["outcomes"]:
            qty_of[ref] = qty
            if outcome == "APPLIED":
                applied[ref] += 1
    assert max(applied.values()) == 1, "a ref applied twice"
    ledger = _ledger(engine, w.COUNTER)
    assert set(ledger) == set(applied)
    assert all(ledger[ref] == -qty_of[ref] for ref in ledger)
    sold = sum(qty_of[ref] for ref in applied)
    assert sold == stock
    amounts = _stripes(engine, w.COUNTER, w.ITEM)
    assert amounts == [0] * 8 and stock + sum(ledger.values()) == sum(amounts)
    # Redelivered purchases that applied elsewhere are REPEATED, never APPLIED twice.
    outcomes = Counter(o for r in reports for _, _, o in r["outcomes"])
    assert outcomes["REPEATED"] > 0 and outcomes["INSUFFICIENT"] > 0
    retries = Counter[str]()
    for r in reports:
        retries.update(r["counts"])
    print(f"{backend.name}: outcomes {dict(outcomes)}, retried conflicts {dict(retries)}")
    if not capable(backend, "deadlock_rolls_back_transaction"):
        # PostgreSQL's slow path survives being a deadlock victim (a savepoint); MariaDB rolls the
        # whole transaction back, and the worker retries it (counted, printed).
        assert not retries, retries


def test_large_decrements_compete_with_small_ones(
    engine: Any, backend: Backend, pool8: tuple[Any, ProcessPoolExecutor]
) -> None:
    """Stripes of 10; 4 processes take 1 at a time while 4 take 25 (more than any stripe) at once:
    every large decrement made while the item held 25 succeeds, nothing is oversold, no process
    gives up, and INSUFFICIENT reports a total below what was asked."""
    stock = 400
    with Session(engine) as s, s.begin():
        w.COUNTER.create(s, w.ITEM, amount=stock, stripes=40)
    plans = [[1] * 60 if i % 2 else [25] * 5 for i in range(WORKERS)]
    reports = _run(pool8, w.mixed_buyer, [(backend.name, backend.url, i, plans[i]) for i in range(WORKERS)])
    sold = 0
    large = Counter[str]()
    for report in reports:
        for qty, outcome, value in report["outcomes"]:
            if outcome == "APPLIED":
                sold += qty
            else:
                assert outcome == "INSUFFICIENT" and value < qty
            if qty == 25:
                large[outcome] += 1
    assert sold == stock - sum(_stripes(engine, w.COUNTER, w.ITEM))
    assert min(_stripes(engine, w.COUNTER, w.ITEM)) >= 0
    # 4 x 60 small + 20 large x 25 = 740 wanted of 400: large ones apply until stock runs low.
    assert large["APPLIED"] >= 5, large
    retries = Counter[str]()
    for r in reports:
        retries.update(r["counts"])
    print(f"{backend.name}: large {dict(large)}, sold {sold}, retried conflicts {dict(retries)}")
    if not capable(backend, "deadlock_rolls_back_transaction"):
        assert not retries, retries


def test_mixed_sizes_with_restocks_keep_stock_near_zero_without_deadlock(
    engine: Any, backend: Backend, pool8: tuple[Any, ProcessPoolExecutor]
) -> None:
    """Every process mixes decrements of 1-3 units, decrements larger than any stripe, and restocks,
    so stock hovers near zero for the whole storm: the state where a fast path finds its stripe
    emptied by a commit just before locking it, and PostgreSQL keeps that stripe locked.  Nothing
    is oversold or lost (stock + restocked - sold is what the stripes hold), no stripe goes below
    zero, INSUFFICIENT reports less than was asked, and on PostgreSQL no decrement deadlocks."""
    stock = 60
    with Session(engine) as s, s.begin():
        w.COUNTER.create(s, w.ITEM, amount=stock, stripes=12)
    rng = random.Random(23)
    sizes = [1, 1, 1, 2, 3, 7, 12, -6, -6]
    plans = [[rng.choice(sizes) for _ in range(70)] for _ in range(WORKERS)]
    reports = _run(pool8, w.churn_buyer, [(backend.name, backend.url, i, plans[i]) for i in range(WORKERS)])
    sold = restocked = 0
    outcomes = Counter[str]()
    for report in reports:
        for step, outcome, value in report["outcomes"]:
            outcomes[outcome] += 1
            if step < 0:
                assert outcome == "APPLIED"
                restocked -= step
            elif outcome == "APPLIED":
                sold += step
            else:
                assert outcome == "INSUFFICIENT" and value < step, (step, outcome, value)
    amounts = _stripes(engine, w.COUNTER, w.ITEM)
    assert stock + restocked - sold == sum(amounts)
    assert min(amounts) >= 0
    assert outcomes["INSUFFICIENT"] > 0 and outcomes["APPLIED"] > 0
    retries = Counter[str]()
    for r in reports:
        retries.update(r["counts"])
    print(f"{backend.name}: outcomes {dict(outcomes)}, sold {sold}, retried conflicts {dict(retries)}")
    if backend.name == "postgresql":
        assert not retries, retries


def test_restripe_under_concurrent_decrements_keeps_the_total(
    engine: Any, backend: Backend, pool8: tuple[Any, ProcessPoolExecutor]
) -> None:
    """One process restripes the item (1 to 16 stripes) 20 times while 7 take 1-3 units: what is
    left plus what was sold is the stock, at every restripe the total it saw was a possible one."""
    stock = 600
    with Session(engine) as s, s.begin():
        w.COUNTER.create(s, w.ITEM, amount=stock)
    rng = random.Random(7)
    args: list[tuple[Any, ...]] = [(backend.name, backend.url, 20)]
    plans = [[rng.randint(1, 3) for _ in range(30)] for _ in range(WORKERS - 1)]
    args += [(backend.name, backend.url, i, plans[i]) for i in range(WORKERS - 1)]
    manager, pool = pool8
    barrier = manager.Barrier(WORKERS)
    futures = [pool.submit(w.restriper, *args[0], barrier)]
    futures += [pool.submit(w.mixed_buyer, *a, barrier) for a in args[1:]]
    restripes, *buyers = [f.result(timeout=300) for f in futures]
    sold = sum(q for r in buyers for q, o, _ in r["outcomes"] if o == "APPLIED")
    left = sum(_stripes(engine, w.COUNTER, w.ITEM))
    assert left + sold == stock
    assert all(stock - sum(sum(p) for p in plans) <= t <= stock for t in restripes["totals"])
    assert sorted(restripes["totals"], reverse=True) == restripes["totals"]
    with engine.connect() as conn:
        counts = conn.execute(
            select(counter_stripes.c.stripes, func.count())
            .where(counter_stripes.c.stripe >= 0)  # not the restripe gate
            .group_by(counter_stripes.c.stripes)
        ).all()
    [(k, n)] = counts
    assert k == n


def test_stripe_ids_spread_evenly() -> None:
    """Stripe ids start at 0 and split [0, 2**20) into equal parts (the random start's fairness)."""
    for k in (1, 2, 3, 8, 1024):
        ids = stripe_ids(k)
        assert ids[0] == 0 and len(set(ids)) == k
        gaps = [b - a for a, b in zip(ids, [*ids[1:], SPACE], strict=True)]
        assert max(gaps) - min(gaps) <= 1
