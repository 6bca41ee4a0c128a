"""A flash sale on one item: its stock split over 8 rows ("stripes") so 8 buyers take at once.

Same outcomes and the same ``ref`` ledger as the one-row counters; the counter is the object.
"""

import os

from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from stateguard import Outcome, StripedCounter, create_tables

engine = create_engine(os.environ.get("DATABASE_URL", "sqlite:///sale.db"))
create_tables(engine)                       # the stripes table and the ref ledger

stock = StripedCounter("stock", stripes=8)  # a name: several counters share the table
with Session(engine) as session, session.begin():
    stock.create(session, "sku-1", amount=100)          # 8 stripes of 12 or 13

with Session(engine) as session, session.begin():
    r = stock.decrement(session, "sku-1", by=2, ref="order-42")   # one free stripe
    assert r.outcome is Outcome.APPLIED
    assert stock.decrement(session, "sku-1", by=2, ref="order-42").outcome is Outcome.REPEATED
    assert stock.decrement(session, "sku-1", by=50).outcome is Outcome.APPLIED  # > any stripe
    short = stock.decrement(session, "sku-1", by=49)
    assert short.outcome is Outcome.INSUFFICIENT and short.value == 48   # the item's total
    stock.increment(session, "sku-1", by=10, ref="delivery-7")
    stock.reserve(session, {"sku-1": 3}, ref="order-43")                 # all-or-nothing
    stock.release(session, "order-42")                                   # gives 2 back, once
    assert stock.total(session, "sku-1") == 57
    stock.restripe(session, "sku-1", stripes=2)          # after the sale: fewer rows
    assert stock.stripe_amounts(session, "sku-1") == [29, 28]
engine.dispose()
