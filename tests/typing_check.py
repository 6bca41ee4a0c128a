"""Typical user code, type-checked by ``mypy --strict`` in CI (not collected by pytest).

If a public signature regresses (a missing annotation, a wrong return type),
this file stops type-checking.
"""

from __future__ import annotations

import datetime

from sqlalchemy import String, create_engine, func
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import (
    Outcome,
    Result,
    StaleVersion,
    StateMachine,
    decrement,
    guarded_update,
    idempotent,
    insert_once,
    purge_expired,
    purge_expired_tokens,
    retry_on_conflict,
    version_column,
)


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "typing_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    version: Mapped[int] = version_column()
    paid_at: Mapped[datetime.datetime | None]
    note: Mapped[str | None] = mapped_column(String(50))

    flow: StateMachine[str] = StateMachine(
        "status",
        states=["pending", "paid", "shipped", "cancelled"],
        transitions=[
            {"trigger": "pay", "source": "pending", "dest": "paid"},
            {"trigger": "ship", "source": "paid", "dest": "shipped"},
            ["cancel", ["pending", "paid"], "cancelled"],
        ],
    )


class Message(Base):
    __tablename__ = "typing_messages"
    id: Mapped[int] = mapped_column(primary_key=True)
    message_id: Mapped[str] = mapped_column(String(40), unique=True)


def charge_card(order_id: int) -> None: ...


def pay(session: Session, order_id: int) -> bool:
    result: Result = Order.flow.pay(session, order_id, values={"paid_at": func.now()})
    if result.applied:
        result.on_commit(charge_card, order_id)
        return True
    if result.outcome is Outcome.REPEATED:
        return False
    result.raise_for_outcome()
    return False


def rename(engine_url: str, order_id: int, note: str) -> Result:
    engine = create_engine(engine_url)

    def attempt() -> Result:
        with Session(engine) as s, s.begin():
            order = s.get_one(Order, order_id)
            return guarded_update(s, Order, order, {"note": note}, expected_version=order.version)

    try:
        return retry_on_conflict(attempt, attempts=3)
    except StaleVersion as error:
        print(error.expected_version, error.version)
        raise


def consume(session: Session, message_id: str) -> bool:
    return insert_once(session, Message, {"message_id": message_id}).applied


def allowed(order: Order) -> list[str]:
    names: list[str] = Order.flow.available(order)
    version: int | None = Order.flow.fire(Session(), "ship", order).version
    print(version, Order.flow.pay.statement(1))
    return names


def create_payment(session: Session, key: str, body: dict[str, int]) -> dict[str, int]:
    with idempotent(session, scope="payments", key=key, fingerprint=body) as call:
        if call.replayed:
            response: dict[str, int] = call.response
            return response
        return call.complete({"payment_id": 1})


async def create_payment_async(session: AsyncSession, key: str) -> int:
    async with idempotent(session, scope="payments", key=key) as call:
        if call.replayed:
            return int(call.response)
        paid: Result = await Order.flow.pay(session, 1)
        left: Result = await decrement(session, Order.id, 1, by=1)
        print(paid.applied, left.value)
        return await call.complete(1)


def housekeeping(engine_url: str) -> int:
    engine = create_engine(engine_url)
    return purge_expired(engine, batch=500) + purge_expired_tokens(engine)


def misspelt_trigger(session: Session) -> None:
    # The stateguard.mypy plugin (pyproject [tool.mypy] plugins) makes a misspelt trigger an
    # error. --strict reports an unneeded ignore too, so this line fails the check if the
    # plugin stops working.
    Order.flow.pya(session, 1)  # type: ignore[attr-defined]
    Order.flow.trigger("shipp")  # type: ignore[attr-defined]
