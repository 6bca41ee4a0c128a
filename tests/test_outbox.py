"""The transactional outbox (issue 16): emit() in the caller's transaction, relays that publish
every committed event at least once, in id order per key, sharing the work without waiting."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from stateguard import (
    AsyncRelay,
    CallableSink,
    InvalidArgument,
    OutboxEvent,
    RedisStreamSink,
    Relay,
    create_tables,
    drop_tables,
    emit,
    purge_published,
)
from stateguard.tables import outbox

from . import _outbox_workers as w
from ._support.async_helpers import ASYNC_TARGETS, AsyncTarget, target_from
from .conftest import Backend, count_statements


def _emit(engine: Engine, topic: str, payload: Any, key: str | None = None) -> int:
    with Session(engine) as session, session.begin():
        return emit(session, topic, payload, key=key)


def _rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(outbox).order_by(outbox.c.id)))


class Recorder:
    """A sink that keeps every batch it was given."""

    def __init__(self) -> None:
        self.batches: list[list[OutboxEvent]] = []

    def publish(self, events: Any) -> None:
        self.batches.append(list(events))

    @property
    def ids(self) -> list[int]:
        return [e.id for batch in self.batches for e in batch]


# --------------------------------------------------------------------------
# emit
# --------------------------------------------------------------------------


def test_emit_is_visible_only_after_commit_and_returns_increasing_ids(
    backend: Backend, engine: Engine
) -> None:
    """An emitted event is invisible to other connections until COMMIT; the ids it returns increase."""
    with Session(engine) as session, session.begin():
        first = emit(session, "order.paid", {"order": 1}, key="order-1")
        second = emit(session, "order.paid", {"order": 2})
        with engine.connect() as other:
            assert other.execute(select(func.count()).select_from(outbox)).scalar_one() == 0
    assert second > first
    rows = _rows(engine)
    assert [(r.id, r.topic, r.key, json.loads(r.payload)) for r in rows] == [
        (first, "order.paid", "order-1", {"order": 1}),
        (second, "order.paid", None, {"order": 2}),
    ]
    assert all(r.published_ms is None and r.attempts == 0 and r.created_ms > 0 for r in rows)


def test_a_rollback_discards_the_event_and_no_relay_publishes_it(backend: Backend, engine: Engine) -> None:
    """An event emitted in a transaction that rolls back never exists for a relay."""
    with Session(engine) as session:
        session.begin()
        emit(session, "order.paid", {"order": 1}, key="order-1")
        session.rollback()
    sink = Recorder()
    assert Relay(engine, sink).run_once() == 0
    assert _rows(engine) == [] and sink.batches == []


HOSTILE_PAYLOADS = [
    float("nan"),
    {"x": float("inf")},
    {1: "int key"},
    {"s": "\ud800 lone surrogate"},
    object(),
    {"when": {1, 2}},
]


def _circular() -> Any:
    a: list[Any] = []
    a.append(a)
    return a


def _deep_list(n: int) -> Any:
    value: Any = []
    for _ in range(n):
        value = [value]
    return value


def _deep(n: int) -> Any:
    value: Any = 0
    for _ in range(n):
        value = {"v": value}
    return value


@pytest.mark.parametrize(
    ("topic", "payload", "key"),
    [("t", p, None) for p in [*HOSTILE_PAYLOADS, _circular(), _deep(100_000), _deep_list(150)]]
    + [("", {}, None), ("  ", {}, None), ("t" * 201, {}, None), (7, {}, None), ("t\x00", {}, None)]
    + [("t", {}, ""), ("t", {}, "k" * 256), ("t", {}, 5), ("t", {}, "\udfff")],
)
def test_hostile_input_is_invalid_argument_before_any_statement(
    backend: Backend, engine: Engine, topic: Any, payload: Any, key: Any
) -> None:
    """NaN, non-str keys, lone surrogates, sets, cycles, deep nesting, bad topics and keys send nothing."""
    with Session(engine) as session, session.begin(), count_statements(engine) as statements:
        with pytest.raises(InvalidArgument):
            emit(session, topic, payload, key=key)
        assert statements.statements == []
    assert _rows(engine) == []


def test_a_payload_over_the_packet_limit_is_refused_on_mariadb(mariadb: Backend) -> None:
    """A payload MariaDB would refuse (1153, dropped connection) is InvalidArgument; no INSERT was sent.

    MariaDB only: the other backends take a value up to 1 GB.
    """
    engine = mariadb.engine
    drop_tables(engine)
    create_tables(engine)
    try:
        with engine.connect() as conn:
            packet = int(conn.execute(select(text("@@max_allowed_packet"))).scalar_one())
        with Session(engine) as session, session.begin(), count_statements(engine) as statements:
            with pytest.raises(InvalidArgument, match="max_allowed_packet"):
                emit(session, "t", {"blob": '"' * (packet // 3)})
            assert not [s for s in statements.statements if "INSERT" in s]
        assert _rows(engine) == []
    finally:
        drop_tables(engine)


def test_payloads_come_back_exactly_as_emitted(backend: Backend, engine: Engine) -> None:
    """Unicode, NUL, big integers and floats survive the round trip through the table and the relay."""
    payload = {
        "emoji": "💳 ✓",
        "cjk": "注文が支払われました" * 50,
        "nul": "a\x00b",
        "big": 2**70,
        "floats": [0.1, 1e308, -0.0, 5e-324],
        "flags": [True, False, None],
        "nested": {"a": [{"b": "c"}]},
        "long": "x" * 100_000,
    }
    event_id = _emit(engine, "t", payload, key="注文-1")
    sink = Recorder()
    assert Relay(engine, sink).run_once() == 1
    [[event]] = sink.batches
    assert (event.id, event.key, event.payload) == (event_id, "注文-1", payload)
    assert json.loads(event.payload_json()) == payload


# --------------------------------------------------------------------------
# One relay
# --------------------------------------------------------------------------


def test_run_once_publishes_in_id_order_and_marks_them(backend: Backend, engine: Engine) -> None:
    """One batch takes the free events in id order, the sink gets them in that order, and they are marked."""
    ids = [_emit(engine, "t", {"n": n}, key=f"k{n % 3}" if n % 4 else None) for n in range(12)]
    sink = Recorder()
    relay = Relay(engine, sink, batch=5)
    assert [relay.run_once() for _ in range(4)] == [5, 5, 2, 0]
    assert sink.ids == ids
    rows = _rows(engine)
    assert all(r.published_ms is not None and r.attempts == 1 and r.claimed_until_ms is None for r in rows)


def test_a_failing_sink_leaves_the_batch_unpublished_and_free_at_once(
    backend: Backend, engine: Engine
) -> None:
    """A sink that raises: nothing is marked, the claim is released, the next run publishes it all."""
    ids = [_emit(engine, "t", {"n": n}, key="k") for n in range(3)]

    def broken(events: Any) -> None:
        raise ConnectionError("broker down")

    with pytest.raises(ConnectionError):
        Relay(engine, CallableSink(broken)).run_once()
    rows = _rows(engine)
    assert all(r.published_ms is None and r.claimed_until_ms is None and r.attempts == 1 for r in rows)
    sink = Recorder()
    assert Relay(engine, sink).run_once() == 3
    assert sink.ids == ids
    assert all(r.attempts == 2 and r.published_ms is not None for r in _rows(engine))


def test_a_key_is_held_back_while_its_earlier_event_is_claimed_elsewhere(
    backend: Backend, engine: Engine
) -> None:
    """While relay A publishes k's first event, relay B takes other keys but none of k's later events."""
    k1 = _emit(engine, "t", {"n": 1}, key="k")
    k2 = _emit(engine, "t", {"n": 2}, key="k")
    j1 = _emit(engine, "t", {"n": 3}, key="j")
    entered, leave = threading.Event(), threading.Event()
    got_a: list[int] = []

    def slow(events: Any) -> None:
        got_a.extend(e.id for e in events)
        entered.set()
        assert leave.wait(60)

    relay_a = Relay(engine, CallableSink(slow), batch=1)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(relay_a.run_once)
        assert entered.wait(60)
        sink_b = Recorder()
        relay_b = Relay(engine, sink_b)
        assert relay_b.run_once() == 1 and sink_b.ids == [j1]
        assert relay_b.run_once() == 0, "k's second event must wait for the first to be marked"
        leave.set()
        assert future.result(60) == 1
    assert got_a == [k1]
    assert relay_b.run_once() == 1 and sink_b.ids == [j1, k2]


def _wait_for_db_clock_past(engine: Engine, ms: int) -> None:
    from stateguard._sql import db_now_ms

    while True:
        with engine.connect() as conn:
            if conn.execute(select(db_now_ms())).scalar_one() > ms:
                return
        time.sleep(0.05)


def test_a_relay_that_outlived_its_lease_cannot_mark_the_new_claim(backend: Backend, engine: Engine) -> None:
    """A's lease ends while it publishes; B claims the batch; A's late mark leaves B's claim unpublished."""
    ids = [_emit(engine, "t", {"n": n}, key="k") for n in range(3)]
    entered_a, leave_a, entered_b, leave_b = (threading.Event() for _ in range(4))

    def blocking(entered: threading.Event, leave: threading.Event) -> CallableSink:
        def publish(events: Any) -> None:
            entered.set()
            assert leave.wait(60)

        return CallableSink(publish)

    relay_a = Relay(engine, blocking(entered_a, leave_a), lease=timedelta(milliseconds=300))
    relay_b = Relay(engine, blocking(entered_b, leave_b), lease=timedelta(seconds=60))
    with ThreadPoolExecutor(2) as pool:
        future_a = pool.submit(relay_a.run_once)
        assert entered_a.wait(60)
        _wait_for_db_clock_past(engine, max(r.claimed_until_ms for r in _rows(engine)))
        future_b = pool.submit(relay_b.run_once)
        assert entered_b.wait(60)
        leave_a.set()
        assert future_a.result(60) == 3  # A did hand them to its sink
        rows = _rows(engine)
        assert all(r.published_ms is None and r.attempts == 2 for r in rows), "A's mark took B's claim"
        assert len({r.claimed_by for r in rows}) == 1
        leave_b.set()
        assert future_b.result(60) == 3
    assert [r.id for r in _rows(engine) if r.published_ms is not None] == ids


def test_topics_limit_a_relay_and_a_key_waits_for_its_other_topic(backend: Backend, engine: Engine) -> None:
    """A relay for topic A skips topic B, and a key's later A event waits until its B event is published."""
    a1 = _emit(engine, "A", {}, key="k")
    b1 = _emit(engine, "B", {}, key="k")
    a2 = _emit(engine, "A", {}, key="k")
    a3 = _emit(engine, "A", {}, key="other")
    only_a, only_b = Recorder(), Recorder()
    relay_a, relay_b = Relay(engine, only_a, topics=["A"]), Relay(engine, only_b, topics=["B"])
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
        ids = [_emit(engine, "t", {"n": n}, key="k") for n in range(5)]
        deadline = time.monotonic() + 30
        while sink.ids != ids and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive() and sink.ids == ids


def test_bad_relay_options_are_invalid_argument(backend: Backend, engine: Engine) -> None:
    """A sink without publish, a zero batch, a non-timedelta lease or a str topics are refused."""
    for kwargs in [{"batch": 0}, {"batch": 10_001}, {"lease": 30}, {"topics": "A"}, {"topics": []}]:
        with pytest.raises(InvalidArgument):
            Relay(engine, Recorder(), **kwargs)
    with pytest.raises(InvalidArgument):
        Relay(engine, lambda events: None)


# --------------------------------------------------------------------------
# Several relays: threads and processes
# --------------------------------------------------------------------------


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


def test_four_processes_and_four_threads_share_the_work_once_each_and_in_key_order(
    backend: Backend, engine: Engine, procs: tuple[Any, ProcessPoolExecutor]
) -> None:
    """8 relays released by one barrier publish 400 events once each, each key's events in id order."""
    manager, pool = procs
    with Session(engine) as session, session.begin():
        ids = [emit(session, "t", {"n": n}, key=None if n % 10 == 0 else f"key-{n % 13}") for n in range(400)]
    seen, barrier = manager.list(), manager.Barrier(8, timeout=120)
    futures = [
        pool.submit(w.relay_in_process, backend.name, backend.url, barrier, seen, f"p{i}", 7, 0.004)
        for i in range(4)
    ]
    with ThreadPoolExecutor(4) as threads:
        local = [
            threads.submit(w.relay_until_done, engine, barrier, seen, f"t{i}", 7, 0.004) for i in range(4)
        ]
        counts = [f.result(timeout=300) for f in [*futures, *local]]
    assert sum(counts) == 400
    assert sum(1 for c in counts if c > 0) >= 2, f"the work was not shared: {counts}"
    _check_order(list(seen), ids)
    assert all(r.published_ms is not None and r.attempts == 1 for r in _rows(engine))


def test_a_relay_killed_after_publishing_is_republished_by_another_after_its_lease(
    backend: Backend, engine: Engine, procs: tuple[Any, ProcessPoolExecutor]
) -> None:
    """SIGKILL between publish and mark: the events stay claimed for the lease, then another relay
    publishes them again (at least once), in id order."""
    manager, _ = procs
    ids = [_emit(engine, "t", {"n": n}, key=f"k{n % 2}") for n in range(6)]
    seen, published = manager.list(), manager.Event()
    ctx = multiprocessing.get_context("spawn")
    doomed = ctx.Process(target=w.publish_then_hang, args=(backend.name, backend.url, 3.0, seen, published))
    doomed.start()
    try:
        assert published.wait(60), "the doomed relay never published"
    finally:
        os.kill(doomed.pid, signal.SIGKILL)  # type: ignore[arg-type]
        doomed.join(30)
    assert doomed.exitcode == -signal.SIGKILL
    rows = _rows(engine)
    assert all(r.published_ms is None and r.claimed_by is not None for r in rows)

    survivor = Recorder()
    relay = Relay(engine, survivor)
    assert relay.run_once() == 0, "the dead relay's lease still holds its events"
    _wait_for_db_clock_past(engine, max(r.claimed_until_ms for r in rows))
    assert relay.run_once() == 6
    assert [event_id for _, event_id, _, _ in next(iter(seen))] == ids
    assert survivor.ids == ids
    assert all(r.published_ms is not None and r.attempts == 2 for r in _rows(engine))


# --------------------------------------------------------------------------
# Redis stream sink
# --------------------------------------------------------------------------


def test_redis_stream_sink_xadds_each_event_with_its_id(
    backend: Backend, engine: Engine, redis_client: Any
) -> None:
    """Each event becomes one stream entry carrying id, topic, key and payload, in id order."""
    stream = f"sg-test-outbox-{uuid.uuid4().hex}"
    try:
        ids = [
            _emit(engine, "order.paid", {"n": n, "s": "✓"}, key=None if n == 2 else "o-1") for n in range(4)
        ]
        assert Relay(engine, RedisStreamSink(redis_client, stream=stream)).run_once() == 4
        entries = redis_client.xrange(stream)
        fields = [{k.decode(): v.decode() for k, v in f.items()} for _, f in entries]
        assert fields == [
            {
                "id": str(i),
                "topic": "order.paid",
                "key": "" if n == 2 else "o-1",
                "payload": json.dumps({"n": n, "s": "✓"}, ensure_ascii=False, separators=(",", ":")),
            }
            for n, i in enumerate(ids)
        ]
    finally:
        redis_client.delete(stream)


def test_redis_stream_sink_refuses_bad_options(redis_client: Any) -> None:
    """No client, a blank stream or a zero maxlen are InvalidArgument."""
    for args, kwargs in [
        ((None,), {"stream": "s"}),
        ((redis_client,), {"stream": " "}),
        ((redis_client,), {"stream": "s", "maxlen": 0}),
    ]:
        with pytest.raises(InvalidArgument):
            RedisStreamSink(*args, **kwargs)


# --------------------------------------------------------------------------
# Purge
# --------------------------------------------------------------------------


def test_purge_published_deletes_only_old_published_events_in_batches(
    backend: Backend, engine: Engine
) -> None:
    """Published events older than the retention go, in batches; unpublished and recent ones stay."""
    old = [_emit(engine, "t", {"n": n}) for n in range(3)]
    assert Relay(engine, Recorder()).run_once() == 3
    with engine.begin() as conn:
        conn.execute(update(outbox).values(published_ms=outbox.c.published_ms - 3_600_000))
    recent = _emit(engine, "t", {})
    assert Relay(engine, Recorder()).run_once() == 1
    unpublished = _emit(engine, "t", {})
    assert purge_published(engine, older_than=timedelta(minutes=30), batch=2) == 2
    assert purge_published(engine, older_than=timedelta(minutes=30), batch=2) == 1
    assert purge_published(engine, older_than=timedelta(minutes=30), batch=2) == 0
    assert [r.id for r in _rows(engine)] == [recent, unpublished]
    assert not {r.id for r in _rows(engine)} & set(old)
    with pytest.raises(InvalidArgument):
        purge_published(engine, older_than=timedelta(0))


# --------------------------------------------------------------------------
# Async
# --------------------------------------------------------------------------


@pytest.fixture(params=list(ASYNC_TARGETS))
def target(request: pytest.FixtureRequest) -> AsyncTarget:
    """Each async driver, on the namespace of its backend."""
    return target_from(request)


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


def test_async_relay_publishes_to_a_redis_stream_through_redis_asyncio(
    target: AsyncTarget, redis_client: Any
) -> None:
    """AsyncRelay awaits RedisStreamSink's pipeline on a redis.asyncio client: an entry per event in order."""
    import redis.asyncio

    from .conftest import REDIS_URL

    stream = f"sg-test-outbox-async-{uuid.uuid4().hex}"

    async def main() -> list[str]:
        engine = target.engine()
        client = redis.asyncio.Redis.from_url(REDIS_URL)
        try:
            await drop_tables(engine)
            await create_tables(engine)
            async with AsyncSession(engine) as session, session.begin():
                ids = [await emit(session, "t", {"n": n}, key="k") for n in range(4)]
            relay = AsyncRelay(engine, RedisStreamSink(client, stream=stream), batch=3)
            assert await relay.run_once() == 3
            assert await relay.run_once() == 1
            await drop_tables(engine)
            return [str(i) for i in ids]
        finally:
            await client.aclose()
            await engine.dispose()

    try:
        ids = asyncio.run(main())
        assert [f[b"id"].decode() for _, f in redis_client.xrange(stream)] == ids
    finally:
        redis_client.delete(stream)


def test_relay_refuses_an_async_sink_and_async_relay_a_sync_engine(backend: Backend, engine: Engine) -> None:
    """A coroutine sink on the sync Relay leaves the batch unpublished; AsyncRelay needs an AsyncEngine."""
    _emit(engine, "t", {})

    async def publish(events: Any) -> None:
        return None

    with pytest.raises(InvalidArgument):
        Relay(engine, CallableSink(publish)).run_once()
    assert all(r.published_ms is None and r.claimed_until_ms is None for r in _rows(engine))
    with pytest.raises(InvalidArgument):
        AsyncRelay(engine, Recorder())  # type: ignore[arg-type]


def test_statements_text(backend: Backend, engine: Engine) -> None:
    """The claim locks its heads with SKIP LOCKED where row locks exist."""
    _emit(engine, "t", {}, key="k")
    with count_statements(engine) as statements:
        Relay(engine, Recorder()).run_once()
    claim = next(s for s in statements.statements if "sg_earlier" in s)
    if backend.name == "sqlite":
        assert "FOR UPDATE" not in claim
    else:
        assert "FOR UPDATE SKIP LOCKED" in claim


def test_a_batch_costs_two_statements_on_postgresql(backend: Backend, engine: Engine) -> None:
    """A cycle with followers sends one claim and one mark on PostgreSQL (the claim used to be three)."""
    for key in ("k", "k", "j", None):
        _emit(engine, "t", {}, key=key)
    recorder = Recorder()
    with count_statements(engine) as statements:
        assert Relay(engine, recorder).run_once() == 4
    assert [e.key for e in recorder.batches[0]] == ["k", "k", "j", None]
    # SQLite: BEGIN IMMEDIATE before the claim and before the mark; MariaDB: three claim statements
    # and a SET TRANSACTION before the claim and before the mark.
    expected = {"postgresql": 2, "sqlite": 4}.get(backend.name, 6)
    assert len(statements.statements) == expected, statements.statements


def test_a_purged_events_id_is_never_handed_out_again(backend: Backend) -> None:
    """Consumers deduplicate by event id: after every event was published and purged, the next emit gets
    a new id (SQLite's plain rowid reused id 1, and consume_once then dropped the new event)."""
    engine = backend.engine
    drop_tables(engine)
    create_tables(engine)
    try:
        with Session(engine) as s, s.begin():
            first = emit(s, "mail", {"to": "alice"})
        published: list[int] = []
        Relay(engine, CallableSink(lambda events: published.extend(e.id for e in events))).run_once()
        assert published == [first]
        time.sleep(0.05)
        assert purge_published(engine, older_than=timedelta(milliseconds=1)) == 1
        with Session(engine) as s, s.begin():
            second = emit(s, "mail", {"to": "bob"})
        assert second > first
    finally:
        drop_tables(engine)
