"""The consumers' business write in the tests: one ``consumer_effects`` row per handler run that committed.

No unique key on ``event_id``: an effect applied twice shows as two rows.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, func, insert, select
from sqlalchemy.orm import Session

from stateguard import emit
from stateguard.consumers import Message
from stateguard.tables import outbox

metadata = MetaData()
effects = Table(
    "consumer_effects",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("event_id", String(80), nullable=False),
    Column("key", String(80)),
    Column("seq", Integer),
    Column("pid", Integer, nullable=False),
)


def record(session: Session, message: Message) -> None:
    """The handler most tests use: one effect row for the message, in the consume_once transaction."""
    payload = message.payload
    seq = payload.get("seq") if isinstance(payload, dict) else None
    session.execute(insert(effects).values(event_id=message.id, key=message.key, seq=seq, pid=os.getpid()))


def emit_events(engine: Engine, n: int, *, topic: str = "order.paid", keys: int = 3) -> list[int]:
    """``n`` committed events over the keys k0..k<keys-1>, payload ``{"seq": i}``; their ids."""
    with Session(engine) as session, session.begin():
        return [emit(session, topic, {"seq": i}, key=f"k{i % keys}") for i in range(n)]


def applied(engine: Engine) -> Counter[str]:
    """How many effect rows each message id has."""
    with engine.connect() as conn:
        return Counter(row.event_id for row in conn.execute(select(effects.c.event_id)))


def committed_ids(engine: Engine) -> set[str]:
    """The ids of every committed outbox event, as the sinks write them."""
    with engine.connect() as conn:
        return {str(i) for i in conn.execute(select(outbox.c.id)).scalars()}


def effect_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(effects)).scalar_one())


def payload_of(message: Message) -> Any:
    return message.payload
