"""What the outbox tests share: emitting events, reading the table back, sinks that record or refuse."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from stateguard import OutboxEvent, emit
from stateguard.tables import outbox


def emit_one(engine: Engine, topic: str = "t", payload: Any = None, key: str | None = None) -> int:
    """One event in a transaction of its own; its id."""
    with Session(engine) as session, session.begin():
        return emit(session, topic, {} if payload is None else payload, key=key)


def event_rows(engine: Engine) -> list[Any]:
    """Every outbox row, in id order."""
    with engine.connect() as conn:
        return list(conn.execute(select(outbox).order_by(outbox.c.id)))


def event_row(engine: Engine, event_id: int) -> Any:
    """The outbox row of ``event_id``."""
    with engine.connect() as conn:
        return conn.execute(select(outbox).where(outbox.c.id == event_id)).one()


def wait_for_db_clock_past(engine: Engine, ms: int) -> None:
    """Return once the database's clock (epoch ms) is past ``ms``."""
    from stateguard._kernel import db_now_ms

    while True:
        with engine.connect() as conn:
            if conn.execute(select(db_now_ms())).scalar_one() > ms:
                return
        time.sleep(0.05)


class Recorder:
    """A sink that keeps every batch it was given."""

    def __init__(self) -> None:
        self.batches: list[list[OutboxEvent]] = []

    def publish(self, events: Any) -> None:
        self.batches.append(list(events))

    @property
    def ids(self) -> list[int]:
        return [e.id for batch in self.batches for e in batch]


class Refusing:
    """A sink that refuses (raises for) every batch holding a refused id, and records what it took."""

    def __init__(self, refused: set[int]) -> None:
        self.refused = refused
        self.taken: list[int] = []
        self.calls: list[list[int]] = []
        self.lock = threading.Lock()

    def publish(self, events: Sequence[OutboxEvent]) -> None:
        with self.lock:
            self.calls.append([e.id for e in events])
        bad = [e.id for e in events if e.id in self.refused]
        if bad:
            raise RuntimeError(f"the broker refuses events {bad}")
        with self.lock:
            self.taken.extend(e.id for e in events)
