"""Declaration mistakes raise ConfigurationError when the class is defined."""

from __future__ import annotations

import enum
from typing import Any

import pytest
from sqlalchemy import Enum, ForeignKey, Integer, String, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import ConfigurationError, StateguardError, StateMachine, version_column
from tests._support.models import Base, Order
from tests.conftest import Backend

GOOD = [{"trigger": "go", "source": "a", "dest": "b"}]


def define(transitions: Any = None, states: Any = None, column: str = "state", **extra: Any) -> type:
    """Define a fresh mapped class with one machine (a new Base each time)."""

    class B(DeclarativeBase):
        pass

    class Thing(B):
        __tablename__ = "things"
        id: Mapped[int] = mapped_column(primary_key=True)
        state: Mapped[str] = mapped_column(String(10))
        other: Mapped[int] = mapped_column(Integer, default=0)
        flow = StateMachine(
            column,
            states=["a", "b", "c"] if states is None else states,
            transitions=GOOD if transitions is None else transitions,
            **extra,
        )

    return Thing


@pytest.mark.parametrize(
    ("transitions", "states", "column", "needle"),
    [
        ([{"trigger": "go", "source": "a", "dest": "zz"}], None, "state", "'zz' is not a declared state"),
        ([{"trigger": "go", "source": "zz", "dest": "b"}], None, "state", "'zz' is not a declared state"),
        ([{"trigger": "fire", "source": "a", "dest": "b"}], None, "state", "clashes"),
        ([{"trigger": "available", "source": "a", "dest": "b"}], None, "state", "clashes"),
        ([{"trigger": "history", "source": "a", "dest": "b"}], None, "state", "clashes"),
        ([{"trigger": "many", "source": "a", "dest": "b"}], None, "state", "clashes"),
        ([["go", "a", "b"], ["go", "a", "c"]], None, "state", "two different states"),
        (GOOD, None, "nope", "not a mapped column"),
        (GOOD, [], "state", "at least one state"),
        ([], None, "state", "at least one transition"),
        ([{"trigger": "go", "source": "a", "dest": "b", "conditions": "ok"}], None, "state", "not supported"),
        ([{"trigger": "go", "source": "a", "dest": "b", "before": "x"}], None, "state", "not supported"),
        (
            [{"trigger": "go", "source": "a", "dest": "b", "values": {"nope": 1}}],
            None,
            "state",
            "unknown column",
        ),
        (
            [{"trigger": "go", "source": "a", "dest": "b", "values": {"state": "c"}}],
            None,
            "state",
            "state column",
        ),
        ([{"trigger": "go", "source": "a", "dest": "b", "where": "x > 1"}], None, "state", "callable"),
        ([{"trigger": "go", "dest": "b"}], None, "state", "lacks"),
        (["go"], None, "state", "[trigger, source, dest]"),
    ],
)
def test_declaration_errors_name_the_model_and_culprit(
    transitions: Any, states: Any, column: str, needle: str
) -> None:
    """Each inconsistent declaration fails at class definition with a message naming model and offender."""
    with pytest.raises(ConfigurationError) as info:
        define(transitions, states, column)
    assert needle in str(info.value)
    assert isinstance(info.value, StateguardError)
    if needle not in ("at least one state",):
        assert "Thing" in str(info.value)


def test_guards_with_subqueries_or_other_tables_are_rejected() -> None:
    """A where-guard over other rows would not be atomic: it is refused at definition."""

    class B(DeclarativeBase):
        pass

    class Parent(B):
        __tablename__ = "parents"
        id: Mapped[int] = mapped_column(primary_key=True)
        limit: Mapped[int] = mapped_column(Integer, default=0)

    with pytest.raises(ConfigurationError, match="subquery"):

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
                            select(Parent.limit).where(Parent.id == c.parent_id).scalar_subquery() > 0
                        ),
                    }
                ],
            )

    with pytest.raises(ConfigurationError, match=r"parents\.limit"):

        class Child2(B):
            __tablename__ = "children2"
            id: Mapped[int] = mapped_column(primary_key=True)
            state: Mapped[str] = mapped_column(String(10))
            flow = StateMachine(
                "state",
                states=["a", "b"],
                transitions=[
                    {"trigger": "go", "source": "a", "dest": "b", "where": lambda c: Parent.limit > 0}
                ],
            )


class Mood(enum.Enum):
    HAPPY = "happy"
    SAD = "sad"


class Other(enum.Enum):
    X = "x"


def test_enum_column_of_another_enum_is_rejected() -> None:
    """An Enum column whose enum class differs from the declared states is a configuration error."""

    class B(DeclarativeBase):
        pass

    with pytest.raises(ConfigurationError, match="Enum of Other"):

        class Person(B):
            __tablename__ = "people"
            id: Mapped[int] = mapped_column(primary_key=True)
            mood: Mapped[Other] = mapped_column(Enum(Other, native_enum=False))
            flow = StateMachine("mood", states=Mood, transitions=[["cheer", "SAD", "HAPPY"]])


def test_loading_rows_creates_no_per_row_machine_or_listener(backend: Backend) -> None:
    """Loaded rows carry no machine, trigger or event listener of their own: one machine per class."""
    engine = backend.create(Base.metadata)
    with Session(engine) as s, s.begin():
        s.add_all([Order(id=i) for i in range(1, 51)])
    with Session(engine) as s:
        rows = s.scalars(select(Order)).all()
        assert len(rows) == 50
        for row in rows:
            assert set(vars(row)) <= {"_sa_instance_state", *Order.__mapper__.attrs.keys()}
            assert row.flow is Order.flow  # the class-level machine, not a bound copy
        assert Order.flow.graph is Order.flow.graph and Order.flow.graph.models == []
        # No instance-level event dispatch was created for any row.
        assert all("dispatch" not in vars(r) for r in rows)


def test_a_mixin_machine_binds_to_each_model() -> None:
    """A machine declared on a mixin gets one copy per mapped class, each on its own table."""

    class B(DeclarativeBase):
        pass

    class Flow:
        state: Mapped[str] = mapped_column(String(10), default="a")
        flow = StateMachine("state", states=["a", "b"], transitions=[["go", "a", "b"]])

    class One(Flow, B):
        __tablename__ = "ones"
        id: Mapped[int] = mapped_column(primary_key=True)

    class Two(Flow, B):
        __tablename__ = "twos"
        id: Mapped[int] = mapped_column(primary_key=True)
        version: Mapped[int] = version_column()

    assert One.flow.model is One and Two.flow.model is Two
    assert One.flow.state_column.table.name == "ones" and Two.flow.state_column.table.name == "twos"
