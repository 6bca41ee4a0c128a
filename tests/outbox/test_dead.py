"""Dead events: an event refused max_attempts times is parked (never claimed, never deleted, listed as
stuck by stateguard inspect), given back by requeue_dead() and `stateguard outbox requeue`; strict
key order keeps a dead event's later events waiting; purge_published deletes only old published ones."""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta

import pytest
from sqlalchemy import Engine, update

from stateguard import InvalidArgument, Relay, purge_published
from stateguard.tables import outbox

from ..conftest import Backend
from ._events import Recorder, Refusing, emit_one, event_row, event_rows


def _rounds(relay: Relay, n: int) -> None:
    for _ in range(n):
        with contextlib.suppress(RuntimeError):
            relay.run_once()


def test_a_refused_event_holds_back_only_its_key_until_it_is_parked_dead(
    backend: Backend, engine: Engine, hold: str
) -> None:
    """While refused its key's next event waits; after max_attempts refusals it is dead and the next goes."""
    from stateguard.tooling.inspection import inspect_database

    poison = emit_one(engine, "t", {"n": 0}, key="bad")
    after = emit_one(engine, "t", {"n": 1}, key="bad")
    sink = Refusing({poison})
    relay = Relay(engine, sink, max_attempts=3, retry_delay=timedelta(milliseconds=1), hold=hold)
    for _ in range(200):
        if event_row(engine, poison).dead_ms is not None:
            break
        assert after not in sink.taken, "the key's later event went before its refused one was dead"
        _rounds(relay, 1)
        time.sleep(0.005)
    row = event_row(engine, poison)
    assert row.dead_ms is not None and row.refusals == 3 and row.published_ms is None
    assert row.last_error.startswith("RuntimeError: the broker refuses events")
    _rounds(relay, 2)
    assert sink.taken == [after]
    with engine.connect() as conn:
        report = inspect_database(conn)
    assert report.outbox is not None and report.outbox["dead"] == 1
    assert [e["id"] for e in report.outbox["dead_events"]] == [poison]
    assert any("dead" in s for s in report.stuck)


def test_requeue_publishes_a_dead_event_once_the_sink_accepts_it(
    backend: Backend, engine: Engine, hold: str
) -> None:
    """requeue_dead() makes a dead event claimable again and it is published once; live ones are untouched."""
    from stateguard import requeue_dead

    poison = emit_one(engine, "t", {"n": 0}, key="bad")
    sink = Refusing({poison})
    relay = Relay(engine, sink, max_attempts=2, retry_delay=timedelta(milliseconds=1), hold=hold)
    for _ in range(200):
        _rounds(relay, 1)
        if event_row(engine, poison).dead_ms is not None:
            break
        time.sleep(0.005)
    assert event_row(engine, poison).dead_ms is not None
    assert relay.run_once() == 0, "a dead event is never claimed"
    sink.refused.clear()
    assert requeue_dead(engine, ids=[poison + 1000]) == 0
    assert requeue_dead(engine, key="bad") == 1
    assert requeue_dead(engine) == 0
    row = event_row(engine, poison)
    assert row.dead_ms is None and row.refusals == 0
    assert relay.run_once() == 1 and relay.run_once() == 0
    assert sink.taken == [poison]


def test_stateguard_outbox_requeue_requeues_dead_events(backend: Backend, engine: Engine, hold: str) -> None:
    """`stateguard outbox requeue --db URL` gives every dead event back and says how many."""
    import io

    from stateguard.tooling.cli import main

    poison = emit_one(engine, "t", {"n": 0}, key=None)
    relay = Relay(engine, Refusing({poison}), max_attempts=1, hold=hold)
    _rounds(relay, 1)
    assert event_row(engine, poison).dead_ms is not None
    out, err = io.StringIO(), io.StringIO()
    from contextlib import redirect_stderr, redirect_stdout

    with redirect_stdout(out), redirect_stderr(err):
        assert main(["outbox", "requeue", "--db", backend.url]) == 0
    assert "1 dead outbox event requeued" in out.getvalue()
    assert event_row(engine, poison).dead_ms is None


def test_strict_key_order_holds_a_dead_events_later_events(
    backend: Backend, engine: Engine, hold: str
) -> None:
    """key_order="strict": a dead event's later events wait until it is requeued and published first."""
    from stateguard import requeue_dead

    poison = emit_one(engine, "t", {"n": 0}, key="bad")
    after = emit_one(engine, "t", {"n": 1}, key="bad")
    other = emit_one(engine, "t", {"n": 2}, key="good")
    sink = Refusing({poison})
    relay = Relay(engine, sink, max_attempts=1, key_order="strict", hold=hold)
    _rounds(relay, 3)
    assert event_row(engine, poison).dead_ms is not None
    assert sink.taken == [other]
    sink.refused.clear()
    assert requeue_dead(engine) == 1
    _rounds(relay, 3)
    assert sink.taken == [other, poison, after]


def test_purge_published_deletes_only_old_published_events_in_batches(
    backend: Backend, engine: Engine, hold: str
) -> None:
    """Published events older than the retention go, in batches; unpublished and recent ones stay."""
    old = [emit_one(engine, "t", {"n": n}) for n in range(3)]
    assert Relay(engine, Recorder(), hold=hold).run_once() == 3
    with engine.begin() as conn:
        conn.execute(update(outbox).values(published_ms=outbox.c.published_ms - 3_600_000))
    recent = emit_one(engine, "t", {})
    assert Relay(engine, Recorder(), hold=hold).run_once() == 1
    unpublished = emit_one(engine, "t", {})
    assert purge_published(engine, older_than=timedelta(minutes=30), batch=2) == 2
    assert purge_published(engine, older_than=timedelta(minutes=30), batch=2) == 1
    assert purge_published(engine, older_than=timedelta(minutes=30), batch=2) == 0
    assert [r.id for r in event_rows(engine)] == [recent, unpublished]
    assert not {r.id for r in event_rows(engine)} & set(old)
    with pytest.raises(InvalidArgument):
        purge_published(engine, older_than=timedelta(0))
