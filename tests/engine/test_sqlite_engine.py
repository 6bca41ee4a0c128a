"""sqlite_engine / async_sqlite_engine: readers never wait for SQLite's write lock; stateguard's writes
take it where they start a transaction, so they stay serialized."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, event, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

import stateguard
from stateguard import Outcome, async_sqlite_engine, create_tables, decrement, row_lock, sqlite_engine
from tests._support.models import Base, Invoice, Order
from tests.conftest import Backend

#: How long the writer holds its transaction, and the most a reader may take meanwhile.
HOLD = 3.0
FAST = 0.5


@pytest.fixture
def db(sqlite: Backend) -> Iterator[str]:
    """A WAL file database with the test models and stateguard's tables; its URL."""
    engine = sqlite_engine(sqlite.url)
    try:
        Base.metadata.drop_all(engine)
        Base.metadata.create_all(engine)
        create_tables(engine)
        with Session(engine) as s, s.begin():
            s.add_all([Order(id=1, amount=5), Invoice(id=1)])
    finally:
        engine.dispose()
    yield sqlite.url
    engine = sqlite_engine(sqlite.url)
    try:
        Base.metadata.drop_all(engine)
        stateguard.drop_tables(engine)
    finally:
        engine.dispose()


def _traced(engine: Engine) -> list[str]:
    """Every statement SQLite runs on ``engine``'s connections (sqlite3's trace callback: BEGINs too)."""
    seen: list[str] = []

    @event.listens_for(engine, "connect")
    def _trace(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.set_trace_callback(seen.append)

    return seen


def test_a_reader_does_not_wait_while_a_writer_holds_the_write_lock(db: str) -> None:
    """While a stateguard write holds the write lock, ORM and Core reads via sqlite_engine() run at once."""
    writer_engine = sqlite_engine(db)
    reader_engine = sqlite_engine(db, busy_timeout=HOLD)
    try:
        with Session(writer_engine) as writer, writer.begin():
            assert Order.flow.pay(writer, 1).applied  # uncommitted: the writer holds the lock
            outsider = sqlite3.connect(make_url(db).database or "", timeout=0.05, isolation_level=None)
            try:
                with pytest.raises(sqlite3.OperationalError, match="locked"):
                    outsider.execute("BEGIN IMMEDIATE")
            finally:
                outsider.close()
            started = time.monotonic()
            with Session(reader_engine) as reader, reader.begin():
                assert reader.get_one(Order, 1).status == "pending"  # the last committed state
                assert reader.execute(select(Invoice.status)).scalar_one() == "draft"
            with reader_engine.connect() as conn:
                assert conn.execute(text("SELECT count(*) FROM orders")).scalar_one() == 1
            took = time.monotonic() - started
        assert took < FAST, f"the reads waited {took:.2f}s for the writer"
    finally:
        writer_engine.dispose()
        reader_engine.dispose()


def test_an_async_reader_does_not_wait_while_a_writer_holds_the_write_lock(db: str) -> None:
    """The same through async_sqlite_engine(): an AsyncSession read runs while another connection writes."""
    pytest.importorskip("aiosqlite")
    from sqlalchemy.ext.asyncio import AsyncSession

    path = make_url(db).database or ""
    url = make_url(db).set(drivername="sqlite+aiosqlite").render_as_string(False)

    async def read() -> float:
        engine = async_sqlite_engine(url, busy_timeout=HOLD)
        try:
            started = time.monotonic()
            async with AsyncSession(engine) as s, s.begin():
                assert (await s.execute(select(Order.status))).scalar_one() == "pending"
            return time.monotonic() - started
        finally:
            await engine.dispose()

    writer = sqlite3.connect(path, isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")
        writer.execute("UPDATE orders SET status = 'paid' WHERE id = 1")
        took = asyncio.run(read())
        writer.execute("ROLLBACK")
    finally:
        writer.close()
    assert took < FAST, f"the read waited {took:.2f}s for the writer"


def test_a_transaction_begins_immediate_only_when_it_starts_with_a_write(db: str) -> None:
    """begin='auto': reads begin DEFERRED; a write, a stateguard call or row_lock first begins IMMEDIATE."""
    engine = sqlite_engine(db)
    seen = _traced(engine)

    def first_statements(unit: Any) -> list[str]:
        seen.clear()
        with Session(engine) as s, s.begin():
            unit(s)
        return seen[:2]

    try:
        reads = first_statements(lambda s: s.get(Order, 1))
        assert reads[0] == "BEGIN" and reads[1].startswith("SELECT")
        flush = first_statements(lambda s: s.add(Order(id=2)))
        assert flush[0] == "BEGIN IMMEDIATE" and flush[1].startswith("INSERT")
        # A trigger with history and a request_id reads the log before its UPDATE: locked before the read.
        fire = first_statements(lambda s: Invoice.flow.send(s, 1, request_id="r1"))
        assert fire[0] == "BEGIN IMMEDIATE" and fire[1].startswith("SELECT")
        lock = first_statements(lambda s: row_lock(s, Order, 1))
        assert lock[0] == "BEGIN IMMEDIATE" and lock[1].startswith("SELECT")
        locking_read = first_statements(lambda s: s.execute(select(Order).with_for_update()).all())
        assert locking_read[0] == "BEGIN IMMEDIATE"
        nested = first_statements(lambda s: s.connection().begin_nested().commit())
        assert nested[0] == "BEGIN" and nested[1].startswith("SAVEPOINT")
    finally:
        engine.dispose()


@pytest.mark.parametrize(("begin", "first"), [("immediate", "BEGIN IMMEDIATE"), ("deferred", "BEGIN")])
def test_begin_immediate_and_deferred_begin_every_transaction_alike(db: str, begin: Any, first: str) -> None:
    """begin='immediate' (the opt-in: every transaction holds the write lock) and 'deferred' still apply."""
    engine = sqlite_engine(db, begin=begin)
    seen = _traced(engine)
    try:
        for unit in (lambda s: s.get(Order, 1), lambda s: s.add(Order(id=3))):
            seen.clear()
            with Session(engine) as s, s.begin():
                unit(s)
            assert seen[0] == first
    finally:
        engine.dispose()
    with pytest.raises(ValueError, match="begin must be"):
        sqlite_engine(db, begin="lazy")  # type: ignore[arg-type]


def test_row_lock_after_a_read_is_not_supported_under_auto(db: str) -> None:
    """A transaction that already read cannot take the write lock late: row_lock says so instead of lying."""
    engine = sqlite_engine(db)
    try:
        with Session(engine) as s, s.begin():
            s.get(Order, 1)
            with pytest.raises(stateguard.NotSupported, match="before anything else reads"):
                row_lock(s, Order, 1)
    finally:
        engine.dispose()


def _storm(db: str, workers: int, unit: Any) -> list[Any]:
    """``unit(session, i)`` from ``workers`` threads released together, each in its own transaction."""
    engine = sqlite_engine(db, pool_size=workers)
    barrier = threading.Barrier(workers)
    results: list[Any] = [None] * workers

    def run(i: int) -> None:
        barrier.wait()
        try:
            with Session(engine) as s, s.begin():
                results[i] = unit(s, i)
        except Exception as error:  # reported by the assertions, not lost in the thread
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(workers)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        engine.dispose()
    return results


def test_read_then_write_triggers_from_16_threads_stay_serialized(db: str) -> None:
    """16 threads void one invoice, each with a request_id (the log is read first): 1 APPLIED, no error."""
    results = _storm(db, 16, lambda s, i: Invoice.flow.void(s, 1, request_id=f"void-{i}").outcome)
    assert Counter(results) == {Outcome.APPLIED: 1, Outcome.REPEATED: 15}, results


def test_counter_storm_from_16_threads_never_oversells(db: str) -> None:
    """16 threads buy 1 of a stock of 5 with their own ref: exactly 5 APPLIED, 11 INSUFFICIENT, no error."""
    results = _storm(db, 16, lambda s, i: decrement(s, Order.amount, 1, by=1, ref=f"buy-{i}").outcome)
    assert Counter(results) == {Outcome.APPLIED: 5, Outcome.INSUFFICIENT: 11}, results
    engine = sqlite_engine(db)
    try:
        with Session(engine) as s:
            assert s.get_one(Order, 1).amount == 0
    finally:
        engine.dispose()
