"""How RabbitMQConsumer counts deliveries (docs/how-to/consumers.md): stop() mid-batch
with prefetched messages, a connection cut while a failed message's copy is being requeued or while
the database is away, hostile counting headers, a huge poison body, and a raising listener while the
database is away."""

from __future__ import annotations

import threading
import time
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from stateguard import on_event
from stateguard.consumers import Message, RabbitMQConsumer

from .._support.brokers import RABBITMQ_PORT, RABBITMQ_URL, Queue, via
from .._support.failing_observers import ObserverBug
from .._support.faultproxy import FaultProxy
from ._drive import publish_amqp as publish
from ._drive import run_for, run_until
from ._effects import applied, record


def consumer(
    db: Engine, mq: Queue, handler: Any = record, url: str = RABBITMQ_URL, **kw: Any
) -> RabbitMQConsumer:
    kw.setdefault("poll", 0.05)
    return RabbitMQConsumer(db, handler, url, queue=mq.queue, consumer="billing", **kw)


@pytest.mark.cancel
@pytest.mark.parametrize("max_deliveries", [1, 5])
def test_stop_mid_batch_gives_the_prefetched_messages_back_to_be_handled_not_dead_lettered(
    db: Engine, mq: Queue, max_deliveries: int
) -> None:
    """prefetch 5, stop() while the first handler runs: that one commits and is acked, the four
    prefetched ones go back unhandled; the next consumer handles them (they never failed, so even
    with max_deliveries=1 none is dead-lettered without running)."""
    ids = [str(i) for i in range(6)]
    for message_id in ids:
        publish(mq, message_id)
    inside, release = threading.Event(), threading.Event()

    def slow(session: Session, message: Message) -> None:
        record(session, message)
        inside.set()
        release.wait(5)

    first = consumer(db, mq, slow, prefetch=5, max_deliveries=max_deliveries)
    thread = threading.Thread(target=first.run)
    thread.start()
    assert inside.wait(5)
    time.sleep(0.2)  # the other four are prefetched by now
    first.stop()
    release.set()
    thread.join(10)
    assert not thread.is_alive() and first.handled == 1
    second = consumer(db, mq, max_deliveries=max_deliveries)
    run_until(second, lambda: second.handled + second.dead_lettered >= 5)
    assert applied(db) == dict.fromkeys(ids, 1)
    assert second.dead_lettered == 0 and mq.count(mq.dead_queue) == 0


@pytest.mark.restart
def test_a_connection_cut_while_a_failed_message_is_requeued_leaves_its_effect_once(
    db: Engine, mq: Queue
) -> None:
    """The handler fails, the consumer publishes the counted copy and the connection is cut before the
    copy is confirmed and the original acknowledged: the original comes back (and the copy, when the
    broker took it whole before the cut); the effect is in once, any extra one is a repeat, nothing
    dead-lettered, nothing left in the queue."""
    publish(mq, "m1")
    calls: list[int] = []
    with FaultProxy("127.0.0.1", RABBITMQ_PORT) as proxy:

        def handler(session: Session, message: Message) -> None:
            calls.append(message.deliveries)
            if len(calls) == 1:
                # Cut the link as soon as the copy's publish reached the broker (before the ack).
                proxy.cut_after_next_request(b"x-stateguard-deliveries")
                raise RuntimeError("first try fails")
            record(session, message)

        c = consumer(db, mq, handler, url=via(RABBITMQ_URL, RABBITMQ_PORT, proxy.port))
        run_until(c, lambda: applied(db)["m1"] == 1 and mq.count() == 0, timeout=30)
        assert proxy.cuts + proxy.cuts_without_reply == 1
    # Whatever was still on its way (a copy the broker took) is handled by a consumer that runs on.
    run_for(consumer(db, mq, handler), 1.0)
    assert applied(db) == {"m1": 1}
    assert mq.count() == 0 and mq.count(mq.dead_queue) == 0


@pytest.mark.restart
def test_a_connection_cut_while_the_database_is_away_leaves_the_effect_once(db: Engine, mq: Queue) -> None:
    """The database is "down" (the handler raises OperationalError) and the broker connection is cut
    meanwhile: the consumer reconnects, the message comes back, and once the database is back its
    effect is in once, not dead-lettered (the outage was not counted)."""
    publish(mq, "m2")
    down = threading.Event()
    down.set()
    with FaultProxy("127.0.0.1", RABBITMQ_PORT) as proxy:
        tries: list[int] = []

        def handler(session: Session, message: Message) -> None:
            tries.append(message.deliveries)
            if down.is_set():
                if len(tries) == 2:
                    proxy.cut_all()
                if len(tries) == 4:
                    down.clear()
                raise sa_exc.OperationalError("SELECT 1", {}, ConnectionError("server closed the connection"))
            record(session, message)

        c = consumer(db, mq, handler, url=via(RABBITMQ_URL, RABBITMQ_PORT, proxy.port), max_deliveries=2)
        run_until(c, lambda: applied(db)["m2"] == 1 and mq.count() == 0, timeout=30)
    assert applied(db) == {"m2": 1}
    assert mq.count(mq.dead_queue) == 0 and c.dead_lettered == 0


@pytest.mark.hostile
@pytest.mark.parametrize("value", ["99", True, -5, Decimal("2.5"), None, b"\x01"])
def test_a_counting_header_that_is_not_a_count_does_not_change_the_outcome(
    db: Engine, mq: Queue, value: Any
) -> None:
    """A publisher's ``x-stateguard-deliveries`` that is not an int (a str, a bool, negative, a float,
    void, bytes): the message is handled once like any other, not dead-lettered and not a crash."""
    publish(mq, "h1", headers={"key": "k", "x-stateguard-deliveries": value})
    c = consumer(db, mq)
    run_until(c, lambda: c.handled == 1)
    assert applied(db) == {"h1": 1} and c.dead_lettered == 0


@pytest.mark.limits
def test_a_huge_poison_body_is_dead_lettered_whole(db: Engine, mq: Queue) -> None:
    """An 8 MiB body that is not JSON: its copies are requeued with their count, then it goes to the
    dead letters whole; the message after it is handled."""
    body = b"\xff" * (8 << 20)
    publish(mq, "big", body=body)
    publish(mq, "ok")
    c = consumer(db, mq, max_deliveries=2)
    run_until(c, lambda: c.dead_lettered == 1 and c.handled == 1, timeout=30)
    assert applied(db) == {"ok": 1}
    [dead] = mq.drain(mq.dead_queue)
    assert dead.properties.message_id == "big" and dead.body == body


@pytest.mark.failing_observer
def test_a_raising_listener_during_a_database_outage_changes_nothing(db: Engine, mq: Queue) -> None:
    """A raising outcome listener while the handler's database is away twice: the message is handled
    once when it is back, acked, nothing dead-lettered."""
    publish(mq, "o1")
    tries: list[int] = []

    def handler(session: Session, message: Message) -> None:
        tries.append(1)
        if len(tries) <= 2:
            raise sa_exc.OperationalError("SELECT 1", {}, ConnectionError("down"))
        record(session, message)

    def fail(event: Any) -> None:
        raise ObserverBug(f"listener: {event}")

    stop = on_event(fail)
    try:
        c = consumer(db, mq, handler, max_deliveries=1)
        run_until(c, lambda: c.handled == 1)
    finally:
        stop()
    assert applied(db) == {"o1": 1} and c.dead_lettered == 0 and mq.count() == 0
