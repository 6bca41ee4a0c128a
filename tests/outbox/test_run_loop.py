"""Relay.run() and AsyncRelay.run() survive every error a sink raises and end only when stopped, or
with a clear ConfigurationError when the relay's own table is missing."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
from sqlalchemy import Engine, select, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from stateguard import (
    AsyncRelay,
    ConfigurationError,
    InvalidArgument,
    LockLost,
    OutboxEvent,
    Relay,
    StateguardError,
    create_tables,
    drop_tables,
    emit,
)
from stateguard.tables import outbox

from .._support.async_helpers import AsyncTarget
from ..conftest import Backend

pytestmark = pytest.mark.hostile


class BrokerGone(KeyError, StateguardError):
    """An error that is a StateguardError and a builtin at once."""


ERRORS: dict[str, Any] = {
    "ConfigurationError": lambda: ConfigurationError("the sink's exchange is not declared"),
    "InvalidArgument": lambda: InvalidArgument("the sink refused an argument"),
    "LockLost": lambda: LockLost("the sink's lock was lost"),
    "StateguardError": lambda: StateguardError("a bare StateguardError"),
    "RuntimeError": lambda: RuntimeError("broker down"),
    "StopIteration": lambda: StopIteration("a sink iterating too far"),
    "KeyError+StateguardError": lambda: BrokerGone("gone"),
}


class FailingFirst:
    """A sink that raises for its first ``n`` calls, then accepts every batch."""

    def __init__(self, make_error: Any, n: int) -> None:
        self.make_error = make_error
        self.left = n
        self.calls = 0
        self.taken: list[int] = []

    def publish(self, events: Sequence[OutboxEvent]) -> None:
        self.calls += 1
        if self.left > 0:
            self.left -= 1
            raise self.make_error()
        self.taken.extend(e.id for e in events)


def _emit(engine: Engine, key: str | None) -> int:
    with Session(engine) as session, session.begin():
        return emit(session, "t", {}, key=key)


@pytest.mark.parametrize("error", list(ERRORS))
def test_run_survives_any_sink_error_and_stops_when_asked(
    backend: Backend, engine: Engine, error: str
) -> None:
    """A sink raising this error for 6 calls: run() keeps going, publishes the event, and ends on stop."""
    event_id = _emit(engine, "k")
    sink = FailingFirst(ERRORS[error], 6)
    relay = Relay(engine, sink)
    stop = threading.Event()
    died: list[BaseException] = []

    def work() -> None:
        try:
            relay.run(stop, idle_sleep=0.01)
        except BaseException as e:
            died.append(e)

    thread = threading.Thread(target=work)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not sink.taken and thread.is_alive():
            time.sleep(0.01)
        assert died == [] and thread.is_alive()
        assert sink.taken == [event_id]
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive() and died == []


def test_run_keeps_calling_a_sink_that_always_fails_with_a_bounded_backoff(
    backend: Backend, engine: Engine
) -> None:
    """A sink that always raises: run() tries again and again (backing off) and still ends at once on stop."""
    _emit(engine, None)
    sink = FailingFirst(lambda: ConfigurationError("never configured"), 10**9)
    relay = Relay(engine, sink)
    stop = threading.Event()
    thread = threading.Thread(target=relay.run, args=(stop,), kwargs={"idle_sleep": 0.01})
    thread.start()
    time.sleep(1.5)
    assert thread.is_alive()
    assert sink.calls >= 4
    started = time.monotonic()
    stop.set()
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - started < 2


def test_run_ends_with_a_configuration_error_when_the_outbox_table_is_missing(backend: Backend) -> None:
    """Without stateguard's tables run() raises ConfigurationError naming the fix instead of looping."""
    drop_tables(backend.engine)
    relay = Relay(backend.engine, FailingFirst(RuntimeError, 0))
    with pytest.raises(ConfigurationError, match="alembic upgrade stateguard@head"):
        relay.run(threading.Event(), idle_sleep=0.01)


def test_run_ends_with_a_configuration_error_when_the_outbox_lacks_new_columns(
    backend: Backend, engine: Engine
) -> None:
    """An outbox table from before dead events (no dead_ms column) ends run() with the migration to run."""
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE stateguard_outbox DROP COLUMN last_error"))
    try:
        relay = Relay(engine, FailingFirst(RuntimeError, 0))
        with pytest.raises(ConfigurationError, match="last_error"):
            relay.run(threading.Event(), idle_sleep=0.01)
    finally:
        drop_tables(engine)
        create_tables(engine)


@pytest.mark.parametrize("error", ["ConfigurationError", "RuntimeError"])
def test_async_run_survives_sink_errors_and_stops_when_asked(target: AsyncTarget, error: str) -> None:
    """AsyncRelay.run() with a coroutine sink raising for 4 calls keeps going, publishes, and ends on stop."""

    async def main() -> None:
        engine = target.engine()
        try:
            await drop_tables(engine)
            await create_tables(engine)
            async with AsyncSession(engine) as session, session.begin():
                event_id = await emit(session, "t", {}, key="k")
            sink = FailingFirst(ERRORS[error], 4)

            class Async:
                async def publish(self, events: Sequence[OutboxEvent]) -> None:
                    await asyncio.sleep(0)
                    sink.publish(events)

            stop = asyncio.Event()
            runner = asyncio.create_task(AsyncRelay(engine, Async()).run(stop, idle_sleep=0.01))
            for _ in range(3000):
                if sink.taken or runner.done():
                    break
                await asyncio.sleep(0.01)
            assert not runner.done(), runner.exception() if runner.done() else None
            assert sink.taken == [event_id]
            stop.set()
            await asyncio.wait_for(runner, 10)
            async with engine.connect() as conn:
                published = await conn.scalar(select(outbox.c.published_ms).where(outbox.c.id == event_id))
            assert published is not None
            await drop_tables(engine)
        finally:
            await engine.dispose()

    asyncio.run(main())
