"""The broker consumers on PostgreSQL and MariaDB, not only SQLite: effects once with duplicates and
two consumers racing on one queue, a failed handler's writes rolled back, and the consumer's COMMIT
whose reply is lost on the wire.

The lost COMMIT is real: tests/_support/faultproxy.py forwards the consumer's COMMIT to the server and
cuts the connection before the reply.  The commit's fate is then unknown to the consumer: it must not
acknowledge the message as done on a guess, and whatever it does next (try again where it is, or give
the message back when it is stopping), the message's effect is in the database exactly once and its
next handling is recognised as a repeat.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from stateguard import CallableSink, Relay
from stateguard.consumers import Message, NATSConsumer, RabbitMQConsumer
from stateguard.outbox.sinks import NATSSink, RabbitMQSink

from .._support.brokers import NATS_URL, RABBITMQ_URL, Queue, Stream
from .._support.faultproxy import FaultProxy, commit_of
from ..conftest import backends_with
from ._drive import publish_amqp, publish_nats, run_for, run_until
from ._effects import applied, committed_ids, emit_events, record

LEASE = timedelta(seconds=30)

pytestmark = pytest.mark.parametrize("backend", backends_with("tcp_server"), indirect=True)


def rabbit(engine: Engine, mq: Queue, handler: Any = record, **kw: Any) -> RabbitMQConsumer:
    kw.setdefault("poll", 0.05)
    return RabbitMQConsumer(engine, handler, RABBITMQ_URL, queue=mq.queue, consumer="billing", **kw)


def nats(engine: Engine, js: Stream, handler: Any = record, **kw: Any) -> NATSConsumer:
    kw.setdefault("poll", timedelta(milliseconds=100))
    kw.setdefault("retry_delay", timedelta(milliseconds=50))
    return NATSConsumer(
        engine,
        handler,
        NATS_URL,
        stream=js.name,
        durable="billing",
        dead_letter_subject=js.dead_subject,
        **kw,
    )


# -- the promise on a real server ------------------------------------------------------------------


def test_duplicates_raced_by_two_rabbitmq_consumers_apply_once(direct: Engine, mq: Queue) -> None:
    """Every batch published twice, two consumers on the queue: each event's effect is in once."""
    emit_events(direct, 20)
    with RabbitMQSink(RABBITMQ_URL, exchange=mq.exchange) as real:
        Relay(direct, CallableSink(lambda events: [real.publish(events), real.publish(events)])).run_once()
    first, second = rabbit(direct, mq, prefetch=5), rabbit(direct, mq, prefetch=5)
    other = threading.Thread(target=run_until, args=(second, lambda: first.handled + second.handled >= 40))
    other.start()
    run_until(first, lambda: first.handled + second.handled >= 40, timeout=30)
    other.join(30)
    assert first.handled + second.handled == 40
    assert applied(direct) == dict.fromkeys(committed_ids(direct), 1)
    assert mq.count() == 0 and mq.count(mq.dead_queue) == 0


def test_a_failed_handler_s_writes_roll_back_on_nats(direct: Engine, js: Stream) -> None:
    """A handler that wrote its effect and then raised: the write is rolled back, the redelivery applies
    it once."""
    publish_nats(js, "6")
    seen: list[int] = []

    def flaky(session: Session, message: Message) -> None:
        seen.append(message.deliveries)
        record(session, message)  # written, then rolled back twice
        if len(seen) < 3:
            raise RuntimeError("not yet")

    c = nats(direct, js, flaky)
    run_until(c, lambda: c.handled == 1, timeout=20)
    assert seen == [1, 2, 3] and applied(direct) == {"6": 1}
    assert js.messages(js.dead_name) == []


def test_relayed_events_apply_once_on_nats(direct: Engine, js: Stream) -> None:
    """Every event the NATS sink published is applied once on the server."""
    emit_events(direct, 10, topic=js.topic())
    with NATSSink(NATS_URL, stream=js.name, lease=LEASE) as sink:
        Relay(direct, sink, lease=LEASE).run_once()
    c = nats(direct, js)
    run_until(c, lambda: c.handled == 10, timeout=20)
    assert applied(direct) == dict.fromkeys(committed_ids(direct), 1)


# -- the consumer's COMMIT whose reply is lost -------------------------------------------------------


def cutting_handler(engine: Engine, proxy: FaultProxy, calls: list[str], *, cut: str) -> Any:
    """``record``; the first time it runs, the proxy is armed to lose the reply to its COMMIT
    (``cut="reply"``) or cuts the connection before the COMMIT is sent (``cut="before"``)."""

    def handler(session: Session, message: Message) -> None:
        calls.append(message.id)
        record(session, message)
        if len(calls) == 1:
            if cut == "reply":
                proxy.cut_after_next_request(commit_of(engine))
            else:
                session.flush()
                assert proxy.cut_all() >= 1

    return handler


@pytest.mark.lost_reply
def test_a_lost_commit_reply_is_settled_before_the_rabbitmq_ack(
    proxied: tuple[Engine, FaultProxy], direct: Engine, mq: Queue
) -> None:
    """The COMMIT ran, its reply was lost: the consumer asks again (consume_once is REPEATED), acks, and
    the handler's effect is in once; the handler does not run a second time."""
    engine, proxy = proxied
    publish_amqp(mq, "1")
    publish_amqp(mq, "2")
    calls: list[str] = []
    c = rabbit(engine, mq, cutting_handler(engine, proxy, calls, cut="reply"))
    run_until(c, lambda: c.handled == 2, timeout=30)
    assert proxy.cuts == 1
    assert calls == ["1", "2"]
    assert applied(direct) == {"1": 1, "2": 1}
    assert (c.handled, c.dead_lettered) == (2, 0)
    assert mq.count() == 0 and mq.count(mq.dead_queue) == 0


@pytest.mark.lost_reply
def test_a_lost_commit_reply_is_settled_before_the_nats_ack(
    proxied: tuple[Engine, FaultProxy], direct: Engine, js: Stream
) -> None:
    """The same on JetStream: the lost reply is settled by asking again, the message acked once, no
    redelivery, one effect."""
    engine, proxy = proxied
    publish_nats(js, "1")
    publish_nats(js, "2")
    calls: list[str] = []
    c = nats(engine, js, cutting_handler(engine, proxy, calls, cut="reply"))
    run_until(c, lambda: c.handled == 2, timeout=30)
    assert proxy.cuts == 1
    assert calls == ["1", "2"]
    assert applied(direct) == {"1": 1, "2": 1}
    again = nats(engine, js)
    run_for(again, 0.5)
    assert again.handled == 0  # acked: JetStream has nothing to deliver again


@pytest.mark.lost_reply
def test_a_connection_lost_before_the_commit_runs_the_handler_again(
    proxied: tuple[Engine, FaultProxy], direct: Engine, mq: Queue
) -> None:
    """The connection died before the COMMIT was sent (nothing committed): the consumer's next try is
    APPLIED, the handler runs again, and the effect is in once."""
    engine, proxy = proxied
    publish_amqp(mq, "1")
    calls: list[str] = []
    c = rabbit(engine, mq, cutting_handler(engine, proxy, calls, cut="before"))
    run_until(c, lambda: c.handled == 1, timeout=30)
    assert calls == ["1", "1"]
    assert applied(direct) == {"1": 1}
    assert mq.count() == 0


@pytest.mark.lost_reply
def test_stopped_with_the_commit_s_fate_unknown_the_message_goes_back_not_acked(
    proxied: tuple[Engine, FaultProxy], direct: Engine, mq: Queue
) -> None:
    """Stop asked while the COMMIT's reply is lost: the message is not acked as done but returned to the
    queue; the next consumer recognises it as a repeat (the handler does not run) and acks it."""
    engine, proxy = proxied
    publish_amqp(mq, "7")
    calls: list[str] = []
    holder: list[RabbitMQConsumer] = []
    cut = cutting_handler(engine, proxy, calls, cut="reply")

    def stopping(session: Session, message: Message) -> None:
        cut(session, message)
        holder[0].stop()  # SIGTERM arrives while the commit is on the wire

    first = rabbit(engine, mq, stopping)
    holder.append(first)
    first.run()  # returns: stopped
    assert proxy.cuts == 1
    assert first.handled == 0  # not acknowledged as done: its commit's fate was unknown
    assert applied(direct) == {"7": 1}  # the commit did run on the server
    assert mq.count() == 1  # given back
    repeats: list[Message] = []
    second = rabbit(direct, mq, lambda s, m: repeats.append(m))
    run_until(second, lambda: second.handled == 1)
    assert repeats == []  # REPEATED: acknowledged without running the handler
    assert applied(direct) == {"7": 1}
    assert mq.count() == 0 and mq.count(mq.dead_queue) == 0
