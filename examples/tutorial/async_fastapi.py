"""A shop API on FastAPI and AsyncSession: each payment runs once, whatever the client retries.

Serve it with ``uvicorn async_fastapi:app``; run the file to try it once: it starts the app (its
lifespan creates the tables), pays an order twice with one key and checks that the second answer
is the first one replayed.
"""
# docs-test: backends sqlite, postgresql

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse
from httpx import ASGITransport, AsyncClient
from sqlalchemy import String
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from stateguard import (
    Outcome,
    StateguardError,
    StateMachine,
    async_sqlite_engine,
    create_tables,
    decrement,
    idempotent,
    release,
    version_column,
)


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "shop_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    sku: Mapped[str] = mapped_column(String(20))
    status: Mapped[str] = mapped_column(String(20), default="pending")
    version: Mapped[int] = version_column()

    flow = StateMachine(
        "status",
        states=["pending", "paid", "cancelled"],
        transitions=[
            {"trigger": "pay", "source": "pending", "dest": "paid"},
            {"trigger": "cancel", "source": ["pending", "paid"], "dest": "cancelled"},
        ],
    )


class Stock(Base):
    __tablename__ = "shop_stock"
    sku: Mapped[str] = mapped_column(String(20), primary_key=True)
    amount: Mapped[int]


url = os.environ.get("DATABASE_URL", "sqlite+aiosqlite:///shop.db")  # or postgresql+asyncpg://...
engine = async_sqlite_engine(url) if url.startswith("sqlite") else create_async_engine(url, pool_size=20)
Session = async_sessionmaker(engine, expire_on_commit=False)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    async with engine.begin() as conn:  # or your alembic migrations
        await conn.run_sync(Base.metadata.create_all)
    await create_tables(engine)  # stateguard's own tables (or `alembic upgrade stateguard@head`)
    yield
    await engine.dispose()


app = FastAPI(lifespan=lifespan)


@app.exception_handler(StateguardError)
async def stateguard_error(request: Request, exc: StateguardError) -> JSONResponse:
    # retryable: a deadlock, a serialization failure, a lock wait; otherwise e.g. a key reused
    if exc.retryable:
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": "1"})
    return JSONResponse({"detail": str(exc)}, status_code=422)


@app.post("/orders/{order_id}/pay")
async def pay(order_id: int, idempotency_key: Annotated[str, Header()]) -> Any:
    async with Session() as session, session.begin():  # commits before the response is sent
        async with idempotent(
            session, scope="pay", key=idempotency_key, fingerprint={"order": order_id}
        ) as call:
            if call.replayed:
                return call.response  # a retry: the first response, nothing runs again
            order = await session.get(Order, order_id)
            if order is None:
                raise HTTPException(404, f"no order {order_id}")
            paid = await Order.flow.pay(session, order)
            if paid.outcome is Outcome.REJECTED:
                raise HTTPException(409, f"order {order_id} is {paid.state}")
            taken = await decrement(session, Stock.amount, order.sku, ref=f"order-{order_id}")
            if taken.outcome is Outcome.INSUFFICIENT:
                # Rolls back the payment with the transaction and frees the key for a retry.
                raise HTTPException(409, f"{order.sku} is sold out")
            return await call.complete({"order": order_id, "status": paid.state, "left": taken.value})


@app.post("/orders/{order_id}/cancel")
async def cancel(order_id: int) -> dict[str, Any]:
    async with Session() as session, session.begin():
        cancelled = await Order.flow.cancel(session, order_id)
        if cancelled.outcome is Outcome.NOT_FOUND:
            raise HTTPException(404, f"no order {order_id}")
        if cancelled.outcome is Outcome.REJECTED:
            raise HTTPException(409, f"order {order_id} is {cancelled.state}")
        # Gives the stock back once, if the payment took it; REPEATED or NOT_FOUND otherwise.
        restocked = await release(session, Stock.amount, f"order-{order_id}")
        return {"order": order_id, "status": cancelled.state, "restocked": restocked.applied}


async def try_it() -> None:
    """Pay order 1 twice with one key (the retry is replayed), then an order that does not exist."""
    async with app.router.lifespan_context(app):
        async with Session() as s, s.begin():
            await s.merge(Stock(sku="widget", amount=1))
            await s.merge(Order(id=1, sku="widget", status="pending"))
        async with AsyncClient(transport=ASGITransport(app=app), base_url="http://shop") as client:
            first = await client.post("/orders/1/pay", headers={"Idempotency-Key": "k1"})
            again = await client.post("/orders/1/pay", headers={"Idempotency-Key": "k1"})
            missing = await client.post("/orders/2/pay", headers={"Idempotency-Key": "k2"})
    assert (first.status_code, first.json()) == (200, {"order": 1, "status": "paid", "left": 0})
    assert again.json() == first.json()  # replayed: the stock was taken once
    assert missing.status_code == 404


if __name__ == "__main__":
    asyncio.run(try_it())
