"""The ``Idempotency-Key`` header for a whole FastAPI app: the handler stays a plain handler.

A retry with the same key and body gets the stored response without running the handler; the
same key with another body is 422; a missing key on a required path is 400; a refused request
(404, 409, 422 ...) frees its key; a keyed request that names no client is 400.
"""

import os

from fastapi import FastAPI, HTTPException
from sqlalchemy import String, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker
from starlette.testclient import TestClient

from stateguard import Outcome, StateMachine, create_tables
from stateguard.asgi import IdempotencyMiddleware


class Base(DeclarativeBase): ...


class Order(Base):
    __tablename__ = "api_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    flow = StateMachine("status", states=["pending", "paid"], transitions=[["pay", "pending", "paid"]])


engine = create_engine(os.environ.get("DATABASE_URL", "sqlite:///api.db"))
Base.metadata.create_all(engine)
create_tables(engine)                                      # the middleware's keys live there
SessionLocal = sessionmaker(engine)
with SessionLocal.begin() as session:
    session.add_all([Order(id=1), Order(id=2)])

app = FastAPI()
app.add_middleware(IdempotencyMiddleware, session_factory=SessionLocal, required_paths=["/orders/*"])
charges: list[int] = []


@app.post("/orders/{order_id}/pay")
def pay(order_id: int, body: dict) -> dict:
    with SessionLocal.begin() as session:
        r = Order.flow.pay(session, order_id)
        if r.outcome is Outcome.NOT_FOUND:
            raise HTTPException(404, f"no order {order_id}")   # not stored: the key is free again
        if r.applied:
            r.on_commit(charges.append, order_id)          # psp.charge(...), once, after COMMIT
        return {"order": order_id, "status": r.state}


with TestClient(app) as client:
    key = {"Idempotency-Key": "7c1e-pay-1", "Authorization": "Bearer alice-token"}   # keys are per client
    first = client.post("/orders/1/pay", json={"amount": 1990}, headers=key)
    retry = client.post("/orders/1/pay", json={"amount": 1990}, headers=key)   # its response was lost
    assert retry.json() == first.json() and retry.headers["Idempotency-Replayed"] == "true"
    assert client.post("/orders/1/pay", json={"amount": 1}, headers=key).status_code == 422
    assert client.post("/orders/2/pay", json={"amount": 500}).status_code == 400   # no key
    assert client.post("/orders/9/pay", json={}, headers=key | {"Idempotency-Key": "k9"}).status_code == 404
    assert client.post("/orders/2/pay", json={}, headers={"Idempotency-Key": "k2"}).status_code == 400  # who?
assert charges == [1]
engine.dispose()
