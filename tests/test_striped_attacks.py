"""Attacks on the README's promises about striped counters (### Striped counters).

Every storm re-reads the database in a new Session afterwards and checks:
start + APPLIED increments - APPLIED decrements (+ released refs) == total(), no stripe
below zero, every INSUFFICIENT's value below what was asked (and, when only decrements ran,
above or equal to the final total, which must itself be below what was asked).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, bindparam, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from stateguard import (
    DeadlockDetected,
    Outcome,
    RefConflict,
    SerializationConflict,
    StripedCounter,
    async_sqlite_engine,
    create_tables,
    drop_tables,
    retry_on_conflict,
    striped,
)

STRIPES = "stateguard_counter_stripes"
LEDGER = "stateguard_counter_ledger"


# ---------------------------------------------------------------- helpers


def run_threads(n: int, fn: Callable[[int], Any], timeout: float = 60) -> list[Any]:
    """Run ``fn(i)`` in ``n`` threads started together; re-raise the first worker error."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n
    errors: list[tuple[int, BaseException, str]] = []

    def wrap(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = fn(i)
        except BaseException as error:  # reported to the test below
            errors.append((i, error, traceback.format_exc()))

    threads = [threading.Thread(target=wrap, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [t for t in threads if t.is_alive()]
    assert not alive, f"{len(alive)} workers still running after {timeout}s (hang/deadlock?)"
    if errors:
        i, error, tb = errors[0]
        raise AssertionError(f"{len(errors)} worker(s) failed; worker {i}:\n{tb}") from error
    return results


class Stats:
    """Thread-safe record of retryable errors that reached the caller."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.retryable: Counter[str] = Counter()

    def add(self, name: str) -> None:
        with self.lock:
            self.retryable[name] += 1


def unit(engine: Engine, op: Callable[[Session], Any], stats: Stats, attempts: int = 40) -> Any:
    """Run ``op`` in its own transaction; retry typed retryable stateguard errors only.

    Any other error (a raw driver error from a stateguard call, above all) propagates.
    """
    for attempt in range(attempts):
        with Session(engine) as s:
            try:
                with s.begin():
                    return op(s)
            except SerializationConflict as error:
                assert error.retryable
                stats.add(type(error).__name__)
                time.sleep(random.uniform(0, 0.01 * (attempt + 1)))
    raise AssertionError(f"gave up after {attempts} attempts: {stats.retryable}")


def new_item(
    engine: Engine, counter: StripedCounter, item: str, amount: int, stripes: int | None = None
) -> None:
    with Session(engine) as s, s.begin():
        r = counter.create(s, item, amount=amount, stripes=stripes)
        assert r.outcome is Outcome.APPLIED


def state(engine: Engine, counter: StripedCounter, item: str) -> tuple[int | None, list[int]]:
    with Session(engine) as s:
        return counter.total(s, item), counter.stripe_amounts(s, item)


def assert_invariant(engine: Engine, counter: StripedCounter, item: str, expected: int) -> list[int]:
    total, amounts = state(engine, counter, item)
    assert all(a >= 0 for a in amounts), f"negative stripe: {amounts}"
    assert sum(amounts) == total, (amounts, total)
    assert total == expected, f"total {total} != expected {expected} (stripes {amounts})"
    return amounts


def ledger_refs(engine: Engine, counter: StripedCounter) -> list[tuple[str, str, str, Any]]:
    with Session(engine) as s:
        rows = s.execute(
            text(f"SELECT ref, row_key, delta, released_at FROM {LEDGER} WHERE column_name = :c"),
            {"c": counter.name},
        ).all()
    return [tuple(r) for r in rows]


def lock_stripes_sql(backend_name: str) -> str:
    return (
        f"SELECT stripe, amount FROM {STRIPES} WHERE counter = :c AND item = :i AND stripe IN :s FOR UPDATE"
    )


class Holder:
    """A transaction that holds something open until told to finish."""

    def __init__(self, engine: Engine, action: Callable[[Session], Any], commit: bool = True) -> None:
        self.engine = engine
        self.action = action
        self.commit = commit
        self.held = threading.Event()
        self.go = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with Session(self.engine) as s:
                s.begin()
                self.result = self.action(s)
                self.held.set()
                self.go.wait(30)
                if self.commit:
                    s.commit()
                else:
                    s.rollback()
        except BaseException as error:
            self.error = error
            self.held.set()

    def start(self) -> Holder:
        self.thread.start()
        assert self.held.wait(15), "holder never got its locks"
        assert self.error is None, self.error
        return self

    def finish(self) -> None:
        self.go.set()
        self.thread.join(30)
        assert not self.thread.is_alive()
        assert self.error is None, self.error


class Bg:
    """Run one call in a thread, timing it and keeping its result or error."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.elapsed: float | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            self.result = self.fn()
        except BaseException as error:
            self.error = error
        finally:
            self.elapsed = time.monotonic() - t0
            self.done.set()

    def get(self, timeout: float = 30) -> Any:
        assert self.done.wait(timeout), "call hung"
        if self.error is not None:
            raise self.error
        return self.result


def pg_waiting_backends(engine: Engine) -> int:
    """How many sessions of this database wait for a lock right now (PostgreSQL)."""
    with engine.connect() as conn:
        return conn.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND datname = current_database()"
            )
        ).scalar_one()


# ---------------------------------------------------------------- storms on every backend

SIZES = [1, 1, 2, 3, 5, 8, 13, 27, 60, 95]


def test_storm_mixed_sizes_decrements_only(backend: Any, engine: Engine) -> None:
    """Never oversold, never a lost unit; INSUFFICIENT only when the whole item lacks the amount."""
    counter = StripedCounter("storm", stripes=8)
    start = 700
    new_item(engine, counter, "hot", start)
    stats = Stats()
    n, per = 16, 14

    def worker(i: int) -> list[tuple[int, str | None, Any]]:
        rng = random.Random(i)
        out = []
        for j in range(per):
            by = rng.choice(SIZES)
            ref = f"d-{i}-{j}" if j % 2 else None
            r = unit(engine, lambda s, by=by, ref=ref: counter.decrement(s, "hot", by=by, ref=ref), stats)
            out.append((by, ref, r))
        return out

    results = [x for w in run_threads(n, worker) for x in w]
    applied = sum(by for by, _, r in results if r.outcome is Outcome.APPLIED)
    final = start - applied
    assert final >= 0
    assert_invariant(engine, counter, "hot", final)
    assert all(r.value is None for _, _, r in results if r.outcome is Outcome.APPLIED)
    insufficient = [(by, r.value) for by, _, r in results if r.outcome is Outcome.INSUFFICIENT]
    assert {r.outcome for _, _, r in results} <= {Outcome.APPLIED, Outcome.INSUFFICIENT}
    for by, value in insufficient:
        assert value is not None and value < by, (by, value)
        # totals only fall: the total seen then is >= the final total, which still lacks `by`
        assert value >= final, (by, value, final)
        assert final < by, f"INSUFFICIENT for {by} but {final} units are still there"
    # ledger: exactly the APPLIED ref'd decrements, none of the INSUFFICIENT ones
    refs = {ref: str(-by) for by, ref, r in results if ref and r.outcome is Outcome.APPLIED}
    got = {ref: delta for ref, _, delta, _ in ledger_refs(engine, counter)}
    assert got == refs
    print(f"{backend.name}: retryable errors reaching the caller: {dict(stats.retryable)}")
    if backend.name == "postgresql":
        # documented: deadlocks reach the caller only in rare cases, when stock runs low
        assert sum(stats.retryable.values()) <= 3, stats.retryable


@pytest.mark.parametrize("stripes", [1, 6])
def test_storm_drains_to_zero_with_unit_decrements(backend: Any, engine: Engine, stripes: int) -> None:
    """More unit buyers than stock: every unit sold exactly once, nothing left, no INSUFFICIENT early."""
    counter = StripedCounter("drain", stripes=stripes)
    start = 150
    new_item(engine, counter, "x", start)
    stats = Stats()

    def worker(i: int) -> list[Any]:
        return [
            unit(engine, lambda s, j=j: counter.decrement(s, "x", by=1, ref=f"u-{i}-{j}"), stats)
            for j in range(12)
        ]

    results = [r for w in run_threads(16, worker) for r in w]
    applied = sum(1 for r in results if r.outcome is Outcome.APPLIED)
    assert applied == start, (applied, Counter(r.outcome for r in results))
    assert_invariant(engine, counter, "x", 0)
    assert all(r.value == 0 for r in results if r.outcome is Outcome.INSUFFICIENT)


def test_storm_increments_refs_and_replays(backend: Any, engine: Engine) -> None:
    """Mixed decrements/increments with refs replayed by other threads: refs apply at most once."""
    counter = StripedCounter("mixed", stripes=5)
    start = 120
    new_item(engine, counter, "m", start)
    stats = Stats()
    # every ref is used by two threads at once (worker i and i ^ 1) with the same amount
    n, per = 16, 10

    def worker(i: int) -> list[tuple[str, int, str, Any]]:
        rng = random.Random(i // 2)
        out = []
        for j in range(per):
            kind = rng.choice(["dec", "dec", "dec", "inc"])
            by = rng.choice([1, 2, 4, 9, 31, 70])
            ref = f"{kind}-{i // 2}-{j}"
            if kind == "dec":
                r = unit(engine, lambda s, by=by, ref=ref: counter.decrement(s, "m", by=by, ref=ref), stats)
            else:
                r = unit(engine, lambda s, by=by, ref=ref: counter.increment(s, "m", by=by, ref=ref), stats)
            out.append((kind, by, ref, r))
        return out

    results = [x for w in run_threads(n, worker) for x in w]
    by_ref: dict[str, list[Any]] = {}
    for kind, by, ref, r in results:
        by_ref.setdefault(ref, []).append((kind, by, r.outcome))
    total = start
    for ref, calls in by_ref.items():
        outcomes = Counter(o for _, _, o in calls)
        assert outcomes[Outcome.APPLIED] <= 1, (ref, calls)
        if outcomes[Outcome.APPLIED]:
            kind, by, _ = calls[0]
            total += by if kind == "inc" else -by
    amounts = assert_invariant(engine, counter, "m", total)
    assert len(amounts) == 5
    ledger = ledger_refs(engine, counter)
    assert len(ledger) == len({r for r, _, _, _ in ledger})
    applied_refs = {ref for ref, calls in by_ref.items() if any(o is Outcome.APPLIED for _, _, o in calls)}
    assert {r for r, _, _, _ in ledger} == applied_refs


def test_same_ref_from_sixteen_threads_applies_once(backend: Any, engine: Engine) -> None:
    counter = StripedCounter("sameref", stripes=4)
    new_item(engine, counter, "s", 100)
    stats = Stats()

    def worker(i: int) -> Any:
        by = 4 if i == 15 else 30
        try:
            return by, unit(engine, lambda s: counter.decrement(s, "s", by=by, ref="only"), stats)
        except RefConflict as error:
            return by, error

    results = run_threads(16, worker)
    winners = [by for by, r in results if not isinstance(r, RefConflict) and r.outcome is Outcome.APPLIED]
    assert len(winners) == 1, results
    (won,) = winners
    for by, r in results:
        if by == won:
            assert isinstance(r, RefConflict) is False and r.outcome in (Outcome.APPLIED, Outcome.REPEATED), r
        else:
            assert isinstance(r, RefConflict), (by, r)
    assert_invariant(engine, counter, "s", 100 - won)


# ---------------------------------------------------------------- PostgreSQL: no locks for INSUFFICIENT


@pytest.fixture
def pg_engine(pg: Any) -> Any:
    drop_tables(pg.engine)
    create_tables(pg.engine)
    yield pg.engine
    drop_tables(pg.engine)


@pytest.fixture(params=["postgresql", "mariadb"])
def server_engine(request: pytest.FixtureRequest, namespaces: Any) -> Any:
    from tests.conftest import _only

    for b in _only(request.param, namespaces):
        drop_tables(b.engine)
        create_tables(b.engine)
        yield b
        drop_tables(b.engine)


def test_pg_insufficient_settled_without_waiting_for_holders(pg_engine: Engine) -> None:
    """Every stripe held by an uncommitted decrement; a decrement above the total answers at once."""
    counter = StripedCounter("nolock", stripes=8)
    new_item(pg_engine, counter, "i", 80)
    holders = [Holder(pg_engine, lambda s: counter.decrement(s, "i", by=1)).start() for _ in range(8)]
    try:
        with Session(pg_engine) as s:
            before = s.execute(text(f"SELECT count(*) FROM {STRIPES}")).scalar_one()
        assert before == 8
        call = Bg(lambda: unit(pg_engine, lambda s: counter.decrement(s, "i", by=81), Stats()))
        r = call.get(timeout=5)
        assert r.outcome is Outcome.INSUFFICIENT
        assert r.value == 80  # uncommitted decrements still show their units
        assert call.elapsed is not None and call.elapsed < 1.0, f"waited {call.elapsed:.2f}s for holders"
    finally:
        for h in holders:
            h.finish()
    assert_invariant(pg_engine, counter, "i", 72)


@pytest.mark.parametrize("how", ["for_update", "restripe"])
def test_pg_insufficient_without_lock_when_rows_locked_otherwise(pg_engine: Engine, how: str) -> None:
    """Every stripe locked by a raw SELECT ... FOR UPDATE, or by a restripe not yet committed:
    a decrement above the item's total still answers INSUFFICIENT at once."""
    counter = StripedCounter("nolock2", stripes=8)
    new_item(pg_engine, counter, "i", 80)
    sql = text(lock_stripes_sql("postgresql")).bindparams(bindparam("s", expanding=True))
    if how == "for_update":
        holder = Holder(
            pg_engine, lambda s: s.execute(sql, {"c": "nolock2", "i": "i", "s": list(range(8))}).all()
        )
    else:
        holder = Holder(pg_engine, lambda s: counter.restripe(s, "i", stripes=3))
    holder.start()
    try:
        call = Bg(
            lambda: unit(pg_engine, lambda s: counter.decrement(s, "i", by=81, ref="too-many"), Stats())
        )
        r = call.get(timeout=5)
        assert r.outcome is Outcome.INSUFFICIENT and r.value == 80, r
        assert call.elapsed is not None and call.elapsed < 1.0, f"waited {call.elapsed:.2f}s"
    finally:
        holder.finish()
    assert_invariant(pg_engine, counter, "i", 80)
    assert ledger_refs(pg_engine, counter) == []


def test_pg_decrement_not_insufficient_when_holders_roll_back(pg_engine: Engine) -> None:
    """by is above what commits would leave but below the committed total: must wait, then APPLIED."""
    counter = StripedCounter("rb", stripes=8)
    new_item(pg_engine, counter, "i", 80)
    holders = [
        Holder(pg_engine, lambda s: counter.decrement(s, "i", by=1), commit=False).start() for _ in range(8)
    ]
    stats = Stats()
    call = Bg(lambda: unit(pg_engine, lambda s: counter.decrement(s, "i", by=75), stats))
    time.sleep(0.8)
    assert not call.done.is_set(), f"answered {call.result} while every stripe was held"
    for h in holders:
        h.finish()
    r = call.get()
    assert r.outcome is Outcome.APPLIED, r
    assert_invariant(pg_engine, counter, "i", 5)


def test_pg_insufficient_after_holders_commit_reports_new_total(pg_engine: Engine) -> None:
    counter = StripedCounter("rc", stripes=8)
    new_item(pg_engine, counter, "i", 80)
    holders = [Holder(pg_engine, lambda s: counter.decrement(s, "i", by=2)).start() for _ in range(8)]
    call = Bg(lambda: unit(pg_engine, lambda s: counter.decrement(s, "i", by=70), Stats()))
    time.sleep(0.8)
    assert not call.done.is_set(), f"answered {call.result} before the holders decided"
    for h in holders:
        h.finish()
    r = call.get()
    # holders commit one by one: once 6 of 8 committed, the committed total (68) already lacks 70
    assert r.outcome is Outcome.INSUFFICIENT and r.value in (64, 66, 68), r
    assert_invariant(pg_engine, counter, "i", 64)


def test_pg_big_decrement_takes_free_stripes_without_waiting(pg_engine: Engine) -> None:
    """Two stripes held by open transactions; by > any stripe but <= what the free stripes hold."""
    counter = StripedCounter("free", stripes=8)
    new_item(pg_engine, counter, "i", 80)
    holders = [Holder(pg_engine, lambda s: counter.decrement(s, "i", by=1)).start() for _ in range(2)]
    try:
        call = Bg(lambda: unit(pg_engine, lambda s: counter.decrement(s, "i", by=55), Stats()))
        r = call.get(timeout=10)
        assert r.outcome is Outcome.APPLIED
        assert call.elapsed is not None and call.elapsed < 1.0, f"waited {call.elapsed:.2f}s"
    finally:
        for h in holders:
            h.finish()
    assert_invariant(pg_engine, counter, "i", 23)


def test_pg_waiting_big_decrement_holds_no_free_stripe(pg_engine: Engine) -> None:
    """A decrement that must wait gives back what it took: a small buyer is not blocked by it."""
    counter = StripedCounter("givesback", stripes=8)
    new_item(pg_engine, counter, "i", 80)
    holders = [Holder(pg_engine, lambda s: counter.decrement(s, "i", by=1)).start() for _ in range(6)]
    stats = Stats()
    big = Bg(lambda: unit(pg_engine, lambda s: counter.decrement(s, "i", by=30), stats))
    try:
        time.sleep(0.8)
        assert not big.done.is_set(), big.result
        small = Bg(lambda: unit(pg_engine, lambda s: counter.decrement(s, "i", by=3), stats))
        r = small.get(timeout=10)
        assert r.outcome is Outcome.APPLIED
        assert small.elapsed is not None and small.elapsed < 1.0, (
            f"small buyer waited {small.elapsed:.2f}s: the waiting big decrement holds the free stripes"
        )
    finally:
        for h in holders:
            h.finish()
    assert big.get().outcome is Outcome.APPLIED
    assert_invariant(pg_engine, counter, "i", 80 - 6 - 30 - 3)
    assert not stats.retryable, stats.retryable


def test_holder_then_big_decrement_in_same_txn_vs_waiting_big(server_engine: Any) -> None:
    """A holds a stripe, B waits with by > anything; A then decrements more than one stripe.

    On PostgreSQL B must not hold the stripe A needs while it waits: no deadlock, A APPLIED,
    B INSUFFICIENT with the true total.  MariaDB may (documented) give one of them DeadlockDetected.
    """
    eng = server_engine.engine
    counter = StripedCounter("pair", stripes=2)
    for round_ in range(4):
        item = f"p{round_}"
        new_item(eng, counter, item, 20)  # 10 + 10
        a_session = Session(eng)
        a_session.begin()
        try:
            assert counter.decrement(a_session, item, by=1).outcome is Outcome.APPLIED
            b = Bg(lambda item=item: counter_dec_once(eng, counter, item, 15))
            time.sleep(0.5)
            assert not b.done.is_set(), b.result
            a = Bg(lambda item=item, sa=a_session: counter.decrement(sa, item, by=12))
            ra = a.get(timeout=20)
            a_error = None
        except DeadlockDetected as error:
            a_error = error
            ra = None
        finally:
            if a_session.in_transaction() and a_error is None:
                a_session.commit()
            else:
                a_session.rollback()
            a_session.close()
        b_res: Any
        try:
            b_res = b.get(timeout=20)
        except DeadlockDetected as error:
            b_res = error
        if server_engine.name == "postgresql":
            assert a_error is None and not isinstance(b_res, BaseException), (a_error, b_res)
        if a_error is None and ra is not None:
            assert ra.outcome is Outcome.APPLIED
            if not isinstance(b_res, BaseException):
                assert b_res.outcome is Outcome.INSUFFICIENT and b_res.value == 7, b_res
            assert_invariant(eng, counter, item, 7)
        else:
            assert not isinstance(b_res, BaseException)
            assert b_res.outcome is Outcome.APPLIED
            assert_invariant(eng, counter, item, 5)


def counter_dec_once(engine: Engine, counter: StripedCounter, item: str, by: int) -> Any:
    with Session(engine) as s, s.begin():
        return counter.decrement(s, item, by=by)


def test_pg_big_buyers_contend_while_stripes_held(pg_engine: Engine) -> None:
    """Six decrements larger than any stripe start together while four stripes are held by open
    transactions: no waiting-while-holding cycles, so no error; exact totals; INSUFFICIENT only
    for sizes the final stock cannot cover."""
    counter = StripedCounter("bigs", stripes=8)
    new_item(pg_engine, counter, "b", 80)
    holders = [Holder(pg_engine, lambda s: counter.decrement(s, "b", by=1)).start() for _ in range(4)]
    stats = Stats()
    sizes = [15, 18, 21, 24, 12, 30]
    release_timer = threading.Timer(0.7, lambda: [h.go.set() for h in holders])
    release_timer.start()
    results = run_threads(
        len(sizes), lambda i: unit(pg_engine, lambda s: counter.decrement(s, "b", by=sizes[i]), stats)
    )
    for h in holders:
        h.finish()
    applied = sum(by for by, r in zip(sizes, results, strict=True) if r.outcome is Outcome.APPLIED)
    final = 76 - applied
    assert_invariant(pg_engine, counter, "b", final)
    for by, r in zip(sizes, results, strict=True):
        if r.outcome is Outcome.INSUFFICIENT:
            assert r.value < by and final < by, (by, r, final)
    assert not stats.retryable, stats.retryable


def test_pg_each_holds_own_stripe_then_both_want_more_than_one(pg_engine: Engine) -> None:
    """T1 and T2 each hold a stripe from their own earlier decrement, then both ask for 12 of the
    18 left: a deadlock the library cannot avoid (the held stripes predate its savepoint).  It may
    only come out as the typed, retryable DeadlockDetected; the other one then applies."""
    counter = StripedCounter("cross", stripes=2)
    new_item(pg_engine, counter, "c", 20)
    sessions = [Session(pg_engine), Session(pg_engine)]
    try:
        for s in sessions:
            s.begin()
            assert counter.decrement(s, "c", by=1).outcome is Outcome.APPLIED
        with Session(pg_engine) as probe:
            rows = probe.execute(
                text(
                    f"SELECT stripe FROM {STRIPES} WHERE counter = 'cross' AND item = 'c'"
                    " FOR UPDATE SKIP LOCKED"
                )
            ).all()
        assert rows == [], "the two transactions should hold one stripe each"

        for s in sessions:  # keep the test short: PostgreSQL checks for deadlocks after 300 ms
            s.execute(text("SET LOCAL deadlock_timeout = '300ms'"))
        t0 = time.monotonic()
        times: dict[int, float] = {}

        def worker(i: int) -> Any:
            s = sessions[i]
            try:
                r = counter.decrement(s, "c", by=12)
            except DeadlockDetected as error:
                times[i] = time.monotonic() - t0
                assert error.retryable
                s.rollback()
                return error
            times[i] = time.monotonic() - t0
            s.commit()
            return r

        results = run_threads(2, worker, timeout=40)
        # The victim's wait ran through a stripe its transaction held before the call: no savepoint
        # frees that, so it raises after one deadlock_timeout (before: ~11 rounds, 11 s at the
        # default 1 s, both transactions stuck meanwhile), and the other applies right after.
        print("cross deadlock timings", times)
        assert max(times.values()) < 2.0, times  # one round: ~0.3 s; eleven: 3.3 s
    finally:
        for s in sessions:
            s.close()
    outcomes = sorted(type(r).__name__ if isinstance(r, BaseException) else r.outcome.name for r in results)
    assert outcomes == ["APPLIED", "DeadlockDetected"], results
    assert_invariant(pg_engine, counter, "c", 20 - 1 - 12)


def test_increment_with_every_stripe_held_waits_and_never_lands_on_the_gate(server_engine: Any) -> None:
    """A restriped item has a free gate row with room (stripe -1, amount 0); with every stripe
    held, an increment waits for stripe 0 rather than add to the gate, and its units count."""
    eng = server_engine.engine
    counter = StripedCounter("gated", stripes=4)
    new_item(eng, counter, "g", 40)
    with Session(eng) as s, s.begin():
        assert counter.restripe(s, "g", stripes=4).value == 40
    holders = [Holder(eng, lambda s: counter.decrement(s, "g", by=1)).start() for _ in range(4)]
    try:
        call = Bg(lambda: unit(eng, lambda s: counter.increment(s, "g", by=5), Stats()))
        time.sleep(0.5)
        assert not call.done.is_set(), f"answered {call.result} while every stripe was held"
    finally:
        for h in holders:
            h.finish()
    assert call.get().outcome is Outcome.APPLIED
    assert_invariant(eng, counter, "g", 41)
    with Session(eng) as s:
        gate = s.execute(text(f"SELECT amount FROM {STRIPES} WHERE counter = 'gated' AND stripe < 0")).all()
    assert [tuple(r) for r in gate] == [(0,)]


def test_waiters_survive_restripe_that_deletes_their_stripe(server_engine: Any) -> None:
    """Every stripe held; a unit buyer and a big buyer wait; a restripe to one stripe waits too.
    When the holders commit, the stripe rows the buyers waited for are gone: they must still
    apply (the item has the units), never NOT_FOUND or INSUFFICIENT."""
    eng = server_engine.engine
    counter = StripedCounter("resdel", stripes=4)
    new_item(eng, counter, "r", 80)
    holders = [Holder(eng, lambda s: counter.decrement(s, "r", by=1)).start() for _ in range(4)]
    stats = Stats()
    small = Bg(lambda: unit(eng, lambda s: counter.decrement(s, "r", by=1), stats))
    big = Bg(lambda: unit(eng, lambda s: counter.decrement(s, "r", by=30), stats))
    time.sleep(0.4)
    re = Bg(lambda: unit(eng, lambda s: counter.restripe(s, "r", stripes=1), stats))
    time.sleep(0.4)
    assert not small.done.is_set() and not big.done.is_set(), (small.result, big.result)
    for h in holders:
        h.finish()
    assert small.get().outcome is Outcome.APPLIED, small.result
    assert big.get().outcome is Outcome.APPLIED, big.result
    assert re.get().outcome is Outcome.APPLIED
    amounts = assert_invariant(eng, counter, "r", 80 - 4 - 1 - 30)
    assert len(amounts) == 1
    # and back to many stripes while buyers wait on the single one
    holder = Holder(eng, lambda s: counter.decrement(s, "r", by=2)).start()
    waiter = Bg(lambda: unit(eng, lambda s: counter.decrement(s, "r", by=5), stats))
    time.sleep(0.3)
    re2 = Bg(lambda: unit(eng, lambda s: counter.restripe(s, "r", stripes=8), stats))
    time.sleep(0.3)
    holder.finish()
    assert waiter.get().outcome is Outcome.APPLIED, waiter.result
    assert re2.get().outcome is Outcome.APPLIED
    amounts = assert_invariant(eng, counter, "r", 45 - 2 - 5)
    assert len(amounts) == 8


def test_concurrent_create_of_one_item(backend: Any, engine: Engine) -> None:
    counter = StripedCounter("create", stripes=8)
    stats = Stats()
    results = run_threads(12, lambda i: unit(engine, lambda s: counter.create(s, "n", amount=100 + i), stats))
    applied = [i for i, r in enumerate(results) if r.outcome is Outcome.APPLIED]
    assert len(applied) == 1, results
    assert all(r.outcome is Outcome.REPEATED for i, r in enumerate(results) if i not in applied)
    amounts = assert_invariant(engine, counter, "n", 100 + applied[0])
    assert len(amounts) == 8


# ---------------------------------------------------------------- stripes already locked by the caller


def test_caller_already_holds_stripe_rows_locked(server_engine: Any) -> None:
    """A transaction that locked stripe rows itself (SELECT ... FOR UPDATE) then decrements."""
    eng = server_engine.engine
    counter = StripedCounter("own", stripes=8)
    new_item(eng, counter, "o", 80)
    sql = text(lock_stripes_sql(server_engine.name)).bindparams(bindparam("s", expanding=True))

    def own(s: Session) -> list[Any]:
        s.execute(sql, {"c": "own", "i": "o", "s": list(range(8))}).all()
        return [
            counter.decrement(s, "o", by=1),
            counter.decrement(s, "o", by=25),  # more than any stripe
            counter.decrement(s, "o", by=60),  # more than what is left
        ]

    call = Bg(lambda: unit(eng, own, Stats()))
    r1, r2, r3 = call.get(timeout=20)
    assert (r1.outcome, r2.outcome, r3.outcome) == (Outcome.APPLIED, Outcome.APPLIED, Outcome.INSUFFICIENT)
    assert r3.value == 54
    assert_invariant(eng, counter, "o", 54)


def test_two_callers_each_hold_half_and_decrement_from_their_half(server_engine: Any) -> None:
    """T1 locked stripes 0-3, T2 stripes 4-7, each asks for what its own half holds.

    PostgreSQL promises to take from stripes nobody else holds (its own included) and never
    wait while holding: both APPLIED.  MariaDB locks every stripe: one may get DeadlockDetected.
    """
    eng = server_engine.engine
    counter = StripedCounter("halves", stripes=8)
    new_item(eng, counter, "h", 80)
    sql = text(lock_stripes_sql(server_engine.name)).bindparams(bindparam("s", expanding=True))

    def worker(i: int) -> Any:
        with Session(eng) as s:
            try:
                with s.begin():
                    s.execute(sql, {"c": "halves", "i": "h", "s": [4 * i + k for k in range(4)]}).all()
                    time.sleep(0.3)
                    return counter.decrement(s, "h", by=35)
            except DeadlockDetected as error:
                return error

    t0 = time.monotonic()
    results = run_threads(2, worker, timeout=40)
    elapsed = time.monotonic() - t0
    deadlocks = [r for r in results if isinstance(r, DeadlockDetected)]
    applied = [r for r in results if not isinstance(r, BaseException) and r.outcome is Outcome.APPLIED]
    if server_engine.name == "postgresql":
        assert len(applied) == 2, results
        assert elapsed < 3, f"took {elapsed:.1f}s"
    else:
        assert len(applied) + len(deadlocks) == 2, results
    assert_invariant(eng, counter, "h", 80 - 35 * len(applied))


# ---------------------------------------------------------------- the caller's own savepoints


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


def test_restripe_waits_for_open_holders_and_keeps_total(server_engine: Any) -> None:
    eng = server_engine.engine
    counter = StripedCounter("reh", stripes=8)
    new_item(eng, counter, "r", 80)
    commit_holder = Holder(eng, lambda s: counter.decrement(s, "r", by=9)).start()
    rollback_holder = Holder(eng, lambda s: counter.decrement(s, "r", by=7), commit=False).start()
    stats = Stats()
    re = Bg(lambda: unit(eng, lambda s: counter.restripe(s, "r", stripes=3), stats))
    time.sleep(0.5)
    commit_holder.finish()
    rollback_holder.finish()
    assert re.get().outcome is Outcome.APPLIED
    amounts = assert_invariant(eng, counter, "r", 71)
    assert len(amounts) == 3 and max(amounts) - min(amounts) <= 1, amounts


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


def _lockable(engine: Engine, counter: StripedCounter, item: str, stripe: int) -> bool:
    """Whether another transaction could lock this stripe right now (``FOR UPDATE NOWAIT``)."""
    sql = text(
        f"SELECT amount FROM {STRIPES} WHERE counter = :c AND item = :i AND stripe = :s FOR UPDATE NOWAIT"
    )
    with engine.connect() as conn:
        try:
            conn.execute(sql, {"c": counter.name, "i": item, "s": stripe}).all()
        except DBAPIError:
            return False
        finally:
            conn.rollback()
    return True


@pytest.mark.parametrize("hint", [None, 3, 8])
@pytest.mark.parametrize("busy", [(), (0,), (1,), (3,), (0, 1), (1, 2), (0, 3), (0, 1, 2), (1, 2, 3)])
def test_decrement_locks_nothing_but_the_stripe_it_takes(
    server_engine: Any, busy: tuple[int, ...], hint: int | None
) -> None:
    """The root of a deadlock CI met with plenty of stock on MariaDB: a locking range scan in
    REPEATABLE READ also locks the record that ends it (a stripe the pick skipped past, or the
    neighbouring item's), until COMMIT; two buyers holding such strays waited for each other.
    Whatever stripes another buyer holds and wherever the pick starts (cold and warm stripe-count
    hint), a fast-path decrement holds exactly one stripe of its item and none of its neighbours';
    the slow path holds its own item's stripes and none of its neighbours'.  ``hint``: the
    stripe count the process believes (MariaDB names the stripes it reads by it; a stale one
    once made the optimizer scan the item, whose locks then held its neighbours)."""
    eng = server_engine.engine
    ids = [0, 1 << 18, 2 << 18, 3 << 18]
    for round_ in range(4):
        counter = StripedCounter(f"strays-{round_}-{hint}", stripes=4)
        for item in ("a", "b", "c"):
            new_item(eng, counter, item, 400)
        striped._counts.clear()
        if hint is not None:
            striped._counts.put((counter.name, "b"), hint)
        held = [ids[k] for k in busy]
        sql = text(lock_stripes_sql(server_engine.name)).bindparams(bindparam("s", expanding=True))
        lock = {"c": counter.name, "i": "b", "s": held}
        holder = Holder(eng, lambda s, q=sql, p=lock: s.execute(q, p).all())
        if held:
            holder.start()
        try:
            for by, slow in ((1, False), (1, False), (150, True)):
                with Session(eng) as s, s.begin():
                    if slow and held:
                        break  # the slow path waits for the held stripes: nothing to probe here
                    r = counter.decrement(s, "b", by=by)
                    assert r.outcome is Outcome.APPLIED, r
                    for item in ("a", "c"):
                        locked = [x for x in ids if not _lockable(eng, counter, item, x)]
                        assert not locked, f"decrement of 'b' holds stripes {locked} of {item!r}"
                    mine = [x for x in ids if x not in held and not _lockable(eng, counter, "b", x)]
                    if slow:
                        assert mine == ids, mine
                    else:
                        assert len(mine) == 1, f"busy {held}: the decrement holds {mine}"
        finally:
            if held:
                holder.finish()


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


# ---------------------------------------------------------------- async sessions


def _async_engine(backend: Any) -> Any:
    if backend.name == "sqlite":
        return async_sqlite_engine(backend.url.replace("sqlite://", "sqlite+aiosqlite://", 1))
    if backend.name == "mariadb":
        return create_async_engine(backend.url.replace("mysql+pymysql", "mysql+aiomysql", 1), pool_size=20)
    return create_async_engine(backend.url, pool_size=20)  # psycopg 3 async


def test_async_storm(backend: Any, engine: Engine) -> None:
    counter = StripedCounter("astorm", stripes=6)
    start = 300
    new_item(engine, counter, "a", start)
    retried: Counter[str] = Counter()

    async def one(aeng: Any, kind: str, by: int, ref: str | None) -> Any:
        for attempt in range(40):
            async with AsyncSession(aeng) as s:
                try:
                    async with s.begin():
                        if kind == "dec":
                            return await counter.decrement(s, "a", by=by, ref=ref)
                        return await counter.increment(s, "a", by=by, ref=ref)
                except SerializationConflict as error:
                    retried[type(error).__name__] += 1
                    await asyncio.sleep(random.uniform(0, 0.01 * (attempt + 1)))
        raise AssertionError("gave up")

    async def main() -> list[Any]:
        aeng = _async_engine(backend)
        try:
            gate = asyncio.Event()

            async def task(i: int) -> list[Any]:
                await gate.wait()
                rng = random.Random(900 + i)
                out = []
                for j in range(8):
                    kind = "inc" if rng.random() < 0.2 else "dec"
                    by = rng.choice([1, 2, 6, 15, 70])
                    ref = f"a-{i}-{j}" if j % 2 else None
                    first = await one(aeng, kind, by, ref)
                    out.append((kind, by, first))
                    if ref:  # replay: REPEATED after APPLIED, never applied twice
                        again = await one(aeng, kind, by, ref)
                        if first.outcome is Outcome.APPLIED:
                            assert again.outcome is Outcome.REPEATED, again
                        else:  # an INSUFFICIENT ref is free again (README): it may apply now
                            out.append((kind, by, again))
                return out

            tasks = [asyncio.create_task(task(i)) for i in range(12)]
            await asyncio.sleep(0.05)
            gate.set()
            return await asyncio.wait_for(asyncio.gather(*tasks), 60)
        finally:
            await aeng.dispose()

    results = [x for w in asyncio.run(main()) for x in w]
    total = start
    for kind, by, r in results:
        if r.outcome is Outcome.APPLIED:
            total += by if kind == "inc" else -by
        else:
            assert kind == "dec" and r.outcome is Outcome.INSUFFICIENT and r.value < by, (kind, by, r)
    assert_invariant(engine, counter, "a", total)


# ---------------------------------------------------------------- PostgreSQL at REPEATABLE READ


def test_pg_repeatable_read_storm_only_typed_errors(pg_engine: Engine) -> None:
    rr = pg_engine.execution_options(isolation_level="REPEATABLE READ")
    counter = StripedCounter("rr", stripes=4)
    start = 300
    new_item(pg_engine, counter, "a", start)
    stats = Stats()
    raw: list[str] = []

    def op_unit(op: Callable[[Session], Any]) -> Any:
        for attempt in range(60):
            with Session(rr) as s:
                s.begin()
                try:
                    r = op(s)
                except SerializationConflict as error:
                    stats.add(type(error).__name__)
                    s.rollback()
                    time.sleep(random.uniform(0, 0.005 * (attempt + 1)))
                    continue
                except DBAPIError as error:  # a raw driver error escaped a stateguard call
                    raw.append(repr(error))
                    raise
                s.commit()
                return r
        raise AssertionError(f"gave up: {stats.retryable}")

    def worker(i: int) -> list[tuple[str, int, Any]]:
        rng = random.Random(1200 + i)
        out = []
        for j in range(10):
            by = rng.choice([1, 2, 5, 30, 90])
            if rng.random() < 0.2:
                out.append(("inc", by, op_unit(lambda s, by=by: counter.increment(s, "a", by=by))))
            elif rng.random() < 0.15:
                out.append(
                    ("re", 0, op_unit(lambda s: counter.restripe(s, "a", stripes=rng.choice([2, 4, 6]))))
                )
            else:
                ref = f"rr-{i}-{j}"
                r = op_unit(lambda s, by=by, ref=ref: counter.decrement(s, "a", by=by, ref=ref))
                out.append(("dec", by, r))
                if r.outcome is Outcome.APPLIED and rng.random() < 0.4:
                    rel = op_unit(lambda s, ref=ref: counter.release(s, ref))
                    assert rel.outcome is Outcome.APPLIED, rel
                    out.append(("inc", by, rel))
                    again = op_unit(lambda s, ref=ref: counter.release(s, ref))
                    assert again.outcome is Outcome.REPEATED, again
        return out

    results = [x for w in run_threads(12, worker) for x in w]
    assert not raw, raw
    total = start
    for kind, by, r in results:
        if kind == "re":
            continue
        if r.outcome is Outcome.APPLIED:
            total += by if kind == "inc" else -by
        else:
            assert kind == "dec" and r.outcome is Outcome.INSUFFICIENT and r.value < by, (kind, by, r)
    assert_invariant(pg_engine, counter, "a", total)
    for name in stats.retryable:
        assert name in ("SerializationConflict", "DeadlockDetected")


def test_pg_repeatable_read_serialization_failure_is_typed(pg_engine: Engine) -> None:
    """An RR snapshot taken before another transaction changed the stripes: typed error, never raw."""
    rr = pg_engine.execution_options(isolation_level="REPEATABLE READ")
    counter = StripedCounter("rr2", stripes=2)
    new_item(pg_engine, counter, "a", 20)
    outcomes: list[Any] = []
    for by in (1, 10, 15):
        with Session(rr) as s:
            s.begin()
            assert counter.total(s, "a") is not None  # snapshot taken
            # another transaction changes every stripe and commits
            with Session(pg_engine) as other, other.begin():
                other.execute(text(f"UPDATE {STRIPES} SET amount = amount + 1 WHERE counter = 'rr2'"))
            try:
                outcomes.append(counter.decrement(s, "a", by=by))
                s.commit()
            except SerializationConflict as error:
                assert error.retryable
                outcomes.append(type(error).__name__)
                s.rollback()
    assert all(o == "SerializationConflict" or isinstance(o, str) for o in outcomes), outcomes
    # every attempt saw a changed row: all of them must be typed conflicts
    assert outcomes == ["SerializationConflict"] * 3, outcomes
    assert_invariant(pg_engine, counter, "a", 26)


# ---------------------------------------------------------------- processes


def _proc_worker(url: str, name: str, item: str, seed: int, barrier: Any) -> list[tuple[int, str, Any]]:
    from tests.conftest import make_engine

    eng = make_engine(name, url, pool_size=2)
    counter = StripedCounter("procs", stripes=8)
    rng = random.Random(seed)
    out = []
    stats = Stats()
    barrier.wait(30)
    try:
        for _ in range(25):
            by = rng.choice([1, 2, 4, 9, 22, 60])
            r = unit(eng, lambda s, by=by: counter.decrement(s, item, by=by), stats)
            out.append((by, r.outcome.name, r.value))
    finally:
        eng.dispose()
    return out


def test_process_storm(server_engine: Any, procs: Any) -> None:
    manager, pool = procs
    eng = server_engine.engine
    counter = StripedCounter("procs", stripes=8)
    start = 600
    new_item(eng, counter, "p", start)
    barrier = manager.Barrier(4)
    futures = [
        pool.submit(_proc_worker, server_engine.url, server_engine.name, "p", k, barrier) for k in range(4)
    ]
    results = [x for f in futures for x in f.result(timeout=80)]
    applied = sum(by for by, o, _ in results if o == "APPLIED")
    final = start - applied
    assert_invariant(eng, counter, "p", final)
    for by, o, v in results:
        if o == "INSUFFICIENT":
            assert v < by and v >= final and final < by, (by, v, final)
