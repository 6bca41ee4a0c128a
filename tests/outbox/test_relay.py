"""The relay's cycle (claim, publish, mark): every committed event published at least once, in id order
per key, relays sharing the work without waiting on each other, leases judged on the database's clock."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from stateguard import (
    AsyncRelay,
    CallableSink,
    InvalidArgument,
    OutboxEvent,
    Relay,
    create_tables,
    drop_tables,
    emit,
)
from stateguard.tables import outbox
from tests._support import outbox_workers as w
from tests._support.async_helpers import AsyncTarget
from tests._support.processes import worker_context

from ..conftest import Backend
from ._events import Recorder, emit_one, event_rows, wait_for_db_clock_past


def test_run_once_publishes_in_id_order_and_marks_them(backend: Backend, engine: Engine) -> None:
    """One batch takes the free events in id order, the sink gets them in that order, and they are marked."""
    ids = [emit_one(engine, "t", {"n": n}, key=f"k{n % 3}" if n % 4 else None) for n in range(12)]
    sink = Recorder()
    relay = Relay(engine, sink, batch=5)
    assert [relay.run_once() for _ in range(4)] == [5, 5, 2, 0]
    assert sink.ids == ids
    rows = event_rows(engine)
    assert all(r.published_ms is not None and r.attempts == 1 and r.claimed_until_ms is None for r in rows)


def test_a_failing_sink_leaves_the_batch_unpublished_and_free_at_once(
    backend: Backend, engine: Engine, hold: str
) -> None:
    """A sink that raises: nothing is marked, the claim is released (the locks with the rollback),
    the next run publishes it all."""
    ids = [emit_one(engine, "t", {"n": n}, key="k") for n in range(3)]

    def broken(events: Any) -> None:
        raise ConnectionError("broker down")

    with pytest.raises(ConnectionError):
        Relay(engine, CallableSink(broken), hold=hold).run_once()
    rows = event_rows(engine)
    # A lease counts the claim as an attempt; held locks count only what their transaction settled.
    tried = 1 if hold == "lease" else 0
    assert all(r.published_ms is None and r.claimed_until_ms is None and r.attempts == tried for r in rows)
    sink = Recorder()
    assert Relay(engine, sink, hold=hold).run_once() == 3
    assert sink.ids == ids
    assert all(r.attempts == tried + 1 and r.published_ms is not None for r in event_rows(engine))


def test_a_key_is_held_back_while_its_earlier_event_is_claimed_elsewhere(
    backend: Backend, engine: Engine, hold: str
) -> None:
    """While relay A publishes k's first event, relay B takes other keys but none of k's later events."""
    k1 = emit_one(engine, "t", {"n": 1}, key="k")
    k2 = emit_one(engine, "t", {"n": 2}, key="k")
    j1 = emit_one(engine, "t", {"n": 3}, key="j")
    entered, leave = threading.Event(), threading.Event()
    got_a: list[int] = []

    def slow(events: Any) -> None:
        got_a.extend(e.id for e in events)
        entered.set()
        assert leave.wait(60)

    relay_a = Relay(engine, CallableSink(slow), batch=1, hold=hold)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(relay_a.run_once)
        assert entered.wait(60)
        sink_b = Recorder()
        relay_b = Relay(engine, sink_b, hold=hold)
        assert relay_b.run_once() == 1 and sink_b.ids == [j1]
        assert relay_b.run_once() == 0, "k's second event must wait for the first to be marked"
        leave.set()
        assert future.result(60) == 1
    assert got_a == [k1]
    assert relay_b.run_once() == 1 and sink_b.ids == [j1, k2]


def test_a_relay_that_outlived_its_lease_cannot_mark_the_new_claim(backend: Backend, engine: Engine) -> None:
    """A's lease ends while it publishes; B claims the batch; A's late mark leaves B's claim unpublished."""
    ids = [emit_one(engine, "t", {"n": n}, key="k") for n in range(3)]
    entered_a, leave_a, entered_b, leave_b = (threading.Event() for _ in range(4))

    def blocking(entered: threading.Event, leave: threading.Event) -> CallableSink:
        def publish(events: Any) -> None:
            entered.set()
            assert leave.wait(60)

        return CallableSink(publish)

    relay_a = Relay(engine, blocking(entered_a, leave_a), lease=timedelta(milliseconds=300), hold="lease")
    relay_b = Relay(engine, blocking(entered_b, leave_b), lease=timedelta(seconds=60), hold="lease")
    with ThreadPoolExecutor(2) as pool:
        future_a = pool.submit(relay_a.run_once)
        assert entered_a.wait(60)
        wait_for_db_clock_past(engine, max(r.claimed_until_ms for r in event_rows(engine)))
        future_b = pool.submit(relay_b.run_once)
        assert entered_b.wait(60)
        leave_a.set()
        assert future_a.result(60) == 3  # A did hand them to its sink
        rows = event_rows(engine)
        assert all(r.published_ms is None and r.attempts == 2 for r in rows), "A's mark took B's claim"
        assert len({r.claimed_by for r in rows}) == 1
        leave_b.set()
        assert future_b.result(60) == 3
    assert [r.id for r in event_rows(engine) if r.published_ms is not None] == ids


@pytest.mark.parametrize("hold", ["locks"])
def test_a_relay_holding_locks_longer_than_its_lease_loses_them_and_cannot_mark(
    backend: Backend, engine: Engine, hold: str
) -> None:
    """hold="locks": A's publish outlasts its 300 ms lease, the server ends A's idle transaction, B
    claims and publishes the batch in order; A's mark fails and marks nothing.  (Only ``"locks"``:
    tests/conftest.py deselects it on the backends without the mode.)"""
    ids = [emit_one(engine, "t", {"n": n}, key="k") for n in range(3)]
    entered_a, leave_a = threading.Event(), threading.Event()

    def publish(events: Any) -> None:
        entered_a.set()
        assert leave_a.wait(60)

    relay_a = Relay(engine, CallableSink(publish), lease=timedelta(milliseconds=300), hold=hold)
    sink_b = Recorder()
    relay_b = Relay(engine, sink_b, hold=hold)
    with ThreadPoolExecutor(1) as pool:
        future_a = pool.submit(relay_a.run_once)
        assert entered_a.wait(60)
        assert relay_b.run_once() == 0, "A's locks hold the batch while its lease lasts"
        deadline = time.monotonic() + 30
        while relay_b.run_once() == 0:
            assert time.monotonic() < deadline, "A's transaction outlived its lease"
            time.sleep(0.05)
        assert sink_b.ids == ids
        leave_a.set()
        with pytest.raises(DBAPIError):
            future_a.result(60)
    rows = event_rows(engine)
    assert all(r.published_ms is not None and r.attempts == 1 for r in rows)


def test_topics_limit_a_relay_and_a_key_waits_for_its_other_topic(
    backend: Backend, engine: Engine, hold: str
) -> None:
    """A relay for topic A skips topic B, and a key's later A event waits until its B event is published."""
    a1 = emit_one(engine, "A", {}, key="k")
    b1 = emit_one(engine, "B", {}, key="k")
    a2 = emit_one(engine, "A", {}, key="k")
    a3 = emit_one(engine, "A", {}, key="other")
    only_a, only_b = Recorder(), Recorder()
    relay_a = Relay(engine, only_a, topics=["A"], hold=hold)
    relay_b = Relay(engine, only_b, topics=["B"], hold=hold)
    assert relay_a.run_once() == 2 and only_a.ids == [a1, a3]
    assert relay_a.run_once() == 0
    assert relay_b.run_once() == 1 and only_b.ids == [b1]
    assert relay_a.run_once() == 1 and only_a.ids == [a1, a3, a2]


def test_run_stops_when_the_event_is_set(backend: Backend, engine: Engine) -> None:
    """run() publishes what arrives and returns once stop_event is set."""
    sink, stop = Recorder(), threading.Event()
    relay = Relay(engine, sink)
    thread = threading.Thread(target=relay.run, args=(stop,), kwargs={"idle_sleep": 0.02})
    thread.start()
    try:
        ids = [emit_one(engine, "t", {"n": n}, key="k") for n in range(5)]
        deadline = time.monotonic() + 30
        while sink.ids != ids and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive() and sink.ids == ids


def test_bad_relay_options_are_invalid_argument(backend: Backend, engine: Engine) -> None:
    """A sink without publish, a zero batch, a non-timedelta lease or a str topics are refused."""
    bad: list[dict[str, Any]] = [
        {"batch": 0},
        {"batch": 10_001},
        {"lease": 30},
        {"topics": "A"},
        {"topics": []},
    ]
    bad += [{"hold": "rows"}, *([{"hold": "locks"}] if backend.name != "postgresql" else [])]
    for kwargs in bad:
        with pytest.raises(InvalidArgument):
            Relay(engine, Recorder(), **kwargs)
    with pytest.raises(InvalidArgument):
        Relay(engine, lambda events: None)


def _check_order(batches: list[list[tuple[str, int, str | None, int]]], ids: list[int]) -> None:
    seen = [item for batch in batches for item in batch]
    published = [event_id for _, event_id, _, _ in seen]
    assert sorted(published) == sorted(ids), "every event exactly once (no lease ended)"
    by_key: dict[str | None, list[tuple[int, int]]] = defaultdict(list)
    for _, event_id, key, at in seen:
        by_key[key].append((at, event_id))
    for key, items in by_key.items():
        if key is None:
            continue
        in_time = [event_id for _, event_id in sorted(items)]
        assert in_time == sorted(in_time), f"key {key}: published out of id order"


@pytest.mark.parametrize("holds", [["lease"], ["locks"], ["lease", "locks"]], ids=["lease", "locks", "mixed"])
def test_four_processes_and_four_threads_share_the_work_once_each_and_in_key_order(
    backend: Backend, engine: Engine, procs: tuple[Any, ProcessPoolExecutor], holds: list[str]
) -> None:
    """8 relays released by one barrier publish 400 events once each, each key's events in id order
    (holding leases, row locks, or half of them each; tests/conftest.py deselects "locks" and "mixed"
    on the backends without row-lock holding)."""
    manager, pool = procs
    with Session(engine) as session, session.begin():
        ids = [emit(session, "t", {"n": n}, key=None if n % 10 == 0 else f"key-{n % 13}") for n in range(400)]
    seen, barrier = manager.list(), manager.Barrier(8, timeout=120)
    futures = [
        pool.submit(
            w.relay_in_process,
            backend.name,
            backend.url,
            barrier,
            seen,
            f"p{i}",
            7,
            0.004,
            holds[i % len(holds)],
        )
        for i in range(4)
    ]
    with ThreadPoolExecutor(4) as threads:
        local = [
            threads.submit(
                w.relay_until_done, engine, barrier, seen, f"t{i}", 7, 0.004, holds[i % len(holds)]
            )
            for i in range(4)
        ]
        counts = [f.result(timeout=300) for f in [*futures, *local]]
    assert sum(counts) == 400
    assert sum(1 for c in counts if c > 0) >= 2, f"the work was not shared: {counts}"
    _check_order(list(seen), ids)
    assert all(r.published_ms is not None and r.attempts == 1 for r in event_rows(engine))


@pytest.mark.restart
def test_a_relay_killed_after_publishing_is_republished_by_another_after_its_lease(
    backend: Backend, engine: Engine, procs: tuple[Any, ProcessPoolExecutor], hold: str
) -> None:
    """SIGKILL between publish and mark: the events stay claimed for the lease (held locks: until the
    server sees the connection close), then another relay publishes them again (at least once), in
    id order."""
    manager, _ = procs
    ids = [emit_one(engine, "t", {"n": n}, key=f"k{n % 2}") for n in range(6)]
    seen, published = manager.list(), manager.Event()
    ctx = worker_context()
    doomed = ctx.Process(
        target=w.publish_then_hang, args=(backend.name, backend.url, 3.0, seen, published, hold)
    )
    doomed.start()
    try:
        assert published.wait(60), "the doomed relay never published"
    finally:
        os.kill(doomed.pid, signal.SIGKILL)  # type: ignore[arg-type]
        doomed.join(30)
    assert doomed.exitcode == -signal.SIGKILL
    rows = event_rows(engine)
    survivor = Recorder()
    relay = Relay(engine, survivor, hold=hold)
    if hold == "lease":
        assert all(r.published_ms is None and r.claimed_by is not None for r in rows)
        assert relay.run_once() == 0, "the dead relay's lease still holds its events"
        wait_for_db_clock_past(engine, max(r.claimed_until_ms for r in rows))
        assert relay.run_once() == 6
    else:
        # Nothing was written: the dead relay's transaction rolls back when its connection closes.
        assert all(r.published_ms is None and r.claimed_by is None for r in rows)
        deadline = time.monotonic() + 30
        while not relay.run_once():
            assert time.monotonic() < deadline, "the dead relay's locks outlived its connection"
            time.sleep(0.05)
    assert [event_id for _, event_id, _, _ in next(iter(seen))] == ids
    assert survivor.ids == ids
    tries = 2 if hold == "lease" else 1
    assert all(r.published_ms is not None and r.attempts == tries for r in event_rows(engine))


def test_async_emit_and_async_relay(target: AsyncTarget) -> None:
    """await emit(AsyncSession) and AsyncRelay with a coroutine sink publish in id order, then run() stops."""

    async def main() -> None:
        engine = target.engine()
        try:
            await drop_tables(engine)
            await create_tables(engine)
            async with AsyncSession(engine) as session, session.begin():
                ids = [await emit(session, "t", {"n": n}, key="k") for n in range(5)]
            async with AsyncSession(engine) as session:
                await session.begin()
                await emit(session, "t", {"rolled": "back"})
                await session.rollback()
            got: list[int] = []

            async def publish(events: Any) -> None:
                await asyncio.sleep(0)
                got.extend(e.id for e in events)

            relay = AsyncRelay(engine, CallableSink(publish), batch=3)
            assert await relay.run_once() == 3
            stop = asyncio.Event()
            runner = asyncio.create_task(relay.run(stop, idle_sleep=0.02))
            for _ in range(500):
                if len(got) == 5:
                    break
                await asyncio.sleep(0.01)
            stop.set()
            await asyncio.wait_for(runner, 30)
            assert got == ids
            async with engine.connect() as conn:
                pending = await conn.scalar(select(func.count()).where(outbox.c.published_ms.is_(None)))
            assert pending == 0
            await drop_tables(engine)
        finally:
            await engine.dispose()

    asyncio.run(main())


def test_relay_refuses_an_async_sink_and_async_relay_a_sync_engine(backend: Backend, engine: Engine) -> None:
    """A coroutine sink on the sync Relay leaves the batch unpublished; AsyncRelay needs an AsyncEngine."""
    emit_one(engine, "t", {})

    async def publish(events: Any) -> None:
        return None

    with pytest.raises(InvalidArgument):
        Relay(engine, CallableSink(publish)).run_once()
    assert all(r.published_ms is None and r.claimed_until_ms is None for r in event_rows(engine))
    with pytest.raises(InvalidArgument):
        AsyncRelay(engine, Recorder())  # type: ignore[arg-type]


HOURS = 3 * 3600.0


@pytest.fixture(params=[HOURS, -HOURS], ids=["ahead", "behind"])
def skewed(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> float:
    """The application's clock (time.time, time.time_ns) hours ahead or behind the database's."""
    offset: float = request.param
    real, real_ns = time.time, time.time_ns
    monkeypatch.setattr(time, "time", lambda: real() + offset)
    monkeypatch.setattr(time, "time_ns", lambda: real_ns() + int(offset * 1e9))
    return offset


def _nested_relay(engine: Engine, wait: float, seen: list[tuple[str, int]]) -> CallableSink:
    """A sink for relay A that, mid-publish, lets relay B try the same events after ``wait`` seconds."""

    def other(events: Any) -> None:
        seen.extend(("B", e.id) for e in events)

    def publish(events: list[OutboxEvent]) -> None:
        seen.extend(("A", e.id) for e in events)
        time.sleep(wait)
        Relay(engine, CallableSink(other)).run_once()

    return CallableSink(publish)


@pytest.mark.clock
def test_a_live_claim_is_not_taken_over_whatever_the_application_clock(engine: Engine, skewed: float) -> None:
    """Relay A holds a 30 s lease while B runs: B claims nothing, with the app clock 3 h off."""
    with Session(engine) as s, s.begin():
        first = emit(s, "t", {"n": 1}, key="k")
    seen: list[tuple[str, int]] = []
    Relay(engine, _nested_relay(engine, 0.0, seen), lease=timedelta(seconds=30)).run_once()
    assert seen == [("A", first)]


@pytest.mark.clock
def test_an_expired_claim_is_taken_over_whatever_the_application_clock(engine: Engine, skewed: float) -> None:
    """Relay A's 300 ms lease ends while it publishes: B republishes (at least once), app clock 3 h off."""
    with Session(engine) as s, s.begin():
        first = emit(s, "t", {"n": 1}, key="k")
    seen: list[tuple[str, int]] = []
    Relay(
        engine, _nested_relay(engine, 0.6, seen), lease=timedelta(milliseconds=300), hold="lease"
    ).run_once()
    assert seen == [("A", first), ("B", first)]
