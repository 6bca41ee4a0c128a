"""Stateful property tests: random sequences of calls run against real rows on every backend
AND against a pure in-memory model of the declared graph; both must agree on every outcome,
on what each result reports, and on the rows after every step.

The model below is written from the declarations (trigger, sources, dest, guard), not from
stateguard's internals, so a wrong compilation of the graph shows up as a disagreement.
Each run mixes: every trigger, expected_version that is current / behind / ahead, keys of
missing rows, loaded instances as targets, rollbacks, ORM flushes and guarded_update on the
versioned model, guard columns changed under the guard, and bad input (which must raise a
typed error and change nothing).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import Engine, delete, select
from sqlalchemy.orm import Session

from stateguard import (
    InvalidArgument,
    NotFound,
    Outcome,
    Result,
    StaleVersion,
    TransitionRejected,
    UnknownTrigger,
    guarded_update,
)
from tests._support.models import ORDER_STATES, ORDER_TRANSITIONS, Base, Color, Lamp, Order, Ticket
from tests.conftest import Backend, count_statements

SETTINGS = settings(
    max_examples=30,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

KEYS = (1, 2)
MISSING = 99


# --------------------------------------------------------------------------
# The pure model
# --------------------------------------------------------------------------


@dataclass
class Row:
    state: Any
    version: int | None
    priority: int = 0


@dataclass(frozen=True)
class Edge:
    sources: frozenset[Any]
    dest: Any
    guard: Callable[[Row], bool] | None


@dataclass
class Graph:
    """trigger -> edges, built from a ``transitions``-style declaration."""

    states: tuple[Any, ...]
    edges: dict[str, list[Edge]] = field(default_factory=dict)

    @classmethod
    def declared(
        cls,
        states: Sequence[Any] | type[enum.Enum],
        transitions: Sequence[Mapping[str, Any] | Sequence[Any]],
        guards: Mapping[str, Callable[[Row], bool]] | None = None,
    ) -> Graph:
        members = tuple(states)
        enum_cls = states if isinstance(states, type) else None

        def ref(value: Any) -> Any:
            if enum_cls is not None and not isinstance(value, enum_cls):
                return enum_cls[value] if value in enum_cls.__members__ else enum_cls(value)
            return value

        graph = cls(members)
        for t in transitions:
            trigger, source, dest = (
                (t["trigger"], t["source"], t["dest"]) if isinstance(t, Mapping) else tuple(t)
            )
            if source == "*":
                sources = frozenset(members)
            elif isinstance(source, str | enum.Enum):
                sources = frozenset([ref(source)])
            else:
                sources = frozenset(ref(s) for s in source)
            guard = (guards or {}).get(trigger)
            graph.edges.setdefault(trigger, []).append(Edge(sources, ref(dest), guard))
        return graph

    def dests(self, trigger: str) -> set[Any]:
        return {e.dest for e in self.edges[trigger]}

    def fire(self, row: Row | None, trigger: str, expected: int | None) -> tuple[Outcome, Row | None]:
        """What firing ``trigger`` must report, and the row afterwards (SCHEMES.md, schemes 1 and 2)."""
        if row is None:
            return Outcome.NOT_FOUND, None
        edge = next((e for e in self.edges[trigger] if row.state in e.sources), None)
        version_ok = expected is None or expected == row.version
        if edge is not None and version_ok and (edge.guard is None or edge.guard(row)):
            version = None if row.version is None else row.version + 1
            return Outcome.APPLIED, replace(row, state=edge.dest, version=version)
        if row.state in self.dests(trigger) and edge is None:
            # Already there: REPEATED wins over a version mismatch.  Not when the trigger also
            # leaves from there (a self-loop such as stop: * -> red fired on a red row): the
            # UPDATE would have matched, so it did not apply (STALE or REJECTED).
            return Outcome.REPEATED, row
        if edge is not None and not version_ok:
            return Outcome.STALE, row
        return Outcome.REJECTED, row


# Restated from tests/_support/models.py on purpose: the model must not read stateguard's copy.
TICKET_GRAPH = Graph.declared(
    ["open", "closed"],
    [
        {"trigger": "close", "source": "open", "dest": "closed"},
        {"trigger": "touch", "source": "open", "dest": "open"},
        ["reopen", "closed", "open"],
    ],
    guards={"close": lambda row: row.priority < 5},  # where=lambda c: c.priority < 5
)
LAMP_GRAPH = Graph.declared(
    Color,
    [
        {"trigger": "go", "source": Color.RED, "dest": Color.GREEN},
        {"trigger": "slow", "source": "GREEN", "dest": Color.BLUE},
        {"trigger": "stop", "source": "*", "dest": Color.RED},
    ],
)
ORDER_GRAPH = Graph.declared(ORDER_STATES, ORDER_TRANSITIONS)

ERRORS = {
    Outcome.REJECTED: TransitionRejected,
    Outcome.STALE: StaleVersion,
    Outcome.NOT_FOUND: NotFound,
}


@dataclass(frozen=True)
class Spec:
    model: type[Any]
    graph: Graph
    state_attr: str
    versioned: bool
    guard_column: str | None = None


SPECS = {
    "Order": Spec(Order, ORDER_GRAPH, "status", versioned=True),
    "Ticket": Spec(Ticket, TICKET_GRAPH, "state", versioned=False, guard_column="priority"),
    "Lamp": Spec(Lamp, LAMP_GRAPH, "color", versioned=True),
}


# --------------------------------------------------------------------------
# The state machine driving both
# --------------------------------------------------------------------------


def run_against_model(engine: Engine, backend_name: str, spec: Spec) -> None:
    model = spec.model
    machine = model.flow
    graph = spec.graph
    triggers = sorted(graph.edges)
    state_strategy = st.sampled_from(graph.states)
    MISTAKES = ["unknown trigger", "key type", "set the state", "unknown column"]
    if not spec.versioned:
        MISTAKES.append("version of an unversioned model")

    class Agreement(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.rows: dict[int, Row] = {}
            self.flushes = 0
            with Session(engine) as s, s.begin():
                s.execute(delete(model))

        @initialize(
            states=st.lists(state_strategy, min_size=2, max_size=2),
            priorities=st.lists(st.integers(0, 9), min_size=2, max_size=2),
        )
        def insert_rows(self, states: list[Any], priorities: list[int]) -> None:
            with Session(engine) as s, s.begin():
                for key, state, priority in zip(KEYS, states, priorities, strict=True):
                    row = model(id=key, **{spec.state_attr: state})
                    if spec.guard_column:
                        setattr(row, spec.guard_column, priority)
                    s.add(row)
            for key, state, priority in zip(KEYS, states, priorities, strict=True):
                # ORM inserts start SQLAlchemy's version counter at 1.
                self.rows[key] = Row(
                    state, 1 if spec.versioned else None, priority if spec.guard_column else 0
                )

        def _expected_version(self, key: int, mode: str) -> int | None:
            if mode == "none":
                return None
            base = self.rows[key].version if key in self.rows else 1
            assert base is not None
            return base + {"current": 0, "behind": -1, "ahead": 1}[mode]

        @rule(
            key=st.sampled_from([*KEYS, MISSING]),
            trigger=st.sampled_from(triggers),
            mode=st.sampled_from(["none", "current", "behind", "ahead"] if spec.versioned else ["none"]),
            by_instance=st.booleans(),
            commit=st.booleans(),
        )
        def fire(self, key: int, trigger: str, mode: str, by_instance: bool, commit: bool) -> None:
            expected = self._expected_version(key, mode)
            outcome, after = graph.fire(self.rows.get(key), trigger, expected)
            with Session(engine) as s:
                s.begin()
                target: Any = key
                if by_instance and key in self.rows:
                    target = s.get_one(model, key)
                with count_statements(engine) as counter:
                    if trigger == triggers[0]:
                        r = getattr(machine, trigger)(s, target, expected_version=expected)
                    else:
                        r = machine.fire(s, trigger, target, expected_version=expected)
                self._check_result(r, key, trigger, outcome, after, expected)
                # One UPDATE when it applies; the UPDATE and one read when it does not.
                assert len(counter) == (1 if outcome is Outcome.APPLIED else 2), counter.statements
                if target is not key and after is not None:
                    assert getattr(target, spec.state_attr) == after.state
                    if spec.versioned:
                        assert target.version == after.version
                if commit:
                    s.commit()
                else:
                    s.rollback()
            if commit and after is not None:
                self.rows[key] = after

        def _check_result(
            self, r: Result, key: int, trigger: str, outcome: Outcome, after: Row | None, expected: int | None
        ) -> None:
            assert r.outcome is outcome, (trigger, key, expected, self.rows.get(key), r)
            assert r.applied is (outcome is Outcome.APPLIED)
            assert (r.key, r.trigger, r.expected_version) == (key, trigger, expected)
            if after is None:
                assert (r.state, r.version) == (None, None)
            else:
                assert r.state == after.state and type(r.state) is type(after.state)
                assert r.version == after.version, (backend_name, r)
            error = ERRORS.get(outcome)
            if error is None:
                assert r.raise_for_outcome() is r
            else:
                try:
                    r.raise_for_outcome()
                except error as exc:
                    assert (exc.model, exc.key, exc.trigger, exc.state) == (model, key, trigger, r.state)
                else:  # pragma: no cover
                    raise AssertionError(f"{outcome} did not raise {error.__name__}")

        @precondition(lambda self: spec.model is Order)
        @rule(key=st.sampled_from([*KEYS, MISSING]), mode=st.sampled_from(["current", "behind", "ahead"]))
        def update_with_version(self, key: int, mode: str) -> None:
            """guarded_update is APPLIED, STALE or NOT_FOUND exactly as the version says."""
            expected = self._expected_version(key, mode)
            assert expected is not None
            row = self.rows.get(key)
            with Session(engine) as s, s.begin():
                r = guarded_update(s, Order, key, {"note": f"v{expected}"}, expected_version=expected)
            if row is None:
                assert (r.outcome, r.version) == (Outcome.NOT_FOUND, None)
            elif expected == row.version:
                assert (r.outcome, r.version) == (Outcome.APPLIED, expected + 1)
                self.rows[key] = replace(row, version=expected + 1)
            else:
                assert (r.outcome, r.version) == (Outcome.STALE, row.version)

        @precondition(lambda self: spec.model is Order and bool(self.rows))
        @rule(key=st.sampled_from(KEYS))
        def orm_flush(self, key: int) -> None:
            """A plain ORM update bumps the same version column (version_id_col)."""
            self.flushes += 1
            with Session(engine) as s, s.begin():
                s.get_one(Order, key).note = f"orm {self.flushes}"  # always a change, so always an UPDATE
            row = self.rows[key]
            assert row.version is not None
            self.rows[key] = replace(row, version=row.version + 1)

        @precondition(lambda self: spec.guard_column is not None and bool(self.rows))
        @rule(key=st.sampled_from(KEYS), priority=st.integers(0, 9))
        def change_guard_column(self, key: int, priority: int) -> None:
            assert spec.guard_column is not None
            with Session(engine) as s, s.begin():
                setattr(s.get_one(model, key), spec.guard_column, priority)
            self.rows[key] = replace(self.rows[key], priority=priority)

        @precondition(lambda self: bool(self.rows))
        @rule(key=st.sampled_from(KEYS), mistake=st.sampled_from(MISTAKES))
        def bad_input(self, key: int, mistake: str) -> None:
            """Bad input raises a typed error before anything is sent to the database."""
            trigger = triggers[0]
            calls: dict[str, Callable[[Session], Any]] = {
                "unknown trigger": lambda s: machine.fire(s, "explode", key),
                "key type": lambda s: machine.fire(s, trigger, str(key)),
                "set the state": lambda s: machine.fire(s, trigger, key, values={spec.state_attr: None}),
                "unknown column": lambda s: machine.fire(s, trigger, key, values={"nope": 1}),
                "version of an unversioned model": lambda s: machine.fire(
                    s, trigger, key, expected_version=1
                ),
            }
            kind = UnknownTrigger if mistake == "unknown trigger" else InvalidArgument
            with Session(engine) as s, s.begin(), count_statements(engine) as counter:
                try:
                    calls[mistake](s)
                except kind:
                    pass
                else:  # pragma: no cover
                    raise AssertionError(f"{mistake}: no {kind.__name__}")
                assert counter.statements == []

        @invariant()
        def rows_agree(self) -> None:
            with Session(engine) as s:
                found = {
                    row.id: Row(
                        getattr(row, spec.state_attr),
                        row.version if spec.versioned else None,
                        getattr(row, spec.guard_column) if spec.guard_column else 0,
                    )
                    for row in s.scalars(select(model))
                }
            assert found == self.rows

    run_state_machine_as_test(Agreement, settings=SETTINGS)


def test_order_rows_agree_with_the_pure_graph(backend: Backend) -> None:
    """Random pay/ship/cancel (with current, behind and ahead versions, missing keys, instances, rollbacks,
    guarded_update and ORM flushes) report what the pure model of Order's graph says, step by step."""
    engine = backend.create(Base.metadata)
    run_against_model(engine, backend.name, SPECS["Order"])


def test_ticket_rows_agree_with_the_pure_graph(backend: Backend) -> None:
    """Random close/touch/reopen on Ticket (a guard on priority, a self-loop, no version column) report what
    the pure model says while the guard column changes."""
    engine = backend.create(Base.metadata)
    run_against_model(engine, backend.name, SPECS["Ticket"])


def test_lamp_rows_agree_with_the_pure_graph(backend: Backend) -> None:
    """Random go/slow/stop on Lamp (Enum states, a '*' source that is a self-loop from RED, a version column)
    report enum members and versions as the pure model says."""
    engine = backend.create(Base.metadata)
    run_against_model(engine, backend.name, SPECS["Lamp"])


def test_the_pure_model_is_the_declared_graph() -> None:
    """The restated graphs allow exactly the triggers each machine reports as available from every state."""
    for spec in SPECS.values():
        for state in spec.graph.states:
            obj = spec.model(**{spec.state_attr: state})
            allowed = sorted(
                t for t, edges in spec.graph.edges.items() if any(state in e.sources for e in edges)
            )
            assert sorted(spec.model.flow.available(obj)) == allowed, (spec.model.__name__, state)
