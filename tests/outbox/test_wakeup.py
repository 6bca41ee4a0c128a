"""How a running relay wakes: on PostgreSQL a NOTIFY at the emitting transaction's COMMIT (never at a
rollback), and a lost notification (its LISTEN connection killed) loses no event; elsewhere an adaptive
poll that keeps latency short while events keep coming."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, String, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import AsyncRelay, CallableSink, Relay, StateMachine, create_tables, drop_tables, emit
from stateguard.outbox.wakeup import CHANNEL, MIN_POLL_S, Poll
from tests._support.async_helpers import PG_TARGETS, AsyncTarget, target_from

from ..conftest import Backend
from ._events import emit_one

#: run()'s default idle_sleep: a relay that only polled would take up to this long.
IDLE = 1.0


class Stamped:
    """A sink that records when each event arrived (time.monotonic())."""

    def __init__(self) -> None:
        self.at: dict[int, float] = {}
        self.lock = threading.Lock()

    def publish(self, events: Any) -> None:
        now = time.monotonic()
        with self.lock:
            for e in events:
                self.at.setdefault(e.id, now)

    def wait_for(self, event_id: int, timeout: float = 10.0) -> float:
        """Seconds until ``event_id`` arrived, measured from now."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            with self.lock:
                if event_id in self.at:
                    return self.at[event_id] - t0
            time.sleep(0.001)
        raise AssertionError(f"event {event_id} not published within {timeout} s")


@pytest.fixture
def pg_engine(pg: Backend) -> Iterator[Engine]:
    """PostgreSQL's engine with stateguard's tables, dropped afterwards."""
    drop_tables(pg.engine)
    create_tables(pg.engine)
    yield pg.engine
    drop_tables(pg.engine)


@pytest.fixture
def running(pg_engine: Engine) -> Iterator[tuple[Relay, Stamped]]:
    """Relay.run() on PostgreSQL with its default idle_sleep in a thread, idle (past its poll's backoff)."""
    engine = pg_engine
    sink = Stamped()
    relay = Relay(engine, sink)
    stop = threading.Event()
    thread = threading.Thread(target=relay.run, args=(stop,), daemon=True)
    thread.start()
    time.sleep(IDLE * 2.5)  # past the poll's backoff: only a wake-up can be quick now
    try:
        yield relay, sink
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive(), "run() did not end on its stop event"


def _listener_pid(relay: Relay, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listener = relay._listener
        if listener is not None and listener.backend_pid is not None:
            return int(listener.backend_pid)
        time.sleep(0.01)
    raise AssertionError("the relay never opened its LISTEN connection")


def test_an_idle_relay_on_postgresql_publishes_within_milliseconds_of_the_commit(
    pg_engine: Engine, running: tuple[Relay, Stamped]
) -> None:
    """With the default idle_sleep of 1 s, each of 10 events emitted into an idle relay's outbox is
    published well under the poll interval after its COMMIT: the NOTIFY woke the relay."""
    relay, sink = running
    _listener_pid(relay)
    waits = []
    for n in range(10):
        event_id = emit_one(pg_engine, "t", {"n": n}, key="k")
        waits.append(sink.wait_for(event_id))
        time.sleep(0.05)
    assert max(waits) < 0.3, waits


def test_a_rolled_back_emit_sends_no_notification(pg_engine: Engine) -> None:
    """NOTIFY is transactional: a listener hears the committed emit, not the rolled-back one."""
    raw = pg_engine.raw_connection()
    try:
        listener = raw.driver_connection
        listener.autocommit = True
        listener.execute(f'LISTEN "{CHANNEL}"')
        with Session(pg_engine) as session:
            session.begin()
            emit(session, "t", {"rolled": "back"})
            session.rollback()
        assert list(listener.notifies(timeout=0.5)) == []
        emit_one(pg_engine, "t", {"committed": True})
        heard = list(listener.notifies(timeout=5, stop_after=1))
        assert [n.channel for n in heard] == [CHANNEL]
    finally:
        raw.invalidate()


class Orders(DeclarativeBase):
    pass


class Order(Orders):
    __tablename__ = "sg_wakeup_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="new")
    flow = StateMachine(
        "status",
        states=["new", "paid"],
        transitions=[{"trigger": "pay", "source": "new", "dest": "paid"}],
        events=True,
    )


def test_a_transition_with_events_and_a_bulk_transition_notify(pg: Backend) -> None:
    """events=True: a single transition (one statement with its event) and Order.flow.pay.many() each
    send a notification at COMMIT."""
    engine = pg.create(Orders.metadata)
    drop_tables(engine)
    create_tables(engine)
    raw = engine.raw_connection()
    try:
        listener = raw.driver_connection
        listener.autocommit = True
        listener.execute(f'LISTEN "{CHANNEL}"')
        with Session(engine) as s, s.begin():
            s.add_all([Order(id=i) for i in range(1, 4)])
        with Session(engine) as s, s.begin():
            assert Order.flow.pay(s, 1).applied
        assert len(list(listener.notifies(timeout=5, stop_after=1))) == 1
        with Session(engine) as s, s.begin():
            Order.flow.pay.many(s, [2, 3])
        assert len(list(listener.notifies(timeout=5, stop_after=1))) == 1
    finally:
        raw.invalidate()
        drop_tables(engine)


@pytest.mark.lost_reply
@pytest.mark.restart
def test_a_killed_listen_connection_loses_no_event_and_is_made_again(
    pg_engine: Engine, running: tuple[Relay, Stamped]
) -> None:
    """pg_terminate_backend on the relay's LISTEN connection, then emits at once and 0.3 s later: none is
    lost (the poll, or the reconnection's round, finds them within idle_sleep), the relay listens again on
    a new connection, and the next event is published within milliseconds again."""
    relay, sink = running
    first = _listener_pid(relay)
    with pg_engine.connect() as conn:
        assert conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": first}).scalar_one()
    lost = [emit_one(pg_engine, "t", {"n": 0}, key="k")]
    time.sleep(0.3)
    lost.append(emit_one(pg_engine, "t", {"n": 1}, key="k"))
    for event_id in lost:
        assert sink.wait_for(event_id, timeout=IDLE * 3) < IDLE * 3
    deadline = time.monotonic() + 10
    while _listener_pid(relay) == first:
        assert time.monotonic() < deadline, "the relay did not listen again"
        time.sleep(0.01)
    time.sleep(IDLE * 2.5)
    again = emit_one(pg_engine, "t", {"n": 2}, key="k")
    assert sink.wait_for(again) < 0.3


def test_the_adaptive_poll_sleeps_briefly_while_events_come_and_backs_off_to_idle() -> None:
    """After a round that published the poll sleeps MIN_POLL_S, doubling each empty round up to idle."""
    poll = Poll()
    assert [poll.seconds(0.1) for _ in range(7)] == [MIN_POLL_S * 2**i for i in range(5)] + [0.1, 0.1]
    poll.worked()
    assert poll.seconds(0.1) == MIN_POLL_S


def test_a_polling_relay_publishes_events_that_keep_coming_quickly(backend: Backend, engine: Engine) -> None:
    """Every backend: events emitted every 20 ms into a running relay (default idle_sleep) are published
    within 100 ms at the 90th percentile, far under the 1 s idle poll."""
    sink = Stamped()
    relay = Relay(engine, sink)
    stop = threading.Event()
    thread = threading.Thread(target=relay.run, args=(stop,), daemon=True)
    thread.start()
    waits = []
    try:
        for n in range(40):
            t0 = time.monotonic()  # before the COMMIT: the wait counts from it
            event_id = emit_one(engine, "t", {"n": n}, key=f"k{n % 4}")
            waits.append(sink.wait_for(event_id) + (time.monotonic() - t0))
            time.sleep(0.02)
    finally:
        stop.set()
        thread.join(10)
    waits.sort()
    assert waits[int(len(waits) * 0.9)] < 0.1, waits


@pytest.fixture(params=PG_TARGETS)
def pg_target(request: pytest.FixtureRequest) -> AsyncTarget:
    """The async PostgreSQL drivers (asyncpg, psycopg async)."""
    return target_from(request)


@pytest.mark.lost_reply
def test_async_relay_wakes_on_notify_and_survives_a_killed_listen_connection(pg_target: AsyncTarget) -> None:
    """AsyncRelay.run(): an event into an idle relay arrives within milliseconds; after its LISTEN
    connection is killed the next events still arrive (poll or reconnection) and it listens again."""

    async def main() -> None:
        engine = pg_target.engine()
        got: dict[int, float] = {}

        async def publish(events: Any) -> None:
            for e in events:
                got.setdefault(e.id, time.monotonic())

        async def emit_now(n: int) -> tuple[int, float]:
            async with AsyncSession(engine) as session, session.begin():
                event_id = await emit(session, "t", {"n": n}, key="k")
            return event_id, time.monotonic()

        async def arrival(event_id: int, since: float, timeout: float) -> float:
            deadline = time.monotonic() + timeout
            while event_id not in got:
                assert time.monotonic() < deadline, f"event {event_id} not published in {timeout} s"
                await asyncio.sleep(0.001)
            return got[event_id] - since

        try:
            await drop_tables(engine)
            await create_tables(engine)
            relay = AsyncRelay(engine, CallableSink(publish))
            stop = asyncio.Event()
            runner = asyncio.create_task(relay.run(stop))
            await asyncio.sleep(IDLE * 2.5)
            event_id, at = await emit_now(0)
            assert await arrival(event_id, at, 5) < 0.3
            pid = relay._listener.backend_pid
            assert pid is not None
            async with engine.connect() as conn:
                await conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            for n in (1, 2):
                event_id, at = await emit_now(n)
                assert await arrival(event_id, at, IDLE * 3) < IDLE * 3
            deadline = time.monotonic() + 10
            while relay._listener.backend_pid in (None, pid):
                assert time.monotonic() < deadline, "the async relay did not listen again"
                await asyncio.sleep(0.01)
            await asyncio.sleep(IDLE * 2.5)
            event_id, at = await emit_now(3)
            assert await arrival(event_id, at, 5) < 0.3
            stop.set()
            await asyncio.wait_for(runner, 10)
            await drop_tables(engine)
        finally:
            await engine.dispose()

    asyncio.run(main())
