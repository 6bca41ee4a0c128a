"""NATSConsumer on a real NATS JetStream: ack after commit, repeats skipped, failures redelivered by
JetStream, poison messages copied to a dead-letter subject and terminated, graceful stop."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from stateguard import ConfigurationError, InvalidArgument, Relay
from stateguard.consumers import Message, NATSConsumer
from stateguard.outbox.sinks import NATSSink

from .._support.brokers import NATS_URL, Stream, nats_stream
from .._support.nats_server import NATSServer
from . import _behaviours
from ._drive import publish_nats as publish
from ._drive import publish_nats_bytes, run_for, run_until
from ._effects import applied, committed_ids, emit_events, record

LEASE = timedelta(seconds=30)


def consumer(db: Engine, js: Stream, handler: Any = record, **kw: Any) -> NATSConsumer:
    kw.setdefault("poll", timedelta(milliseconds=100))
    kw.setdefault("retry_delay", timedelta(milliseconds=50))
    kw.setdefault("dead_letter_subject", js.dead_subject)
    return NATSConsumer(db, handler, NATS_URL, stream=js.name, durable="billing", **kw)


def broker(db: Engine, js: Stream) -> _behaviours.Broker:
    """The database and the test's stream, for the behaviours every consumer shares."""
    return _behaviours.Broker(
        db, lambda message_id: publish(js, message_id), lambda handler: consumer(db, js, handler)
    )


def test_relayed_events_are_applied_once_and_acknowledged(db: Engine, js: Stream) -> None:
    """Every event a relay published is applied once; the message carries id, topic, key and payload."""
    emit_events(db, 10, topic=js.topic())
    with NATSSink(NATS_URL, stream=js.name, lease=LEASE) as sink:
        Relay(db, sink, lease=LEASE).run_once()
    got: list[Message] = []

    def handler(session: Session, message: Message) -> None:
        got.append(message)
        record(session, message)

    c = consumer(db, js, handler)
    run_until(c, lambda: c.handled == 10)
    assert applied(db) == dict.fromkeys(committed_ids(db), 1)
    first = min(got, key=lambda m: int(m.id))
    assert (first.topic, first.key, first.payload, first.deliveries) == (js.topic(), "k0", {"seq": 0}, 1)


def test_a_message_committed_before_a_crash_is_acked_without_the_handler(db: Engine, js: Stream) -> None:
    """Committed, then died before its ack: the redelivery is REPEATED and acked, the handler not run."""
    _behaviours.repeat_is_acked_without_the_handler(broker(db, js))


def test_a_failing_message_is_redelivered_then_applied(db: Engine, js: Stream) -> None:
    """Two failures then a success: JetStream's deliveries are 1, 2, 3 and there is one effect."""
    publish(js, "6")
    seen: list[int] = []

    def flaky(session: Session, message: Message) -> None:
        seen.append(message.deliveries)
        if len(seen) < 3:
            raise RuntimeError("not yet")
        record(session, message)

    c = consumer(db, js, flaky)
    run_until(c, lambda: c.handled == 1)
    assert seen == [1, 2, 3] and applied(db) == {"6": 1}
    assert js.messages(js.dead_name) == []


def test_a_poison_message_is_copied_to_the_dead_letter_subject_and_terminated(db: Engine, js: Stream) -> None:
    """A message that always fails is tried max_deliveries times, copied to the dead subject, never again."""
    publish(js, "13", b"not json")
    publish(js, "14", b'{"seq": 1}')
    c = consumer(db, js, max_deliveries=3)
    run_until(c, lambda: c.dead_lettered == 1 and c.handled == 1)
    assert applied(db) == {"14": 1}
    [dead] = js.messages(js.dead_name)
    assert dead.data == b"not json"
    assert dead.headers["Stateguard-Msg-Id"] == "13"
    assert dead.headers["Stateguard-Deliveries"] == "3"
    assert dead.headers["Stateguard-Stream"] == js.name
    again = consumer(db, js, max_deliveries=3)
    run_for(again, 0.5)
    assert again.handled == again.dead_lettered == 0  # terminated: JetStream does not deliver it again


def test_a_message_without_an_id_is_dead_lettered(db: Engine, js: Stream) -> None:
    """A message with no Nats-Msg-Id cannot be deduplicated: dead-lettered at once."""
    _behaviours.message_without_an_id_is_dead_lettered(broker(db, js))
    assert len(js.messages(js.dead_name)) == 1


def test_stop_finishes_the_message_in_hand(db: Engine, js: Stream) -> None:
    """stop() during a handler: it commits and is acked, run() returns; the rest is delivered to the next
    run."""
    _behaviours.stop_finishes_the_message_in_hand(broker(db, js), 3)
    rest = consumer(db, js)
    run_until(rest, lambda: rest.handled == 2)
    assert applied(db) == {"0": 1, "1": 1, "2": 1}


def test_a_missing_stream_is_a_configuration_error(db: Engine) -> None:
    """A stream that does not exist ends run() with ConfigurationError naming it."""
    c = NATSConsumer(db, record, NATS_URL, stream="SGCNOSUCHSTREAM", durable="x")
    with pytest.raises(ConfigurationError, match="SGCNOSUCHSTREAM"):
        run_for(c, 5)


def test_bad_arguments_are_refused(db: Engine) -> None:
    """A URL that is not NATS, a zero max_deliveries or ack_wait is InvalidArgument."""
    with pytest.raises(InvalidArgument, match="NATS URL"):
        NATSConsumer(db, record, "http://x", stream="S", durable="d")
    with pytest.raises(InvalidArgument, match="max_deliveries"):
        NATSConsumer(db, record, NATS_URL, stream="S", durable="d", max_deliveries=0)
    with pytest.raises(InvalidArgument, match="ack_wait"):
        NATSConsumer(db, record, NATS_URL, stream="S", durable="d", ack_wait=timedelta(0))


#: Nats-Msg-Id header values consume_once cannot record, as they go on the wire: NUL, a lone
#: surrogate (its CESU-8 octets), two different non-UTF-8 ids (a client decoding with replacement
#: reads both as U+FFFD), blank, and 256 characters.
HOSTILE_IDS: list[bytes] = [b"a\x00b", b"\xed\xa0\x80", b"\xff", b"\xfe", b"   ", b"x" * 256]


@pytest.mark.hostile
def test_messages_whose_ids_cannot_be_recorded_are_dead_lettered_at_once(
    db: Engine, js: Stream, caplog: pytest.LogCaptureFixture
) -> None:
    """Each hostile Nats-Msg-Id: copied to the dead-letter subject on its first delivery with the reason
    logged, the handler never run, never redelivered; the consumer goes on with the good message after."""
    for bad in HOSTILE_IDS:
        publish_nats_bytes(js, b"Nats-Msg-Id: " + bad)
    _behaviours.hostile_ids_are_dead_lettered_at_once(
        broker(db, js), caplog, hostile=len(HOSTILE_IDS), logged="terminated"
    )
    dead = js.messages(js.dead_name)
    assert len(dead) == len(HOSTILE_IDS)
    assert {letter.headers["Stateguard-Deliveries"] for letter in dead} == {"1"}  # never retried
    again = consumer(db, js)
    run_for(again, 0.5)
    assert again.handled == again.dead_lettered == 0  # terminated: none comes back


# -- a NATS server killed mid-stream (a private one: never the shared server) ------------------------


def settled(url: str, stream: str, durable: str) -> bool:
    """Whether the durable consumer has nothing pending and nothing waiting for an ack."""

    async def ask() -> bool:
        import nats

        client = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0)
        try:
            info = await client.jetstream().consumer_info(stream, durable)
            return bool(info.num_pending == 0 and info.num_ack_pending == 0)
        finally:
            await client.close()

    try:
        return asyncio.run(ask())
    except Exception:  # the server is down or restarting: not settled
        return False


@pytest.mark.restart
def test_a_nats_server_killed_mid_stream_and_restarted_leaves_every_effect_once(db: Engine) -> None:
    """SIGKILL of the server inside a handler, restarted on the same port and store: the consumer
    reconnects by itself, the message whose ack was lost comes again and is a repeat (its handler ran
    once), and every message's effect is in once."""
    ids = [str(i) for i in range(1, 9)]
    with NATSServer() as server, nats_stream(url=server.url) as js:
        for message_id in ids:
            publish(js, message_id, url=server.url)
        calls: list[str] = []
        restarted: list[threading.Thread] = []

        def handler(session: Session, message: Message) -> None:
            calls.append(message.id)
            record(session, message)
            if message.id == "3" and not restarted:
                server.kill()  # before this message's commit and ack

                def restart() -> None:
                    time.sleep(0.5)
                    server.start()

                restarted.append(threading.Thread(target=restart))
                restarted[0].start()

        c = NATSConsumer(
            db,
            handler,
            server.url,
            stream=js.name,
            durable="billing",
            poll=timedelta(milliseconds=100),
            ack_wait=timedelta(seconds=3),  # how soon JetStream delivers the unacknowledged message again
        )
        run_until(
            c,
            lambda: len(applied(db)) == len(ids) and settled(server.url, js.name, "billing"),
            timeout=60,
        )
        restarted[0].join(20)
        assert applied(db) == dict.fromkeys(ids, 1)
        assert sorted(calls) == ids  # the redelivered message was a repeat: its handler did not run again
        assert c.dead_lettered == 0


def _new_connect_refused(records: list[Any]) -> bool:
    """The consumer gave the lost connection up ("connecting again in") and a new connect attempt
    has since been refused once (nats-py now waits 2 s before its next attempt)."""
    messages = [r.getMessage() for r in records]
    gave_up = next((i for i, m in enumerate(messages) if "connecting again in" in m), None)
    return gave_up is not None and any("ConnectionRefusedError" in m for m in messages[gave_up + 1 :])


@pytest.mark.restart
@pytest.mark.parametrize("phase", ["reconnecting", "connecting"])
def test_stop_while_the_nats_server_is_down_returns_promptly(
    db: Engine, caplog: pytest.LogCaptureFixture, phase: str
) -> None:
    """The server killed and not restarted: the consumer keeps trying (nats-py's own reconnects of the
    lost connection, then a new connect, which itself retries for about 6 s).  A stop() in either
    phase ends run() within about a second, without an error: not after the connect's retries."""
    with NATSServer() as server, nats_stream(url=server.url) as js:
        publish(js, "1", url=server.url)
        c = NATSConsumer(
            db, record, server.url, stream=js.name, durable="billing", poll=timedelta(milliseconds=100)
        )
        stop = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            try:
                c.run(stop)
            except BaseException as error:  # pragma: no cover - reported below
                failed.append(error)

        thread = threading.Thread(target=run)
        thread.start()
        deadline = time.monotonic() + 10
        while c.handled < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.handled == 1
        caplog.clear()
        server.kill()
        if phase == "reconnecting":
            time.sleep(1.0)
        else:
            deadline = time.monotonic() + 30
            while not _new_connect_refused(caplog.records):
                assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
                time.sleep(0.02)
        asked = time.monotonic()
        stop.set()
        thread.join(30)
        took = time.monotonic() - asked
        assert not thread.is_alive()
        server.start()  # for the stream's deletion
    assert failed == []
    assert took < 1.5, f"run() took {took:.1f} s to return after stop()"
