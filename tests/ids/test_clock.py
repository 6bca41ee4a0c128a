"""Snowflake ids and the host's clock: a clock stepping back mid-life never repeats or decreases an id,
a holder hours behind still loses its lease on time (leases are judged on the database's clock), one
ahead or a dead process with a fast clock hands over without repeated ids, and a clock stepped back
then corrected does not hang ``next_id()``."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine

from stateguard import (
    Snowflake,
    WorkerLeaseLost,
)
from tests._support.snowflake_clocks import (
    WAIT,
    SkewedClock,
    _row,
    _run_thread,
    _take_over,
    _worker_engine,
)
from tests.conftest import Backend

HOUR_NS = 3600 * 1_000_000_000


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[SkewedClock]:
    c = SkewedClock()
    monkeypatch.setattr(time, "time_ns", c.time_ns)
    monkeypatch.setattr(time, "time", c.time)
    yield c
    c.release.set()


def proc_die_holding(name: str, url: str, namespace: str, skew_ms: int, count: int) -> tuple[int, list[int]]:
    """A process whose clock is ``skew_ms`` off issues ids and "dies": it never closes or renews."""
    real = time.time_ns
    time.time_ns = lambda: real() + skew_ms * 1_000_000  # type: ignore[assignment]
    engine = _worker_engine(name, url)
    try:
        ids = Snowflake(engine, namespace=namespace, lease=timedelta(seconds=1), heartbeat=False)
        return ids.worker_id, [ids.next_id() for _ in range(count)]
    finally:
        time.time_ns = real  # type: ignore[assignment]
        engine.dispose()


# --------------------------------------------------------------------------
# clocks
# --------------------------------------------------------------------------


@pytest.mark.clock
def test_clock_stepping_back_mid_life_never_repeats_or_decreases(engine: Engine, clock: SkewedClock) -> None:
    """The application clock steps back 300 ms twice while ids are issued: still strictly increasing."""
    with Snowflake(engine, namespace="stepback") as ids:
        issued = [ids.next_id() for _ in range(2000)]
        clock.offset_ns = -300_000_000
        started = time.monotonic()
        issued += [ids.next_id() for _ in range(2000)]
        assert time.monotonic() - started >= 0.25  # it waited rather than issue smaller ids
        clock.offset_ns = -600_000_000
        issued += [ids.next_id() for _ in range(2000)]
    assert all(a < b for a, b in itertools.pairwise(issued))


@pytest.mark.clock
def test_a_holder_with_its_clock_hours_behind_still_loses_its_lease_on_time(
    engine: Engine, clock: SkewedClock
) -> None:
    """The app clock jumps 3 h back after the claim: the lease still expires on the database's clock."""
    old = Snowflake(engine, namespace="behind", lease=timedelta(seconds=1), heartbeat=False)
    old.next_id()
    clock.offset_ns = -3 * HOUR_NS
    new = _take_over(engine, "behind", old.worker_id)
    with pytest.raises(WorkerLeaseLost) as lost:
        old.next_id()
    assert lost.value.worker_id == old.worker_id and lost.value.namespace == "behind"
    old.close()
    assert _row(engine, "behind", old.worker_id).owner is not None  # the new holder's lease stands
    new.close()


@pytest.mark.clock
def test_a_holder_with_its_clock_ahead_hands_over_without_repeating_ids(
    engine: Engine, clock: SkewedClock
) -> None:
    """A host 1.5 s ahead issues ids and closes; a host on time takes the worker id: its ids come after."""
    clock.offset_ns = 1_500_000_000
    ahead = Snowflake(engine, namespace="ahead", heartbeat=False)
    ahead_ids = [ahead.next_id() for _ in range(500)]
    ahead.close()
    clock.offset_ns = 0
    with Snowflake(engine, namespace="ahead", heartbeat=False) as on_time:
        assert on_time.worker_id == ahead.worker_id
        mine = [on_time.next_id() for _ in range(500)]
    assert min(mine) > max(ahead_ids)


@pytest.mark.clock
@pytest.mark.restart
def test_a_dead_process_with_a_fast_clock_hands_over_without_repeating_ids(
    backend: Backend, engine: Engine, procs: tuple[Any, ProcessPoolExecutor]
) -> None:
    """A process 1.5 s ahead dies holding worker id 0; this process takes it over after expiry."""
    _, pool = procs
    worker, dead_ids = pool.submit(proc_die_holding, backend.name, backend.url, "dead", 1500, 2000).result(
        timeout=WAIT
    )
    assert worker == 0 and len(set(dead_ids)) == 2000
    taker = _take_over(engine, "dead", worker)
    mine = [taker.next_id() for _ in range(2000)]
    taker.close()
    assert min(mine) > max(dead_ids)
    assert not set(mine) & set(dead_ids)


# README: "When the clock steps back it waits rather than issue a smaller id."  A clock that steps
# back 3 h and is corrected a moment later (NTP) must not leave next_id() asleep for the full 3 h:
# it looks at the clock again at least every 50 ms while it waits.
@pytest.mark.clock
def test_a_clock_stepped_back_hours_then_corrected_does_not_hang_next_id(
    engine: Engine, clock: SkewedClock
) -> None:
    ids = Snowflake(engine, namespace="ntp", heartbeat=False)
    before = ids.next_id()
    clock.offset_ns = -3 * HOUR_NS
    seen_back = threading.Event()
    real_time_ns = clock.time_ns

    def watching() -> int:
        value = real_time_ns()
        if clock.offset_ns < 0:
            seen_back.set()
        return value

    clock.time_ns = watching  # type: ignore[method-assign]
    time.time_ns = watching  # type: ignore[assignment]  # restored by the monkeypatch fixture
    t, out = _run_thread(ids.next_id)
    assert seen_back.wait(WAIT)  # next_id has read the stepped-back clock
    clock.offset_ns = 0  # NTP corrects the clock
    t.join(5)
    finished = not t.is_alive()
    if finished:
        ids.close()
    assert finished, "next_id() still asleep 5 s after the clock was corrected"
    assert out["result"] > before
