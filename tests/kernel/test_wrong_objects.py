"""An Engine, Connection, AsyncEngine or AsyncConnection where a session belongs: a typed error
that says what to pass, before anything runs."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from stateguard import (
    InvalidArgument,
    advisory_lock,
    consume_once,
    consume_token,
    decrement,
    emit,
    guarded_update,
    idempotent,
    increment,
    insert_once,
    issue_token,
    purge_expired,
    purge_expired_tokens,
    release,
    reserve,
    row_lock,
)
from tests._support.models import Base, Message, Order


def _seed(s: Session) -> None:
    s.add(Order(id=1))


pytestmark = pytest.mark.tables(Base.metadata, seed=_seed)


CALLS: dict[str, Callable[[Any], Any]] = {
    "trigger": lambda bad: Order.flow.pay(bad, 1),
    "fire": lambda bad: Order.flow.fire(bad, "pay", 1),
    "many": lambda bad: Order.flow.pay.many(bad, [1]),
    "where": lambda bad: Order.flow.pay.where(bad, Order.id > 0),
    "decrement": lambda bad: decrement(bad, Order.amount, 1, floor=None),
    "increment": lambda bad: increment(bad, Order.amount, 1),
    "reserve": lambda bad: reserve(bad, Order.amount, {1: 1}, ref="r"),
    "release": lambda bad: release(bad, Order.amount, "r"),
    "guarded_update": lambda bad: guarded_update(bad, Order, 1, {"note": "x"}, expected_version=1),
    "insert_once": lambda bad: insert_once(bad, Message, {"message_id": "m"}),
    "consume_once": lambda bad: consume_once(bad, "c", "m"),
    "issue_token": lambda bad: issue_token(bad, scope="s", ttl=timedelta(minutes=1)),
    "consume_token": lambda bad: consume_token(bad, "t" * 20, scope="s"),
    "row_lock": lambda bad: row_lock(bad, Order, 1),
    "advisory_lock": lambda bad: advisory_lock(bad, "x").__enter__(),
    "idempotent": lambda bad: idempotent(bad, scope="s", key="k").__enter__(),
    "emit": lambda bad: emit(bad, "orders.paid", {"id": 1}),
}


def _snapshot(engine: Engine) -> Any:
    with Session(engine) as s:
        order = s.get_one(Order, 1)
        return order.status, order.version, order.amount, s.execute(select(func.count(Message.id))).scalar()


@pytest.mark.parametrize("call", sorted(CALLS))
def test_an_engine_or_connection_where_a_session_belongs_is_a_typed_error(engine: Engine, call: str) -> None:
    """Engine, Connection and a sessionmaker: InvalidArgument naming what was given and what to pass."""
    before = _snapshot(engine)
    with engine.connect() as conn:
        for bad, hint in ((engine, "Session(engine)"), (conn, "Session(bind=connection)")):
            with pytest.raises(InvalidArgument, match=rf"got {type(bad).__name__}: pass ") as info:
                CALLS[call](bad)
            assert hint in str(info.value)
    with pytest.raises(InvalidArgument, match="pass factory"):
        CALLS[call](sessionmaker(engine))
    assert _snapshot(engine) == before


@pytest.mark.parametrize("call", ["trigger", "decrement", "insert_once", "advisory_lock", "idempotent"])
def test_a_scoped_session_is_used_through_its_current_session(engine: Engine, call: str) -> None:
    """scoped_session (Flask-SQLAlchemy's db.session) works as before: its current Session is used."""
    scoped = scoped_session(sessionmaker(engine))
    try:
        CALLS[call](scoped)
    except InvalidArgument as error:  # pragma: no cover - the failure this test guards against
        pytest.fail(f"scoped_session refused: {error}")
    except Exception as error:
        # advisory_lock has no named locks on SQLite (NotSupported): past the session check.
        assert type(error).__name__ == "NotSupported", error
    finally:
        scoped.rollback()
        scoped.remove()


@pytest.mark.parametrize("call", sorted(CALLS))
def test_an_async_engine_or_connection_says_to_use_an_async_session(engine: Engine, call: str) -> None:
    """AsyncEngine and AsyncConnection get the hint to pass an AsyncSession and await."""
    async_engine = create_async_engine("sqlite+aiosqlite://")
    with pytest.raises(InvalidArgument, match="got AsyncEngine: pass AsyncSession"):
        CALLS[call](async_engine)


def test_purges_take_an_engine_a_connection_or_a_session_and_refuse_the_rest(engine: Engine) -> None:
    """purge_expired and purge_expired_tokens still take binds; an AsyncEngine is a typed error."""
    for purge in (purge_expired, purge_expired_tokens):
        assert purge(engine) == 0
        with engine.begin() as conn:
            assert purge(conn) == 0
        with Session(engine) as s:
            assert purge(s) == 0
        with pytest.raises(InvalidArgument, match="needs a Session, an Engine or a Connection"):
            purge(create_async_engine("sqlite+aiosqlite://"))  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument):
            purge("sqlite://")  # type: ignore[arg-type]
