"""Outcome events: every guarded call reports one GuardEvent; DEBUG logging with extra
fields; OpenTelemetry metrics and spans (tested with the SDK's in-memory exporters).

The events are checked against what the calls returned, on every backend and through an
AsyncSession, so a call that reports the wrong outcome (or none) fails here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, Integer, String
from sqlalchemy.orm import Mapped, Session, mapped_column

from stateguard import (
    GuardEvent,
    InvalidArgument,
    Outcome,
    consume_once,
    consume_token,
    decrement,
    guarded_update,
    increment,
    insert_once,
    issue_token,
    on_event,
    release,
    reserve,
    row_lock,
)
from stateguard import observe as observe_module
from tests._support.models import Base, Order
from tests.conftest import REDIS_URL, Backend, capable


class Shelf(Base):
    """A counter and a unique column for insert_once."""

    __tablename__ = "observe_shelves"
    id: Mapped[int] = mapped_column(primary_key=True)
    sku: Mapped[str] = mapped_column(String(20), unique=True)
    amount: Mapped[int] = mapped_column(Integer, default=0)


@pytest.fixture
def events() -> Iterator[list[GuardEvent]]:
    seen: list[GuardEvent] = []
    remove = on_event(seen.append)
    yield seen
    remove()
    assert observe_module.hooked is False


@pytest.fixture
def db(engine: Engine) -> Iterator[Engine]:
    Base.metadata.drop_all(engine, tables=[Order.__table__, Shelf.__table__])
    Base.metadata.create_all(engine, tables=[Order.__table__, Shelf.__table__])
    with Session(engine) as s, s.begin():
        s.add_all([Order(id=i) for i in (1, 2, 3)])
        s.add(Shelf(id=1, sku="a", amount=5))
    yield engine
    Base.metadata.drop_all(engine, tables=[Order.__table__, Shelf.__table__])


def _last(events: list[GuardEvent], operation: str) -> GuardEvent:
    found = [e for e in events if e.operation == operation]
    assert found, f"no {operation} event among {[e.operation for e in events]}"
    return found[-1]


def test_every_session_call_reports_its_outcome(
    backend: Backend, db: Engine, events: list[GuardEvent]
) -> None:
    """One event per call, with the outcome the call returned, its model, trigger and backend."""
    expected_backend = "mysql" if backend.name == "mariadb" else backend.name
    calls: list[tuple[str, str, Any]] = []

    def check(operation: str, result: Any, outcome: str, model: str | None = None) -> None:
        event = _last(events, operation)
        assert event.outcome == outcome
        if hasattr(result, "outcome"):
            assert event.outcome == result.outcome.name
        if model is not None:
            assert event.model == model
        assert event.backend == expected_backend
        assert event.duration > 0
        assert event.error is None
        calls.append((operation, outcome, model))

    with Session(db) as s, s.begin():
        check("trigger", Order.flow.pay(s, 1), "APPLIED", "Order")
        assert _last(events, "trigger").trigger == "pay"
        check("trigger", Order.flow.pay(s, 1), "REPEATED", "Order")
        check("trigger", Order.flow.ship(s, 2), "REJECTED", "Order")
        check("trigger", Order.flow.pay(s, 99), "NOT_FOUND", "Order")
        many = Order.flow.pay.many(s, [1, 2, 98])
        event = _last(events, "many")
        assert event.counts == {"APPLIED": 1, "REPEATED": 1, "NOT_FOUND": 1}
        assert event.outcome == "MIXED" and event.model == "Order" and event.trigger == "pay"
        assert sorted(r.outcome.name for r in many.values()) == ["APPLIED", "NOT_FOUND", "REPEATED"]
        applied = Order.flow.cancel.where(s, Order.id == 3)
        assert _last(events, "where").counts == {"APPLIED": len(applied)} == {"APPLIED": 1}
        version = s.get(Order, 1).version  # type: ignore[union-attr]
        check(
            "guarded_update",
            guarded_update(s, Order, 1, {"note": "x"}, expected_version=version - 1),
            "STALE",
            "Order",
        )
        check("decrement", decrement(s, Shelf.amount, 1, by=2), "APPLIED", "Shelf")
        check("decrement", decrement(s, Shelf.amount, 1, by=50), "INSUFFICIENT", "Shelf")
        check("increment", increment(s, Shelf.amount, 1, by=1, ref="r-1"), "APPLIED", "Shelf")
        check("increment", increment(s, Shelf.amount, 1, by=1, ref="r-1"), "REPEATED", "Shelf")
        check("reserve", reserve(s, Shelf.amount, {1: 1}, ref="res-1"), "APPLIED")
        check("release", release(s, Shelf.amount, "res-1"), "APPLIED")
        check("insert_once", insert_once(s, Shelf, {"id": 2, "sku": "b"}), "APPLIED", "Shelf")
        check("insert_once", insert_once(s, Shelf, {"id": 3, "sku": "b"}), "REPEATED", "Shelf")
        check("consume_once", consume_once(s, "mailer", "m-1"), "APPLIED")
        check("consume_once", consume_once(s, "mailer", "m-1"), "REPEATED")
        token = issue_token(s, scope="reset", ttl=__import__("datetime").timedelta(minutes=5))
        check("issue_token", token, "OK")
        check("consume_token", consume_token(s, token, scope="reset"), "APPLIED")
        check("consume_token", consume_token(s, token, scope="reset"), "REPEATED")
        if not capable(backend, "row_locks"):
            with pytest.raises(Exception, match="SQLite has no row locks"):
                row_lock(s, Order, 1)
            assert _last(events, "row_lock").outcome == "NotSupported"
        else:
            row_lock(s, Order, 1)
            check("row_lock", None, "OK")
    assert len(calls) == (19 if capable(backend, "row_locks") else 18)


def test_a_call_that_raises_reports_the_error_and_still_raises(
    sqlite: Backend, events: list[GuardEvent]
) -> None:
    Base.metadata.create_all(sqlite.engine, tables=[Order.__table__])
    with Session(sqlite.engine) as s, s.begin(), pytest.raises(InvalidArgument) as raised:
        Order.flow.pay(s, "not an int")
    event = _last(events, "trigger")
    assert (event.outcome, event.model, event.trigger) == ("InvalidArgument", "Order", "pay")
    assert event.error is raised.value


def test_a_failing_listener_never_breaks_the_call(
    sqlite: Backend, events: list[GuardEvent], caplog: pytest.LogCaptureFixture
) -> None:
    def broken(event: GuardEvent) -> None:
        raise RuntimeError("listener bug")

    Base.metadata.create_all(sqlite.engine, tables=[Order.__table__])
    remove = on_event(broken)
    try:
        with Session(sqlite.engine) as s, s.begin():
            s.add(Order(id=7))
            s.flush()
            assert Order.flow.pay(s, 7).outcome is Outcome.APPLIED
    finally:
        remove()
    assert _last(events, "trigger").outcome == "APPLIED"  # the other listener still ran
    assert any("listener" in r.getMessage() and r.name == "stateguard.observe" for r in caplog.records)


def test_on_event_refuses_what_it_cannot_call() -> None:
    with pytest.raises(InvalidArgument, match="callable"):
        on_event("print")  # type: ignore[arg-type]


def test_debug_logging_carries_the_facts_and_is_quiet_by_default(
    sqlite: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    Base.metadata.create_all(sqlite.engine, tables=[Shelf.__table__])
    with Session(sqlite.engine) as s, s.begin():
        s.add(Shelf(id=1, sku="a", amount=1))
    caplog.set_level(logging.WARNING)
    with Session(sqlite.engine) as s, s.begin():
        decrement(s, Shelf.amount, 1, by=1)
    assert [r for r in caplog.records if r.name.startswith("stateguard")] == []
    caplog.set_level(logging.DEBUG, logger="stateguard.counters")
    with Session(sqlite.engine) as s, s.begin():
        decrement(s, Shelf.amount, 1, by=1)
    [record] = [r for r in caplog.records if r.name == "stateguard.counters"]
    assert record.levelno == logging.DEBUG
    facts = {k: getattr(record, k) for k in ("sg_operation", "sg_model", "sg_outcome", "sg_backend")}
    assert facts == {
        "sg_operation": "decrement",
        "sg_model": "Shelf",
        "sg_outcome": "INSUFFICIENT",
        "sg_backend": "sqlite",
    }
    assert record.sg_duration_ms > 0  # type: ignore[attr-defined]


def test_async_session_calls_report_the_same(tmp_path: Path, events: list[GuardEvent]) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from stateguard import create_tables

    async def main() -> None:
        engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'a.db'}")
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all, tables=[Order.__table__, Shelf.__table__])
        await create_tables(engine)
        async with AsyncSession(engine) as s, s.begin():
            s.add(Order(id=1))
            s.add(Shelf(id=1, sku="a", amount=1))
            await s.flush()
            await Order.flow.pay(s, 1)
            await Order.flow.pay(s, 1)
            await Order.flow.ship.many(s, [1])
            await decrement(s, Shelf.amount, 1, by=5)
        await engine.dispose()

    asyncio.run(main())
    assert [(e.operation, e.outcome, e.model, e.backend) for e in events] == [
        ("trigger", "APPLIED", "Order", "sqlite"),
        ("trigger", "REPEATED", "Order", "sqlite"),
        ("many", "APPLIED", "Order", "sqlite"),
        ("decrement", "INSUFFICIENT", "Shelf", "sqlite"),
    ]


# --------------------------------------------------------------------------
# OpenTelemetry
# --------------------------------------------------------------------------


def test_otel_metrics_and_spans_nest_with_sqlalchemys_instrumentation(pg: Backend) -> None:
    from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from stateguard.otel import instrument

    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    exporter = InMemorySpanExporter()
    tracers = TracerProvider()
    tracers.add_span_processor(SimpleSpanProcessor(exporter))
    engine = pg.engine
    Base.metadata.drop_all(engine, tables=[Order.__table__])
    Base.metadata.create_all(engine, tables=[Order.__table__])
    with Session(engine) as s, s.begin():
        s.add_all([Order(id=1), Order(id=2)])
    SQLAlchemyInstrumentor().instrument(engine=engine, tracer_provider=tracers, skip_dep_check=True)
    stop = instrument(meter_provider=meters, tracer_provider=tracers)
    try:
        app = tracers.get_tracer("app")
        with app.start_as_current_span("handle request"), Session(engine) as s, s.begin():
            Order.flow.pay(s, 1)
            Order.flow.pay(s, 1)
            Order.flow.pay.many(s, [1, 2])
            with pytest.raises(InvalidArgument):
                Order.flow.pay(s, "x")
    finally:
        stop()
        SQLAlchemyInstrumentor().uninstrument()
        Base.metadata.drop_all(engine, tables=[Order.__table__])
    spans = exporter.get_finished_spans()
    request = next(sp for sp in spans if sp.name == "handle request")
    ours = [sp for sp in spans if sp.name.startswith("stateguard ")]
    assert [sp.name for sp in ours] == ["stateguard trigger"] * 2 + ["stateguard many", "stateguard trigger"]
    assert all(sp.parent is not None and sp.parent.span_id == request.context.span_id for sp in ours)
    assert [sp.attributes["stateguard.outcome"] for sp in ours] == [
        "APPLIED",
        "REPEATED",
        "MIXED",  # type: ignore[index]
        "InvalidArgument",
    ]
    assert ours[3].status.status_code.name == "ERROR"
    # The UPDATE of the first pay is a child of its stateguard span (SQLAlchemy's own span).
    first = ours[0]
    children = [sp for sp in spans if sp.parent is not None and sp.parent.span_id == first.context.span_id]
    statements = [str((sp.attributes or {}).get("db.statement", "")) for sp in children]
    assert any(text.startswith("UPDATE orders") for text in statements), [sp.name for sp in children]

    data = reader.get_metrics_data()
    metrics = {m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    calls = {
        (p.attributes["stateguard.operation"], p.attributes["stateguard.outcome"]): p.value  # type: ignore[index]
        for p in metrics["stateguard.calls"].data.data_points
    }
    assert calls == {
        ("trigger", "APPLIED"): 1,
        ("trigger", "REPEATED"): 1,
        ("many", "APPLIED"): 1,
        ("many", "REPEATED"): 1,
        ("trigger", "InvalidArgument"): 1,
    }
    durations = metrics["stateguard.duration"].data.data_points
    assert sum(p.count for p in durations) == 4
    assert all(p.attributes["db.system"] == "postgresql" for p in durations)  # type: ignore[index]


def test_instrument_needs_something_to_record() -> None:
    from stateguard.otel import instrument

    with pytest.raises(InvalidArgument):
        instrument(spans=False, metrics=False)


def test_advisory_lock_reports_its_acquisition(pg: Backend, events: list[GuardEvent]) -> None:
    from stateguard import LockNotAcquired, advisory_lock

    with Session(pg.engine) as holder, holder.begin(), advisory_lock(holder, "observe-lock"):
        assert _last(events, "advisory_lock").outcome == "OK"
        with Session(pg.engine) as other, other.begin(), pytest.raises(LockNotAcquired):
            with advisory_lock(other, "observe-lock", timeout=0.05):
                pass  # pragma: no cover - never entered
    event = _last(events, "advisory_lock")
    assert (event.outcome, event.scope, event.backend) == ("LockNotAcquired", "observe-lock", "postgresql")
    assert event.duration >= 0.05


def test_retry_on_conflict_reports_the_retries_it_took(events: list[GuardEvent]) -> None:
    from stateguard import SerializationConflict, retry_on_conflict

    calls = []

    def unit() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise SerializationConflict("simulated 40001 from the unit of work")
        return "done"

    assert retry_on_conflict(unit, backoff=0) == "done"
    event = _last(events, "retry_on_conflict")
    assert (event.outcome, event.retries, event.error) == ("OK", 2, None)

    def always() -> str:
        raise SerializationConflict("always loses")

    with pytest.raises(SerializationConflict):
        retry_on_conflict(always, attempts=2, backoff=0)
    event = _last(events, "retry_on_conflict")
    assert (event.outcome, event.retries) == ("SerializationConflict", 1)


def test_next_id_reports(sqlite: Backend, events: list[GuardEvent]) -> None:
    from stateguard import Snowflake, create_tables

    create_tables(sqlite.engine)
    with Snowflake(sqlite.engine) as ids:
        first = ids.next_id()
        assert ids.next_id() > first
    found = [e for e in events if e.operation == "next_id"]
    assert [e.outcome for e in found] == ["OK", "OK"] and found[0].backend == "sqlite"


def test_redis_tokens_and_locks_report(redis_client: Any, events: list[GuardEvent]) -> None:
    import uuid
    from datetime import timedelta

    import redis.asyncio

    from stateguard import AsyncRedisTokens, LockNotAcquired, RedisLock, RedisTokens

    scope = f"observe-{uuid.uuid4().hex[:8]}"
    tokens = RedisTokens(redis_client)
    token = tokens.issue(scope=scope, ttl=timedelta(minutes=1))
    assert tokens.consume(token, scope=scope).outcome is Outcome.APPLIED
    tokens.consume(token, scope=scope)
    name = f"{scope}-lock"
    with RedisLock(redis_client, name, ttl=timedelta(seconds=10)):
        with pytest.raises(LockNotAcquired):
            RedisLock(redis_client, name, ttl=timedelta(seconds=10)).acquire(blocking_timeout=0)

    async def consume_async() -> None:
        client = redis.asyncio.Redis.from_url(REDIS_URL)
        try:
            other = AsyncRedisTokens(client)
            await other.consume(await other.issue(scope=scope, ttl=timedelta(minutes=1)), scope=scope)
        finally:
            await client.aclose()

    asyncio.run(consume_async())
    assert [(e.operation, e.outcome) for e in events] == [
        ("redis_token.issue", "OK"),
        ("redis_token.consume", "APPLIED"),
        ("redis_token.consume", "REPEATED"),
        ("redis_lock.acquire", "OK"),
        ("redis_lock.acquire", "LockNotAcquired"),
        ("redis_lock.release", "OK"),
        ("redis_token.issue", "OK"),
        ("redis_token.consume", "APPLIED"),
    ]
    assert {e.backend for e in events} == {"redis"}
    assert {e.scope for e in events} == {scope, name}


def test_idempotency_keys_report_their_kinds(sqlite: Backend, events: list[GuardEvent]) -> None:
    from stateguard import create_tables, idempotent

    create_tables(sqlite.engine)
    for _ in range(2):
        with (
            Session(sqlite.engine) as s,
            s.begin(),
            idempotent(s, scope="pay", key="k-1", fingerprint=1) as call,
        ):
            if not call.replayed:
                call.complete({"ok": True})
    kinds = [(e.outcome, e.scope) for e in events if e.operation == "idempotency"]
    assert kinds == [("claimed", "pay"), ("completed", "pay"), ("replayed", "pay")]


def test_striped_counters_report_under_their_own_names(sqlite: Backend, events: list[GuardEvent]) -> None:
    from stateguard import StripedCounter, create_tables

    create_tables(sqlite.engine)
    stock = StripedCounter("observe-stock", stripes=2)
    with Session(sqlite.engine) as s, s.begin():
        stock.create(s, "sku-1", amount=3)
        stock.decrement(s, "sku-1", by=2, ref="o-1")
        stock.decrement(s, "sku-1", by=2, ref="o-1")
        stock.decrement(s, "sku-1", by=5)
    got = [(e.operation, e.outcome, e.scope) for e in events]
    assert got == [
        ("striped.create", "APPLIED", "observe-stock"),
        ("striped.decrement", "APPLIED", "observe-stock"),
        ("striped.decrement", "REPEATED", "observe-stock"),
        ("striped.decrement", "INSUFFICIENT", "observe-stock"),
    ]
    assert {e.backend for e in events} == {"sqlite"}


def test_on_event_refuses_an_async_listener() -> None:
    async def listener(event: GuardEvent) -> None:  # pragma: no cover - never registered
        pass

    class AsyncCallable:
        async def __call__(self, event: GuardEvent) -> None:  # pragma: no cover
            pass

    for bad in (listener, AsyncCallable()):
        with pytest.raises(InvalidArgument, match="not async"):
            on_event(bad)
    assert observe_module.hooked is False


def test_instrument_twice_is_refused_until_the_first_is_stopped() -> None:
    from opentelemetry.sdk.metrics import MeterProvider

    from stateguard.otel import instrument

    stop = instrument(meter_provider=MeterProvider(), spans=False)
    try:
        with pytest.raises(InvalidArgument, match="already active"):
            instrument(meter_provider=MeterProvider(), spans=False)
    finally:
        stop()
    stop()  # twice is harmless
    instrument(meter_provider=MeterProvider(), spans=False)()
    assert observe_module.hooked is False
