"""Core behaviour of triggers, guarded updates and insert-once on every backend."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import String, func, select, text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from sqlalchemy.orm.exc import StaleDataError

import stateguard
from stateguard import (
    InvalidArgument,
    NotFound,
    Outcome,
    SerializationConflict,
    StaleVersion,
    TransitionRejected,
    UnknownTrigger,
    guarded_update,
    insert_once,
    retry_on_conflict,
)
from tests._support.models import Base, Color, Lamp, Message, Order, Shipment, Ticket
from tests.conftest import Backend, capable, count_statements

SEEN: list[Any] = []


class JobBase(DeclarativeBase):
    pass


class Job(JobBase):
    __tablename__ = "jobs_after_commit"
    id: Mapped[int] = mapped_column(primary_key=True)
    state: Mapped[str] = mapped_column(String(10), default="new")
    flow = stateguard.StateMachine(
        "state",
        states=["new", "done"],
        transitions=[{"trigger": "finish", "source": "new", "dest": "done", "after_commit": SEEN.append}],
    )


def _seed(s: Session) -> None:
    s.add_all([Order(id=1), Order(id=2, status="paid"), Order(id=3, status="shipped")])
    s.add_all([Ticket(id=1), Ticket(id=2, priority=9)])
    s.add(Lamp(id=1))
    s.add(Shipment(warehouse="north", number=7))


pytestmark = pytest.mark.tables(Base.metadata, seed=_seed, stateguard=False)


def _row(engine: Any, model: Any, key: Any) -> Any:
    with Session(engine) as s:
        return s.get_one(model, key)


def test_every_outcome_with_state_and_version(engine: Any) -> None:
    """pay reports APPLIED, REPEATED, REJECTED and NOT_FOUND with the state and version it found or set."""
    with Session(engine) as s, s.begin():
        applied = Order.flow.pay(s, 1)
        repeated = Order.flow.pay(s, 1)
        rejected = Order.flow.pay(s, 3)
        missing = Order.flow.pay(s, 404)
    assert (applied.outcome, applied.state, applied.version, applied.applied) == (
        Outcome.APPLIED,
        "paid",
        2,
        True,
    )
    assert (repeated.outcome, repeated.state, repeated.version, bool(repeated)) == (
        Outcome.REPEATED,
        "paid",
        2,
        False,
    )
    assert (rejected.outcome, rejected.state) == (Outcome.REJECTED, "shipped")
    assert (missing.outcome, missing.state, missing.version) == (Outcome.NOT_FOUND, None, None)
    assert applied.raise_for_outcome() is applied and repeated.raise_for_outcome() is repeated
    assert _row(engine, Order, 1).status == "paid"


def test_raise_for_outcome_errors_carry_what_was_found(engine: Any) -> None:
    """REJECTED, NOT_FOUND and STALE raise typed errors naming the model, key and state found."""
    with Session(engine) as s, s.begin():
        with pytest.raises(TransitionRejected) as rejected:
            Order.flow.ship(s, 1).raise_for_outcome()
        with pytest.raises(NotFound) as missing:
            Order.flow.ship(s, 99).raise_for_outcome()
        with pytest.raises(StaleVersion) as stale:
            Order.flow.pay(s, 1, expected_version=7).raise_for_outcome()
    e = rejected.value
    assert (e.model, e.key, e.trigger, e.state, e.retryable) == (Order, 1, "ship", "pending", False)
    assert "Order 1" in str(e) and "'ship'" in str(e) and "'pending'" in str(e)
    assert (missing.value.key, missing.value.trigger) == (99, "ship") and "does not exist" in str(
        missing.value
    )
    s_err = stale.value
    assert (s_err.expected_version, s_err.version, s_err.state) == (7, 1, "pending")
    assert isinstance(s_err, StaleDataError) and "expected version 7" in str(s_err)


def test_repeated_wins_over_stale_and_stale_over_rejected(engine: Any) -> None:
    """With expected_version: dest state -> REPEATED; source state with another version -> STALE."""
    with Session(engine) as s, s.begin():
        assert Order.flow.pay(s, 2, expected_version=99).outcome is Outcome.REPEATED
        assert Order.flow.pay(s, 1, expected_version=99).outcome is Outcome.STALE
        r = Order.flow.pay(s, 1, expected_version=1)
        assert (r.outcome, r.version) == (Outcome.APPLIED, 2)
        assert Order.flow.pay(s, 3, expected_version=99).outcome is Outcome.REJECTED


def test_one_statement_when_applied_and_two_when_not(engine: Any) -> None:
    """pay runs exactly one SQL statement when it applies and two when it does not."""
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as c:
            Order.flow.pay(s, 1)
        assert len(c) == 1, c.statements
        with count_statements(engine) as c:
            Order.flow.pay(s, 1)
        assert len(c) == 2, c.statements


def test_instance_target_reflects_the_database_afterwards(engine: Any) -> None:
    """A loaded instance gets the new state/version, and a later ORM flush of it passes the version check."""
    with Session(engine) as s, s.begin():
        order = s.get_one(Order, 1)
        order.note = "dirty before"
        r = Order.flow.pay(s, order)
        assert r.applied and order.status == "paid" and order.version == r.version
        order.note = "dirty after"
        s.flush()  # would raise StaleDataError if the in-memory version were stale
        stale_copy = s.get_one(Order, 3)
        Order.flow.pay(s, stale_copy)  # REJECTED: the instance is refreshed to what was found
        assert stale_copy.status == "shipped"
    row = _row(engine, Order, 1)
    assert (row.status, row.note, row.version) == ("paid", "dirty after", r.version + 1)


def test_identity_map_instance_is_synced_when_the_target_is_a_key(engine: Any) -> None:
    """Firing by primary key also updates the instance already loaded in the session."""
    with Session(engine) as s, s.begin():
        order = s.get_one(Order, 1)
        Order.flow.pay(s, 1, values={"note": "by key"})
        assert order.status == "paid" and order.version == 2
        assert order.note == "by key"  # expired and reloaded


def test_values_literal_and_sql_expressions(engine: Any) -> None:
    """values= sets literals and SQL expressions in the same UPDATE; they are bound, not interpolated."""
    with Session(engine) as s, s.begin():
        r = Order.flow.pay(s, 1, values={"paid_at": func.now(), "note": "x'); DROP TABLE orders; --"})
        assert r.applied
    row = _row(engine, Order, 1)
    assert row.paid_at is not None and row.note == "x'); DROP TABLE orders; --"


def test_where_guard_and_self_loop_without_version_column(engine: Any) -> None:
    """A failing where-guard is REJECTED; a self-loop that changes no column is APPLIED (matched rows)."""
    with Session(engine) as s, s.begin():
        assert Ticket.flow.close(s, 2).outcome is Outcome.REJECTED
        touch = Ticket.flow.touch(s, 1)
        assert touch.outcome is Outcome.APPLIED and touch.version is None
        assert Ticket.flow.touch(s, 1).outcome is Outcome.APPLIED
        assert Ticket.flow.close(s, 1).applied
        assert Ticket.flow.close(s, 1).outcome is Outcome.REPEATED


def test_enum_states_are_members(engine: Any) -> None:
    """On an Enum column the result state is the member, and sources given by name or member both work."""
    with Session(engine) as s, s.begin():
        r = Lamp.flow.go(s, 1)
        assert r.state is Color.GREEN
        assert Lamp.flow.slow(s, 1).state is Color.BLUE
        again = Lamp.flow.slow(s, 1)
        assert (again.outcome, again.state) == (Outcome.REPEATED, Color.BLUE)
        assert Lamp.flow.available(s.get_one(Lamp, 1)) == ["stop"]
    assert _row(engine, Lamp, 1).color is Color.BLUE


def test_composite_keys_and_a_trigger_with_several_destinations(engine: Any) -> None:
    """Tuple keys work; advance goes new -> packed -> sent and reports where it went."""
    with Session(engine) as s, s.begin():
        first = Shipment.flow.advance(s, ("north", 7))
        second = Shipment.flow.advance(s, ("north", 7))
        third = Shipment.flow.advance(s, ("north", 7))
        assert (first.state, second.state, third.outcome) == ("packed", "sent", Outcome.REPEATED)
        assert first.key == ("north", 7) and second.version == 3
        assert Shipment.flow.advance(s, ("south", 7)).outcome is Outcome.NOT_FOUND


def test_fire_available_and_statement(engine: Any) -> None:
    """fire() dispatches by name, available() lists graph triggers, statement() shows the UPDATE."""
    with Session(engine) as s, s.begin():
        assert Order.flow.fire(s, "cancel", 1).state == "cancelled"
        assert Order.flow.available(s.get_one(Order, 2)) == ["cancel", "ship"]
        assert Order.flow.available(s.get_one(Order, 3)) == []
    sql = str(Order.flow.pay.statement(5))
    assert sql.startswith("UPDATE orders SET") and "WHERE orders.id = :sg_pk0 AND orders.status = " in sql


def test_guarded_update_applied_stale_not_found(engine: Any) -> None:
    """guarded_update applies with the right version, is STALE with another, NOT_FOUND for no row."""
    with Session(engine) as s, s.begin():
        r = guarded_update(s, Order, 1, {"note": "a"}, expected_version=1)
        assert (r.outcome, r.version) == (Outcome.APPLIED, 2)
        stale = guarded_update(s, Order, 1, {"note": "b"}, expected_version=1)
        assert (stale.outcome, stale.version, stale.expected_version) == (Outcome.STALE, 2, 1)
        assert guarded_update(s, Order, 9, {"note": "c"}, expected_version=1).outcome is Outcome.NOT_FOUND
    assert _row(engine, Order, 1).note == "a"


def test_orm_flush_and_stateguard_share_the_version_column(engine: Any) -> None:
    """version_column is the mapper's version_id_col: a stale ORM flush raises StaleDataError."""
    assert Order.__mapper__.version_id_col is Order.__table__.c.version
    col = Order.__table__.c.version
    assert col.nullable is False and str(col.server_default.arg) == "0"
    with Session(engine) as stale, stale.begin():
        order = stale.get_one(Order, 1)
        with Session(engine) as other, other.begin():
            Order.flow.pay(other, 1)
        order.note = "lost update?"
        with pytest.raises(StaleDataError):
            stale.flush()


def test_insert_once_and_the_transaction_stays_usable(engine: Any, backend: Backend) -> None:
    """insert_once is APPLIED then REPEATED, and the same transaction can go on and commit."""
    with Session(engine) as s, s.begin():
        first = insert_once(s, Message, {"message_id": "m-1"})
        dup = insert_once(s, Message, {"message_id": "m-1"})
        assert first.applied and isinstance(first.key, int)
        assert dup.outcome is Outcome.REPEATED
        assert Order.flow.pay(s, 1).applied
        insert_once(s, Message, {"message_id": "m-2"})
    with Session(engine) as s:
        assert s.scalar(select(func.count()).select_from(Message)) == 2
        assert _row(engine, Order, 1).status == "paid"


def test_insert_once_does_not_hide_other_errors_on_mariadb(mariadb: Backend) -> None:
    """A key too long for its column is InvalidArgument, never a silent truncation reported as REPEATED."""
    engine = mariadb.create(Base.metadata)
    with Session(engine) as s, s.begin():
        assert insert_once(s, Message, {"message_id": "abcdefghij"}).applied
        with pytest.raises(InvalidArgument, match="holds at most 10"):
            insert_once(s, Message, {"message_id": "abcdefghij-and-more"})
        assert insert_once(s, Message, {"message_id": "k"}).applied  # transaction still usable
    with Session(engine) as s:
        assert s.scalar(select(func.count()).select_from(Message)) == 2


def test_on_commit_runs_after_commit_only_for_applied_calls(engine: Any) -> None:
    """on_commit callbacks run after COMMIT for APPLIED calls, never for REPEATED, never after a rollback."""
    calls: list[str] = []
    with Session(engine) as s:
        with s.begin():
            r = Order.flow.pay(s, 1)
            r.on_commit(calls.append, "paid-1")
            Order.flow.pay(s, 1).on_commit(calls.append, "repeated")
            assert calls == []
        assert calls == ["paid-1"]
        with pytest.raises(RuntimeError), s.begin():
            Order.flow.ship(s, 1).on_commit(calls.append, "rolled back")
            raise RuntimeError("boom")
        assert calls == ["paid-1"]
        with s.begin():
            Order.flow.cancel(s, 1).on_commit(calls.append, "after close")
        s.begin()
        Order.flow.ship(s, 2).on_commit(calls.append, "closed without commit")
        s.close()
    assert calls == ["paid-1", "after close"]


@pytest.mark.rollback
def test_on_commit_follows_savepoints(backend: Backend) -> None:
    """A callback registered in a rolled-back savepoint is dropped; one in a released savepoint runs."""
    eng = backend.engine if capable(backend, "row_locks") else stateguard.sqlite_engine(backend.url)
    backend.create(Base.metadata)
    with Session(eng) as s, s.begin():
        s.add_all([Order(id=1), Order(id=2)])
    calls: list[int] = []
    try:
        with Session(eng) as s, s.begin():
            with s.begin_nested() as sp:
                Order.flow.pay(s, 1).on_commit(calls.append, 1)
                sp.rollback()
            with s.begin_nested():
                Order.flow.pay(s, 2).on_commit(calls.append, 2)
            assert calls == []
        assert calls == [2]
    finally:
        if eng is not backend.engine:
            eng.dispose()


def test_declared_after_commit_receives_the_result(backend: Backend) -> None:
    """A transition's after_commit callables get the Result, once, after commit."""
    engine = backend.create(JobBase.metadata)
    SEEN.clear()
    with Session(engine) as s, s.begin():
        s.add(Job(id=1))
    with Session(engine) as s, s.begin():
        Job.flow.finish(s, 1)
        Job.flow.finish(s, 1)
        assert SEEN == []
    assert [(r.key, r.state, r.outcome) for r in SEEN] == [(1, "done", Outcome.APPLIED)]


@pytest.mark.hostile
def test_bad_input_is_typed_and_changes_nothing(engine: Any) -> None:
    """Unknown triggers, wrong keys, bad values, foreign instances: typed errors, nothing written."""
    with Session(engine) as s, s.begin():
        with pytest.raises(UnknownTrigger):
            Order.flow.refund  # noqa: B018
        with pytest.raises(AttributeError):
            Order.flow.fire(s, "refund", 1)
        for key in ("1", True, None, (1, 2), 1.5):
            with pytest.raises(InvalidArgument):
                Order.flow.pay(s, key)
        with pytest.raises(InvalidArgument):
            Order.flow.pay(s, 1, values={"no_such_column": 1})
        with pytest.raises(InvalidArgument):
            Order.flow.pay(s, 1, values={"status": "shipped"})
        with pytest.raises(InvalidArgument):
            Order.flow.pay(s, 1, values={"version": 40})
        with pytest.raises(InvalidArgument):
            Order.flow.pay(s, s.get_one(Ticket, 1))
        with pytest.raises(InvalidArgument):
            Order.flow.pay(s, Order(status="pending"))  # transient: no key yet
        with pytest.raises(InvalidArgument):
            Order.flow.pay(s, 1, expected_version="1")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument):
            Shipment.flow.advance(s, "north")
        with pytest.raises(InvalidArgument):
            guarded_update(s, Order, 1, {"status": "paid"}, expected_version=1)
    row = _row(engine, Order, 1)
    assert (row.status, row.version) == ("pending", 1)


@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
def test_serialization_failures_become_retryable_conflicts(pg: Backend, level: str) -> None:
    """At REPEATABLE READ / SERIALIZABLE a lost race raises SerializationConflict; a retry is REPEATED."""
    engine = pg.create(Base.metadata)
    with Session(engine) as s, s.begin():
        s.add(Order(id=1))
    strict = pg.new_engine(isolation_level=level)
    try:
        with Session(strict) as s1:
            s1.begin()
            s1.execute(select(Order.status).where(Order.id == 1)).all()  # snapshot taken
            with Session(engine) as s2, s2.begin():
                assert Order.flow.pay(s2, 1).applied
            with pytest.raises(SerializationConflict) as info:
                Order.flow.pay(s1, 1)
            assert info.value.retryable and info.value.__cause__ is not None
            s1.rollback()

        def unit() -> Any:
            with Session(strict) as s, s.begin():
                return Order.flow.pay(s, 1)

        assert retry_on_conflict(unit).outcome is Outcome.REPEATED
    finally:
        strict.dispose()


def test_retry_on_conflict_retries_stale_results_then_gives_up() -> None:
    """STALE results are retried with backoff; after the last attempt the STALE result is returned."""
    sleeps: list[float] = []
    results = iter(
        [
            stateguard.Result(Outcome.STALE, model=Order, key=1),
            stateguard.Result(Outcome.STALE, model=Order, key=1),
            stateguard.Result(Outcome.APPLIED, model=Order, key=1),
        ]
    )
    assert retry_on_conflict(lambda: next(results), sleep=sleeps.append).applied
    assert len(sleeps) == 2
    stale = stateguard.Result(Outcome.STALE, model=Order, key=1)
    assert retry_on_conflict(lambda: stale, attempts=3, sleep=sleeps.append) is stale
    with pytest.raises(TransitionRejected):
        retry_on_conflict(
            lambda: stateguard.Result(Outcome.REJECTED, model=Order, key=1).raise_for_outcome(),
            sleep=sleeps.append,
        )


def test_deadlocks_become_deadlock_detected_on_postgresql(pg: Backend) -> None:
    """PostgreSQL 40P01 between two opposite-order transactions surfaces as DeadlockDetected."""
    _deadlock(pg)


def test_deadlocks_become_deadlock_detected_on_mariadb(mariadb: Backend) -> None:
    """MariaDB 1213 between two opposite-order transactions surfaces as DeadlockDetected."""
    _deadlock(mariadb)


def _deadlock(backend: Backend) -> None:
    # SQLite has a single writer, so row-lock deadlocks cannot happen there.
    engine = backend.create(Base.metadata)
    with Session(engine) as s, s.begin():
        s.add_all([Order(id=1), Order(id=2)])
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def worker(first: int, second: int) -> None:
        try:
            with Session(engine) as s, s.begin():
                guarded_update(s, Order, first, {"note": "x"}, expected_version=1)
                barrier.wait()
                guarded_update(s, Order, second, {"note": "y"}, expected_version=1)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=worker, args=a) for a in ((1, 2), (2, 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(errors) == 1 and isinstance(errors[0], stateguard.DeadlockDetected), errors
    assert errors[0].retryable


def test_sqlite_busy_snapshot_is_a_serialization_conflict(sqlite: Backend) -> None:
    """A deferred SQLite read transaction that writes after another commit gets SerializationConflict."""
    backend = sqlite
    wal = stateguard.sqlite_engine(backend.url, begin="deferred", busy_timeout=0.2)
    try:
        backend.create(Base.metadata)
        with Session(wal) as s, s.begin():
            s.add(Order(id=1))
        with Session(wal) as reader:
            reader.begin()
            reader.execute(text("SELECT status FROM orders")).all()
            with Session(wal) as writer, writer.begin():
                Order.flow.pay(writer, 1)
            with pytest.raises(SerializationConflict):
                Order.flow.cancel(reader, 1)
            reader.rollback()
    finally:
        wal.dispose()


def test_a_failing_after_commit_callback_leaves_the_session_usable(engine: Any) -> None:
    """Every callback runs; the first failure is re-raised after the commit; the session stays usable."""
    calls: list[str] = []

    def boom() -> None:
        raise ValueError("callback failed")

    with Session(engine) as s:
        with pytest.raises(ValueError, match="callback failed"), s.begin():
            Order.flow.pay(s, 1).on_commit(boom)
            Order.flow.pay(s, 2).on_commit(calls.append, "never: REPEATED")
            Order.flow.cancel(s, 2).on_commit(calls.append, "second")
        assert calls == ["second"]
        with s.begin():
            assert s.get_one(Order, 1).status == "paid"  # committed despite the failing callback
