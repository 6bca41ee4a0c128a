"""Observers that raise never change what a guarded call does or returns.

Each broken observer in turn: a stateguard outcome listener, an OpenTelemetry span processor
raising in ``on_start`` or in ``on_end`` (a real SDK ``TracerProvider``), a metric whose recording
raises (a real SDK ``MeterProvider`` with an exemplar filter that raises), and a logging filter
raising on the DEBUG event line.  Around every observed public call, sync and async, on every
backend: the call keeps its result, its write commits, its lock is really held and released, and
the observer's error is logged on ``stateguard.observe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.metrics import ExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util.types import Attributes
from sqlalchemy import Engine, Integer, String, func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import (
    AsyncRedisLock,
    AsyncRedisTokens,
    GuardEvent,
    Outcome,
    RedisLock,
    RedisTokens,
    Snowflake,
    StateMachine,
    StripedCounter,
    consume_once,
    consume_token,
    decrement,
    emit,
    guarded_update,
    idempotent,
    increment,
    insert_once,
    issue_token,
    on_event,
    on_idempotency_event,
    retry_on_conflict,
    version_column,
)
from stateguard import observe as observe_module
from stateguard import otel as otel_module
from stateguard.idempotency import IdempotencyEvent
from stateguard.observe import on_span
from stateguard.otel import instrument
from stateguard.tables import metadata as stateguard_metadata
from stateguard.tables import outbox
from tests._support.async_helpers import Tables, async_target
from tests._support.failing_observers import FailingProcessor, ObserverBug, QuietHandler
from tests.conftest import REDIS_URL, Backend

pytestmark = pytest.mark.failing_observer


class Base(DeclarativeBase):
    pass


class Invoice(Base):
    """A state machine, a version and an amount: the rows the guarded calls change."""

    __tablename__ = "observe_invoices"
    id: Mapped[int] = mapped_column(primary_key=True)
    state: Mapped[str] = mapped_column(String(20), default="open")
    version: Mapped[int] = version_column()
    amount: Mapped[int] = mapped_column(Integer, default=0)
    note: Mapped[str | None] = mapped_column(String(50))

    flow = StateMachine(
        "state",
        states=["open", "paid"],
        transitions=[{"trigger": "pay", "source": "open", "dest": "paid"}],
    )


# --------------------------------------------------------------------------
# Broken observers
# --------------------------------------------------------------------------

OBSERVERS = ["listener", "span_start", "span_end", "metric", "log_filter"]


class FailingExemplarFilter(ExemplarFilter):
    """An exemplar filter that raises: every measurement the SDK takes raises with it."""

    def should_sample(
        self, value: float, time_unix_nano: int, attributes: Attributes, context: Context
    ) -> bool:
        raise ObserverBug("metric recording")


def fail_on_debug(record: logging.LogRecord) -> bool:
    """A logging filter that raises on DEBUG records (stateguard's event lines), passes the rest."""
    if record.levelno == logging.DEBUG:
        raise ObserverBug(f"logging filter: {record.getMessage()}")
    return True


def fail_on_event(event: GuardEvent | IdempotencyEvent) -> None:
    """An outcome (or idempotency event) listener that raises on every event."""
    raise ObserverBug(f"listener: {event}")


@dataclass
class Broken:
    """One broken observer installed for the test."""

    kind: str
    exporter: InMemorySpanExporter | None = None
    stops: list[Callable[[], None]] = field(default_factory=list)

    def check(self, caplog: pytest.LogCaptureFixture, *operations: str) -> None:
        """The observer's error was logged; with spans, each call's span ended and none stays current."""
        failures = [
            r
            for r in caplog.records
            if r.name == "stateguard.observe"
            and r.exc_info is not None
            and isinstance(r.exc_info[1], ObserverBug)
        ]
        assert failures, f"no logged {self.kind} failure among {[r.getMessage() for r in caplog.records]}"
        assert trace.get_current_span() is trace.INVALID_SPAN
        assert otel_module._current.get() is None
        if self.kind == "span_end" and operations:
            assert self.exporter is not None
            ended = {span.name for span in self.exporter.get_finished_spans()}
            assert {f"stateguard {op}" for op in operations} <= ended, ended


@pytest.fixture(params=OBSERVERS)
def broken(request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture) -> Iterator[Broken]:
    """Each broken observer in turn, removed afterwards."""
    caplog.set_level(logging.ERROR, logger="stateguard.observe")
    got = Broken(request.param)
    if got.kind == "listener":
        got.stops.append(on_event(fail_on_event))
        got.stops.append(on_idempotency_event(fail_on_event))
    elif got.kind in ("span_start", "span_end"):
        got.exporter = InMemorySpanExporter()
        tracers = TracerProvider(shutdown_on_exit=False)
        # The exporter first: the SDK calls processors in order, so it sees the span end.
        tracers.add_span_processor(SimpleSpanProcessor(got.exporter))
        tracers.add_span_processor(FailingProcessor(got.kind.removeprefix("span_")))
        got.stops.append(tracers.shutdown)
        got.stops.append(instrument(tracer_provider=tracers, metrics=False))
    elif got.kind == "metric":
        meters = MeterProvider(
            metric_readers=[InMemoryMetricReader()],
            exemplar_filter=FailingExemplarFilter(),
            shutdown_on_exit=False,
        )
        got.stops.append(meters.shutdown)
        got.stops.append(instrument(meter_provider=meters, spans=False))
    else:
        logger = logging.getLogger("stateguard")
        handler = QuietHandler()
        handler.addFilter(fail_on_debug)
        level = logger.level
        logger.setLevel(logging.DEBUG)
        logger.addHandler(handler)

        def restore() -> None:
            logger.removeHandler(handler)
            logger.setLevel(level)

        got.stops.append(restore)
    yield got
    for stop in reversed(got.stops):
        stop()
    assert observe_module.hooked is False


# --------------------------------------------------------------------------
# Database calls
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tables() -> Iterator[Tables]:
    """The invoices and stateguard's tables, created once per backend and emptied per test."""
    t = Tables(Base.metadata, stateguard_metadata)
    yield t
    t.drop()


@pytest.fixture
def db(backend: Backend, tables: Tables) -> Engine:
    """Two open invoices (1 with an amount of 10, 2 with 0) on the backend."""
    tables.ready(backend)
    with Session(backend.engine) as s, s.begin():
        s.add_all([Invoice(id=1, amount=10), Invoice(id=2)])
    return backend.engine


def _invoice(engine: Engine, key: int) -> tuple[str, int, str | None] | None:
    with Session(engine) as s:
        row = s.get(Invoice, key)
        return None if row is None else (row.state, row.amount, row.note)


def _outbox_rows(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(outbox)).scalar_one())


def call_trigger(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        assert Invoice.flow.pay(s, 1).outcome is Outcome.APPLIED
    assert _invoice(engine, 1) == ("paid", 10, None)


def call_many(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        results = Invoice.flow.pay.many(s, [1, 2])
        assert {k: r.outcome for k, r in results.items()} == {1: Outcome.APPLIED, 2: Outcome.APPLIED}
    assert [_invoice(engine, k) for k in (1, 2)] == [("paid", 10, None), ("paid", 0, None)]


def call_where(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        assert len(Invoice.flow.pay.where(s, Invoice.id == 2)) == 1
    assert _invoice(engine, 2) == ("paid", 0, None)


def call_guarded_update(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        result = guarded_update(s, Invoice, 1, {"note": "sent"}, expected_version=1)
        assert result.outcome is Outcome.APPLIED
    assert _invoice(engine, 1) == ("open", 10, "sent")


def call_counters(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        assert decrement(s, Invoice.amount, 1, by=3).outcome is Outcome.APPLIED
        assert increment(s, Invoice.amount, 2, by=5, ref="refund-1").outcome is Outcome.APPLIED
    assert (_invoice(engine, 1), _invoice(engine, 2)) == (("open", 7, None), ("open", 5, None))
    with Session(engine) as s, s.begin():
        assert increment(s, Invoice.amount, 2, by=5, ref="refund-1").outcome is Outcome.REPEATED
    assert _invoice(engine, 2) == ("open", 5, None)


def call_insert_once(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        assert insert_once(s, Invoice, {"id": 3, "amount": 4}).outcome is Outcome.APPLIED
    assert _invoice(engine, 3) == ("open", 4, None)


def call_consume_once(engine: Engine) -> None:
    for expected in (Outcome.APPLIED, Outcome.REPEATED):
        with Session(engine) as s, s.begin():
            assert consume_once(s, "mailer", "m-1").outcome is expected


def call_tokens(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        token = issue_token(s, scope="reset", ttl=timedelta(minutes=5))
    for expected in (Outcome.APPLIED, Outcome.REPEATED):
        with Session(engine) as s, s.begin():
            assert consume_token(s, token, scope="reset").outcome is expected


def call_emit(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        assert isinstance(emit(s, "invoice.paid", {"id": 1}, key="invoice-1"), int)
    assert _outbox_rows(engine) == 1


def call_idempotent(engine: Engine) -> None:
    for replayed in (False, True):
        with Session(engine) as s, s.begin():
            with idempotent(s, scope="pay", key="k-1", fingerprint=1) as call:
                assert call.replayed is replayed
                if replayed:
                    assert call.response == {"paid": 1}
                else:
                    Invoice.flow.pay(s, 1)
                    call.complete({"paid": 1})
    assert _invoice(engine, 1) == ("paid", 10, None)


def call_striped(engine: Engine) -> None:
    stock = StripedCounter("observe-stock", stripes=2)
    with Session(engine) as s, s.begin():
        assert stock.create(s, "sku-1", amount=3).outcome is Outcome.APPLIED
        assert stock.decrement(s, "sku-1", by=2, ref="o-1").outcome is Outcome.APPLIED
    with Session(engine) as s, s.begin():
        assert stock.decrement(s, "sku-1", by=2, ref="o-1").outcome is Outcome.REPEATED
        assert stock.total(s, "sku-1") == 1


def call_retry_on_conflict(engine: Engine) -> None:
    def unit() -> Outcome:
        with Session(engine) as s, s.begin():
            return Invoice.flow.pay(s, 1).outcome

    assert retry_on_conflict(unit, backoff=0) is Outcome.APPLIED
    assert _invoice(engine, 1) == ("paid", 10, None)


def call_next_id(engine: Engine) -> None:
    with Snowflake(engine) as ids:
        first = ids.next_id()
        assert ids.next_id() > first


#: (the call and its checks, the operations whose spans it opens)
DATABASE_CALLS: dict[str, tuple[Callable[[Engine], None], tuple[str, ...]]] = {
    "trigger": (call_trigger, ("trigger",)),
    "many": (call_many, ("many",)),
    "where": (call_where, ("where",)),
    "guarded_update": (call_guarded_update, ("guarded_update",)),
    "counters": (call_counters, ("decrement", "increment")),
    "insert_once": (call_insert_once, ("insert_once",)),
    "consume_once": (call_consume_once, ("consume_once",)),
    "tokens": (call_tokens, ("issue_token", "consume_token")),
    "emit": (call_emit, ("emit",)),
    "idempotent": (call_idempotent, ("trigger",)),
    "striped": (call_striped, ("striped.create", "striped.decrement", "striped.total")),
    "retry_on_conflict": (call_retry_on_conflict, ("trigger",)),
    "next_id": (call_next_id, ("next_id",)),
}


@pytest.mark.failing_observer
@pytest.mark.parametrize("call", list(DATABASE_CALLS))
def test_database_calls_keep_their_results(
    call: str, db: Engine, broken: Broken, caplog: pytest.LogCaptureFixture
) -> None:
    """Each guarded database call returns what it returns unobserved and its write commits."""
    run, operations = DATABASE_CALLS[call]
    run(db)
    broken.check(caplog, *operations)


@pytest.mark.failing_observer
def test_a_call_that_raises_keeps_its_own_error(
    sqlite: Backend, tables: Tables, broken: Broken, caplog: pytest.LogCaptureFixture
) -> None:
    """A call that raises raises its own error, not the observer's, and rolls back only its own block."""
    from stateguard import InvalidArgument

    tables.ready(sqlite)
    with Session(sqlite.engine) as s, s.begin():
        s.add(Invoice(id=1))
    with Session(sqlite.engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            Invoice.flow.pay(s, "not a key")
        assert Invoice.flow.pay(s, 1).outcome is Outcome.APPLIED
    assert _invoice(sqlite.engine, 1) == ("paid", 0, None)
    broken.check(caplog, "trigger")


@pytest.mark.failing_observer
def test_every_span_closes_when_another_fails_to(
    sqlite: Backend, tables: Tables, caplog: pytest.LogCaptureFixture
) -> None:
    """A span factory whose exit raises does not keep the others open, nor break the call."""
    tables.ready(sqlite)
    with Session(sqlite.engine) as s, s.begin():
        s.add(Invoice(id=1))
    seen: list[str] = []

    @contextlib.contextmanager
    def recorder(operation: str, attributes: dict[str, Any]) -> Iterator[None]:
        seen.append(f"open {operation}")
        try:
            yield
        finally:
            seen.append(f"close {operation}")

    tracers = TracerProvider(shutdown_on_exit=False)
    tracers.add_span_processor(FailingProcessor("end"))
    remove = on_span(recorder)  # entered first, so closed after the failing span
    stop = instrument(tracer_provider=tracers, metrics=False)
    try:
        with Session(sqlite.engine) as s, s.begin():
            assert Invoice.flow.pay(s, 1).outcome is Outcome.APPLIED
    finally:
        stop()
        remove()
        tracers.shutdown()
    assert seen == ["open trigger", "close trigger"]
    assert _invoice(sqlite.engine, 1) == ("paid", 0, None)
    assert any(r.name == "stateguard.observe" and r.levelno == logging.ERROR for r in caplog.records)


@pytest.mark.failing_observer
@pytest.mark.cancel
def test_an_observers_keyboard_interrupt_is_not_swallowed(sqlite: Backend, tables: Tables) -> None:
    """Only Exceptions are swallowed: a KeyboardInterrupt from an observer still reaches the caller."""
    tables.ready(sqlite)
    with Session(sqlite.engine) as s, s.begin():
        s.add(Invoice(id=1))

    def interrupt(event: GuardEvent) -> None:
        raise KeyboardInterrupt

    remove = on_event(interrupt)
    try:
        with Session(sqlite.engine) as s, s.begin(), pytest.raises(KeyboardInterrupt):
            Invoice.flow.pay(s, 1)
    finally:
        remove()


# --------------------------------------------------------------------------
# AsyncSession calls
# --------------------------------------------------------------------------

ASYNC_DRIVER = {"sqlite": "aiosqlite", "postgresql": "asyncpg", "mariadb": "aiomysql"}


async def async_trigger(s: AsyncSession) -> None:
    assert (await Invoice.flow.pay(s, 1)).outcome is Outcome.APPLIED


async def async_many(s: AsyncSession) -> None:
    results = await Invoice.flow.pay.many(s, [1, 2])
    assert {r.outcome for r in results.values()} == {Outcome.APPLIED}


async def async_counters(s: AsyncSession) -> None:
    assert (await decrement(s, Invoice.amount, 1, by=3)).outcome is Outcome.APPLIED


async def async_emit(s: AsyncSession) -> None:
    assert isinstance(await emit(s, "invoice.paid", {"id": 1}), int)


async def async_insert_once(s: AsyncSession) -> None:
    assert (await insert_once(s, Invoice, {"id": 3, "amount": 4})).outcome is Outcome.APPLIED


async def async_idempotent(s: AsyncSession) -> None:
    async with idempotent(s, scope="pay", key="k-1", fingerprint=1) as call:
        assert not call.replayed
        await Invoice.flow.pay(s, 1)
        await call.complete({"paid": 1})


#: (the call, the operations whose spans it opens, what the rows are after its commit)
ASYNC_CALLS: dict[str, tuple[Callable[[AsyncSession], Awaitable[None]], tuple[str, ...], Any]] = {
    "trigger": (async_trigger, ("trigger",), [("paid", 10, None), ("open", 0, None), None]),
    "many": (async_many, ("many",), [("paid", 10, None), ("paid", 0, None), None]),
    "counters": (async_counters, ("decrement",), [("open", 7, None), ("open", 0, None), None]),
    "emit": (async_emit, ("emit",), [("open", 10, None), ("open", 0, None), None]),
    "insert_once": (
        async_insert_once,
        ("insert_once",),
        [("open", 10, None), ("open", 0, None), ("open", 4, None)],
    ),
    "idempotent": (async_idempotent, ("trigger",), [("paid", 10, None), ("open", 0, None), None]),
}


@pytest.mark.failing_observer
@pytest.mark.parametrize("call", list(ASYNC_CALLS))
def test_async_session_calls_keep_their_results(
    call: str, backend: Backend, db: Engine, broken: Broken, caplog: pytest.LogCaptureFixture
) -> None:
    """Each guarded call awaited on an AsyncSession returns what it returns unobserved and commits."""
    run, operations, rows = ASYNC_CALLS[call]
    target = async_target(ASYNC_DRIVER[backend.name], backend)

    async def main() -> None:
        engine = target.engine()
        try:
            async with AsyncSession(engine) as s, s.begin():
                await run(s)
        finally:
            await engine.dispose()

    asyncio.run(main())
    assert [_invoice(db, k) for k in (1, 2, 3)] == rows
    if call == "emit":
        assert _outbox_rows(db) == 1
    broken.check(caplog, *operations)


# --------------------------------------------------------------------------
# Redis locks and tokens
# --------------------------------------------------------------------------


@pytest.mark.failing_observer
def test_redis_lock_is_held_and_released(
    redis_client: Any, lock_name: str, broken: Broken, caplog: pytest.LogCaptureFixture
) -> None:
    """RedisLock.acquire() returns its fence with the lock really held; release() really frees it."""
    lock = RedisLock(redis_client, lock_name, ttl=timedelta(seconds=30))
    fence = lock.acquire(blocking_timeout=0)
    assert isinstance(fence, int) and fence >= 1
    assert lock.owned() and lock.locked()
    lock.release()
    assert not lock.locked()
    with lock as again:
        assert again > fence and lock.owned()
    assert not lock.locked()
    broken.check(caplog, "redis_lock.acquire", "redis_lock.release")


@pytest.mark.failing_observer
def test_redis_tokens_keep_their_outcomes(
    redis_client: Any, broken: Broken, caplog: pytest.LogCaptureFixture
) -> None:
    """RedisTokens.issue() returns a token that consume() takes once, then reports REPEATED."""
    tokens = RedisTokens(redis_client)
    scope = f"observe-{uuid.uuid4().hex[:8]}"
    token = tokens.issue(scope=scope, ttl=timedelta(minutes=1))
    assert tokens.consume(token, scope=scope).outcome is Outcome.APPLIED
    assert tokens.consume(token, scope=scope).outcome is Outcome.REPEATED
    broken.check(caplog, "redis_token.issue", "redis_token.consume")


@pytest.mark.failing_observer
def test_async_redis_lock_is_held_and_released(
    redis_client: Any, lock_name: str, broken: Broken, caplog: pytest.LogCaptureFixture
) -> None:
    """AsyncRedisLock.acquire() returns its fence with the lock held; release and async with free it."""
    import redis.asyncio

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(REDIS_URL)
        try:
            lock = AsyncRedisLock(client, lock_name, ttl=timedelta(seconds=30))
            fence = await lock.acquire(blocking_timeout=0)
            assert fence >= 1 and await lock.owned()
            await lock.release()
            assert not await lock.locked()
            async with lock as again:
                assert again > fence and await lock.owned()
            assert not await lock.locked()
            tokens = AsyncRedisTokens(client)
            scope = f"observe-{uuid.uuid4().hex[:8]}"
            token = await tokens.issue(scope=scope, ttl=timedelta(minutes=1))
            assert (await tokens.consume(token, scope=scope)).outcome is Outcome.APPLIED
        finally:
            await client.aclose()

    asyncio.run(main())
    assert not RedisLock(redis_client, lock_name, ttl=timedelta(seconds=30)).locked()
    broken.check(caplog, "redis_lock.acquire", "redis_lock.release", "redis_token.consume")


# --------------------------------------------------------------------------
# ZooKeeper lock
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zookeeper() -> Iterator[str]:
    """The hosts of a private standalone ZooKeeper (skips loudly, fails in CI, without zookeeperd)."""
    pytest.importorskip("kazoo", reason="!!! SKIPPED: kazoo is not installed (pip install -e '.[test]')")
    from tests._support.zookeeper_server import ZooKeeperServer

    with ZooKeeperServer() as running:
        yield running.hosts


@pytest.mark.failing_observer
def test_zookeeper_lock_is_held_and_released(
    zookeeper: str, broken: Broken, caplog: pytest.LogCaptureFixture
) -> None:
    """ZooKeeperLock.acquire() returns its fence with the lock held; release() deletes its znode."""
    from stateguard import ZooKeeperLock
    from tests._support.zk_workers import client_for

    client = client_for(zookeeper)
    try:
        path = f"/sg-tests/{uuid.uuid4().hex[:12]}/lock"
        lock = ZooKeeperLock(client, path)
        fence = lock.acquire(timeout=0)
        assert fence == lock.fence and lock.is_held()
        lock.release()
        assert not lock.is_held() and client.get_children(path) == []
    finally:
        client.stop()
        client.close()
    broken.check(caplog, "zookeeper_lock.acquire", "zookeeper_lock.release")
