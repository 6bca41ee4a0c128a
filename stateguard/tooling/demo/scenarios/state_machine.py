"""The state machine scheme: pay, then ship or cancel (sometimes both, racing).

By hand: load the order, check its status in Python, ``UPDATE``.  Through
stateguard: ``DemoOrder.flow.fire()``, one guarded ``UPDATE`` whose ``WHERE``
holds the source states.  Damage: double charges, parcels sent twice, double
refunds, orders both shipped and cancelled.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from ....result import Outcome, Result
from ..models import DemoOrder
from ..results import HAND_WRITTEN, STATEGUARD, Request, SchemeRow
from ..storm import DemoRun, Group, now, scenario

__all__ = ["state_machine"]

#: Where each of DemoOrder.flow's triggers leaves from and goes (for the hand-written variant).
_SOURCES = {"pay": ("pending",), "ship": ("paid",), "cancel": ("pending", "paid")}
_DESTS = {"pay": "paid", "ship": "shipped", "cancel": "cancelled"}
_TWICE = {"pay": "double charges", "ship": "parcels sent twice", "cancel": "double refunds"}


@scenario("state machine")
def state_machine(run: DemoRun) -> list[SchemeRow]:
    """pay, then ship or cancel (sometimes both, racing): by hand, then through ``Order.flow.<trigger>``."""
    scheme = "state machine"
    ids = run.create_orders(run.orders)

    def requests(order_id: int, roll: float) -> tuple[Group, Group]:
        pay = [Request(order_id, "pay")]
        if roll < 0.15:
            # A customer cancels while the warehouse ships: only one may win.
            return pay, [Request(order_id, "ship"), Request(order_id, "cancel")]
        return pay, [Request(order_id, "cancel" if roll < 0.35 else "ship")]

    plan = run.plan(run.two_waves(ids, requests))
    naive_plan, _ = run.same_storm(plan, ids)

    def fire(session: Session, request: Request) -> Result:
        values = {"paid_at": now()} if request.action == "pay" else None
        return DemoOrder.flow.fire(session, request.action, request.order_id, values=values)

    def by_hand(session: Session, request: Request) -> Result:
        # Load, check the status in Python, save: the check is stale by the time the UPDATE runs.
        order = session.get(DemoOrder, request.order_id)
        if order is None:
            return Result(Outcome.NOT_FOUND, model=DemoOrder, key=request.order_id)
        dest = _DESTS[request.action]
        if order.status == dest:
            return Result(Outcome.REPEATED, model=DemoOrder, key=order.id)
        if order.status not in _SOURCES[request.action]:
            return Result(Outcome.REJECTED, model=DemoOrder, key=order.id)
        values: dict[str, Any] = {"status": dest}
        if request.action == "pay":
            values["paid_at"] = now()
        session.execute(update(DemoOrder).where(DemoOrder.id == order.id).values(**values))
        return Result(Outcome.APPLIED, model=DemoOrder, key=order.id)

    def damage(code: str) -> dict[str, int]:
        found = run.duplicates(scheme, code, _TWICE)
        found["shipped and cancelled"] = run.orders_with_all(scheme, code, ("ship", "cancel"))
        return found

    rows = run.side_by_side(
        scheme,
        [(HAND_WRITTEN, naive_plan, by_hand), (STATEGUARD, plan, fire)],
        damage,
        {STATEGUARD: "Order.flow.fire(): one guarded UPDATE", HAND_WRITTEN: "load, check status, UPDATE"},
    )
    run.notes.append(
        f"{scheme}: REPEATED = the order was already in the trigger's destination (a twin or a "
        "redelivery won); REJECTED = its state does not allow the trigger (a ship after a cancel, "
        "the loser of ship vs cancel)"
    )
    return rows
