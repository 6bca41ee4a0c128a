"""Snowflake worker-id leases under real races: generators started together in threads and processes
never share a worker id or an id, the last free worker ids go to exactly as many racers, an exhausted
namespace recovers when a holder dies, and a holder that lost its lease never issues again."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine

from stateguard import (
    LockLost,
    Snowflake,
    StateguardError,
    WorkerIdsExhausted,
    WorkerLeaseLost,
)
from stateguard.tables import worker_leases
from tests._support.snowflake_clocks import (
    _REAL_TIME_NS,
    WAIT,
    SkewedClock,
    _parse,
    _row,
    _rows,
    _run_thread,
    _take_over,
    _worker_engine,
)
from tests.conftest import Backend, backends_with


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[SkewedClock]:
    c = SkewedClock()
    monkeypatch.setattr(time, "time_ns", c.time_ns)
    monkeypatch.setattr(time, "time", c.time)
    yield c
    c.release.set()


def proc_issue(name: str, url: str, namespace: str, count: int, barrier: Any) -> tuple[int, list[int]]:
    """A process with its own engine and Snowflake, constructed on the barrier; ``count`` ids, then close."""
    engine = _worker_engine(name, url)
    try:
        with engine.connect():
            pass
        barrier.wait(WAIT)
        with Snowflake(engine, namespace=namespace) as ids:
            barrier.wait(WAIT)
            return ids.worker_id, [ids.next_id() for _ in range(count)]
    finally:
        engine.dispose()


def proc_hold_until_taken(name: str, url: str, namespace: str, taken: Any, ready: Any) -> tuple[Any, ...]:
    """Hold a short lease without renewing; once the test took it over, try to issue and then close."""
    engine = _worker_engine(name, url)
    try:
        ids = Snowflake(engine, namespace=namespace, lease=timedelta(seconds=1), heartbeat=False)
        first = ids.next_id()
        ready.set()
        if not taken.wait(WAIT):
            raise TimeoutError("never taken over")
        outcomes: list[Any] = []
        for _ in range(3):
            try:
                outcomes.append(ids.next_id())
            except WorkerLeaseLost as error:
                outcomes.append(("WorkerLeaseLost", error.namespace, error.worker_id, error.retryable))
        ids.close()
        ids.close()
        return ids.worker_id, first, outcomes
    finally:
        engine.dispose()


# --------------------------------------------------------------------------
# uniqueness under concurrency
# --------------------------------------------------------------------------


def test_threads_each_with_a_generator_started_together_never_share_a_worker_id_or_an_id(
    engine: Engine,
) -> None:
    """16 threads construct their generators on one barrier and issue 2,000 ids each: 32,000 unique ids."""
    n, count = 16, 2000
    barrier = threading.Barrier(n)

    def work() -> tuple[int, list[int]]:
        barrier.wait(WAIT)
        with Snowflake(engine, namespace="threads") as ids:
            barrier.wait(WAIT)
            return ids.worker_id, [ids.next_id() for _ in range(count)]

    with ThreadPoolExecutor(n) as pool:
        results = [f.result() for f in [pool.submit(work) for _ in range(n)]]
    workers = [w for w, _ in results]
    assert sorted(workers) == list(range(n))
    every = [i for _, ids in results for i in ids]
    assert len(every) == len(set(every)) == n * count
    for worker, ids in results:
        assert ids == sorted(ids) and len(set(ids)) == count
        assert {_parse(i)[1] for i in ids} == {worker}
    assert all(r.owner is None for r in _rows(engine, "threads"))


def test_one_generator_shared_by_many_threads_gives_unique_increasing_ids(engine: Engine) -> None:
    """One generator, 16 threads released together: 40,000 unique ids, increasing in each thread."""
    n, count = 16, 2500
    barrier = threading.Barrier(n)
    with Snowflake(engine, namespace="shared") as ids:

        def work() -> list[int]:
            barrier.wait(WAIT)
            return [ids.next_id() for _ in range(count)]

        with ThreadPoolExecutor(n) as pool:
            results = [f.result() for f in [pool.submit(work) for _ in range(n)]]
    every = [i for r in results for i in r]
    assert len(set(every)) == n * count
    for r in results:
        assert all(a < b for a, b in itertools.pairwise(r))
    assert all(0 <= i < 2**63 for i in every)


def test_four_processes_started_together_issue_unique_ids(
    backend: Backend, engine: Engine, procs: tuple[Any, ProcessPoolExecutor]
) -> None:
    """4 spawned processes, each its own engine and generator, constructed on one barrier: 20,000 unique."""
    manager, pool = procs
    barrier = manager.Barrier(4)
    futures = [pool.submit(proc_issue, backend.name, backend.url, "procs", 5000, barrier) for _ in range(4)]
    results = [f.result(timeout=WAIT) for f in futures]
    assert sorted(w for w, _ in results) == [0, 1, 2, 3]
    every = [i for _, ids in results for i in ids]
    assert len(set(every)) == 20_000
    for worker, ids in results:
        assert all(a < b for a, b in itertools.pairwise(ids))
        assert {_parse(i)[1] for i in ids} == {worker}


# --------------------------------------------------------------------------
# exhaustion
# --------------------------------------------------------------------------


def test_the_last_free_worker_ids_go_to_exactly_as_many_racers_and_a_close_frees_one(engine: Engine) -> None:
    """1,016 live generators; 16 threads race for the last 8 worker ids: 8 win, 8 get WorkerIdsExhausted."""
    held = [Snowflake(engine, namespace="full", heartbeat=False) for _ in range(1016)]
    assert sorted(g.worker_id for g in held) == list(range(1016))
    n = 16
    barrier = threading.Barrier(n)

    def race() -> Snowflake | WorkerIdsExhausted:
        barrier.wait(WAIT)
        try:
            return Snowflake(engine, namespace="full", heartbeat=False)
        except WorkerIdsExhausted as error:
            return error

    with ThreadPoolExecutor(n) as pool:
        outcomes = [f.result() for f in [pool.submit(race) for _ in range(n)]]
    winners = [o for o in outcomes if isinstance(o, Snowflake)]
    errors = [o for o in outcomes if isinstance(o, WorkerIdsExhausted)]
    assert len(winners) == 8 and len(errors) == 8
    assert sorted(w.worker_id for w in winners) == list(range(1016, 1024))
    for error in errors:
        assert error.retryable is True and error.namespace == "full"
        assert isinstance(error, StateguardError)
    held += winners
    # another namespace is a separate id space: not exhausted
    with Snowflake(engine, namespace="other", heartbeat=False) as other:
        assert other.worker_id == 0
    with pytest.raises(WorkerIdsExhausted):
        Snowflake(engine, namespace="full", heartbeat=False)
    # a close frees exactly that worker id
    freed = held.pop(517)
    last_before = freed.next_id()
    freed.close()
    again = Snowflake(engine, namespace="full", heartbeat=False)
    assert again.worker_id == 517
    assert again.next_id() > last_before
    held.append(again)
    for g in held:
        g.close()
    assert all(r.owner is None for r in _rows(engine, "full")) and len(_rows(engine, "full")) == 1024


def test_racers_for_many_free_worker_ids_reuse_them_before_creating_new_ones(engine: Engine) -> None:
    """20 released worker ids, 16 threads starting generators at once: each takes a distinct one of
    the 20 (a claim reads 8 free rows at a time; losing all 8 to racers looks again rather than
    creating id 20 while free ones are left)."""
    for g in [Snowflake(engine, namespace="reuse", heartbeat=False) for _ in range(20)]:
        g.close()
    n = 16
    barrier = threading.Barrier(n)

    def race() -> Snowflake:
        barrier.wait(WAIT)
        return Snowflake(engine, namespace="reuse", heartbeat=False)

    with ThreadPoolExecutor(n) as pool:
        winners = [f.result() for f in [pool.submit(race) for _ in range(n)]]
    taken = sorted(w.worker_id for w in winners)
    assert len(set(taken)) == n and taken[-1] < 20, taken
    assert len(_rows(engine, "reuse")) == 20
    for g in winners:
        g.close()


@pytest.mark.hostile
def test_worker_rows_deleted_by_hand_leave_gaps_that_new_generators_fill_lowest_first(engine: Engine) -> None:
    """Ids are created lowest unused first, so a claim counts the rows instead of reading them;
    rows an operator deleted (and one inserted by hand far out of order) leave gaps that the next
    generators take, lowest first, before they create id 6; every id stays with one holder."""
    held = [Snowflake(engine, namespace="gaps", heartbeat=False) for _ in range(6)]
    assert [g.worker_id for g in held] == [0, 1, 2, 3, 4, 5]
    for gone in (held.pop(3), held.pop(1)):  # closed, then their rows deleted
        gone.close()
    with engine.begin() as conn:
        conn.execute(
            worker_leases.delete().where(
                worker_leases.c.namespace == "gaps", worker_leases.c.worker_id.in_([1, 3])
            )
        )
        conn.execute(
            worker_leases.insert().values(
                namespace="gaps", worker_id=1000, owner="by-hand", lease_expires_ms=2**62, last_ms=0
            )
        )
    more = [Snowflake(engine, namespace="gaps", heartbeat=False) for _ in range(3)]
    assert [g.worker_id for g in more] == [1, 3, 6]
    for g in held + more:
        g.close()


@pytest.mark.restart
def test_exhausted_namespace_recovers_when_a_holder_dies(engine: Engine) -> None:
    """1,023 live generators and one that dies (never renews, never closes): its worker id frees on expiry."""
    held = [Snowflake(engine, namespace="die", heartbeat=False) for _ in range(1023)]
    # The shortest lease there is: the exhausted check below runs within milliseconds of the claim.
    dead = Snowflake(engine, namespace="die", lease=timedelta(seconds=1), heartbeat=False)
    dead_ids = [dead.next_id() for _ in range(100)]
    del dead  # the process died: no close(), no renewal
    with pytest.raises(WorkerIdsExhausted):
        Snowflake(engine, namespace="die", heartbeat=False)
    taker = _take_over(engine, "die", 1023)
    assert taker.next_id() > max(dead_ids)
    for g in [*held, taker]:
        g.close()


# --------------------------------------------------------------------------
# leases lost and taken over
# --------------------------------------------------------------------------


@pytest.mark.lost_reply
def test_a_process_that_lost_its_lease_raises_and_never_issues_again(
    backend: Backend, engine: Engine, procs: tuple[Any, ProcessPoolExecutor]
) -> None:
    """A process that stopped renewing is taken over by this one; its next_id() raises WorkerLeaseLost."""
    manager, pool = procs
    taken, ready = manager.Event(), manager.Event()
    future = pool.submit(proc_hold_until_taken, backend.name, backend.url, "lost", taken, ready)
    assert ready.wait(WAIT)
    worker = 0
    taker = _take_over(engine, "lost", worker)
    mine = [taker.next_id()]
    taken.set()
    worker_id, first, outcomes = future.result(timeout=WAIT)
    assert worker_id == worker
    assert outcomes == [("WorkerLeaseLost", "lost", worker, False)] * 3
    assert issubclass(WorkerLeaseLost, LockLost)
    # its close() left the new holder's lease alone: the row is still ours and renewals succeed
    assert _row(engine, "lost", worker).owner is not None
    taker._renew(due_only=False)
    mine += [taker.next_id() for _ in range(100)]
    assert min(mine) > first
    taker.close()


def test_a_holder_paused_inside_next_id_past_its_lease_never_duplicates_the_new_holders_ids(
    engine: Engine, clock: SkewedClock
) -> None:
    """A holder paused (GC, stopped VM) right after next_id read the clock, taken over meanwhile.

    Whatever id it returns when it wakes must not be one the new holder issues.
    """
    old = Snowflake(engine, namespace="pause", lease=timedelta(seconds=1), heartbeat=False)
    before = [old.next_id() for _ in range(10)]
    holder: dict[str, Any] = {}

    def paused() -> int:
        holder["ident"] = threading.get_ident()
        clock.held = holder["ident"]
        return old.next_id()

    t, out = _run_thread(paused)
    assert clock.reached.wait(WAIT)
    new = _take_over(engine, "pause", old.worker_id)
    new_ids = [new.next_id() for _ in range(3000)]
    clock.release.set()
    t.join(WAIT)
    late = out.get("result")
    assert "error" in out or late not in set(new_ids)
    if late is not None:
        assert late < min(new_ids)
    with pytest.raises(WorkerLeaseLost):
        old.next_id()
    assert max(before) < min(new_ids)
    old.close()
    new.close()


# README: a generator never issues ids without its lease ("raises WorkerLeaseLost instead of
# issuing ids"; two live processes never share a worker id).  A next_id() running in one thread
# while another thread calls close() must not return an id after close() released the worker id
# (the next holder of that worker id would issue the very same id).
def test_next_id_racing_close_never_duplicates_the_next_holders_ids(
    engine: Engine, clock: SkewedClock
) -> None:
    """Shutdown: close() runs while a request thread is inside next_id(); a new generator then starts."""
    old = Snowflake(engine, namespace="closing", heartbeat=False)
    for _ in range(5):
        old.next_id()
    holder: dict[str, Any] = {}

    def request() -> int:
        holder["ident"] = threading.get_ident()
        clock.held = holder["ident"]
        return old.next_id()

    t, out = _run_thread(request)
    assert clock.reached.wait(WAIT)  # the request thread is inside next_id, past the closed check
    old.close()
    # both generators read the same millisecond (a busy host issues thousands per millisecond)
    clock.frozen_ns = _REAL_TIME_NS() + 50_000_000
    new = Snowflake(engine, namespace="closing", heartbeat=False)
    assert new.worker_id == old.worker_id
    new_ids = {new.next_id() for _ in range(10)}
    clock.release.set()
    t.join(WAIT)
    assert not t.is_alive()
    assert "error" in out or out["result"] not in new_ids, "the closed generator issued a duplicate id"
    new.close()


@pytest.mark.parametrize("backend", backends_with("concurrent_writers"), indirect=True)
def test_twelve_takers_of_one_expired_worker_id_on_a_server(backend: Any, engine: Engine) -> None:
    """12 threads with their own engines race for worker ids while the only expired one is free."""
    live = [Snowflake(engine, namespace="takers", heartbeat=False) for _ in range(3)]
    dead = Snowflake(engine, namespace="takers", lease=timedelta(seconds=1), heartbeat=False)
    dead_ids = [dead.next_id() for _ in range(50)]
    taker = _take_over(engine, "takers", dead.worker_id)
    taker.close()  # the row is free again, with its last_ms
    n = 12
    barrier = threading.Barrier(n)
    # every generator stays live until all have issued: a generator closed early frees its worker id,
    # and a late starter may rightly take it again
    all_issued = threading.Barrier(n)
    engines = [backend.new_engine(pool_size=1) for _ in range(n)]

    def take(e: Engine) -> tuple[int, list[int]]:
        with e.connect():
            pass
        barrier.wait(WAIT)
        g = Snowflake(e, namespace="takers", heartbeat=False)
        try:
            issued = [g.next_id() for _ in range(200)]
            all_issued.wait(WAIT)
            return g.worker_id, issued
        finally:
            g.close()

    try:
        with ThreadPoolExecutor(n) as pool:
            results = list(pool.map(take, engines))
    finally:
        for e in engines:
            e.dispose()
    workers = [w for w, _ in results]
    assert workers.count(dead.worker_id) <= 1
    assert len(set(workers)) == n  # all live at once: distinct worker ids
    every = [i for _, ids in results for i in ids]
    assert len(set(every)) == n * 200
    for w, ids in results:
        if w == dead.worker_id:
            assert min(ids) > max(dead_ids)
    for g in live:
        g.close()
