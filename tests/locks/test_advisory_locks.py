"""Advisory locks at their edges: ``timeout=inf`` waits like ``timeout=None``, and a MariaDB GET_LOCK
holder whose connection is killed gets LockLost."""

from __future__ import annotations

import math
import threading
from decimal import Decimal

import pytest
from sqlalchemy import Engine, Integer, Numeric, String, text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import (
    LockLost,
    StateMachine,
    advisory_lock,
    version_column,
)
from tests.conftest import Backend, backends_with


class _Base(DeclarativeBase):
    pass


class Item(_Base):
    """A str key, a short text column, a counter, a version and a logged machine."""

    __tablename__ = "hostile_items"
    code: Mapped[str] = mapped_column(String(40), primary_key=True)
    note: Mapped[str | None] = mapped_column(String(10))
    qty: Mapped[int] = mapped_column(Integer, default=10)
    price: Mapped[Decimal] = mapped_column(Numeric(12, 2), default=Decimal("5.00"))
    status: Mapped[str] = mapped_column(String(20), default="new")
    version: Mapped[int] = version_column()

    flow = StateMachine(
        "status",
        states=["new", "done"],
        transitions=[["finish", "new", "done"]],
        history=True,
    )


def _seed(s: Session) -> None:
    s.add(Item(code="a"))


pytestmark = pytest.mark.tables(_Base.metadata, seed=_seed)


@pytest.mark.cancel
@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_advisory_lock_timeout_inf_waits_like_none(backend: Backend) -> None:
    """timeout=float('inf') takes a free lock (GET_LOCK refused 'inf' as a raw error before)."""
    with Session(backend.engine) as s, s.begin():
        with advisory_lock(s, "hostile-inf", timeout=math.inf):
            pass


@pytest.mark.restart
def test_get_lock_holder_whose_connection_is_killed_gets_lock_lost(mariadb: Backend) -> None:
    """MariaDB: KILL CONNECTION of the holder inside the block; the block's end raises LockLost."""
    backend = mariadb
    with pytest.raises(LockLost, match="lost with its connection"), Session(backend.engine) as s:
        with advisory_lock(s, "hostile-kill"):
            conn_id = s.execute(text("SELECT CONNECTION_ID()")).scalar_one()
            killer = threading.Thread(target=_kill, args=(backend.engine, conn_id))
            killer.start()
            killer.join()
    # The server released the lock with the connection: another session takes it at once.
    with Session(backend.engine) as s, advisory_lock(s, "hostile-kill", timeout=0):
        pass


def _kill(engine: Engine, conn_id: int) -> None:
    with engine.connect() as conn:
        conn.execute(text(f"KILL CONNECTION {int(conn_id)}"))
