"""The flash sale scheme: more buyers than stock, every purchase retried.

By hand: read the stock, check it, write stock - 1.  Through stateguard:
``decrement(ref=...)``, one guarded statement per purchase.  Damage:
oversold units, lost updates of the stock row, double charges.
"""

from __future__ import annotations

import uuid

from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session

from ....counters import decrement
from ....result import Outcome, Result
from ....tables import create_tables
from ..models import DemoSideEffect, DemoStock
from ..results import HAND_WRITTEN, STATEGUARD, Request, SchemeRow
from ..storm import DemoRun, scenario

__all__ = ["flash_sale"]


@scenario("flash sale")
def flash_sale(run: DemoRun) -> list[SchemeRow]:
    """More buyers than stock, every purchase retried: read-modify-write, then ``decrement`` with a ref."""
    scheme = "flash sale"
    stock = max(1, run.orders // 4)
    token = uuid.uuid4().hex[:8]  # refs are unique per run
    create_tables(run.engine)
    rows_of = {STATEGUARD: 1, HAND_WRITTEN: 2}
    with run.engine.begin() as conn:
        conn.execute(insert(DemoStock), [{"id": i, "amount": stock} for i in rows_of.values()])
    buyers = run.create_orders(run.orders)
    plan = run.plan([[[Request(buyer, "buy")] for buyer in buyers]])
    naive_plan, _ = run.same_storm(plan, buyers)
    naive_key = run.key(scheme, HAND_WRITTEN)

    def buy(session: Session, request: Request) -> Result:
        return decrement(
            session, DemoStock.amount, rows_of[STATEGUARD], by=1, ref=f"demo-{token}-{request.request_id}"
        )

    def by_hand(session: Session, request: Request) -> Result:
        bought = session.scalar(
            select(DemoSideEffect.id)
            .where(DemoSideEffect.scheme == naive_key, DemoSideEffect.order_id == request.order_id)
            .limit(1)
        )
        if bought is not None:
            return Result(Outcome.REPEATED, model=DemoStock, key=request.order_id)
        left = session.scalar(select(DemoStock.amount).where(DemoStock.id == rows_of[HAND_WRITTEN]))
        if left is None or left < 1:
            return Result(Outcome.INSUFFICIENT, model=DemoStock, key=request.order_id)
        session.execute(
            update(DemoStock).where(DemoStock.id == rows_of[HAND_WRITTEN]).values(amount=left - 1)
        )
        return Result(Outcome.APPLIED, model=DemoStock, key=request.order_id)

    rows = []
    for code, deliveries, call in ((HAND_WRITTEN, naive_plan, by_hand), (STATEGUARD, plan, buy)):
        engine = run.hand_engine if code == HAND_WRITTEN else run.engine
        tally = run.fire(deliveries, run.with_side_effect(run.key(scheme, code), call), engine=engine)
        with run.engine.connect() as conn:
            left = int(conn.scalar(select(DemoStock.amount).where(DemoStock.id == rows_of[code])) or 0)
            sold = int(
                conn.scalar(
                    select(func.count())
                    .select_from(DemoSideEffect)
                    .where(DemoSideEffect.scheme == run.key(scheme, code))
                )
                or 0
            )
        damage = {
            "oversold units": max(0, sold - stock),
            "lost updates": max(0, sold - (stock - left)),
        }
        damage.update(run.duplicates(scheme, code, {"buy": "double charges"}))
        how = (
            f"decrement(ref=...) on stock {stock}"
            if code == STATEGUARD
            else f"read stock, check, write stock - 1 (stock {stock})"
        )
        problems = [] if code == HAND_WRITTEN or not sum(damage.values()) else [f"damage {damage}"]
        rows.append(run.row(scheme, how, tally, code=code, damage=damage, problems=problems))
    run.notes.append(
        f"{scheme}: {run.orders} buyers for {stock} units; APPLIED = units sold, INSUFFICIENT = sold out; "
        "oversold = sold beyond the stock, lost updates = sales the stock row does not show"
    )
    return rows
