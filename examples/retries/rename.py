"""A read-modify-write under a version check, retried on conflict; the same unit awaited on asyncio.

``fn`` runs the *whole* unit of work in a transaction of its own: a retry inside the same
transaction would see the same snapshot and fail again.
"""

import asyncio
import os

from sqlalchemy import String, create_engine
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import Outcome, async_sqlite_engine, guarded_update, retry_on_conflict, version_column


class Base(DeclarativeBase): ...


class Order(Base):
    __tablename__ = "retry_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    note: Mapped[str | None] = mapped_column(String(50))
    version: Mapped[int] = version_column()


engine = create_engine(os.environ.get("DATABASE_URL", "sqlite:///retries.db"))
Base.metadata.create_all(engine)
with Session(engine) as session, session.begin():
    session.add_all([Order(id=42), Order(id=9)])

seen = []


def rename(order_id: int, note: str):
    with Session(engine) as s, s.begin():
        order = s.get_one(Order, order_id)
        if not seen:                                       # another writer gets in between, once
            seen.append(order.version)
            with Session(engine) as other, other.begin():
                guarded_update(other, Order, order_id, {"note": "theirs"}, expected_version=order.version)
        return guarded_update(s, Order, order, {"note": note}, expected_version=order.version)


result = retry_on_conflict(lambda: rename(42, "gift"), attempts=5)
assert result.outcome is Outcome.APPLIED and result.version == seen[0] + 2   # STALE once, then applied

async_engine = async_sqlite_engine("sqlite+aiosqlite:///retries.db")  # or postgresql+asyncpg://...


async def rename_async(order_id: int, note: str):
    async with AsyncSession(async_engine) as s, s.begin():
        order = await s.get_one(Order, order_id)
        return await guarded_update(s, Order, order, {"note": note}, expected_version=order.version)


async def main() -> None:
    result = await retry_on_conflict(lambda: rename_async(9, "fragile"), attempts=5)
    assert result.applied
    await async_engine.dispose()


if not os.environ.get("DATABASE_URL"):                     # the async half runs on the SQLite file
    asyncio.run(main())
engine.dispose()
