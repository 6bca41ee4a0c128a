"""RedisStreamConsumer with the entries and replies production sends it (docs/how-to/consumers.md):
poison entries read by a decoding client, a dead-letter XADD Redis refuses, replies of XREADGROUP and XACK
lost on the wire, raising observers, and a handler whose own error the driver calls "operational"."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, insert, text
from sqlalchemy.orm import Session

from stateguard import on_event
from stateguard.consumers import Message, RedisStreamConsumer

from .._support.failing_observers import ObserverBug, QuietHandler
from .._support.faultproxy import FaultProxy
from ._drive import run_for, run_until
from ._effects import applied, effects, record

GROUP = "billing"


def consumer(db: Engine, client: Any, name: str, handler: Any = record, **kw: Any) -> RedisStreamConsumer:
    kw.setdefault("worker", "w1")
    kw.setdefault("block", timedelta(milliseconds=50))
    return RedisStreamConsumer(db, handler, client, stream=name, group=GROUP, **kw)


def add(client: Any, name: str, entry_id: Any, payload: Any = "{}") -> None:
    client.xadd(name, {"id": entry_id, "topic": "t", "key": "k", "payload": payload})


def pending(client: Any, name: str) -> int:
    return int(client.xpending(name, GROUP)["pending"])


@pytest.fixture
def decoding(stream: tuple[Any, str]) -> Iterator[Any]:
    """A second client of the same Redis with ``decode_responses=True`` (the docstring says both work)."""
    client, _ = stream
    kwargs = client.connection_pool.connection_kwargs
    made = redis.Redis(host=kwargs["host"], port=kwargs["port"], db=kwargs["db"], decode_responses=True)
    yield made
    made.close()


@pytest.mark.hostile
def test_a_non_utf8_entry_read_by_a_decoding_client_is_dead_lettered_not_fatal(
    db: Engine, stream: tuple[Any, str], decoding: Any
) -> None:
    """A client with decode_responses: an entry whose id (or payload) is not UTF-8 is dead-lettered like
    with a raw client, and the entries after it are handled, instead of run() dying on a
    UnicodeDecodeError at every start (the entry stays pending, read again first each time)."""
    raw, name = stream
    add(raw, name, b"\xff")
    add(raw, name, "bin", payload=b"\x80\x81")  # a good id, a body that is not text
    add(raw, name, "good")
    seen: list[str] = []

    def handler(session: Session, message: Message) -> None:
        seen.append(message.id)
        assert message.body in (b"\x80\x81", b"{}")
        session.execute(insert(effects).values(event_id=message.id, pid=0))

    c = consumer(db, decoding, name, handler)
    run_until(c, lambda: c.handled == 2 and c.dead_lettered == 1)
    assert seen == ["bin", "good"] and applied(db) == {"bin": 1, "good": 1}
    assert pending(raw, name) == 0
    [(_, dead)] = raw.xrange(f"{name}:dead")
    assert dead[b"id"] == b"\xff" and dead[b"error"] == b"its id is not UTF-8 text"


@pytest.mark.hostile
def test_a_dead_letter_stream_redis_refuses_does_not_lose_the_entry(
    db: Engine, stream: tuple[Any, str]
) -> None:
    """The dead-letter XADD fails when it runs (the key holds a string): the entry must stay pending,
    not be XACKed with it anyway (a MULTI is not rolled back) and vanish from both streams."""
    client, name = stream
    client.set(f"{name}:dead", "not a stream")
    add(client, name, "9", payload="not json")
    c = consumer(db, client, name, claim_idle=timedelta(milliseconds=20), max_deliveries=2)
    run_for(c, 1.5)
    assert applied(db) == {}
    # Not dead-lettered (Redis refused), so it must still be pending, to be dead-lettered once fixed.
    assert pending(client, name) == 1
    client.delete(f"{name}:dead")
    run_until(c, lambda: c.dead_lettered == 1)
    assert pending(client, name) == 0 and client.xlen(f"{name}:dead") == 1


@pytest.mark.lost_reply
@pytest.mark.parametrize("command", [b"XACK", b"XREADGROUP"])
def test_a_lost_redis_reply_leaves_every_effect_once(
    db: Engine, stream: tuple[Any, str], command: bytes
) -> None:
    """The reply of an XACK (ran: the entry left the PEL) or of an XREADGROUP (ran: the entries joined
    this worker's PEL, the client never saw them) is lost on the wire: the consumer reconnects, the
    entries it never saw are claimed back after claim_idle, and every effect is in once."""
    raw, name = stream
    ids = [str(i) for i in range(8)]
    for entry_id in ids[:4]:
        add(raw, name, entry_id)
    kwargs = raw.connection_pool.connection_kwargs
    with FaultProxy(kwargs["host"], kwargs["port"]) as proxy:
        client = redis.Redis(host=proxy.host, port=proxy.port, retry=None)
        try:
            c = consumer(db, client, name, claim_idle=timedelta(milliseconds=300), batch=2)
            c._ensure_group()
            proxy.cut_after_next_request(command)
            stop = threading.Event()
            thread = threading.Thread(target=c.run, args=(stop,))
            thread.start()
            assert proxy.wait_cut(10)
            for entry_id in ids[4:]:
                add(raw, name, entry_id)
            deadline = time.monotonic() + 20
            while (len(applied(db)) < len(ids) or pending(raw, name)) and time.monotonic() < deadline:
                time.sleep(0.05)
            stop.set()
            thread.join(15)
            assert not thread.is_alive()
        finally:
            client.close()
    assert proxy.cuts == 1
    assert applied(db) == dict.fromkeys(ids, 1)
    assert pending(raw, name) == 0


@pytest.mark.failing_observer
@pytest.mark.parametrize("broken", ["listener", "consumer_log_filter"])
def test_a_broken_observer_does_not_change_the_redis_consumer(
    db: Engine, stream: tuple[Any, str], broken: str
) -> None:
    """New, failing once, no id: with a raising outcome listener or logging filter the effects are in
    once, two acks, one dead letter, no crash (the observer tests cover RabbitMQ and NATS only)."""
    client, name = stream
    for entry_id in ("1", "2", ""):
        add(client, name, entry_id)
    calls: list[str] = []

    def flaky(session: Session, message: Message) -> None:
        calls.append(message.id)
        record(session, message)
        if message.id == "2" and calls.count("2") == 1:
            raise RuntimeError("the first try of 2 fails")

    stops: list[Callable[[], None]] = []
    if broken == "listener":

        def fail(event: Any) -> None:
            raise ObserverBug(f"listener: {event}")

        stops.append(on_event(fail))
    else:
        logger = logging.getLogger("stateguard")
        handler = QuietHandler()

        def check(rec: logging.LogRecord) -> bool:
            if rec.name == "stateguard.consumers":
                raise ObserverBug(rec.getMessage())
            return True

        handler.addFilter(check)
        level = logger.level
        logger.setLevel(logging.DEBUG)
        logger.addHandler(handler)

        def restore() -> None:
            logger.removeHandler(handler)
            logger.setLevel(level)

        stops.append(restore)
    try:
        c = consumer(db, client, name, flaky, claim_idle=timedelta(milliseconds=50))
        run_until(c, lambda: c.handled == 2 and c.dead_lettered == 1)
    finally:
        for stop in stops:
            stop()
    assert sorted(calls) == ["1", "2", "2"] and applied(db) == {"1": 1, "2": 1}
    assert (c.handled, c.dead_lettered) == (2, 1) and pending(client, name) == 0


def test_a_handler_whose_own_statement_fails_operationally_is_dead_lettered(
    db: Engine, stream: tuple[Any, str]
) -> None:
    """The database is up; the handler's statement is wrong (sqlite3 says OperationalError): it is the
    message's failure, so after max_deliveries the entry goes to the dead letters and the next entry is
    handled."""
    client, name = stream
    add(client, name, "bad")
    add(client, name, "good")

    def handler(session: Session, message: Message) -> None:
        if message.id == "bad":
            session.execute(text("SELECT * FROM sg_no_such_table"))
        record(session, message)

    c = consumer(db, client, name, handler, claim_idle=timedelta(milliseconds=20), max_deliveries=2)
    run_until(c, lambda: c.dead_lettered == 1 and c.handled == 1, timeout=6)
    assert applied(db) == {"good": 1} and c.dead_lettered == 1


@pytest.mark.hostile
@pytest.mark.parametrize("fields", [1, 5000])
def test_a_poison_entry_with_many_fields_is_dead_lettered_whole(
    db: Engine, stream: tuple[Any, str], fields: int
) -> None:
    """A poison entry with thousands of extra fields (more than one Lua unpack() takes) is still moved
    to the dead letters whole, and acknowledged."""
    client, name = stream
    extra = {f"f{i}": "v" for i in range(fields)}
    client.xadd(name, {"id": "9", "topic": "t", "key": "k", "payload": "not json", **extra})
    c = consumer(db, client, name, max_deliveries=1)
    run_until(c, lambda: c.dead_lettered == 1)
    assert pending(client, name) == 0
    [(_, dead)] = client.xrange(f"{name}:dead")
    assert dead[b"id"] == b"9" and len(dead) == 4 + fields + 5


@pytest.mark.cancel
@pytest.mark.parametrize("max_deliveries", [1, 5])
def test_entries_left_unstarted_by_stop_are_handled_at_the_next_start_not_dead_lettered(
    db: Engine, stream: tuple[Any, str], max_deliveries: int
) -> None:
    """stop() while the first of a batch of five runs: the four read and not started stay pending;
    the restarted worker handles them (they never ran, let alone crashed a worker), even with
    max_deliveries=1."""
    client, name = stream
    for i in range(5):
        add(client, name, str(i))
    inside, release = threading.Event(), threading.Event()

    def slow(session: Session, message: Message) -> None:
        record(session, message)
        inside.set()
        release.wait(5)

    first = consumer(db, client, name, slow, max_deliveries=max_deliveries)
    thread = threading.Thread(target=first.run)
    thread.start()
    assert inside.wait(5)
    first.stop()
    release.set()
    thread.join(10)
    assert not thread.is_alive() and pending(client, name) == 4
    again = consumer(db, client, name, max_deliveries=max_deliveries)
    run_until(again, lambda: again.handled + again.dead_lettered >= 4)
    assert again.dead_lettered == 0 and client.xlen(f"{name}:dead") == 0
    assert applied(db) == dict.fromkeys(map(str, range(5)), 1)


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_resp3_client_reads_recovers_claims_and_dead_letters_like_a_resp2_one(
    db: Engine, stream: tuple[Any, str], protocol: int
) -> None:
    """``redis.Redis(protocol=3)`` answers XREADGROUP with a map, not a list: the consumer still
    handles new entries, its own pending ones at start, claimed ones and a poison entry (instead of
    run() dying on a KeyError at its first round)."""
    raw, name = stream
    kwargs = raw.connection_pool.connection_kwargs
    client = redis.Redis(host=kwargs["host"], port=kwargs["port"], db=kwargs["db"], protocol=protocol)
    try:
        raw.xgroup_create(name, GROUP, id="0", mkstream=True)
        add(raw, name, "mine")
        raw.xreadgroup(GROUP, "w1", {name: ">"})  # read by w1 before it died: recovered at start
        add(raw, name, "theirs")
        raw.xreadgroup(GROUP, "w9", {name: ">"})  # read by w9, which died: claimed after claim_idle
        add(raw, name, "new")
        add(raw, name, "poison", payload="not json")
        c = consumer(db, client, name, claim_idle=timedelta(milliseconds=50), max_deliveries=2)
        run_until(c, lambda: c.handled == 3 and c.dead_lettered == 1)
        assert applied(db) == {"mine": 1, "theirs": 1, "new": 1}
        assert pending(raw, name) == 0 and raw.xlen(f"{name}:dead") == 1
    finally:
        client.close()


def test_an_entry_claimed_by_another_worker_while_its_handler_runs_is_applied_once(
    db: Engine, stream: tuple[Any, str]
) -> None:
    """claim_idle shorter than a slow handler: w2 XAUTOCLAIMs the entry w1 is still handling and
    handles it too; the two transactions race on the consume_once record, the effect is in once and
    the entry ends acknowledged."""
    client, name = stream
    add(client, name, "slow")
    claimed, w1_done = threading.Event(), threading.Event()
    runs: list[str] = []

    def slow(session: Session, message: Message) -> None:
        runs.append(message.id)
        record(session, message)
        if len(runs) == 1:  # w1: hold the transaction until w2 took the entry over
            assert claimed.wait(10)

    w1 = consumer(db, client, name, slow, worker="w1", claim_idle=timedelta(hours=1))
    w2 = consumer(db, client, name, slow, worker="w2", claim_idle=timedelta(milliseconds=100))
    first = threading.Thread(target=lambda: (w1.run_once(), w1_done.set()))
    first.start()
    deadline = time.monotonic() + 10
    while not runs and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # idle past w2's claim_idle
    w2._ensure_group()
    second = threading.Thread(target=w2.run_once)
    second.start()
    while time.monotonic() < deadline:
        owners = client.xpending_range(name, GROUP, "-", "+", 10)
        if owners and owners[0]["consumer"] == b"w2":
            break
        time.sleep(0.01)
    claimed.set()
    first.join(15)
    second.join(15)
    assert w1_done.is_set()
    assert applied(db) == {"slow": 1}
    assert pending(client, name) == 0
