"""A first state machine: an order is paid once, however many requests try at the same time."""

import os
import threading

from sqlalchemy import String, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import Outcome, StateMachine, TransitionRejected, sqlite_engine, version_column


class Base(DeclarativeBase): ...


class Order(Base):
    __tablename__ = "tutorial_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    version: Mapped[int] = version_column()

    flow = StateMachine(
        "status",
        states=["pending", "paid", "shipped", "cancelled"],
        transitions=[
            {"trigger": "pay", "source": "pending", "dest": "paid"},
            {"trigger": "ship", "source": "paid", "dest": "shipped"},
            {"trigger": "cancel", "source": ["pending", "paid"], "dest": "cancelled"},
        ],
    )


url = os.environ.get("DATABASE_URL")  # e.g. postgresql+psycopg://user@host/db; else a SQLite file
engine = create_engine(url) if url else sqlite_engine("sqlite:///tutorial.db")
Base.metadata.drop_all(engine)  # a fresh start each run
Base.metadata.create_all(engine)
with Session(engine) as session, session.begin():
    session.add_all([Order(id=1), Order(id=2)])

# 1. A trigger is one UPDATE ... WHERE id = 1 AND status = 'pending'; the database decides.
with Session(engine) as session, session.begin():
    first = Order.flow.pay(session, 1)
    again = Order.flow.pay(session, 1)          # a retry: the order is already paid
    cancelled = Order.flow.cancel(session, 2)
    late = Order.flow.pay(session, 2)           # too late: order 2 is cancelled
print(first.outcome.name, again.outcome.name, late.outcome.name)  # APPLIED REPEATED REJECTED
assert (first.outcome, again.outcome, late.outcome) == (Outcome.APPLIED, Outcome.REPEATED, Outcome.REJECTED)
assert (first.state, first.version) == ("paid", 2)

# 2. A REJECTED result can become an exception where that reads better.
with Session(engine) as session, session.begin():
    try:
        Order.flow.ship(session, 2).raise_for_outcome()
    except TransitionRejected as error:
        print(error)                            # says which order, which trigger, which state

# 3. Eight threads ship order 1 at once: exactly one of them does it.
barrier = threading.Barrier(8)
outcomes: list[Outcome] = []


def ship() -> None:
    with Session(engine) as session, session.begin():
        barrier.wait()                          # all eight fire together
        outcomes.append(Order.flow.ship(session, 1).outcome)


threads = [threading.Thread(target=ship) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(sorted(o.name for o in outcomes))         # one APPLIED, seven REPEATED
assert outcomes.count(Outcome.APPLIED) == 1 and outcomes.count(Outcome.REPEATED) == 7
engine.dispose()
