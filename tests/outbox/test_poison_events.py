"""Events a sink refuses: they hold back only their own key, are parked dead after max_attempts
refusals, show as stuck in stateguard inspect, and are published once requeued."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from stateguard import OutboxEvent, Relay, emit
from stateguard.tables import outbox

from ..conftest import Backend

pytestmark = pytest.mark.hostile


def _emit(engine: Engine, key: str | None, n: int = 0) -> int:
    with Session(engine) as session, session.begin():
        return emit(session, "t", {"n": n}, key=key)


def _row(engine: Engine, event_id: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(select(outbox).where(outbox.c.id == event_id)).one()


class Refusing:
    """A sink that refuses (raises for) every batch holding a refused id, and records what it took."""

    def __init__(self, refused: set[int]) -> None:
        self.refused = refused
        self.taken: list[int] = []
        self.lock = threading.Lock()

    def publish(self, events: Sequence[OutboxEvent]) -> None:
        bad = [e.id for e in events if e.id in self.refused]
        if bad:
            raise RuntimeError(f"the broker refuses events {bad}")
        with self.lock:
            self.taken.extend(e.id for e in events)


def _rounds(relay: Relay, n: int) -> None:
    for _ in range(n):
        with contextlib.suppress(RuntimeError):
            relay.run_once()


def test_one_refused_event_does_not_hold_back_other_keys(backend: Backend, engine: Engine) -> None:
    """The oldest event is always refused; the events of 30 other keys go in the first round."""
    poison = _emit(engine, "bad")
    others = [_emit(engine, f"k{n}", n) for n in range(30)]
    sink = Refusing({poison})
    _rounds(Relay(engine, sink), 1)
    assert sorted(sink.taken) == others
    assert _row(engine, poison).published_ms is None


def test_two_relays_in_threads_publish_around_refused_events(backend: Backend, engine: Engine) -> None:
    """Two running relays and three refused events among 60: the 57 others are published within seconds."""
    ids = [_emit(engine, f"k{n % 20}" if n % 3 else None, n) for n in range(60)]
    refused = {ids[0], ids[1], ids[31]}
    sink = Refusing(refused)
    relays = [Relay(engine, sink, batch=16) for _ in range(2)]
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


def test_a_refused_event_holds_back_only_its_key_until_it_is_parked_dead(
    backend: Backend, engine: Engine
) -> None:
    """While refused its key's next event waits; after max_attempts refusals it is dead and the next goes."""
    from stateguard.tooling.inspection import inspect_database

    poison = _emit(engine, "bad")
    after = _emit(engine, "bad", 1)
    sink = Refusing({poison})
    relay = Relay(engine, sink, max_attempts=3, retry_delay=timedelta(milliseconds=1))
    for _ in range(200):
        if _row(engine, poison).dead_ms is not None:
            break
        assert after not in sink.taken, "the key's later event went before its refused one was dead"
        _rounds(relay, 1)
        time.sleep(0.005)
    row = _row(engine, poison)
    assert row.dead_ms is not None and row.refusals == 3 and row.published_ms is None
    assert row.last_error.startswith("RuntimeError: the broker refuses events")
    _rounds(relay, 2)
    assert sink.taken == [after]
    with engine.connect() as conn:
        report = inspect_database(conn)
    assert report.outbox is not None and report.outbox["dead"] == 1
    assert [e["id"] for e in report.outbox["dead_events"]] == [poison]
    assert any("dead" in s for s in report.stuck)


def test_requeue_publishes_a_dead_event_once_the_sink_accepts_it(backend: Backend, engine: Engine) -> None:
    """requeue_dead() makes a dead event claimable again and it is published once; live ones are untouched."""
    from stateguard import requeue_dead

    poison = _emit(engine, "bad")
    sink = Refusing({poison})
    relay = Relay(engine, sink, max_attempts=2, retry_delay=timedelta(milliseconds=1))
    for _ in range(200):
        _rounds(relay, 1)
        if _row(engine, poison).dead_ms is not None:
            break
        time.sleep(0.005)
    assert _row(engine, poison).dead_ms is not None
    assert relay.run_once() == 0, "a dead event is never claimed"
    sink.refused.clear()
    assert requeue_dead(engine, ids=[poison + 1000]) == 0
    assert requeue_dead(engine, key="bad") == 1
    assert requeue_dead(engine) == 0
    row = _row(engine, poison)
    assert row.dead_ms is None and row.refusals == 0
    assert relay.run_once() == 1 and relay.run_once() == 0
    assert sink.taken == [poison]


def test_stateguard_outbox_requeue_requeues_dead_events(backend: Backend, engine: Engine) -> None:
    """`stateguard outbox requeue --db URL` gives every dead event back and says how many."""
    import io

    from stateguard.tooling.cli import main

    poison = _emit(engine, None)
    relay = Relay(engine, Refusing({poison}), max_attempts=1)
    _rounds(relay, 1)
    assert _row(engine, poison).dead_ms is not None
    out, err = io.StringIO(), io.StringIO()
    from contextlib import redirect_stderr, redirect_stdout

    with redirect_stdout(out), redirect_stderr(err):
        assert main(["outbox", "requeue", "--db", backend.url]) == 0
    assert "1 dead outbox event requeued" in out.getvalue()
    assert _row(engine, poison).dead_ms is None


def test_strict_key_order_holds_a_dead_events_later_events(backend: Backend, engine: Engine) -> None:
    """key_order="strict": a dead event's later events wait until it is requeued and published first."""
    from stateguard import requeue_dead

    poison = _emit(engine, "bad")
    after = _emit(engine, "bad", 1)
    other = _emit(engine, "good", 2)
    sink = Refusing({poison})
    relay = Relay(engine, sink, max_attempts=1, key_order="strict")
    _rounds(relay, 3)
    assert _row(engine, poison).dead_ms is not None
    assert sink.taken == [other]
    sink.refused.clear()
    assert requeue_dead(engine) == 1
    _rounds(relay, 3)
    assert sink.taken == [other, poison, after]


def test_a_sink_naming_its_refused_events_refuses_only_those(backend: Backend, engine: Engine) -> None:
    """An error with event_ids (as PublishFailed has) refuses those events; the rest of the batch goes."""
    ids = [_emit(engine, f"k{n}", n) for n in range(5)]

    class NotConfirmed(Exception):
        def __init__(self, event_ids: tuple[int, ...]) -> None:
            super().__init__("not confirmed")
            self.event_ids = event_ids

    calls: list[list[int]] = []

    class Naming:
        def publish(self, events: Sequence[OutboxEvent]) -> None:
            calls.append([e.id for e in events])
            if ids[2] in calls[-1]:
                raise NotConfirmed((ids[2],))

    relay = Relay(engine, Naming())
    assert relay.run_once() == 4
    assert calls == [ids]
    assert _row(engine, ids[2]).published_ms is None and _row(engine, ids[2]).refusals == 1
    assert all(_row(engine, i).published_ms is not None for i in ids if i != ids[2])


def test_a_sink_that_is_down_counts_one_refusal_a_round(backend: Backend, engine: Engine) -> None:
    """A sink refusing everything: the round raises, at most one event's refusal is counted, all are free."""
    ids = [_emit(engine, f"k{n}", n) for n in range(8)]
    calls: list[int] = []

    class Down:
        def publish(self, events: Sequence[OutboxEvent]) -> None:
            calls.append(len(events))
            raise ConnectionError("broker down")

    relay = Relay(engine, Down())
    with pytest.raises(ConnectionError):
        relay.run_once()
    rows = [_row(engine, i) for i in ids]
    assert sum(r.refusals for r in rows) == 1 and rows[0].refusals == 1
    assert all(r.claimed_until_ms is None and r.dead_ms is None for r in rows)
    assert len(calls) <= 6, calls  # 8, 4, 2, 1, 1: it stops once two calls failed and none worked
