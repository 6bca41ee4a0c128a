"""The outbox at its edges: per-model binds, and relay leases decided on the database's clock while the
application's clock is hours off (issue 16, attacked the way issue 15 attacks every promise)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from stateguard import CallableSink, OutboxEvent, Relay, create_tables, drop_tables, emit
from stateguard.tables import outbox

from ._support.models import Base, Order
from .conftest import Backend

HOURS = 3 * 3600.0


@pytest.fixture
def engine(backend: Backend) -> Iterator[Engine]:
    eng = backend.create(Base.metadata)
    drop_tables(eng)
    create_tables(eng)
    yield eng
    drop_tables(eng)


def test_emit_through_per_model_binds_is_in_the_models_transaction(engine: Engine) -> None:
    """Session(binds={Base: engine}): the event commits and rolls back with the model's write."""
    with Session(binds={Base: engine}) as s:
        s.add(Order(id=1))
        emit(s, "orders.created", {"id": 1}, key="orders:1")
        s.rollback()
    with Session(binds={Base: engine}) as s, s.begin():
        s.add(Order(id=2))
        emit(s, "orders.created", {"id": 2}, key="orders:2")
    with Session(engine) as s:
        assert s.execute(select(outbox.c.key)).scalars().all() == ["orders:2"]
        assert s.execute(select(func.count()).select_from(Order)).scalar_one() == 1


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


def test_a_live_claim_is_not_taken_over_whatever_the_application_clock(engine: Engine, skewed: float) -> None:
    """Relay A holds a 30 s lease while B runs: B claims nothing, with the app clock 3 h off."""
    with Session(engine) as s, s.begin():
        first = emit(s, "t", {"n": 1}, key="k")
    seen: list[tuple[str, int]] = []
    Relay(engine, _nested_relay(engine, 0.0, seen), lease=timedelta(seconds=30)).run_once()
    assert seen == [("A", first)]


def test_an_expired_claim_is_taken_over_whatever_the_application_clock(engine: Engine, skewed: float) -> None:
    """Relay A's 300 ms lease ends while it publishes: B republishes (at least once), app clock 3 h off."""
    with Session(engine) as s, s.begin():
        first = emit(s, "t", {"n": 1}, key="k")
    seen: list[tuple[str, int]] = []
    Relay(engine, _nested_relay(engine, 0.6, seen), lease=timedelta(milliseconds=300)).run_once()
    assert seen == [("A", first), ("B", first)]
