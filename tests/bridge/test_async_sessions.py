"""Every guarded operation on an AsyncSession gives what it gives on a Session.

Each scenario is written once (tests/_support/async_helpers.py) and run twice: on the
sync driver (psycopg, PyMySQL, sqlite3) and on an async driver (asyncpg,
psycopg async, aiomysql, aiosqlite) over the same namespace; the records of
every call's outcome, key, state, version and exception type must be equal,
and each scenario asserts its expected outcomes too.  The error-mapping
tests create serialization failures, deadlocks and lock waits with two
connections (threads and a barrier on the sync side, tasks on the async one)
and check that the sync and the async driver raise the same stateguard error.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from stateguard import (
    DeadlockDetected,
    IdempotencyKeyReused,
    InvalidArgument,
    LeaseLost,
    LockNotAcquired,
    NotSupported,
    Outcome,
    RefConflict,
    RequestFailed,
    RequestInProgress,
    SerializationConflict,
    advisory_lock,
    async_sqlite_engine,
    consume_once,
    consume_token,
    decrement,
    guarded_update,
    idempotent,
    idempotent_function,
    increment,
    insert_once,
    issue_token,
    purge_expired,
    purge_expired_tokens,
    release,
    reserve,
    row_lock,
)
from stateguard.tables import metadata as stateguard_metadata
from tests._support.async_helpers import (
    ASYNC_TARGETS,
    PG_TARGETS,
    SERVER_TARGETS,
    AsyncTarget,
    Side,
    Tables,
    async_target,
    run_both,
    target_from,
)
from tests._support.counter_workers import Bin, CounterBase
from tests._support.models import Base, Color, Invoice, Lamp, Message, Order, Ticket
from tests.conftest import Backend

MS = timedelta(milliseconds=1)


@pytest.fixture(params=list(ASYNC_TARGETS))
def target(request: pytest.FixtureRequest) -> AsyncTarget:
    """Each async driver, on the namespace of its backend."""
    return target_from(request)


@pytest.fixture(params=SERVER_TARGETS)
def server_target(request: pytest.FixtureRequest) -> AsyncTarget:
    """asyncpg, psycopg async and aiomysql (the servers with row and advisory locks)."""
    return target_from(request)


@pytest.fixture(params=PG_TARGETS)
def pg_target(request: pytest.FixtureRequest) -> AsyncTarget:
    """asyncpg and psycopg async."""
    return target_from(request)


@pytest.fixture(scope="module")
def tables() -> Iterator[Tables]:
    """The test models, counter bins and stateguard's tables, created once per backend."""
    t = Tables(Base.metadata, CounterBase.metadata, stateguard_metadata, restart=("processed_messages",))
    yield t
    t.drop()


def _seeded(target: AsyncTarget, tables: Tables) -> Callable[[Engine], None]:
    """Empty the tables, then seed them through ``engine``."""

    def reset(engine: Engine) -> None:
        tables.ready(target.backend)
        with Session(engine) as s, s.begin():
            s.add_all(Order(id=i) for i in range(1, 6))
            s.add_all([Order(id=6, amount=10), Order(id=7, amount=10)])
            s.add(Order(id=8, amount=10, status="shipped"))
            s.add_all([Ticket(id=1, priority=9), Ticket(id=2, priority=1), Lamp(id=1), Invoice(id=1)])
            s.add_all([Bin(id=1, qty=10), Bin(id=2, qty=5), Bin(id=3, qty=5)])

    return reset


def _check(
    target: AsyncTarget,
    tables: Tables,
    scenario: Any,
    *,
    helper: bool = False,
    entries: int | None = None,
    engine_kw: dict[str, Any] | None = None,
) -> None:
    sync_log, async_log = run_both(
        target, scenario, _seeded(target, tables), helper=helper, engine_kw=engine_kw
    )
    assert async_log == sync_log
    if entries is not None:
        assert len(sync_log) == entries, sync_log


def _code(error: BaseException) -> Any:
    """The driver's own code behind a stateguard error: SQLSTATE, MySQL errno or SQLite code."""
    cause = error.__cause__
    assert isinstance(cause, DBAPIError), repr(cause)
    orig: Any = cause.orig
    if type(orig).__module__.startswith("pymysql"):  # PyMySQL's errors, also raised by aiomysql
        return orig.args[0]
    for attr in ("sqlstate", "sqlite_errorcode"):
        if getattr(orig, attr, None) is not None:
            return getattr(orig, attr)
    raise AssertionError(f"no driver code on {orig!r}")


# --------------------------------------------------------------------------
# Outcomes: the same on both sides
# --------------------------------------------------------------------------


async def _triggers(side: Side) -> None:
    committed: list[Any] = []
    async with side.session() as s:
        async with side.begin(s):
            r = await side.run(lambda: Order.flow.pay(s, 1))
            assert (r.outcome, r.state, r.version) == (Outcome.APPLIED, "paid", 2)
            r.on_commit(committed.append, "pay-1")
            assert (await side.run(lambda: Order.flow.pay(s, 1))).outcome is Outcome.REPEATED
            assert (await side.run(lambda: Order.flow.ship(s, 1))).applied
            r = await side.run(lambda: Order.flow.pay(s, 1))
            assert (r.outcome, r.state) == (Outcome.REJECTED, "shipped")
            assert (await side.run(lambda: Order.flow.pay(s, 99))).outcome is Outcome.NOT_FOUND
            r = await side.run(lambda: Order.flow.cancel(s, 2, expected_version=7))
            assert (r.outcome, r.version) == (Outcome.STALE, 1)
            r = await side.run(lambda: Order.flow.fire(s, "cancel", 2, expected_version=1))
            assert (r.outcome, r.state) == (Outcome.APPLIED, "cancelled")
            order = await side.q(lambda: s.get(Order, 3))
            assert (await side.run(lambda: Order.flow.pay(s, order, values={"note": "by instance"}))).applied
            assert (order.status, order.version) == ("paid", 2)
            # values= attributes are expired; an AsyncSession cannot lazy-load them: refresh.
            await side.q(lambda: s.refresh(order, ["note"]))
            assert order.note == "by instance"
            many = await side.run(lambda: Order.flow.pay.many(s, [3, 4, 5, 99, 8]))
            assert {k: v.outcome for k, v in many.items()} == {
                3: Outcome.REPEATED,
                4: Outcome.APPLIED,
                5: Outcome.APPLIED,
                99: Outcome.NOT_FOUND,
                8: Outcome.REJECTED,
            }
            swept = await side.run(lambda: Order.flow.cancel.where(s, Order.amount >= 10))
            assert sorted(swept) == [6, 7]
            assert (await side.run(lambda: Ticket.flow.close(s, 1))).outcome is Outcome.REJECTED
            assert (await side.run(lambda: Ticket.flow.close(s, 2))).applied
            r = await side.run(lambda: Lamp.flow.go(s, 1))
            assert (r.outcome, r.state) == (Outcome.APPLIED, Color.GREEN)
            assert (await side.run(lambda: Invoice.flow.send(s, 1, request_id="req-1"))).applied
            r = await side.run(lambda: Invoice.flow.send(s, 1, request_id="req-1"))
            assert r.outcome is Outcome.REPEATED
            assert (await side.run(lambda: Invoice.flow.pay(s, 1, metadata={"by": "u1"}))).applied
            assert (await side.run(lambda: Invoice.flow.void(s, 1))).applied
            history = await side.run(lambda: Invoice.flow.history(s, 1))
            assert [(e.trigger, e.source, e.dest) for e in history] == [
                ("send", "draft", "sent"),
                ("pay", "sent", "paid"),
                ("void", "paid", "void"),
            ]
            assert history[0].request_id == "req-1" and history[1].metadata == {"by": "u1"}
            assert committed == []
    assert committed == ["pay-1"]


def test_triggers_many_where_fire_and_history_match_sync(target: AsyncTarget, tables: Tables) -> None:
    """Awaited triggers (every outcome), many, where, fire and history give what sync gives."""
    _check(target, tables, _triggers, entries=18)


async def _writes(side: Side) -> None:
    async with side.session() as s:
        async with side.begin(s):
            r = await side.run(lambda: guarded_update(s, Order, 1, {"note": "gift"}, expected_version=1))
            assert (r.outcome, r.version) == (Outcome.APPLIED, 2)
            r = await side.run(lambda: guarded_update(s, Order, 1, {"note": "late"}, expected_version=1))
            assert (r.outcome, r.version) == (Outcome.STALE, 2)
            r = await side.run(lambda: guarded_update(s, Order, 99, {"note": "x"}, expected_version=1))
            assert r.outcome is Outcome.NOT_FOUND
            assert (await side.run(lambda: insert_once(s, Message, {"message_id": "m-1"}))).applied
            r = await side.run(lambda: insert_once(s, Message, {"message_id": "m-1"}))
            assert r.outcome is Outcome.REPEATED
        async with side.begin(s):
            r = await side.run(lambda: insert_once(s, Message, {"message_id": "m-1"}))
            assert r.outcome is Outcome.REPEATED
            note = await side.q(lambda: s.scalar(select(Order.note).where(Order.id == 1)))
            assert note == "gift"


def test_guarded_update_and_insert_once_match_sync(target: AsyncTarget, tables: Tables) -> None:
    """Awaited guarded_update (APPLIED, STALE, NOT_FOUND) and insert_once (APPLIED, REPEATED) match sync."""
    _check(target, tables, _writes, entries=6)


async def _counters(side: Side) -> None:
    async with side.session() as s:
        async with side.begin(s):
            r = await side.run(lambda: decrement(s, Bin.qty, 1, by=3, ref="o-1"))
            assert r.outcome is Outcome.APPLIED
            r = await side.run(lambda: decrement(s, Bin.qty, 1, by=3, ref="o-1"))
            assert r.outcome is Outcome.REPEATED
            await side.raises(RefConflict, lambda: decrement(s, Bin.qty, 1, by=4, ref="o-1"))
            r = await side.run(lambda: decrement(s, Bin.qty, 1, by=100, ref="o-2"))
            assert (r.outcome, r.value) == (Outcome.INSUFFICIENT, 7)
            assert (await side.run(lambda: increment(s, Bin.qty, 1, by=2, ceiling=100, ref="i-1"))).applied
            r = await side.run(lambda: increment(s, Bin.qty, 1, by=200, ceiling=100))
            assert r.outcome is Outcome.INSUFFICIENT
            assert (await side.run(lambda: decrement(s, Bin.qty, 99))).outcome is Outcome.NOT_FOUND
            r = await side.run(lambda: reserve(s, Bin.qty, {3: 2, 2: 1}, ref="r-1"))
            assert r.outcome is Outcome.APPLIED
            r = await side.run(lambda: reserve(s, Bin.qty, {2: 1, 3: 2}, ref="r-1"))
            assert r.outcome is Outcome.REPEATED
            r = await side.run(lambda: reserve(s, Bin.qty, {2: 1, 3: 100}, ref="r-2"))
            assert (r.outcome, r.key) == (Outcome.INSUFFICIENT, 3)
            r = await side.run(lambda: release(s, Bin.qty, "r-1"))
            assert (r.outcome, r.value) == (Outcome.APPLIED, {2: 1, 3: 2})
            assert (await side.run(lambda: release(s, Bin.qty, "r-1"))).outcome is Outcome.REPEATED
            assert (await side.run(lambda: release(s, Bin.qty, "nope"))).outcome is Outcome.NOT_FOUND
        qty = await side.q(lambda: s.execute(select(Bin.id, Bin.qty).order_by(Bin.id)))
        assert [tuple(row) for row in qty] == [(1, 9), (2, 5), (3, 5)]


def test_counters_with_refs_match_sync(target: AsyncTarget, tables: Tables) -> None:
    """Awaited decrement/increment/reserve/release: every outcome and RefConflict, as sync."""
    _check(target, tables, _counters, entries=13)


async def _keys(side: Side) -> None:
    async with side.session() as s:
        async with side.begin(s):
            token = await side.q(lambda: issue_token(s, scope="confirm", ttl=timedelta(minutes=5)))
            short = await side.q(lambda: issue_token(s, scope="confirm", ttl=MS))
            assert isinstance(token, str) and len(token) == 43
        async with side.begin(s), side.enter(idempotent(s, scope="p", key="short", lease=MS, ttl=MS)) as call:
            await side.run(lambda: call.complete("done"))
        await asyncio.sleep(0.02)
        async with side.begin(s):
            assert (await side.run(lambda: consume_token(s, token, scope="confirm"))).applied
            r = await side.run(lambda: consume_token(s, token, scope="confirm"))
            assert r.outcome is Outcome.REPEATED
            r = await side.run(lambda: consume_token(s, token, scope="other"))
            assert r.outcome is Outcome.NOT_FOUND
            r = await side.run(lambda: consume_token(s, short, scope="confirm"))
            assert (r.outcome, r.state) == (Outcome.REJECTED, "expired")
            assert (await side.run(lambda: consume_once(s, "billing", "msg-1"))).applied
            r = await side.run(lambda: consume_once(s, "billing", "msg-1"))
            assert r.outcome is Outcome.REPEATED
            assert await side.run(lambda: purge_expired_tokens(s, batch=10)) == 1
            assert await side.run(lambda: purge_expired(s, batch=10)) == 1
        async with side.begin(s):
            assert await side.run(lambda: purge_expired_tokens(s)) == 0
            r = await side.run(lambda: consume_token(s, short, scope="confirm"))
            assert r.outcome is Outcome.NOT_FOUND


def test_tokens_consume_once_and_purges_match_sync(target: AsyncTarget, tables: Tables) -> None:
    """Awaited issue/consume_token, consume_once, purge_expired_tokens and purge_expired match sync."""
    _check(target, tables, _keys, entries=11)


async def _pay(side: Side, s: Any, key: str, body: Any) -> tuple[bool, Any, int]:
    """The README's create_payment: a Message row per key, once; (replayed, response, attempt)."""
    async with side.enter(idempotent(s, scope="payments", key=key, fingerprint=body)) as call:
        if call.replayed:
            return True, call.response, call.attempt
        s.add(Message(message_id=key))
        await side.q(lambda: s.flush())
        response = await side.run(lambda: call.complete({"key": key, "amount": body["amount"]}))
        return False, response, call.attempt


async def _messages(side: Side, *ids: str) -> int:
    """How many of these Message rows are committed (read in a session of its own)."""
    async with side.session() as s:
        count = await side.q(lambda: s.scalar(select(func.count()).where(Message.message_id.in_(ids))))
    return int(count)


async def _same_transaction(side: Side) -> None:
    async with side.session() as s:
        async with side.begin(s):
            first = await _pay(side, s, "k1", {"amount": 10})
            assert first == (False, {"key": "k1", "amount": 10}, 1)
        async with side.begin(s):
            assert await _pay(side, s, "k1", {"amount": 10}) == (True, {"key": "k1", "amount": 10}, 1)
            await side.raises_entering(
                IdempotencyKeyReused, idempotent(s, scope="payments", key="k1", fingerprint={"amount": 11})
            )
        # The block raising rolls its writes and the claim back, even though the transaction commits.
        async with side.begin(s):
            with pytest.raises(ConnectionError):
                async with side.enter(idempotent(s, scope="payments", key="k2")):
                    s.add(Message(message_id="k2"))
                    await side.q(lambda: s.flush())
                    raise ConnectionError("card network down")
            s.add(Message(message_id="other"))
        assert await _messages(side, "k2", "other") == 1
        async with side.begin(s):
            assert await _pay(side, s, "k2", {"amount": 5}) == (False, {"key": "k2", "amount": 5}, 1)
        # release() in same-transaction mode rolls the block back too.
        async with side.begin(s):
            async with side.enter(idempotent(s, scope="payments", key="k3")) as call:
                s.add(Message(message_id="k3"))
                await side.q(lambda: s.flush())
                await side.run(lambda: call.release("upstream 503"))
        assert await _messages(side, "k3") == 0
        # Leaving the block without complete() stores a null response.
        async with side.begin(s), side.enter(idempotent(s, scope="payments", key="k4")):
            pass
        async with side.begin(s), side.enter(idempotent(s, scope="payments", key="k4")) as call:
            assert (call.replayed, call.response) == (True, None)
        async with side.begin(s):
            assert await _pay(side, s, "k3", {"amount": 1}) == (False, {"key": "k3", "amount": 1}, 1)
    side.log.append("end")


def test_idempotent_same_transaction_matches_sync(target: AsyncTarget, tables: Tables) -> None:
    """async with idempotent(): first call, replay, fingerprint mismatch; an exception or release frees it."""
    _check(target, tables, _same_transaction, entries=6)


async def _separate(side: Side) -> None:
    async with side.session() as s:
        with pytest.raises(ConnectionError):
            async with side.enter(idempotent(s, scope="s", key="k", mode="separate")) as call:
                assert (call.replayed, call.attempt, call.taken_over) == (False, 1, False)
                s.add(Message(message_id="phase-1"))
                await side.run(lambda: call.checkpoint("charged", {"charge_id": "ch_1"}))
                s.add(Message(message_id="phase-2"))
                await side.q(lambda: s.flush())
                raise ConnectionError("shipping API down")
        assert await _messages(side, "phase-1") == 1
        assert await _messages(side, "phase-2") == 0
        await side.q(lambda: s.rollback())
        async with side.enter(idempotent(s, scope="s", key="k", mode="separate")) as call:
            assert (call.taken_over, call.attempt) == (True, 2)
            assert (call.checkpoint_name, call.checkpoint_data) == ("charged", {"charge_id": "ch_1"})
            await side.run(lambda: call.heartbeat())
            await side.run(lambda: call.release("upstream 503"))
        async with side.enter(idempotent(s, scope="s", key="k", mode="separate")) as call:
            assert (call.taken_over, call.attempt, call.checkpoint_name) == (True, 3, "charged")
            await side.run(lambda: call.complete("shipped"))
        async with side.enter(idempotent(s, scope="s", key="k", mode="separate")) as call:
            assert (call.replayed, call.response, call.attempt) == (True, "shipped", 3)
    # A worker that dies inside the block: its lease must end before a retry takes over.
    async with side.session() as dead, side.session() as retry:
        dead_call = await side.enter_only(
            idempotent(dead, scope="s", key="dead", mode="separate", lease=timedelta(milliseconds=250))
        )
        error = await side.raises_entering(
            RequestInProgress, idempotent(retry, scope="s", key="dead", mode="separate")
        )
        assert isinstance(error, RequestInProgress) and error.retry_after <= timedelta(milliseconds=250)
        await asyncio.sleep(0.3)
        async with side.enter(idempotent(retry, scope="s", key="dead", mode="separate")) as call:
            assert (call.taken_over, call.attempt) == (True, 2)
            await side.run(lambda: call.complete("second"))
        # The stale worker wakes up: its completion changes nothing.
        await side.raises(LeaseLost, lambda: dead_call.complete("late"))
        async with side.enter(idempotent(retry, scope="s", key="dead", mode="separate")) as call:
            assert (call.replayed, call.response) == (True, "second")

    class CardDeclined(Exception):
        pass

    async with side.session() as s:
        with pytest.raises(CardDeclined):
            async with side.enter(
                idempotent(s, scope="s", key="declined", mode="separate", non_retryable=(CardDeclined,))
            ):
                raise CardDeclined("insufficient funds")
        await side.raises_entering(RequestFailed, idempotent(s, scope="s", key="declined", mode="separate"))


def test_idempotent_separate_mode_matches_sync(target: AsyncTarget, tables: Tables) -> None:
    """Separate mode awaited: checkpoint, release on error, heartbeat, takeover, LeaseLost, failed."""
    _check(target, tables, _separate, entries=8)


async def _decorated(side: Side) -> None:
    calls: list[str] = []
    options: dict[str, Any] = {
        "scope": lambda session, refund_id, amount: f"refunds:{refund_id[:2]}",
        "key": lambda session, refund_id, amount: refund_id,
        "fingerprint": lambda session, refund_id, amount: {"amount": amount},
    }
    refund: Callable[..., Any]
    if side.is_async:

        @idempotent_function(**options)
        async def refund_async(session: AsyncSession, refund_id: str, amount: int) -> dict[str, int]:
            calls.append(refund_id)
            session.add(Message(message_id=refund_id))
            await session.flush()
            return {"refunded": amount}

        refund = refund_async
    else:

        @idempotent_function(**options)
        def refund_sync(session: Session, refund_id: str, amount: int) -> dict[str, int]:
            calls.append(refund_id)
            session.add(Message(message_id=refund_id))
            session.flush()
            return {"refunded": amount}

        refund = refund_sync
    async with side.session() as s:
        async with side.begin(s):
            assert await side.run(lambda: refund(s, "r-1", 30)) == {"refunded": 30}
            assert await side.run(lambda: refund(s, "r-1", 30)) == {"refunded": 30}
            await side.raises(IdempotencyKeyReused, lambda: refund(s, "r-1", 31))
            await side.raises(InvalidArgument, lambda: refund("not a session", "r-2", 1))  # type: ignore[arg-type]
        async with side.begin(s):
            assert await side.run(lambda: refund(s, "r-1", 30)) == {"refunded": 30}
            assert await _messages(side, "r-1") == 1
    assert calls == ["r-1"]


def test_idempotent_function_on_async_def_matches_sync(target: AsyncTarget, tables: Tables) -> None:
    """@idempotent_function on an async def runs once per key and replays, like the sync decorator."""
    _check(target, tables, _decorated, entries=5)


async def _rolled_back(side: Side) -> None:
    async with side.session() as s:
        async with side.begin(s):
            async with side.enter(idempotent(s, scope="rb", key="k")) as call:
                await side.run(lambda: call.complete("first"))
            assert (await side.run(lambda: reserve(s, Bin.qty, {1: 1, 2: 1}, ref="rb"))).applied
            assert (await side.run(lambda: insert_once(s, Message, {"message_id": "rb"}))).applied
            await side.q(lambda: s.rollback())
        async with side.begin(s):
            async with side.enter(idempotent(s, scope="rb", key="k")) as call:
                assert not call.replayed, "the rolled-back claim was committed"
            qty = await side.q(lambda: s.scalars(select(Bin.qty).where(Bin.id.in_([1, 2])).order_by(Bin.id)))
            assert list(qty) == [10, 5], "the rolled-back reservation was committed"
            assert (await side.run(lambda: reserve(s, Bin.qty, {1: 1, 2: 1}, ref="rb"))).applied
            assert (await side.run(lambda: insert_once(s, Message, {"message_id": "rb"}))).applied


@pytest.mark.rollback
def test_a_rollback_takes_savepoint_writes_along(target: AsyncTarget, tables: Tables) -> None:
    """Rolling back the caller's transaction undoes an idempotent claim, a reservation and an insert_once."""
    _check(target, tables, _rolled_back, entries=5)


@pytest.mark.rollback
def test_a_rollback_takes_savepoint_writes_along_on_async_sqlite_engine(
    sqlite: Backend, tables: Tables
) -> None:
    """With async_sqlite_engine (explicit BEGIN IMMEDIATE), aiosqlite rolls savepoint writes back too."""
    _check(async_target("aiosqlite", sqlite), tables, _rolled_back, helper=True, entries=5)


def test_idempotent_function_async_def_refuses_a_sync_session(sqlite: Backend) -> None:
    """An async def decorated function given a Session raises InvalidArgument naming the AsyncSession."""

    @idempotent_function(scope="x", key=lambda session: "k")
    async def work(session: AsyncSession) -> int:
        return 1

    with Session(sqlite.engine) as s, pytest.raises(InvalidArgument, match="AsyncSession"):
        asyncio.run(work(s))  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# Locks
# --------------------------------------------------------------------------


async def _row_locks(side: Side) -> None:
    async with side.session() as s, side.session() as other:
        async with side.begin(other):
            assert (await side.run(lambda: Order.flow.pay(other, 2))).applied
        async with side.begin(s):
            order = await side.run(lambda: row_lock(s, Order, 2))
            assert (order.id, order.status, order.version) == (2, "paid", 2)
            rows = await side.run(lambda: row_lock(s, Order, [3, 1, 99]))
            assert [o.id for o in rows] == [1, 3]
            assert await side.run(lambda: row_lock(s, Order, 99)) is None
            assert (await side.run(lambda: row_lock(s, Order, 1, skip_locked=True))).id == 1
            order.amount += 5
        amount = await side.q(lambda: s.scalar(select(Order.amount).where(Order.id == 2)))
        assert amount == 5


def test_row_lock_matches_sync(target: AsyncTarget, tables: Tables) -> None:
    """Awaited row_lock returns fresh locked rows in key order (aiosqlite through async_sqlite_engine)."""
    _check(target, tables, _row_locks, helper=True, entries=5)


def test_row_lock_on_a_plain_aiosqlite_engine_is_not_supported(sqlite: Backend, tables: Tables) -> None:
    """Without async_sqlite_engine's BEGIN IMMEDIATE, row_lock on aiosqlite refuses, as on sqlite3."""
    target = async_target("aiosqlite", sqlite)

    async def main() -> None:
        engine = target.engine()
        try:
            async with AsyncSession(engine) as s, s.begin():
                with pytest.raises(NotSupported, match="sqlite_engine"):
                    await row_lock(s, Order, 1)
        finally:
            await engine.dispose()

    tables.ready(sqlite)
    asyncio.run(main())


def test_async_sqlite_engine_transactions_hold_the_write_lock(sqlite: Backend, tables: Tables) -> None:
    """async_sqlite_engine: WAL, busy timeout, BEGIN IMMEDIATE, so a row_lock shuts out other writers."""
    tables.ready(sqlite)
    with Session(sqlite.engine) as s, s.begin():
        s.add(Order(id=1))
    url = make_url(sqlite.url).set(drivername="sqlite+aiosqlite").render_as_string(False)
    path = make_url(sqlite.url).database
    assert path is not None

    async def main() -> None:
        engine = async_sqlite_engine(url, busy_timeout=7.5)
        try:
            async with engine.connect() as conn:
                assert (await conn.exec_driver_sql("PRAGMA journal_mode")).scalar() == "wal"
                assert (await conn.exec_driver_sql("PRAGMA busy_timeout")).scalar() == 7500
            async with AsyncSession(engine) as s, s.begin():
                order = await row_lock(s, Order, 1)
                assert order is not None and order.status == "pending"
                outsider = sqlite3.connect(path, timeout=0.05, isolation_level=None)
                try:
                    with pytest.raises(sqlite3.OperationalError, match="locked"):
                        outsider.execute("BEGIN IMMEDIATE")
                finally:
                    outsider.close()
            deferred = async_sqlite_engine(url, begin="deferred")
            try:
                async with AsyncSession(deferred) as s, s.begin():
                    with pytest.raises(NotSupported):
                        await row_lock(s, Order, 1)
            finally:
                await deferred.dispose()
        finally:
            await engine.dispose()

    asyncio.run(main())
    with pytest.raises(ValueError, match=r"sqlite\+aiosqlite://"):
        async_sqlite_engine("sqlite:///x.db")
    with pytest.raises(ValueError, match="sqlite://"):
        async_sqlite_engine("postgresql+asyncpg://u@h/db")


async def _advisory(side: Side) -> None:
    async with side.session() as a, side.session() as b:
        async with side.begin(a):
            async with side.enter(advisory_lock(a, "billing:settle")):
                async with side.begin(b):
                    await side.raises_entering(LockNotAcquired, advisory_lock(b, "billing:settle", timeout=0))
                    # Another name is free.
                    async with side.enter(advisory_lock(b, "billing:other", timeout=0)):
                        pass
        async with side.begin(b):
            async with side.enter(advisory_lock(b, "billing:settle", timeout=0)):
                pass
    # A waiter (no timeout) gets the lock once the holder commits; on the async side the
    # holder can only get there if the waiter's wait does not block the event loop.
    order: list[str] = []
    held = side.barrier(2)

    async def holder() -> None:
        async with side.session() as s, side.begin(s), side.enter(advisory_lock(s, "billing:settle")):
            await held()
            await asyncio.sleep(0.3)
            order.append("holder done")

    async def waiter() -> None:
        async with side.session() as s, side.begin(s):
            await held()
            async with side.enter(advisory_lock(s, "billing:settle")):
                order.append("waiter in")

    await side.gather(holder, waiter)
    assert order == ["holder done", "waiter in"]
    side.log.append(order)


def test_advisory_lock_with_async_with_matches_sync(server_target: AsyncTarget, tables: Tables) -> None:
    """async with advisory_lock(): exclusive, timeout=0 is LockNotAcquired, a waiter follows the holder."""
    _check(server_target, tables, _advisory, entries=2)


async def _autocommit(side: Side) -> None:
    async with side.session() as s:
        error = await side.raises_entering(NotSupported, advisory_lock(s, "x"))
        assert "AUTOCOMMIT" in str(error)


def test_postgresql_advisory_lock_refuses_autocommit_on_every_driver(
    pg_target: AsyncTarget, tables: Tables
) -> None:
    """A transaction-level advisory lock under AUTOCOMMIT would end at once: NotSupported on all drivers."""
    _check(pg_target, tables, _autocommit, entries=1, engine_kw={"isolation_level": "AUTOCOMMIT"})


async def _no_advisory(side: Side) -> None:
    async with side.session() as s, side.begin(s):
        await side.raises_entering(NotSupported, advisory_lock(s, "x"))


def test_advisory_lock_on_aiosqlite_is_not_supported(sqlite: Backend, tables: Tables) -> None:
    """advisory_lock on SQLite raises NotSupported with an AsyncSession as with a Session."""
    _check(async_target("aiosqlite", sqlite), tables, _no_advisory, entries=1)


@pytest.mark.hostile
def test_with_and_async_with_mixed_up_raise_invalid_argument(target: AsyncTarget, tables: Tables) -> None:
    """`with` on an AsyncSession's lock or key, and `async with` on a Session's, raise InvalidArgument."""
    tables.ready(target.backend)

    async def main() -> None:
        engine = target.engine()
        try:
            async with AsyncSession(engine) as s:
                with pytest.raises(InvalidArgument, match="async with"):
                    with advisory_lock(s, "x"):
                        pytest.fail("must not run")
                with pytest.raises(InvalidArgument, match="async with"):
                    with idempotent(s, scope="s", key="k"):
                        pytest.fail("must not run")
                with pytest.raises(NotSupported, match="heartbeat"):
                    idempotent(s, scope="s", key="k", mode="separate", heartbeat_every=timedelta(seconds=1))
        finally:
            await engine.dispose()
        with Session(target.backend.engine) as sync:
            with pytest.raises(InvalidArgument, match="`with`"):
                async with advisory_lock(sync, "x"):
                    pytest.fail("must not run")
            with pytest.raises(InvalidArgument, match="`with`"):
                async with idempotent(sync, scope="s", key="k"):
                    pytest.fail("must not run")

    asyncio.run(main())
    with target.backend.engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM stateguard_idempotency_keys")).scalar() == 0


# --------------------------------------------------------------------------
# Error mapping: the same stateguard error from the sync and the async driver
# --------------------------------------------------------------------------


async def _serialization(side: Side) -> None:
    async with side.session() as t1, side.session() as t2:
        await side.q(lambda: t1.connection(execution_options={"isolation_level": "REPEATABLE READ"}))
        await side.q(lambda: t1.execute(select(Order.status).where(Order.id == 1)))  # the snapshot
        async with side.begin(t2):
            assert (await side.run(lambda: Order.flow.pay(t2, 1))).applied
        error = await side.raises(SerializationConflict, lambda: Order.flow.pay(t1, 1))
        assert not isinstance(error, DeadlockDetected) and error.retryable
        assert _code(error) == "40001"
        await side.q(lambda: t1.rollback())
        async with side.begin(t1):
            assert (await side.run(lambda: Order.flow.pay(t1, 1))).outcome is Outcome.REPEATED


def test_postgresql_serialization_failure_is_the_same_error(pg_target: AsyncTarget, tables: Tables) -> None:
    """A REPEATABLE READ loser: SerializationConflict (40001) from psycopg, asyncpg and psycopg async."""
    _check(pg_target, tables, _serialization, entries=3)


async def _deadlock(side: Side) -> None:
    meet = side.barrier(2)

    async def worker(first: int, second: int) -> Any:
        async with side.session() as s:
            try:
                async with side.begin(s):
                    if side.dialect == "postgresql":  # detect it in 50 ms, not the default second
                        await side.q(lambda: s.execute(text("SET LOCAL deadlock_timeout = '50ms'")))
                    await side.q(lambda: Order.flow.pay(s, first))
                    await meet()
                    await side.q(lambda: Order.flow.pay(s, second))
            except DeadlockDetected as error:
                return error
            return "committed"

    results = await side.gather(lambda: worker(1, 2), lambda: worker(2, 1))
    victims = [r for r in results if isinstance(r, DeadlockDetected)]
    assert len(victims) == 1 and results.count("committed") == 1, results
    assert victims[0].retryable and isinstance(victims[0], SerializationConflict)
    side.log.append(("deadlock", type(victims[0]).__name__, _code(victims[0])))


def test_deadlock_is_the_same_error(server_target: AsyncTarget, tables: Tables) -> None:
    """Opposite-order transactions: DeadlockDetected (40P01 / 1213) from the sync and the async driver."""
    _check(server_target, tables, _deadlock, entries=1)
    assert server_target.name in ("postgresql", "mariadb")


async def _nowait(side: Side) -> None:
    async with side.session() as holder, side.session() as other:
        async with side.begin(holder):
            assert (await side.run(lambda: row_lock(holder, Order, 1))).id == 1
            error = await side.raises(LockNotAcquired, lambda: row_lock(other, Order, 1, nowait=True))
            assert error.retryable
            # MariaDB's NOWAIT error (1205) is behind it; PostgreSQL's NOWAIT would abort the
            # transaction, so stateguard asks with SKIP LOCKED there and raises without one.
            side.log.append(_code(error) if error.__cause__ is not None else "no driver error")
            assert await side.q(lambda: other.scalar(text("SELECT 1"))) == 1  # the transaction goes on
            await side.q(lambda: other.rollback())
        async with side.begin(other):
            assert (await side.run(lambda: row_lock(other, Order, 1, nowait=True))).id == 1


def test_row_lock_nowait_is_the_same_error(server_target: AsyncTarget, tables: Tables) -> None:
    """row_lock(nowait=True) on a held row: LockNotAcquired from sync and async drivers alike (1205 on
    MariaDB; on PostgreSQL from the SKIP LOCKED read, no driver error), the transaction still usable."""
    _check(server_target, tables, _nowait, helper=True, entries=4)


async def _lock_wait_timeout(side: Side) -> None:
    async with side.session() as holder, side.session() as waiter:
        async with side.begin(holder):
            assert (await side.run(lambda: Order.flow.pay(holder, 1))).applied
            await side.q(lambda: waiter.execute(text("SET SESSION innodb_lock_wait_timeout = 1")))
            error = await side.raises(LockNotAcquired, lambda: Order.flow.cancel(waiter, 1))
            assert _code(error) == 1205 and error.retryable
            await side.q(lambda: waiter.rollback())
        async with side.begin(waiter):
            r = await side.run(lambda: Order.flow.cancel(waiter, 1))
            assert (r.outcome, r.state) == (Outcome.APPLIED, "cancelled")


@pytest.mark.cancel
def test_mariadb_lock_wait_timeout_is_the_same_error(mariadb: Backend, tables: Tables) -> None:
    """InnoDB's lock wait timeout (1205) is LockNotAcquired from PyMySQL and from aiomysql."""
    _check(async_target("aiomysql", mariadb), tables, _lock_wait_timeout, entries=3)


async def _busy_snapshot(side: Side) -> None:
    async with side.session() as reader, side.session() as writer:
        assert await side.q(lambda: reader.scalar(select(Order.status).where(Order.id == 1))) == "pending"
        async with side.begin(writer):
            assert (await side.run(lambda: Order.flow.pay(writer, 1))).applied
        error = await side.raises(SerializationConflict, lambda: Order.flow.cancel(reader, 1))
        assert _code(error) == 517  # SQLITE_BUSY_SNAPSHOT
        await side.q(lambda: reader.rollback())


def test_sqlite_busy_snapshot_is_the_same_error(sqlite: Backend, tables: Tables) -> None:
    """A deferred SQLite reader writing after another commit: SerializationConflict, sqlite3 and aiosqlite."""
    target = async_target("aiosqlite", sqlite)
    deferred = {"begin": "deferred", "busy_timeout": 0.2}
    _check(target, tables, _busy_snapshot, helper=True, entries=2, engine_kw=deferred)


def test_async_urls_reach_the_private_namespace(target: AsyncTarget, tables: Tables) -> None:
    """The derived async URL (asyncpg: server_settings) lands in the backend's private schema or file."""
    tables.ready(target.backend)
    with Session(target.backend.engine) as s, s.begin():
        s.add(Order(id=41))

    async def main() -> list[int]:
        engine = target.engine()
        try:
            async with AsyncSession(engine) as s:
                return list(await s.scalars(select(Order.id)))
        finally:
            await engine.dispose()

    assert asyncio.run(main()) == [41]
