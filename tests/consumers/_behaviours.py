"""What every broker's consumer does alike, written once: each broker's test module calls these with
its own :class:`Broker` and checks what its broker shows afterwards (its queue, its dead letters).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from stateguard import consume_once
from stateguard.consumers import Message

from ._drive import run_until
from ._effects import applied, record


class Counting(Protocol):
    """A broker's consumer: ``run(stop_event)`` until stopped, ``stop()``, what it handled and
    dead-lettered."""

    handled: int
    dead_lettered: int

    def run(self, stop_event: threading.Event | None = None) -> None: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class Broker:
    """One test's database and broker: ``publish(message_id)`` puts one message with that id
    (``None``: none) on the test's private queue or stream; ``consumer(handler)`` is a consumer of
    it running ``handler``."""

    db: Engine
    publish: Callable[[Any], None]
    consumer: Callable[[Any], Counting]


def repeat_is_acked_without_the_handler(broker: Broker) -> None:
    """A message whose id was consumed and committed before the consumer died (before its ack): the
    redelivery is REPEATED and acknowledged, the handler not run."""
    broker.publish("41")
    with Session(broker.db) as session, session.begin():
        consume_once(session, "billing", "41")
    calls: list[Message] = []
    c = broker.consumer(lambda s, m: calls.append(m))
    run_until(c, lambda: c.handled == 1)
    assert calls == []


def message_without_an_id_is_dead_lettered(broker: Broker) -> None:
    """A message with no id cannot be deduplicated: it is dead-lettered at once (the caller counts the
    broker's dead letters)."""
    broker.publish(None)
    c = broker.consumer(record)
    run_until(c, lambda: c.dead_lettered == 1)


def stop_finishes_the_message_in_hand(broker: Broker, messages: int) -> Counting:
    """``messages`` messages "0", "1" ...; stop() while the handler of the first runs: it commits and
    is acked, run() returns, nothing else is applied.  The stopped consumer."""
    for i in range(messages):
        broker.publish(str(i))
    inside, release = threading.Event(), threading.Event()

    def slow(session: Session, message: Message) -> None:
        record(session, message)
        inside.set()
        release.wait(5)

    c = broker.consumer(slow)
    thread = threading.Thread(target=c.run)
    thread.start()
    assert inside.wait(5)
    c.stop()
    release.set()
    thread.join(10)
    assert not thread.is_alive()
    assert applied(broker.db) == {"0": 1} and c.handled == 1
    return c


def hostile_ids_are_dead_lettered_at_once(
    broker: Broker, caplog: pytest.LogCaptureFixture, hostile: int, logged: str
) -> None:
    """After ``hostile`` messages whose ids cannot be recorded (published by the caller), one good
    message "ok": each hostile one is dead-lettered on its first delivery with the reason logged (a
    line containing ``logged``), the handler runs for "ok" alone."""
    broker.publish("ok")
    calls: list[str] = []

    def handler(session: Session, message: Message) -> None:
        calls.append(message.id)
        record(session, message)

    c = broker.consumer(handler)
    with caplog.at_level("ERROR", logger="stateguard.consumers"):
        run_until(c, lambda: c.dead_lettered == hostile and c.handled == 1)
    assert calls == ["ok"] and applied(broker.db) == {"ok": 1}
    reasons = [r.getMessage() for r in caplog.records if logged in r.getMessage()]
    assert len(reasons) == hostile, reasons
    assert all("cannot be recorded" in r or "not UTF-8" in r for r in reasons), reasons
