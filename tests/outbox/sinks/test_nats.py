"""NATSSink and AsyncNATSSink on a real NATS JetStream: each event one message with Nats-Msg-Id = its id,
every PubAck awaited, a batch published again stored once inside the duplicate window, and a relay lease
longer than that window refused."""

from __future__ import annotations

import asyncio
import contextlib
import json
from datetime import timedelta
from typing import Any
from urllib.parse import unquote

import pytest
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

from stateguard import ConfigurationError, InvalidArgument, OutboxEvent, PublishFailed, Relay, emit
from stateguard.outbox import AsyncRelay
from stateguard.outbox.sinks import AsyncNATSSink, NATSSink

from ..._support import brokers as _brokers
from ..._support.brokers import NATS_PORT, NATS_URL, Stream, via
from ..._support.faultproxy import FaultProxy
from ...conftest import Backend
from ._relay import drain_relay, outbox_rows, publish_all

LEASE = timedelta(seconds=30)


def emit_events(engine: Engine, topic: str, n: int) -> list[int]:
    """``n`` committed events of ``topic`` over the keys k0, k1 and no key (every third); their ids."""
    with Session(engine) as session, session.begin():
        return [
            emit(session, topic, {"i": i, "name": "Zoë ✓"}, key=None if i % 3 == 2 else f"k{i % 3}")
            for i in range(n)
        ]


def msg_ids(js: Stream) -> list[int]:
    return [int(m.headers["Nats-Msg-Id"]) for m in js.messages()]


def test_every_event_arrives_with_its_headers(backend: Backend, engine: Engine, js: Stream) -> None:
    """Relay + NATSSink: each event is one message on its topic, Nats-Msg-Id = the id, in id order per key."""
    ids = emit_events(engine, js.topic(), 17)
    with NATSSink(NATS_URL, stream=js.name, lease=LEASE) as sink:
        assert drain_relay(Relay(engine, sink, batch=4, lease=LEASE)) == 17
        assert sink.duplicate_window == js.duplicate_window
    rows = outbox_rows(engine)
    messages = js.messages()
    assert sorted(int(m.headers["Nats-Msg-Id"]) for m in messages) == ids
    for m in messages:
        row = rows[int(m.headers["Nats-Msg-Id"])]
        assert m.subject == row.topic
        assert m.data == row.payload.encode("utf-8")
        assert unquote(m.headers["Outbox-Topic"]) == row.topic
        assert m.headers["Outbox-Created-Ms"] == str(row.created_ms)
        assert m.headers["Content-Type"] == "application/json"
        if row.key is None:
            assert "Outbox-Key" not in m.headers
        else:
            assert unquote(m.headers["Outbox-Key"]) == row.key
    for key in ("k0", "k1"):
        of_key = [int(m.headers["Nats-Msg-Id"]) for m in messages if m.headers.get("Outbox-Key") == key]
        assert of_key == sorted(of_key)
    assert all(r.published_ms is not None for r in rows.values())


def test_batch_published_again_is_stored_once(outbox_db: Engine, js: Stream) -> None:
    """The same batch published twice inside the duplicate window: JetStream keeps one copy of each."""
    emit_events(outbox_db, js.topic(), 6)
    events = [
        OutboxEvent(r.id, r.topic, r.key, json.loads(r.payload), r.created_ms)
        for r in outbox_rows(outbox_db).values()
    ]
    with NATSSink(NATS_URL, stream=js.name, lease=LEASE, subject=js.subject) as sink:
        sink.publish(events)
        sink.publish([*events[2:], events[0]])
    assert msg_ids(js) == [e.id for e in events]


def test_msg_id_prefix_keeps_two_outboxes_apart(js: Stream) -> None:
    """Two outboxes publishing into one stream with their own msg_id_prefix: event 1 of each is kept."""
    event = OutboxEvent(1, js.topic(), None, {"x": 1}, 0)
    for prefix in ("billing-", "shipping-"):
        with NATSSink(NATS_URL, stream=js.name, lease=LEASE, msg_id_prefix=prefix) as sink:
            sink.publish([event])
    assert [m.headers["Nats-Msg-Id"] for m in js.messages()] == ["billing-1", "shipping-1"]


@pytest.mark.lost_reply
def test_lost_pubacks_publish_the_batch_again_and_jetstream_drops_the_copies(
    outbox_db: Engine, js: Stream
) -> None:
    """The connection is cut after events reached JetStream, before their PubAcks came back: publish
    raises PublishFailed naming them, a relay does not mark them, they come again, and the stream holds
    every event once."""
    ids = emit_events(outbox_db, js.topic(), 5)
    rows = outbox_rows(outbox_db)
    events = [OutboxEvent(r.id, r.topic, r.key, json.loads(r.payload), r.created_ms) for r in rows.values()]
    with FaultProxy("127.0.0.1", NATS_PORT) as proxy:
        with NATSSink(via(NATS_URL, NATS_PORT, proxy.port), stream=js.name, lease=LEASE, timeout=3) as sink:
            sink.connect()
            proxy.cut_after_next_request(f"Nats-Msg-Id: {ids[2]}\r\n".encode())
            with pytest.raises(PublishFailed, match="did not acknowledge") as caught:
                sink.publish(events)
            assert proxy.cuts == 1 and caught.value.retryable and ids[2] in caught.value.event_ids
            assert ids[2] in msg_ids(js)  # stored, though its PubAck was lost

            relay = Relay(outbox_db, sink, lease=LEASE)
            proxy.cut_after_next_request(f"Nats-Msg-Id: {ids[2]}\r\n".encode())
            with contextlib.suppress(PublishFailed):
                relay.run_once()
            assert proxy.cuts == 2
            assert outbox_rows(outbox_db)[ids[2]].published_ms is None
            publish_all(relay, outbox_db)
    stored = msg_ids(js)
    assert sorted(stored) == ids  # once each: the copies of what got through were dropped
    assert ids[2] in stored  # the message whose PubAck was lost had been stored
    assert all(r.published_ms is not None for r in outbox_rows(outbox_db).values())


def test_lease_longer_than_the_duplicate_window_is_refused(outbox_db: Engine) -> None:
    """A relay lease over the stream's duplicate_window: ConfigurationError at connect() and at the first
    publish, nothing stored, the batch unpublished; a lease equal to the window is taken."""
    with _brokers.nats_stream(duplicate_window=5) as js:
        emit_events(outbox_db, js.topic(), 3)
        long = timedelta(seconds=5, milliseconds=1)
        with NATSSink(NATS_URL, stream=js.name, lease=long) as sink:
            with pytest.raises(
                ConfigurationError, match=r"lease \(5.001 s\) is longer than the duplicate_window"
            ):
                sink.connect()
            with pytest.raises(
                ConfigurationError, match="shorten the lease or raise the stream's duplicate_window"
            ):
                Relay(outbox_db, sink, lease=long).run_once()
        assert js.messages() == []
        rows = outbox_rows(outbox_db)
        assert all(r.published_ms is None and r.claimed_until_ms is None for r in rows.values())
        with NATSSink(NATS_URL, stream=js.name, lease=timedelta(seconds=5)) as sink:
            assert drain_relay(Relay(outbox_db, sink, lease=timedelta(seconds=5))) == 3
        assert len(js.messages()) == 3


def test_missing_stream_is_a_configuration_error() -> None:
    """A stream JetStream does not have: ConfigurationError naming it."""
    with (
        NATSSink(NATS_URL, stream="SGTEST_NO_SUCH_STREAM", lease=LEASE) as sink,
        pytest.raises(ConfigurationError, match="no stream 'SGTEST_NO_SUCH_STREAM'"),
    ):
        sink.connect()


def test_unreachable_server_raises_publish_failed() -> None:
    """No NATS server at the URL: PublishFailed (retryable), not a hang."""
    event = OutboxEvent(1, "t", None, {}, 0)
    with (
        NATSSink("nats://127.0.0.1:1", stream="S", lease=LEASE, timeout=1) as sink,
        pytest.raises(PublishFailed, match="cannot connect to NATS"),
    ):
        sink.publish([event])


@pytest.mark.hostile
def test_topic_outside_the_stream_or_not_a_subject_raises_publish_failed(js: Stream) -> None:
    """A topic no subject of the stream matches, or one that is no NATS subject: PublishFailed naming it."""
    with NATSSink(NATS_URL, stream=js.name, lease=LEASE, timeout=3) as sink:
        with pytest.raises(PublishFailed, match="did not acknowledge outbox event 1"):
            sink.publish([OutboxEvent(1, "elsewhere.paid", None, {}, 0)])
        with pytest.raises(PublishFailed, match="is not a NATS subject"):
            sink.publish([OutboxEvent(2, f"{js.name}.order paid", None, {}, 0)])
    assert js.messages() == []


@pytest.mark.hostile
def test_key_with_line_breaks_cannot_forge_a_header(js: Stream) -> None:
    """A key holding CR LF and a header line is percent-encoded: Nats-Msg-Id stays the event id."""
    key = "k\r\nNats-Msg-Id: 1\r\n"
    with NATSSink(NATS_URL, stream=js.name, lease=LEASE) as sink:
        sink.publish([OutboxEvent(1, js.topic(), "a", {}, 0), OutboxEvent(2, js.topic(), key, {}, 0)])
    messages = js.messages()
    assert [m.headers["Nats-Msg-Id"] for m in messages] == ["1", "2"]
    assert unquote(messages[1].headers["Outbox-Key"]) == key


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"servers": "redis://127.0.0.1:6379"}, "servers must be a NATS URL"),
        ({"servers": []}, "servers must be a NATS URL"),
        ({"stream": "a.b"}, "stream names hold no"),
        ({"stream": ""}, "stream must be the name"),
        ({"lease": 30}, "lease must be a datetime.timedelta"),
        ({"lease": timedelta(0)}, "lease must be at least 1 millisecond"),
        ({"subject": "orders.*"}, "not a NATS subject"),
        ({"subject": "orders..paid"}, "not a NATS subject"),
        ({"msg_id_prefix": "a\nb"}, "msg_id_prefix must be a str without line breaks"),
        ({"timeout": 0}, "timeout"),
    ],
)
@pytest.mark.hostile
def test_bad_arguments_are_invalid_argument(kwargs: dict[str, Any], message: str) -> None:
    """Each bad argument of either sink is InvalidArgument saying what was wrong; nothing is connected."""
    arguments: dict[str, Any] = {"servers": NATS_URL, "stream": "S", "lease": LEASE, **kwargs}
    servers = arguments.pop("servers")
    for cls in (NATSSink, AsyncNATSSink):
        with pytest.raises(InvalidArgument, match=message):
            cls(servers, **arguments)


# -- AsyncNATSSink ----------------------------------------------------------


def test_async_sink_publishes_with_async_relay_and_refuses_a_long_lease(
    sqlite: Backend, outbox_db: Engine, js: Stream
) -> None:
    """AsyncRelay + AsyncNATSSink: every event once, in id order per key; a lease over the window refused."""
    ids = emit_events(outbox_db, js.topic(), 12)

    async def main() -> None:
        engine = create_async_engine(sqlite.url.replace("sqlite://", "sqlite+aiosqlite://", 1))
        try:
            too_long = timedelta(seconds=js.duplicate_window + 1)
            async with AsyncNATSSink(NATS_URL, stream=js.name, lease=too_long) as sink:
                with pytest.raises(ConfigurationError, match="longer than the duplicate_window"):
                    await AsyncRelay(engine, sink, lease=too_long).run_once()
            async with AsyncNATSSink(NATS_URL, stream=js.name, lease=LEASE) as sink:
                relay = AsyncRelay(engine, sink, batch=5, lease=LEASE)
                assert [await relay.run_once() for _ in range(4)] == [5, 5, 2, 0]
        finally:
            await engine.dispose()

    asyncio.run(main())
    stored = js.messages()
    assert sorted(int(m.headers["Nats-Msg-Id"]) for m in stored) == ids
    for key in ("k0", "k1"):
        of_key = [int(m.headers["Nats-Msg-Id"]) for m in stored if m.headers.get("Outbox-Key") == key]
        assert of_key == sorted(of_key)
