"""Triggers of a StateMachine on every backend: outcomes, results, errors, instances,
values, guards, self-loops, enum states, composite keys and statement counts."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from sqlalchemy import DateTime, Engine, Integer, String, func, select, update
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import (
    NotFound,
    Outcome,
    StaleVersion,
    StateguardError,
    StateMachine,
    TransitionRejected,
    version_column,
)
from tests._support.models import Base, Color, Lamp, Order, Shipment, Ticket
from tests.conftest import Backend, count_statements


class DocBase(DeclarativeBase):
    pass


class Doc(DocBase):
    """Declared per-transition values, also differing per source of one trigger."""

    __tablename__ = "sg_machine_docs"
    id: Mapped[int] = mapped_column(primary_key=True)
    state: Mapped[str] = mapped_column(String(20), default="draft")
    version: Mapped[int] = version_column()
    note: Mapped[str | None] = mapped_column(String(40))
    published_at: Mapped[datetime.datetime | None] = mapped_column(DateTime)
    edits: Mapped[int] = mapped_column(Integer, default=0)

    flow = StateMachine(
        "state",
        states=["draft", "published", "archived"],
        transitions=[
            {
                "trigger": "publish",
                "source": "draft",
                "dest": "published",
                "values": {"published_at": func.now(), "note": "live"},
            },
            {"trigger": "archive", "source": "draft", "dest": "archived", "values": {"note": "from draft"}},
            {
                "trigger": "archive",
                "source": "published",
                "dest": "archived",
                "values": {"note": "from published"},
            },
        ],
    )


def _seed(s: Session) -> None:
    s.add_all([Order(id=1), Order(id=2, status="paid"), Order(id=3, status="shipped")])
    s.add_all([Ticket(id=1), Ticket(id=2, priority=9)])
    s.add(Lamp(id=1))
    s.add(Shipment(warehouse="north", number=7))
    s.add_all([Doc(id=1), Doc(id=2)])


pytestmark = pytest.mark.tables(Base.metadata, DocBase.metadata, seed=_seed, stateguard=False)


def _db(engine: Engine, model: Any, key: Any) -> Any:
    """The committed row, read in a fresh session."""
    with Session(engine) as s:
        return s.get_one(model, key)


# -- outcomes ------------------------------------------------------------------


def test_applied_reports_dest_state_new_version_and_is_truthy(engine: Engine) -> None:
    """An applying pay reports APPLIED, the dest state, the new version, its trigger, model and key."""
    with Session(engine) as s, s.begin():
        r = Order.flow.pay(s, 1)
    assert r.outcome is Outcome.APPLIED
    assert r.applied is True and bool(r) is True
    assert (r.state, r.version, r.trigger, r.model, r.key) == ("paid", 2, "pay", Order, 1)
    assert r.raise_for_outcome() is r
    row = _db(engine, Order, 1)
    assert (row.status, row.version) == ("paid", 2)


def test_version_is_returned_on_applied_on_every_backend(engine: Engine, backend: Backend) -> None:
    """APPLIED carries the row's new version on every backend (MariaDB via LAST_INSERT_ID)."""
    with Session(engine) as s, s.begin():
        versions = [Order.flow.pay(s, 1).version, Order.flow.ship(s, 1).version]
        lamp = Lamp.flow.go(s, 1).version
        shipment = Shipment.flow.advance(s, ("north", 7)).version
    assert versions == [2, 3]
    assert lamp == 2 and shipment == 2
    assert _db(engine, Order, 1).version == 3


def test_repeated_when_the_row_is_already_in_the_dest_state(engine: Engine) -> None:
    """Paying a paid order is REPEATED, not applied, with the state and version found, and raises nothing."""
    with Session(engine) as s, s.begin():
        r = Order.flow.pay(s, 2)
    assert r.outcome is Outcome.REPEATED
    assert r.applied is False and bool(r) is False
    assert (r.state, r.version, r.trigger, r.key) == ("paid", 1, "pay", 2)
    assert r.raise_for_outcome() is r
    assert _db(engine, Order, 2).version == 1


def test_rejected_reports_the_state_found_and_raises_transition_rejected(engine: Engine) -> None:
    """A shipped order's pay is REJECTED with state 'shipped'; raise_for_outcome raises TransitionRejected."""
    with Session(engine) as s, s.begin():
        r = Order.flow.pay(s, 3)
    assert (r.outcome, r.state, r.version, r.applied) == (Outcome.REJECTED, "shipped", 1, False)
    with pytest.raises(TransitionRejected) as info:
        r.raise_for_outcome()
    e = info.value
    assert isinstance(e, StateguardError) and e.retryable is False
    assert (e.model, e.key, e.trigger, e.state) == (Order, 3, "pay", "shipped")
    assert e.result is r
    message = str(e)
    assert "Order" in message and "3" in message and "'pay'" in message and "'shipped'" in message
    row = _db(engine, Order, 3)
    assert (row.status, row.version) == ("shipped", 1)


def test_not_found_for_a_missing_row_raises_not_found(engine: Engine) -> None:
    """A trigger on a key with no row is NOT_FOUND (no state, no version); NotFound is a LookupError."""
    with Session(engine) as s, s.begin():
        r = Order.flow.ship(s, 404)
    assert (r.outcome, r.state, r.version, r.applied, r.key) == (Outcome.NOT_FOUND, None, None, False, 404)
    with pytest.raises(NotFound) as info:
        r.raise_for_outcome()
    e = info.value
    assert isinstance(e, LookupError) and isinstance(e, StateguardError)
    assert (e.model, e.key, e.trigger, e.state) == (Order, 404, "ship", None)
    assert "Order" in str(e) and "404" in str(e) and "'ship'" in str(e)


def test_stale_when_expected_version_differs_and_the_state_allows_it(engine: Engine) -> None:
    """pay with a wrong expected_version on a pending order is STALE; StaleVersion names both versions."""
    with Session(engine) as s, s.begin():
        r = Order.flow.pay(s, 1, expected_version=7)
    assert (r.outcome, r.state, r.version, r.expected_version) == (Outcome.STALE, "pending", 1, 7)
    with pytest.raises(StaleVersion) as info:
        r.raise_for_outcome()
    e = info.value
    assert (e.model, e.key, e.trigger, e.state) == (Order, 1, "pay", "pending")
    assert (e.expected_version, e.version) == (7, 1)
    message = str(e)
    assert "Order" in message and "'pay'" in message and "7" in message and "version 1" in message
    assert "'pending'" in message
    row = _db(engine, Order, 1)
    assert (row.status, row.version) == ("pending", 1)


def test_expected_version_that_matches_applies(engine: Engine) -> None:
    """pay with the row's current version applies and reports version + 1."""
    with Session(engine) as s, s.begin():
        r = Order.flow.pay(s, 1, expected_version=1)
    assert (r.outcome, r.version, r.expected_version) == (Outcome.APPLIED, 2, 1)
    assert _db(engine, Order, 1).version == 2


def test_repeated_wins_over_stale_when_the_row_is_already_in_the_dest(engine: Engine) -> None:
    """A wrong expected_version on a row already in the dest state is REPEATED, not STALE."""
    with Session(engine) as s, s.begin():
        r = Order.flow.pay(s, 2, expected_version=99)
    assert (r.outcome, r.state, r.version) == (Outcome.REPEATED, "paid", 1)


@pytest.mark.hostile
def test_wrong_state_with_wrong_version_is_rejected_not_stale(engine: Engine) -> None:
    """A wrong expected_version on a row whose state forbids the trigger is REJECTED."""
    with Session(engine) as s, s.begin():
        r = Order.flow.pay(s, 3, expected_version=99)
    assert (r.outcome, r.state) == (Outcome.REJECTED, "shipped")


def test_fire_by_name_is_the_same_as_the_trigger_attribute(engine: Engine) -> None:
    """fire(session, 'pay', id) runs pay: APPLIED first, REPEATED after."""
    with Session(engine) as s, s.begin():
        first = Order.flow.fire(s, "pay", 1)
        second = Order.flow.fire(s, "pay", 1, expected_version=1)
    assert (first.outcome, first.trigger, first.state) == (Outcome.APPLIED, "pay", "paid")
    assert second.outcome is Outcome.REPEATED
    assert _db(engine, Order, 1).status == "paid"


def test_a_chain_of_triggers_follows_the_graph(engine: Engine) -> None:
    """pay, ship, then cancel: the first two apply, cancel from shipped is REJECTED."""
    with Session(engine) as s, s.begin():
        outcomes = [Order.flow.pay(s, 1).outcome, Order.flow.ship(s, 1).outcome]
        cancel = Order.flow.cancel(s, 1)
    assert outcomes == [Outcome.APPLIED, Outcome.APPLIED]
    assert (cancel.outcome, cancel.state) == (Outcome.REJECTED, "shipped")
    assert _db(engine, Order, 1).version == 3


def test_trigger_with_several_sources(engine: Engine) -> None:
    """cancel applies from pending and from paid, and is REPEATED once cancelled."""
    with Session(engine) as s, s.begin():
        assert Order.flow.cancel(s, 1).applied
        assert Order.flow.cancel(s, 2).applied
        again = Order.flow.cancel(s, 2)
    assert (again.outcome, again.state) == (Outcome.REPEATED, "cancelled")


@pytest.mark.rollback
def test_rolled_back_transition_leaves_the_row_unchanged(engine: Engine) -> None:
    """An APPLIED transition inside a transaction that rolls back changes nothing in the database."""
    with Session(engine) as s:
        s.begin()
        assert Order.flow.pay(s, 1).applied
        s.rollback()
    row = _db(engine, Order, 1)
    assert (row.status, row.version) == ("pending", 1)


# -- instance targets ------------------------------------------------------------


def test_instance_target_gets_the_new_state_and_version(engine: Engine) -> None:
    """Firing on a loaded instance updates its state and version attributes to what the database has."""
    with Session(engine) as s, s.begin():
        order = s.get_one(Order, 1)
        r = Order.flow.pay(s, order)
        assert r.applied and r.key == 1
        assert (order.status, order.version) == ("paid", 2)
        assert s.scalar(select(Order.version).where(Order.id == 1)) == 2


def test_instance_attributes_need_no_reload_after_applied(engine: Engine) -> None:
    """After an APPLIED call on a clean instance, reading its state and version sends no SQL."""
    with Session(engine) as s, s.begin():
        order = s.get_one(Order, 1)
        with count_statements(engine) as c:
            Order.flow.pay(s, order)
            assert (order.status, order.version) == ("paid", 2)
        assert len(c) == 1, c.statements


def test_instance_is_synced_when_repeated_after_another_session_committed(engine: Engine) -> None:
    """An instance loaded before another session paid it shows 'paid' and the new version after REPEATED."""
    with Session(engine) as s, s.begin():
        order = s.get_one(Order, 1)
        with Session(engine) as other, other.begin():
            assert Order.flow.pay(other, 1).applied
        r = Order.flow.pay(s, order)
        assert (r.outcome, r.version) == (Outcome.REPEATED, 2)
        assert (order.status, order.version) == ("paid", 2)


def test_instance_is_synced_when_rejected(engine: Engine) -> None:
    """An instance whose row moved on elsewhere gets the found state and version after REJECTED."""
    with Session(engine) as s, s.begin():
        order = s.get_one(Order, 1)
        with Session(engine) as other, other.begin():
            Order.flow.pay(other, 1)
            Order.flow.ship(other, 1)
        r = Order.flow.cancel(s, order)
        assert (r.outcome, r.state, r.version) == (Outcome.REJECTED, "shipped", 3)
        assert (order.status, order.version) == ("shipped", 3)
        order.note = "flushable"
        s.flush()  # the synced version passes the ORM's own version check
    row = _db(engine, Order, 1)
    assert (row.status, row.note, row.version) == ("shipped", "flushable", 4)


def test_later_orm_flush_of_a_dirty_instance_does_not_raise_stale_data(engine: Engine) -> None:
    """A dirty instance flushed after a transition (and changed again) passes SQLAlchemy's version check."""
    with Session(engine) as s, s.begin():
        order = s.get_one(Order, 1)
        order.note = "dirty before"
        r = Order.flow.pay(s, order)  # autoflushes the pending change first
        assert r.applied and order.version == r.version
        order.note = "dirty after"
        s.flush()
        assert order.version == r.version + 1
    row = _db(engine, Order, 1)
    assert (row.status, row.note, row.version) == ("paid", "dirty after", r.version + 1)


def test_identity_map_instance_is_synced_when_the_target_is_a_key(engine: Engine) -> None:
    """Firing by primary key also updates the instance of that row already loaded in the session."""
    with Session(engine) as s, s.begin():
        order = s.get_one(Order, 1)
        lamp = s.get_one(Lamp, 1)
        shipment = s.get_one(Shipment, ("north", 7))
        Order.flow.pay(s, 1)
        Lamp.flow.go(s, 1)
        Shipment.flow.advance(s, ("north", 7))
        assert (order.status, order.version) == ("paid", 2)
        assert (lamp.color, lamp.version) == (Color.GREEN, 2)
        assert (shipment.stage, shipment.version) == ("packed", 2)
        order.note = "flush after key transition"
        s.flush()
    assert _db(engine, Order, 1).version == 3


def test_pending_instance_is_flushed_then_transitioned(engine: Engine) -> None:
    """A new instance added to the session is flushed (as autoflush would) and then transitioned."""
    with Session(engine) as s, s.begin():
        order = Order(id=10)
        s.add(order)
        r = Order.flow.pay(s, order)
        assert (r.outcome, r.key, order.status) == (Outcome.APPLIED, 10, "paid")
    assert _db(engine, Order, 10).status == "paid"


# -- values and guards -----------------------------------------------------------


def test_values_sets_literals_and_sql_expressions_in_the_same_update(engine: Engine) -> None:
    """values= sets a literal and func.now() together with the state, in one statement."""
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as c:
            r = Order.flow.pay(s, 1, values={"paid_at": func.now(), "note": "card", "amount": 42})
        assert r.applied and len(c) == 1, c.statements
    row = _db(engine, Order, 1)
    assert (row.status, row.note, row.amount, row.version) == ("paid", "card", 42, 2)
    assert isinstance(row.paid_at, datetime.datetime)


def test_values_can_use_the_rows_own_columns(engine: Engine) -> None:
    """A values expression over the row's own column (amount + 5) sees the row's old value."""
    with Session(engine) as s, s.begin():
        s.execute(update(Order).where(Order.id == 1).values(amount=10))
        s.expire_all()
        assert Order.flow.pay(s, 1, values={"amount": Order.amount + 5}).applied
    assert _db(engine, Order, 1).amount == 15


def test_values_on_an_instance_are_reloaded_on_access(engine: Engine) -> None:
    """Columns set through values on an instance target read back what the database stored."""
    with Session(engine) as s, s.begin():
        order = s.get_one(Order, 1)
        Order.flow.pay(s, order, values={"paid_at": func.now(), "note": "n"})
        assert order.note == "n"
        assert isinstance(order.paid_at, datetime.datetime)


def test_values_are_not_written_when_the_trigger_does_not_apply(engine: Engine) -> None:
    """values of a REPEATED or REJECTED call are not written."""
    with Session(engine) as s, s.begin():
        assert Order.flow.pay(s, 2, values={"note": "repeated"}).outcome is Outcome.REPEATED
        assert Order.flow.pay(s, 3, values={"note": "rejected"}).outcome is Outcome.REJECTED
    assert _db(engine, Order, 2).note is None
    assert _db(engine, Order, 3).note is None


def test_declared_values_are_set_by_the_transition(engine: Engine) -> None:
    """A transition's declared values (a literal and func.now()) are written with the state."""
    with Session(engine) as s, s.begin():
        r = Doc.flow.publish(s, 1)
        assert (r.outcome, r.state, r.version) == (Outcome.APPLIED, "published", 2)
    row = _db(engine, Doc, 1)
    assert (row.state, row.note) == ("published", "live")
    assert isinstance(row.published_at, datetime.datetime)


def test_declared_values_follow_the_edge_taken(engine: Engine) -> None:
    """archive sets note 'from draft' from draft and 'from published' from published."""
    with Session(engine) as s, s.begin():
        Doc.flow.publish(s, 2)
        assert Doc.flow.archive(s, 1).applied
        assert Doc.flow.archive(s, 2).applied
    assert (_db(engine, Doc, 1).note, _db(engine, Doc, 2).note) == ("from draft", "from published")


def test_call_values_override_declared_values(engine: Engine) -> None:
    """A values= entry for a column the transition also declares wins over the declared one."""
    with Session(engine) as s, s.begin():
        assert Doc.flow.archive(s, 1, values={"note": "by caller", "edits": 3}).applied
    row = _db(engine, Doc, 1)
    assert (row.note, row.edits, row.state) == ("by caller", 3, "archived")


def test_where_guard_rejects_when_false(engine: Engine) -> None:
    """Ticket.close with priority >= 5 is REJECTED (state still 'open'); with priority < 5 it applies."""
    with Session(engine) as s, s.begin():
        blocked = Ticket.flow.close(s, 2)
        allowed = Ticket.flow.close(s, 1)
    assert (blocked.outcome, blocked.state, blocked.version) == (Outcome.REJECTED, "open", None)
    with pytest.raises(TransitionRejected) as info:
        blocked.raise_for_outcome()
    assert (info.value.trigger, info.value.state, info.value.key) == ("close", "open", 2)
    assert (allowed.outcome, allowed.state, allowed.version) == (Outcome.APPLIED, "closed", None)
    assert _db(engine, Ticket, 2).state == "open"


def test_where_guard_is_evaluated_by_the_database_at_call_time(engine: Engine) -> None:
    """Raising a ticket's priority in the database makes the guarded close REJECTED."""
    with Session(engine) as s, s.begin():
        s.execute(update(Ticket).where(Ticket.id == 1).values(priority=7))
        assert Ticket.flow.close(s, 1).outcome is Outcome.REJECTED
        s.execute(update(Ticket).where(Ticket.id == 1).values(priority=1))
        assert Ticket.flow.close(s, 1).outcome is Outcome.APPLIED
        assert Ticket.flow.close(s, 1).outcome is Outcome.REPEATED


def test_self_loop_that_changes_no_column_is_applied(engine: Engine, backend: Backend) -> None:
    """Ticket.touch (open -> open, no version column) is APPLIED each time, in one statement."""
    with Session(engine) as s, s.begin():
        s.connection()
        for _ in range(3):
            with count_statements(engine) as c:
                r = Ticket.flow.touch(s, 1)
            assert (r.outcome, r.state, r.version) == (Outcome.APPLIED, "open", None)
            assert len(c) == 1, c.statements
        assert Ticket.flow.touch(s, 404).outcome is Outcome.NOT_FOUND
        Ticket.flow.close(s, 1)
        rejected = Ticket.flow.touch(s, 1)
    assert (rejected.outcome, rejected.state) == (Outcome.REJECTED, "closed")


def test_self_loop_with_a_version_column_bumps_the_version(engine: Engine) -> None:
    """Lamp.stop from RED to RED applies and increments the version."""
    with Session(engine) as s, s.begin():
        r = Lamp.flow.stop(s, 1)
    assert (r.outcome, r.state, r.version) == (Outcome.APPLIED, Color.RED, 2)


# -- enum states, composite keys, several destinations ---------------------------


def test_enum_state_in_results_is_the_member(engine: Engine) -> None:
    """On an Enum column .state is the enum member; sources given by member, name or '*' all work."""
    with Session(engine) as s, s.begin():
        go = Lamp.flow.go(s, 1)  # source given as Color.RED
        slow = Lamp.flow.slow(s, 1)  # source given as "GREEN"
        again = Lamp.flow.slow(s, 1)
        rejected = Lamp.flow.go(s, 1)
        stop = Lamp.flow.stop(s, 1)  # source "*"
    assert go.state is Color.GREEN and go.outcome is Outcome.APPLIED
    assert slow.state is Color.BLUE and slow.outcome is Outcome.APPLIED
    assert (again.outcome, again.state) == (Outcome.REPEATED, Color.BLUE)
    assert (rejected.outcome, rejected.state) == (Outcome.REJECTED, Color.BLUE)
    assert (stop.outcome, stop.state, stop.version) == (Outcome.APPLIED, Color.RED, 4)
    row = _db(engine, Lamp, 1)
    assert (row.color, row.version) == (Color.RED, 4)


def test_enum_rejection_error_carries_the_member(engine: Engine) -> None:
    """TransitionRejected on an enum machine carries the member found."""
    with Session(engine) as s, s.begin():
        r = Lamp.flow.slow(s, 1)
    with pytest.raises(TransitionRejected) as info:
        r.raise_for_outcome()
    assert info.value.state is Color.RED and "Lamp" in str(info.value) and "'slow'" in str(info.value)


def test_enum_instance_target_is_synced_with_members(engine: Engine) -> None:
    """Firing an enum trigger on a loaded Lamp leaves the member on the instance."""
    with Session(engine) as s, s.begin():
        lamp = s.get_one(Lamp, 1)
        assert Lamp.flow.fire(s, "go", lamp).applied
        assert lamp.color is Color.GREEN and lamp.version == 2


def test_composite_primary_key_with_tuple_keys(engine: Engine) -> None:
    """A composite-key model takes (warehouse, number) tuples; results and errors carry the tuple."""
    with Session(engine) as s, s.begin():
        r = Shipment.flow.advance(s, ("north", 7))
        missing = Shipment.flow.advance(s, ("south", 7))
        missing2 = Shipment.flow.advance(s, ("north", 8))
    assert (r.outcome, r.key, r.state) == (Outcome.APPLIED, ("north", 7), "packed")
    assert (missing.outcome, missing.key) == (Outcome.NOT_FOUND, ("south", 7))
    assert missing2.outcome is Outcome.NOT_FOUND
    with pytest.raises(NotFound) as info:
        missing.raise_for_outcome()
    assert info.value.key == ("south", 7) and "('south', 7)" in str(info.value)


def test_multi_destination_trigger_reports_where_it_went(engine: Engine) -> None:
    """advance goes new -> packed -> sent, then is REPEATED in sent and REJECTED once delivered."""
    with Session(engine) as s, s.begin():
        first = Shipment.flow.advance(s, ("north", 7))
        second = Shipment.flow.advance(s, ("north", 7))
        third = Shipment.flow.advance(s, ("north", 7))
        delivered = Shipment.flow.deliver(s, ("north", 7))
        fourth = Shipment.flow.advance(s, ("north", 7))
    assert (first.outcome, first.state, first.version) == (Outcome.APPLIED, "packed", 2)
    assert (second.outcome, second.state, second.version) == (Outcome.APPLIED, "sent", 3)
    assert (third.outcome, third.state, third.version) == (Outcome.REPEATED, "sent", 3)
    assert (delivered.outcome, delivered.state) == (Outcome.APPLIED, "delivered")
    assert (fourth.outcome, fourth.state) == (Outcome.REJECTED, "delivered")
    row = _db(engine, Shipment, ("north", 7))
    assert (row.stage, row.version) == ("delivered", 4)


def test_multi_destination_trigger_on_an_instance(engine: Engine) -> None:
    """advance on a loaded Shipment leaves the reached stage and version on it."""
    with Session(engine) as s, s.begin():
        shipment = s.get_one(Shipment, ("north", 7))
        Shipment.flow.advance(s, shipment)
        Shipment.flow.advance(s, shipment)
        assert (shipment.stage, shipment.version) == ("sent", 3)


# -- available -------------------------------------------------------------------


def test_available_lists_trigger_names_from_the_objects_state(engine: Engine) -> None:
    """available(obj) returns the trigger names the graph allows from the loaded object's state."""
    with Session(engine) as s:
        assert Order.flow.available(s.get_one(Order, 1)) == ["cancel", "pay"]
        assert Order.flow.available(s.get_one(Order, 2)) == ["cancel", "ship"]
        assert Order.flow.available(s.get_one(Order, 3)) == []
        assert Ticket.flow.available(s.get_one(Ticket, 2)) == ["close", "touch"]  # guards are SQL
        assert Lamp.flow.available(s.get_one(Lamp, 1)) == ["go", "stop"]
        assert Shipment.flow.available(s.get_one(Shipment, ("north", 7))) == ["advance"]
        assert all(isinstance(name, str) for name in Order.flow.available(s.get_one(Order, 1)))


def test_available_follows_the_instance_after_a_transition(engine: Engine) -> None:
    """After pay on an instance, available() reflects the new state without a reload."""
    with Session(engine) as s, s.begin():
        order = s.get_one(Order, 1)
        Order.flow.pay(s, order)
        assert Order.flow.available(order) == ["cancel", "ship"]


# -- statement counts --------------------------------------------------------------


def test_pay_is_one_statement_when_it_applies(engine: Engine) -> None:
    """pay that applies executes exactly one SQL statement (BEGIN excluded)."""
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as c:
            r = Order.flow.pay(s, 1)
        assert r.applied
        assert len(c) == 1, c.statements
        assert c.statements[0].lstrip().upper().startswith("UPDATE")


@pytest.mark.parametrize(
    ("key", "outcome"),
    [(2, Outcome.REPEATED), (3, Outcome.REJECTED), (404, Outcome.NOT_FOUND)],
)
def test_pay_is_two_statements_when_it_does_not_apply(engine: Engine, key: int, outcome: Outcome) -> None:
    """pay that does not apply executes exactly two statements: the UPDATE and one read."""
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as c:
            r = Order.flow.pay(s, key)
        assert r.outcome is outcome
        assert len(c) == 2, c.statements
        assert c.statements[0].lstrip().upper().startswith("UPDATE")
        assert c.statements[1].lstrip().upper().startswith("SELECT")


def test_expected_version_and_values_do_not_add_statements(engine: Engine) -> None:
    """pay with expected_version and values still applies in one statement."""
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as c:
            r = Order.flow.pay(s, 1, expected_version=1, values={"note": "x", "paid_at": func.now()})
        assert r.applied and r.version == 2
        assert len(c) == 1, c.statements


def test_instance_target_never_loads_the_row_first(engine: Engine) -> None:
    """Firing on an expired instance sends only the UPDATE, no SELECT of the row first."""
    with Session(engine) as s, s.begin():
        order = s.get_one(Order, 1)
        s.expire(order)
        with count_statements(engine) as c:
            r = Order.flow.pay(s, order)
        assert r.applied
        assert len(c) == 1, c.statements
