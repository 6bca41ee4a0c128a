"""Guarded counters (stateguard.counters) on every backend.

Complements tests/test_stock.py (basic outcomes, hot row with 16 threads and
4 processes, retried purchases with plenty of stock, opposite-order pairs,
concurrent releases) with: exact statement counts, numeric and composite-key
counters, values MariaDB can and cannot report, instance sync, ledger
behaviour across snapshots and duplicates, reserve/release edge cases, bad
input that sends nothing, and storms where stock runs out, refs collide with
different amounts, reservations are watched for atomicity while they happen,
and reservations and releases interleave without deadlocks.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from stateguard import (
    InsufficientQuantity,
    InvalidArgument,
    Outcome,
    RefConflict,
    StateguardError,
    decrement,
    increment,
    release,
    reserve,
)
from stateguard._kernel import is_galera
from stateguard.tables import counter_ledger
from tests._support import counter_workers as w
from tests._support.counter_workers import Bin, CounterBase, Wallet
from tests._support.processes import worker_context
from tests.conftest import Backend, count_statements

pytestmark = pytest.mark.tables(CounterBase.metadata)


def _bins(engine: Any, qty: dict[int, int], cap: int = 0) -> None:
    with Session(engine) as s, s.begin():
        s.add_all(Bin(id=k, qty=v, cap=cap) for k, v in qty.items())


def _qty(engine: Any, *keys: int) -> tuple[int, ...]:
    with Session(engine) as s:
        found = dict(s.execute(select(Bin.id, Bin.qty).where(Bin.id.in_(keys))).all())
    return tuple(found[k] for k in keys)


def _ledger(engine: Any) -> list[Any]:
    with engine.connect() as c:
        return list(c.execute(select(counter_ledger)).all())


def _mariadb(engine: Any) -> bool:
    return engine.dialect.name in ("mysql", "mariadb")


# --------------------------------------------------------------------------
# Single calls
# --------------------------------------------------------------------------


def test_exact_statement_counts(engine: Any) -> None:
    """No ref: 1 statement; ref: 2 (ledger INSERT, UPDATE; no savepoint on MariaDB); REPEATED 2; short 2."""
    _bins(engine, {1: 10})
    with Session(engine) as s, s.begin():
        # The engine's one-time Galera probe (MariaDB: SHOW GLOBAL VARIABLES LIKE 'wsrep_on', on the
        # engine's first guarded call) made first: run alone, this test's first decrement is that call.
        is_galera(s.connection())
        with count_statements(engine) as c:
            assert decrement(s, Bin.qty, 1).applied
        assert len(c) == 1, c.statements
        with count_statements(engine) as c:
            assert decrement(s, Bin.qty, 1, ref="a").applied
        assert [x.split()[0] for x in c.statements] == ["INSERT", "UPDATE"], c.statements
        with count_statements(engine) as c:
            assert decrement(s, Bin.qty, 1, ref="a").outcome is Outcome.REPEATED
        assert [x.split()[0] for x in c.statements] == ["INSERT", "SELECT"], c.statements
        with count_statements(engine) as c:
            assert decrement(s, Bin.qty, 1, by=50).outcome is Outcome.INSUFFICIENT
        assert [x.split()[0] for x in c.statements] == ["UPDATE", "SELECT"], c.statements
    assert _qty(engine, 1) == (8,)


def test_increment_with_number_and_column_ceilings(engine: Any) -> None:
    """increment stops at a number or a same-row column ceiling, reports the amount found, and NOT_FOUND."""
    _bins(engine, {1: 3}, cap=5)
    with Session(engine) as s, s.begin():
        r = increment(s, Bin.qty, 1, by=2, ceiling=5)
        assert r.applied and r.value == (None if _mariadb(engine) else 5)
        over = increment(s, Bin.qty, 1, ceiling=5)
        assert (over.outcome, over.key, over.value) == (Outcome.INSUFFICIENT, 1, 5)
        with pytest.raises(InsufficientQuantity) as info:
            over.raise_for_outcome()
        assert (info.value.target, info.value.value) == (1, 5)
        assert increment(s, Bin.qty, 1, ceiling=Bin.cap).outcome is Outcome.INSUFFICIENT
        assert increment(s, Bin.qty, 1, by=100).applied
        assert increment(s, Bin.qty, 99, ceiling=1000).outcome is Outcome.NOT_FOUND
    assert _qty(engine, 1) == (105,)


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda s, k: decrement(s, Wallet.balance, k, by=Decimal("0.004")), "would be rounded"),
        (lambda s, k: decrement(s, Wallet.balance, k, by=0.005), "would be rounded"),
        (lambda s, k: decrement(s, Wallet.balance, k, by=Decimal("1.001"), ref="r-1"), "would be rounded"),
        (lambda s, k: decrement(s, Wallet.balance, k, by=1, floor=Decimal("0.001")), "would be rounded"),
        (lambda s, k: increment(s, Wallet.balance, k, by=Decimal("1E+10")), "too many digits"),
        (lambda s, k: increment(s, Wallet.balance, k, by=1, ceiling=Decimal("1E+12")), "too many digits"),
        (lambda s, k: reserve(s, Wallet.balance, {k: Decimal("0.001")}, ref="r-2"), "would be rounded"),
    ],
)
def test_numeric_amounts_the_column_cannot_store_exactly_are_refused(
    engine: Any, call: Any, needle: str
) -> None:
    """On NUMERIC(12, 2) holding 0.01, by=0.004 would be rounded to 0.00 and APPLIED forever: refused."""
    with Session(engine) as s, s.begin():
        s.add(Wallet(owner="bo", currency="EUR", balance=Decimal("0.01")))
    key = ("bo", "EUR")
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument, match=needle):
            call(s, key)
        # The transaction is still usable and nothing was taken.
        assert s.get_one(Wallet, key).balance == Decimal("0.01")
        assert decrement(s, Wallet.balance, key, by=Decimal("0.01")).applied
    with Session(engine) as s:
        assert s.get_one(Wallet, key).balance == Decimal("0.00")
        assert s.execute(select(func.count()).select_from(counter_ledger)).scalar_one() == 0


def test_numeric_counter_with_composite_key(engine: Any) -> None:
    """Decimal amounts on a composite-key row: exact values, equal amounts repeat, different ones conflict."""
    with Session(engine) as s, s.begin():
        s.add(Wallet(owner="ann", currency="EUR", balance=Decimal("10.00")))
    key = ("ann", "EUR")
    with Session(engine) as s, s.begin():
        r = decrement(s, Wallet.balance, key, by=Decimal("2.50"), ref="pay-1")
        assert r.applied and r.key == key
        assert r.value == (None if _mariadb(engine) else Decimal("7.50"))
        assert decrement(s, Wallet.balance, key, by=Decimal("2.5"), ref="pay-1").outcome is Outcome.REPEATED
        with pytest.raises(RefConflict):
            decrement(s, Wallet.balance, key, by=Decimal("2.51"), ref="pay-1")
        short = decrement(s, Wallet.balance, key, by=Decimal("8"))
        assert (short.outcome, short.value) == (Outcome.INSUFFICIENT, Decimal("7.50"))
        assert decrement(s, Wallet.balance, key, by=0.5).applied
        back = release(s, Wallet.balance, "pay-1")
        assert back.applied and back.value == {key: Decimal("2.50")}
    with Session(engine) as s:
        assert s.get_one(Wallet, key).balance == Decimal("9.50")


@pytest.mark.hostile
def test_values_below_zero_are_exact_or_none_never_garbage(engine: Any) -> None:
    """A negative floor works; MariaDB reports None there (its OK packet is unsigned) and 0 at zero."""
    _bins(engine, {1: 5, 2: 1})
    none_on_mariadb = None if _mariadb(engine) else -3
    with Session(engine) as s, s.begin():
        r = decrement(s, Bin.qty, 1, by=8, floor=-10)
        assert r.applied and r.value == none_on_mariadb
        short = decrement(s, Bin.qty, 1, by=8, floor=-10)
        assert (short.outcome, short.value) == (Outcome.INSUFFICIENT, -3)
        assert decrement(s, Bin.qty, 1, by=3, floor=None).value in (-6, None)
        zero = decrement(s, Bin.qty, 2)
        assert zero.applied and zero.value == 0
    assert _qty(engine, 1, 2) == (-6, 0)


def test_instances_are_targets_and_stay_in_sync(engine: Any) -> None:
    """A loaded instance sees the new amount and version (no StaleDataError); a pending one is flushed."""
    _bins(engine, {1: 10})
    with Session(engine) as s, s.begin():
        b = s.get_one(Bin, 1)
        assert b.version == 1
        r = decrement(s, Bin.qty, b, by=2)
        assert r.key == 1 and b.qty == 8 and b.version == 2
        b.cap = 7
        s.flush()
        pending = Bin(id=5, qty=3)
        s.add(pending)
        assert decrement(s, Bin.qty, pending).applied
        assert pending.qty == 2
        assert release(s, Bin.qty, "nothing").outcome is Outcome.NOT_FOUND
        assert reserve(s, Bin.qty, {b: 1, pending: 1}, ref="inst").applied
        assert (b.qty, pending.qty) == (7, 1)
        assert release(s, Bin.qty, "inst").applied
        assert (b.qty, pending.qty) == (8, 2)
    with Session(engine) as s:
        assert (s.get_one(Bin, 1).cap, s.get_one(Bin, 1).version) == (7, 5)


def test_a_ref_committed_after_this_transaction_began_is_repeated(engine: Any) -> None:
    """A transaction that read before a twin committed the same ref sees REPEATED, not an error."""
    _bins(engine, {1: 10, 2: 10})
    with Session(engine) as early:
        early.begin()
        # Takes the REPEATABLE READ snapshot on MariaDB, before the twin's commit.
        assert early.scalar(select(Bin.qty).where(Bin.id == 2)) == 10
        with Session(engine) as twin, twin.begin():
            assert decrement(twin, Bin.qty, 1, by=2, ref="o-1").applied
        assert decrement(early, Bin.qty, 1, by=2, ref="o-1").outcome is Outcome.REPEATED
        assert decrement(early, Bin.qty, 2, by=1, ref="o-2").applied
        early.commit()
    assert _qty(engine, 1, 2) == (8, 9) and len(_ledger(engine)) == 2


def test_a_duplicate_ref_keeps_the_transaction_usable(engine: Any) -> None:
    """After a REPEATED (a caught duplicate key on MariaDB) the transaction goes on and commits it all."""
    _bins(engine, {1: 10, 2: 10, 3: 10})
    with Session(engine) as s, s.begin():
        assert decrement(s, Bin.qty, 1, ref="x").applied
        assert decrement(s, Bin.qty, 1, ref="x").outcome is Outcome.REPEATED
        assert decrement(s, Bin.qty, 2, ref="y").applied
        s.get_one(Bin, 3).cap = 9
    assert _qty(engine, 1, 2) == (9, 9) and len(_ledger(engine)) == 2
    with Session(engine) as s:
        assert s.get_one(Bin, 3).cap == 9


def test_refs_compare_byte_exact_on_every_backend(engine: Any) -> None:
    """Refs differing only in case or a trailing space are different refs, MariaDB included."""
    _bins(engine, {1: 10})
    with Session(engine) as s, s.begin():
        outcomes = [decrement(s, Bin.qty, 1, ref=r).outcome for r in ("order-A", "order-a", "order-A ")]
    assert outcomes == [Outcome.APPLIED] * 3
    assert _qty(engine, 1) == (7,) and len(_ledger(engine)) == 3


def test_insufficient_and_missing_refs_leave_no_ledger_row(engine: Any) -> None:
    """INSUFFICIENT and NOT_FOUND with a ref leave no ledger row; the same ref applies once possible."""
    _bins(engine, {1: 1})
    with Session(engine) as s, s.begin():
        assert decrement(s, Bin.qty, 1, by=2, ref="r").outcome is Outcome.INSUFFICIENT
        assert decrement(s, Bin.qty, 7, ref="r").outcome is Outcome.NOT_FOUND
        assert increment(s, Bin.qty, 1, by=5, ceiling=3, ref="up").outcome is Outcome.INSUFFICIENT
    assert _ledger(engine) == []
    with Session(engine) as s, s.begin():
        assert increment(s, Bin.qty, 1, by=2, ceiling=3, ref="up").applied
        assert decrement(s, Bin.qty, 1, by=2, ref="r").applied
    assert _qty(engine, 1) == (1,) and len(_ledger(engine)) == 2


def test_reserve_edge_cases(engine: Any) -> None:
    """Reusing a ref for other rows or amounts is RefConflict; short or missing rows undo the whole call."""
    _bins(engine, {1: 5, 2: 5, 3: 5})
    with Session(engine) as s, s.begin():
        assert reserve(s, Bin.qty, {1: 1, 2: 1}, ref="o").applied
        with pytest.raises(RefConflict):
            reserve(s, Bin.qty, {1: 1, 2: 1, 3: 1}, ref="o")
        with pytest.raises(RefConflict):
            reserve(s, Bin.qty, {2: 1, 1: 2}, ref="o")
        again = reserve(s, Bin.qty, {2: 1, 1: 1}, ref="o")
        assert (again.outcome, again.key, again.value) == (Outcome.REPEATED, "o", {1: None, 2: None})
        # A smaller basket under the ref of a bigger one is another reservation, not a repeat.
        with pytest.raises(RefConflict, match="also reserved 1 other"):
            reserve(s, Bin.qty, {1: 1}, ref="o")
        missing = reserve(s, Bin.qty, {1: 1, 99: 1}, ref="p")
        assert (missing.outcome, missing.key) == (Outcome.NOT_FOUND, 99)
        short = reserve(s, Bin.qty, {1: 1, 3: 9}, ref="q")
        assert (short.outcome, short.key, short.value) == (Outcome.INSUFFICIENT, 3, 5)
        with pytest.raises(InsufficientQuantity) as info:
            short.raise_for_outcome()
        assert (info.value.target, info.value.value) == (3, 5)
    assert _qty(engine, 1, 2, 3) == (4, 4, 5)
    assert sorted((r.ref, r.row_key) for r in _ledger(engine)) == [("o", "1"), ("o", "2")]


def test_a_reservation_repeated_after_its_twin_committed_is_repeated(engine: Any) -> None:
    """A transaction whose snapshot predates its twin's committed reservation (InnoDB at
    REPEATABLE READ reads that snapshot without locks) still gets REPEATED for the same basket,
    not RefConflict; a smaller basket is RefConflict once the twin's rows are visible."""
    _bins(engine, {1: 5, 2: 5, 3: 5})
    with Session(engine) as late:
        late.begin()
        assert late.get_one(Bin, 3).qty == 5  # the snapshot starts here
        with Session(engine) as twin, twin.begin():
            assert reserve(twin, Bin.qty, {1: 1, 2: 1}, ref="o").applied
        again = reserve(late, Bin.qty, {2: 1, 1: 1}, ref="o")
        assert (again.outcome, again.same_request) == (Outcome.REPEATED, True)
        late.commit()
    with Session(engine) as s, s.begin(), pytest.raises(RefConflict, match="also reserved 1 other"):
        reserve(s, Bin.qty, {2: 1}, ref="o")
    assert _qty(engine, 1, 2, 3) == (4, 4, 5)


@pytest.mark.rollback
def test_release_undoes_any_ref_once_and_the_ref_stays_used(engine: Any) -> None:
    """release gives back a decrement, takes back an increment, once each; the released ref stays REPEATED."""
    _bins(engine, {1: 5})
    with Session(engine) as s, s.begin():
        assert decrement(s, Bin.qty, 1, by=2, ref="d").applied
        assert increment(s, Bin.qty, 1, by=3, ref="i").applied
    with Session(engine) as s, s.begin():
        assert release(s, Bin.qty, "d").value == {1: 2}
        assert release(s, Bin.qty, "d").outcome is Outcome.REPEATED
        assert release(s, Bin.qty, "i").value == {1: -3}
        assert release(s, Bin.cap, "d").outcome is Outcome.NOT_FOUND
        assert decrement(s, Bin.qty, 1, by=2, ref="d").outcome is Outcome.REPEATED
    assert _qty(engine, 1) == (5,)
    assert all(r.released_at is not None for r in _ledger(engine))


def test_release_of_an_increment_whose_units_are_gone_is_insufficient(engine: Any) -> None:
    """An increment's ref released after its units were sold: INSUFFICIENT, nothing changed, the ref
    not released (never below floor 0); after a restock the same release applies, once."""
    _bins(engine, {1: 0, 2: 5})
    with Session(engine) as s, s.begin():
        assert increment(s, Bin.qty, 1, by=3, ref="delivery").applied
        assert increment(s, Bin.qty, 2, by=1, ref="delivery").applied
    with Session(engine) as s, s.begin():
        assert decrement(s, Bin.qty, 1, by=2).applied
    with Session(engine) as s, s.begin():
        r = release(s, Bin.qty, "delivery")
        assert (r.outcome, r.key, r.value) == (Outcome.INSUFFICIENT, 1, 1)
        with pytest.raises(InsufficientQuantity):
            r.raise_for_outcome()
        # The transaction stays usable, and the row released before the short one (2) was undone too.
        assert decrement(s, Bin.qty, 2, by=1).applied
    assert _qty(engine, 1, 2) == (1, 5)
    assert all(r.released_at is None for r in _ledger(engine))
    with Session(engine) as s, s.begin():
        assert increment(s, Bin.qty, 1, by=2).applied
        assert release(s, Bin.qty, "delivery").value == {1: -3, 2: -1}
        assert release(s, Bin.qty, "delivery").outcome is Outcome.REPEATED
    assert _qty(engine, 1, 2) == (0, 4)


@pytest.mark.hostile
def test_bad_input_is_typed_and_sends_nothing(engine: Any) -> None:
    """Every kind of bad input raises InvalidArgument (a StateguardError) before any statement is sent."""
    _bins(engine, {1: 5, 2: 5})
    bad: list[Callable[[Session], Any]] = [
        *(lambda s, by=by: decrement(s, Bin.qty, 1, by=by) for by in (0, -1, True, "1", None)),
        lambda s: decrement(s, Bin.qty, 1, by=1.5),  # not an int for an integer column
        lambda s: decrement(s, Bin.qty, 1, by=Decimal("2")),
        lambda s: decrement(s, Wallet.balance, ("a", "EUR"), by=Decimal("NaN")),
        lambda s: decrement(s, Wallet.balance, ("a", "EUR"), by=float("inf")),
        *(lambda s, f=f: decrement(s, Bin.qty, 1, floor=f) for f in (0.5, True, "0", Wallet.balance)),
        lambda s: decrement(s, Wallet.balance, ("a", "EUR"), floor=float("nan")),
        lambda s: increment(s, Bin.qty, 1, ceiling=Wallet.balance),
        lambda s: decrement(s, Bin.version, 1),
        lambda s: decrement(s, Bin.id, 1),
        lambda s: decrement(s, Wallet.owner, ("a", "EUR")),
        lambda s: decrement(s, "qty", 1),
        lambda s: decrement(s, Bin.qty, "one"),
        lambda s: decrement(s, Bin.qty, (1, 2)),
        lambda s: decrement(s, Bin.qty, Wallet(owner="a", currency="EUR")),
        *(lambda s, ref=ref: decrement(s, Bin.qty, 1, ref=ref) for ref in ("", "x" * 201, 42)),
        lambda s: reserve(s, Bin.qty, {}, ref="r"),
        lambda s: reserve(s, Bin.qty, [1], ref="r"),
        lambda s: reserve(s, Bin.qty, {1: 1}, ref=None),  # type: ignore[arg-type]
        lambda s: reserve(s, Bin.qty, {1: 1, 2: 0}, ref="r"),
        lambda s: reserve(s, Bin.qty, {1: 1, (1,): 1}, ref="r"),
        lambda s: release(s, Bin.qty, None),  # type: ignore[arg-type]
        lambda s: release(s, Bin.qty, ""),
        lambda s: release(s, Wallet.owner, "r"),
    ]
    with Session(engine) as s, s.begin():
        s.connection()
        for i, call in enumerate(bad):
            with count_statements(engine) as c, pytest.raises(InvalidArgument) as info:
                call(s)
            assert isinstance(info.value, StateguardError)
            assert len(c) == 0, (i, c.statements)
    assert _qty(engine, 1, 2) == (5, 5) and _ledger(engine) == []


# --------------------------------------------------------------------------
# Storms
# --------------------------------------------------------------------------


def _threads(fn: Callable[..., Any], args: list[tuple[Any, ...]]) -> list[Any]:
    with ThreadPoolExecutor(len(args)) as pool:
        return [f.result(timeout=120) for f in [pool.submit(fn, *a) for a in args]]


class _Watcher:
    """Samples committed state with one statement at a time while a storm runs."""

    def __init__(self, engine: Any, sql: str, check: Callable[[Any], bool]) -> None:
        self.engine, self.sql, self.check = engine, text(sql), check
        self.samples = 0
        self.bad: list[Any] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        with self.engine.connect() as conn:
            while not self.stop.is_set():
                row = tuple(conn.execute(self.sql).one())
                conn.rollback()  # a fresh snapshot for the next sample
                self.samples += 1
                if not self.check(row):
                    self.bad.append(row)
                self.stop.wait(0.002)

    def __enter__(self) -> _Watcher:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


def test_hot_row_is_never_negative_while_buyers_storm_it(engine: Any, backend: Backend) -> None:
    """Stock 100, 16 threads x 20 buys: 100 APPLIED, 220 INSUFFICIENT, and no sample ever below 0."""
    _bins(engine, {1: 100})
    barrier = threading.Barrier(16)
    with _Watcher(engine, "SELECT qty FROM counter_bins WHERE id = 1", lambda r: r[0] >= 0) as watch:
        results = _threads(w.buy_many, [(backend.name, backend.url, 20, barrier) for _ in range(16)])
    total: Counter[str] = Counter()
    for r in results:
        total.update(r)
    assert total == {"APPLIED": 100, "INSUFFICIENT": 220}
    assert watch.samples > 0 and watch.bad == []
    assert _qty(engine, 1) == (0,)


def _processes(fn: Callable[..., Any], args: list[tuple[Any, ...]]) -> list[Any]:
    ctx = worker_context()
    with ctx.Manager() as manager:
        barrier = manager.Barrier(len(args))
        with ProcessPoolExecutor(len(args), mp_context=ctx) as pool:
            futures = [pool.submit(fn, *a, barrier) for a in args]
            return [f.result(timeout=120) for f in futures]


def test_retried_purchases_when_stock_runs_out_apply_once_per_ref(engine: Any, backend: Backend) -> None:
    """Stock 30, 45 refs each sent by 3 processes: 30 refs apply once (+2 REPEATED), 15 are short 3 times."""
    _bins(engine, {1: 30})
    refs = [f"order-{i}" for i in range(45)]
    results = _processes(w.send_purchases, [(backend.name, backend.url, refs, seed) for seed in range(3)])
    per_ref = {ref: Counter(outcomes[ref] for outcomes, _ in results) for ref in refs}
    applied = [ref for ref, seen in per_ref.items() if seen == {"APPLIED": 1, "REPEATED": 2}]
    short = [ref for ref, seen in per_ref.items() if seen == {"INSUFFICIENT": 3}]
    assert len(applied) == 30 and len(short) == 15, per_ref
    assert _qty(engine, 1) == (0,)
    assert sorted(r.ref for r in _ledger(engine)) == sorted(applied)


def test_same_ref_with_different_amounts_at_once(engine: Any) -> None:
    """6 threads share a ref per round, by=1 or 2: one APPLIED, same by REPEATED, other by RefConflict."""
    _bins(engine, {1: 1000})
    rounds = 15
    barrier = threading.Barrier(6)
    results = _threads(w.same_ref_different_amounts, [(engine, rounds, 1 + i % 2, barrier) for i in range(6)])
    by_of = [1 + t % 2 for t in range(6)]
    outcome = {(t, r): o for t in range(6) for r, o in results[t]}
    taken = 0
    for i in range(rounds):
        winners = [t for t in range(6) if outcome[(t, i)] == "APPLIED"]
        assert len(winners) == 1, [outcome[(t, i)] for t in range(6)]
        winner = by_of[winners[0]]
        for t in range(6):
            expected = ("APPLIED", "REPEATED") if by_of[t] == winner else ("RefConflict",)
            assert outcome[(t, i)] in expected, (i, t, outcome[(t, i)])
        taken += winner
    assert _qty(engine, 1) == (1000 - taken,) and len(_ledger(engine)) == rounds


def test_reservations_are_atomic_while_they_happen(engine: Any) -> None:
    """Triples {1,2,3} and pairs {1,3} race; every committed snapshot has qty1 == qty3; no partial ledger."""
    _bins(engine, {1: 80, 2: 25, 3: 80})
    barrier = threading.Barrier(8)

    def worker(n: int) -> list[tuple[str, Any, Any]]:
        rng = random.Random(n)
        conflicts = w.Conflicts(deadlocks=False)
        seen = []
        barrier.wait()
        for i in range(10):
            keys = [1, 2, 3] if n % 2 == 0 else [3, 1]
            rng.shuffle(keys)

            def unit(keys: list[int] = keys, i: int = i) -> Any:
                with Session(engine) as s, s.begin():
                    return reserve(s, Bin.qty, dict.fromkeys(keys, 1), ref=f"res-{n}-{i}")

            r = conflicts.run(unit)
            seen.append((r.outcome.name, r.key, r.value))
        return seen

    sql = "SELECT (SELECT qty FROM counter_bins WHERE id = 1), (SELECT qty FROM counter_bins WHERE id = 3)"
    with _Watcher(engine, sql, lambda r: r[0] == r[1]) as watch:
        results = _threads(worker, [(n,) for n in range(8)])
    triples = [x for n in range(0, 8, 2) for x in results[n]]
    pairs = [x for n in range(1, 8, 2) for x in results[n]]
    assert Counter(o for o, _, _ in triples) == {"APPLIED": 25, "INSUFFICIENT": 15}
    assert all((k, v) == (2, 0) for o, k, v in triples if o == "INSUFFICIENT")
    assert Counter(o for o, _, _ in pairs) == {"APPLIED": 40}
    assert watch.samples > 0 and watch.bad == []
    assert _qty(engine, 1, 2, 3) == (15, 0, 15)
    rows_per_ref = Counter(r.ref for r in _ledger(engine))
    assert sorted(Counter(rows_per_ref.values()).items()) == [(2, 40), (3, 25)]


def test_interleaved_reservations_and_releases_never_deadlock(engine: Any) -> None:
    """8 threads reserve rows 2, 10, 33 in random orders and release half: no deadlock, exact totals."""
    _bins(engine, {2: 1000, 10: 1000, 33: 1000})
    barrier = threading.Barrier(8)
    results = _threads(w.reserve_and_release, [(engine, n, 12, [2, 10, 33], barrier) for n in range(8)])
    total: Counter[str] = Counter()
    for counts, _ in results:
        total.update(counts)
    assert sum(c.deadlocks for _, c in results) == 0
    assert total == {"reserve APPLIED": 96, "release APPLIED": 48}
    assert _qty(engine, 2, 10, 33) == (952, 952, 952)
    ledger = _ledger(engine)
    assert len(ledger) == 288 and sum(r.released_at is not None for r in ledger) == 144


def test_concurrent_releases_of_many_refs_give_back_each_once(engine: Any) -> None:
    """20 reservations over rows 2 and 10, each released by 6 threads at once: one APPLIED per ref."""
    _bins(engine, {2: 100, 10: 100})
    refs = [f"cancel-{i}" for i in range(20)]
    with Session(engine) as s, s.begin():
        for ref in refs:
            assert reserve(s, Bin.qty, {10: 2, 2: 1}, ref=ref).applied
    barrier = threading.Barrier(6)

    def worker(n: int) -> list[tuple[str, str]]:
        order = list(refs)
        random.Random(n).shuffle(order)
        conflicts = w.Conflicts(deadlocks=False)
        barrier.wait()
        out = []
        for ref in order:

            def unit(ref: str = ref) -> Any:
                with Session(engine) as s, s.begin():
                    return release(s, Bin.qty, ref)

            out.append((ref, conflicts.run(unit).outcome.name))
        return out

    results = _threads(worker, [(n,) for n in range(6)])
    per_ref = Counter((ref, o) for out in results for ref, o in out)
    assert all(per_ref[(ref, "APPLIED")] == 1 and per_ref[(ref, "REPEATED")] == 5 for ref in refs)
    assert _qty(engine, 2, 10) == (100, 100)


def test_counter_plans_are_cached(engine: Any) -> None:
    """The guarded UPDATE is built once per column, backend and bound kind, then reused."""
    from stateguard import _kernel

    def bin_plans() -> dict[Any, Any]:
        return {k: v for k, v in _kernel.memo._data.items() if k[0] == "counter" and k[1].model is Bin}

    _bins(engine, {1: 10})
    with Session(engine) as s, s.begin():
        decrement(s, Bin.qty, 1)
        plans = bin_plans()
        for _ in range(3):
            decrement(s, Bin.qty, 1)
    assert plans and {k: id(v) for k, v in bin_plans().items()} == {k: id(v) for k, v in plans.items()}
