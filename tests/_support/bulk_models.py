"""Models and helpers of the bulk-transition and history tests (Trigger.many, Trigger.where, history=True)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, String, select, text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import (
    StateMachine,
    version_column,
)
from stateguard.tables import transition_log

JOIN = 60.0


class BulkBase(DeclarativeBase):
    pass


class BOrder(BulkBase):
    __tablename__ = "bh_orders"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    version: Mapped[int] = version_column()
    amount: Mapped[int] = mapped_column(default=0)
    note: Mapped[str | None] = mapped_column(String(50))

    flow = StateMachine(
        "status",
        states=["pending", "paid", "shipped", "cancelled", "approved"],
        transitions=[
            {"trigger": "pay", "source": "pending", "dest": "paid"},
            {"trigger": "ship", "source": "paid", "dest": "shipped"},
            {"trigger": "cancel", "source": ["pending", "paid"], "dest": "cancelled"},
            {"trigger": "refund", "source": "paid", "dest": "pending"},
            {"trigger": "approve", "source": "pending", "dest": "approved", "where": lambda c: c.amount > 0},
            {"trigger": "renote", "source": "paid", "dest": "paid"},
        ],
        history=True,
    )


# -- helpers -------------------------------------------------------------------


def _seed(engine: Engine, n: int, **kw: Any) -> None:
    with Session(engine) as s, s.begin():
        s.execute(
            BOrder.__table__.insert(),
            [{"id": i, "status": "pending", "version": 1, **kw} for i in range(1, n + 1)],
        )


def _rows(engine: Engine) -> dict[int, tuple[str, int, str | None]]:
    with Session(engine) as s:
        return {
            r.id: (r.status, r.version, r.note)
            for r in s.execute(select(BOrder.id, BOrder.status, BOrder.version, BOrder.note))
        }


def _log(engine: Engine, model: str = "bh_orders") -> list[Any]:
    with Session(engine) as s:
        return list(
            s.execute(
                select(
                    transition_log.c.row_key,
                    transition_log.c.trigger,
                    transition_log.c.source,
                    transition_log.c.dest,
                    transition_log.c.version,
                    transition_log.c.request_id,
                    transition_log.c.meta,
                )
                .where(transition_log.c.model == model)
                .order_by(transition_log.c.id)
            )
        )


def _threads(n: int, work: Callable[[int, threading.Barrier], Any]) -> list[Any]:
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = work(i, barrier)
        except BaseException as error:
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN)
    assert not any(t.is_alive() for t in threads), "a worker hung (deadlock?)"
    assert not errors, errors
    return results


def _nothing_written(engine: Engine, n: int) -> None:
    assert _rows(engine) == {i: ("pending", 1, None) for i in range(1, n + 1)}
    assert _log(engine) == []


def _conn_id(session: Session, name: str) -> int:
    q = "SELECT pg_backend_pid()" if name == "postgresql" else "SELECT CONNECTION_ID()"
    return int(session.execute(text(q)).scalar_one())


def _wait_blocked(engine: Engine, name: str, conn_id: int, ready: threading.Event) -> None:
    """Poll the server until connection ``conn_id`` waits on a row lock.

    MariaDB refreshes information_schema.innodb_trx at most every 0.1 s, so the poll waits that
    long between reads (a condition poll, not a sleep hoping for a race)."""
    if name == "postgresql":
        q = f"SELECT count(*) FROM pg_stat_activity WHERE pid = {conn_id} AND wait_event_type = 'Lock'"
    else:
        q = (
            "SELECT count(*) FROM information_schema.innodb_trx "
            f"WHERE trx_mysql_thread_id = {conn_id} AND trx_state = 'LOCK WAIT'"
        )
    for _ in range(300):
        with engine.connect() as c:
            if c.execute(text(q)).scalar():
                return
        if ready.wait(0.12):
            return
    raise AssertionError("the batch never waited on the held row")
