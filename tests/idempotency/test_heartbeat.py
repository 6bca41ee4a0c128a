"""Heartbeats racing the end of their own claim, on every SQL backend.

A heartbeat that finds the claim completed, failed or released by its own
owner has not lost a lease: no ``lease_lost`` event, no LeaseLost, and a
released key is not leased again.  The race is made with a barrier and many
iterations: a heartbeat thread against ``complete()``/``release()``.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from stateguard import InvalidArgument, LeaseLost, idempotent, on_idempotency_event
from stateguard.tables import idempotency_keys

ROUNDS = 40


@pytest.fixture
def events() -> Iterator[Counter[str]]:
    """Count idempotency events by kind while the test runs."""
    counts: Counter[str] = Counter()
    remove = on_idempotency_event(lambda e: counts.update([e.kind]))
    yield counts
    remove()


def _race(engine: Engine, key: str, finish: str) -> list[BaseException]:
    """Claim ``key`` (separate mode), heartbeat from a thread while the owner finishes; its errors."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(2, timeout=30)
    with Session(engine) as session:
        with idempotent(session, scope="race", key=key, mode="separate", lease=timedelta(seconds=30)) as call:

            def beat() -> None:
                barrier.wait()
                try:
                    for _ in range(3):
                        call.heartbeat()
                except LeaseLost as error:
                    errors.append(error)
                except InvalidArgument:
                    pass  # the finish came first and closed the call: heartbeat() refuses, as it should

            thread = threading.Thread(target=beat)
            thread.start()
            barrier.wait()
            if finish == "complete":
                call.complete({"key": key})
            else:
                call.release("retry later")
            thread.join(30)
    return errors


@pytest.mark.lost_reply
@pytest.mark.parametrize("finish", ["complete", "release"])
def test_a_heartbeat_racing_its_own_finish_is_not_a_lost_lease(
    engine: Engine, events: Counter[str], finish: str
) -> None:
    """Many rounds of heartbeat vs complete()/release(): never LeaseLost, never a lease_lost event."""
    errors = [error for i in range(ROUNDS) for error in _race(engine, f"k{i}", finish)]
    assert errors == [] and events["lease_lost"] == 0
    assert events["completed" if finish == "complete" else "released"] == ROUNDS
    with engine.connect() as conn:
        rows = conn.execute(select(idempotency_keys.c.status, idempotency_keys.c.locked_until_ms)).all()
    if finish == "complete":
        assert {row.status for row in rows} == {"completed"}
    else:
        # A released key is free at once: no racing heartbeat leased it again.
        assert {(row.status, row.locked_until_ms) for row in rows} == {("in_progress", 0)}


@pytest.mark.lost_reply
def test_the_background_heartbeat_racing_complete_is_not_a_lost_lease(
    engine: Engine, events: Counter[str]
) -> None:
    """With heartbeat_every=1 ms, completing many claims emits no lease_lost event."""
    for i in range(ROUNDS):
        with Session(engine) as session:
            with idempotent(
                session,
                scope="race",
                key=f"bg{i}",
                mode="separate",
                lease=timedelta(seconds=30),
                heartbeat_every=timedelta(milliseconds=1),
            ) as call:
                threading.Event().wait(0.003)
                call.complete(i)
    assert events["lease_lost"] == 0 and events["completed"] == ROUNDS
