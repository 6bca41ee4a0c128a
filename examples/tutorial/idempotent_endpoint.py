"""An idempotent endpoint: a retried payment request is answered from the first one, and runs once.

``pay()`` is the body of ``POST /orders/{order_id}/pay`` in any web framework: the client sends an
``Idempotency-Key`` header and retries with the same key when it gets no answer.
"""

import os

from sqlalchemy import String, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from stateguard import (
    IdempotencyKeyReused,
    Outcome,
    StateMachine,
    create_tables,
    decrement,
    drop_tables,
    idempotent,
    sqlite_engine,
    version_column,
)


class Base(DeclarativeBase): ...


class Order(Base):
    __tablename__ = "endpoint_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    sku: Mapped[str] = mapped_column(String(20))
    status: Mapped[str] = mapped_column(String(20), default="pending")
    version: Mapped[int] = version_column()
    flow = StateMachine(
        "status",
        states=["pending", "paid"],
        transitions=[{"trigger": "pay", "source": "pending", "dest": "paid"}],
    )


class Stock(Base):
    __tablename__ = "endpoint_stock"
    sku: Mapped[str] = mapped_column(String(20), primary_key=True)
    amount: Mapped[int]


url = os.environ.get("DATABASE_URL")
engine = create_engine(url) if url else sqlite_engine("sqlite:///endpoint.db")
Base.metadata.drop_all(engine)  # a fresh start each run
drop_tables(engine)
Base.metadata.create_all(engine)
create_tables(engine)  # stateguard's tables, here for the keys (or: alembic upgrade stateguard@head)
Shop = sessionmaker(engine)
with Shop.begin() as session:
    session.add_all([Order(id=1, sku="mug"), Order(id=2, sku="mug"), Stock(sku="mug", amount=1)])

charges: list[int] = []


def pay(order_id: int, key: str) -> dict:
    """POST /orders/{order_id}/pay with an Idempotency-Key: the answer the client gets."""
    with Shop.begin() as session:  # the key, the payment and the stock commit together
        with idempotent(session, scope="pay", key=key, fingerprint={"order": order_id}) as call:
            if call.replayed:
                return call.response  # a retry: the first answer again; nothing below runs
            paid = Order.flow.pay(session, order_id)
            if paid.outcome is not Outcome.APPLIED:
                return call.complete({"order": order_id, "status": paid.state, "error": "not payable"})
            order = session.get_one(Order, order_id)
            taken = decrement(session, Stock.amount, order.sku, ref=f"order-{order_id}")
            if taken.outcome is Outcome.INSUFFICIENT:
                raise LookupError(f"{order.sku} is sold out")  # rolls back the payment, frees the key
            paid.on_commit(charges.append, order_id)  # side effects only after COMMIT, only once
            return call.complete({"order": order_id, "status": "paid", "left": taken.value})


first = pay(1, key="k-1")
retry = pay(1, key="k-1")  # the client did not hear the first answer and sends it again
print(first, retry)
assert first == retry == {"order": 1, "status": "paid", "left": 0}
assert charges == [1]  # charged once

try:
    pay(2, key="k-1")  # the same key for another request is a client bug (HTTP 422)
except IdempotencyKeyReused as error:
    print(error)

try:
    pay(2, key="k-2")
except LookupError as error:
    print(error)  # mug is sold out: order 2 stays pending and k-2 can be retried later
with Shop() as session:
    assert session.get_one(Order, 2).status == "pending"
engine.dispose()
