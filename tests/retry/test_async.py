"""``await retry_on_conflict(fn)`` for coroutine functions: real serialization failures and
deadlocks between two async sessions (asyncpg, aiomysql) are retried, the retry applies once,
the cap and the jittered waits hold, and other errors are not retried."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
from sqlalchemy import Table, select, update
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

import stateguard
import stateguard.retry
from stateguard import (
    DeadlockDetected,
    InvalidArgument,
    LockNotAcquired,
    Outcome,
    Result,
    SerializationConflict,
    guarded_update,
    retry_on_conflict,
    row_lock,
)
from tests._support.async_helpers import AsyncTarget, async_target
from tests._support.models import Base, Order
from tests._support.retry_conflicts import (
    Acct,
    AppError,
    Log,
    balances,
    chain,
    hold_row,
    log_tags,
    pg_fast_options,
    setup,
)
from tests.conftest import Backend, backends_with


@pytest.fixture
def pg_orders(pg: Backend) -> Iterator[AsyncTarget]:
    """The orders table on PostgreSQL, reached through asyncpg."""
    yield from _orders(pg, "asyncpg")


@pytest.fixture
def mariadb_orders(mariadb: Backend) -> Iterator[AsyncTarget]:
    """The orders table on MariaDB, reached through aiomysql."""
    yield from _orders(mariadb, "aiomysql")


@pytest.fixture
def orders(backend: Backend) -> Iterator[AsyncTarget]:
    """The orders table on ``backend``, reached through its async driver (asyncpg, aiomysql)."""
    yield from _orders(backend, "asyncpg" if backend.name == "postgresql" else "aiomysql")


def _orders(backend: Backend, driver: str) -> Iterator[AsyncTarget]:
    table = cast(Table, Order.__table__)
    Base.metadata.drop_all(backend.engine, tables=[table])
    Base.metadata.create_all(backend.engine, tables=[table])
    with backend.engine.begin() as conn:
        conn.execute(table.insert(), [{"id": 1, "status": "pending"}, {"id": 2, "status": "pending"}])
    try:
        yield async_target(driver, backend)
    finally:
        Base.metadata.drop_all(backend.engine, tables=[table])


def _run(target: AsyncTarget, body: Any, **engine_kw: Any) -> Any:
    async def main() -> Any:
        engine = target.engine(pool_size=4, max_overflow=0, **engine_kw)
        try:
            return await body(engine)
        finally:
            await engine.dispose()

    return asyncio.run(main())


async def _versions(engine: AsyncEngine) -> dict[int, tuple[str, int]]:
    async with AsyncSession(engine) as s:
        rows = await s.execute(select(Order.id, Order.status, Order.version).order_by(Order.id))
        return {row.id: (row.status, row.version) for row in rows}


# -- real conflicts --------------------------------------------------------------------------


def test_asyncpg_serialization_failure_is_retried_once(pg_orders: AsyncTarget) -> None:
    """A REPEATABLE READ unit loses to a concurrent task's commit: 40001, one retry, REPEATED, paid once."""

    async def body(engine: AsyncEngine) -> tuple[list[Any], Result, dict[int, tuple[str, int]]]:
        strict = pg_orders.engine(pool_size=2, max_overflow=0, isolation_level="REPEATABLE READ")
        snapshot_taken, rival_committed = asyncio.Event(), asyncio.Event()
        attempts: list[Any] = []

        async def rival() -> None:
            await snapshot_taken.wait()
            async with AsyncSession(engine) as s, s.begin():
                assert (await Order.flow.pay(s, 1)).applied
            rival_committed.set()

        async def unit() -> Result:
            async with AsyncSession(strict) as s, s.begin():
                await s.execute(select(Order.status).where(Order.id == 1))  # the snapshot is taken here
                if not attempts:
                    snapshot_taken.set()
                    await rival_committed.wait()
                try:
                    r = await Order.flow.pay(s, 1)
                except SerializationConflict as error:
                    attempts.append(error)
                    raise
                attempts.append(r)
                return r

        try:
            # A lambda around the coroutine function: its awaitable is detected and retried too.
            got, _ = await asyncio.gather(retry_on_conflict(lambda: unit(), backoff=0.001), rival())
        finally:
            await strict.dispose()
        return attempts, got, await _versions(engine)

    attempts, got, rows = _run(pg_orders, body)
    assert len(attempts) == 2, attempts
    error = attempts[0]
    assert isinstance(error, SerializationConflict) and not isinstance(error, DeadlockDetected)
    assert getattr(error.__cause__, "orig", None) is not None
    assert error.__cause__.orig.sqlstate == "40001"  # type: ignore[union-attr]
    assert attempts[1] is got and (got.outcome, got.state, got.version) == (Outcome.REPEATED, "paid", 1)
    assert rows[1] == ("paid", 1) and rows[2] == ("pending", 0)


@pytest.mark.clock
def test_asyncpg_serializable_write_skew_is_retried(pg_orders: AsyncTarget) -> None:
    """A write skew between two concurrent SERIALIZABLE async sessions is aborted (40001, at the write or
    by COMMIT, where asyncpg's own error surfaces outside any stateguard call) and the unit is re-run once."""

    async def body(engine: AsyncEngine) -> tuple[list[BaseException], list[Result]]:
        strict = pg_orders.engine(pool_size=2, max_overflow=0, isolation_level="SERIALIZABLE")
        read, rival_committed = asyncio.Event(), asyncio.Event()
        failures: list[BaseException] = []
        done: list[Result] = []

        async def total(s: AsyncSession) -> int:
            return sum(await s.scalars(select(Order.amount)))

        async def rival() -> None:
            await read.wait()
            async with AsyncSession(strict) as s, s.begin():
                seen = await total(s)
                assert (await guarded_update(s, Order, 2, {"amount": seen - 10}, expected_version=0)).applied
            rival_committed.set()

        async def unit() -> Result:
            try:
                async with AsyncSession(strict) as s, s.begin():
                    seen = await total(s)
                    if not failures:
                        read.set()
                        await rival_committed.wait()
                    r = await guarded_update(s, Order, 1, {"amount": seen - 10}, expected_version=0)
            except Exception as error:
                failures.append(error)
                raise
            done.append(r)
            return r

        try:
            await asyncio.gather(retry_on_conflict(unit, backoff=0.001), rival())
        finally:
            await strict.dispose()
        return failures, done

    failures, done = _run(pg_orders, body)
    assert len(failures) == 1 and len(done) == 1, failures
    failure = failures[0]
    if isinstance(failure, SerializationConflict):
        failure = failure.__cause__  # type: ignore[assignment]
    assert isinstance(failure, DBAPIError) and getattr(failure.orig, "sqlstate", None) == "40001"
    # The retry reads the rival's committed row 2 (amount -10) and applies on row 1 (version still 0).
    assert done[0].applied


def _deadlock_storm(target: AsyncTarget) -> tuple[list[BaseException], dict[str, list[Outcome]], Any]:
    """Two tasks pay rows 1 and 2 in opposite orders behind an asyncio.Barrier, each unit under retry."""

    async def body(engine: AsyncEngine) -> tuple[list[BaseException], dict[str, list[Outcome]], Any]:
        barrier = asyncio.Barrier(2)
        conflicts: list[BaseException] = []
        final: dict[str, list[Outcome]] = {}

        async def worker(name: str, first: int, second: int) -> None:
            tries = 0

            async def unit() -> list[Outcome]:
                nonlocal tries
                tries += 1
                try:
                    async with AsyncSession(engine) as s, s.begin():
                        got = [(await Order.flow.pay(s, first)).outcome]
                        if tries == 1:
                            await asyncio.wait_for(barrier.wait(), 30)
                        got.append((await Order.flow.pay(s, second)).outcome)
                        return got
                except DeadlockDetected as error:
                    conflicts.append(error)
                    raise

            final[name] = await retry_on_conflict(unit, attempts=10, backoff=0.05)

        await asyncio.wait_for(asyncio.gather(worker("a", 1, 2), worker("b", 2, 1)), 90)
        return conflicts, final, await _versions(engine)

    return _run(target, body)  # type: ignore[no-any-return]


@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_async_deadlock_victim_is_retried_and_applies_once(orders: AsyncTarget) -> None:
    """A real deadlock (PostgreSQL 40P01 / MariaDB 1213) between two async sessions: the victim is re-run,
    sees REPEATED, and each row is paid exactly once."""
    target = orders
    conflicts, final, rows = _deadlock_storm(target)
    assert len(conflicts) >= 1 and all(isinstance(c, DeadlockDetected) for c in conflicts)
    orig = conflicts[0].__cause__.orig  # type: ignore[union-attr]
    if target.name == "postgresql":
        assert orig.sqlstate == "40P01"
    else:
        assert orig.args[0] == 1213
    assert Counter(o for got in final.values() for o in got) == Counter(
        {Outcome.APPLIED: 2, Outcome.REPEATED: 2}
    )
    assert rows == {1: ("paid", 1), 2: ("paid", 1)}


def test_async_cap_gives_up_with_the_last_typed_error(pg_orders: AsyncTarget) -> None:
    """A REPEATABLE READ unit that loses a real race on every attempt (40001 each time) is called
    ``attempts`` times, then its last SerializationConflict is raised (never an endless loop), and the
    waits between attempts are asyncio.sleep within the jitter bounds (time.sleep is never called)."""
    delays: list[float] = []
    real_sleep = asyncio.sleep

    async def recording_sleep(delay: float) -> None:
        delays.append(delay)
        await real_sleep(delay)

    async def body(engine: AsyncEngine) -> tuple[list[BaseException], BaseException | None]:
        strict = pg_orders.engine(pool_size=2, max_overflow=0, isolation_level="REPEATABLE READ")
        seen: list[BaseException] = []

        async def unit() -> Result:
            async with AsyncSession(strict) as s, s.begin():
                order = await s.get_one(Order, 1)  # the snapshot is taken here
                async with AsyncSession(engine) as rival, rival.begin():
                    other = await rival.get_one(Order, 1)
                    r = await guarded_update(
                        rival, Order, other, {"note": "rival"}, expected_version=other.version
                    )
                    assert r.applied
                try:
                    return await guarded_update(
                        s, Order, order, {"note": "mine"}, expected_version=order.version
                    )
                except SerializationConflict as error:
                    seen.append(error)
                    raise

        try:
            await retry_on_conflict(unit, attempts=4, backoff=0.004, max_backoff=0.01)
        except SerializationConflict as error:
            return seen, error
        finally:
            await strict.dispose()
        return seen, None

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(asyncio, "sleep", recording_sleep)
        mp.setattr(time, "sleep", _no_blocking_sleep)
        seen, raised = _run(pg_orders, body)
    assert len(seen) == 4 and raised is seen[-1], seen
    assert raised.__cause__.orig.sqlstate == "40001"
    assert len(delays) == 3
    for attempt, delay in enumerate(delays, start=1):
        assert 0 <= delay <= min(0.01, 0.004 * 2 ** (attempt - 1)), delays


def _no_blocking_sleep(seconds: float) -> None:
    raise AssertionError(f"time.sleep({seconds}) called inside the event loop")


def test_async_non_retryable_error_is_raised_at_once(pg_orders: AsyncTarget) -> None:
    """A duplicate key (23505) from asyncpg is not a conflict: one call, the driver's IntegrityError."""

    async def body(engine: AsyncEngine) -> int:
        calls = 0

        async def unit() -> None:
            nonlocal calls
            calls += 1
            async with AsyncSession(engine) as s, s.begin():
                s.add(Order(id=1))

        with pytest.raises(IntegrityError):
            await retry_on_conflict(unit, attempts=5, backoff=0)
        return calls

    assert _run(pg_orders, body) == 1


# -- the waits, without a database -----------------------------------------------------------


def test_jitter_spreads_within_the_exponential_bounds() -> None:
    """200 async retries of a conflicting call: every wait in [0, min(max_backoff, backoff*2**(n-1))],
    and the waits are spread out (full jitter), not all at the bound."""
    delays: list[tuple[int, float]] = []

    async def main() -> None:
        for _ in range(40):
            calls = [0]

            async def unit(calls: list[int] = calls) -> None:
                calls[0] += 1
                raise SerializationConflict("conflict")

            async def record(delay: float, calls: list[int] = calls) -> None:
                delays.append((calls[0], delay))

            with pytest.raises(SerializationConflict):
                await retry_on_conflict(unit, attempts=6, backoff=0.01, max_backoff=0.05, sleep=record)
            assert calls == [6]

    asyncio.run(main())
    assert len(delays) == 40 * 5
    for attempt, delay in delays:
        assert 0 <= delay <= min(0.05, 0.01 * 2 ** (attempt - 1))
    at_cap = [d for a, d in delays if a >= 3]
    assert min(at_cap) < 0.02 < max(at_cap), "full jitter spreads the waits over the whole range"


def test_async_stale_result_is_retried_and_returned_after_the_cap() -> None:
    """A coroutine returning STALE is called again, and its last STALE result is returned at the cap."""

    async def main() -> tuple[int, Result]:
        calls = 0

        async def unit() -> Result:
            nonlocal calls
            calls += 1
            return Result(Outcome.STALE, model=Order, key=1, version=calls)

        r = await retry_on_conflict(unit, attempts=3, sleep=lambda _: None)
        return calls, r

    calls, r = asyncio.run(main())
    assert calls == 3 and r.outcome is Outcome.STALE and r.version == 3


def test_sync_form_is_unchanged() -> None:
    """The synchronous call keeps its signature, returns the value itself and sleeps with its ``sleep``."""
    params = inspect.signature(stateguard.retry.retry_on_conflict).parameters
    assert [(p.name, p.default) for p in params.values()][1:] == [
        ("attempts", 5),
        ("backoff", 0.01),
        ("max_backoff", 1.0),
        ("max_time", None),
        ("lock_not_acquired", True),
        ("sleep", time.sleep),
    ]
    waits: list[float] = []
    calls = 0

    def unit() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise DeadlockDetected("deadlock")
        return "done"

    assert retry_on_conflict(unit, sleep=waits.append) == "done"
    assert calls == 3 and len(waits) == 2
    assert not inspect.isawaitable(retry_on_conflict(lambda: 42))


@pytest.mark.hostile
def test_an_async_sleep_with_a_synchronous_unit_is_invalid_argument() -> None:
    """A coroutine-function ``sleep`` cannot be waited on by the synchronous form: a typed error
    naming the fix, after the unit ran once, with no coroutine left un-awaited."""
    calls = 0

    def unit() -> str:
        nonlocal calls
        calls += 1
        raise DeadlockDetected("deadlock")

    with pytest.raises(InvalidArgument, match=r"sleep=.*returned an awaitable, but fn is synchronous"):
        retry_on_conflict(unit, sleep=asyncio.sleep, backoff=0.001)
    assert calls == 1


# ---------------------------------------------------------------- deadlocks


# ------------------------------------------------------------------ async


def async_url(backend: Backend) -> str:
    if backend.name == "mariadb":
        return backend.url.replace("mysql+pymysql://", "mysql+aiomysql://")
    return backend.url  # psycopg 3 is async too


# On MariaDB (aiomysql) with nested >= 1, leaving the block raises 1305 "SAVEPOINT sa_savepoint_1
# does not exist" while the 1213 deadlock is handled, with aiomysql's own exception between the two
# SQLAlchemy errors in the __context__ chain.  The awaited retry_on_conflict raised it after ONE call
# (the sync form retried); it now follows the chain through the wrapped driver error too.
@pytest.mark.parametrize("nested", [0, 1, 2])
@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_async_deadlock_retried_once(backend: Backend, monkeypatch: pytest.MonkeyPatch, nested: int) -> None:
    """Promise: the async form retries a real deadlock (also inside begin_nested()), awaits each
    attempt, never calls time.sleep."""
    setup(backend)
    slept: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: (slept.append(s), real_sleep(s)))
    options = {"connect_args": pg_fast_options(backend)} if backend.name == "postgresql" else {}
    calls: dict[str, list[int]] = {"a": [], "b": []}

    async def main() -> list[Any]:
        engine = create_async_engine(async_url(backend), **options)
        barrier = asyncio.Barrier(2)

        def unit(tag: str, first: int, second: int) -> Callable[[], Any]:
            async def run() -> int:
                calls[tag].append(1)
                async with AsyncSession(engine) as s, s.begin():
                    s.add(Log(tag=tag))
                    await s.flush()
                    async with contextlib.AsyncExitStack() as stack:
                        for _ in range(nested):
                            await stack.enter_async_context(s.begin_nested())
                        await s.execute(update(Acct).where(Acct.id == first).values(balance=Acct.balance + 1))
                        if len(calls[tag]) == 1:
                            await asyncio.wait_for(barrier.wait(), 10)
                        await s.execute(
                            update(Acct).where(Acct.id == second).values(balance=Acct.balance + 1)
                        )
                return len(calls[tag])

            return run

        try:
            return await asyncio.wait_for(
                asyncio.gather(
                    retry_on_conflict(unit("a", 1, 2)),
                    retry_on_conflict(lambda: unit("b", 2, 1)()),
                    return_exceptions=True,
                ),
                30,
            )
        finally:
            await engine.dispose()

    results = asyncio.run(main())
    assert not [r for r in results if isinstance(r, BaseException)], (
        results,
        calls,
        [chain(r) for r in results],
    )
    assert sorted(results) == [1, 2], results
    assert sorted([len(calls["a"]), len(calls["b"])]) == [1, 2]
    assert slept == []
    assert balances(backend.engine) == {1: 2, 2: 2}
    assert log_tags(backend.engine) == ["a", "b"]


def _with_held_row_async(pg: Backend, body: Callable[[Callable[[], Any], list[int]], Any]) -> None:
    """Row 1 held by another transaction; run ``await body(nowait, calls)`` where ``nowait()`` is an
    async unit that tries to lock row 1 with NOWAIT (LockNotAcquired) and appends to ``calls``."""
    engine = setup(pg)
    release = hold_row(engine)
    calls: list[int] = []

    async def main() -> None:
        aengine = create_async_engine(async_url(pg))

        async def nowait() -> None:
            calls.append(1)
            async with AsyncSession(aengine) as s, s.begin():
                await row_lock(s, Acct, 1, nowait=True)

        try:
            await body(nowait, calls)
        finally:
            await aengine.dispose()

    try:
        asyncio.run(main())
    finally:
        release()


def test_async_caps_and_non_retryable(pg: Backend) -> None:
    """Async: attempts cap, lock_not_acquired=False, max_time, app errors raised at once."""

    async def body(nowait: Callable[[], Any], calls: list[int]) -> None:
        async def app_error() -> None:
            calls.append(1)
            try:
                await nowait()
            except LockNotAcquired:
                raise AppError("busy")  # noqa: B904 - raised while handling, on purpose

        with pytest.raises(LockNotAcquired):
            await retry_on_conflict(nowait, attempts=3, backoff=0.001)
        assert len(calls) == 3
        calls.clear()
        with pytest.raises(LockNotAcquired):
            await retry_on_conflict(nowait, attempts=3, lock_not_acquired=False)
        assert len(calls) == 1
        calls.clear()
        with pytest.raises(AppError):
            await retry_on_conflict(app_error, attempts=3)
        assert len(calls) == 2  # app_error once, nowait once
        calls.clear()
        started = time.monotonic()
        with pytest.raises(LockNotAcquired):
            await retry_on_conflict(nowait, attempts=100_000, backoff=5, max_backoff=5, max_time=0.3)
        assert time.monotonic() - started < 1.5

    _with_held_row_async(pg, body)


@pytest.mark.cancel
def test_async_cancel_during_backoff_is_not_swallowed(pg: Backend) -> None:
    """Cancelling the task while it waits between attempts cancels it (no further attempts)."""

    async def body(nowait: Callable[[], Any], calls: list[int]) -> None:
        task = asyncio.ensure_future(retry_on_conflict(nowait, attempts=50, backoff=5, max_backoff=5))
        await asyncio.sleep(0.3)
        task.cancel()
        started = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - started < 1
        n = len(calls)
        await asyncio.sleep(0.2)
        assert len(calls) == n

    _with_held_row_async(pg, body)
