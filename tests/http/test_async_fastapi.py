"""The README's async FastAPI quickstart (examples/tutorial/async_fastapi.py) served through
httpx's ASGITransport against SQLite (aiosqlite) and PostgreSQL (asyncpg): payments run once
per key, retries replay, a reused key is 422, a sold-out payment rolls back and frees its key,
and 20 concurrent retries of one request take the stock once.

The example's ``Session`` factory is re-bound to the test's namespace, the way an application's
tests point it at a test database; everything else runs as the README shows it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import Session

from stateguard import create_tables, drop_tables
from tests._support.async_helpers import AsyncTarget, target_from
from tests.docs._examples import load_example

shop = load_example("tutorial/async_fastapi.py")

TARGETS = ["aiosqlite", "asyncpg"]


@pytest.fixture(params=TARGETS)
def target(request: pytest.FixtureRequest) -> Iterator[AsyncTarget]:
    """SQLite and PostgreSQL with the shop's tables and stateguard's, seeded: 3 orders, 2 widgets."""
    t = target_from(request)
    engine = t.backend.create(shop.Base.metadata)
    drop_tables(engine)
    create_tables(engine)
    with Session(engine) as s, s.begin():
        s.add_all([shop.Order(id=i, sku="widget") for i in (1, 2, 3)])
        s.add(shop.Stock(sku="widget", amount=2))
    yield t
    drop_tables(engine)


def _stock(target: AsyncTarget) -> int:
    with Session(target.backend.engine) as s:
        return int(s.execute(select(shop.Stock.amount)).scalar_one())


def _status(target: AsyncTarget, order_id: int) -> str:
    with Session(target.backend.engine) as s:
        return s.get_one(shop.Order, order_id).status


def _serve(target: AsyncTarget, scenario: Any) -> Any:
    """Run ``scenario(client)`` with the example app bound to ``target`` for one event loop."""

    async def main() -> Any:
        engine: AsyncEngine = target.engine(helper=True)
        shop.Session.configure(bind=engine)
        try:
            transport = httpx.ASGITransport(app=shop.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://shop") as client:
                return await scenario(client)
        finally:
            shop.Session.configure(bind=shop.engine)
            await engine.dispose()

    return asyncio.run(main())


def _pay(client: httpx.AsyncClient, order_id: int, key: str | None) -> Any:
    headers = {} if key is None else {"Idempotency-Key": key}
    return client.post(f"/orders/{order_id}/pay", headers=headers)


def test_payments_run_once_and_retries_replay(target: AsyncTarget) -> None:
    """A paid order's retry replays its response; another order with the same key is 422; unknown is 404."""

    async def scenario(client: httpx.AsyncClient) -> None:
        first = await _pay(client, 1, "key-1")
        assert (first.status_code, first.json()) == (200, {"order": 1, "status": "paid", "left": 1})
        again = await _pay(client, 1, "key-1")
        assert (again.status_code, again.json()) == (200, first.json())
        reused = await _pay(client, 2, "key-1")
        assert reused.status_code == 422 and "another fingerprint" in reused.json()["detail"]
        assert (await _pay(client, 99, "key-99")).status_code == 404
        assert (await _pay(client, 1, None)).status_code == 422  # the header is required
        # A new key for a paid order: the trigger is REPEATED, so stock is not taken again.
        other = await _pay(client, 1, "key-1b")
        assert other.status_code == 200 and other.json()["status"] == "paid"

    _serve(target, scenario)
    assert _stock(target) == 1
    assert (_status(target, 1), _status(target, 2)) == ("paid", "pending")


def test_concurrent_retries_of_one_request_take_the_stock_once(target: AsyncTarget) -> None:
    """20 concurrent requests with one key: all get the same 200, the order is paid and stock taken once."""

    async def scenario(client: httpx.AsyncClient) -> list[Any]:
        responses = await asyncio.gather(*(_pay(client, 2, "key-2") for _ in range(20)))
        return [(r.status_code, r.json()) for r in responses]

    answers = _serve(target, scenario)
    assert answers == [(200, {"order": 2, "status": "paid", "left": 1})] * 20
    assert _stock(target) == 1 and _status(target, 2) == "paid"


@pytest.mark.rollback
def test_a_sold_out_payment_rolls_back_and_its_key_can_be_retried(target: AsyncTarget) -> None:
    """Sold out: 409, the order stays pending; after a restock the same key pays; cancel gives stock back."""
    with Session(target.backend.engine) as s, s.begin():
        s.execute(update(shop.Stock).values(amount=0))

    async def sold_out(client: httpx.AsyncClient) -> None:
        r = await _pay(client, 3, "key-3")
        assert r.status_code == 409 and "sold out" in r.json()["detail"]

    _serve(target, sold_out)
    assert _status(target, 3) == "pending"
    with Session(target.backend.engine) as s, s.begin():
        s.execute(update(shop.Stock).values(amount=1))

    async def restocked(client: httpx.AsyncClient) -> None:
        r = await _pay(client, 3, "key-3")
        assert (r.status_code, r.json()) == (200, {"order": 3, "status": "paid", "left": 0})
        cancelled = await client.post("/orders/3/cancel")
        assert cancelled.json() == {"order": 3, "status": "cancelled", "restocked": True}
        again = await client.post("/orders/3/cancel")
        assert again.json() == {"order": 3, "status": "cancelled", "restocked": False}
        assert (await client.post("/orders/99/cancel")).status_code == 404
        late = await _pay(client, 3, "key-3")  # the replay still answers what the payment did
        assert late.json() == {"order": 3, "status": "paid", "left": 0}
        assert (await _pay(client, 3, "key-3b")).status_code == 409  # a new payment: cancelled

    _serve(target, restocked)
    assert _stock(target) == 1 and _status(target, 3) == "cancelled"
