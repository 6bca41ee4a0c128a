"""The optimistic version scheme: load, look, write, with pay and cancel excluding each other.

By hand: the whole row saved back as it was read, its version written but
never compared.  Through stateguard: ``guarded_update(expected_version=)``
under ``retry_on_conflict``.  Damage: double charges and refunds, orders
both paid and cancelled, and lost updates (a version below the writes made).
"""

from __future__ import annotations

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from ....result import Outcome, Result
from ....versioning import guarded_update
from ..models import DemoOrder, DemoSideEffect
from ..results import HAND_WRITTEN, STATEGUARD, Request, SchemeRow
from ..storm import DemoRun, Group, now, scenario

__all__ = ["optimistic_version"]


@scenario("optimistic version")
def optimistic_version(run: DemoRun) -> list[SchemeRow]:
    """Load, look, write: by hand (saving the whole row back), then ``guarded_update(expected_version=)``."""
    scheme = "optimistic version"
    ids = run.create_orders(run.orders)

    def requests(order_id: int, roll: float) -> tuple[Group, Group | None]:
        if roll < 0.25:
            # Paying and cancelling exclude each other; both arrive at once.
            return [Request(order_id, "pay"), Request(order_id, "cancel")], None
        return [Request(order_id, "pay")], [Request(order_id, "cancel")] if roll < 0.45 else None

    plan = run.plan(run.two_waves(ids, requests))
    naive_plan, naive_ids = run.same_storm(plan, ids)
    columns = {"pay": ("paid_at", "cancelled_at"), "cancel": ("cancelled_at", "paid_at")}

    def look(session: Session, request: Request) -> DemoOrder | Result:
        done, excluded = columns[request.action]
        order = session.get(DemoOrder, request.order_id)
        if order is None:
            return Result(Outcome.NOT_FOUND, model=DemoOrder, key=request.order_id)
        if getattr(order, done) is not None:
            return Result(Outcome.REPEATED, model=DemoOrder, key=request.order_id, version=order.version)
        if getattr(order, excluded) is not None:
            return Result(Outcome.REJECTED, model=DemoOrder, key=request.order_id, version=order.version)
        return order

    def look_then_write(session: Session, request: Request) -> Result:
        order = look(session, request)
        if isinstance(order, Result):
            return order
        # This check in Python is safe only because the write below is
        # conditional on the version read here: if anyone wrote in between,
        # it matches no row (STALE) and retry_on_conflict runs it all again.
        done = columns[request.action][0]
        return guarded_update(session, DemoOrder, order, {done: now()}, expected_version=order.version)

    def by_hand(session: Session, request: Request) -> Result:
        order = look(session, request)
        if isinstance(order, Result):
            return order
        # The whole row saved back as it was read, plus this change: the version is
        # written but never compared, so a write made meanwhile is silently undone.
        row = {"paid_at": order.paid_at, "cancelled_at": order.cancelled_at, "version": order.version + 1}
        row[columns[request.action][0]] = now()
        session.execute(update(DemoOrder).where(DemoOrder.id == order.id).values(**row))
        return Result(Outcome.APPLIED, model=DemoOrder, key=order.id, version=order.version + 1)

    orders_of = {HAND_WRITTEN: naive_ids, STATEGUARD: ids}

    def damage(code: str) -> dict[str, int]:
        found = run.duplicates(scheme, code, {"pay": "double charges", "cancel": "double refunds"})
        found["paid and cancelled"] = run.orders_with_all(scheme, code, ("pay", "cancel"))
        # Every APPLIED write recorded its side effect and added 1 to the version it read:
        # a version below the number of writes is that many writes overwritten unseen.
        writes = (
            select(DemoSideEffect.order_id, func.count().label("n"))
            .where(DemoSideEffect.scheme == run.key(scheme, code))
            .group_by(DemoSideEffect.order_id)
            .subquery()
        )
        with run.engine.connect() as conn:
            lost = conn.scalar(
                select(func.coalesce(func.sum(writes.c.n - DemoOrder.version), 0))
                .select_from(writes.join(DemoOrder, DemoOrder.id == writes.c.order_id))
                .where(DemoOrder.id.in_(orders_of[code]), writes.c.n > DemoOrder.version)
            )
        found["lost updates"] = int(lost or 0)
        return found

    rows = run.side_by_side(
        scheme,
        [(HAND_WRITTEN, naive_plan, by_hand), (STATEGUARD, plan, look_then_write)],
        damage,
        {
            STATEGUARD: "guarded_update(expected_version=...), retry_on_conflict",
            HAND_WRITTEN: "load, check, save the row back (version not compared)",
        },
    )
    run.notes.append(
        f"{scheme}: REJECTED = pay and cancel exclude each other, and a quarter of the orders send both "
        "at once: whichever loses is REJECTED"
    )
    run.notes.append(
        f"{scheme}: lost updates = writes another write overwrote without seeing them "
        "(the row's version is lower than the number of writes that ran); a double charge is one too"
    )
    return rows
