"""A call given an Engine (or anything else) where its session belongs names the call the user made."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session, sessionmaker

from stateguard import (
    InvalidArgument,
    StripedCounter,
    advisory_lock,
    decrement,
    guarded_update,
    idempotent,
    increment,
)
from tests._support.models import Order

pytestmark = pytest.mark.hostile

STOCK = StripedCounter("stock", stripes=4)

#: (the call with ``bad`` in the session's place, the call as the message must name it, the example call)
CALLS: list[tuple[str, Callable[[Any], Any], str, str]] = [
    ("trigger", lambda bad: Order.flow.pay(bad, 1), "Order.flow.pay()", "Order.flow.pay(session, 1)"),
    (
        "trigger by keyword",
        lambda bad: Order.flow.pay(session=bad, target=1),
        "Order.flow.pay()",
        # The call's real signature binds target=1 as the parameter target: shown positionally.
        "Order.flow.pay(session, 1)",
    ),
    ("many", lambda bad: Order.flow.ship.many(bad, [1, 2]), "Order.flow.ship.many()", "(session, [1, 2])"),
    (
        "where",
        lambda bad: Order.flow.cancel.where(bad, Order.amount > 5),
        "Order.flow.cancel.where()",
        "Order.flow.cancel.where(session, ...)",
    ),
    (
        "fire",
        lambda bad: Order.flow.fire(bad, "pay", 1),
        "Order.flow.fire()",
        "Order.flow.fire(session, 'pay', 1)",
    ),
    ("history", lambda bad: Order.flow.history(bad, 1), "Order.flow.history()", "(session, 1)"),
    (
        "counter",
        lambda bad: decrement(bad, Order.amount, 1, by=2),
        "decrement()",
        "decrement(session, Order.amount, 1, by=2)",
    ),
    ("increment", lambda bad: increment(bad, Order.amount, 1), "increment()", "(session, Order.amount, 1)"),
    (
        "guarded_update",
        lambda bad: guarded_update(bad, Order, 1, {"note": "x"}),
        "guarded_update()",
        "guarded_update(session, Order, 1, {'note': 'x'})",
    ),
    (
        "striped counter",
        lambda bad: STOCK.decrement(bad, "sku-1", by=2),
        "StripedCounter('stock', stripes=4).decrement()",
        "StripedCounter('stock', stripes=4).decrement(session, 'sku-1', by=2)",
    ),
    (
        "idempotent",
        lambda bad: idempotent(bad, scope="s", key="k"),
        "idempotent()",
        "idempotent(session, ...)",
    ),
    (
        "advisory_lock",
        lambda bad: advisory_lock(bad, "nightly"),
        "advisory_lock()",
        "advisory_lock(session, ...)",
    ),
]
IDS = [c[0] for c in CALLS]


@pytest.mark.parametrize(("label", "call", "name", "example"), CALLS, ids=IDS)
def test_an_engine_names_the_call_and_shows_it_with_a_session(
    label: str, call: Callable[[Any], Any], name: str, example: str
) -> None:
    """An Engine: the message starts with the public call and shows it made inside `with Session(engine)`."""
    engine = create_engine("sqlite://")
    with pytest.raises(InvalidArgument) as caught:
        call(engine)
    message = str(caught.value)
    assert message.startswith(
        f"{name} needs a Session (or an AsyncSession) as its first argument, got Engine"
    )
    assert "with Session(engine) as session, session.begin(): " in message
    assert example in message
    engine.dispose()


@pytest.mark.hostile
@pytest.mark.parametrize(("label", "call", "name", "example"), CALLS, ids=IDS)
def test_other_wrong_objects_name_the_call_and_say_what_to_pass(
    label: str, call: Callable[[Any], Any], name: str, example: str
) -> None:
    """A Connection, a sessionmaker, None and an AsyncEngine each get the call's name and their own fix."""
    engine = create_engine("sqlite://")
    async_engine = create_async_engine("sqlite+aiosqlite://")
    with engine.connect() as conn:
        cases = [
            (conn, "got Connection: pass Session(bind=connection)"),
            (sessionmaker(engine), "got sessionmaker: call the factory"),
            (None, "got NoneType: pass a sqlalchemy.orm.Session"),
            (async_engine, "got AsyncEngine: pass AsyncSession(engine) and await the call"),
        ]
        for bad, fix in cases:
            with pytest.raises(InvalidArgument) as caught:
                call(bad)
            message = str(caught.value)
            assert message.startswith(f"{name} needs a Session"), message
            assert fix in message and example in message, message
    asyncio.run(async_engine.dispose())
    engine.dispose()


def test_the_right_sessions_still_run_the_call() -> None:
    """A Session runs the trigger and an AsyncSession's call is awaited: only wrong objects are refused."""
    engine = create_engine("sqlite://")
    Order.metadata.create_all(engine)
    with Session(engine) as session, session.begin():
        session.add(Order(id=1))
    with Session(engine) as session, session.begin():
        assert Order.flow.pay(session, 1).applied

    async def main() -> None:
        async_engine = create_async_engine("sqlite+aiosqlite://")
        async with async_engine.begin() as conn:
            await conn.run_sync(Order.metadata.create_all)
        async with AsyncSession(async_engine) as session, session.begin():
            session.add(Order(id=1))
        async with AsyncSession(async_engine) as session, session.begin():
            assert (await Order.flow.pay(session, 1)).applied
        await async_engine.dispose()

    asyncio.run(main())
    engine.dispose()
