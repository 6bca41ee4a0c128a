"""Charge once, whatever the client retries: an idempotency key, a request id and the outbox.

``pay()`` is the body of ``POST /orders/{id}/pay``.  The key replays a retried request's first
answer; the trigger's ``request_id`` lets even a retry whose key is gone find its own first
attempt; the charge runs from the outbox event, which exists only for an APPLIED payment.
"""

import os

from sqlalchemy import String, create_engine, event
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from stateguard import CallableSink, Outcome, Relay, StateMachine, create_tables, idempotent, version_column


class Base(DeclarativeBase): ...


class Order(Base):
    __tablename__ = "pay_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    version: Mapped[int] = version_column()
    flow = StateMachine(
        "status", states=["pending", "paid", "cancelled"], history=True,   # history keeps request ids
        transitions=[{"trigger": "pay", "source": "pending", "dest": "paid", "event": "order.paid"}],
    )


class Conflict(Exception): ...                             # your HTTP 409


engine = create_engine(os.environ.get("DATABASE_URL", "sqlite:///payments.db"))
Base.metadata.create_all(engine)
create_tables(engine)                                      # keys, history, outbox (or alembic)
Shop = sessionmaker(engine)
with Shop.begin() as session:
    session.add_all([Order(id=1), Order(id=2), Order(id=3, status="cancelled")])


def pay(order_id: int, key: str, seen_version: int) -> dict:
    """POST /orders/{id}/pay with an Idempotency-Key; the customer confirmed the order at seen_version."""
    with Shop.begin() as session, idempotent(session, scope="pay", key=key, fingerprint=order_id) as call:
        if call.replayed:
            return call.response                           # a retry: the first answer, nothing runs again
        r = Order.flow.pay(session, order_id, request_id=key, expected_version=seen_version)
        if r.outcome is Outcome.REJECTED:                  # cancelled: refuse; the exception frees the key
            raise Conflict(f"order {order_id} is {r.state}")
        if r.outcome is Outcome.STALE:                     # changed since the customer saw it: show it again
            raise Conflict(f"order {order_id} changed, now version {r.version}")
        r.raise_for_outcome()                              # NOT_FOUND: raises NotFound (a 404)
        # APPLIED: "order.paid" commits with the change, the relay charges.  REPEATED: paid already.
        return call.complete({"order": order_id, "status": r.state})


charged: list[int] = []


def charge_cards(events) -> None:                          # the relay's sink: each event at least once
    for e in events:
        charged.append(e.payload["key"])                   # psp.charge(..., idempotency_key=f"evt-{e.id}")


assert pay(1, key="k1", seen_version=1) == pay(1, key="k1", seen_version=1)   # the retry is replayed
for order_id, seen in [(3, 1), (2, 7)]:
    try:
        pay(order_id, key=f"k{order_id}", seen_version=seen)
    except Conflict as refused:
        print(refused)                                     # order 3 is cancelled / order 2 changed, ...


def lose_reply(session) -> None:                           # a test rig: the COMMIT ran, its reply is lost
    raise OperationalError("COMMIT", {}, ConnectionResetError("connection reset"))


event.listen(Shop, "after_commit", lose_reply, once=True)
try:
    answer = pay(2, key="k2-again", seen_version=1)
except OperationalError:                                   # did it apply?  Retry with the same identity:
    answer = pay(2, key="k2-again", seen_version=1)        # replayed: it did, and ran once
assert answer == {"order": 2, "status": "paid"}
with Shop.begin() as session:                              # no key at hand: the request id tells the same
    r = Order.flow.pay(session, 2, request_id="k2-again")
    assert r.outcome is Outcome.REPEATED and r.same_request
Relay(engine, CallableSink(charge_cards)).run_once()       # `stateguard relay` or Relay.run() in production
assert charged == [1, 2]                                   # one charge per payment, none for the retries
engine.dispose()
