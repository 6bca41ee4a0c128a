"""Bad input gets a clear typed error (InvalidArgument, a StateguardError) before any
SQL is sent, and the database is left unchanged."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, func
from sqlalchemy.orm import Session

from stateguard import InvalidArgument, StateguardError, UnknownTrigger, guarded_update
from tests._support.models import Base, Lamp, Order, Shipment, Ticket
from tests.conftest import count_statements


def _seed(s: Session) -> None:
    s.add(Order(id=1))
    s.add(Ticket(id=1))
    s.add(Lamp(id=1))
    s.add(Shipment(warehouse="north", number=7))


pytestmark = pytest.mark.tables(Base.metadata, seed=_seed, stateguard=False)


def _unchanged(engine: Engine) -> None:
    with Session(engine) as s:
        order = s.get_one(Order, 1)
        assert (order.status, order.version, order.note, order.amount) == ("pending", 1, None, 0)
        assert s.get_one(Ticket, 1).state == "open"
        assert s.get_one(Lamp, 1).version == 1
        assert s.get_one(Shipment, ("north", 7)).stage == "new"


@pytest.fixture
def session(engine: Engine) -> Iterator[Session]:
    """A session inside a transaction, its connection already open (so BEGIN is not counted)."""
    with Session(engine) as s, s.begin():
        s.connection()
        yield s
    _unchanged(engine)


def _refused(engine: Engine, call: Callable[[], Any], error: type[Exception] = InvalidArgument) -> Exception:
    """Run ``call``, expect ``error``, and check no SQL statement was sent."""
    with count_statements(engine) as c, pytest.raises(error) as info:
        call()
    assert len(c) == 0, c.statements
    assert isinstance(info.value, StateguardError) and info.value.retryable is False
    return info.value


# -- unknown triggers ----------------------------------------------------------------------


@pytest.mark.hostile
def test_unknown_trigger_attribute(engine: Engine, session: Session) -> None:
    """Order.flow.refund is UnknownTrigger, also an AttributeError, naming the declared triggers."""
    error = _refused(engine, lambda: Order.flow.refund, UnknownTrigger)
    assert isinstance(error, AttributeError) and isinstance(error, InvalidArgument)
    assert "'refund'" in str(error) and "pay" in str(error) and "Order" in str(error)


@pytest.mark.hostile
def test_unknown_trigger_by_fire(engine: Engine, session: Session) -> None:
    """fire(session, 'refund', 1) is UnknownTrigger before any SQL."""
    error = _refused(engine, lambda: Order.flow.fire(session, "refund", 1), UnknownTrigger)
    assert isinstance(error, AttributeError) and "'refund'" in str(error)


@pytest.mark.hostile
@pytest.mark.parametrize("name", [None, 3, "", "Pay", "pay "])
def test_fire_with_a_non_trigger_name(engine: Engine, session: Session, name: Any) -> None:
    """fire() with a non-string or misspelt name is UnknownTrigger."""
    _refused(engine, lambda: Order.flow.fire(session, name, 1), UnknownTrigger)


@pytest.mark.hostile
def test_unknown_trigger_with_getattr_default(engine: Engine, session: Session) -> None:
    """Because UnknownTrigger is an AttributeError, getattr() with a default works."""
    assert getattr(Order.flow, "refund", None) is None
    assert hasattr(Order.flow, "pay") and not hasattr(Order.flow, "refund")


# -- wrong keys ----------------------------------------------------------------------------


@pytest.mark.hostile
@pytest.mark.parametrize("key", ["abc", "1", True, False, None, 1.5, b"1", [1], (1, 2), ()])
def test_wrong_key_for_an_integer_primary_key(engine: Engine, session: Session, key: Any) -> None:
    """A key that is not an int for Order.id (str, bool, None, float, tuple) is InvalidArgument."""
    error = _refused(engine, lambda: Order.flow.pay(session, key))
    assert "Order" in str(error) and "primary key" in str(error)


@pytest.mark.hostile
@pytest.mark.parametrize(
    "key", ["north", ("north",), ("north", 7, 1), ("north", "7"), (7, "north"), ("north", None), (None, 7)]
)
def test_wrong_key_for_a_composite_primary_key(engine: Engine, session: Session, key: Any) -> None:
    """A composite key of the wrong length or with wrong element types is InvalidArgument."""
    error = _refused(engine, lambda: Shipment.flow.advance(session, key))
    assert "Shipment" in str(error)


@pytest.mark.hostile
def test_wrong_key_for_guarded_update(engine: Engine, session: Session) -> None:
    """guarded_update checks the key the same way."""
    _refused(engine, lambda: guarded_update(session, Order, "1", {"note": "x"}, expected_version=1))
    _refused(engine, lambda: guarded_update(session, Order, None, {"note": "x"}, expected_version=1))


@pytest.mark.hostile
def test_wrong_key_for_statement(engine: Engine, session: Session) -> None:
    """statement() refuses a bad key too."""
    _refused(engine, lambda: Order.flow.pay.statement("1"))


# -- values ----------------------------------------------------------------------------------


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"no_such_column": 1}, "'no_such_column'"),
        ({"flow": 1}, "'flow'"),
        ({"status": "shipped"}, "state column"),
        ({"version": 40}, "version column"),
        ({"id": 2}, "primary key"),
        ({1: "x"}, "attribute names"),
        ([("note", "x")], "mapping"),
    ],
)
def test_bad_values_for_a_trigger(engine: Engine, session: Session, values: Any, needle: str) -> None:
    """values naming unknown columns, the state, version or key column, or not a mapping: InvalidArgument."""
    error = _refused(engine, lambda: Order.flow.pay(session, 1, values=values))
    assert needle in str(error)


@pytest.mark.hostile
def test_bad_values_mixed_with_good_ones_write_nothing(engine: Engine, session: Session) -> None:
    """One bad entry among good ones refuses the whole call."""
    _refused(
        engine, lambda: Order.flow.pay(session, 1, values={"note": "x", "nope": 1, "paid_at": func.now()})
    )


@pytest.mark.hostile
def test_bad_values_on_a_composite_key_model(engine: Engine, session: Session) -> None:
    """Setting a composite key part or the state column through values is refused."""
    _refused(engine, lambda: Shipment.flow.advance(session, ("north", 7), values={"warehouse": "x"}))
    _refused(engine, lambda: Shipment.flow.advance(session, ("north", 7), values={"stage": "sent"}))
    _refused(engine, lambda: Shipment.flow.advance(session, ("north", 7), values={"version": 5}))


# -- targets ---------------------------------------------------------------------------------


@pytest.mark.hostile
def test_target_instance_of_another_model(engine: Engine, session: Session) -> None:
    """A loaded Ticket passed to an Order trigger is InvalidArgument naming both models."""
    ticket = session.get_one(Ticket, 1)
    error = _refused(engine, lambda: Order.flow.pay(session, ticket))
    assert "Order" in str(error) and "Ticket" in str(error)
    _refused(engine, lambda: guarded_update(session, Order, ticket, {"note": "x"}, expected_version=1))
    _refused(engine, lambda: Order.flow.available(ticket))


@pytest.mark.hostile
def test_transient_instance(engine: Engine, session: Session) -> None:
    """An instance never added to a session has no key: InvalidArgument, and it is not inserted."""
    transient = Order(status="pending")
    error = _refused(engine, lambda: Order.flow.pay(session, transient))
    assert "no primary key" in str(error)
    assert transient not in session


@pytest.mark.hostile
def test_transient_instance_with_an_id_is_still_refused(engine: Engine, session: Session) -> None:
    """A transient instance is refused even when its id attribute is set: it is not a loaded row."""
    _refused(engine, lambda: Order.flow.pay(session, Order(id=1)))


@pytest.mark.hostile
def test_instance_pending_in_another_session(engine: Engine, session: Session) -> None:
    """A pending instance of a different session is refused rather than flushed by the wrong session."""
    with Session(engine) as other:
        pending = Order(id=55)
        other.add(pending)
        _refused(engine, lambda: Order.flow.pay(session, pending))


# -- expected_version --------------------------------------------------------------------------


@pytest.mark.hostile
@pytest.mark.parametrize("expected", ["1", 1.0, True, [1]])
def test_expected_version_not_an_int(engine: Engine, session: Session, expected: Any) -> None:
    """expected_version that is not an int (str, float, bool, list) is InvalidArgument."""
    error = _refused(engine, lambda: Order.flow.pay(session, 1, expected_version=expected))
    assert "expected_version" in str(error)


@pytest.mark.hostile
def test_expected_version_on_a_model_without_a_version_column(engine: Engine, session: Session) -> None:
    """expected_version on Ticket (no version column) is InvalidArgument naming the model."""
    error = _refused(engine, lambda: Ticket.flow.close(session, 1, expected_version=1))
    assert "Ticket" in str(error) and "version" in str(error)


# -- the session stays usable ----------------------------------------------------------------


@pytest.mark.hostile
def test_session_is_usable_after_bad_input(engine: Engine) -> None:
    """A refused call leaves the transaction usable: a valid call afterwards applies and commits."""
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            Order.flow.pay(s, "1")
        with pytest.raises(UnknownTrigger):
            Order.flow.fire(s, "refund", 1)
        assert Order.flow.pay(s, 1).applied
    with Session(engine) as s:
        assert s.get_one(Order, 1).status == "paid"


@pytest.mark.hostile
def test_bad_input_does_not_autoflush_pending_changes(engine: Engine) -> None:
    """Input is validated before the autoflush, so a refused call sends nothing, not even pending changes."""
    with Session(engine) as s, s.begin():
        s.connection()
        s.add(Order(id=9))
        with count_statements(engine) as c, pytest.raises(InvalidArgument):
            Order.flow.pay(s, 1, values={"status": "paid"})
        assert len(c) == 0, c.statements
        s.rollback()
    _unchanged(engine)
