"""An exactly-once effect: the event commits with the change, a relay publishes it at least once,
and the consumer applies it once per event id.

    HTTP retry -> idempotent() -> transition + emit() -> COMMIT -> Relay -> sink -> consume_once()
"""

import os

from sqlalchemy import String, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import CallableSink, Relay, StateMachine, consume_once, create_tables, emit, idempotent


class Base(DeclarativeBase): ...


class Order(Base):
    __tablename__ = "outbox_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    flow = StateMachine("status", states=["pending", "paid"], transitions=[["pay", "pending", "paid"]])


engine = create_engine(os.environ.get("DATABASE_URL", "sqlite:///outbox.db"))
Base.metadata.create_all(engine)
create_tables(engine)                         # or `alembic upgrade stateguard@head`
with Session(engine) as session, session.begin():
    session.add(Order(id=77))


def pay(order_id: int, request_key: str) -> dict:
    with Session(engine) as session, session.begin():
        with idempotent(session, scope="pay", key=request_key) as call:
            if call.replayed:
                return call.response
            if Order.flow.pay(session, order_id).applied:      # the event commits with the change
                emit(session, "order.paid", {"order": order_id}, key=f"order-{order_id}")
            return call.complete({"order": order_id, "status": "paid"})


pay(77, "req-1")
pay(77, "req-1")                              # the client's retry: no second transition, no second event

shipped: list[int] = []


def deliver(events) -> None:                  # stands in for a broker and its consumer
    for event in events:
        with Session(engine) as session, session.begin():
            if consume_once(session, "warehouse", str(event.id)).applied:   # REPEATED on redelivery
                shipped.append(event.payload["order"])                      # the effect, once


relay = Relay(engine, CallableSink(deliver))
relay.run_once()                              # relay.run(stop_event) in a process of its own
assert shipped == [77]
engine.dispose()
