"""200 concurrent asyncio tasks on one AsyncEngine per backend (asyncpg, psycopg async,
aiomysql, aiosqlite through async_sqlite_engine): one APPLIED per row and one side effect
per APPLIED, no oversell, one run per idempotency key, and a task cancelled inside an
``async with idempotent(...)`` block leaves its key claimable again.

The pool is smaller than the number of tasks (24 + 8 overflow, tasks wait for a
connection), so at any moment dozens of transactions race on the same rows; each test
checks that the pool really was used concurrently.
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import func, insert, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from stateguard import DeadlockDetected, Outcome, decrement, idempotent
from stateguard._kernel import classify_db_error
from stateguard.idempotency import Mode
from stateguard.tables import counter_ledger, idempotency_keys
from stateguard.tables import metadata as stateguard_metadata
from tests._support.async_helpers import (
    ASYNC_TARGETS,
    SERVER_TARGETS,
    AsyncTarget,
    Tables,
    max_checked_out,
    retry_async,
    target_from,
)
from tests._support.counter_workers import Bin, CounterBase
from tests._support.models import Base, Message, Order, SideEffect

TASKS = 200
ROWS = 20
STOCK = 50
POOL = {"pool_size": 20, "max_overflow": 0}
SQLITE_POOL = {"pool_size": 4, "max_overflow": 0}


@pytest.fixture(scope="module")
def tables() -> Iterator[Tables]:
    """Orders, side effects, messages, bins and stateguard's tables, created once per backend."""
    t = Tables(Base.metadata, CounterBase.metadata, stateguard_metadata)
    yield t
    t.drop()


@pytest.fixture(params=list(ASYNC_TARGETS))
def target(request: pytest.FixtureRequest, tables: Tables) -> AsyncTarget:
    """Each async driver, its tables created and empty."""
    t = target_from(request)
    tables.ready(t.backend)
    return t


def _run(target: AsyncTarget, body: Callable[[AsyncEngine], Any], **engine_kw: Any) -> Any:
    """Run ``body(engine)`` in a fresh event loop with an AsyncEngine of ``target``."""

    async def main() -> Any:
        # SQLite: async_sqlite_engine (BEGIN IMMEDIATE, WAL, busy timeout), the way to run it,
        # with a small pool: there is one writer, and connections waiting in SQLite's busy
        # handler sleep in steps of up to 100 ms, while tasks queued on the pool wake at once.
        pool = POOL if target.name != "sqlite" else SQLITE_POOL
        engine = target.engine(helper=True, **{**pool, **engine_kw})
        try:
            return await body(engine)
        finally:
            await engine.dispose()

    return asyncio.run(main())


def _min_overlap(target: AsyncTarget) -> int:
    """How many connections must have been checked out at once for the race to count."""
    return 10 if target.name != "sqlite" else 3


@pytest.fixture(params=["aiosqlite", "asyncpg", "aiomysql"])
def storm_target(request: pytest.FixtureRequest, tables: Tables) -> AsyncTarget:
    """One driver per backend for the 4000-transaction storm (psycopg async runs the other storms)."""
    t = target_from(request)
    tables.ready(t.backend)
    return t


def test_200_tasks_pay_the_same_20_rows_once_each(storm_target: AsyncTarget) -> None:
    """200 tasks fire pay on the same 20 rows in random orders: one APPLIED and one side effect per row."""
    target = storm_target
    with target.backend.engine.begin() as conn:
        conn.execute(
            insert(Order), [{"id": i, "status": "pending", "version": 1} for i in range(1, ROWS + 1)]
        )

    async def body(engine: AsyncEngine) -> tuple[Counter[Outcome], list[str], int]:
        maker = async_sessionmaker(engine, expire_on_commit=False)
        outcomes: Counter[Outcome] = Counter()
        conflicts: list[str] = []
        go = asyncio.Event()

        async def fire(worker: int, row: int) -> Outcome:
            async with maker() as s, s.begin():
                r = await Order.flow.pay(s, row)
                if r.applied:
                    s.add(SideEffect(order_id=row, what="pay", worker=f"task-{worker}"))
                return r.outcome

        async def task(worker: int) -> None:
            rows = list(range(1, ROWS + 1))
            random.Random(worker).shuffle(rows)
            await go.wait()
            for row in rows:
                outcomes[await retry_async(functools.partial(fire, worker, row), conflicts)] += 1

        with max_checked_out(engine) as seen:
            tasks = [asyncio.create_task(task(i)) for i in range(TASKS)]
            await asyncio.sleep(0)
            go.set()
            await asyncio.gather(*tasks)
        return outcomes, conflicts, seen[1]

    outcomes, conflicts, overlap = _run(target, body)
    assert outcomes == Counter({Outcome.APPLIED: ROWS, Outcome.REPEATED: TASKS * ROWS - ROWS}), conflicts
    assert overlap >= _min_overlap(target), overlap
    with target.backend.engine.connect() as conn:
        per_row = dict(
            conn.execute(select(SideEffect.order_id, func.count()).group_by(SideEffect.order_id)).all()
        )
        statuses = set(conn.execute(select(Order.status)).scalars())
    assert per_row == dict.fromkeys(range(1, ROWS + 1), 1)
    assert statuses == {"paid"}


def test_200_tasks_cannot_oversell_a_stock_of_50(target: AsyncTarget) -> None:
    """200 tasks decrement a stock of 50 with refs and retry once: 50 APPLIED, 50 REPEATED, no oversell."""
    with target.backend.engine.begin() as conn:
        conn.execute(insert(Bin), [{"id": 1, "qty": STOCK, "cap": 0, "version": 1}])

    async def body(engine: AsyncEngine) -> tuple[Counter[Outcome], list[str], int]:
        maker = async_sessionmaker(engine, expire_on_commit=False)
        outcomes: Counter[Outcome] = Counter()
        conflicts: list[str] = []
        go = asyncio.Event()

        async def buy(ref: str) -> Outcome:
            async with maker() as s, s.begin():
                return (await decrement(s, Bin.qty, 1, by=1, ref=ref)).outcome

        async def task(worker: int) -> None:
            await go.wait()
            ref = f"order-{worker}"
            first = await retry_async(lambda: buy(ref), conflicts)
            again = await retry_async(lambda: buy(ref), conflicts)  # the client's retry
            assert (first, again) in (
                (Outcome.APPLIED, Outcome.REPEATED),
                (Outcome.INSUFFICIENT, Outcome.INSUFFICIENT),
            ), (first, again)
            outcomes.update([first, again])

        with max_checked_out(engine) as seen:
            tasks = [asyncio.create_task(task(i)) for i in range(TASKS)]
            await asyncio.sleep(0)
            go.set()
            await asyncio.gather(*tasks)
        return outcomes, conflicts, seen[1]

    outcomes, conflicts, overlap = _run(target, body)
    sold_out = TASKS - STOCK
    assert outcomes == Counter(
        {Outcome.APPLIED: STOCK, Outcome.REPEATED: STOCK, Outcome.INSUFFICIENT: 2 * sold_out}
    ), conflicts
    assert overlap >= _min_overlap(target), overlap
    with target.backend.engine.connect() as conn:
        assert conn.execute(select(Bin.qty)).scalar_one() == 0
        assert conn.execute(select(func.count()).select_from(counter_ledger)).scalar_one() == STOCK


def test_200_tasks_with_one_idempotency_key_run_the_body_once(target: AsyncTarget) -> None:
    """200 tasks send the same key at once (same_transaction): the body runs once, 199 replay its response."""

    async def body(engine: AsyncEngine) -> tuple[list[Any], int, list[str], int]:
        maker = async_sessionmaker(engine, expire_on_commit=False)
        runs: list[int] = []
        replies: list[Any] = []
        conflicts: list[str] = []
        go = asyncio.Event()

        async def request(worker: int) -> Any:
            async with maker() as s, s.begin():
                async with idempotent(s, scope="payments", key="same-key", fingerprint={"amount": 5}) as call:
                    if call.replayed:
                        return call.response
                    runs.append(worker)
                    s.add(Message(message_id="paid"))
                    await s.flush()
                    await asyncio.sleep(0.05)  # the twins pile up on the claim meanwhile
                    return await call.complete({"payment": "paid", "by": worker})

        async def task(worker: int) -> None:
            await go.wait()
            replies.append(await retry_async(lambda: request(worker), conflicts))

        with max_checked_out(engine) as seen:
            tasks = [asyncio.create_task(task(i)) for i in range(TASKS)]
            await asyncio.sleep(0)
            go.set()
            await asyncio.gather(*tasks)
        return replies, len(runs), conflicts, seen[1]

    replies, runs, conflicts, overlap = _run(target, body)
    assert runs == 1, conflicts
    assert len(replies) == TASKS and all(r == replies[0] for r in replies), replies
    assert overlap >= _min_overlap(target), overlap
    with target.backend.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Message.__table__)).scalar_one() == 1
        status = conn.execute(select(idempotency_keys.c.status)).scalars().all()
    assert status == ["completed"]


CANCELLED = 40


@pytest.mark.cancel
@pytest.mark.parametrize("mode", ["same_transaction", "separate"])
def test_tasks_cancelled_inside_idempotent_leave_their_keys_claimable(
    target: AsyncTarget, mode: Mode
) -> None:
    """Tasks cancelled while awaiting inside `async with idempotent()`: their writes vanish, keys are free.

    On the servers 40 tasks are inside their blocks at once when they are cancelled.  SQLite
    has one writer, and a block that has written holds the write lock while it sleeps, so
    there the 40 tasks are cancelled one after another.
    """
    batch = CANCELLED if target.name != "sqlite" else 1

    async def body(engine: AsyncEngine) -> list[tuple[bool, int, bool]]:
        maker = async_sessionmaker(engine, expire_on_commit=False)

        async def work(session: AsyncSession, key: str, inside: list[str], ready: asyncio.Event) -> None:
            async with idempotent(session, scope="cancel", key=key, mode=mode) as call:
                assert not call.replayed
                session.add(Message(message_id=key))
                await session.flush()
                inside.append(key)
                if len(inside) == batch:
                    ready.set()
                await asyncio.sleep(60)  # cancelled here
                await call.complete("never")

        async def task(key: str, inside: list[str], ready: asyncio.Event) -> None:
            async with maker() as s:
                try:
                    await work(s, key, inside, ready)
                except asyncio.CancelledError:
                    # The caller catches the cancellation and commits its own work: the
                    # block's writes and (same_transaction) its claim must not go with it.
                    await commit_after(s, key)
                    raise

        async def commit_after(s: AsyncSession, key: str) -> None:
            # 40 callers insert into processed_messages' unique index at once, next to the rows
            # the cancelled blocks rolled back: InnoDB now and then answers one of these plain
            # INSERTs with a deadlock (seen in CI), which an application retries like any other.
            for attempt in range(1, 11):
                s.add(Message(message_id=f"after-{key}"))
                try:
                    await s.commit()
                    return
                except DBAPIError as error:
                    await s.rollback()
                    if attempt == 10 or classify_db_error(error) is not DeadlockDetected:
                        raise
                    caller_deadlocks.append(key)

        caller_deadlocks: list[str] = []

        keys = [f"k{i}" for i in range(CANCELLED)]
        for first in range(0, CANCELLED, batch):
            inside: list[str] = []
            ready = asyncio.Event()
            tasks = [asyncio.create_task(task(k, inside, ready)) for k in keys[first : first + batch]]
            async with asyncio.timeout(60):
                await ready.wait()
            for t in tasks:
                t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(r, asyncio.CancelledError) for r in results), [
                r for r in results if not isinstance(r, asyncio.CancelledError)
            ]
        # Every key is claimable again, by a fresh request.
        again: list[tuple[bool, int, bool]] = []
        async with maker() as s:
            for key in keys:
                async with idempotent(s, scope="cancel", key=key, mode=mode) as call:
                    again.append((call.replayed, call.attempt, call.taken_over))
                    await call.complete("second")
                if mode == "same_transaction":
                    await s.commit()
        return again

    again = _run(target, body, pool_size=CANCELLED + 5, max_overflow=0)
    if mode == "same_transaction":
        # The claim rolled back with the savepoint: the retry is a first call.
        assert again == [(False, 1, False)] * CANCELLED
    else:
        # The claim had committed; the cancellation released it, so the retry takes it over at once.
        assert again == [(False, 2, True)] * CANCELLED
    with target.backend.engine.connect() as conn:
        messages = set(conn.execute(select(Message.message_id)).scalars())
        rows = conn.execute(select(idempotency_keys.c.status, idempotency_keys.c.response)).all()
    assert messages == {f"after-k{i}" for i in range(CANCELLED)}
    assert sorted(set(rows)) == [("completed", '"second"')]
    assert len(rows) == CANCELLED


@pytest.fixture(params=SERVER_TARGETS)
def server_target(request: pytest.FixtureRequest, tables: Tables) -> AsyncTarget:
    """asyncpg, psycopg async and aiomysql, tables empty."""
    t = target_from(request)
    tables.ready(t.backend)
    return t


#: asyncpg and psycopg cancel a statement on the server when their task is cancelled;
#: aiomysql drops the connection, and MariaDB runs the statement (holding its transaction's
#: locks) until it notices, so a short SLEEP there keeps the retry's wait short.
SLOW_QUERY = {"postgresql": "SELECT pg_sleep(30)", "mariadb": "SELECT SLEEP(2)"}


@pytest.mark.cancel
@pytest.mark.parametrize("mode", ["same_transaction", "separate"])
def test_a_task_cancelled_during_a_statement_in_the_block_frees_its_key(
    server_target: AsyncTarget, mode: Mode
) -> None:
    """Cancelled while the driver awaits a slow statement in the block: CancelledError, the key is free."""
    target = server_target
    slow = text(SLOW_QUERY[target.name])

    async def body(engine: AsyncEngine) -> tuple[BaseException | None, tuple[bool, int, bool]]:
        maker = async_sessionmaker(engine, expire_on_commit=False)
        started = asyncio.Event()

        async def task() -> None:
            async with maker() as s:
                async with idempotent(s, scope="cancel", key="slow", mode=mode):
                    s.add(Message(message_id="slow"))
                    await s.flush()
                    started.set()
                    await s.execute(slow)  # cancelled while the server sleeps
                    pytest.fail("the statement must be cancelled")

        running = asyncio.create_task(task())
        await started.wait()
        await asyncio.sleep(0.2)
        running.cancel()
        async with asyncio.timeout(20):
            outcome = (await asyncio.gather(running, return_exceptions=True))[0]
        async with maker() as s:
            async with idempotent(s, scope="cancel", key="slow", mode=mode) as call:
                claimed = (call.replayed, call.attempt, call.taken_over)
                await call.complete("second")
            await s.commit()
        return outcome, claimed

    outcome, claimed = _run(target, body)
    assert isinstance(outcome, asyncio.CancelledError), outcome
    assert claimed == ((False, 1, False) if mode == "same_transaction" else (False, 2, True))
    with target.backend.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Message.__table__)).scalar_one() == 0


@pytest.mark.cancel
def test_a_twin_cancelled_while_its_claim_waits_leaves_the_owner_alone(target: AsyncTarget) -> None:
    """A twin cancelled while its claim waits behind the owner's: the owner completes, replays follow."""

    async def body(engine: AsyncEngine) -> tuple[BaseException | None, Any]:
        maker = async_sessionmaker(engine, expire_on_commit=False)
        holding, finish = asyncio.Event(), asyncio.Event()

        async def owner() -> None:
            async with maker() as s, s.begin():
                async with idempotent(s, scope="twin", key="k") as call:
                    holding.set()
                    await finish.wait()
                    await call.complete("owner")

        async def twin() -> None:
            async with maker() as s, s.begin():
                async with idempotent(s, scope="twin", key="k"):
                    pytest.fail("the twin must not get the key")

        first = asyncio.create_task(owner())
        await holding.wait()
        waiting = asyncio.create_task(twin())
        await asyncio.sleep(0.2)  # the twin's claim now waits on the owner's (SQLite: on the write lock)
        waiting.cancel()
        # The owner goes on at once: on SQLite the cancelled twin's connection stays blocked in
        # SQLite's busy handler (aiosqlite's thread cannot be interrupted) until the lock is free.
        finish.set()
        async with asyncio.timeout(20):
            outcome = (await asyncio.gather(waiting, return_exceptions=True))[0]
            await first
        async with maker() as s, s.begin():
            async with idempotent(s, scope="twin", key="k") as call:
                return outcome, (call.replayed, call.response)

    outcome, replay = _run(target, body)
    assert isinstance(outcome, asyncio.CancelledError), outcome
    assert replay == (True, "owner")
