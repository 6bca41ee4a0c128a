"""Workers for tests/test_ids.py, importable by spawned processes.

Every worker makes its own engine and takes manager proxies (barriers,
events, queues) so the test can start the processes together and hold
them at the point where the race is meant to happen.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, create_engine, event

from stateguard import Snowflake, WorkerLeaseLost, new_request_id

#: A short lease, so a test can let one expire in about a second.
SHORT_LEASE = timedelta(seconds=1)
#: Longest wait for the test's signal: a failed test never leaves a worker blocked for good.
WAIT = 60


def wait_for(signal: Any) -> None:
    """Wait for a manager Event set by the test; fail after WAIT seconds."""
    if not signal.wait(WAIT):
        raise TimeoutError("the test never gave the signal")


class VirtualClock:
    """Wall-clock milliseconds plus an offset; ``sleep`` moves the offset instead of sleeping."""

    def __init__(self, offset_ms: float = 0) -> None:
        self.offset_ms = offset_ms
        self.slept_ms = 0.0

    def __call__(self) -> int:
        return int(time.time_ns() / 1_000_000 + self.offset_ms)

    def sleep(self, seconds: float) -> None:
        self.offset_ms += seconds * 1000
        self.slept_ms += seconds * 1000


def make_engine(name: str, url: str) -> Engine:
    kw: dict[str, Any] = {"pool_size": 2}
    if name == "sqlite":
        kw["connect_args"] = {"timeout": 60}
    engine = create_engine(url, **kw)
    with engine.connect():
        pass  # connect now, so the race is the statements', not the connects'
    return engine


def pause_before_first(engine: Engine, prefix: str, contains: str, barrier: Any) -> None:
    """Wait on ``barrier`` just before this engine first sends a statement matching ``prefix``/``contains``.

    All parties then send that statement at the same moment: the race happens
    in the database, with nothing mocked.
    """
    fired = False

    def hook(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        nonlocal fired
        if not fired and statement.startswith(prefix) and contains in statement:
            fired = True
            barrier.wait()

    event.listen(engine, "before_cursor_execute", hook)


def ready(barrier: Any) -> int:
    """Wait for every pool process to be up (forces the pool to spawn them all)."""
    barrier.wait()
    return os.getpid()


def request_ids(count: int, barrier: Any) -> tuple[int, list[int], int]:
    """``count`` UUIDv7 ids made after the barrier: (ms before, ids as ints, ms after)."""
    barrier.wait()
    before = time.time_ns() // 1_000_000
    made = [new_request_id().int for _ in range(count)]
    after = time.time_ns() // 1_000_000
    return before, made, after


def live_generator(
    name: str, url: str, namespace: str, count: int, first_insert: Any, live: Any, checked: Any
) -> tuple[int, list[int]]:
    """Lease a worker id (every process sends its first INSERT together), make ids, hold until all are live.

    Returns (worker id, ids in the order made); ids are made both before and
    after every generator of the test holds its lease at once.
    """
    engine = make_engine(name, url)
    try:
        pause_before_first(engine, "INSERT INTO stateguard_worker_leases", "", first_insert)
        with Snowflake(engine, namespace=namespace) as ids:
            made = [ids.next_id() for _ in range(count)]
            live.wait()  # every generator holds its lease now; the test reads the table
            checked.wait()
            made += [ids.next_id() for _ in range(count)]
            return ids.worker_id, made
    finally:
        engine.dispose()


def stalled_holder(
    name: str, url: str, namespace: str, count: int, paused: Any, resume: Any
) -> tuple[int, list[int], list[int], bool]:
    """Hold a short lease, make ids, stop renewing until ``resume`` (a stalled process), then try again.

    Returns (worker id, ids before the stall, ids after it, whether
    WorkerLeaseLost was raised); the lease is not renewed while stalled
    because the heartbeat is off and next_id() is not called.
    """
    engine = make_engine(name, url)
    try:
        ids = Snowflake(engine, namespace=namespace, lease=SHORT_LEASE, heartbeat=False)
        before = [ids.next_id() for _ in range(count)]
        paused.put(ids.worker_id)
        wait_for(resume)
        after: list[int] = []
        lost = False
        try:
            for _ in range(count):
                after.append(ids.next_id())
        except WorkerLeaseLost as error:
            lost = error.worker_id == ids.worker_id and error.namespace == namespace
        ids.close()  # must not release the worker id: it is the taker's now
        return ids.worker_id, before, after, lost
    finally:
        engine.dispose()


def taker(
    name: str,
    url: str,
    namespace: str,
    count: int,
    start: Any,
    claim_race: Any,
    taken: Any,
    resume: Any,
    done: Any,
) -> tuple[int, list[int]]:
    """After ``start``, lease a worker id; every taker sends its first claim UPDATE at the same moment.

    Makes ids, reports its worker id on ``taken``, makes more ids after
    ``resume`` (while the stalled holder wakes up), and closes after
    ``done``.  Returns (worker id, ids in order).
    """
    engine = make_engine(name, url)
    try:
        pause_before_first(engine, "UPDATE stateguard_worker_leases", "CASE", claim_race)
        start.wait()
        with Snowflake(engine, namespace=namespace) as ids:
            made = [ids.next_id() for _ in range(count)]
            taken.put(ids.worker_id)
            wait_for(resume)
            made += [ids.next_id() for _ in range(count)]
            wait_for(done)  # the test reads the worker row before anyone releases it
            return ids.worker_id, made
    finally:
        engine.dispose()


def clock_steps_back(
    name: str, url: str, namespace: str, count: int, step_back_ms: int, start: Any, live: Any
) -> tuple[int, list[int], int, float, float]:
    """Make ids, move this process's clock back ``step_back_ms``, make more ids.

    The generator's sleeps move the virtual clock forward instead of
    sleeping.  Returns (worker id, ids in order, index of the first id after
    the step, virtual milliseconds slept, real seconds the second half took).
    """
    engine = make_engine(name, url)
    clock = VirtualClock()
    try:
        start.wait()
        with Snowflake(engine, namespace=namespace, heartbeat=False, _clock=clock, _sleep=clock.sleep) as ids:
            made = [ids.next_id() for _ in range(count)]
            live.wait()  # all generators hold their worker ids: none is reused
            clock.offset_ms -= step_back_ms
            started = time.monotonic()
            made += [ids.next_id() for _ in range(count)]
            real = time.monotonic() - started
            return ids.worker_id, made, count, clock.slept_ms, real
    finally:
        engine.dispose()


def generate_with_offset(
    name: str, url: str, namespace: str, count: int, offset_ms: int, start: Any, live: Any
) -> tuple[int, list[int], float]:
    """With the clock ``offset_ms`` off, lease a worker id, make ids, hold until all are live, close.

    Returns (worker id, ids in order, virtual milliseconds slept).
    """
    engine = make_engine(name, url)
    clock = VirtualClock(offset_ms)
    try:
        start.wait()
        with Snowflake(engine, namespace=namespace, heartbeat=False, _clock=clock, _sleep=clock.sleep) as ids:
            made = [ids.next_id() for _ in range(count)]
            live.wait()
            return ids.worker_id, made, clock.slept_ms
    finally:
        engine.dispose()
