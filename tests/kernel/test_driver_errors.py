"""Driver errors become typed errors in every guarded call: a PostgreSQL transaction that an earlier
failed statement aborted (SQLSTATE 25P02) is TransactionAborted, saying to roll back first."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from stateguard import (
    StateguardError,
    TransactionAborted,
    consume_once,
    create_tables,
    decrement,
    drop_tables,
    guarded_update,
    increment,
    retry_on_conflict,
    row_lock,
)
from tests._support.async_helpers import PG_TARGETS, async_target
from tests._support.models import Base, Order
from tests.conftest import Backend

pytestmark = pytest.mark.rollback

#: Guarded calls, each given a session whose transaction is aborted; what a retry after a rollback returns.
CALLS: dict[str, Callable[[Any], Any]] = {
    "trigger": lambda s: Order.flow.pay(s, 1),
    "many": lambda s: Order.flow.pay.many(s, [1]),
    "fire": lambda s: Order.flow.fire(s, "pay", 1),
    "guarded_update": lambda s: guarded_update(s, Order, 1, {"note": "x"}, expected_version=1),
    "increment": lambda s: increment(s, Order.amount, 1, by=5),
    "decrement": lambda s: decrement(s, Order.amount, 1, by=3),
    "row_lock": lambda s: row_lock(s, Order, 1),
    "consume_once": lambda s: consume_once(s, "billing", "message-1"),
}


@pytest.fixture
def db(pg: Backend) -> Iterator[Engine]:
    """PostgreSQL with the test models (one pending order, id 1) and stateguard's tables."""
    engine = pg.create(Base.metadata)
    drop_tables(engine)
    create_tables(engine)
    with Session(engine) as s, s.begin():
        s.add(Order(id=1, status="pending", amount=10))
    yield engine
    drop_tables(engine)


def _fail(session: Session) -> None:
    with pytest.raises(DBAPIError):
        session.execute(text("SELECT 1 / 0"))


def _order(engine: Engine) -> tuple[str, int, int]:
    with Session(engine) as s:
        order = s.get_one(Order, 1)
        return order.status, order.version, order.amount


@pytest.mark.rollback
@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_guarded_call_in_an_aborted_transaction_is_transaction_aborted(db: Engine, call: str) -> None:
    """psycopg: the call raises TransactionAborted saying to roll back; after a rollback it runs."""
    before = _order(db)
    with Session(db) as session:
        session.begin()
        _fail(session)
        with pytest.raises(TransactionAborted, match="Roll it back first") as caught:
            CALLS[call](session)
        error = caught.value
        assert isinstance(error, StateguardError) and not error.retryable
        assert getattr(error.__cause__, "orig", None).__class__.__name__ == "InFailedSqlTransaction"
        assert "earlier statement in it failed" in str(error)
        session.rollback()
        assert _order(db) == before
        with session.begin():
            CALLS[call](session)  # the same session runs the call once rolled back
    assert _order(db) != before or call in ("row_lock", "consume_once")


@pytest.mark.rollback
@pytest.mark.parametrize("driver", PG_TARGETS)
@pytest.mark.parametrize("call", sorted(CALLS))
def test_an_awaited_call_in_an_aborted_transaction_is_transaction_aborted(
    pg: Backend, db: Engine, driver: str, call: str
) -> None:
    """asyncpg and psycopg async: the awaited call raises TransactionAborted; after a rollback it runs."""
    target = async_target(driver, pg)
    before = _order(db)

    async def main() -> None:
        engine = target.engine(pool_size=2)
        try:
            async with AsyncSession(engine) as session:
                await session.begin()
                with pytest.raises(DBAPIError):
                    await session.execute(text("SELECT 1 / 0"))
                with pytest.raises(TransactionAborted, match="Roll it back first"):
                    await CALLS[call](session)
                await session.rollback()
                assert _order(db) == before
                async with session.begin():
                    await CALLS[call](session)
        finally:
            await engine.dispose()

    asyncio.run(main())


@pytest.mark.rollback
def test_retry_on_conflict_does_not_retry_an_aborted_transaction(db: Engine) -> None:
    """TransactionAborted is not retryable: a unit of work that aborts its own transaction runs once."""
    runs: list[int] = []

    def unit() -> Any:
        runs.append(1)
        with Session(db) as session, session.begin():
            _fail(session)
            return Order.flow.pay(session, 1)

    with pytest.raises(TransactionAborted):
        retry_on_conflict(unit, attempts=5, sleep=lambda _s: None)
    assert runs == [1]
    with Session(db) as s:
        assert s.execute(select(Order.status)).scalar_one() == "pending"
