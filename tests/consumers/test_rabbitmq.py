"""RabbitMQConsumer on a real RabbitMQ: ack after commit, repeats skipped, failures counted and
requeued, poison messages to the queue's dead-letter exchange, graceful stop."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from stateguard import CallableSink, InvalidArgument, Relay
from stateguard.consumers import Message, RabbitMQConsumer
from stateguard.outbox.sinks import RabbitMQSink

from .._support.brokers import RABBITMQ_PORT, RABBITMQ_URL, Queue, via
from .._support.faultproxy import FaultProxy
from . import _behaviours
from ._drive import publish_amqp as publish
from ._drive import run_until
from ._effects import applied, committed_ids, emit_events, record


def consumer(db: Engine, mq: Queue, handler: Any = record, **kw: Any) -> RabbitMQConsumer:
    kw.setdefault("poll", 0.05)
    return RabbitMQConsumer(db, handler, RABBITMQ_URL, queue=mq.queue, consumer="billing", **kw)


def broker(db: Engine, mq: Queue) -> _behaviours.Broker:
    """The database and the test's queue, for the behaviours every consumer shares."""
    return _behaviours.Broker(
        db, lambda message_id: publish(mq, message_id), lambda handler: consumer(db, mq, handler)
    )


def test_relayed_events_are_applied_once_and_acknowledged(db: Engine, mq: Queue) -> None:
    """Every event a relay published (each batch twice) is applied once; the queue is empty."""
    emit_events(db, 10)
    with RabbitMQSink(RABBITMQ_URL, exchange=mq.exchange) as real:
        Relay(db, CallableSink(lambda events: [real.publish(events), real.publish(events)])).run_once()
    c = consumer(db, mq)
    run_until(c, lambda: c.handled == 20)
    assert applied(db) == dict.fromkeys(committed_ids(db), 1)
    assert mq.count() == 0 and mq.count(mq.dead_queue) == 0


def test_the_message_carries_the_event(db: Engine, mq: Queue) -> None:
    """The handler gets id = message_id, topic = type, key = the key header, payload = the body's JSON."""
    [event_id] = emit_events(db, 1, topic="order.paid")
    with RabbitMQSink(RABBITMQ_URL, exchange=mq.exchange) as sink:
        Relay(db, sink).run_once()
    got: list[Message] = []
    c = consumer(db, mq, lambda s, m: got.append(m))
    run_until(c, lambda: bool(got))
    [m] = got
    assert (m.id, m.topic, m.key, m.payload, m.deliveries) == (
        str(event_id),
        "order.paid",
        "k0",
        {"seq": 0},
        1,
    )


def test_a_message_committed_before_a_crash_is_acked_without_the_handler(db: Engine, mq: Queue) -> None:
    """A consumer that committed and died before basic.ack: the redelivery is REPEATED, acked, handler not
    run."""
    _behaviours.repeat_is_acked_without_the_handler(broker(db, mq))
    assert mq.count() == 0


def test_a_consumer_gone_before_its_ack_has_the_message_redelivered(db: Engine, mq: Queue) -> None:
    """A message taken and never acked (its connection closed) comes back and is applied once."""
    import pika

    publish(mq, "8")
    other = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))
    method, _, _ = other.channel().basic_get(mq.queue, auto_ack=False)
    assert method is not None
    other.close()  # died before the ack: RabbitMQ requeues the message
    seen: list[int] = []

    def handler(session: Session, message: Message) -> None:
        seen.append(message.deliveries)
        record(session, message)

    c = consumer(db, mq, handler)
    run_until(c, lambda: c.handled == 1)
    assert applied(db) == {"8": 1} and seen == [2]


def test_a_failing_message_is_requeued_with_its_count_then_applied(db: Engine, mq: Queue) -> None:
    """Two failures then a success: the deliveries seen are 1, 2, 3, one effect, nothing dead-lettered."""
    publish(mq, "6")
    seen: list[int] = []

    def flaky(session: Session, message: Message) -> None:
        seen.append(message.deliveries)
        if len(seen) < 3:
            raise RuntimeError("not yet")
        record(session, message)

    c = consumer(db, mq, flaky, max_deliveries=5)
    run_until(c, lambda: c.handled == 1)
    assert seen == [1, 2, 3]
    assert applied(db) == {"6": 1}
    assert mq.count() == 0 and mq.count(mq.dead_queue) == 0


def test_a_poison_message_goes_to_the_dead_letter_exchange(db: Engine, mq: Queue) -> None:
    """A message that always fails is tried max_deliveries times, then rejected to the DLX's queue."""
    publish(mq, "13", b"not json")
    publish(mq, "14", b'{"seq": 1}')
    c = consumer(db, mq, max_deliveries=3)
    run_until(c, lambda: c.dead_lettered == 1 and c.handled == 1)
    assert applied(db) == {"14": 1}
    [dead] = mq.drain(mq.dead_queue)
    properties = dead.properties
    assert (properties.message_id, dead.body) == ("13", b"not json")
    assert properties.headers["x-stateguard-deliveries"] == 2  # the failures before the last delivery
    assert properties.headers["x-death"][0]["reason"] == "rejected"
    assert mq.count() == 0


def test_a_message_delivered_too_often_is_dead_lettered_without_running(db: Engine, mq: Queue) -> None:
    """A message whose count is already past max_deliveries (it crashed consumers) is rejected unrun."""
    publish(mq, "15", headers={"x-stateguard-deliveries": 3})
    calls: list[Message] = []
    c = consumer(db, mq, lambda s, m: calls.append(m), max_deliveries=3)
    run_until(c, lambda: c.dead_lettered == 1)
    assert calls == [] and len(mq.drain(mq.dead_queue)) == 1


def test_a_message_without_message_id_is_dead_lettered(db: Engine, mq: Queue) -> None:
    """A message with no message_id cannot be deduplicated: rejected to the dead letters at once."""
    _behaviours.message_without_an_id_is_dead_lettered(broker(db, mq))
    assert len(mq.drain(mq.dead_queue)) == 1


def test_stop_finishes_the_message_in_hand(db: Engine, mq: Queue) -> None:
    """stop() during a handler: it commits and is acked, run() returns, the others stay in the queue."""
    _behaviours.stop_finishes_the_message_in_hand(broker(db, mq), 4)
    assert mq.count() == 3


def test_bad_arguments_are_refused(db: Engine) -> None:
    """A URL that is not AMQP, a zero prefetch or max_deliveries is InvalidArgument."""
    with pytest.raises(InvalidArgument, match="AMQP URL"):
        RabbitMQConsumer(db, record, "http://x", queue="q")
    with pytest.raises(InvalidArgument, match="prefetch"):
        RabbitMQConsumer(db, record, RABBITMQ_URL, queue="q", prefetch=0)
    with pytest.raises(InvalidArgument, match="max_deliveries"):
        RabbitMQConsumer(db, record, RABBITMQ_URL, queue="q", max_deliveries=0)


#: message_id values consume_once cannot record, as they go on the wire (an AMQP short string holds at
#: most 255 octets, so an over-long id cannot be sent): NUL, a lone surrogate (its CESU-8 octets),
#: bytes that are not UTF-8, blank, empty.
HOSTILE_IDS: list[Any] = [b"a\x00b", b"\xed\xa0\x80", b"\xff", b"\xfe", b"   ", b""]


@pytest.mark.hostile
def test_messages_whose_ids_cannot_be_recorded_are_dead_lettered_at_once(
    db: Engine, mq: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    """Each hostile message_id: rejected to the dead letters on its first delivery with the reason
    logged, the handler never run, never requeued; the consumer goes on with the good message after."""
    for bad in HOSTILE_IDS:
        publish(mq, bad)
    _behaviours.hostile_ids_are_dead_lettered_at_once(
        broker(db, mq), caplog, hostile=len(HOSTILE_IDS), logged="dead-letter exchange"
    )
    dead = mq.drain(mq.dead_queue)
    assert len(dead) == len(HOSTILE_IDS) and mq.count() == 0
    for letter in dead:
        assert "x-stateguard-deliveries" not in (letter.properties.headers or {})  # never retried
        assert letter.properties.headers["x-death"][0]["count"] == 1


# -- the consumer's connection lost mid-consume ------------------------------------------------------


def closing_connection_of(queue: str) -> Callable[[], None]:
    """A function closing, from the server side (``rabbitmqctl close_connection``), the connection of
    the consumer on ``queue`` (the server keeps running)."""

    def ctl(*args: str) -> list[list[str]]:
        done = subprocess.run(
            ["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=60, check=True
        )
        return [line.split("\t") for line in done.stdout.splitlines() if line.strip()]

    def close() -> None:
        channels = {row[1] for row in ctl("list_consumers", "queue_name", "channel_pid") if row[0] == queue}
        connections = [row[1] for row in ctl("list_channels", "pid", "connection") if row[0] in channels]
        assert len(connections) == 1, (channels, connections)
        # RabbitMQ 3.10 takes the connection's pid (later versions also its name).
        ctl("close_connection", connections[0], "stateguard test: the consumer's connection is closed")

    return close


@pytest.mark.restart
@pytest.mark.parametrize("how", ["cut on the wire", "closed by the broker"])
def test_a_connection_lost_mid_message_is_reconnected_and_every_effect_is_in_once(
    db: Engine, mq: Queue, how: str
) -> None:
    """The consumer's connection dies while a handler runs (its ack cannot be sent): the consumer
    connects again by itself, the message comes back and is a repeat (its handler ran once), and every
    message's effect is in once."""
    ids = [str(i) for i in range(1, 7)]
    for message_id in ids:
        publish(mq, message_id)
    calls: list[str] = []
    with FaultProxy("127.0.0.1", RABBITMQ_PORT) as proxy:
        close_by_broker = closing_connection_of(mq.queue)

        def handler(session: Session, message: Message) -> None:
            calls.append(message.id)
            record(session, message)
            if message.id == "3" and calls.count("3") == 1:
                if how == "cut on the wire":
                    assert proxy.cut_all() == 1
                else:
                    close_by_broker()

        url = via(RABBITMQ_URL, RABBITMQ_PORT, proxy.port) if how == "cut on the wire" else RABBITMQ_URL
        c = RabbitMQConsumer(db, handler, url, queue=mq.queue, consumer="billing", poll=0.05)
        run_until(c, lambda: len(applied(db)) == len(ids) and c.handled >= len(ids), timeout=60)
    assert applied(db) == dict.fromkeys(ids, 1)
    assert sorted(calls) == ids  # the redelivered message was a repeat: its handler did not run again
    assert mq.count() == 0 and mq.count(mq.dead_queue) == 0


@pytest.mark.restart
def test_after_a_connection_that_worked_the_reconnect_is_prompt(db: Engine, mq: Queue) -> None:
    """Nine connections lost in a row, each after it worked: each reconnection starts the backoff
    afresh (50 ms), so the ninth is not delayed by the eight before it (that would be 6.4 s to 12.8 s;
    the bound leaves room for a loaded machine)."""
    with FaultProxy("127.0.0.1", RABBITMQ_PORT) as proxy:
        c = RabbitMQConsumer(
            db, record, via(RABBITMQ_URL, RABBITMQ_PORT, proxy.port), queue=mq.queue, poll=0.05
        )
        stop = threading.Event()
        thread = threading.Thread(target=c.run, args=(stop,))
        thread.start()
        took: list[float] = []
        try:
            for i in range(10):
                started = time.monotonic()
                publish(mq, f"m{i}")
                deadline = started + 20
                # The effects count, not c.handled: a cut that lands after the commit but before the
                # broker took the ack redelivers the message, which is then acknowledged again as a
                # repeat (handled counts it twice, its effect is there once).
                while applied(db)[f"m{i}"] < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert applied(db)[f"m{i}"] == 1
                took.append(time.monotonic() - started)
                if i < 9:
                    assert proxy.cut_all() == 1
        finally:
            stop.set()
            thread.join(15)
    assert not thread.is_alive()
    assert applied(db) == {f"m{i}": 1 for i in range(10)}
    assert max(took) < 4, [f"{t:.2f}" for t in took]
