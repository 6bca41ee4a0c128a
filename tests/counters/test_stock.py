"""Guarded counters on every backend: outcomes, refs, reserve/release, storms."""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from stateguard import (
    InsufficientQuantity,
    InvalidArgument,
    Outcome,
    RefConflict,
    decrement,
    increment,
    release,
    reserve,
)
from stateguard.tables import counter_ledger
from tests._support import stock_workers as w
from tests._support.models import Order
from tests._support.processes import worker_context
from tests._support.stock_workers import Stock, StockBase
from tests.conftest import Backend, count_statements

pytestmark = pytest.mark.tables(StockBase.metadata)


def _stock(engine: Any, **amounts: int) -> None:
    with Session(engine) as s, s.begin():
        for key, amount in amounts.items():
            s.add(Stock(id=int(key[1:]), amount=amount, reserved_max=amount))


def _amount(engine: Any, key: int) -> int:
    with Session(engine) as s:
        return s.get_one(Stock, key).amount


def _ledger_rows(engine: Any) -> int:
    with engine.connect() as c:
        return int(c.execute(select(func.count()).select_from(counter_ledger)).scalar_one())


def test_decrement_outcomes_and_values(engine: Any) -> None:
    """APPLIED with the new value, INSUFFICIENT with the amount found (nothing changed), NOT_FOUND."""
    _stock(engine, s1=3)
    with Session(engine) as s, s.begin():
        r = decrement(s, Stock.amount, 1, by=2)
        assert (r.outcome, r.value) == (Outcome.APPLIED, 1)
        short = decrement(s, Stock.amount, 1, by=2)
        assert (short.outcome, short.value) == (Outcome.INSUFFICIENT, 1)
        with pytest.raises(InsufficientQuantity) as info:
            short.raise_for_outcome()
        assert (info.value.target, info.value.value) == (1, 1)
        assert decrement(s, Stock.amount, 99).outcome is Outcome.NOT_FOUND
        assert decrement(s, Stock.amount, 1, by=5, floor=None).value in (-4, None)
    assert _amount(engine, 1) == -4


def test_bounds_may_be_columns_of_the_same_row(engine: Any) -> None:
    """increment with ceiling=Stock.reserved_max stops at that row's own limit."""
    _stock(engine, s1=1)
    with Session(engine) as s, s.begin():
        s.get_one(Stock, 1).amount = 0
    with Session(engine) as s, s.begin():
        assert increment(s, Stock.amount, 1, ceiling=Stock.reserved_max).applied
        assert increment(s, Stock.amount, 1, ceiling=Stock.reserved_max).outcome is Outcome.INSUFFICIENT
        assert decrement(s, Stock.amount, 1, floor=Stock.reserved_max).outcome is Outcome.INSUFFICIENT
    assert _amount(engine, 1) == 1


def test_statement_counts(engine: Any) -> None:
    """Without ref: one statement; with ref: the ledger insert plus the UPDATE."""
    _stock(engine, s1=10)
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as c:
            decrement(s, Stock.amount, 1)
        assert len(c) == 1, c.statements
        with count_statements(engine) as c:
            decrement(s, Stock.amount, 1, ref="order-1")
        inserts_and_updates = [x for x in c.statements if x.split()[0] in ("INSERT", "UPDATE")]
        assert len(inserts_and_updates) == 2, c.statements


def test_refs_apply_once_and_conflict_on_another_amount(engine: Any) -> None:
    """The same ref is REPEATED even after stock ran out; the same ref with another amount is RefConflict."""
    _stock(engine, s1=2)
    with Session(engine) as s, s.begin():
        assert decrement(s, Stock.amount, 1, by=2, ref="order-42").applied
        again = decrement(s, Stock.amount, 1, by=2, ref="order-42")
        assert again.outcome is Outcome.REPEATED
        with pytest.raises(RefConflict):
            decrement(s, Stock.amount, 1, by=1, ref="order-42")
    assert _amount(engine, 1) == 0 and _ledger_rows(engine) == 1


def test_insufficient_leaves_no_ledger_row_so_a_retry_after_restock_applies(engine: Any) -> None:
    """An INSUFFICIENT call forgets its ref: after a restock the same ref applies."""
    _stock(engine, s1=1)
    with Session(engine) as s, s.begin():
        assert decrement(s, Stock.amount, 1, by=2, ref="late").outcome is Outcome.INSUFFICIENT
    assert _ledger_rows(engine) == 0
    with Session(engine) as s, s.begin():
        assert increment(s, Stock.amount, 1, by=5).applied
        assert decrement(s, Stock.amount, 1, by=2, ref="late").applied
    assert _amount(engine, 1) == 4


def test_reserve_is_all_or_nothing_and_release_is_exactly_once(engine: Any) -> None:
    """A short item undoes the whole reservation; release gives back once, then REPEATED."""
    _stock(engine, s1=5, s2=1)
    with Session(engine) as s, s.begin():
        short = reserve(s, Stock.amount, {1: 2, 2: 3}, ref="big")
        assert (short.outcome, short.key, short.value) == (Outcome.INSUFFICIENT, 2, 1)
        ok = reserve(s, Stock.amount, {2: 1, 1: 2}, ref="small")
        assert ok.applied and ok.value in ({1: 3, 2: 0}, {1: None, 2: None})
        assert reserve(s, Stock.amount, {2: 1, 1: 2}, ref="small").outcome is Outcome.REPEATED
    assert (_amount(engine, 1), _amount(engine, 2)) == (3, 0)
    with Session(engine) as s, s.begin():
        back = release(s, Stock.amount, "small")
        assert back.applied and back.value == {1: 2, 2: 1}
        assert release(s, Stock.amount, "small").outcome is Outcome.REPEATED
        assert release(s, Stock.amount, "nope").outcome is Outcome.NOT_FOUND
    assert (_amount(engine, 1), _amount(engine, 2)) == (5, 1)


@pytest.mark.hostile
def test_bad_input_is_typed_and_writes_nothing(engine: Any) -> None:
    """by <= 0, bool, non-numeric columns, foreign bounds or columns: InvalidArgument, nothing written."""
    _stock(engine, s1=5)
    with Session(engine) as s, s.begin():
        for by in (0, -1, True, "1", None):
            with pytest.raises(InvalidArgument):
                decrement(s, Stock.amount, 1, by=by)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument):
            decrement(s, Order.status, 1)
        with pytest.raises(InvalidArgument):
            decrement(s, Stock.amount, 1, floor=Order.amount)
        with pytest.raises(InvalidArgument):
            decrement(s, Stock.amount, 1, floor="zero")
        with pytest.raises(InvalidArgument):
            decrement(s, "amount", 1)
        with pytest.raises(InvalidArgument):
            decrement(s, Stock.amount, "one")
        with pytest.raises(InvalidArgument):
            decrement(s, Stock.amount, 1, ref="")
        with pytest.raises(InvalidArgument):
            reserve(s, Stock.amount, {}, ref="r")
    assert _amount(engine, 1) == 5 and _ledger_rows(engine) == 0


def _threads(fn: Any, args: list[tuple[Any, ...]]) -> list[Any]:
    with ThreadPoolExecutor(len(args)) as pool:
        return [f.result(timeout=300) for f in [pool.submit(fn, *a) for a in args]]


BARRIER = "<barrier>"


def _processes(fn: Any, args: list[tuple[Any, ...]]) -> list[Any]:
    """Run ``fn`` in separate processes; the BARRIER placeholder becomes a shared barrier."""
    ctx = worker_context()
    with ctx.Manager() as manager:
        barrier = manager.Barrier(len(args))
        with ProcessPoolExecutor(len(args), mp_context=ctx) as pool:
            futures = [pool.submit(fn, *(barrier if x == BARRIER else x for x in a)) for a in args]
            return [f.result(timeout=300) for f in futures]


def _total(results: list[dict[str, int]]) -> Counter[str]:
    total: Counter[str] = Counter()
    for r in results:
        total.update(r)
    return total


@pytest.mark.parametrize("use_ref", [False, True])
def test_hot_row_16_threads_never_oversell(engine: Any, backend: Backend, use_ref: bool) -> None:
    """Stock 100, 16 threads x 20 purchases: exactly 100 APPLIED, final 0, never negative."""
    _stock(engine, s1=100)
    barrier = threading.Barrier(16)
    results = _threads(w.buy, [(backend.name, backend.url, f"t{i}", 20, barrier, use_ref) for i in range(16)])
    total = _total(results)
    assert total["APPLIED"] == 100 and total["INSUFFICIENT"] == 220 and "negative" not in total
    assert _amount(engine, 1) == 0
    assert _ledger_rows(engine) == (100 if use_ref else 0)


def test_hot_row_4_processes_never_oversell(engine: Any, backend: Backend) -> None:
    """Stock 100, 4 processes x 30 purchases with refs: exactly 100 APPLIED, 100 ledger rows, final 0."""
    _stock(engine, s1=100)
    results = _processes(w.buy, [(backend.name, backend.url, f"p{i}", 30, BARRIER, True) for i in range(4)])
    total = _total(results)
    assert total["APPLIED"] == 100 and total["INSUFFICIENT"] == 20 and "negative" not in total
    assert _amount(engine, 1) == 0 and _ledger_rows(engine) == 100


def test_retried_purchases_apply_once_per_ref(engine: Any, backend: Backend) -> None:
    """Every purchase sent 3 times from different workers at once: stock drops exactly once per ref."""
    _stock(engine, s1=1000)
    refs = [f"purchase-{i}" for i in range(40)]
    barrier = threading.Barrier(6)
    results = _threads(w.retried_purchases, [(backend.name, backend.url, refs, barrier) for _ in range(6)])
    total = _total(results)
    assert total["APPLIED"] == 40 and total["REPEATED"] == 200
    assert _amount(engine, 1) == 960 and _ledger_rows(engine) == 40


def test_opposite_order_reservations_do_not_deadlock(engine: Any, backend: Backend) -> None:
    """Many reservations over the same two items in opposite mapping order: no deadlock, no oversell."""
    _stock(engine, s1=60, s2=60)
    barrier = threading.Barrier(8)
    results = _threads(w.reserve_pairs, [(backend.name, backend.url, i, 10, barrier) for i in range(8)])
    total = _total(results)
    assert total["APPLIED"] == 60 and total["INSUFFICIENT"] == 20
    assert (_amount(engine, 1), _amount(engine, 2)) == (0, 0)


def test_concurrent_releases_give_back_once(engine: Any, backend: Backend) -> None:
    """8 threads release the same reservation at once: exactly one APPLIED."""
    _stock(engine, s1=10, s2=10)
    with Session(engine) as s, s.begin():
        assert reserve(s, Stock.amount, {1: 3, 2: 4}, ref="cancel-me").applied
    barrier = threading.Barrier(8)
    outcomes: list[Outcome] = []

    def worker() -> None:
        barrier.wait()
        for _ in range(100):
            try:
                with Session(engine) as s, s.begin():
                    outcomes.append(release(s, Stock.amount, "cancel-me").outcome)
                return
            except Exception as error:
                from stateguard import SerializationConflict

                if not isinstance(error, SerializationConflict):
                    raise

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert Counter(outcomes) == {Outcome.APPLIED: 1, Outcome.REPEATED: 7}
    assert (_amount(engine, 1), _amount(engine, 2)) == (10, 10)
