"""The insert-once scheme: a message consumer under at-least-once redelivery.

By hand: ``SELECT`` the message id, then ``INSERT`` it into an inbox without
a unique constraint.  Through stateguard: ``insert_once()`` into an inbox
with a unique key.  Damage: duplicate inbox rows, double side effects.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ....inserts import insert_once
from ....result import Outcome, Result
from ..models import DemoInbox, DemoPlainInbox
from ..results import HAND_WRITTEN, STATEGUARD, Request, SchemeRow
from ..storm import DemoRun, scenario

__all__ = ["insert_once_consumer"]


@scenario("insert-once")
def insert_once_consumer(run: DemoRun) -> list[SchemeRow]:
    """A message consumer under at-least-once redelivery: ``SELECT`` then ``INSERT``, then ``insert_once``."""
    scheme = "insert-once"
    ids = run.create_orders(run.orders)
    paid = [[Request(order_id, "pay")] for order_id in ids]
    shipped = [[Request(order_id, "ship")] for order_id in ids if run.rng.random() < 0.7]
    plan = run.plan([paid, shipped])
    naive_plan, _ = run.same_storm(plan, ids)
    messages = len(paid) + len(shipped)

    def consume(session: Session, request: Request) -> Result:
        return insert_once(session, DemoInbox, {"message_id": request.request_id})

    def by_hand(session: Session, request: Request) -> Result:
        seen = session.scalar(
            select(DemoPlainInbox.id).where(DemoPlainInbox.message_id == request.request_id).limit(1)
        )
        if seen is not None:
            return Result(Outcome.REPEATED, model=DemoPlainInbox, key=request.request_id)
        session.add(DemoPlainInbox(message_id=request.request_id))
        session.flush()
        return Result(Outcome.APPLIED, model=DemoPlainInbox, key=request.request_id)

    inbox_of: dict[str, type[DemoInbox] | type[DemoPlainInbox]] = {
        HAND_WRITTEN: DemoPlainInbox,
        STATEGUARD: DemoInbox,
    }

    def damage(code: str) -> dict[str, int]:
        inbox = inbox_of[code]
        found = {
            "duplicate rows": run.count(
                select(inbox.message_id).group_by(inbox.message_id).having(func.count() > 1)
            )
        }
        found.update(run.duplicates(scheme, code, {"pay": "double charges", "ship": "parcels sent twice"}))
        return found

    rows = run.side_by_side(
        scheme,
        [(HAND_WRITTEN, naive_plan, by_hand), (STATEGUARD, plan, consume)],
        damage,
        {STATEGUARD: "insert_once() into an inbox with a unique key", HAND_WRITTEN: "SELECT, then INSERT"},
    )
    run.notes.append(
        f"{scheme}: APPLIED = messages processed the first time: {messages} messages for {len(ids)} orders "
        "(a pay for each, a ship for ~70%), so APPLIED exceeds the order count"
    )
    run.notes.append(
        f"{scheme}: the hand-written inbox has no unique constraint (with one, its race is an IntegrityError "
        "instead: an error and a redelivery)"
    )
    return rows
