"""Delivery at least once, effects exactly once: the relay's promise under lost replies, a Redis that
restarts empty, a database whose reply to the relay's claim or mark never arrives.

The promise (stateguard.outbox): every committed event is
published at least once; an event is marked published only after the sink accepted it; a relay
that fails mid-batch leaves the batch to a later cycle (at once after a sink error, after the
lease when the relay lost track of its claim); ``Relay.run()`` survives sink errors and
database errors; ``RedisStreamSink`` XADDs each event with its id, so a consumer that records
the id with ``consume_once`` in the transaction of its effect applies each event once.

Every fault is real: tests/_support/faultproxy.FaultProxy forwards a request to Redis, PostgreSQL or
MariaDB and drops the server's reply (or closes every connection), and tests/_support/redis_server
starts a private Redis without persistence that a test crashes and restarts.  Nothing of a
database or of Redis is mocked; the only wrapper is a sink that records what the real
``RedisStreamSink`` returned successfully.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from sqlalchemy import BigInteger, Engine, String, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import OutboxEvent, RedisStreamSink, Relay, consume_once, create_tables, drop_tables, emit
from stateguard.tables import outbox
from tests._support.faultproxy import COMMIT, FaultProxy, proxied_engine
from tests._support.redis_server import RedisServer
from tests.conftest import REDIS_URL, Backend, backends_with

CONSUMER = "relay-faults"
#: What a relay's mark statement looks like on the wire (PostgreSQL and MariaDB): only the mark
#: SETs published_ms (the claim SETs claimed_by, claimed_until_ms and attempts).
MARK_BYTES = b", published_ms="
#: The claim on PostgreSQL: one ``WITH sg_heads AS MATERIALIZED (...) UPDATE ... RETURNING``.
PG_CLAIM_BYTES = b"WITH sg_heads AS MATERIALIZED"


class FaultBase(DeclarativeBase):
    pass


class Effect(FaultBase):
    """One row per effect the consumer applied (no unique key: a double application shows)."""

    __tablename__ = "relay_fault_effects"
    id: Mapped[int] = mapped_column(primary_key=True)
    event_id: Mapped[int] = mapped_column(BigInteger)
    entry: Mapped[str] = mapped_column(String(60))


@dataclass(frozen=True)
class Emitted:
    topic: str
    key: str | None
    payload: dict[str, Any]


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def emit_events(engine: Engine, n: int, tag: str, *, per_transaction: int = 1) -> dict[int, Emitted]:
    """Emit ``n`` events (keys k0..k2 and no key), ``per_transaction`` per committed transaction."""
    out: dict[int, Emitted] = {}
    i = 0
    while i < n:
        with Session(engine) as s, s.begin():
            for _ in range(min(per_transaction, n - i)):
                key = None if i % 4 == 3 else f"{tag}-k{i % 3}"
                payload = {"tag": tag, "n": i, "text": f"événement {i}"}
                event_id = emit(s, f"faults.{tag}", payload, key=key)
                out[event_id] = Emitted(f"faults.{tag}", key, payload)
                i += 1
    return out


def entries_of(client: Any, stream: str) -> list[tuple[str, dict[str, str]]]:
    """The stream's entries, fields decoded."""
    return [
        (entry_id.decode(), {k.decode(): v.decode() for k, v in fields.items()})
        for entry_id, fields in client.xrange(stream)
    ]


def ids_in(entries: Sequence[tuple[str, dict[str, str]]]) -> Counter[int]:
    return Counter(int(fields["id"]) for _, fields in entries)


def check_entries_are_real_events(
    entries: Sequence[tuple[str, dict[str, str]]], emitted: dict[int, Emitted]
) -> None:
    """Every entry carries the id of an emitted event and that event's topic, key and payload."""
    for entry_id, fields in entries:
        assert set(fields) == {"id", "topic", "key", "payload"}, (entry_id, fields)
        event_id = int(fields["id"])
        assert event_id in emitted, f"stream entry {entry_id} carries id {event_id}, which no one emitted"
        want = emitted[event_id]
        assert fields["topic"] == want.topic
        assert fields["key"] == (want.key or "")
        assert json.loads(fields["payload"]) == want.payload


def check_first_appearances_in_key_order(
    entries: Sequence[tuple[str, dict[str, str]]], emitted: dict[int, Emitted]
) -> None:
    """Per key, events first reach the stream in id order (a duplicate may come late; a first never)."""
    seen: set[int] = set()
    firsts: dict[str, list[int]] = {}
    for _, fields in entries:
        event_id = int(fields["id"])
        if event_id in seen:
            continue
        seen.add(event_id)
        key = emitted[event_id].key
        if key is not None:
            firsts.setdefault(key, []).append(event_id)
    for key, order in firsts.items():
        assert order == sorted(order), f"key {key!r} first published out of id order: {order}"


def consume(engine: Engine, entries: Sequence[tuple[str, dict[str, str]]]) -> int:
    """Apply each entry like a consumer: consume_once and the effect row in one transaction."""
    applied = 0
    for entry_id, fields in entries:
        with Session(engine) as s, s.begin():
            if consume_once(s, CONSUMER, fields["id"]).applied:
                s.add(Effect(event_id=int(fields["id"]), entry=entry_id))
                applied += 1
    return applied


def effects(engine: Engine) -> Counter[int]:
    with Session(engine) as s:
        return Counter(s.execute(select(Effect.event_id)).scalars().all())


def outbox_rows(engine: Engine) -> dict[int, Any]:
    with engine.connect() as conn:
        return {row.id: row for row in conn.execute(select(outbox))}


def unpublished(engine: Engine) -> set[int]:
    return {i for i, row in outbox_rows(engine).items() if row.published_ms is None}


def published(engine: Engine) -> set[int]:
    return {i for i, row in outbox_rows(engine).items() if row.published_ms is not None}


def drain(relay: Relay, engine: Engine, *, timeout: float = 30.0) -> list[BaseException]:
    """Run ``relay.run_once()`` until the outbox has nothing unpublished; the errors it raised."""
    errors: list[BaseException] = []
    deadline = time.monotonic() + timeout
    while unpublished(engine):
        assert time.monotonic() < deadline, (
            f"events still unpublished after {timeout}s: {sorted(unpublished(engine))}; errors {errors!r}"
        )
        try:
            if relay.run_once() == 0:
                time.sleep(0.05)
        except Exception as error:  # a fault we injected, or its aftermath: the next cycle goes on
            errors.append(error)
            time.sleep(0.05)
    return errors


def assert_exactly_once_effects(
    engine: Engine, entries: Sequence[tuple[str, dict[str, str]]], emitted: dict[int, Emitted]
) -> None:
    """A consumer reading ``entries`` (and then all of them again: a redelivery) applies each event once."""
    check_entries_are_real_events(entries, emitted)
    check_first_appearances_in_key_order(entries, emitted)
    consume(engine, entries)
    assert consume(engine, entries) == 0  # the redelivery applies nothing
    counts = effects(engine)
    assert set(counts) == set(emitted), f"events never applied: {sorted(set(emitted) - set(counts))}"
    assert {i: c for i, c in counts.items() if c != 1} == {}, "events applied more than once"


class RecordingSink:
    """The real RedisStreamSink; records the ids of every batch whose publish returned (XADD succeeded)."""

    def __init__(
        self, inner: RedisStreamSink, after_publish: Callable[[Sequence[OutboxEvent]], None] | None = None
    ) -> None:
        self.inner = inner
        self.after_publish = after_publish
        self.accepted: set[int] = set()
        self.calls = 0
        self.in_flight: dict[int, list[int]] = {}  # publish calls that have not returned: their ids
        self.lock = threading.Lock()

    def publish(self, events: Sequence[OutboxEvent]) -> Any:
        with self.lock:
            self.calls += 1
            call = self.calls
            self.in_flight[call] = [e.id for e in events]
        try:
            result = self.inner.publish(events)
        finally:
            with self.lock:
                del self.in_flight[call]
        # redis-py's pipeline returns one entry id per XADD: all of them were written.
        assert len(result) == len(events)
        with self.lock:
            self.accepted.update(e.id for e in events)
        if self.after_publish is not None:
            self.after_publish(events)
        return result


# --------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------


@pytest.fixture
def db(backend: Backend) -> Iterator[Engine]:
    """The backend with stateguard's tables and the consumer's effect table."""
    engine = backend.create(FaultBase.metadata)
    drop_tables(engine)
    create_tables(engine)
    yield engine
    drop_tables(engine)


@pytest.fixture
def stream(redis_client: Any) -> Iterator[str]:
    """A stream name unique to the test on the shared Redis; deleted afterwards."""
    name = f"sg-test-relay-faults-{uuid.uuid4().hex}"
    yield name
    redis_client.delete(name)


@pytest.fixture
def redis_proxy(redis_client: Any) -> Iterator[FaultProxy]:
    """A FaultProxy in front of the shared test Redis."""
    kwargs = redis_client.connection_pool.connection_kwargs
    with FaultProxy(kwargs.get("host", "127.0.0.1"), kwargs.get("port", 6379)) as running:
        yield running


def redis_through(host: str, port: int, *, retries: bool, db_index: int = 0) -> Any:
    """A redis-py client: redis-py's default retries, or none at all."""
    if retries:
        return redis.Redis(host=host, port=port, db=db_index)
    return redis.Redis(host=host, port=port, db=db_index, retry=Retry(NoBackoff(), 0))


RETRIES = pytest.mark.parametrize("retries", [False, True], ids=["redis-no-retry", "redis-default-retry"])


# --------------------------------------------------------------------------
# 1. The reply to the XADDs is lost
# --------------------------------------------------------------------------


@pytest.mark.lost_reply
@RETRIES
def test_lost_xadd_reply_publishes_every_event_and_the_consumer_applies_each_once(
    db: Engine, redis_proxy: FaultProxy, redis_client: Any, stream: str, retries: bool
) -> None:
    """The batch's XADDs ran on Redis, their reply was dropped: the relay never marks the batch on
    the strength of that pipeline (without retries the sink raised and the relay published the
    batch again, in halves, in the same cycle); later cycles publish everything; each stream
    entry is a real event and a consume_once consumer applies each event exactly once despite the
    duplicates."""
    emitted = emit_events(db, 7, "xadd", per_transaction=3)
    client = redis_through(
        redis_proxy.host, redis_proxy.port, retries=retries, db_index=int(REDIS_URL.rsplit("/", 1)[-1] or 0)
    )
    try:
        client.ping()  # connected (and its handshake done) before the cut is armed
        sink = RecordingSink(RedisStreamSink(client, stream=stream))
        # A long lease: the events can only come back at once if the failed batch was released.
        relay = Relay(db, sink, lease=timedelta(seconds=60))
        redis_proxy.cut_after_next_request(b"XADD")
        # With retries redis-py sent the pipeline again on a new connection; without, the sink raised
        # and the relay published the batch's halves again (taking a refused batch apart): either
        # way the sink accepted the whole batch in this cycle, and only after the failed call.
        assert relay.run_once() == len(emitted)
        assert published(db) == set(emitted) and published(db) <= sink.accepted
        assert redis_proxy.wait_cut()
        assert redis_proxy.cuts == 1
        # The cut XADDs ran on the server (their reply was lost), so the stream has them twice.
        assert ids_in(entries_of(redis_client, stream)) == Counter(dict.fromkeys(emitted, 2))

        drain(relay, db)
        assert unpublished(db) == set()
        assert published(db) <= sink.accepted
        entries = entries_of(redis_client, stream)
        counts = ids_in(entries)
        assert set(counts) == set(emitted)
        assert len(entries) > len(emitted)  # the lost reply made the relay publish the batch again
        assert redis_proxy.cuts == 1
        assert_exactly_once_effects(db, entries, emitted)
    finally:
        client.close()


# --------------------------------------------------------------------------
# 2. Redis crashes and comes back empty while Relay.run() is publishing
# --------------------------------------------------------------------------


@pytest.mark.restart
@RETRIES
def test_relay_run_survives_a_redis_restart_and_publishes_what_the_restart_did_not_see(
    db: Engine, private_redis: RedisServer, retries: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Relay.run() in a thread over many events; Redis is SIGKILLed and restarted empty while the
    relay's XADDs wait.  The thread keeps running; every event unpublished at the restart and every
    event emitted after it is in the new stream; every event marked published reached an XADD that
    succeeded (it is in the old stream's last content or in the new stream): the union of both
    streams is every event, and a consumer that read both applies each event once.

    What Redis without persistence loses is not asserted: entries XADDed (and marked) before the
    crash are gone from the new stream; that is Redis's durability, not the relay's."""
    caplog.set_level(logging.WARNING, logger="stateguard.outbox")
    server = private_redis
    observer: Any = redis.Redis(host=server.host, port=server.port)
    observer.flushall()
    stream = f"sg-test-relay-restart-{uuid.uuid4().hex}"
    client = redis_through(server.host, server.port, retries=retries)
    sink = RecordingSink(RedisStreamSink(client, stream=stream))
    relay = Relay(db, sink, batch=5, lease=timedelta(seconds=2))
    stop = threading.Event()
    died: list[BaseException] = []

    def run() -> None:
        try:
            relay.run(stop, idle_sleep=0.02)
        except BaseException as error:
            died.append(error)
            raise

    thread = threading.Thread(target=run, name="relay-under-restart", daemon=True)
    thread.start()
    try:
        emitted = emit_events(db, 60, "before")
        deadline = time.monotonic() + 30
        while observer.xlen(stream) < 20:
            assert time.monotonic() < deadline, "the relay published nothing"
            time.sleep(0.01)

        # Freeze the old server's writes (reads still answer): what XRANGE returns now is exactly what
        # the crash destroys; the relay's next XADDs wait until the SIGKILL breaks their connection.
        observer.execute_command("CLIENT", "PAUSE", "60000", "WRITE")
        held = emit_events(db, 20, "held", per_transaction=5)  # committed while no XADD can succeed
        emitted |= held
        deadline = time.monotonic() + 10
        while not sink.in_flight:  # the relay is inside publish: its XADDs wait on the paused server
            assert time.monotonic() < deadline, "the relay never tried to publish while Redis was paused"
            time.sleep(0.01)
        time.sleep(0.2)
        with sink.lock:
            blocked = {i for ids in sink.in_flight.values() for i in ids}
        assert blocked, "no publish in flight at the crash"
        old_entries = entries_of(observer, stream)
        unpublished_at_restart = unpublished(db)
        accepted_before = set(sink.accepted)
        # Nothing is marked while its XADD has not succeeded: the blocked batch and the held events.
        assert blocked <= unpublished_at_restart, "events marked published while their XADD was blocked"
        assert set(held) <= unpublished_at_restart, "events marked published while every XADD was blocked"
        assert not (accepted_before & (set(held) | blocked))
        assert not (set(ids_in(old_entries)) & blocked)  # the paused server really did not run them
        server.restart()
        assert thread.is_alive(), f"the relay thread died at the restart: {died!r}"

        after = emit_events(db, 40, "after", per_transaction=4)
        emitted |= after
        deadline = time.monotonic() + 60
        while unpublished(db):
            assert thread.is_alive(), f"the relay thread died after the restart: {died!r}"
            assert time.monotonic() < deadline, f"unpublished after the restart: {sorted(unpublished(db))}"
            time.sleep(0.05)
        assert thread.is_alive()
    finally:
        with contextlib.suppress(Exception):  # a failed assertion must not leave the server paused
            observer.execute_command("CLIENT", "UNPAUSE")
        stop.set()
        thread.join(timeout=20)
        client.close()
    assert not thread.is_alive()
    assert died == []
    new_entries = entries_of(observer, stream)
    observer.delete(stream)
    observer.close()

    old_ids, new_ids = set(ids_in(old_entries)), set(ids_in(new_entries))
    assert old_ids <= set(emitted) and new_ids <= set(emitted)
    # What the relay promises across the crash:
    assert set(after) <= new_ids, (
        f"emitted after the restart, not in the stream: {sorted(set(after) - new_ids)}"
    )
    assert set(held) | blocked <= new_ids
    # An event unpublished at the restart that the old server had not XADDed must be in the new stream
    # (one the old server had may have been accepted and marked just after: lost by Redis, not stateguard).
    missing = (unpublished_at_restart - old_ids) - new_ids
    assert missing == set(), f"unpublished at the restart and never published after: {sorted(missing)}"
    # Marked published only after an XADD that succeeded: in the old server's last content or the new one.
    marked = published(db)
    assert marked == set(emitted)
    assert marked <= sink.accepted
    never_xadded = marked - old_ids - new_ids
    assert never_xadded == set(), f"marked published but in no stream: {sorted(never_xadded)}"
    assert_exactly_once_effects(db, old_entries + new_entries, emitted)
    if not retries:
        # The blocked pipeline's connection died with the server: the sink raised, the relay went on.
        assert any("batch not published" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------
# 3. The database's reply to the relay is lost
# --------------------------------------------------------------------------


@dataclass
class Proxied:
    direct: Engine  # the test's own connections: emit, inspect, consume
    relay_engine: Engine  # the relay's, through the proxy
    proxy: FaultProxy
    name: str

    def commit_bytes(self) -> bytes:
        return COMMIT[self.name]

    def mark_commit_bytes(self, hold: str) -> bytes:
        """The request whose reply is the mark's commit: on PostgreSQL with a lease the relay runs
        the mark in autocommit (the UPDATE is its own commit); holding locks, and on MariaDB, a
        COMMIT follows it."""
        if self.name != "postgresql":
            return COMMIT["mariadb"]
        return MARK_BYTES if hold == "lease" else COMMIT["postgresql"]

    def claim_commit_bytes(self) -> bytes:
        """Likewise for the claim: PostgreSQL's one-statement claim, MariaDB's COMMIT after it."""
        return PG_CLAIM_BYTES if self.name == "postgresql" else COMMIT["mariadb"]


@pytest.fixture
def proxied(backend: Backend) -> Iterator[Proxied]:
    direct = backend.create(FaultBase.metadata)
    drop_tables(direct)
    create_tables(direct)
    with proxied_engine(backend.url) as (engine, proxy):
        with engine.connect() as conn:  # first connect (dialect initialisation) before any cut
            conn.execute(text("SELECT 1"))
        yield Proxied(direct, engine, proxy, backend.name)
    drop_tables(direct)


@pytest.mark.lost_reply
@pytest.mark.parametrize("hold", ["lease", "locks"])
@pytest.mark.parametrize("then", ["same-relay", "other-relay"])
@pytest.mark.parametrize("fault", ["mark-reply-lost", "mark-connection-lost"])
@pytest.mark.parametrize("backend", backends_with("tcp_server"), indirect=True)
def test_lost_mark_leaves_nothing_unpublished_and_applies_each_event_once(
    proxied: Proxied, redis_client: Any, stream: str, fault: str, then: str, hold: str
) -> None:
    """The batch was XADDed, then the mark's commit reply was lost (it applied) or the connection
    died before the mark was sent (it did not): the relay's later cycles, or another relay's (after
    the 1 s lease; at once when the relay held row locks, rolled back with its connection), leave
    everything published, and a consume_once consumer applies each event once."""
    p = proxied
    if hold == "locks" and p.name != "postgresql":
        pytest.skip("hold='locks' is PostgreSQL's")
    emitted = emit_events(p.direct, 6, "mark", per_transaction=2)
    armed = threading.Event()

    def fault_after_xadd(events: Sequence[OutboxEvent]) -> None:
        if armed.is_set():
            return
        armed.set()
        if fault == "mark-reply-lost":
            p.proxy.cut_after_next_request(p.mark_commit_bytes(hold))
        else:
            assert p.proxy.cut_all() >= 1  # the relay's pooled connection dies before the mark

    sink = RecordingSink(RedisStreamSink(redis_client, stream=stream), after_publish=fault_after_xadd)
    lease = timedelta(seconds=1)
    relay = Relay(p.relay_engine, sink, lease=lease, hold=hold)
    started = time.monotonic()
    with pytest.raises(DBAPIError):
        relay.run_once()
    assert sink.accepted == set(emitted)
    if then == "other-relay":
        other = Relay(p.direct, sink, lease=lease, hold=hold)
        if fault == "mark-connection-lost" and hold == "lease" and time.monotonic() - started < 0.5:
            assert other.run_once() == 0  # the dead relay's lease still holds the batch
        relay = other
    assert ids_in(entries_of(redis_client, stream)) == Counter(dict.fromkeys(emitted, 1))
    if fault == "mark-reply-lost":
        assert p.proxy.wait_cut()
        assert p.proxy.cuts == 1
        # The server answered the mark's commit: the events are published although the relay never heard.
        assert published(p.direct) == set(emitted)
    else:
        assert p.proxy.cuts == 0
        assert unpublished(p.direct) == set(emitted)  # nothing of the mark reached the server

    drain(relay, p.direct)
    assert unpublished(p.direct) == set()
    assert published(p.direct) <= sink.accepted
    entries = entries_of(redis_client, stream)
    counts = ids_in(entries)
    assert set(counts) == set(emitted)
    if fault == "mark-connection-lost":
        # The lease ended (or the locks went with the connection) and the batch was published
        # again: at least once, seen as duplicates.
        assert all(counts[i] >= 2 for i in emitted)
        rows = outbox_rows(p.direct)
        # A lease counts each claim; held locks count the publish their transaction committed.
        assert all(rows[i].attempts >= (2 if hold == "lease" else 1) for i in emitted)
    assert_exactly_once_effects(p.direct, entries, emitted)


@pytest.mark.lost_reply
@pytest.mark.parametrize("backend", backends_with("tcp_server"), indirect=True)
def test_lost_claim_reply_leaves_the_events_to_a_later_cycle_after_the_lease(
    proxied: Proxied, redis_client: Any, stream: str
) -> None:
    """The claim committed on the server but its reply was lost: the relay holds nothing, the events
    carry its lease; a later cycle (the lease is 1 s) claims, publishes and marks them."""
    p = proxied
    emitted = emit_events(p.direct, 5, "claim", per_transaction=5)
    sink = RecordingSink(RedisStreamSink(redis_client, stream=stream))
    relay = Relay(p.relay_engine, sink, lease=timedelta(seconds=1), hold="lease")
    p.proxy.cut_after_next_request(p.claim_commit_bytes())
    with pytest.raises(DBAPIError):
        relay.run_once()
    assert p.proxy.wait_cut()
    assert p.proxy.cuts == 1
    assert sink.calls == 0  # nothing was handed to the sink
    rows = outbox_rows(p.direct)
    # The claim applied: each event leased to a relay that does not know it, none published.
    assert all(r.published_ms is None and r.claimed_until_ms is not None for r in rows.values())
    assert all(r.attempts == 1 for r in rows.values())
    assert entries_of(redis_client, stream) == []

    drain(relay, p.direct)
    assert unpublished(p.direct) == set()
    assert published(p.direct) <= sink.accepted
    entries = entries_of(redis_client, stream)
    assert set(ids_in(entries)) == set(emitted)
    assert all(r.attempts >= 2 for r in outbox_rows(p.direct).values())
    assert_exactly_once_effects(p.direct, entries, emitted)


@pytest.mark.restart
@pytest.mark.parametrize("backend", backends_with("tcp_server"), indirect=True)
def test_relay_run_survives_database_connections_dying_under_it(
    proxied: Proxied, redis_client: Any, stream: str
) -> None:
    """Relay.run() in a thread through the proxy while every database connection is cut over and over
    (and one mark's reply is lost): the thread keeps running and everything ends up published,
    each event applied once by the consumer."""
    p = proxied
    sink = RecordingSink(RedisStreamSink(redis_client, stream=stream))
    relay = Relay(p.relay_engine, sink, batch=4, lease=timedelta(seconds=1))
    stop = threading.Event()
    died: list[BaseException] = []

    def run() -> None:
        try:
            relay.run(stop, idle_sleep=0.02)
        except BaseException as error:
            died.append(error)
            raise

    thread = threading.Thread(target=run, name="relay-under-db-cuts", daemon=True)
    thread.start()
    emitted: dict[int, Emitted] = {}
    try:
        p.proxy.cut_after_next_request(p.mark_commit_bytes(relay.hold))
        for round_ in range(8):
            emitted |= emit_events(p.direct, 10, f"cuts{round_}", per_transaction=2)
            time.sleep(0.05)
            p.proxy.cut_all()
            assert thread.is_alive(), f"the relay thread died: {died!r}"
        deadline = time.monotonic() + 60
        while unpublished(p.direct):
            assert thread.is_alive(), f"the relay thread died: {died!r}"
            assert time.monotonic() < deadline, f"still unpublished: {sorted(unpublished(p.direct))}"
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join(timeout=20)
    assert not thread.is_alive()
    assert died == []
    assert published(p.direct) == set(emitted)
    assert published(p.direct) <= sink.accepted
    entries = entries_of(redis_client, stream)
    assert set(ids_in(entries)) == set(emitted)
    assert_exactly_once_effects(p.direct, entries, emitted)


@pytest.mark.lost_reply
@pytest.mark.parametrize("fault", ["release-reply-lost", "release-connection-lost"])
@pytest.mark.parametrize("backend", backends_with("tcp_server"), indirect=True)
def test_sink_error_whose_release_is_lost_is_published_again_never_marked_early(
    proxied: Proxied, redis_client: Any, stream: str, fault: str
) -> None:
    """The sink XADDs the batch and then reports failure (a broker that did not acknowledge); the
    relay's release of the claim loses its reply (it applied: free at once) or its connection (it
    did not: free after the 1 s lease).  Nothing is marked on the strength of the failed publish,
    run_once raises the sink's error (not the release's), and later cycles publish everything."""
    p = proxied
    emitted = emit_events(p.direct, 6, "release", per_transaction=3)
    real = RedisStreamSink(redis_client, stream=stream)
    failures: list[int] = []

    class Unacknowledged(Exception):
        pass

    refusing = [True]  # through the first run_once: the relay's parts of the batch are refused too

    class FlakySink:
        def publish(self, events: Sequence[OutboxEvent]) -> Any:
            if failures and refusing[0]:
                raise Unacknowledged("the broker is still not acknowledging")
            result = real.publish(events)
            if not failures:
                failures.append(len(events))
                if fault == "release-reply-lost":
                    # On PostgreSQL the release is one autocommit UPDATE (the only one that SETs
                    # only claimed_until_ms, to a parameter); on MariaDB its COMMIT is the next COMMIT.
                    p.proxy.cut_after_next_request(
                        b"SET claimed_until_ms=$1" if p.name == "postgresql" else COMMIT["mariadb"]
                    )
                else:
                    assert p.proxy.cut_all() >= 1
                raise Unacknowledged("the broker did not acknowledge the batch")
            return result

    sink = RecordingSink(FlakySink())  # type: ignore[arg-type]
    relay = Relay(p.relay_engine, sink, lease=timedelta(seconds=1), hold="lease")
    with pytest.raises(Unacknowledged):
        relay.run_once()
    refusing[0] = False
    rows = outbox_rows(p.direct)
    assert all(r.published_ms is None for r in rows.values()), "marked although the sink raised"
    assert sink.accepted == set()
    if fault == "release-reply-lost":
        assert p.proxy.wait_cut()
        assert p.proxy.cuts == 1
        assert all(r.claimed_until_ms is None for r in rows.values())  # the release applied
    else:
        assert p.proxy.cuts == 0
        assert all(r.claimed_until_ms is not None for r in rows.values())  # still leased
    drain(relay, p.direct)
    assert published(p.direct) == set(emitted)
    assert published(p.direct) <= sink.accepted
    entries = entries_of(redis_client, stream)
    counts = ids_in(entries)
    assert counts == Counter(dict.fromkeys(emitted, 2))  # the failed batch's XADDs and the real publish
    assert_exactly_once_effects(p.direct, entries, emitted)
