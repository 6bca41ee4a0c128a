"""A trigger with several destinations on a SQLAlchemy Enum column works on every backend.

The CASE that picks the destination bound raw Enum members without the
column's type, which SQLite and MariaDB refuse (found while adding events).
"""

from __future__ import annotations

import enum

from sqlalchemy import Enum, Integer, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import Outcome, StateMachine
from tests.conftest import Backend


class Light(enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class _Base(DeclarativeBase):
    pass


class Signal(_Base):
    __tablename__ = "enum_dest_signals"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    light: Mapped[Light] = mapped_column(Enum(Light, native_enum=False, length=10), default=Light.RED)

    flow = StateMachine(
        "light",
        states=Light,
        transitions=[
            {"trigger": "next", "source": Light.RED, "dest": Light.GREEN},
            {"trigger": "next", "source": Light.GREEN, "dest": Light.BLUE},
        ],
    )


def test_several_destinations_on_an_enum_column(backend: Backend) -> None:
    """next moves RED -> GREEN -> BLUE, then is REPEATED; single calls and many()."""
    engine = backend.create(_Base.metadata)
    with Session(engine) as s, s.begin():
        s.add_all([Signal(id=1), Signal(id=2)])
    with Session(engine) as s, s.begin():
        assert Signal.flow.next(s, 1).state is Light.GREEN
        assert Signal.flow.next(s, 1).state is Light.BLUE
        assert Signal.flow.next(s, 1).outcome is Outcome.REPEATED  # BLUE: where next leads
        assert {k: r.outcome for k, r in Signal.flow.next.many(s, [1, 2]).items()} == {
            1: Outcome.REPEATED,
            2: Outcome.APPLIED,
        }
    with Session(engine) as s:
        assert dict(s.execute(select(Signal.id, Signal.light)).all()) == {1: Light.BLUE, 2: Light.GREEN}
