"""Declaring a StateMachine: mistakes fail when the class is defined, and one
machine serves every row (no per-row machine or listener)."""

from __future__ import annotations

import enum
import gc
from typing import Any

import pytest
import transitions
from sqlalchemy import Enum, ForeignKey, Integer, String, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import ConfigurationError, StateguardError, StateMachine, Trigger
from tests._support.models import Base, Order
from tests.conftest import Backend

GOOD: list[Any] = [{"trigger": "go", "source": "a", "dest": "b"}]


def define(transitions: Any = None, states: Any = None, column: str = "state", name: str = "Widget") -> type:
    """Define a fresh mapped class ``name`` with one machine ``flow`` (a new Base each time)."""

    class B(DeclarativeBase):
        pass

    namespace: dict[str, Any] = {
        "__tablename__": "widgets",
        "__annotations__": {"id": Mapped[int], "state": Mapped[str], "other": Mapped[int]},
        "id": mapped_column(primary_key=True),
        "state": mapped_column(String(10)),
        "other": mapped_column(Integer, default=0),
        "flow": StateMachine(
            column,
            states=["a", "b", "c"] if states is None else states,
            transitions=GOOD if transitions is None else transitions,
        ),
    }
    return type(name, (B,), namespace)


def test_a_valid_declaration_binds_to_its_model() -> None:
    """A correct declaration defines the class; the machine knows its model, column and triggers."""
    cls: Any = define([["go", "a", "b"], {"trigger": "back", "source": ["b", "c"], "dest": "a"}])
    assert cls.flow.model is cls
    assert cls.flow.state_column is cls.__table__.c.state
    assert sorted(cls.flow.triggers) == ["back", "go"]
    assert isinstance(cls.flow.go, Trigger)
    assert cls.flow.back.sources == ("b", "c") and cls.flow.back.dests == ("a",)


@pytest.mark.parametrize(
    ("transitions", "culprit", "needle"),
    [
        ([{"trigger": "go", "source": "a", "dest": "zz"}], "'zz'", "not a declared state"),
        ([["go", "a", "zz"]], "'zz'", "not a declared state"),
        ([{"trigger": "go", "source": "zz", "dest": "b"}], "'zz'", "not a declared state"),
        ([{"trigger": "go", "source": ["a", "zz"], "dest": "b"}], "'zz'", "not a declared state"),
        ([["go", "a", "b"], ["go", "a", "c"]], "'go'", "two different states"),
        ([["go", "a", "b"], ["go", "a", "b"]], "'go'", "declared twice"),
        ([{"trigger": "go", "source": [], "dest": "b"}], "'go'", "no source"),
    ],
)
def test_undeclared_states_and_nondeterministic_triggers(transitions: Any, culprit: str, needle: str) -> None:
    """An undeclared source/dest or a trigger going two ways from one source fails at definition."""
    with pytest.raises(ConfigurationError) as info:
        define(transitions)
    message = str(info.value)
    assert needle in message and culprit in message
    assert "Widget" in message and "'go'" in message


@pytest.mark.parametrize(
    "name",
    [
        "fire",
        "available",
        "statement",
        "history",
        "many",
        "where",
        "trigger",
        "triggers",
        "can",
        "target_of",
        "graph",
        "states",
        "model",
        "column",
        "name",
        "_private",
    ],
)
def test_trigger_names_clashing_with_machine_methods_are_rejected(name: str) -> None:
    """A trigger named like one of the machine's or trigger's own attributes fails at definition."""
    with pytest.raises(ConfigurationError) as info:
        define([{"trigger": name, "source": "a", "dest": "b"}])
    message = str(info.value)
    assert "clashes" in message and repr(name) in message and "Widget" in message


@pytest.mark.parametrize("name", ["not valid", "class", "", 3])
def test_trigger_names_must_be_identifiers(name: Any) -> None:
    """A trigger name that is not a Python identifier fails at definition."""
    with pytest.raises(ConfigurationError, match="not a Python identifier"):
        define([{"trigger": name, "source": "a", "dest": "b"}])


def test_unknown_state_column_is_rejected() -> None:
    """A machine over a column the model does not have fails at definition, naming model and column."""
    with pytest.raises(ConfigurationError) as info:
        define(GOOD, column="nope")
    assert "'nope'" in str(info.value) and "Widget" in str(info.value)


def test_no_states_is_rejected() -> None:
    """A machine with no states fails at definition, naming the model."""
    with pytest.raises(ConfigurationError) as info:
        define(GOOD, states=[])
    assert "at least one state" in str(info.value)
    assert "Widget" in str(info.value)


def test_no_transitions_is_rejected() -> None:
    """A machine with no transitions fails at definition, naming the model."""
    with pytest.raises(ConfigurationError) as info:
        define([])
    assert "at least one transition" in str(info.value) and "Widget" in str(info.value)


@pytest.mark.parametrize("states", [["a", "a"], ["a", ""], "abc", [1, 2]])
def test_malformed_state_lists_are_rejected(states: Any) -> None:
    """Duplicate, empty or non-string states fail at definition."""
    with pytest.raises(ConfigurationError):
        define([["go", "a", "a"]], states=states)


@pytest.mark.parametrize("key", ["conditions", "unless", "before", "after", "prepare"])
def test_transitions_package_callbacks_are_not_supported(key: str) -> None:
    """conditions/before/after callbacks would run for race losers too: refused at definition."""
    with pytest.raises(ConfigurationError) as info:
        define([{"trigger": "go", "source": "a", "dest": "b", key: "something"}])
    message = str(info.value)
    assert "not supported" in message and key in message and "Widget" in message
    assert "'go'" in message


def test_unknown_transition_keys_are_rejected() -> None:
    """A misspelt transition key fails at definition instead of being ignored."""
    with pytest.raises(ConfigurationError, match="unknown transition keys"):
        define([{"trigger": "go", "source": "a", "dest": "b", "valuez": {}}])


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"nope": 1}, "unknown column 'nope'"),
        ({"state": "c"}, "state column"),
        ({3: "x"}, "attribute names"),
    ],
)
def test_declared_values_must_name_other_known_columns(values: Any, needle: str) -> None:
    """Declared values naming an unknown column or the state column fail at definition."""
    with pytest.raises(ConfigurationError) as info:
        define([{"trigger": "go", "source": "a", "dest": "b", "values": values}])
    assert needle in str(info.value) and "Widget" in str(info.value) and "'go'" in str(info.value)


def test_declared_values_on_a_known_column_are_accepted() -> None:
    """Declared values naming a real non-state column are fine."""
    cls: Any = define([{"trigger": "go", "source": "a", "dest": "b", "values": {"other": 5}}])
    assert "SET other=" in str(cls.flow.go.statement(1))


def test_where_must_be_a_callable_returning_sql() -> None:
    """A where that is not a callable, or returns a non-SQL value, fails at definition."""
    with pytest.raises(ConfigurationError, match="callable"):
        define([{"trigger": "go", "source": "a", "dest": "b", "where": "other > 1"}])
    with pytest.raises(ConfigurationError, match="SQL expression"):
        define([{"trigger": "go", "source": "a", "dest": "b", "where": lambda c: True}])


def test_where_with_a_subquery_is_rejected() -> None:
    """A where-guard with a subquery over other rows is not atomic and fails at definition."""

    class B(DeclarativeBase):
        pass

    class Parent(B):
        __tablename__ = "parents"
        id: Mapped[int] = mapped_column(primary_key=True)
        cap: Mapped[int] = mapped_column(Integer, default=0)

    with pytest.raises(ConfigurationError) as info:

        class Child(B):
            __tablename__ = "children"
            id: Mapped[int] = mapped_column(primary_key=True)
            state: Mapped[str] = mapped_column(String(10))
            parent_id: Mapped[int] = mapped_column(ForeignKey("parents.id"))
            flow = StateMachine(
                "state",
                states=["a", "b"],
                transitions=[
                    {
                        "trigger": "go",
                        "source": "a",
                        "dest": "b",
                        "where": lambda c: (
                            select(Parent.cap).where(Parent.id == c.parent_id).scalar_subquery() > 0
                        ),
                    }
                ],
            )

    message = str(info.value)
    assert "subquery" in message and "Child" in message and "'go'" in message


def test_where_with_an_exists_over_the_same_table_is_rejected() -> None:
    """An EXISTS over other rows of the same table is still a subquery: refused."""

    class B(DeclarativeBase):
        pass

    with pytest.raises(ConfigurationError, match="subquery"):

        class Seat(B):
            __tablename__ = "seats"
            id: Mapped[int] = mapped_column(primary_key=True)
            state: Mapped[str] = mapped_column(String(10))
            row: Mapped[int] = mapped_column(Integer)
            flow = StateMachine(
                "state",
                states=["free", "held"],
                transitions=[
                    {
                        "trigger": "hold",
                        "source": "free",
                        "dest": "held",
                        "where": lambda c: ~select(c.id).where(c.state == "held").exists(),
                    }
                ],
            )


def test_where_with_another_tables_column_is_rejected() -> None:
    """A where-guard that uses another table's column fails at definition, naming that column."""

    class B(DeclarativeBase):
        pass

    class Limit(B):
        __tablename__ = "limits"
        id: Mapped[int] = mapped_column(primary_key=True)
        cap: Mapped[int] = mapped_column(Integer, default=0)

    with pytest.raises(ConfigurationError) as info:

        class Job(B):
            __tablename__ = "jobs"
            id: Mapped[int] = mapped_column(primary_key=True)
            state: Mapped[str] = mapped_column(String(10))
            flow = StateMachine(
                "state",
                states=["a", "b"],
                transitions=[{"trigger": "go", "source": "a", "dest": "b", "where": lambda c: Limit.cap > 0}],
            )

    message = str(info.value)
    assert "limits.cap" in message and "Job" in message and "'go'" in message


def test_where_over_own_columns_with_functions_is_accepted() -> None:
    """A guard using only the row's own columns and SQL functions is fine."""

    class B(DeclarativeBase):
        pass

    class Job(B):
        __tablename__ = "jobs"
        id: Mapped[int] = mapped_column(primary_key=True)
        state: Mapped[str] = mapped_column(String(10))
        tries: Mapped[int] = mapped_column(Integer, default=0)
        flow = StateMachine(
            "state",
            states=["a", "b"],
            transitions=[
                {
                    "trigger": "go",
                    "source": "a",
                    "dest": "b",
                    "where": lambda c: func.coalesce(c.tries, 0) < 3,
                }
            ],
        )

    assert "coalesce(jobs.tries" in str(Job.flow.go.statement(1))


class Mood(enum.Enum):
    HAPPY = "happy"
    SAD = "sad"


class Other(enum.Enum):
    X = "x"


def test_enum_column_of_another_enum_class_is_rejected() -> None:
    """An Enum column whose enum class differs from the machine's states fails at definition."""

    class B(DeclarativeBase):
        pass

    with pytest.raises(ConfigurationError) as info:

        class Person(B):
            __tablename__ = "people"
            id: Mapped[int] = mapped_column(primary_key=True)
            mood: Mapped[Other] = mapped_column(Enum(Other, native_enum=False))
            flow = StateMachine("mood", states=Mood, transitions=[["cheer", "SAD", "HAPPY"]])

    message = str(info.value)
    assert "Person" in message and "Other" in message and "Mood" in message


def test_enum_states_reject_unknown_member_names() -> None:
    """With Enum states, a source naming no member fails at definition."""

    class B(DeclarativeBase):
        pass

    with pytest.raises(ConfigurationError) as info:

        class Person(B):
            __tablename__ = "people"
            id: Mapped[int] = mapped_column(primary_key=True)
            mood: Mapped[Mood] = mapped_column(Enum(Mood, native_enum=False))
            flow = StateMachine("mood", states=Mood, transitions=[["cheer", "ANGRY", "HAPPY"]])

    assert "'ANGRY'" in str(info.value) and "'cheer'" in str(info.value)


def test_declaration_errors_are_stateguard_errors_not_retryable() -> None:
    """ConfigurationError is a StateguardError with retryable False."""
    with pytest.raises(StateguardError) as info:
        define([["go", "a", "zz"]])
    assert isinstance(info.value, ConfigurationError) and info.value.retryable is False


def test_a_failed_declaration_does_not_break_other_models() -> None:
    """After a rejected declaration, other mapped classes still configure and work."""
    with pytest.raises(ConfigurationError):
        define([["go", "a", "zz"]])
    cls: Any = define(GOOD, name="Fine")
    assert cls.flow.model is cls and "go" in cls.flow.triggers


# -- one machine per class ---------------------------------------------------------


def _graph_machines() -> int:
    gc.collect()
    # type(o), not isinstance(): isinstance() reads __class__, which a lazy proxy (Celery's
    # pending tasks) answers by evaluating itself.
    return sum(1 for o in gc.get_objects() if issubclass(type(o), transitions.Machine))


def test_loading_rows_creates_no_per_row_machine_or_listener(backend: Backend) -> None:
    """Loading 200 rows adds no transitions.Machine, no listener and no per-row machine attribute."""
    engine = backend.create(Base.metadata)
    with Session(engine) as s, s.begin():
        s.add_all([Order(id=i) for i in range(1, 201)])
    manager = Order.__mapper__.class_manager
    listeners_before = {
        name: len(getattr(manager.dispatch, name)) for name in ("load", "refresh", "init", "init_failure")
    }
    machines_before = _graph_machines()
    models_before = list(Order.flow.graph.models)
    with Session(engine) as s:
        rows = s.scalars(select(Order)).all()
        assert len(rows) == 200
        assert _graph_machines() == machines_before
        assert list(Order.flow.graph.models) == models_before
        assert {
            name: len(getattr(manager.dispatch, name)) for name in ("load", "refresh", "init", "init_failure")
        } == listeners_before
        allowed = {"_sa_instance_state", *Order.__mapper__.attrs.keys()}
        for row in rows:
            assert set(vars(row)) <= allowed
            assert row.flow is Order.flow  # the class attribute, not a bound per-row copy
            # transitions' model binding would add these to each object.
            for bound in ("pay", "trigger", "may_pay", "to_paid", "is_paid", "state"):
                assert not hasattr(row, bound), bound


def test_the_machine_is_the_same_object_from_class_and_instance() -> None:
    """Order.flow from the class and from an instance is the same object, with the same graph."""
    order = Order(id=1)
    assert order.flow is Order.flow
    assert order.flow.pay is Order.flow.pay
    assert order.flow.graph is Order.flow.graph
    assert "flow" not in vars(order)


def test_one_graph_machine_per_class_not_per_instance() -> None:
    """Creating many instances does not create transitions machines."""
    before = _graph_machines()
    orders = [Order(id=i) for i in range(500)]
    assert _graph_machines() == before
    assert len(orders) == 500


def test_no_instance_level_event_listener_is_registered() -> None:
    """Creating and loading instances registers no SQLAlchemy event on the instances."""
    order = Order(id=1)
    assert "dispatch" not in vars(order)
    state = order._sa_instance_state  # type: ignore[attr-defined]
    assert not state.callables
