"""emit(): an event stored in the caller's transaction, visible only after its COMMIT, its payload
checked before anything is sent and read back exactly as emitted."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, select, text
from sqlalchemy.orm import Session

from stateguard import CallableSink, InvalidArgument, Relay, create_tables, drop_tables, emit, purge_published
from stateguard.tables import outbox
from tests._support.models import Base, Order

from ..conftest import Backend, count_statements
from ._events import Recorder, emit_one, event_rows


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
    rows = event_rows(engine)
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
    assert event_rows(engine) == [] and sink.batches == []


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
    assert event_rows(engine) == []


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
        assert event_rows(engine) == []
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
    event_id = emit_one(engine, "t", payload, key="注文-1")
    sink = Recorder()
    assert Relay(engine, sink).run_once() == 1
    [[event]] = sink.batches
    assert (event.id, event.key, event.payload) == (event_id, "注文-1", payload)
    assert json.loads(event.payload_json()) == payload


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


@pytest.fixture
def models_engine(backend: Backend) -> Iterator[Engine]:
    """The backend with the test models' tables and stateguard's."""
    eng = backend.create(Base.metadata)
    drop_tables(eng)
    create_tables(eng)
    yield eng
    drop_tables(eng)


def test_emit_through_per_model_binds_is_in_the_models_transaction(models_engine: Engine) -> None:
    """Session(binds={Base: models_engine}): the event commits and rolls back with the model's write."""
    with Session(binds={Base: models_engine}) as s:
        s.add(Order(id=1))
        emit(s, "orders.created", {"id": 1}, key="orders:1")
        s.rollback()
    with Session(binds={Base: models_engine}) as s, s.begin():
        s.add(Order(id=2))
        emit(s, "orders.created", {"id": 2}, key="orders:2")
    with Session(models_engine) as s:
        assert s.execute(select(outbox.c.key)).scalars().all() == ["orders:2"]
        assert s.execute(select(func.count()).select_from(Order)).scalar_one() == 1
