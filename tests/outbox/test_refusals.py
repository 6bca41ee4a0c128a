"""What the relay counts as a refusal: an event the sink refuses holds back only its own key and is
counted; a sink that is down (connection errors, a batch it did not confirm, timeouts) has no event's
refusal counted, however many rounds it lasts."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from sqlalchemy import Engine

from stateguard import OutboxEvent, PublishFailed, RedisStreamSink, Relay, create_tables, drop_tables
from tests._support.redis_server import RedisServer

from ..conftest import Backend
from ._events import Refusing, emit_one, event_row, event_rows


def _rounds(relay: Relay, n: int) -> None:
    for _ in range(n):
        with contextlib.suppress(RuntimeError):
            relay.run_once()


def test_one_refused_event_does_not_hold_back_other_keys(backend: Backend, engine: Engine, hold: str) -> None:
    """The oldest event is always refused; the events of 30 other keys go in the first round."""
    poison = emit_one(engine, "t", {"n": 0}, key="bad")
    others = [emit_one(engine, "t", {"n": n}, key=f"k{n}") for n in range(30)]
    sink = Refusing({poison})
    _rounds(Relay(engine, sink, hold=hold), 1)
    assert sorted(sink.taken) == others
    assert event_row(engine, poison).published_ms is None


def test_two_relays_in_threads_publish_around_refused_events(
    backend: Backend, engine: Engine, hold: str
) -> None:
    """Two running relays and three refused events among 60: the 57 others are published within seconds."""
    ids = [emit_one(engine, "t", {"n": n}, key=f"k{n % 20}" if n % 3 else None) for n in range(60)]
    refused = {ids[0], ids[1], ids[31]}
    sink = Refusing(refused)
    relays = [Relay(engine, sink, batch=16, hold=hold) for _ in range(2)]
    stop = threading.Event()
    threads = [threading.Thread(target=r.run, args=(stop,), kwargs={"idle_sleep": 0.01}) for r in relays]
    for t in threads:
        t.start()
    keys_blocked = {f"k{n % 20}" for n in (0, 1, 31) if n % 3}
    wanted = {
        i for n, i in enumerate(ids) if i not in refused and not (n % 3 and f"k{n % 20}" in keys_blocked)
    }
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not wanted <= set(sink.taken):
            time.sleep(0.02)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert wanted <= set(sink.taken)
    assert not refused & set(sink.taken)


def test_a_sink_naming_its_refused_events_refuses_only_those(
    backend: Backend, engine: Engine, hold: str
) -> None:
    """PublishFailed with refused_ids: those events are counted refused, the rest of the batch goes."""
    ids = [emit_one(engine, "t", {"n": n}, key=f"k{n}") for n in range(5)]
    calls: list[list[int]] = []

    class Naming:
        def publish(self, events: Sequence[OutboxEvent]) -> None:
            calls.append([e.id for e in events])
            if ids[2] in calls[-1]:
                raise PublishFailed("nacked", event_ids=(ids[2],), refused_ids=(ids[2],))

    relay = Relay(engine, Naming(), hold=hold)
    assert relay.run_once() == 4
    assert calls == [ids]
    assert event_row(engine, ids[2]).published_ms is None and event_row(engine, ids[2]).refusals == 1
    assert all(event_row(engine, i).published_ms is not None for i in ids if i != ids[2])


def test_a_refusal_named_mid_batch_sends_the_unsent_rest_in_the_same_round(
    backend: Backend, engine: Engine, hold: str
) -> None:
    """A nack of the 2nd event with the rest unsent (as RabbitMQSink reports it): the rest goes at once."""
    ids = [emit_one(engine, "t", {"n": n}, key=f"k{n}") for n in range(5)]
    calls: list[list[int]] = []

    class StopsAtTheNack:
        def publish(self, events: Sequence[OutboxEvent]) -> None:
            calls.append([e.id for e in events])
            sent = [e.id for e in events]
            if ids[1] in sent:
                at = sent.index(ids[1])
                raise PublishFailed("nacked", event_ids=tuple(sent[at:]), refused_ids=(ids[1],))

    assert Relay(engine, StopsAtTheNack(), hold=hold).run_once() == 4
    assert calls == [ids, ids[2:]]
    assert [event_row(engine, i).refusals for i in ids] == [0, 1, 0, 0, 0]


def test_a_batch_the_broker_did_not_confirm_counts_no_refusal(
    backend: Backend, engine: Engine, hold: str
) -> None:
    """PublishFailed naming events unconfirmed but none refused: the confirmed ones are published, the
    others are given back free at once with nothing counted, and the round ends."""
    ids = [emit_one(engine, "t", {"n": n}, key=f"k{n}") for n in range(6)]
    calls: list[list[int]] = []

    class LostConnection:
        def publish(self, events: Sequence[OutboxEvent]) -> None:
            calls.append([e.id for e in events])
            raise PublishFailed("connection lost", event_ids=tuple(e.id for e in events[3:]))

    assert Relay(engine, LostConnection(), hold=hold).run_once() == 3
    assert calls == [ids]
    rows = [event_row(engine, i) for i in ids]
    assert [r.published_ms is not None for r in rows] == [True] * 3 + [False] * 3
    assert all(r.refusals == 0 and r.claimed_until_ms is None for r in rows)


class Down:
    """A sink whose broker is down for ``calls_down`` calls (raising ``error``), then takes everything."""

    def __init__(self, error: BaseException, calls_down: int = 10**9, probe: bool | None = None) -> None:
        self.error = error
        self.left = calls_down
        self.calls: list[list[int]] = []
        self.taken: list[int] = []
        self.probes = 0
        if probe is not None:
            self.probe = self._probe_ok if probe else self._probe_down

    def publish(self, events: Sequence[OutboxEvent]) -> None:
        self.calls.append([e.id for e in events])
        if self.left > 0:
            self.left -= 1
            raise self.error
        self.taken.extend(e.id for e in events)

    def _probe_ok(self) -> None:
        self.probes += 1

    def _probe_down(self) -> None:
        self.probes += 1
        raise ConnectionRefusedError("broker down")


DOWN_ERRORS = {
    "ConnectionError": lambda: ConnectionError("broker down"),
    "TimeoutError": lambda: TimeoutError("no answer"),
    "PublishFailed": lambda: PublishFailed("cannot connect to the broker"),
    "RuntimeError": lambda: RuntimeError("broker down"),
}


@pytest.mark.restart
@pytest.mark.parametrize("error", list(DOWN_ERRORS))
def test_a_sink_down_for_many_rounds_counts_no_refusal(
    backend: Backend, engine: Engine, hold: str, error: str
) -> None:
    """40 rounds of a sink that fails every call (max_attempts=3): no event is counted or parked, each
    round ends after a handful of calls, and once the sink is back every event goes out in key order."""
    ids = [emit_one(engine, "t", {"n": n}, key=f"k{n % 3}") for n in range(12)]
    sink = Down(DOWN_ERRORS[error]())
    relay = Relay(engine, sink, batch=8, max_attempts=3, retry_delay=timedelta(milliseconds=1), hold=hold)
    for _ in range(40):
        calls = len(sink.calls)
        with pytest.raises(type(sink.error)):
            relay.run_once()
        assert len(sink.calls) - calls <= 7, sink.calls[calls:]  # 8, 4, 2, 1, 1, 1: then it stops
    rows = [event_row(engine, i) for i in ids]
    assert all(r.refusals == 0 and r.dead_ms is None and r.claimed_until_ms is None for r in rows)
    sink.left = 0
    while relay.run_once():
        pass
    assert sorted(sink.taken) == ids
    for key in range(3):
        of_key = [i for i in sink.taken if (ids.index(i) % 3) == key]
        assert of_key == sorted(of_key)


@pytest.mark.restart
@pytest.mark.parametrize("error", ["ConnectionError", "TimeoutError", "PublishFailed"])
def test_a_lone_event_while_the_sink_is_down_is_not_counted(
    backend: Backend, engine: Engine, hold: str, error: str
) -> None:
    """The only pending event, 20 rounds of an unreachable sink without probe(): never counted."""
    lone = emit_one(engine, "t", {}, key="k")
    sink = Down(DOWN_ERRORS[error]())
    relay = Relay(engine, sink, max_attempts=2, retry_delay=timedelta(milliseconds=1), hold=hold)
    _rounds_raising(relay, 20)
    assert event_row(engine, lone).refusals == 0 and event_row(engine, lone).dead_ms is None


@pytest.mark.parametrize("up", [True, False], ids=["probe-answers", "probe-fails"])
def test_a_lone_refused_event_counts_only_when_the_sinks_probe_answers(
    backend: Backend, engine: Engine, hold: str, up: bool
) -> None:
    """A lone event refused with a RuntimeError: counted (and parked at max_attempts) when probe() answers,
    never counted when probe() fails too (the sink is down)."""
    lone = emit_one(engine, "t", {}, key=None)
    sink = Down(RuntimeError("refused"), probe=up)
    relay = Relay(engine, sink, max_attempts=3, retry_delay=timedelta(milliseconds=1), hold=hold)
    for _ in range(6):
        _rounds_raising(relay, 1)
        time.sleep(0.003)
    row = event_row(engine, lone)
    assert sink.probes >= 3
    if up:
        assert row.refusals == 3 and row.dead_ms is not None
        assert row.last_error == "RuntimeError: refused"
    else:
        assert row.refusals == 0 and row.dead_ms is None


def test_an_event_that_failed_just_before_the_sink_came_back_is_not_counted(
    backend: Backend, engine: Engine, hold: str
) -> None:
    """The sink is down for the first 4 calls of a round: the event it failed alone is tried again once
    the sink took others, and the whole batch is published in that round with nothing counted."""
    ids = [emit_one(engine, "t", {"n": n}, key=f"k{n}") for n in range(8)]
    sink = Down(ConnectionError("broker down"), calls_down=4)
    assert Relay(engine, sink, hold=hold).run_once() == 8
    assert sorted(sink.taken) == ids
    assert sink.calls[:4] == [ids, ids[:4], ids[:2], ids[:1]]
    assert all(event_row(engine, i).refusals == 0 for i in ids)


def test_an_event_refused_while_others_go_is_counted_once_a_round(
    backend: Backend, engine: Engine, hold: str
) -> None:
    """A poison event among good ones: refused alone, refused again after the sink took others: one
    refusal counted per round, its retry delay kept."""
    ids = [emit_one(engine, "t", {"n": n}, key=f"k{n}") for n in range(6)]
    sink = Refusing({ids[0]})
    relay = Relay(engine, sink, retry_delay=timedelta(seconds=30), hold=hold)
    assert relay.run_once() == 5
    row = event_row(engine, ids[0])
    assert row.refusals == 1 and row.claimed_until_ms is not None and row.published_ms is None
    assert sink.calls.count([ids[0]]) == 2
    assert relay.run_once() == 0  # its retry delay holds it


def _rounds_raising(relay: Relay, n: int) -> None:
    for _ in range(n):
        with contextlib.suppress(Exception):
            relay.run_once()


def _stream_ids(client: Any, stream: str) -> list[int]:
    return [int(fields[b"id"]) for _, fields in client.xrange(stream)]


@pytest.mark.restart
@pytest.mark.parametrize("hold", ["lease", "locks"])
def test_a_redis_server_stopped_for_many_rounds_parks_no_event(
    pg: Backend, private_redis: RedisServer, hold: str
) -> None:
    """A private redis-server SIGKILLed by pid under a RedisStreamSink for 30 rounds with 24 pending events,
    then for 15 rounds with one: no refusal is counted, nothing is parked (max_attempts=3), and after the
    restart every event is in the stream once, each key's in id order."""
    engine = pg.engine
    drop_tables(engine)
    create_tables(engine)
    # No client retries (each would wait out redis-py's backoff): every call meets the outage at once.
    client = redis.Redis(host=private_redis.host, port=private_redis.port, retry=Retry(NoBackoff(), 0))
    stream = f"sg-test-outage-{uuid.uuid4().hex}"
    relay = Relay(
        engine,
        RedisStreamSink(client, stream=stream),
        batch=8,
        max_attempts=3,
        retry_delay=timedelta(milliseconds=1),
        hold=hold,
    )
    try:
        before = [emit_one(engine, "t", {"n": n}, key=f"k{n % 3}") for n in range(4)]
        while relay.run_once():
            pass
        assert _stream_ids(client, stream) == before
        private_redis.kill()
        during = [emit_one(engine, "t", {"n": n}, key=f"k{n % 3}" if n % 4 else None) for n in range(24)]
        _rounds_raising(relay, 30)
        private_redis.start()
        while relay.run_once():
            pass
        private_redis.kill()
        lone = emit_one(engine, "t", {"n": 99}, key="k0")
        _rounds_raising(relay, 15)
        private_redis.start()
        while relay.run_once():
            pass
        rows = event_rows(engine)
        assert [(r.id, r.refusals, r.dead_ms) for r in rows if r.refusals or r.dead_ms] == []
        assert all(r.published_ms is not None for r in rows)
        assert _stream_ids(client, stream) == [lone], "the second restart's stream holds the lone event"
    finally:
        client.close()
        drop_tables(engine)
    assert len(during) == 24
