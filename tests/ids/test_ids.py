"""Request ids (stateguard.ids): UUIDv7 and leased Snowflake ids on every backend.

The races are real: several separate processes (tests/_support/id_workers.py) start
behind a barrier, and where the interesting moment is a single statement
(every process inserting the same worker row, every taker claiming the same
expired lease) an engine event holds each process just before sending it,
so they all send it together.  Clocks that move are injected: the
generator's sleeps then move the injected clock instead of sleeping.
"""

from __future__ import annotations

import itertools
import os
import pickle
import threading
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from datetime import timedelta
from queue import Empty
from typing import Any

import pytest
from sqlalchemy import Engine, insert, select
from sqlalchemy.dialects import mysql

from stateguard import (
    InvalidArgument,
    Snowflake,
    StateguardError,
    WorkerIdsExhausted,
    WorkerLeaseLost,
    new_request_id,
)
from stateguard import ids as ids_module
from stateguard.tables import worker_leases
from tests._support import id_workers as w
from tests._support.id_workers import VirtualClock
from tests._support.processes import worker_context
from tests.conftest import Backend, count_statements

LEASE = timedelta(seconds=2)
#: Processes in the pool: the multi-process tests run this many at once.
PROCS = 5
#: How long a worker may wait for the others at a barrier.
WAIT = 60


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


@pytest.fixture(scope="module")
def procs() -> Iterator[tuple[Any, ProcessPoolExecutor]]:
    """PROCS separate worker processes, all started up front, and a manager for barriers and events."""
    ctx = worker_context()
    with ctx.Manager() as manager, ProcessPoolExecutor(PROCS, mp_context=ctx) as pool:
        barrier = manager.Barrier(PROCS, timeout=WAIT)
        pids = [f.result(timeout=2 * WAIT) for f in [pool.submit(w.ready, barrier) for _ in range(PROCS)]]
        assert len(set(pids)) == PROCS
        yield manager, pool


def _results(futures: list[Future[Any]]) -> list[Any]:
    return [f.result(timeout=2 * WAIT) for f in futures]


def _get(queue: Any, futures: list[Future[Any]]) -> Any:
    """The next item a worker puts on ``queue``; a worker's own error if one fails first."""
    deadline = time.monotonic() + WAIT
    while True:
        try:
            return queue.get(timeout=0.2)
        except Empty:
            for f in futures:
                if f.done():
                    f.result()  # raises the worker's error
            if time.monotonic() > deadline:
                raise


def _wait(barrier: Any, futures: list[Future[Any]]) -> None:
    """Join the workers at ``barrier``; if it breaks, raise the first worker's own error instead."""
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        _results(futures)
        raise


def _increasing(values: list[Any]) -> bool:
    return all(a < b for a, b in itertools.pairwise(values))


def _lease_row(engine: Engine, worker_id: int, namespace: str = "default") -> Any:
    with engine.connect() as conn:
        return conn.execute(
            select(worker_leases).where(
                worker_leases.c.namespace == namespace, worker_leases.c.worker_id == worker_id
            )
        ).one()


# --------------------------------------------------------------------------
# UUIDv7
# --------------------------------------------------------------------------


def test_uuid7_version_variant_and_timestamp() -> None:
    """Every id is an RFC 9562 version 7 UUID whose first 48 bits are the creation millisecond."""
    before = _now_ms()
    made = [new_request_id() for _ in range(1000)]
    after = _now_ms()
    for u in made:
        assert isinstance(u, uuid.UUID)
        assert u.version == 7 and u.variant == uuid.RFC_4122
        assert before <= u.int >> 80 <= after


def test_uuid7_ids_made_fast_are_strictly_increasing() -> None:
    """50,000 ids made in a tight loop (many per millisecond) sort in creation order, as ints and as text."""
    made = [new_request_id() for _ in range(50_000)]
    assert _increasing([u.int for u in made])
    texts = [str(u) for u in made]
    assert _increasing(texts)


@pytest.mark.limits
@pytest.mark.clock
def test_uuid7_counter_overflow_and_clock_going_back_keep_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock behind the last id, or a full counter, advances the timestamp instead of going back."""
    ahead = _now_ms() + 10_000
    monkeypatch.setattr(ids_module, "_v7_last_ms", ahead)
    monkeypatch.setattr(ids_module, "_v7_counter", (1 << 42) - 2)
    first, second, third = new_request_id(), new_request_id(), new_request_id()
    assert first.int >> 80 == ahead  # the clock is "behind": the timestamp stays, the counter counts
    assert second.int >> 80 == ahead + 1  # the counter overflowed: the next millisecond
    assert first.int < second.int < third.int
    assert all(u.version == 7 and u.variant == uuid.RFC_4122 for u in (first, second, third))


def test_uuid7_unique_across_threads() -> None:
    """Eight threads making ids at once never produce the same one, and each sees its own ids increase."""
    barrier = threading.Barrier(8)

    def make() -> list[int]:
        barrier.wait()
        return [new_request_id().int for _ in range(5000)]

    with ThreadPoolExecutor(8) as pool:
        runs = [f.result() for f in [pool.submit(make) for _ in range(8)]]
    assert len({i for run in runs for i in run}) == 40_000
    assert all(_increasing(run) for run in runs)


def test_uuid7_valid_unique_and_time_ordered_across_processes(procs: tuple[Any, ProcessPoolExecutor]) -> None:
    """Processes started together make valid v7 ids, increasing in each, unique, stamped with their time."""
    manager, pool = procs
    barrier = manager.Barrier(PROCS, timeout=WAIT)
    runs = _results([pool.submit(w.request_ids, 10_000, barrier) for _ in range(PROCS)])
    for before, made, after in runs:
        assert _increasing(made)
        for value in made:
            u = uuid.UUID(int=value)
            assert u.version == 7 and u.variant == uuid.RFC_4122
            assert before <= value >> 80 <= after
    assert len({i for _, made, _ in runs for i in made}) == PROCS * 10_000


# --------------------------------------------------------------------------
# Snowflake: one process
# --------------------------------------------------------------------------


def test_snowflake_ids_increase_and_carry_time_and_worker(engine: Engine) -> None:
    """Ids strictly increase, and parse back into the current millisecond, the worker id and a sequence."""
    before = _now_ms()
    with Snowflake(engine, namespace="orders") as ids:
        made = [ids.next_id() for _ in range(5000)]
        assert ids.worker_id == 0
    after = _now_ms()
    assert _increasing(made)
    assert all(0 < i < 1 << 63 for i in made)
    for i in made:
        ms, worker, _seq = Snowflake.parse(i)
        assert before <= ms <= after and worker == 0
    assert max(Counter(Snowflake.parse(i)[0] for i in made).values()) <= 4096


def test_snowflake_next_id_sends_no_sql_between_renewals(engine: Engine) -> None:
    """Between lease renewals next_id() is pure Python: no statement at all."""
    with Snowflake(engine, heartbeat=False) as ids, count_statements(engine) as c:
        for _ in range(1000):
            ids.next_id()
        assert len(c) == 0


def test_one_generator_shared_by_threads_gives_unique_ids(engine: Engine) -> None:
    """Eight threads sharing one generator get unique ids, each thread's in increasing order."""
    barrier = threading.Barrier(8)
    with Snowflake(engine, heartbeat=False) as ids:

        def make() -> list[int]:
            barrier.wait()
            return [ids.next_id() for _ in range(3000)]

        with ThreadPoolExecutor(8) as pool:
            runs = [f.result() for f in [pool.submit(make) for _ in range(8)]]
    assert len({i for run in runs for i in run}) == 24_000
    assert all(_increasing(run) for run in runs)


def test_live_generators_get_distinct_worker_ids_and_release_them(engine: Engine) -> None:
    """Live generators hold ids 0, 1, 2; a closed one's id goes to the next, which continues after it."""
    gens = [Snowflake(engine, namespace="n", heartbeat=False) for _ in range(3)]
    try:
        assert [g.worker_id for g in gens] == [0, 1, 2]
        last = [gens[1].next_id() for _ in range(100)][-1]
        gens[1].close()
        row = _lease_row(engine, 1, "n")
        assert row.owner is None and row.last_ms == Snowflake.parse(last)[0]
        with Snowflake(engine, namespace="n", heartbeat=False) as again:
            assert again.worker_id == 1
            assert again.next_id() > last
        with Snowflake(engine, namespace="other", heartbeat=False) as elsewhere:
            assert elsewhere.worker_id == 0  # namespaces are independent
    finally:
        for g in gens:
            g.close()


@pytest.mark.clock
def test_clock_moving_back_waits_instead_of_going_back(engine: Engine) -> None:
    """When the clock steps back an hour, next_id() waits (on the injected sleep) until it catches up."""
    clock = VirtualClock()
    with Snowflake(engine, heartbeat=False, _clock=clock, _sleep=clock.sleep) as ids:
        before = [ids.next_id() for _ in range(100)]
        clock.offset_ms -= 3_600_000
        started = time.monotonic()
        after = [ids.next_id() for _ in range(100)]
        real = time.monotonic() - started
    last_ms = Snowflake.parse(before[-1])[0]
    assert _increasing(before + after)
    assert all(Snowflake.parse(i)[0] >= last_ms for i in after)
    assert clock.slept_ms >= 3_590_000  # it waited out the step...
    assert Snowflake.parse(after[0])[0] - last_ms < 100  # ...rather than jumping ahead
    assert real < 5  # on the injected sleep, not a real one


def test_a_full_millisecond_waits_for_the_next_one(engine: Engine) -> None:
    """With the clock standing still, the 4097th id waits for the next millisecond (sequence 0 again)."""
    clock = VirtualClock()  # only its sleep and slept_ms are used
    frozen = _now_ms()

    def still() -> int:
        return frozen + int(clock.slept_ms)  # moves only when the generator sleeps

    with Snowflake(engine, heartbeat=False, _clock=still, _sleep=clock.sleep) as ids:
        made = [ids.next_id() for _ in range(4097)]
    parsed = [Snowflake.parse(i) for i in made]
    assert [p[0] for p in parsed[:4096]] == [frozen] * 4096
    assert [p[2] for p in parsed[:4096]] == list(range(4096))
    assert parsed[4096][0] == frozen + 1 and parsed[4096][2] == 0
    assert 1 <= clock.slept_ms < 2
    assert _increasing(made)


def test_a_new_holder_in_the_same_millisecond_does_not_repeat_the_last_ids(engine: Engine) -> None:
    """A worker id leased again within the same millisecond continues after the previous holder's ids."""
    clock = VirtualClock()  # only its sleep and slept_ms are used
    frozen = _now_ms()

    def still() -> int:
        return frozen + int(clock.slept_ms)

    with Snowflake(engine, heartbeat=False, _clock=still, _sleep=clock.sleep) as first:
        made = [first.next_id() for _ in range(10)]
    with Snowflake(engine, heartbeat=False, _clock=still, _sleep=clock.sleep) as second:
        assert second.worker_id == first.worker_id
        again = second.next_id()
    assert Snowflake.parse(made[-1])[0] == frozen
    assert again > made[-1] and Snowflake.parse(again)[0] == frozen + 1


def test_an_expired_lease_is_taken_over_and_the_old_holder_stops(engine: Engine) -> None:
    """A new generator takes an expired lease and starts after it; the old holder gets WorkerLeaseLost."""
    clock = VirtualClock()
    lease = timedelta(seconds=1)
    old = Snowflake(engine, lease=lease, heartbeat=False, _clock=clock)
    old_ids = [old.next_id() for _ in range(50)]
    horizon = _lease_row(engine, 0).last_ms
    assert horizon >= Snowflake.parse(old_ids[-1])[0] + 500  # the old holder's clock + its lease
    time.sleep(1.1)  # the old holder "paused" past its lease (the database's clock decides)
    late = VirtualClock(clock.offset_ms)
    with Snowflake(engine, lease=LEASE, heartbeat=False, _clock=late, _sleep=late.sleep) as new:
        assert new.worker_id == old.worker_id == 0
        # The taker's clock then steps back 3 s, before the old holder's ids: it must
        # still start after the horizon the old holder stored, the last millisecond it could use.
        late.offset_ms -= 3000
        first = new.next_id()
        assert first > old_ids[-1]
        assert Snowflake.parse(first)[0] > horizon
        assert late.slept_ms > 0
        with pytest.raises(WorkerLeaseLost) as lost:
            old.next_id()
        assert lost.value.worker_id == 0 and lost.value.namespace == "default"
        with pytest.raises(WorkerLeaseLost):
            old.next_id()  # and it stays stopped
        old.close()  # releases nothing: the worker id is the new holder's
        assert _lease_row(engine, 0).owner == new._owner
        with Snowflake(engine, lease=LEASE, heartbeat=False, _clock=clock) as third:
            assert third.worker_id == 1


def test_a_renewed_lease_is_not_taken_over(engine: Engine) -> None:
    """next_id() renews a due lease with one UPDATE, so the worker id stays its own past the first lease."""
    clock = VirtualClock()
    with Snowflake(engine, lease=LEASE, heartbeat=False, _clock=clock) as ids:
        ids.next_id()
        clock.offset_ms += 1000  # past a third of the lease: renewal is due
        with count_statements(engine) as c:
            ids.next_id()
        assert [s.split()[0] for s in c.statements] == ["UPDATE"]
        clock.offset_ms += 1500  # past the first lease's end, within the renewed one
        with Snowflake(engine, lease=LEASE, heartbeat=False, _clock=clock) as other:
            assert other.worker_id == 1
        assert ids.next_id() > 0


def test_the_heartbeat_renews_an_idle_generator(engine: Engine) -> None:
    """With no next_id() calls, the daemon thread still extends the lease in the table."""
    with Snowflake(engine, lease=timedelta(seconds=1)) as ids:
        first = _lease_row(engine, ids.worker_id).lease_expires_ms
        deadline = time.monotonic() + 3
        while _lease_row(engine, ids.worker_id).lease_expires_ms == first:
            assert time.monotonic() < deadline, "the lease was never renewed"
            time.sleep(0.05)
    assert _lease_row(engine, ids.worker_id).owner is None


def test_all_1024_worker_ids_live_is_a_typed_error(engine: Engine) -> None:
    """With all 1024 worker ids of a namespace live, a new generator raises WorkerIdsExhausted."""
    far = _now_ms() + 600_000
    rows = [
        {"namespace": "full", "worker_id": i, "owner": f"o{i}", "lease_expires_ms": far, "last_ms": 0}
        for i in range(1024)
    ]
    with engine.begin() as conn:
        conn.execute(insert(worker_leases), rows)
    with pytest.raises(WorkerIdsExhausted) as full:
        Snowflake(engine, namespace="full", heartbeat=False)
    assert full.value.retryable and full.value.namespace == "full"
    with engine.begin() as conn:
        conn.execute(
            worker_leases.update()
            .where(worker_leases.c.namespace == "full", worker_leases.c.worker_id == 700)
            .values(lease_expires_ms=1)
        )
    with Snowflake(engine, namespace="full", heartbeat=False) as ids:
        assert ids.worker_id == 700


@pytest.mark.hostile
@pytest.mark.parametrize(
    "kwargs",
    [
        {"namespace": ""},
        {"namespace": "x" * 101},
        {"namespace": 5},
        {"namespace": "orders\x00"},
        {"namespace": "orders\udc80"},
        {"lease": timedelta(milliseconds=500)},
        {"lease": 60},
        {"epoch_ms": _now_ms() + 10**9},
        {"epoch_ms": "2024"},
    ],
)
def test_bad_arguments_are_typed_and_send_nothing(engine: Engine, kwargs: dict[str, Any]) -> None:
    """Bad namespaces, leases and epochs raise InvalidArgument before any SQL."""
    with count_statements(engine) as c, pytest.raises(InvalidArgument):
        Snowflake(engine, **kwargs)
    assert len(c) == 0
    with pytest.raises(InvalidArgument):
        Snowflake("sqlite://")  # type: ignore[arg-type]


def test_a_closed_generator_issues_nothing(engine: Engine) -> None:
    """After close() (idempotent) next_id() raises, and the worker row is released."""
    ids = Snowflake(engine, heartbeat=False)
    ids.close()
    ids.close()
    with pytest.raises(InvalidArgument):
        ids.next_id()
    assert _lease_row(engine, ids.worker_id).owner is None
    assert issubclass(WorkerLeaseLost, StateguardError) and repr(ids).startswith("<Snowflake")


def test_a_forked_copy_issues_no_ids_and_leaves_the_lease(engine: Engine) -> None:
    """A generator copied into a forked child refuses next_id(), and its close() there releases nothing."""
    with Snowflake(engine, heartbeat=False) as ids:
        parent_id = ids.next_id()
        with warnings.catch_warnings():
            # Python 3.12+ warns about forking a process with threads; the child
            # only calls next_id() and close() (no lock another thread could hold).
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                try:
                    ids.next_id()
                    code = 2
                except InvalidArgument as error:
                    code = 0 if "forked" in str(error) else 3
                ids.close()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert _lease_row(engine, ids.worker_id).owner == ids._owner
        assert ids.next_id() > parent_id


def test_errors_survive_pickling() -> None:
    """WorkerLeaseLost and WorkerIdsExhausted come back from pickle (a process pool) with their fields."""
    lost = pickle.loads(pickle.dumps(WorkerLeaseLost("gone", namespace="n", worker_id=7)))
    assert type(lost) is WorkerLeaseLost and str(lost) == "gone"
    assert (lost.namespace, lost.worker_id) == ("n", 7)
    full = pickle.loads(pickle.dumps(WorkerIdsExhausted("full", namespace="m")))
    assert type(full) is WorkerIdsExhausted and str(full) == "full" and full.namespace == "m"


@pytest.mark.clock
def test_claim_judges_the_lease_on_the_database_clock_and_the_last_ms_it_read() -> None:
    """The claim judges and sets lease_expires_ms on the server clock and matches only the last_ms it read."""
    sql = str(ids_module._CLAIM.compile(dialect=mysql.dialect()))
    assert "lease_expires_ms < (TIMESTAMPDIFF(MICROSECOND" in sql
    assert "lease_expires_ms=((TIMESTAMPDIFF(MICROSECOND" in sql
    assert "last_ms = %s" in sql


# --------------------------------------------------------------------------
# Snowflake: several processes
# --------------------------------------------------------------------------


def test_live_processes_never_share_a_worker_id(
    backend: Backend, engine: Engine, procs: tuple[Any, ProcessPoolExecutor]
) -> None:
    """Processes inserting the same worker row at once hold distinct worker ids; ids unique, increasing."""
    manager, pool = procs
    first_insert = manager.Barrier(PROCS, timeout=WAIT)
    live = manager.Barrier(PROCS + 1, timeout=WAIT)
    checked = manager.Barrier(PROCS + 1, timeout=WAIT)
    futures = [
        pool.submit(w.live_generator, backend.name, backend.url, "race", 2000, first_insert, live, checked)
        for _ in range(PROCS)
    ]
    _wait(live, futures)
    try:  # every process holds its lease now
        with engine.connect() as conn:
            rows = conn.execute(select(worker_leases).where(worker_leases.c.namespace == "race")).all()
        now = _now_ms()
    finally:
        _wait(checked, futures)
    runs = _results(futures)
    assert sorted(row.worker_id for row in rows) == list(range(PROCS))
    assert len({row.owner for row in rows if row.owner is not None}) == PROCS
    assert all(row.lease_expires_ms > now for row in rows)
    assert sorted(worker for worker, _ in runs) == list(range(PROCS))
    assert len({i for _, made in runs for i in made}) == PROCS * 4000
    for worker, made in runs:
        assert _increasing(made)
        assert {Snowflake.parse(i)[1] for i in made} == {worker}


def test_an_expired_lease_is_taken_over_by_exactly_one_of_several_takers(
    backend: Backend, engine: Engine, procs: tuple[Any, ProcessPoolExecutor]
) -> None:
    """Takers claim a stalled holder's expired lease at once: one gets it, the holder gets WorkerLeaseLost."""
    manager, pool = procs
    takers = PROCS - 1
    paused, taken = manager.Queue(), manager.Queue()
    resume, done = manager.Event(), manager.Event()
    start = manager.Barrier(takers + 1, timeout=WAIT)
    claim_race = manager.Barrier(takers, timeout=WAIT)
    holder = pool.submit(w.stalled_holder, backend.name, backend.url, "handover", 500, paused, resume)
    futures = [
        pool.submit(
            w.taker, backend.name, backend.url, "handover", 500, start, claim_race, taken, resume, done
        )
        for _ in range(takers)
    ]
    everyone: list[Future[Any]] = [holder, *futures]
    try:
        worker = _get(paused, everyone)
        # The holder no longer renews: its lease (1 s) runs out.
        deadline = time.monotonic() + 10
        while _lease_row(engine, worker, "handover").lease_expires_ms >= _now_ms():
            assert time.monotonic() < deadline, "the stalled holder's lease never expired"
            time.sleep(0.02)
        _wait(start, everyone)
        holders = sorted(_get(taken, everyone) for _ in range(takers))
        resume.set()  # the holder wakes up while the takers keep making ids
        holder_worker, before, after, lost = holder.result(timeout=WAIT)
        row = _lease_row(engine, worker, "handover")  # after the old holder's close()
    finally:
        resume.set()
        done.set()
    runs = _results(futures)

    assert holder_worker == worker == 0
    assert lost and after == []
    assert holders == sorted(w for w, _ in runs) == list(range(takers))  # exactly one took worker 0
    assert row.owner is not None and row.lease_expires_ms > _now_ms()  # still the successor's
    successor = next(made for w, made in runs if w == worker)
    assert min(successor) > max(before)
    every = before + [i for _, made in runs for i in made]
    assert len(set(every)) == len(every) == 500 + takers * 1000
    assert all(_increasing(made) for _, made in runs)


@pytest.mark.clock
def test_clock_stepping_back_in_several_processes_never_gives_a_smaller_id(
    backend: Backend, engine: Engine, procs: tuple[Any, ProcessPoolExecutor]
) -> None:
    """Processes whose clocks step back an hour wait (on the injected sleep) rather than issue smaller ids."""
    manager, pool = procs
    start = manager.Barrier(PROCS, timeout=WAIT)
    live = manager.Barrier(PROCS, timeout=WAIT)
    step = 3_600_000
    runs = _results(
        [
            pool.submit(w.clock_steps_back, backend.name, backend.url, "clock", 1000, step, start, live)
            for _ in range(PROCS)
        ]
    )
    assert sorted(worker for worker, *_ in runs) == list(range(PROCS))
    assert len({i for _, made, *_ in runs for i in made}) == PROCS * 2000
    for _worker, made, split, slept, real in runs:
        assert _increasing(made)
        last_ms = Snowflake.parse(made[split - 1])[0]
        assert all(Snowflake.parse(i)[0] >= last_ms for i in made[split:])
        assert slept >= step - 10_000 and real < 5


@pytest.mark.clock
def test_a_new_holder_with_a_clock_behind_waits_past_the_previous_holders_ids(
    backend: Backend, engine: Engine, procs: tuple[Any, ProcessPoolExecutor]
) -> None:
    """New holders with clocks 10 minutes behind the previous holders' wait until past their stored ids."""
    manager, pool = procs

    def round_of(offset_ms: int) -> list[tuple[int, list[int], float]]:
        start = manager.Barrier(PROCS, timeout=WAIT)
        live = manager.Barrier(PROCS, timeout=WAIT)
        return _results(
            [
                pool.submit(
                    w.generate_with_offset, backend.name, backend.url, "behind", 1000, offset_ms, start, live
                )
                for _ in range(PROCS)
            ]
        )

    first = round_of(600_000)  # clocks 10 minutes fast; each generator closes
    second = round_of(0)  # correct clocks take the released worker ids over
    assert sorted(worker for worker, _, _ in first) == list(range(PROCS))
    assert sorted(worker for worker, _, _ in second) == list(range(PROCS))
    previous = {worker: made for worker, made, _ in first}
    for worker, made, slept in second:
        assert _increasing(made) and min(made) > max(previous[worker])
        assert slept >= 590_000  # it waited (on the injected sleep) for its clock to pass them
    assert all(slept == 0 for _, _, slept in first)
    every = [i for run in (first, second) for _, made, _ in run for i in made]
    assert len(set(every)) == len(every)
