"""Attacks on the README's "Request ids" section and the ids part of "Scaling out".

Promises under attack (README):

* a ``Snowflake`` leases its worker id (0-1023) with a conditional UPDATE, "so two live processes
  never share one"; a generator that cannot renew raises ``WorkerLeaseLost`` "instead of issuing ids";
* leases are judged on the database's clock, "the ids carry the host's own clock", and "when the
  clock steps back it waits rather than issue a smaller id";
* "the highest millisecond used is stored with the lease, so the next holder of a worker id starts
  after it";
* all 1024 worker ids live: ``WorkerIdsExhausted`` (retryable), freed "when a generator closes or dies".

Everything runs on SQLite, PostgreSQL and MariaDB with real threads (started together on a
``threading.Barrier``) and spawned processes.  Application clocks are moved by monkeypatching
``time.time``/``time.time_ns``; a process that dies holding a lease is a generator abandoned
without ``close()`` (``heartbeat=False``: nothing renews it any more).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, func, select
from sqlalchemy.orm import Session, sessionmaker

from stateguard import (
    InvalidArgument,
    LockLost,
    Snowflake,
    StateguardError,
    WorkerIdsExhausted,
    WorkerLeaseLost,
    create_tables,
    drop_tables,
)
from stateguard.tables import worker_leases
from tests.conftest import Backend, _only

WAIT = 60
HOUR_NS = 3600 * 1_000_000_000
_REAL_TIME_NS = time.time_ns


def _parse(snowflake_id: int) -> tuple[int, int, int]:
    return Snowflake.parse(snowflake_id)


def _rows(engine: Engine, namespace: str) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                select(worker_leases)
                .where(worker_leases.c.namespace == namespace)
                .order_by(worker_leases.c.worker_id)
            )
        )


def _row(engine: Engine, namespace: str, worker_id: int) -> Any:
    return next(r for r in _rows(engine, namespace) if r.worker_id == worker_id)


def _lease_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(worker_leases)).scalar_one())


class SkewedClock:
    """Replaces ``time.time_ns`` and ``time.time`` with the real clock plus ``offset_ns``.

    ``hold(thread_ident)`` makes the next read of the clock by that thread report itself on
    ``reached``, wait for ``release``, and return ``frozen_ns`` (if set) or the time it read first:
    a thread paused (GC, a stopped VM) right after reading the clock.
    """

    def __init__(self) -> None:
        self.offset_ns = 0
        self.frozen_ns: int | None = None
        self.held: int | None = None
        self.reached = threading.Event()
        self.release = threading.Event()
        self.reads_by: dict[int, int] = {}

    def time_ns(self) -> int:
        ident = threading.get_ident()
        self.reads_by[ident] = self.reads_by.get(ident, 0) + 1
        value = _REAL_TIME_NS() + self.offset_ns if self.frozen_ns is None else self.frozen_ns
        if self.held is not None and ident == self.held:
            self.held = None
            self.reached.set()
            assert self.release.wait(WAIT), "the test never released the held thread"
            if self.frozen_ns is not None:
                value = self.frozen_ns
        return value

    def time(self) -> float:
        return self.time_ns() / 1e9


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[SkewedClock]:
    c = SkewedClock()
    monkeypatch.setattr(time, "time_ns", c.time_ns)
    monkeypatch.setattr(time, "time", c.time)
    yield c
    c.release.set()


@pytest.fixture(params=["postgresql", "mariadb"])
def server(request: pytest.FixtureRequest, namespaces: Any) -> Iterator[Backend]:
    """PostgreSQL and MariaDB with stateguard's tables (server-only tests)."""
    for b in _only(request.param, namespaces):
        drop_tables(b.engine)
        create_tables(b.engine)
        yield b
        drop_tables(b.engine)


def _run_thread(target: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``target`` in a daemon thread; the dict gets ``result`` or ``error`` and ``ident``."""
    out: dict[str, Any] = {}
    started = threading.Event()

    def body() -> None:
        out["ident"] = threading.get_ident()
        started.set()
        try:
            out["result"] = target()
        except BaseException as error:  # the test inspects it
            out["error"] = error

    t = threading.Thread(target=body, daemon=True)
    t.start()
    assert started.wait(WAIT)
    return t, out


# --------------------------------------------------------------------------
# process workers (module level: the spawned pool imports them)
# --------------------------------------------------------------------------


def _worker_engine(name: str, url: str) -> Engine:
    kw: dict[str, Any] = {"pool_size": 2}
    if name == "sqlite":
        kw["connect_args"] = {"timeout": 60}
    return create_engine(url, **kw)


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


def proc_die_holding(name: str, url: str, namespace: str, skew_ms: int, count: int) -> tuple[int, list[int]]:
    """A process whose clock is ``skew_ms`` off issues ids and "dies": it never closes or renews."""
    real = time.time_ns
    time.time_ns = lambda: real() + skew_ms * 1_000_000  # type: ignore[assignment]
    engine = _worker_engine(name, url)
    try:
        ids = Snowflake(engine, namespace=namespace, lease=timedelta(seconds=1), heartbeat=False)
        return ids.worker_id, [ids.next_id() for _ in range(count)]
    finally:
        time.time_ns = real  # type: ignore[assignment]
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


def _take_over(engine: Engine, namespace: str, worker_id: int, **kw: Any) -> Snowflake:
    """Poll (the documented retry) until a new generator leases ``worker_id``; others are closed again."""
    deadline = time.monotonic() + 20
    while True:
        try:
            ids = Snowflake(engine, namespace=namespace, heartbeat=False, **kw)
        except WorkerIdsExhausted:  # retryable: the dead holder's lease has not expired yet
            pass
        else:
            if ids.worker_id == worker_id:
                return ids
            ids.close()
        assert time.monotonic() < deadline, f"worker id {worker_id} was never freed"
        time.sleep(0.05)  # polling a lease's expiry, not racing


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


def test_exhausted_namespace_recovers_when_a_holder_dies(engine: Engine) -> None:
    """1,023 live generators and one that dies (never renews, never closes): its worker id frees on expiry."""
    held = [Snowflake(engine, namespace="die", heartbeat=False) for _ in range(1023)]
    dead = Snowflake(engine, namespace="die", lease=timedelta(seconds=2), heartbeat=False)
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


# --------------------------------------------------------------------------
# clocks
# --------------------------------------------------------------------------


def test_clock_stepping_back_mid_life_never_repeats_or_decreases(engine: Engine, clock: SkewedClock) -> None:
    """The application clock steps back 300 ms twice while ids are issued: still strictly increasing."""
    with Snowflake(engine, namespace="stepback") as ids:
        issued = [ids.next_id() for _ in range(2000)]
        clock.offset_ns = -300_000_000
        started = time.monotonic()
        issued += [ids.next_id() for _ in range(2000)]
        assert time.monotonic() - started >= 0.25  # it waited rather than issue smaller ids
        clock.offset_ns = -600_000_000
        issued += [ids.next_id() for _ in range(2000)]
    assert all(a < b for a, b in itertools.pairwise(issued))


def test_a_holder_with_its_clock_hours_behind_still_loses_its_lease_on_time(
    engine: Engine, clock: SkewedClock
) -> None:
    """The app clock jumps 3 h back after the claim: the lease still expires on the database's clock."""
    old = Snowflake(engine, namespace="behind", lease=timedelta(seconds=1), heartbeat=False)
    old.next_id()
    clock.offset_ns = -3 * HOUR_NS
    new = _take_over(engine, "behind", old.worker_id)
    with pytest.raises(WorkerLeaseLost) as lost:
        old.next_id()
    assert lost.value.worker_id == old.worker_id and lost.value.namespace == "behind"
    old.close()
    assert _row(engine, "behind", old.worker_id).owner is not None  # the new holder's lease stands
    new.close()


def test_a_holder_with_its_clock_ahead_hands_over_without_repeating_ids(
    engine: Engine, clock: SkewedClock
) -> None:
    """A host 1.5 s ahead issues ids and closes; a host on time takes the worker id: its ids come after."""
    clock.offset_ns = 1_500_000_000
    ahead = Snowflake(engine, namespace="ahead", heartbeat=False)
    ahead_ids = [ahead.next_id() for _ in range(500)]
    ahead.close()
    clock.offset_ns = 0
    with Snowflake(engine, namespace="ahead", heartbeat=False) as on_time:
        assert on_time.worker_id == ahead.worker_id
        mine = [on_time.next_id() for _ in range(500)]
    assert min(mine) > max(ahead_ids)


def test_a_dead_process_with_a_fast_clock_hands_over_without_repeating_ids(
    backend: Backend, engine: Engine, procs: tuple[Any, ProcessPoolExecutor]
) -> None:
    """A process 1.5 s ahead dies holding worker id 0; this process takes it over after expiry."""
    _, pool = procs
    worker, dead_ids = pool.submit(proc_die_holding, backend.name, backend.url, "dead", 1500, 2000).result(
        timeout=WAIT
    )
    assert worker == 0 and len(set(dead_ids)) == 2000
    taker = _take_over(engine, "dead", worker)
    mine = [taker.next_id() for _ in range(2000)]
    taker.close()
    assert min(mine) > max(dead_ids)
    assert not set(mine) & set(dead_ids)


# README: "When the clock steps back it waits rather than issue a smaller id."  A clock that steps
# back 3 h and is corrected a moment later (NTP) must not leave next_id() asleep for the full 3 h:
# it looks at the clock again at least every 50 ms while it waits.
def test_a_clock_stepped_back_hours_then_corrected_does_not_hang_next_id(
    engine: Engine, clock: SkewedClock
) -> None:
    ids = Snowflake(engine, namespace="ntp", heartbeat=False)
    before = ids.next_id()
    clock.offset_ns = -3 * HOUR_NS
    seen_back = threading.Event()
    real_time_ns = clock.time_ns

    def watching() -> int:
        value = real_time_ns()
        if clock.offset_ns < 0:
            seen_back.set()
        return value

    clock.time_ns = watching  # type: ignore[method-assign]
    time.time_ns = watching  # type: ignore[assignment]  # restored by the monkeypatch fixture
    t, out = _run_thread(ids.next_id)
    assert seen_back.wait(WAIT)  # next_id has read the stepped-back clock
    clock.offset_ns = 0  # NTP corrects the clock
    t.join(5)
    finished = not t.is_alive()
    if finished:
        ids.close()
    assert finished, "next_id() still asleep 5 s after the clock was corrected"
    assert out["result"] > before


# --------------------------------------------------------------------------
# namespaces and hostile input
# --------------------------------------------------------------------------


def test_namespaces_that_differ_only_in_case_space_or_normalisation_are_separate(engine: Engine) -> None:
    """Each namespace is its own worker-id space, compared exactly (no case folding, no trimming)."""
    names = ["orders", "Orders", "ORDERS", "orders ", " orders", "ordérs", "orde\u0301rs", "🦄" * 100]
    gens = [Snowflake(engine, namespace=n, heartbeat=False) for n in names]
    assert [g.worker_id for g in gens] == [0] * len(names)
    second = [Snowflake(engine, namespace=n, heartbeat=False) for n in names]
    assert [g.worker_id for g in second] == [1] * len(names)
    for n in names:
        rows = _rows(engine, n)
        assert [(r.namespace, r.worker_id) for r in rows] == [(n, 0), (n, 1)]
    for g in gens + second:
        g.close()
    assert _lease_count(engine) == 2 * len(names)


@pytest.mark.parametrize(
    "namespace",
    [
        "",
        " \t\n",
        "x" * 101,
        "🦄" * 101,
        "a\x00b",
        "\x00",
        "ns\ud800",
        "\udfff",
        b"orders",
        None,
        7,
        ["orders"],
    ],
    ids=[
        "empty",
        "blank",
        "101",
        "101emoji",
        "nul",
        "only-nul",
        "hi-surrogate",
        "lo-surrogate",
        "bytes",
        "none",
        "int",
        "list",
    ],
)
def test_hostile_namespaces_are_invalid_argument_and_write_nothing(engine: Engine, namespace: Any) -> None:
    with pytest.raises(InvalidArgument):
        Snowflake(engine, namespace=namespace, heartbeat=False)
    assert _lease_count(engine) == 0
    with Snowflake(engine, namespace="after", heartbeat=False) as ids:  # nothing left broken
        assert ids.worker_id == 0 and ids.next_id() > 0


def test_a_session_or_connection_where_the_engine_belongs_is_invalid_argument(engine: Engine) -> None:
    with Session(engine) as session:
        with pytest.raises(InvalidArgument):
            Snowflake(session, heartbeat=False)  # type: ignore[arg-type]
    with engine.connect() as conn, pytest.raises(InvalidArgument):
        Snowflake(conn, heartbeat=False)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        Snowflake(sessionmaker(engine), heartbeat=False)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        Snowflake(None, heartbeat=False)  # type: ignore[arg-type]
    assert _lease_count(engine) == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lease": timedelta(seconds=-60)},
        {"lease": timedelta(0)},
        {"lease": 60.0},
        {"lease": None},
        {"epoch_ms": -1},
        {"epoch_ms": True},
        {"epoch_ms": 1.5e12},
    ],
)
def test_bad_leases_and_epochs_are_invalid_argument(engine: Engine, kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        Snowflake(engine, heartbeat=False, **kwargs)
    assert _lease_count(engine) == 0


def test_a_huge_lease_either_is_refused_or_works(engine: Engine) -> None:
    """``lease=timedelta.max``: InvalidArgument up front, or a generator whose heartbeat keeps running."""
    errors: list[Any] = []
    previous = threading.excepthook
    threading.excepthook = errors.append
    try:
        try:
            ids = Snowflake(engine, namespace="huge", lease=timedelta.max)
        except InvalidArgument:
            return
        try:
            assert ids.next_id() > 0
            assert ids._thread is not None
            ids._thread.join(0.2)
            assert ids._thread.is_alive(), f"the heartbeat thread died: {errors}"
        finally:
            ids.close()
    finally:
        threading.excepthook = previous
    assert errors == []


def test_close_is_idempotent_and_a_closed_generator_issues_nothing(engine: Engine) -> None:
    with Snowflake(engine, namespace="closed") as ids:
        last = ids.next_id()
    ids.close()
    ids.close()
    for _ in range(2):
        with pytest.raises(InvalidArgument):
            ids.next_id()
    row = _row(engine, "closed", ids.worker_id)
    assert row.owner is None
    # the exact last millisecond is kept for the next holder
    assert row.last_ms == _parse(last)[0]
    with Snowflake(engine, namespace="closed", heartbeat=False) as again:
        assert again.worker_id == ids.worker_id and again.next_id() > last


def test_closing_many_generators_concurrently_releases_every_worker_id(engine: Engine) -> None:
    """32 generators closed at the same moment from 32 threads (each twice): every row released."""
    n = 32
    gens = [Snowflake(engine, namespace="bulkclose") for _ in range(n)]
    barrier = threading.Barrier(n)

    def close(g: Snowflake) -> None:
        g.next_id()
        barrier.wait(WAIT)
        g.close()
        g.close()

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(close, gens))
    rows = _rows(engine, "bulkclose")
    assert len(rows) == n and all(r.owner is None for r in rows)
    again = [Snowflake(engine, namespace="bulkclose", heartbeat=False) for _ in range(n)]
    assert sorted(g.worker_id for g in again) == list(range(n))
    for g in again:
        g.close()


def test_twelve_takers_of_one_expired_worker_id_on_a_server(server: Backend) -> None:
    """12 threads with their own engines race for worker ids while the only expired one is free."""
    engine = server.engine
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
    engines = [server.new_engine(pool_size=1) for _ in range(n)]

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
