"""A handler whose own statement fails with what the driver calls an OperationalError, while the
database is up: that is the message's failure (counted, dead-lettered after max_deliveries), not an
outage to wait out forever on the message in hand (blocking the worker and every message after it).

SQLite's "no such table", MariaDB's ``SIGNAL SQLSTATE '45000'`` (PyMySQL raises OperationalError for
error numbers it has no class for) and PostgreSQL's statement timeout (QueryCanceled).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from stateguard.consumers import Message, RedisStreamConsumer

from ..conftest import Backend
from ._effects import applied, record

GROUP = "billing"

FAILING = {
    "sqlite": ("SELECT * FROM sg_no_such_table",),
    "mariadb": ("SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused by a trigger'",),
    "postgresql": ("SET LOCAL statement_timeout = 20", "SELECT pg_sleep(1)"),
}


def test_a_handler_whose_own_statement_fails_operationally_is_dead_lettered(
    backend: Backend, direct: Engine, stream: tuple[Any, str]
) -> None:
    """The database is up; the handler's statement fails (OperationalError): after max_deliveries the
    entry goes to the dead letters and the next entry is handled."""
    client, name = stream
    for entry_id in ("bad", "good"):
        client.xadd(name, {"id": entry_id, "topic": "t", "key": "k", "payload": "{}"})

    def handler(session: Session, message: Message) -> None:
        if message.id == "bad":
            for statement in FAILING[backend.name]:
                session.execute(text(statement))
        record(session, message)

    c = RedisStreamConsumer(
        direct,
        handler,
        client,
        stream=name,
        group=GROUP,
        worker="w1",
        block=timedelta(milliseconds=50),
        claim_idle=timedelta(milliseconds=20),
        max_deliveries=2,
    )
    stop = threading.Event()
    thread = threading.Thread(target=c.run, args=(stop,))
    thread.start()
    deadline = time.monotonic() + 10
    while not (c.dead_lettered == 1 and c.handled == 1) and time.monotonic() < deadline:
        time.sleep(0.02)
    stop.set()
    thread.join(15)
    assert not thread.is_alive()
    assert applied(direct) == {"good": 1} and c.dead_lettered == 1
    [(_, dead)] = client.xrange(f"{name}:dead")
    assert dead[b"id"] == b"bad" and dead[b"error"] == b"the handler failed"
