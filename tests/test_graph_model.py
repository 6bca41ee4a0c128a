"""Property test: random trigger sequences against the database agree with a pure model of the graph."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import Session

from stateguard import Outcome, StateMachine

from .conftest import Backend
from .models import Base, Lamp, Order, Ticket

SETTINGS = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def expected_outcome(
    machine: StateMachine[Any],
    trigger: str,
    state: Any,
    version: int | None,
    expected: int | None,
    guard_ok: bool,
) -> tuple[Outcome, Any, int | None]:
    """The pure model: what the graph says a trigger does from ``state`` (no database)."""
    edges = machine.triggers[trigger].edges
    dests = {e.dest for e in edges}
    edge = next((e for e in edges if state in e.sources), None)
    mismatch = expected is not None and expected != version
    if edge is not None and not mismatch and (guard_ok or edge.where is None):
        return Outcome.APPLIED, edge.dest, None if version is None else version + 1
    if state in dests:
        return Outcome.REPEATED, state, version
    if edge is not None and mismatch:
        return Outcome.STALE, state, version
    return Outcome.REJECTED, state, version


steps = st.lists(
    st.tuples(st.sampled_from(["pay", "ship", "cancel"]), st.sampled_from(["none", "current", "stale"])),
    min_size=1,
    max_size=12,
)


@SETTINGS
@given(steps=steps, missing=st.booleans())
def test_order_graph_agrees_with_the_model(
    backend: Backend, steps: list[tuple[str, str]], missing: bool
) -> None:
    """Every outcome, state and version of Order's triggers matches the in-memory model, step by step."""
    engine = backend.create(Base.metadata)
    with Session(engine) as s, s.begin():
        s.add(Order(id=1))
    state, version = "pending", 1
    with Session(engine) as s, s.begin():
        for trigger, mode in steps:
            expected = {"none": None, "current": version, "stale": version + 1}[mode]
            key = 2 if missing else 1
            r = Order.flow.fire(s, trigger, key, expected_version=expected)
            if missing:
                assert r.outcome is Outcome.NOT_FOUND
                continue
            outcome, state, version = expected_outcome(Order.flow, trigger, state, version, expected, True)  # type: ignore[assignment]
            assert (r.outcome, r.state, r.version) == (outcome, state, version), (trigger, mode)
        assert s.get_one(Order, 1).status == ("pending" if missing else state)


@SETTINGS
@given(
    steps=st.lists(st.sampled_from(["close", "touch", "reopen"]), min_size=1, max_size=12),
    priority=st.integers(0, 9),
)
def test_guarded_ticket_graph_agrees_with_the_model(
    backend: Backend, steps: list[str], priority: int
) -> None:
    """Guards and self-loops (no version column) behave as the model says."""
    engine = backend.create(Base.metadata)
    with Session(engine) as s, s.begin():
        s.add(Ticket(id=1, priority=priority))
    state: Any = "open"
    with Session(engine) as s, s.begin():
        for trigger in steps:
            r = Ticket.flow.fire(s, trigger, 1)
            outcome, state, _ = expected_outcome(Ticket.flow, trigger, state, None, None, priority < 5)
            assert (r.outcome, r.state) == (outcome, state), trigger


@SETTINGS
@given(steps=st.lists(st.sampled_from(["go", "slow", "stop"]), min_size=1, max_size=12))
def test_enum_lamp_graph_agrees_with_the_model(backend: Backend, steps: list[str]) -> None:
    """Enum states (including a '*' source) match the model."""
    from .models import Color

    engine = backend.create(Base.metadata)
    with Session(engine) as s, s.begin():
        s.add(Lamp(id=1))
    state: Any = Color.RED
    version: int | None = 1
    with Session(engine) as s, s.begin():
        for trigger in steps:
            r = Lamp.flow.fire(s, trigger, 1)
            outcome, state, version = expected_outcome(Lamp.flow, trigger, state, version, None, True)
            assert (r.outcome, r.state, r.version) == (outcome, state, version), trigger
