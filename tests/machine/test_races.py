"""Real races on every backend: many threads or processes, released together by a barrier,
fire at the same rows; the database must pick exactly one winner per row (or per version)
and every side effect, written in the winner's own transaction, must exist exactly once.

Threads share the test's engine (a pool of 32 connections); processes fork from
the clean fork server of tests/_support/processes.py (a ``fork`` of this multi-threaded
interpreter is unsafe and warns) and build their own engine from ``backend.url``.
"""

from __future__ import annotations

import queue as queue_mod
import random
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from sqlalchemy import Engine, event, select
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from stateguard import Outcome, Result, SerializationConflict, retry_on_conflict
from stateguard._kernel import classify_db_error
from tests._support import workers as w
from tests._support.models import ORDER_TRANSITIONS, Base, Order
from tests._support.processes import worker_context
from tests.conftest import Backend, capable

N_ROWS = 20
N_THREADS = 16
N_PROCESSES = 4
KEYS = list(range(1, N_ROWS + 1))
JOIN_TIMEOUT = 120.0


def _graph(transitions: Sequence[Any]) -> dict[tuple[str, str], str]:
    """(trigger, source) -> dest, read straight from the declaration (not from stateguard)."""
    edges: dict[tuple[str, str], str] = {}
    for t in transitions:
        trigger, source, dest = (t["trigger"], t["source"], t["dest"]) if isinstance(t, dict) else t
        for s in [source] if isinstance(source, str) else source:
            edges[(trigger, s)] = dest
    return edges


GRAPH = _graph(ORDER_TRANSITIONS)
DESTS = {trigger: {d for (t, _), d in GRAPH.items() if t == trigger} for trigger, _ in GRAPH}


def _setup(backend: Backend, status: str = "pending") -> Engine:
    engine = backend.create(Base.metadata, w.EffectBase.metadata)
    with Session(engine) as s, s.begin():
        s.add_all([Order(id=k, status=status) for k in KEYS])
    return engine


def _run_threads(n: int, work: Callable[[str, threading.Barrier, int], w.Report]) -> list[w.Report]:
    """Start ``n`` threads that block on one barrier; return their reports (or re-raise a failure)."""
    barrier = threading.Barrier(n)
    reports: list[w.Report | None] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            reports[i] = work(f"t{i}", barrier, i)
        except BaseException as error:
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    if errors:
        raise errors[0]
    return [r for r in reports if r is not None]


def _run_processes(backend: Backend, n: int, kind: str, args: Sequence[tuple[Any, ...]]) -> list[w.Report]:
    """Start ``n`` separate processes (own engines) behind one barrier; collect their reports."""
    ctx = worker_context()
    barrier = ctx.Barrier(n)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=w.process_main,
            args=(kind, backend.name, backend.url, f"p{i}", barrier, results, 1000 + i, args[i]),
        )
        for i in range(n)
    ]
    for p in procs:
        p.start()
    got: list[tuple[str, str | None, w.Report | None]] = []
    try:
        for _ in procs:
            got.append(results.get(timeout=JOIN_TIMEOUT))
    except queue_mod.Empty:  # pragma: no cover - only when a child died without reporting
        pytest.fail(f"a worker process did not report; exit codes {[p.exitcode for p in procs]}")
    finally:
        for p in procs:
            p.join(JOIN_TIMEOUT)
            if p.is_alive():  # pragma: no cover
                p.kill()
                p.join()
        results.close()
        results.join_thread()
    errors = [tb for _, tb, _ in got if tb is not None]
    assert not errors, "\n".join(errors)
    assert [p.exitcode for p in procs] == [0] * n
    return [r for _, _, r in got if r is not None]


def _calls(reports: list[w.Report]) -> list[w.Call]:
    return [c for r in reports for c in r.calls]


def _effects(engine: Engine) -> Counter[tuple[int, str, int | None]]:
    with Session(engine) as s:
        rows = s.execute(select(w.Effect.order_id, w.Effect.what, w.Effect.version)).all()
    return Counter((k, what, v) for k, what, v in rows)


def _rows(engine: Engine) -> dict[int, tuple[str, int]]:
    with Session(engine) as s:
        return {k: (st, v) for k, st, v in s.execute(select(Order.id, Order.status, Order.version))}


def _check_known_version(backend: Backend, calls: list[w.Call]) -> None:
    # PostgreSQL and SQLite return the new version with RETURNING; MariaDB
    # hands it back through LAST_INSERT_ID: every APPLIED call must know it.
    assert all(c.version is not None for c in calls if c.outcome == "APPLIED"), backend.name


def _assert_one_winner_per_row(backend: Backend, engine: Engine, calls: list[w.Call], workers: int) -> None:
    """Every row: one APPLIED (to paid, version 2), the rest REPEATED, one side effect."""
    per_row: dict[int, Counter[str]] = defaultdict(Counter)
    for c in calls:
        per_row[c.key][c.outcome] += 1
    assert per_row == {k: Counter({"APPLIED": 1, "REPEATED": workers - 1}) for k in KEYS}
    _check_known_version(backend, calls)
    assert {(c.state, c.version) for c in calls} == {("paid", 2)}
    assert _effects(engine) == Counter({(k, "pay", 2): 1 for k in KEYS})
    assert _rows(engine) == {k: ("paid", 2) for k in KEYS}


def test_16_threads_fire_the_same_trigger_at_the_same_rows_once(backend: Backend) -> None:
    """16 threads pay the same 20 orders at once: one APPLIED and one side effect per order, the rest
    REPEATED."""
    engine = _setup(backend)
    plan = [(k, "pay", None) for k in KEYS]
    reports = _run_threads(N_THREADS, lambda name, b, i: w.fire_storm(engine, name, b, i, plan))
    _assert_one_winner_per_row(backend, engine, _calls(reports), N_THREADS)
    if capable(backend, "update_rechecks_where"):
        # READ COMMITTED: a waiting UPDATE re-checks its WHERE against the
        # committed row, so losers see 0 rows instead of an error.
        assert sum(r.conflicts for r in reports) == 0


def test_4_processes_fire_the_same_trigger_at_the_same_rows_once(backend: Backend) -> None:
    """4 processes with their own engines pay the same 20 orders at once: one APPLIED and one side effect
    per order, the rest REPEATED."""
    engine = _setup(backend)
    plan = [(k, "pay", None) for k in KEYS]
    reports = _run_processes(backend, N_PROCESSES, "fire", [(plan,)] * N_PROCESSES)
    assert len(reports) == N_PROCESSES
    _assert_one_winner_per_row(backend, engine, _calls(reports), N_PROCESSES)


def _assert_one_winner_per_version(
    backend: Backend, engine: Engine, calls: list[w.Call], workers: int, rounds: int
) -> None:
    """Every (row, round): one APPLIED that bumped the version by one, the rest STALE finding that version."""
    by_slot: dict[tuple[int, int], list[w.Call]] = defaultdict(list)
    for c in calls:
        by_slot[(c.key, c.round)].append(c)
    assert set(by_slot) == {(k, r) for k in KEYS for r in range(rounds)}
    for (key, rnd), slot in by_slot.items():
        expected = 1 + rnd  # ORM inserts start at version 1
        assert {c.expected_version for c in slot} == {expected}, (key, rnd)
        assert Counter(c.outcome for c in slot) == {"APPLIED": 1, "STALE": workers - 1}, (key, rnd)
        # Every loser found exactly the winner's version: nobody else wrote in this round.
        assert {c.version for c in slot} == {expected + 1}, (key, rnd)
    assert _effects(engine) == Counter({(k, "note", 2 + r): 1 for k in KEYS for r in range(rounds)})
    assert {v for _, v in _rows(engine).values()} == {1 + rounds}


def test_16_threads_with_the_same_read_version_have_one_winner_per_version(backend: Backend) -> None:
    """16 threads read each row's version, then guarded_update with it, for 3 rounds: one APPLIED per row
    and round, the rest STALE."""
    engine = _setup(backend)
    rounds = 3
    reports = _run_threads(N_THREADS, lambda name, b, i: w.version_storm(engine, name, b, i, KEYS, rounds))
    _assert_one_winner_per_version(backend, engine, _calls(reports), N_THREADS, rounds)


def test_4_processes_with_the_same_read_version_have_one_winner_per_version(backend: Backend) -> None:
    """4 processes read the same versions, then guarded_update with them, for 2 rounds: one APPLIED per row
    and round, the rest STALE."""
    engine = _setup(backend)
    rounds = 2
    reports = _run_processes(backend, N_PROCESSES, "version", [(KEYS, rounds)] * N_PROCESSES)
    _assert_one_winner_per_version(backend, engine, _calls(reports), N_PROCESSES, rounds)


def test_version_checked_triggers_have_one_winner_per_version(backend: Backend) -> None:
    """16 threads fire pay or cancel with the version they all read: one APPLIED per row; the losers are
    REPEATED (same trigger), STALE (cancel after pay) or REJECTED (pay after cancel)."""
    engine = _setup(backend)
    versions = w.read_versions(engine, KEYS)
    assert set(versions.values()) == {1}

    def work(name: str, barrier: threading.Barrier, i: int) -> w.Report:
        trigger = "pay" if i % 2 == 0 else "cancel"
        return w.fire_storm(engine, name, barrier, i, [(k, trigger, versions[k]) for k in KEYS])

    calls = _calls(_run_threads(N_THREADS, work))
    _check_known_version(backend, calls)
    rows = _rows(engine)
    winners = {}
    for key in KEYS:
        mine = [c for c in calls if c.key == key]
        applied = [c for c in mine if c.outcome == "APPLIED"]
        assert len(applied) == 1, (key, mine)
        win = applied[0]
        winners[key] = win.trigger
        dest = GRAPH[(win.trigger, "pending")]
        assert (win.state, win.version) == (dest, 2)
        assert rows[key] == (dest, 2)
        for c in mine:
            if c is win:
                continue
            if c.trigger == win.trigger:
                want = "REPEATED"  # the row is already in this trigger's dest
            elif (c.trigger, dest) in GRAPH:
                want = "STALE"  # the state allows it, the version does not
            else:
                want = "REJECTED"  # the state does not allow it
            assert (c.outcome, c.state, c.version) == (want, dest, 2), (key, c)
    assert _effects(engine) == Counter({(k, t, 2): 1 for k, t in winners.items()})


def test_16_thread_storm_runs_one_after_commit_callback_per_row(backend: Backend) -> None:
    """16 threads pay the same rows, registering on_commit on every result and rolling back half their wins:
    exactly one callback per row runs, after its commit, and rolled-back wins run none."""
    engine = _setup(backend)
    lock = threading.Lock()
    callbacks: list[tuple[int, str, str]] = []
    rolled_back: list[int] = []

    class RollBack(Exception):
        pass

    def callback(key: int, outcome: Outcome) -> None:
        # Runs after the commit, on a fresh connection: the row must already be committed as paid.
        with engine.connect() as conn:
            seen = conn.execute(select(Order.status).where(Order.id == key)).scalar_one()
        with lock:
            callbacks.append((key, outcome.name, seen))

    def work(name: str, barrier: threading.Barrier, i: int) -> w.Report:
        rnd = random.Random(i)
        keys = list(KEYS)
        rnd.shuffle(keys)
        calls: list[w.Call] = []
        conflicts = 0
        barrier.wait(w.BARRIER_TIMEOUT)
        for key in keys:
            while True:
                roll_back = rnd.random() < 0.5

                def unit(key: int = key, roll_back: bool = roll_back) -> Result:
                    with Session(engine) as s, s.begin():
                        r = Order.flow.pay(s, key)
                        r.on_commit(callback, key, r.outcome)
                        if r.applied:
                            s.add(w.Effect(order_id=key, what="pay", worker=name, version=r.version))
                            if roll_back:
                                raise RollBack
                        return r

                try:
                    r, c = w.retry_conflicts(unit)
                except RollBack:
                    with lock:
                        rolled_back.append(key)
                    continue  # the row is pending again: fire again
                conflicts += c
                calls.append(w._call(name, "pay", r))
                break
        return w.Report(calls, conflicts)

    calls = _calls(_run_threads(N_THREADS, work))
    assert rolled_back, "no win was rolled back: the rollback path was not exercised"
    assert sorted(callbacks) == [(k, "APPLIED", "paid") for k in KEYS]
    assert Counter(c.outcome for c in calls) == {"APPLIED": N_ROWS, "REPEATED": N_ROWS * (N_THREADS - 1)}
    assert _effects(engine) == Counter({(k, "pay", 2): 1 for k in KEYS})
    assert _rows(engine) == {k: ("paid", 2) for k in KEYS}


def _assert_consistent_with_graph(backend: Backend, engine: Engine, calls: list[w.Call]) -> None:
    """Replay each row's APPLIED calls in version order through the declared graph."""
    _check_known_version(backend, calls)
    rows = _rows(engine)
    applied = [c for c in calls if c.outcome == "APPLIED"]
    pairs = Counter((c.key, c.trigger) for c in applied)
    assert max(pairs.values()) == 1, [p for p, n in pairs.items() if n > 1]
    for key in KEYS:
        mine = sorted((c for c in applied if c.key == key), key=lambda c: c.version or 0)
        state = "pending"
        assert [c.version for c in mine] == list(range(2, 2 + len(mine))), (key, mine)
        for c in mine:
            assert (c.trigger, state) in GRAPH, (key, state, c)
            state = GRAPH[(c.trigger, state)]
            assert c.state == state
        assert rows[key] == (state, 1 + len(mine)), key
    for c in calls:
        # What a losing call found must be a reason to lose, according to the graph.
        if c.outcome == "REPEATED":
            assert c.state in DESTS[c.trigger], c
        elif c.outcome == "REJECTED":
            assert c.state not in DESTS[c.trigger] and (c.trigger, c.state) not in GRAPH, c
        else:
            assert c.outcome == "APPLIED", c
    assert _effects(engine) == Counter((c.key, c.trigger, c.version) for c in applied)


def test_mixed_trigger_storm_from_16_threads_keeps_the_graph(backend: Backend) -> None:
    """16 threads fire random pay/ship/cancel at shared orders: each row's applied transitions form a path of
    the graph ending in its final state, each (order, trigger) applies at most once, one side effect each."""
    engine = _setup(backend)
    reports = _run_threads(N_THREADS, lambda name, b, i: w.mixed_storm(engine, name, b, i, KEYS, 40))
    calls = _calls(reports)
    assert len(calls) == N_THREADS * 40
    _assert_consistent_with_graph(backend, engine, calls)
    assert Counter(c.outcome for c in calls)["REJECTED"] > 0  # the storm really hit forbidden edges


def test_mixed_trigger_storm_from_4_processes_keeps_the_graph(backend: Backend) -> None:
    """4 processes fire random pay/ship/cancel at shared orders: each row's applied transitions replay
    through the graph to its final state, with one side effect each."""
    engine = _setup(backend)
    reports = _run_processes(backend, N_PROCESSES, "mixed", [(KEYS, 40)] * N_PROCESSES)
    _assert_consistent_with_graph(backend, engine, _calls(reports))


@pytest.mark.restart
@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_postgresql_snapshot_isolation_storm_retries_instead_of_crashing(pg: Backend, isolation: str) -> None:
    """At REPEATABLE READ / SERIALIZABLE on PostgreSQL, 16 threads each read then pay or cancel the same rows
    inside retry_on_conflict: serialization failures become retries, and the graph and side effects hold."""
    _setup(pg)
    engine = pg.new_engine(isolation_level=isolation)
    lock = threading.Lock()
    conflicts: list[str] = []

    def work(name: str, barrier: threading.Barrier, i: int) -> w.Report:
        rnd = random.Random(i)
        plan = [(k, t) for k in KEYS for t in ("pay", "pay", "ship", "cancel")]
        rnd.shuffle(plan)
        calls: list[w.Call] = []
        barrier.wait(w.BARRIER_TIMEOUT)
        for key, trigger in plan[:30]:

            def unit(key: int = key, trigger: str = trigger) -> Result:
                try:
                    with Session(engine) as s, s.begin():
                        # Take the snapshot first, as read-modify-write code does.
                        s.execute(select(Order.version).where(Order.id == key)).all()
                        r = Order.flow.fire(s, trigger, key)
                        if r.applied:
                            s.add(w.Effect(order_id=key, what=trigger, worker=name, version=r.version))
                        return r
                except SerializationConflict as error:
                    assert error.retryable and error.__cause__ is not None
                    with lock:
                        conflicts.append("statement")
                    raise
                except sa_exc.DBAPIError as error:
                    # Only COMMIT may fail with a raw driver error (at SERIALIZABLE), and
                    # only with a serialization failure that retry_on_conflict recognises.
                    assert classify_db_error(error) is SerializationConflict, error
                    with lock:
                        conflicts.append("commit")
                    raise

            r = retry_on_conflict(unit, attempts=100, backoff=0.001, max_backoff=0.05)
            calls.append(w._call(name, trigger, r))
        return w.Report(calls, 0)

    try:
        calls = _calls(_run_threads(N_THREADS, work))
    finally:
        engine.dispose()
    assert "statement" in conflicts, "no serialization failure happened: the race was not created"
    assert len(calls) == N_THREADS * 30
    _assert_consistent_with_graph(pg, pg.engine, calls)


def test_postgresql_read_committed_miss_then_concurrent_commit_is_not_a_false_rejection(pg: Backend) -> None:
    """At READ COMMITTED, when another transaction commits pay between ship's UPDATE (which saw 'pending')
    and ship's follow-up read (which sees 'paid'), ship runs its UPDATE again and applies instead of
    reporting REJECTED with a state that allows it."""
    _setup(pg)
    ship_engine = pg.new_engine()
    other = Session(pg.engine)
    try:
        other.begin()
        assert Order.flow.pay(other, 1).applied  # uncommitted: ship's snapshot still sees 'pending'
        committed: list[str] = []

        @event.listens_for(ship_engine, "after_cursor_execute")
        def commit_pay_after_the_first_update(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            if statement.startswith("UPDATE") and not committed:
                assert cursor.rowcount == 0  # the UPDATE did not see the row as 'paid'
                committed.append(statement)
                other.commit()

        with Session(ship_engine) as s, s.begin():
            r = Order.flow.ship(s, 1)
        assert committed, "the race was not created"
        assert (r.outcome, r.state, r.version) == (Outcome.APPLIED, "shipped", 3)
        assert _rows(pg.engine)[1] == ("shipped", 3)
    finally:
        other.close()
        ship_engine.dispose()
