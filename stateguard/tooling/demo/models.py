"""The demo's own mapped tables (``sg_demo_*``), on a metadata of their own.

:class:`DemoBase` keeps them apart from the application's models, so
:func:`~stateguard.tooling.demo.run_demo` drops and creates only these;
:class:`DemoOrder` carries the state machine ``stateguard graph`` and
``stateguard check`` are shown on (``stateguard.tooling.demo:DemoOrder``).
"""

from __future__ import annotations

import datetime

from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from ...machine import StateMachine
from ...versioning import version_column

__all__ = ["DemoBase", "DemoInbox", "DemoOrder", "DemoPlainInbox", "DemoSideEffect", "DemoStock"]


class DemoBase(DeclarativeBase):
    """The demo's own metadata, so it drops and creates only its ``sg_demo_*`` tables."""


class DemoOrder(DemoBase):
    """An order driven by a state machine (and, in the optimistic scheme, by timestamps)."""

    __tablename__ = "sg_demo_orders"
    #: Dead ends by design (``stateguard check`` reports undeclared dead ends).
    __stateguard_final__ = ("shipped", "cancelled")
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    version: Mapped[int] = version_column()
    paid_at: Mapped[datetime.datetime | None]
    cancelled_at: Mapped[datetime.datetime | None]

    flow = StateMachine(
        "status",
        states=["pending", "paid", "shipped", "cancelled"],
        transitions=[
            {"trigger": "pay", "source": "pending", "dest": "paid"},
            {"trigger": "ship", "source": "paid", "dest": "shipped"},
            {"trigger": "cancel", "source": ["pending", "paid"], "dest": "cancelled"},
        ],
    )


class DemoSideEffect(DemoBase):
    """One row per side effect that ran (charge the card, send the parcel, ...).

    Deliberately no unique constraint: a double side effect must be counted,
    not turned into an error that hides it.
    """

    __tablename__ = "sg_demo_side_effects"
    id: Mapped[int] = mapped_column(primary_key=True)
    scheme: Mapped[str] = mapped_column(String(40), index=True)
    order_id: Mapped[int]
    action: Mapped[str] = mapped_column(String(20))
    request_id: Mapped[str] = mapped_column(String(60))
    worker: Mapped[str] = mapped_column(String(20))


class DemoStock(DemoBase):
    """One hot stock row for the flash sale (no CHECK: only the guard keeps it >= 0)."""

    __tablename__ = "sg_demo_stock"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    amount: Mapped[int]


class DemoInbox(DemoBase):
    """Processed message ids of a message consumer (the insert-once scheme)."""

    __tablename__ = "sg_demo_inbox"
    id: Mapped[int] = mapped_column(primary_key=True)
    message_id: Mapped[str] = mapped_column(String(60), unique=True)


class DemoPlainInbox(DemoBase):
    """The hand-written consumer's inbox: no unique constraint, only a ``SELECT`` before each ``INSERT``."""

    __tablename__ = "sg_demo_inbox_plain"
    id: Mapped[int] = mapped_column(primary_key=True)
    message_id: Mapped[str] = mapped_column(String(60), index=True)
