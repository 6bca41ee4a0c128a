"""RedisStreamConsumer on a real Redis: ack after commit, repeats skipped, own pending entries
recovered at start, other workers' stuck entries claimed, poison entries dead-lettered, graceful stop."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from stateguard import CallableSink, InvalidArgument, RedisStreamSink, Relay, consume_once
from stateguard.consumers import Message, RedisStreamConsumer

from . import _behaviours
from ._effects import applied, committed_ids, emit_events, record

GROUP = "billing"


def consumer(db: Engine, stream: tuple[Any, str], handler: Any = record, **kw: Any) -> RedisStreamConsumer:
    client, name = stream
    kw.setdefault("worker", "w1")
    kw.setdefault("block", timedelta(milliseconds=50))
    return RedisStreamConsumer(db, handler, client, stream=name, group=GROUP, **kw)


def drain(c: RedisStreamConsumer, rounds: int = 20) -> None:
    """Rounds until one handles nothing."""
    for _ in range(rounds):
        if not c.run_once():
            return


def pending(stream: tuple[Any, str]) -> int:
    client, name = stream
    return int(client.xpending(name, GROUP)["pending"])


def test_relayed_events_are_applied_once_and_acknowledged(db: Engine, stream: tuple[Any, str]) -> None:
    """Every event a relay published (a batch published twice too) is applied once and XACKed."""
    client, name = stream
    emit_events(db, 12)
    real = RedisStreamSink(client, stream=name)
    # Each batch lands twice, as when a relay died after publishing and before marking it.
    Relay(db, CallableSink(lambda events: [real.publish(events), real.publish(events)])).run_once()
    assert client.xlen(name) == 24
    c = consumer(db, stream)
    drain(c)
    assert applied(db) == dict.fromkeys(committed_ids(db), 1)
    assert pending(stream) == 0
    assert c.handled == 24


def test_an_entry_committed_before_a_crash_is_acknowledged_without_the_handler(
    db: Engine, stream: tuple[Any, str]
) -> None:
    """Committed, then died before XACK: the entry comes again, REPEATED, acked, the handler not run."""
    client, name = stream
    client.xadd(name, {"id": "77", "topic": "t", "key": "k", "payload": "{}"})
    with Session(db) as session, session.begin():
        consume_once(session, GROUP, "77")
    calls: list[Message] = []
    drain(consumer(db, stream, lambda s, m: calls.append(m)))
    assert calls == [] and pending(stream) == 0


def test_a_failed_entry_stays_pending_and_is_claimed_again_after_claim_idle(
    db: Engine, stream: tuple[Any, str]
) -> None:
    """A handler error leaves the entry pending (no effect); after claim_idle it is handled again, once."""
    client, name = stream
    client.xadd(name, {"id": "5", "topic": "t", "key": "k", "payload": '{"seq": 1}'})
    deliveries: list[int] = []

    def flaky(session: Session, message: Message) -> None:
        deliveries.append(message.deliveries)
        if len(deliveries) == 1:
            raise RuntimeError("first try fails")
        record(session, message)

    c = consumer(db, stream, flaky, claim_idle=timedelta(milliseconds=100))
    c.run_once()
    assert applied(db) == {} and pending(stream) == 1
    time.sleep(0.15)
    drain(c)
    assert applied(db) == {"5": 1} and pending(stream) == 0
    assert deliveries == [1, 2]


def test_a_restarted_worker_handles_its_own_pending_entries_at_once(
    db: Engine, stream: tuple[Any, str]
) -> None:
    """Entries read by w1 before it died are handled by the new w1's first round (no claim_idle wait)."""
    client, name = stream
    client.xgroup_create(name, GROUP, id="0", mkstream=True)
    for i in range(3):
        client.xadd(name, {"id": str(i), "topic": "t", "key": "k", "payload": "{}"})
    client.xreadgroup(GROUP, "w1", {name: ">"})  # read, never acked: the worker died
    assert pending(stream) == 3
    c = consumer(db, stream, claim_idle=timedelta(hours=1))
    c.run_once()
    assert applied(db) == {"0": 1, "1": 1, "2": 1} and pending(stream) == 0


def test_another_workers_stuck_entries_are_claimed_only_after_claim_idle(
    db: Engine, stream: tuple[Any, str]
) -> None:
    """w2 leaves w1's pending entries alone until idle for claim_idle, then XAUTOCLAIMs and handles them."""
    client, name = stream
    client.xgroup_create(name, GROUP, id="0", mkstream=True)
    client.xadd(name, {"id": "1", "topic": "t", "key": "", "payload": "{}"})
    client.xreadgroup(GROUP, "w1", {name: ">"})
    patient = consumer(db, stream, worker="w2", claim_idle=timedelta(hours=1))
    drain(patient)
    assert applied(db) == {} and pending(stream) == 1
    eager = consumer(db, stream, worker="w2", claim_idle=timedelta(milliseconds=50))
    time.sleep(0.1)
    drain(eager)
    assert applied(db) == {"1": 1} and pending(stream) == 0


def test_a_poison_entry_goes_to_the_dead_letter_stream_after_max_deliveries(
    db: Engine, stream: tuple[Any, str]
) -> None:
    """An entry that always fails is tried max_deliveries times, then XADDed to <stream>:dead and acked."""
    client, name = stream
    client.xadd(name, {"id": "9", "topic": "t", "key": "k", "payload": "not json"})
    client.xadd(name, {"id": "10", "topic": "t", "key": "k", "payload": '{"seq": 2}'})
    c = consumer(db, stream, claim_idle=timedelta(milliseconds=20), max_deliveries=3)
    for _ in range(10):
        c.run_once()
        time.sleep(0.03)
    assert applied(db) == {"10": 1}
    assert pending(stream) == 0
    [(_, dead)] = client.xrange(f"{name}:dead")
    assert dead[b"id"] == b"9" and dead[b"payload"] == b"not json"
    assert dead[b"deliveries"] == b"3" and dead[b"group"] == GROUP.encode()
    assert c.dead_lettered == 1


def test_an_entry_that_crashed_workers_is_dead_lettered_without_running(
    db: Engine, stream: tuple[Any, str]
) -> None:
    """An entry delivered over max_deliveries times (workers died) is dead-lettered, the handler not run."""
    client, name = stream
    client.xgroup_create(name, GROUP, id="0", mkstream=True)
    client.xadd(name, {"id": "3", "topic": "t", "key": "k", "payload": "{}"})
    for _ in range(3):
        client.xreadgroup(GROUP, "w1", {name: "0" if pending(stream) else ">"})
    calls: list[Message] = []
    drain(consumer(db, stream, lambda s, m: calls.append(m), max_deliveries=2))
    assert calls == [] and pending(stream) == 0
    assert client.xlen(f"{name}:dead") == 1


def test_an_entry_without_an_id_is_dead_lettered_at_once(db: Engine, stream: tuple[Any, str]) -> None:
    """An entry that is not an outbox event (no ``id`` field) cannot be handled once: dead-lettered."""
    client, name = stream
    client.xadd(name, {"payload": "{}"})
    drain(consumer(db, stream))
    assert client.xlen(f"{name}:dead") == 1 and pending(stream) == 0


@pytest.mark.hostile
def test_entries_whose_ids_cannot_be_recorded_are_dead_lettered_at_once_and_apart(
    db: Engine, stream: tuple[Any, str]
) -> None:
    """Non-UTF-8, NUL, blank and over-long ids: each dead-lettered on its first delivery, handler not
    run, nothing recorded; two different non-UTF-8 ids are not taken for one (no replacement text)."""
    client, name = stream
    hostile: list[Any] = [b"\xff", b"\xfe", "a\x00b", " ", "x" * 256]
    for bad in hostile:
        client.xadd(name, {"id": bad, "topic": "t", "key": "k", "payload": "{}"})
    client.xadd(name, {"id": "good", "topic": "t", "key": "k", "payload": "{}"})
    calls: list[str] = []
    c = consumer(db, stream, lambda s, m: calls.append(m.id), max_deliveries=5)
    drain(c)
    assert calls == ["good"]
    assert client.xlen(f"{name}:dead") == len(hostile) and pending(stream) == 0
    assert c.dead_lettered == len(hostile)
    errors = {e[1][b"error"] for e in client.xrange(f"{name}:dead")}
    assert errors == {b"its id is not UTF-8 text", b"its id cannot be recorded"}


def test_stop_finishes_the_entry_in_hand_and_leaves_the_rest_pending(
    db: Engine, stream: tuple[Any, str]
) -> None:
    """stop() during a handler: that entry commits and is acked, run() returns, the rest stay pending."""
    client, name = stream

    def publish(entry_id: str) -> None:
        client.xadd(name, {"id": entry_id, "topic": "t", "key": "k", "payload": "{}"})

    on_stream = _behaviours.Broker(db, publish, lambda handler: consumer(db, stream, handler))
    _behaviours.stop_finishes_the_message_in_hand(on_stream, 5)
    info = client.xpending(name, GROUP)
    assert info["pending"] == 4  # read in the same batch, not started: this worker's next start takes them
    drain(consumer(db, stream))
    assert applied(db) == dict.fromkeys(map(str, range(5)), 1)


def test_bad_arguments_are_refused(db: Engine, stream: tuple[Any, str]) -> None:
    """No client, a zero max_deliveries or claim_idle, the stream as its own dead stream: InvalidArgument."""
    _, name = stream
    with pytest.raises(InvalidArgument, match="redis"):
        RedisStreamConsumer(db, record, None, stream=name, group=GROUP, worker="w")
    with pytest.raises(InvalidArgument, match="max_deliveries"):
        consumer(db, stream, max_deliveries=0)
    with pytest.raises(InvalidArgument, match="claim_idle"):
        consumer(db, stream, claim_idle=timedelta(0))
    with pytest.raises(InvalidArgument, match="dead_letter_stream"):
        consumer(db, stream, dead_letter_stream=name)
