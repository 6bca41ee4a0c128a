"""RabbitMQSink and AsyncRabbitMQSink on a real RabbitMQ: persistent, confirmed, mandatory messages that
carry their event, and a batch that comes again whole when the broker did not confirm all of it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import threading
import time
import warnings
from collections import defaultdict
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

from stateguard import ConfigurationError, InvalidArgument, OutboxEvent, PublishFailed, Relay, emit
from stateguard.outbox import AsyncRelay
from stateguard.outbox.sinks import AsyncRabbitMQSink, RabbitMQSink

from ..._support.brokers import RABBITMQ_PORT, RABBITMQ_URL, Delivered, Queue, via
from ..._support.faultproxy import FaultProxy
from ...conftest import Backend
from ._relay import drain_relay, outbox_rows, publish_all

#: Payloads that are not plain ASCII text: the body is the stored JSON in UTF-8.
PAYLOADS: list[Any] = [{"n": 0, "name": "Zoë ✓"}, [1, 2.5, None, True], "text", 7, {"nested": {"a": [{}]}}]


def emit_events(engine: Engine, n: int, *, topic: str = "order.paid", start: int = 0) -> list[int]:
    """``n`` committed events over the keys k0..k2 and no key (every fourth); their ids."""
    with Session(engine) as session, session.begin():
        return [
            emit(
                session,
                topic,
                {"i": i, "p": PAYLOADS[i % len(PAYLOADS)]},
                key=None if i % 4 == 3 else f"k{i % 3}",
            )
            for i in range(start, start + n)
        ]


def assert_is_event(message: Delivered, row: Any) -> None:
    """The message carries the outbox row: id, topic, key, payload, created_ms; persistent JSON."""
    p = message.properties
    assert p.message_id == str(row.id)
    assert p.type == row.topic
    assert p.content_type == "application/json"
    assert p.delivery_mode == 2
    assert p.timestamp == row.created_ms // 1000
    assert p.headers["created_ms"] == row.created_ms
    if row.key is None:
        assert "key" not in p.headers
    else:
        key = p.headers["key"]
        assert (key.decode() if isinstance(key, bytes) else key) == row.key
    assert message.body == row.payload.encode("utf-8")
    assert json.loads(message.body) == json.loads(row.payload)


def assert_in_key_order(got: list[Delivered], rows: dict[int, Any]) -> None:
    """The messages of each key arrived in id order (the relay's promise; none across keys)."""
    by_key: dict[Any, list[int]] = defaultdict(list)
    for message in got:
        by_key[rows[int(message.properties.message_id)].key].append(int(message.properties.message_id))
    assert all(seen == sorted(seen) for key, seen in by_key.items() if key is not None)


def test_every_event_arrives_persistent_with_its_properties(
    backend: Backend, engine: Engine, mq: Queue
) -> None:
    """Relay + RabbitMQSink: each event is one persistent message carrying it, in id order per key."""
    ids = emit_events(engine, 23)
    with RabbitMQSink(RABBITMQ_URL, exchange=mq.exchange) as sink:
        assert drain_relay(Relay(engine, sink, batch=5)) == 23
    got = mq.drain()
    rows = outbox_rows(engine)
    assert sorted(int(m.properties.message_id) for m in got) == ids  # each once
    for message in got:
        assert_is_event(message, rows[int(message.properties.message_id)])
        assert message.routing_key == "order.paid"
    assert_in_key_order(got, rows)
    assert all(row.published_ms is not None for row in rows.values())


def test_routing_key_is_the_topic_the_key_or_a_fixed_one(outbox_db: Engine, mq: Queue) -> None:
    """The routing key is the topic by default, the event's key with key_as_routing_key (topic when keyless),
    or one fixed routing_key."""
    emit_events(outbox_db, 4)
    rows = outbox_rows(outbox_db)
    events = [OutboxEvent(r.id, r.topic, r.key, json.loads(r.payload), r.created_ms) for r in rows.values()]
    for options, expected in [
        ({}, ["order.paid"] * 4),
        ({"key_as_routing_key": True}, ["k0", "k1", "k2", "order.paid"]),
        ({"routing_key": "all.orders"}, ["all.orders"] * 4),
    ]:
        with RabbitMQSink(RABBITMQ_URL, exchange=mq.exchange, **options) as sink:
            sink.publish(events)
        assert [m.routing_key for m in mq.drain()] == expected, options


def test_default_exchange_routes_to_the_queue_named_by_the_routing_key(outbox_db: Engine, mq: Queue) -> None:
    """exchange="" (the default exchange) with routing_key=<queue> puts every event in that queue."""
    ids = emit_events(outbox_db, 3)
    with RabbitMQSink(RABBITMQ_URL, routing_key=mq.queue) as sink:
        assert drain_relay(Relay(outbox_db, sink)) == 3
    assert [int(m.properties.message_id) for m in mq.drain()] == ids


def test_unroutable_message_raises_and_the_batch_stays_unpublished(outbox_db: Engine, mq: Queue) -> None:
    """mandatory=True: with no queue bound the broker returns the message and publish raises PublishFailed
    naming it and the unsent rest; a relay marks none published; once a queue is bound all are published."""
    ids = emit_events(outbox_db, 4)
    rows = outbox_rows(outbox_db)
    events = [OutboxEvent(r.id, r.topic, r.key, json.loads(r.payload), r.created_ms) for r in rows.values()]
    with RabbitMQSink(RABBITMQ_URL, exchange=mq.unbound_exchange) as sink:
        with pytest.raises(PublishFailed, match="unroutable: no queue is bound") as caught:
            sink.publish(events)
        assert caught.value.retryable and caught.value.event_ids == tuple(ids)  # the first and the unsent
        assert caught.value.refused_ids == (ids[0],)  # the broker's verdict is on the first alone
        relay = Relay(outbox_db, sink)
        with contextlib.suppress(PublishFailed):
            relay.run_once()
        assert all(r.published_ms is None for r in outbox_rows(outbox_db).values())
        mq.channel.queue_bind(mq.queue, mq.unbound_exchange, "#")
        publish_all(relay, outbox_db)
    got = [int(m.properties.message_id) for m in mq.drain()]
    assert sorted(set(got)) == ids


def test_missing_exchange_is_a_configuration_error(outbox_db: Engine) -> None:
    """An exchange the broker does not have: ConfigurationError at connect() and at publish, naming it."""
    sink = RabbitMQSink(RABBITMQ_URL, exchange="sgtest-no-such-exchange")
    with pytest.raises(ConfigurationError, match="no exchange 'sgtest-no-such-exchange'"):
        sink.connect()
    event = OutboxEvent(1, "t", None, {}, 0)
    with pytest.raises(ConfigurationError, match="declare it"):
        sink.publish([event])
    sink.close()


def test_unreachable_broker_raises_publish_failed(outbox_db: Engine) -> None:
    """A broker nobody listens for: PublishFailed naming the URL without its password; nothing marked."""
    emit_events(outbox_db, 2)
    sink = RabbitMQSink("amqp://guest:s3cret@127.0.0.1:1/%2F", timeout=2)
    with pytest.raises(PublishFailed, match=r"cannot connect to RabbitMQ at amqp://guest:\*\*\*@") as caught:
        sink.connect()
    assert "s3cret" not in str(caught.value) and caught.value.event_ids == ()
    with contextlib.suppress(PublishFailed):
        Relay(outbox_db, sink).run_once()
    assert all(r.published_ms is None for r in outbox_rows(outbox_db).values())


@pytest.mark.lost_reply
def test_lost_confirmation_publishes_the_batch_again_with_the_same_message_ids(
    outbox_db: Engine, mq: Queue
) -> None:
    """The connection is cut after event 3 reached the broker, before its confirmation: publish raises
    PublishFailed naming 3-5, event 3 is not marked, it comes again on a new connection, and the queue
    holds it twice with the same message_id; deduplicating by message_id leaves every event once."""
    ids = emit_events(outbox_db, 5)
    rows = outbox_rows(outbox_db)
    events = [OutboxEvent(r.id, r.topic, r.key, json.loads(r.payload), r.created_ms) for r in rows.values()]
    with FaultProxy("127.0.0.1", RABBITMQ_PORT) as proxy:
        with RabbitMQSink(via(RABBITMQ_URL, RABBITMQ_PORT, proxy.port), exchange=mq.exchange) as sink:
            sink.connect()
            proxy.cut_after_next_request(b'{"i":2,')  # the third event's body
            with pytest.raises(PublishFailed, match="did not confirm outbox event 3") as caught:
                sink.publish(events)
            assert proxy.cuts == 1 and caught.value.event_ids == tuple(ids[2:])
            assert [int(m.properties.message_id) for m in mq.drain()] == ids[:3]  # 3 got there

            relay = Relay(outbox_db, sink)
            proxy.cut_after_next_request(b'{"i":2,')
            with contextlib.suppress(PublishFailed):
                relay.run_once()
            assert proxy.cuts == 2
            assert outbox_rows(outbox_db)[ids[2]].published_ms is None
            publish_all(relay, outbox_db)
    got = [int(m.properties.message_id) for m in mq.drain()]
    assert got.count(ids[2]) >= 2  # the copy whose confirmation was lost, and the one published again
    assert list(dict.fromkeys(got)) == ids  # what a consumer deduplicating on message_id applies
    assert all(r.published_ms is not None for r in outbox_rows(outbox_db).values())


@pytest.mark.restart
def test_connection_cut_between_batches_is_opened_again_without_a_failed_batch(
    outbox_db: Engine, mq: Queue
) -> None:
    """The connection dies while the relay is idle: the next publish notices, reconnects and publishes."""
    ids = emit_events(outbox_db, 2)
    with FaultProxy("127.0.0.1", RABBITMQ_PORT) as proxy:
        with RabbitMQSink(via(RABBITMQ_URL, RABBITMQ_PORT, proxy.port), exchange=mq.exchange) as sink:
            relay = Relay(outbox_db, sink, batch=1)
            assert relay.run_once() == 1
            assert proxy.cut_all() == 1
            assert relay.run_once() == 1
            assert proxy.connections == 2
    assert [int(m.properties.message_id) for m in mq.drain()] == ids


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"url": "redis://127.0.0.1:6379/0"}, "needs an AMQP URL"),
        ({"url": None}, "needs an AMQP URL"),
        ({"exchange": "x" * 256}, "longer than 255 UTF-8 bytes"),
        ({"exchange": 7}, "exchange must be a str"),
        ({"routing_key": "é" * 128}, "longer than 255 UTF-8 bytes"),
        ({"routing_key": "a", "key_as_routing_key": True}, "not both"),
        ({"timeout": 0}, "timeout must be a positive number"),
        ({"timeout": float("nan")}, "timeout must be a positive number"),
        ({"timeout": True}, "timeout must be a positive number"),
    ],
)
@pytest.mark.hostile
def test_bad_arguments_are_invalid_argument(kwargs: dict[str, Any], message: str) -> None:
    """Each bad argument of either sink is InvalidArgument saying what was wrong; nothing is connected."""
    arguments: dict[str, Any] = {"url": RABBITMQ_URL, **kwargs}
    url = arguments.pop("url")
    for cls in (RabbitMQSink, AsyncRabbitMQSink):
        with pytest.raises(InvalidArgument, match=message):
            cls(url, **arguments)


@pytest.mark.limits
def test_topic_longer_than_amqp_type_raises_publish_failed(mq: Queue) -> None:
    """A topic over 255 UTF-8 bytes does not fit AMQP's type property: PublishFailed refusing that event,
    naming it and the unsent rest as unpublished (the event before it was confirmed)."""
    events = [
        OutboxEvent(8, "t", None, {}, 0),
        OutboxEvent(9, "é" * 200, None, {}, 0),
        OutboxEvent(10, "t", None, {}, 0),
    ]
    with (
        RabbitMQSink(RABBITMQ_URL, exchange=mq.exchange) as sink,
        pytest.raises(PublishFailed, match="event 9") as caught,
    ):
        sink.publish(events)
    assert caught.value.event_ids == (9, 10) and caught.value.refused_ids == (9,)
    assert [int(m.properties.message_id) for m in mq.drain()] == [8]


@pytest.mark.limits
def test_relay_publishes_around_an_event_amqp_cannot_carry(outbox_db: Engine, mq: Queue) -> None:
    """A relay's batch with a too-long topic in the middle: the events after it are sent in the same round
    (not counted published unsent), the refused one is counted and stays unpublished."""
    ids = emit_events(outbox_db, 2)
    with Session(outbox_db) as session, session.begin():
        too_long = emit(session, "é" * 150, {}, key="long")
    ids += emit_events(outbox_db, 2, start=2)
    with RabbitMQSink(RABBITMQ_URL, exchange=mq.exchange) as sink:
        assert Relay(outbox_db, sink).run_once() == 4
    rows = outbox_rows(outbox_db)
    assert rows[too_long].published_ms is None and rows[too_long].refusals == 1
    assert sorted(int(m.properties.message_id) for m in mq.drain()) == ids


@pytest.mark.restart
# pika leaves the socket of a handshake the proxy cuts unclosed (its connection workflow drops
# the half-open connection without closing it): a ResourceWarning from pika's own objects,
# raised whenever the garbage collector meets them, not a stateguard leak.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_a_broker_cut_off_for_many_rounds_parks_no_event(
    outbox_db: Engine, mq: Queue, caplog: pytest.LogCaptureFixture
) -> None:
    """Every connection to RabbitMQ is cut as soon as it opens (the fault proxy) for 25 relay rounds with
    max_attempts=3: no refusal is counted, nothing is parked; once the cuts stop every event arrives, each
    key's first copies in id order."""
    # pika logs each cut handshake with its error, whose traceback holds the attempt's sockets: kept by
    # the log capture they would be closed by the collector in a later test.
    caplog.set_level(logging.CRITICAL, logger="pika")
    ids = emit_events(outbox_db, 20)
    with FaultProxy("127.0.0.1", RABBITMQ_PORT) as proxy:
        url = via(RABBITMQ_URL, RABBITMQ_PORT, proxy.port)
        with RabbitMQSink(url, exchange=mq.exchange, timeout=2) as sink:
            relay = Relay(outbox_db, sink, batch=6, max_attempts=3, retry_delay=timedelta(milliseconds=1))
            assert relay.run_once() == 6
            outage = threading.Event()

            def cut() -> None:
                while not outage.wait(0.002):
                    proxy.cut_all()

            cutter = threading.Thread(target=cut, daemon=True)
            cutter.start()
            try:
                for _ in range(25):
                    with contextlib.suppress(PublishFailed):
                        relay.run_once()
            finally:
                outage.set()
                cutter.join(10)
            rows = outbox_rows(outbox_db)
            assert proxy.cut_all_count > 0
            assert [(i, r.refusals, r.dead_ms) for i, r in rows.items() if r.refusals or r.dead_ms] == []
            publish_all(relay, outbox_db)
    # pika leaves the sockets of a connection attempt cut midway (its ioloop's wake-up pair among them)
    # to the garbage collector: collect them here, where their ResourceWarning is expected.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        for _ in range(3):
            gc.collect()
    got = mq.drain()
    first = list(dict.fromkeys(int(m.properties.message_id) for m in got))
    assert sorted(first) == ids
    assert_in_key_order([m for m in got if int(m.properties.message_id) in first], outbox_rows(outbox_db))


# -- AsyncRabbitMQSink ------------------------------------------------------


def test_async_sink_publishes_every_event_with_async_relay(
    sqlite: Backend, outbox_db: Engine, mq: Queue
) -> None:
    """AsyncRelay + AsyncRabbitMQSink: the batch's messages, pipelined, arrive in id order with the same
    properties as the sync sink's; an unroutable one raises PublishFailed and leaves its batch unpublished."""
    ids = emit_events(outbox_db, 40)

    async def main() -> None:
        engine = create_async_engine(sqlite.url.replace("sqlite://", "sqlite+aiosqlite://", 1))
        try:
            two = [OutboxEvent(i, "order.paid", None, {}, 0) for i in ids[:2]]
            async with AsyncRabbitMQSink(RABBITMQ_URL, exchange=mq.unbound_exchange) as unbound:
                with pytest.raises(PublishFailed, match="unroutable") as caught:
                    await unbound.publish(two)
                assert caught.value.event_ids == tuple(ids[:2])
            async with AsyncRabbitMQSink(RABBITMQ_URL, exchange=mq.exchange) as sink:
                relay = AsyncRelay(engine, sink, batch=15)
                assert [await relay.run_once() for _ in range(4)] == [15, 15, 10, 0]
        finally:
            await engine.dispose()

    asyncio.run(main())
    rows = outbox_rows(outbox_db)
    got = mq.drain()
    assert sorted(int(m.properties.message_id) for m in got) == ids  # one per event
    for message in got:
        assert_is_event(message, rows[int(message.properties.message_id)])
    assert_in_key_order(got, rows)


@pytest.mark.lost_reply
def test_async_lost_confirmation_publishes_the_batch_again(
    sqlite: Backend, outbox_db: Engine, mq: Queue
) -> None:
    """AsyncRabbitMQSink: a connection cut before the confirmations came raises PublishFailed naming the
    unconfirmed events; the sink reconnects and every event is published, duplicates sharing a message_id."""
    ids = emit_events(outbox_db, 5)

    async def main(proxy: FaultProxy) -> None:
        engine = create_async_engine(sqlite.url.replace("sqlite://", "sqlite+aiosqlite://", 1))
        try:
            url = via(RABBITMQ_URL, RABBITMQ_PORT, proxy.port)
            async with AsyncRabbitMQSink(url, exchange=mq.exchange, timeout=5) as sink:
                await sink.connect()
                relay = AsyncRelay(engine, sink)
                proxy.cut_after_next_request(b'{"i":0,')
                with contextlib.suppress(PublishFailed):
                    await relay.run_once()
                assert outbox_rows(outbox_db)[ids[0]].published_ms is None
                deadline = time.monotonic() + 60
                while any(r.published_ms is None for r in outbox_rows(outbox_db).values()):
                    assert time.monotonic() < deadline
                    with contextlib.suppress(PublishFailed):
                        if await relay.run_once() == 0:
                            await asyncio.sleep(0.1)
        finally:
            await engine.dispose()

    with FaultProxy("127.0.0.1", RABBITMQ_PORT) as proxy:
        asyncio.run(main(proxy))
        assert proxy.cuts == 1
    got = [int(m.properties.message_id) for m in mq.drain()]
    assert sorted(set(got)) == ids and len(got) > len(ids)  # copies that got there unconfirmed came again
