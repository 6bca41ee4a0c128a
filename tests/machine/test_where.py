"""``Trigger.where()`` sweeps: sweepers racing each other and single transitions move every row once,
a huge limit is clamped or refused typed, the limit follows key order, and locked rows are skipped."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import Engine, String, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from stateguard import (
    StateMachine,
    retry_on_conflict,
)
from tests._support.token_races import (
    Base,
    _run_threads,
)
from tests.conftest import Backend


class SweepOrder(Base):
    """The README sweeper's orders: pending rows cancelled by where(), paid concurrently."""

    __tablename__ = "attack_sweep_orders"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    flow = StateMachine(
        "status",
        states=["pending", "paid", "cancelled"],
        transitions=[["pay", "pending", "paid"], ["cancel", "pending", "cancelled"]],
    )


# --------------------------------------------------------------------------
# Insert once / consume_once
# --------------------------------------------------------------------------


@pytest.fixture
def parcels(backend: Backend, engine: Engine) -> Engine:
    return backend.create(Base.metadata)


# --------------------------------------------------------------------------
# More attacks: sweepers, SQLite lock upgrades, Redis caller identity
# --------------------------------------------------------------------------


def test_two_sweepers_and_a_payer_racing_never_move_a_row_twice(parcels: Engine, backend: Backend) -> None:
    """README sweeper, without the lock: two sweepers (where(limit=5) in a loop) and a payer start
    together on 60 pending orders.  No row is cancelled by both sweepers, no paid row is cancelled,
    and what the calls reported is exactly what the table holds."""
    with Session(parcels) as session, session.begin():
        session.add_all([SweepOrder(id=i) for i in range(1, 61)])
    barrier = threading.Barrier(3)

    def sweep_once() -> list[Any]:
        with Session(parcels) as session, session.begin():
            return SweepOrder.flow.cancel.where(session, SweepOrder.id > 0, limit=5)

    def actor(i: int) -> list[Any]:
        barrier.wait()
        moved: list[Any] = []
        if i == 2:
            for key in range(60, 0, -3):
                with Session(parcels) as session, session.begin():
                    if retry_on_conflict(lambda k=key: SweepOrder.flow.pay(session, k)).applied:
                        moved.append(key)
            return moved
        while batch := retry_on_conflict(sweep_once):
            moved.extend(batch)
        return moved

    results = _run_threads(3, actor)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    first, second, paid = results
    assert len(first) == len(set(first)) and len(second) == len(set(second))
    assert not set(first) & set(second), "a row was cancelled by both sweepers"
    assert not (set(first) | set(second)) & set(paid), "a paid row was cancelled"
    with Session(parcels) as session:
        states = dict(session.execute(select(SweepOrder.id, SweepOrder.status)).all())
    assert {k for k, v in states.items() if v == "cancelled"} == set(first) | set(second)
    assert {k for k, v in states.items() if v == "paid"} == set(paid)
    assert "pending" not in states.values()


# Found: Trigger.where(limit=2**63) (a positive int, as documented) escaped as a raw OverflowError
# (SQLite) / DataError "bigint out of range" (PostgreSQL).  Now clamped like a purge batch.
def test_sweep_with_a_huge_limit_is_clamped(parcels: Engine, backend: Backend) -> None:
    with Session(parcels) as session, session.begin():
        session.add_all([SweepOrder(id=1), SweepOrder(id=2)])
    with Session(parcels) as session, session.begin():
        moved = SweepOrder.flow.cancel.where(session, SweepOrder.id > 0, limit=2**63)
    assert sorted(moved) == [1, 2]
