"""Stock that never oversells: a decrement per order, an all-or-nothing basket, a release once.

Every change carries a ``ref``, so a redelivered "order placed" message or a timer that fires
twice is REPEATED and changes nothing; INSUFFICIENT changed nothing either.
"""

import os

from sqlalchemy import String, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import Outcome, create_tables, decrement, release, reserve


class Base(DeclarativeBase): ...


class Stock(Base):
    __tablename__ = "stock_items"
    sku: Mapped[str] = mapped_column(String(20), primary_key=True)
    amount: Mapped[int]


engine = create_engine(os.environ.get("DATABASE_URL", "sqlite:///stock.db"))
Base.metadata.create_all(engine)
create_tables(engine)                                      # the ledger behind ref= (or alembic)
with Session(engine) as session, session.begin():
    session.add_all([Stock(sku="mug", amount=3), Stock(sku="tea", amount=1)])


def on_order_placed(order_id: int, sku: str, qty: int) -> str:
    """A queue message, delivered at least once."""
    with Session(engine) as session, session.begin():
        r = decrement(session, Stock.amount, sku, by=qty, ref=f"order-{order_id}")
        if r.outcome is Outcome.INSUFFICIENT:              # nothing changed; retry the ref after a restock
            return f"backorder: {r.value} {sku} left"
        return r.outcome.name                              # APPLIED, or REPEATED for a redelivery


def reserve_basket(basket_id: int, items: dict[str, int]) -> Outcome:
    with Session(engine) as session, session.begin():
        r = reserve(session, Stock.amount, items, ref=f"basket-{basket_id}")
        if r.outcome is Outcome.INSUFFICIENT:
            print(f"basket {basket_id}: not enough {r.key}")   # the short item; nothing was taken
        return r.outcome


def basket_expired(basket_id: int) -> None:
    with Session(engine) as session, session.begin():
        release(session, Stock.amount, f"basket-{basket_id}")   # gives back once; then REPEATED


assert [on_order_placed(1, "mug", 1), on_order_placed(1, "mug", 1)] == ["APPLIED", "REPEATED"]
assert on_order_placed(2, "tea", 5) == "backorder: 1 tea left"
assert reserve_basket(7, {"mug": 2, "tea": 1}) is Outcome.APPLIED
assert reserve_basket(8, {"mug": 1, "tea": 1}) is Outcome.INSUFFICIENT
basket_expired(7)
basket_expired(7)                                          # the timer fired twice: stock back once
with Session(engine) as session:
    assert session.get_one(Stock, "mug").amount == 2
    assert session.get_one(Stock, "tea").amount == 1
engine.dispose()
