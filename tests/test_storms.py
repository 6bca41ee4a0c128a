"""Real races: many threads and processes, released by a barrier, firing at the same rows."""

from __future__ import annotations

import multiprocessing
import threading
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from stateguard import Outcome

from . import _storm_workers as w
from .conftest import Backend
from .models import Base, Order, SideEffect

N_ORDERS = 20


def _setup(backend: Backend, status: str = "pending") -> Any:
    engine = backend.create(Base.metadata)
    with Session(engine) as s, s.begin():
        s.add_all([Order(id=i, status=status) for i in range(1, N_ORDERS + 1)])
    return engine


def _side_effects(engine: Any, what: str) -> dict[int, int]:
    with Session(engine) as s:
        rows = s.execute(
            select(SideEffect.order_id, func.count())
            .where(SideEffect.what == what)
            .group_by(SideEffect.order_id)
        ).all()
    return {k: v for k, v in rows}


def _total(results: list[dict[str, int]]) -> Counter[str]:
    total: Counter[str] = Counter()
    for r in results:
        total.update(r)
    return total


def test_16_threads_pay_the_same_orders_exactly_once(backend: Backend) -> None:
    """16 threads pay the same 20 orders at once: one APPLIED and one side effect per order."""
    engine = _setup(backend)
    n = 16
    barrier = threading.Barrier(n)
    keys = list(range(1, N_ORDERS + 1))
    with ThreadPoolExecutor(n) as pool:
        futures = [
            pool.submit(w.fire_storm, backend.name, backend.url, "pay", keys, f"t{i}", barrier, i)
            for i in range(n)
        ]
        results = [f.result(timeout=300) for f in futures]
    total = _total(results)
    assert total["APPLIED"] == N_ORDERS
    assert total["REPEATED"] == N_ORDERS * (n - 1)
    assert total["REJECTED"] == total["NOT_FOUND"] == total["STALE"] == 0
    assert _side_effects(engine, "pay") == {k: 1 for k in keys}
    with Session(engine) as s:
        assert set(s.scalars(select(Order.status))) == {"paid"}
        assert set(s.scalars(select(Order.version))) == {2}


def test_4_processes_pay_the_same_orders_exactly_once(backend: Backend) -> None:
    """4 processes (own engines and connections) pay the same orders at once: one APPLIED per order."""
    engine = _setup(backend)
    n = 4
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(n)
        keys = list(range(1, N_ORDERS + 1))
        with ProcessPoolExecutor(n, mp_context=ctx) as pool:
            futures = [
                pool.submit(w.fire_storm, backend.name, backend.url, "pay", keys, f"p{i}", barrier, 100 + i)
                for i in range(n)
            ]
            results = [f.result(timeout=300) for f in futures]
    total = _total(results)
    assert total["APPLIED"] == N_ORDERS
    assert total["REPEATED"] == N_ORDERS * (n - 1)
    assert _side_effects(engine, "pay") == {k: 1 for k in keys}


def test_16_threads_with_one_read_version_have_one_winner_per_row(backend: Backend) -> None:
    """16 threads update with the version they read: one APPLIED per row, the rest STALE."""
    engine = _setup(backend)
    n = 16
    barrier = threading.Barrier(n)
    keys = list(range(1, N_ORDERS + 1))
    with ThreadPoolExecutor(n) as pool:
        futures = [
            pool.submit(w.version_storm, backend.name, backend.url, keys, f"t{i}", barrier, i)
            for i in range(n)
        ]
        results = [f.result(timeout=300) for f in futures]
    total = _total(results)
    assert total["APPLIED"] == N_ORDERS
    assert total["STALE"] == N_ORDERS * (n - 1)
    assert _side_effects(engine, "note") == {k: 1 for k in keys}
    with Session(engine) as s:
        assert set(s.scalars(select(Order.version))) == {2}


def test_4_processes_with_one_read_version_have_one_winner_per_row(backend: Backend) -> None:
    """4 processes race guarded_update on the same versions: one winner per row."""
    engine = _setup(backend)
    n = 4
    ctx = multiprocessing.get_context("spawn")
    keys = list(range(1, N_ORDERS + 1))
    with ctx.Manager() as manager:
        barrier = manager.Barrier(n)
        with ProcessPoolExecutor(n, mp_context=ctx) as pool:
            futures = [
                pool.submit(w.version_storm, backend.name, backend.url, keys, f"p{i}", barrier, i)
                for i in range(n)
            ]
            results = [f.result(timeout=300) for f in futures]
    total = _total(results)
    assert total["APPLIED"] == N_ORDERS and total["STALE"] == N_ORDERS * (n - 1)
    assert _side_effects(engine, "note") == {k: 1 for k in keys}


def test_after_commit_callbacks_run_once_per_row_in_a_thread_storm(backend: Backend) -> None:
    """16 threads pay the same rows and register on_commit: exactly one callback per row overall."""
    engine = _setup(backend)
    n = 16
    barrier = threading.Barrier(n)
    calls: list[int] = []
    lock = threading.Lock()

    def record(key: int) -> None:
        with lock:
            calls.append(key)

    def worker(seed: int) -> None:
        from random import Random

        keys = list(range(1, N_ORDERS + 1))
        Random(seed).shuffle(keys)
        barrier.wait()
        for key in keys:
            for _attempt in range(30):
                try:
                    with Session(engine) as s, s.begin():
                        r = Order.flow.pay(s, key)
                        r.on_commit(record, key)
                    break
                except Exception as error:  # busy/deadlock: retry the unit of work
                    from stateguard import SerializationConflict

                    if not isinstance(error, SerializationConflict):
                        raise

    with ThreadPoolExecutor(n) as pool:
        for f in [pool.submit(worker, i) for i in range(n)]:
            f.result(timeout=300)
    assert sorted(calls) == list(range(1, N_ORDERS + 1))


def test_mixed_triggers_storm_keeps_the_graph_and_one_effect_per_transition(backend: Backend) -> None:
    """Random pay/ship/cancel from 16 threads: each (order, trigger) applies at most once; the graph holds."""
    engine = _setup(backend)
    n = 16
    barrier = threading.Barrier(n)
    applied: list[tuple[int, str]] = []
    lock = threading.Lock()

    def worker(seed: int) -> None:
        from random import Random

        rnd = Random(seed)
        barrier.wait()
        for _ in range(30):
            key, trig = rnd.randint(1, N_ORDERS), rnd.choice(["pay", "ship", "cancel"])
            for _attempt in range(30):
                try:
                    with Session(engine) as s, s.begin():
                        r = Order.flow.fire(s, trig, key)
                        if r.applied:
                            s.add(SideEffect(order_id=key, what=trig, worker=str(seed)))
                    if r.applied:
                        with lock:
                            applied.append((key, trig))
                    break
                except Exception as error:
                    from stateguard import SerializationConflict

                    if not isinstance(error, SerializationConflict):
                        raise

    with ThreadPoolExecutor(n) as pool:
        for f in [pool.submit(worker, i) for i in range(n)]:
            f.result(timeout=300)
    assert len(applied) == len(set(applied))  # each (order, trigger) at most once
    with Session(engine) as s:
        status = dict(s.execute(select(Order.id, Order.status)).all())
        effects = Counter((e.order_id, e.what) for e in s.scalars(select(SideEffect)))
    assert effects == Counter(applied)
    for key in range(1, N_ORDERS + 1):
        done = {t for k, t in applied if k == key}
        assert not ({"ship", "cancel"} <= done)  # shipped orders cannot be cancelled and vice versa
        if "ship" in done:
            assert status[key] == "shipped" and "pay" in done
        elif "cancel" in done:
            assert status[key] == "cancelled"
        elif "pay" in done:
            assert status[key] == "paid"
        else:
            assert status[key] == "pending"


def test_repeatable_read_storm_on_postgresql_retries_serialization_failures(pg: Backend) -> None:
    """At REPEATABLE READ, losers get serialization failures that retry_on_conflict turns into REPEATED."""
    engine = pg.create(Base.metadata)
    with Session(engine) as s, s.begin():
        s.add_all([Order(id=i) for i in range(1, N_ORDERS + 1)])
    rr = pg.new_engine(isolation_level="REPEATABLE READ")
    try:
        n = 16
        barrier = threading.Barrier(n)
        outcomes: list[Outcome] = []
        lock = threading.Lock()

        def worker(seed: int) -> None:
            from random import Random

            from stateguard import retry_on_conflict

            keys = list(range(1, N_ORDERS + 1))
            Random(seed).shuffle(keys)
            barrier.wait()
            for key in keys:

                def unit(key: int = key) -> Any:
                    with Session(rr) as s, s.begin():
                        s.execute(
                            select(Order.version).where(Order.id == key)
                        ).all()  # take the snapshot first
                        r = Order.flow.pay(s, key)
                        if r.applied:
                            s.add(SideEffect(order_id=key, what="pay", worker=str(seed)))
                        return r

                r = retry_on_conflict(unit, attempts=50, backoff=0.002)
                with lock:
                    outcomes.append(r.outcome)

        with ThreadPoolExecutor(n) as pool:
            for f in [pool.submit(worker, i) for i in range(n)]:
                f.result(timeout=300)
        assert Counter(outcomes) == {Outcome.APPLIED: N_ORDERS, Outcome.REPEATED: N_ORDERS * (n - 1)}
        assert _side_effects(engine, "pay") == {k: 1 for k in range(1, N_ORDERS + 1)}
    finally:
        rr.dispose()
