"""Models shared by the tests (importable by worker processes)."""

from __future__ import annotations

import datetime
import enum

from sqlalchemy import Enum, ForeignKey, Integer, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from stateguard import StateMachine, version_column


class Base(DeclarativeBase):
    pass


ORDER_STATES = ["pending", "paid", "shipped", "cancelled"]
ORDER_TRANSITIONS = [
    {"trigger": "pay", "source": "pending", "dest": "paid"},
    {"trigger": "ship", "source": "paid", "dest": "shipped"},
    {"trigger": "cancel", "source": ["pending", "paid"], "dest": "cancelled"},
]


class Order(Base):
    """The README's model: string states and a version column."""

    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    version: Mapped[int] = version_column()
    paid_at: Mapped[datetime.datetime | None]
    note: Mapped[str | None] = mapped_column(String(50))
    amount: Mapped[int] = mapped_column(Integer, default=0)

    flow = StateMachine("status", states=ORDER_STATES, transitions=ORDER_TRANSITIONS)


class Ticket(Base):
    """No version column; a guarded trigger and a self-loop."""

    __tablename__ = "tickets"
    id: Mapped[int] = mapped_column(primary_key=True)
    state: Mapped[str] = mapped_column(String(20), default="open")
    priority: Mapped[int] = mapped_column(Integer, default=0)

    flow = StateMachine(
        "state",
        states=["open", "closed"],
        transitions=[
            {"trigger": "close", "source": "open", "dest": "closed", "where": lambda c: c.priority < 5},
            {"trigger": "touch", "source": "open", "dest": "open"},
            ["reopen", "closed", "open"],
        ],
    )


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Lamp(Base):
    """Enum states on a non-native SQLAlchemy Enum column."""

    __tablename__ = "lamps"
    id: Mapped[int] = mapped_column(primary_key=True)
    color: Mapped[Color] = mapped_column(Enum(Color, native_enum=False, length=10), default=Color.RED)
    version: Mapped[int] = version_column()

    flow = StateMachine(
        "color",
        states=Color,
        transitions=[
            {"trigger": "go", "source": Color.RED, "dest": Color.GREEN},
            {"trigger": "slow", "source": "GREEN", "dest": Color.BLUE},
            {"trigger": "stop", "source": "*", "dest": Color.RED},
        ],
    )


class Shipment(Base):
    """Composite primary key, a multi-destination trigger."""

    __tablename__ = "shipments"
    warehouse: Mapped[str] = mapped_column(String(10), primary_key=True)
    number: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    stage: Mapped[str] = mapped_column(String(20), default="new")
    version: Mapped[int] = version_column()

    flow = StateMachine(
        "stage",
        states=["new", "packed", "sent", "delivered"],
        transitions=[
            {"trigger": "advance", "source": "new", "dest": "packed"},
            {"trigger": "advance", "source": "packed", "dest": "sent"},
            {"trigger": "deliver", "source": "sent", "dest": "delivered"},
        ],
    )


class SideEffect(Base):
    """One row per side effect a test ran (to count double applications)."""

    __tablename__ = "side_effects"
    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[int] = mapped_column(ForeignKey("orders.id"))
    what: Mapped[str] = mapped_column(String(20))
    worker: Mapped[str] = mapped_column(String(40))


class Message(Base):
    """A dedup table for insert_once."""

    __tablename__ = "processed_messages"
    id: Mapped[int] = mapped_column(primary_key=True)
    message_id: Mapped[str] = mapped_column(String(10), unique=True)
    consumer: Mapped[str] = mapped_column(String(20), default="c")


class Invoice(Base):
    """A machine with history=True; 'void' has several sources."""

    __tablename__ = "invoices"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="draft")
    version: Mapped[int] = version_column()

    flow = StateMachine(
        "status",
        states=["draft", "sent", "paid", "void"],
        transitions=[
            {"trigger": "send", "source": "draft", "dest": "sent"},
            {"trigger": "pay", "source": "sent", "dest": "paid"},
            {"trigger": "void", "source": ["draft", "sent", "paid"], "dest": "void"},
            {"trigger": "reopen", "source": "void", "dest": "draft"},
        ],
        history=True,
    )
