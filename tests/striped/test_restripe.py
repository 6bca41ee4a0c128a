"""``StripedCounter.restripe()`` racing decrements, increments, reserves and other restripes:
totals stay exact, waiters survive the deletion of their stripe, and plentiful stock never deadlocks."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, bindparam, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from stateguard import (
    Outcome,
    SerializationConflict,
    StripedCounter,
    async_sqlite_engine,
)
from stateguard.striped import stripe_ids
from tests._support.striped_storms import (
    LEDGER,
    STRIPES,
    Bg,
    Holder,
    Stats,
    assert_invariant,
    new_item,
    run_threads,
)
from tests._support.striped_storms import unit as _unit
from tests.conftest import backends_with

# ---------------------------------------------------------------- restripe under fire


def test_restripe_concurrent_with_decrements_and_increments(backend: Any, engine: Engine) -> None:
    counter = StripedCounter("re", stripes=8)
    start = 500
    new_item(engine, counter, "r", start)
    stats = Stats()
    plan = [3, 12, 1, 8, 5, 2, 16, 4]

    def worker(i: int) -> list[tuple[str, int, Any]]:
        rng = random.Random(300 + i)
        out = []
        if i == 0:
            for k in plan:
                out.append(("re", k, unit(engine, lambda s, k=k: counter.restripe(s, "r", stripes=k), stats)))
                time.sleep(0.02)
            return out
        for _ in range(12):
            by = rng.choice([1, 2, 5, 11, 33])
            if rng.random() < 0.25:
                out.append(
                    ("inc", by, unit(engine, lambda s, by=by: counter.increment(s, "r", by=by), stats))
                )
            else:
                out.append(
                    ("dec", by, unit(engine, lambda s, by=by: counter.decrement(s, "r", by=by), stats))
                )
        return out

    results = [x for w in run_threads(10, worker) for x in w]
    total = start
    for kind, by, r in results:
        if kind == "re":
            assert r.outcome in (Outcome.APPLIED, Outcome.REPEATED), r
        elif r.outcome is Outcome.APPLIED:
            total += by if kind == "inc" else -by
        else:
            assert kind == "dec" and r.outcome is Outcome.INSUFFICIENT and r.value < by, (kind, by, r)
    amounts = assert_invariant(engine, counter, "r", total)
    assert len(amounts) == plan[-1], amounts


@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_restripe_waits_for_open_holders_and_keeps_total(backend: Any, engine: Engine) -> None:
    counter = StripedCounter("reh", stripes=8)
    new_item(engine, counter, "r", 80)
    commit_holder = Holder(engine, lambda s: counter.decrement(s, "r", by=9)).start()
    rollback_holder = Holder(engine, lambda s: counter.decrement(s, "r", by=7), commit=False).start()
    stats = Stats()
    re = Bg(lambda: unit(engine, lambda s: counter.restripe(s, "r", stripes=3), stats))
    time.sleep(0.5)
    commit_holder.finish()
    rollback_holder.finish()
    assert re.get().outcome is Outcome.APPLIED
    amounts = assert_invariant(engine, counter, "r", 71)
    assert len(amounts) == 3 and max(amounts) - min(amounts) <= 1, amounts


# ---------------------------------------------------------------- helpers


def unit(engine: Engine, op: Callable[[Session], Any], stats: Stats, attempts: int = 60) -> Any:
    """``op`` in its own transaction; typed retryable errors are counted and retried (up to 60 times)."""
    return _unit(engine, op, stats, attempts)


def check_item(engine: Engine, counter: StripedCounter, item: str, expected: int) -> list[int]:
    with Session(engine) as s:
        total, amounts = counter.total(s, item), counter.stripe_amounts(s, item)
    assert all(a >= 0 for a in amounts), amounts
    assert sum(amounts) == total == expected, (item, total, expected, amounts)
    return amounts


def stored(engine: Engine, counter: str) -> list[tuple[int, int]]:
    """``(stripe, stripes)`` of the counter's rows in stripe order, its restripe gates left out."""
    sql = f"SELECT stripe, stripes FROM {STRIPES} WHERE counter = :c AND stripe >= 0 ORDER BY stripe"
    with Session(engine) as s:
        return [(int(r[0]), int(r[1])) for r in s.execute(text(sql), {"c": counter})]


def ledger(engine: Engine, counter: StripedCounter) -> list[tuple[Any, ...]]:
    with Session(engine) as s:
        rows = s.execute(
            text(f"SELECT ref, row_key, delta, released_at FROM {LEDGER} WHERE column_name = :c"),
            {"c": counter.name},
        ).all()
    return [tuple(r) for r in rows]


def _restripe_storm(engine: Engine, counts: list[int]) -> tuple[Stats, Stats, Counter[str]]:
    c = StripedCounter("rs", stripes=8)
    items = [f"r-{n}" for n in range(4)]
    with Session(engine) as s, s.begin():
        for item in items:
            c.create(s, item, amount=100_000)
    buyers, restripers = Stats(), Stats()
    taken: Counter[str] = Counter()
    lock = threading.Lock()

    def work(i: int) -> None:
        rng = random.Random(i)
        if i < 2:
            for k in range(40):
                item, n = items[(k + i) % 4], counts[(k + i) % len(counts)]
                r = unit(engine, lambda s, item=item, n=n: c.restripe(s, item, stripes=n), restripers)
                assert r.outcome is Outcome.APPLIED
            return
        for k in range(40):
            item, by = rng.choice(items), rng.randint(1, 3)
            ref = f"b{i}-{k}"
            if k % 5 == 4:
                basket = {item: by, items[(items.index(item) + 1) % 4]: 1}
                r = unit(engine, lambda s, b=basket, ref=ref: c.reserve(s, b, ref=ref), buyers)
                assert r.outcome is Outcome.APPLIED
                with lock:
                    taken.update(basket)
            else:
                r = unit(
                    engine, lambda s, it=item, by=by, ref=ref: c.decrement(s, it, by=by, ref=ref), buyers
                )
                assert r.outcome is Outcome.APPLIED
                with lock:
                    taken[item] += by

    run_threads(12, work, timeout=80)
    for item in items:
        check_item(engine, c, item, 100_000 - taken[item])
    return buyers, restripers, taken


@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_restripe_between_nested_counts_plentiful_stock(backend: Any, engine: Engine) -> None:
    """Restripes between 4 and 8 stripes (whose stripe ids are a subset of each other's) racing
    ref'd decrements and reserves: exact, and no deadlock with plentiful stock."""
    buyers, restripers, _ = _restripe_storm(engine, [4, 8])
    assert buyers.retryable["DeadlockDetected"] == 0, buyers.retryable
    assert restripers.retryable["DeadlockDetected"] == 0, restripers.retryable


# README: "With plentiful stock there are none [deadlocks]", restripes included.  Restripes to stripe
# counts whose ids differ (3, 8, 5, 16, 2) racing one-call decrements and reserves of plentiful stock
# (100000 units, by <= 3).  MariaDB used to deadlock 20-60 times per run: a decrement that named a
# stripe the item no longer had, or whose wait ended on a stripe a restripe deleted, keeps an InnoDB
# lock there (a gap lock, or the deleted row's) until it commits, and the restripe inserted its new
# stripes there while holding the stripes that decrement waited for.  A restripe now queues at its
# gate and inserts before it locks any stripe; its DELETEs go one key at a time (a DELETE ... IN
# (...) ran as a scan and locked a neighbouring item's rows).
@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_restripe_to_other_counts_plentiful_stock_no_deadlock(backend: Any, engine: Engine) -> None:
    """Restripes to counts with other stripe ids (3, 8, 5, 16, 2) racing ref'd decrements and
    reserves of plentiful stock: exact, and no deadlock on either side."""
    buyers, restripers, _ = _restripe_storm(engine, [3, 8, 5, 16, 2])
    assert buyers.retryable["DeadlockDetected"] == 0, buyers.retryable
    assert restripers.retryable["DeadlockDetected"] == 0, restripers.retryable


# Restripes of one item queue at its gate (an INSERT and DELETE of a key no stripe has): on MariaDB
# a plain INSERT's duplicate check waits for a shared lock, so when the holder committed two queued
# restripes both got it and then each waited for the other to take the exclusive one (a deadlock).
@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_restripes_queued_behind_an_open_restripe_all_apply(backend: Any, engine: Engine) -> None:
    """Three restripes (5, 16, 2) queue behind an open restripe 8 -> 3: once it commits all three
    apply in turn, with no deadlock, and the item ends with exactly the stripes its count names."""
    c = StripedCounter("queue", stripes=8)
    with Session(engine) as s, s.begin():
        c.create(s, "q", amount=8000)
    holder_ready, go = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def holder() -> None:
        try:
            with Session(engine) as s, s.begin():
                assert c.restripe(s, "q", stripes=3).outcome is Outcome.APPLIED
                holder_ready.set()
                assert go.wait(30)
        except BaseException as error:
            errors.append(error)
            holder_ready.set()

    h = threading.Thread(target=holder, daemon=True)
    h.start()
    assert holder_ready.wait(15) and not errors
    outcomes: list[Any] = [None] * 3
    ids: list[int] = []

    def restriper(i: int) -> None:
        try:
            with Session(engine) as s, s.begin():
                ids.append(_connection_id(s, backend))
                outcomes[i] = c.restripe(s, "q", stripes=[5, 16, 2][i]).outcome
        except SerializationConflict as error:
            outcomes[i] = type(error).__name__

    queued = [threading.Thread(target=restriper, args=(i,), daemon=True) for i in range(3)]
    for t in queued:
        t.start()
    deadline = time.monotonic() + 15
    while _lock_waiters(backend, ids, "INSERT ") < 3 and time.monotonic() < deadline:
        time.sleep(0.01)  # polling a condition, not hoping for a race
    assert _lock_waiters(backend, ids, "INSERT ") == 3, ("restripes never queued at the gate", outcomes)
    go.set()
    h.join(30)
    for t in queued:
        t.join(30)
    assert not errors, errors
    assert outcomes == [Outcome.APPLIED] * 3, outcomes
    amounts = check_item(engine, c, "q", 8000)
    assert len(amounts) in (5, 16, 2), amounts
    assert stored(engine, "queue") == [(stripe, len(amounts)) for stripe in stripe_ids(len(amounts))]


# README: a decrement about to wait for a busy stripe takes the restripe gate shared without waiting
# first.  The stripe it waits for is picked from its snapshot, which may be older than the last
# restripe: it can be one that a restripe under way is inserting again, while the decrement holds a
# lock where that restripe inserts next (a stripe the item did not have, named by an earlier
# lookup).  Waiting for it was a deadlock (MariaDB); with the gate held, it waits for stripe 0.
@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_decrement_waiting_on_a_stripe_a_restripe_is_inserting_again(backend: Any, engine: Engine) -> None:
    """A decrement whose snapshot shows 16 stripes, of which only stripe 131072 holds ``by``,
    holding a lock on stripe 786432 (gone since a restripe 16 -> 3): a restripe 3 -> 16 inserts
    131072 and waits at 786432; the decrement then does not wait for 131072 but for stripe 0, and
    both apply once stripe 0's holder lets go."""
    c = StripedCounter("again", stripes=16)
    with Session(engine) as s, s.begin():
        c.create(s, "a", amount=1600)  # 100 a stripe
        s.execute(text(f"UPDATE {STRIPES} SET amount = 1000 WHERE counter = 'again' AND stripe = 131072"))
    late = Session(engine)
    late.begin()
    assert c.total(late, "a") == 2500  # the snapshot: 16 stripes, 131072 the only one with 500
    with Session(engine) as s, s.begin():
        assert c.restripe(s, "a", stripes=3).value == 2500
    one = f"SELECT amount FROM {STRIPES} WHERE counter = 'again' AND item = 'a' AND stripe = :s FOR UPDATE"
    late.execute(text(one), {"s": 786432}).all()  # the lock a stale lookup leaves
    holder = Session(engine)
    holder.begin()
    for stripe in stripe_ids(3):
        holder.execute(text(one), {"s": stripe}).all()  # every stripe busy: no fast path
    outcomes: dict[str, Any] = {}
    ids: list[int] = []

    def restriper() -> None:
        try:
            with Session(engine) as s, s.begin():
                ids.append(_connection_id(s, backend))
                outcomes["restripe"] = c.restripe(s, "a", stripes=16).outcome
        except SerializationConflict as error:
            outcomes["restripe"] = type(error).__name__

    def buyer() -> None:
        try:
            ids.append(_connection_id(late, backend))
            outcomes["decrement"] = c.decrement(late, "a", by=500).outcome
            late.commit()
        except SerializationConflict as error:
            outcomes["decrement"] = type(error).__name__
            late.rollback()

    threads = [threading.Thread(target=restriper, daemon=True)]
    threads[0].start()
    deadline = time.monotonic() + 15
    while _lock_waiters(backend, ids, "") < 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # polling a condition, not hoping for a race
    assert _lock_waiters(backend, ids, "") == 1, ("the restripe never waited", outcomes)
    threads.append(threading.Thread(target=buyer, daemon=True))
    threads[1].start()
    while _lock_waiters(backend, ids, "") < 2 and not outcomes and time.monotonic() < deadline:
        time.sleep(0.01)
    holder.rollback()
    for t in threads:
        t.join(30)
    late.close()
    holder.close()
    assert outcomes == {"restripe": Outcome.APPLIED, "decrement": Outcome.APPLIED}, outcomes
    amounts = check_item(engine, c, "a", 2000)
    assert len(amounts) == 16, amounts


# A restripe plans its new stripes from a read without locks.  In a transaction whose snapshot is
# older than another restripe's commit (MariaDB, REPEATABLE READ) that read shows the old stripes:
# some ids it inserts may be taken (its INSERT fails with a duplicate key, and is left out), others
# are missing; what it finds once it holds the stripes decides.
@pytest.mark.parametrize(("first", "then"), [(3, 5), (3, 6), (16, 2), (2, 16)])
@pytest.mark.parametrize("backend", backends_with("concurrent_writers"), indirect=True)
def test_restripe_in_a_transaction_whose_snapshot_predates_another_restripe(
    backend: Any, engine: Engine, first: int, then: int
) -> None:
    """A transaction reads the item, another restripes it 8 -> ``first`` and commits, then the first
    restripes it to ``then``: APPLIED with the whole total, exactly the stripes ``then`` names."""
    c = StripedCounter("stale", stripes=8)
    with Session(engine) as s, s.begin():
        c.create(s, "s", amount=1001)
    with Session(engine) as late, late.begin():
        assert c.total(late, "s") == 1001  # the snapshot (InnoDB: this transaction's first read)
        with Session(engine) as s, s.begin():
            assert c.restripe(s, "s", stripes=first).value == 1001
        r = c.restripe(late, "s", stripes=then)
        assert (r.outcome, r.value) == (Outcome.APPLIED, 1001)
    amounts = check_item(engine, c, "s", 1001)
    assert len(amounts) == then and max(amounts) - min(amounts) <= 1, amounts
    assert stored(engine, "stale") == [(stripe, then) for stripe in stripe_ids(then)]
    with Session(engine) as s, s.begin():
        assert c.decrement(s, "s", by=1001).outcome is Outcome.APPLIED  # every stripe is reachable


def test_restripe_storm_exact_on_every_backend(backend: Any, engine: Engine) -> None:
    """Whatever the deadlocks, nothing is lost or oversold and every ref applies once."""
    _, _, taken = _restripe_storm(engine, [3, 8, 5, 1, 16, 2])
    refs = ledger(engine, StripedCounter("rs"))
    assert len({(r[0], r[1]) for r in refs}) == len(refs)
    assert sum(-int(r[2]) for r in refs) == sum(taken.values())


# ---------------------------------------------------------------- async


def _async_engine(backend: Any) -> Any:
    if backend.name == "sqlite":
        return async_sqlite_engine(backend.url.replace("sqlite://", "sqlite+aiosqlite://", 1))
    if backend.name == "mariadb":
        return create_async_engine(backend.url.replace("mysql+pymysql", "mysql+aiomysql", 1), pool_size=20)
    return create_async_engine(backend.url, pool_size=20)


def test_async_sessions_reserve_release_restripe(backend: Any, engine: Engine) -> None:
    c = StripedCounter("async-r", stripes=4)
    with Session(engine) as s, s.begin():
        c.create(s, "a", amount=500)
        c.create(s, "b", amount=500)

    async def one(aeng: Any, k: int) -> tuple[str, int]:
        for attempt in range(60):
            try:
                async with AsyncSession(aeng) as s, s.begin():
                    if k % 10 == 9:
                        n = [1, 3, 8][k % 3]
                        assert (await c.restripe(s, "a", stripes=n)).outcome is Outcome.APPLIED
                        return "restripe", 0
                    r = await c.reserve(s, {"b": 1, "a": 2}, ref=f"ar-{k}")
                    assert r.outcome is Outcome.APPLIED
                    assert (await c.reserve(s, {"a": 2, "b": 1}, ref=f"ar-{k}")).outcome is Outcome.REPEATED
                    if k % 3 == 0:
                        rel = await c.release(s, f"ar-{k}")
                        assert rel.outcome is Outcome.APPLIED and rel.value == {"a": 2, "b": 1}
                        return "released", 0
                    return "kept", 1
            except SerializationConflict:
                await asyncio.sleep(random.uniform(0, 0.005 * (attempt + 1)))
        raise AssertionError("gave up")

    async def main() -> list[tuple[str, int]]:
        aeng = _async_engine(backend)
        try:
            return await asyncio.gather(*(one(aeng, k) for k in range(40)))
        finally:
            await aeng.dispose()

    results = asyncio.run(main())
    kept = sum(n for _, n in results)
    assert Counter(kind for kind, _ in results)["restripe"] == 4
    check_item(engine, c, "a", 500 - 2 * kept)
    check_item(engine, c, "b", 500 - kept)
    refs = ledger(engine, c)
    assert len(refs) == 2 * 36
    assert sum(1 for r in refs if r[3] is not None) == 2 * (36 - kept)


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


# README: "With plentiful stock there are none [deadlocks]", "restripe locks every stripe and keeps
# the total exactly, under concurrent decrements": one-call decrements queued behind an open
# restripe 8 -> 3 all apply once it commits (MariaDB: a decrement whose wait ended on a stripe the
# restripe deleted keeps that deleted row's lock; the sweep after it names only the stripes the
# count on stripe 0 names, never the deleted ones another buyer holds).
@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_decrements_waiting_behind_a_restripe_plentiful_stock(backend: Any, engine: Engine) -> None:
    """Four ref'd decrements of 1 unit wait behind an open restripe 8 -> 3 (8000 in stock): all
    APPLIED after it commits, no deadlock, exact total."""
    c = StripedCounter("behind", stripes=8)
    with Session(engine) as s, s.begin():
        c.create(s, "w", amount=8000)
    holder_ready, go = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def restriper() -> None:
        try:
            with Session(engine) as s, s.begin():
                assert c.restripe(s, "w", stripes=3).outcome is Outcome.APPLIED
                holder_ready.set()
                assert go.wait(30)
        except BaseException as error:
            errors.append(error)
            holder_ready.set()

    h = threading.Thread(target=restriper, daemon=True)
    h.start()
    assert holder_ready.wait(15) and not errors
    outcomes: list[Any] = [None] * 4

    ids: list[int] = []

    def buyer(i: int) -> None:
        try:
            with Session(engine) as s, s.begin():
                ids.append(_connection_id(s, backend))
                outcomes[i] = c.decrement(s, "w", by=1, ref=f"wb-{i}").outcome
        except SerializationConflict as error:
            outcomes[i] = type(error).__name__

    buyers = [threading.Thread(target=buyer, args=(i,), daemon=True) for i in range(4)]
    for t in buyers:
        t.start()
    deadline = time.monotonic() + 15
    while _lock_waiters(backend, ids) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)  # polling a condition, not hoping for a race
    assert _lock_waiters(backend, ids) == 4, ("buyers never queued behind the restripe", outcomes)
    go.set()
    h.join(30)
    for t in buyers:
        t.join(30)
    assert not errors, errors
    assert outcomes == [Outcome.APPLIED] * 4, outcomes
    check_item(engine, c, "w", 7996)
