"""Outbox events of APPLIED transitions: StateMachine(events=True) and per-transition "event"."""

from __future__ import annotations

import asyncio
import enum
import json
import threading
from typing import Any

import pytest
from sqlalchemy import ForeignKey, Integer, String, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import ConfigurationError, InvalidArgument, Outcome, StateMachine, version_column
from stateguard.tables import create_tables, drop_tables, outbox
from tests._support.async_helpers import ASYNC_TARGETS, async_target
from tests.conftest import Backend, capable, count_statements


class Base(DeclarativeBase):
    pass


class Parcel(Base):
    """events=True: default topics; 'cancel' has two sources, 'flip' two sources and two destinations."""

    __tablename__ = "ev_parcels"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    status: Mapped[str] = mapped_column(String(20), default="new")
    version: Mapped[int] = version_column()
    note: Mapped[str | None] = mapped_column(String(50))

    flow = StateMachine(
        "status",
        states=["new", "paid", "shipped", "cancelled", "held"],
        transitions=[
            {"trigger": "pay", "source": "new", "dest": "paid"},
            {"trigger": "ship", "source": "paid", "dest": "shipped", "event": "parcel.shipped"},
            {"trigger": "cancel", "source": ["new", "paid"], "dest": "cancelled"},
            {"trigger": "flip", "source": "new", "dest": "held"},
            {"trigger": "flip", "source": "held", "dest": "new"},
        ],
        events=True,
    )


class Memo(Base):
    """No version column, no events=True: only 'send' names an event."""

    __tablename__ = "ev_memos"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    state: Mapped[str] = mapped_column(String(20), default="draft")

    flow = StateMachine(
        "state",
        states=["draft", "sent", "archived"],
        transitions=[
            {"trigger": "send", "source": "draft", "dest": "sent", "event": "memo.sent"},
            {"trigger": "archive", "source": "sent", "dest": "archived"},
        ],
    )


class Slot(Base):
    """A composite primary key."""

    __tablename__ = "ev_slots"
    day: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    room: Mapped[str] = mapped_column(String(20), primary_key=True)
    parcel_id: Mapped[int | None] = mapped_column(ForeignKey("ev_parcels.id"))
    state: Mapped[str] = mapped_column(String(20), default="free")

    flow = StateMachine(
        "state", states=["free", "taken"], transitions=[["take", "free", "taken"]], events=True
    )


class Claim(Base):
    """history=True and events=True together; 'close' has two sources."""

    __tablename__ = "ev_claims"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    status: Mapped[str] = mapped_column(String(20), default="open")
    version: Mapped[int] = version_column()

    flow = StateMachine(
        "status",
        states=["open", "approved", "closed"],
        transitions=[["approve", "open", "approved"], ["close", ["open", "approved"], "closed"]],
        history=True,
        events=True,
    )


class Hue(enum.Enum):
    RED = "r"
    GREEN = "g"
    BLUE = "b"


class Bulb(Base):
    """Enum states stored as member values, with a trigger of several sources and destinations."""

    __tablename__ = "ev_bulbs"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    # A string column of member values: on a sqlalchemy.Enum column a multi-destination trigger
    # binds its CASE values without the column's type and fails, events or not (compile.parts).
    hue: Mapped[str] = mapped_column(String(10), default="r")
    version: Mapped[int] = version_column()

    flow = StateMachine(
        "hue",
        states=Hue,
        transitions=[
            {"trigger": "turn", "source": Hue.RED, "dest": Hue.GREEN},
            {"trigger": "turn", "source": Hue.GREEN, "dest": Hue.BLUE},
        ],
        events=True,
    )


pytestmark = pytest.mark.tables(Base.metadata)


def _parcels(engine: Any, states: dict[int, str]) -> None:
    with Session(engine) as s, s.begin():
        s.add_all([Parcel(id=i, status=st) for i, st in states.items()])


def _events(engine: Any) -> list[tuple[str, str | None, dict[str, Any]]]:
    with engine.connect() as conn:
        rows = conn.execute(select(outbox.c.topic, outbox.c.key, outbox.c.payload).order_by(outbox.c.id))
        return [(t, k, json.loads(p)) for t, k, p in rows]


def _count(engine: Any) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(outbox)).scalar_one())


def _inserts(statements: list[str]) -> list[str]:
    return [x for x in statements if "stateguard_outbox" in x]


def test_applied_transition_writes_one_event_with_its_payload(engine: Any) -> None:
    """An APPLIED call writes one event: default topic, the row's key as text, every payload field."""
    _parcels(engine, {7: "new"})
    with Session(engine) as s, s.begin():
        r = Parcel.flow.pay(s, 7, request_id="req-1", metadata={"by": "user:12", "n": [1, 2]})
        assert r.outcome is Outcome.APPLIED
    assert _events(engine) == [
        (
            "ev_parcels.pay",
            "ev_parcels:7",
            {
                "model": "Parcel",
                "key": 7,
                "trigger": "pay",
                "source": "new",
                "dest": "paid",
                "version": 2,
                "request_id": "req-1",
                "metadata": {"by": "user:12", "n": [1, 2]},
            },
        )
    ]
    with engine.connect() as conn:
        row = conn.execute(select(outbox.c.created_ms, outbox.c.attempts, outbox.c.published_ms)).one()
    assert row.created_ms > 0 and row.attempts == 0 and row.published_ms is None


def test_payload_text_is_the_same_on_every_path(engine: Any) -> None:
    """The payload text is compact JSON in the declared field order, whichever statement wrote it."""
    _parcels(engine, {1: "new", 2: "new"})
    with Session(engine) as s, s.begin():
        Parcel.flow.pay(s, 1)
        Parcel.flow.pay.many(s, [2])
    with engine.connect() as conn:
        texts = conn.execute(select(outbox.c.payload).order_by(outbox.c.id)).scalars().all()
    for text in texts:
        assert text == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)
        assert list(json.loads(text)) == [
            "model",
            "key",
            "trigger",
            "source",
            "dest",
            "version",
            "request_id",
            "metadata",
        ]


def test_no_event_for_repeated_rejected_stale_or_not_found(engine: Any) -> None:
    """REPEATED, REJECTED, STALE and NOT_FOUND write nothing to the outbox."""
    _parcels(engine, {1: "paid", 2: "shipped", 3: "new"})
    with Session(engine) as s, s.begin():
        assert Parcel.flow.pay(s, 1).outcome is Outcome.REPEATED
        assert Parcel.flow.pay(s, 2).outcome is Outcome.REJECTED
        assert Parcel.flow.pay(s, 3, expected_version=5).outcome is Outcome.STALE
        assert Parcel.flow.pay(s, 99).outcome is Outcome.NOT_FOUND
        assert Parcel.flow.cancel(s, 2).outcome is Outcome.REJECTED
        assert Parcel.flow.flip(s, 2).outcome is Outcome.REJECTED
    assert _count(engine) == 0


def test_several_sources_and_destinations_carry_the_real_states(engine: Any) -> None:
    """A trigger with several sources or destinations records the row's real source and dest."""
    _parcels(engine, {1: "paid", 2: "new", 3: "held"})
    with Session(engine) as s, s.begin():
        assert Parcel.flow.cancel(s, 1).applied
        assert Parcel.flow.cancel(s, 2).applied
        assert Parcel.flow.flip(s, 3).state == "new"
        assert Parcel.flow.flip(s, 3).state == "held"
    got = [(p["key"], p["trigger"], p["source"], p["dest"], p["version"]) for _, _, p in _events(engine)]
    assert got == [
        (1, "cancel", "paid", "cancelled", 2),
        (2, "cancel", "new", "cancelled", 2),
        (3, "flip", "held", "new", 2),
        (3, "flip", "new", "held", 3),
    ]


def test_per_transition_event_names_the_topic_and_turns_events_on_for_it_only(engine: Any) -> None:
    """'event' names the topic; a trigger of a machine without events=True writes nothing."""
    with Session(engine) as s, s.begin():
        s.add(Memo(id=1))
    with Session(engine) as s, s.begin():
        assert Memo.flow.send(s, 1, metadata={"to": "ops"}).applied
        assert Memo.flow.archive(s, 1).applied
        with pytest.raises(InvalidArgument, match="writes no events"):
            Memo.flow.archive(s, 1, request_id="r")
    assert _events(engine) == [
        (
            "memo.sent",
            "ev_memos:1",
            {
                "model": "Memo",
                "key": 1,
                "trigger": "send",
                "source": "draft",
                "dest": "sent",
                "version": None,
                "request_id": None,
                "metadata": {"to": "ops"},
            },
        )
    ]
    assert Parcel.flow.ship.topic == "parcel.shipped" and Parcel.flow.pay.topic == "ev_parcels.pay"
    assert Memo.flow.archive.topic is None


def test_call_variants_write_their_events(engine: Any) -> None:
    """values (plain and SQL) and expected_version take the same path: one event each, the values set."""
    _parcels(engine, {1: "new", 2: "new", 3: "new"})
    with Session(engine) as s, s.begin():
        assert Parcel.flow.pay(s, 1, values={"note": "plain"}).applied
        assert Parcel.flow.pay(s, 2, values={"note": func.lower("SQL")}).applied
        assert Parcel.flow.pay(s, 3, expected_version=1).applied
        assert Parcel.flow.ship(s, 3, expected_version=2, values={"note": "v"}).version == 3
    with Session(engine) as s:
        assert [s.get_one(Parcel, i).note for i in (1, 2, 3)] == ["plain", "sql", "v"]
    got = [(t, p["key"], p["version"]) for t, _, p in _events(engine)]
    assert got == [
        ("ev_parcels.pay", 1, 2),
        ("ev_parcels.pay", 2, 2),
        ("ev_parcels.pay", 3, 2),
        ("parcel.shipped", 3, 3),
    ]


def test_enum_states_are_named_in_the_payload(engine: Any) -> None:
    """Enum states appear by member name in source and dest, also when SQL fills them in."""
    with Session(engine) as s, s.begin():
        s.add(Bulb(id=1))
    with Session(engine) as s, s.begin():
        assert Bulb.flow.turn(s, 1).state is Hue.GREEN
        assert Bulb.flow.turn(s, 1).state is Hue.BLUE
    assert [(p["source"], p["dest"], p["version"]) for _, _, p in _events(engine)] == [
        ("RED", "GREEN", 2),
        ("GREEN", "BLUE", 3),
    ]


def test_composite_key_is_a_json_list(engine: Any) -> None:
    """A composite primary key is a JSON list in the payload and its row_key text as the event key."""
    with Session(engine) as s, s.begin():
        s.add(Slot(day=3, room="b-1"))
    with Session(engine) as s, s.begin():
        assert Slot.flow.take(s, (3, "b-1")).applied
    [(topic, key, payload)] = _events(engine)
    assert topic == "ev_slots.take" and key == 'ev_slots:[3,"b-1"]' and payload["key"] == [3, "b-1"]


@pytest.mark.rollback
def test_rollback_discards_the_event(engine: Any) -> None:
    """A rolled-back transition leaves no event, and a savepoint rollback only its own."""
    _parcels(engine, {1: "new", 2: "new"})
    with Session(engine) as s:
        with s.begin():
            assert Parcel.flow.pay(s, 1).applied
            s.rollback()
    assert _count(engine) == 0
    with Session(engine) as s, s.begin():
        with s.begin_nested() as nested:
            assert Parcel.flow.pay(s, 1).applied
            nested.rollback()
        assert Parcel.flow.pay(s, 2).applied
    assert [p["key"] for _, _, p in _events(engine)] == [2]


def test_many_writes_one_event_per_applied_row_in_one_insert(engine: Any) -> None:
    """many() writes one event per APPLIED key with one multi-row INSERT, none for the others."""
    _parcels(engine, {1: "new", 2: "paid", 3: "new", 4: "shipped", 5: "paid"})
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as c:
            results = Parcel.flow.cancel.many(s, [1, 2, 3, 4, 99], metadata={"batch": 7})
        assert len(_inserts(c.statements)) == 1
    assert {k: r.outcome for k, r in results.items()} == {
        1: Outcome.APPLIED,
        2: Outcome.APPLIED,
        3: Outcome.APPLIED,
        4: Outcome.REJECTED,
        99: Outcome.NOT_FOUND,
    }
    got = [(k, p["key"], p["source"], p["metadata"]) for _, k, p in _events(engine)]
    assert got == [
        ("ev_parcels:1", 1, "new", {"batch": 7}),
        ("ev_parcels:2", 2, "paid", {"batch": 7}),
        ("ev_parcels:3", 3, "new", {"batch": 7}),
    ]
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as c:
            Parcel.flow.ship.many(s, [5, 1])
        assert len(_inserts(c.statements)) == 1
    assert [(t, p["key"], p["version"]) for t, _, p in _events(engine)][-1] == ("parcel.shipped", 5, 2)


def test_where_writes_one_event_per_swept_row_in_one_insert(engine: Any) -> None:
    """where() writes one event per row it moved, with one INSERT for the sweep."""
    _parcels(engine, {1: "new", 2: "new", 3: "paid", 4: "new"})
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as c:
            moved = Parcel.flow.pay.where(s, Parcel.id < 4)
        assert len(_inserts(c.statements)) == 1
        assert sorted(moved) == [1, 2]
        assert Parcel.flow.cancel.where(s, Parcel.id >= 3, limit=5) == [3, 4]
        assert Parcel.flow.ship.where(s, Parcel.id > 100) == []
    got = [(t, p["key"], p["source"]) for t, _, p in _events(engine)]
    assert sorted(got) == [
        ("ev_parcels.cancel", 3, "paid"),
        ("ev_parcels.cancel", 4, "new"),
        ("ev_parcels.pay", 1, "new"),
        ("ev_parcels.pay", 2, "new"),
    ]


def test_statement_counts(engine: Any, backend: Backend) -> None:
    """APPLIED with its event: 1 statement on PostgreSQL, 2 elsewhere; REJECTED costs as without events."""
    _parcels(engine, {1: "new", 2: "paid", 3: "shipped", 4: "held"})
    with Session(engine) as s:
        s.add(Memo(id=1, state="draft"))
        s.flush()
        with count_statements(engine) as c:
            assert Parcel.flow.pay(s, 1).applied
        assert len(c) == (1 if capable(backend, "writable_cte") else 2)
        with count_statements(engine) as c:
            assert Parcel.flow.cancel(s, 2).applied
        # Several sources: elsewhere a locking read learns the real source first.
        assert len(c) == (1 if capable(backend, "writable_cte") else 3)
        with count_statements(engine) as c:
            assert Parcel.flow.flip(s, 4).applied
        assert len(c) == (1 if capable(backend, "writable_cte") else 3)
        with count_statements(engine) as c:
            assert Parcel.flow.pay(s, 3).outcome is Outcome.REJECTED
        rejected = len(c)
        with count_statements(engine) as c:
            assert Memo.flow.archive(s, 1).outcome is Outcome.REJECTED
        # The same UPDATE + classifying read as a trigger without events ('archive').
        assert rejected == len(c) == 2
        s.rollback()


def test_concurrent_calls_write_exactly_one_event_per_applied_transition(
    engine: Any, backend: Backend
) -> None:
    """8 threads firing the same triggers on the same rows: one event per APPLIED call, none for the rest."""
    n = 12
    _parcels(engine, {i: ("new" if i % 2 else "paid") for i in range(1, n + 1)})
    workers = 8
    barrier = threading.Barrier(workers)
    applied: list[tuple[str, int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    eng = backend.new_engine(pool_size=workers)

    def work(w: int) -> None:
        try:
            barrier.wait()
            for i in range(1, n + 1):
                trigger = "cancel" if (i + w) % 3 == 0 else ("pay" if i % 2 else "ship")
                with Session(eng) as s, s.begin():
                    r = Parcel.flow.fire(s, trigger, i)
                if r.applied:
                    with lock:
                        applied.append((trigger, i))
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        eng.dispose()
    assert not errors, errors
    got = sorted((p["trigger"], p["key"]) for _, _, p in _events(engine))
    assert got == sorted(applied)
    # Per row, versions 2, 3, ... without gaps or repeats, and each event's source is the previous dest.
    by_key: dict[int, list[dict[str, Any]]] = {}
    for _, _, p in _events(engine):
        by_key.setdefault(p["key"], []).append(p)
    for key, chain in by_key.items():
        assert [p["version"] for p in chain] == list(range(2, 2 + len(chain)))
        states = ["new" if key % 2 else "paid"] + [p["dest"] for p in chain]
        assert [p["source"] for p in chain] == states[:-1]


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("transition", "kwargs", "needle"),
    [
        ({"trigger": "go", "source": "a", "dest": "b", "event": ""}, {}, "non-empty string"),
        ({"trigger": "go", "source": "a", "dest": "b", "event": 3}, {}, "non-empty string"),
        ({"trigger": "go", "source": "a", "dest": "b", "event": None}, {}, "non-empty string"),
        ({"trigger": "go", "source": "a", "dest": "b", "event": "x" * 201}, {}, "at most 200"),
        ({"trigger": "go", "source": "a", "dest": "b"}, {"events": "yes"}, "True or False"),
    ],
)
def test_bad_event_declarations_fail_at_class_definition(
    transition: dict[str, Any], kwargs: dict[str, Any], needle: str
) -> None:
    """An 'event' that is not a non-empty string, or events= that is not a bool, is a ConfigurationError."""

    class Local(DeclarativeBase):
        pass

    with pytest.raises(ConfigurationError, match=needle):

        class Widget(Local):
            __tablename__ = "ev_widgets"
            id: Mapped[int] = mapped_column(primary_key=True)
            state: Mapped[str] = mapped_column(String(10))
            flow = StateMachine("state", states=["a", "b", "c"], transitions=[transition], **kwargs)


def test_one_trigger_writes_one_topic() -> None:
    """Transitions of one trigger naming different events (or only some naming one) fail at definition."""

    class Local(DeclarativeBase):
        pass

    for second in ({"event": "x.two"}, {}):
        with pytest.raises(ConfigurationError, match="name different events"):

            class Widget(Local):
                __tablename__ = "ev_widgets2"
                id: Mapped[int] = mapped_column(primary_key=True)
                state: Mapped[str] = mapped_column(String(10))
                flow = StateMachine(
                    "state",
                    states=["a", "b", "c"],
                    transitions=[
                        {"trigger": "go", "source": "a", "dest": "b", "event": "x.one"},
                        {"trigger": "go", "source": "b", "dest": "c", **second},
                    ],
                )

        Local.metadata.clear()
        Local.registry.dispose()


def test_history_and_events_together(engine: Any) -> None:
    """With history=True too, an APPLIED call writes a log row and an event; a retried request id neither."""
    with Session(engine) as s, s.begin():
        s.add_all([Claim(id=1), Claim(id=2, status="approved")])
    with Session(engine) as s, s.begin():
        assert Claim.flow.approve(s, 1, request_id="req-a").applied
        assert Claim.flow.close(s, 2, request_id="req-c", metadata={"why": "done"}).applied
    with Session(engine) as s, s.begin():
        again = Claim.flow.approve(s, 1, request_id="req-a")
        assert again.outcome is Outcome.REPEATED and again.same_request
        assert [e.trigger for e in Claim.flow.history(s, 2)] == ["close"]
    got = [
        (p["key"], p["trigger"], p["source"], p["dest"], p["request_id"], p["metadata"])
        for _, _, p in _events(engine)
    ]
    assert got == [
        (1, "approve", "open", "approved", "req-a", None),
        (2, "close", "approved", "closed", "req-c", {"why": "done"}),
    ]


@pytest.mark.parametrize("driver", list(ASYNC_TARGETS))
def test_async_sessions_write_the_same_events(driver: str, request: pytest.FixtureRequest) -> None:
    """Through an AsyncSession (every async driver) triggers write the same events as through a Session."""
    from sqlalchemy.ext.asyncio import AsyncSession

    backend: Backend = request.getfixturevalue(ASYNC_TARGETS[driver])
    sync = backend.create(Base.metadata)
    drop_tables(sync)
    create_tables(sync)
    _parcels(sync, {1: "new", 2: "paid", 3: "new", 4: "new"})
    target = async_target(driver, backend)

    async def scenario() -> None:
        eng = target.engine()
        try:
            async with AsyncSession(eng) as s, s.begin():
                assert (await Parcel.flow.pay(s, 1, request_id="a-1")).applied
                assert (await Parcel.flow.cancel(s, 2)).applied
                assert (await Parcel.flow.pay(s, 2)).outcome is Outcome.REJECTED
                results = await Parcel.flow.flip.many(s, [3, 4])
                assert all(r.applied for r in results.values())
        finally:
            await eng.dispose()

    try:
        asyncio.run(scenario())
        got = [
            (t, p["key"], p["source"], p["dest"], p["version"], p["request_id"]) for t, _, p in _events(sync)
        ]
        assert got == [
            ("ev_parcels.pay", 1, "new", "paid", 2, "a-1"),
            ("ev_parcels.cancel", 2, "paid", "cancelled", 2, None),
            ("ev_parcels.flip", 3, "new", "held", 2, None),
            ("ev_parcels.flip", 4, "new", "held", 2, None),
        ]
    finally:
        drop_tables(sync)


def test_rows_of_different_tables_with_the_same_key_have_different_event_keys() -> None:
    """Event keys carry the table, so another table's unpublished event never holds a row back; a key
    too long beside the table name is digested to fit the outbox's key column."""
    from stateguard._kernel import model_info
    from stateguard.machine.events import event_key
    from stateguard.tables import MAX_KEY

    a, b = model_info(Parcel), model_info(Slot)
    assert event_key(a, (7,)) == "ev_parcels:7" and event_key(b, (7, "x")) == 'ev_slots:[7,"x"]'
    long = event_key(b, (7, "x" * 300))
    assert len(long) <= MAX_KEY and long.startswith("ev_slots:#sha256:")


def test_events_of_a_batch_that_outgrow_one_insert_are_all_written(engine: Any) -> None:
    """where() over 16,400 rows (4 parameters an event: over psycopg's 65,535 for one statement) and
    many() with 500 KB of metadata on 40 rows (20 MB: over MariaDB's 16 MiB packet) write every event,
    in several INSERTs."""
    n = 16_400
    with engine.begin() as conn:
        conn.execute(
            Parcel.__table__.insert(), [{"id": i, "status": "new", "version": 1} for i in range(1, n + 1)]
        )
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as c:
            assert len(Parcel.flow.pay.where(s, Parcel.id > 0)) == n
        assert len(_inserts(c.statements)) > 1
    assert _count(engine) == n
    blob = {"blob": "é" * 250_000}
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as c:
            results = Parcel.flow.ship.many(s, range(1, 41), metadata=blob)
        assert all(r.applied for r in results.values())
        assert len(_inserts(c.statements)) > 1
    shipped = [p for t, _, p in _events(engine) if t == "parcel.shipped"]
    assert len(shipped) == 40 and all(p["metadata"] == blob for p in shipped)
