"""Observers that raise never change what a consumer does: each message's effect is in once, it is
acknowledged (or dead-lettered) as without the observer, and the consumer does not crash.

The broken observers, one at a time: a stateguard outcome listener (it hears ``consume_once``), an
OpenTelemetry span processor raising in ``on_start`` or in ``on_end`` (a real SDK ``TracerProvider``
behind ``stateguard.otel.instrument``), a logging filter raising on stateguard's DEBUG event line, and
a logging filter raising on every line the consumers themselves log (a repeat, a failure, a dead
letter).  Each run on the real RabbitMQ and NATS consumers with one new message, its repeat, a message
whose handler fails once and one whose id cannot be recorded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from stateguard import GuardEvent, consume_once, on_event
from stateguard import observe as observe_module
from stateguard.consumers import Message, NATSConsumer, RabbitMQConsumer
from stateguard.otel import instrument

from .._support.brokers import NATS_URL, RABBITMQ_URL, Queue, Stream
from .._support.failing_observers import FailingProcessor, ObserverBug, QuietHandler
from ._drive import publish_amqp, publish_nats, run_until
from ._effects import applied, record

pytestmark = pytest.mark.failing_observer

OBSERVERS = ["listener", "span_start", "span_end", "event_log_filter", "consumer_log_filter"]


def fail_on_event(event: GuardEvent) -> None:
    raise ObserverBug(f"listener: {event}")


def raising_filter(logger: str, level: int) -> Callable[[logging.LogRecord], bool]:
    """A logging filter raising on the records of ``logger`` at ``level`` or above."""

    def check(record: logging.LogRecord) -> bool:
        if record.name == logger and record.levelno >= level:
            raise ObserverBug(f"logging filter: {record.getMessage()}")
        return True

    return check


@pytest.fixture(params=OBSERVERS)
def broken(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each broken observer in turn, removed afterwards."""
    kind: str = request.param
    stops: list[Callable[[], None]] = []
    if kind == "listener":
        stops.append(on_event(fail_on_event))
    elif kind.startswith("span_"):
        tracers = TracerProvider(shutdown_on_exit=False)
        tracers.add_span_processor(FailingProcessor(kind.removeprefix("span_")))
        stops.append(tracers.shutdown)
        stops.append(instrument(tracer_provider=tracers, metrics=False))
    else:
        logger = logging.getLogger("stateguard")
        handler = QuietHandler()
        if kind == "event_log_filter":
            handler.addFilter(raising_filter("stateguard.inserts", logging.DEBUG))
        else:
            handler.addFilter(raising_filter("stateguard.consumers", logging.DEBUG))
        level = logger.level
        logger.setLevel(logging.DEBUG)
        logger.addHandler(handler)

        def restore() -> None:
            logger.removeHandler(handler)
            logger.setLevel(level)

        stops.append(restore)
    yield kind
    for stop in reversed(stops):
        stop()
    assert observe_module.hooked is False


class Flaky:
    """The handler: ``record``, raising the first time it sees message "2"."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, session: Session, message: Message) -> None:
        self.calls.append(message.id)
        record(session, message)
        if message.id == "2" and self.calls.count("2") == 1:
            raise RuntimeError("the first try of message 2 fails")


def handled_before(db: Engine, message_id: str) -> None:
    """Record ``message_id`` as consumed, as a consumer that committed and died before its ack did."""
    with Session(db) as session, session.begin():
        assert consume_once(session, "billing", message_id).applied


def check(db: Engine, handler: Flaky, c: Any) -> None:
    """What every run must show, broken observer or not."""
    assert sorted(handler.calls) == ["1", "2", "2"]  # the repeat (3) did not run, 2 ran twice
    assert applied(db) == {"1": 1, "2": 1}
    assert (c.handled, c.dead_lettered) == (3, 1)


def test_a_broken_observer_does_not_change_the_rabbitmq_consumer(db: Engine, mq: Queue, broken: str) -> None:
    """New, failing once, a repeat, no id: effects once, three acks, one dead letter, no crash."""
    handled_before(db, "3")
    for message_id in ("1", "2", "3", ""):
        publish_amqp(mq, message_id)
    handler = Flaky()
    c = RabbitMQConsumer(db, handler, RABBITMQ_URL, queue=mq.queue, consumer="billing", poll=0.05)
    run_until(c, lambda: c.handled == 3 and c.dead_lettered == 1)
    check(db, handler, c)
    assert mq.count() == 0 and mq.count(mq.dead_queue) == 1


def test_a_broken_observer_does_not_change_the_nats_consumer(db: Engine, js: Stream, broken: str) -> None:
    """The same on JetStream (the handler runs in a worker thread there)."""
    handled_before(db, "3")
    for message_id in ("1", "2", "3", ""):
        publish_nats(js, message_id)
    handler = Flaky()
    c = NATSConsumer(
        db,
        handler,
        NATS_URL,
        stream=js.name,
        durable="billing",
        dead_letter_subject=js.dead_subject,
        poll=timedelta(milliseconds=100),
        retry_delay=timedelta(milliseconds=50),
    )
    run_until(c, lambda: c.handled == 3 and c.dead_lettered == 1, timeout=15)
    check(db, handler, c)
    assert len(js.messages(js.dead_name)) == 1
