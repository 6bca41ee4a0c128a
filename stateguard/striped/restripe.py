"""Restripe: spread an item's total over a new number of stripes, losing nothing, deadlocking no one.

A restripe first takes the item's gate (:meth:`Pick.hold_gate`), so restripes
of one item run one after another; then inserts its new stripes (amount 0,
uncommitted: decrements skip them); only then locks stripe 0 and the stripes
its count names, in stripe order, and spreads the total over the new count.
Inserting before locking keeps it out of deadlocks on InnoDB, which keeps a
decrement's lock where it looked up a stripe the item does not have (or no
longer has) until that decrement commits: an INSERT there waits for it, and
now waits holding only the gate and rows no decrement has seen committed.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection

from .. import _kernel
from ..exceptions import InvalidArgument
from ..result import Outcome
from .limits import GATE, MAX_AMOUNT, split, stripe_ids
from .pick import Pick
from .statements import DROP_STRIPE, HINTS, SET_STRIPE, insert_rows, item_params


def restripe(
    pick: Pick, conn: Connection, counter: str, item: str, stripes: int, label: str
) -> tuple[Outcome, int | None]:
    """Spread ``item``'s total over ``stripes`` stripes: ``(APPLIED, total)`` or ``(NOT_FOUND, None)``.

    :raises InvalidArgument: too few stripes to hold the total (each holds at most 2**63 - 1;
        ``label`` names the counter); nothing changed.
    """
    params = item_params(counter, item)
    # Behind this, no other restripe of the item is under way until this one commits.
    pick.hold_gate(conn, params)
    ids = stripe_ids(stripes)
    # Insert the new stripes before locking anything a decrement waits for.  Planned from a read
    # without locks: behind the gate no restripe is under way, so it is current unless this
    # transaction's snapshot is older than the last restripe's commit (InnoDB, REPEATABLE READ);
    # then ids found taken are left alone and what is still missing is inserted below.  No plan
    # for a total the new count cannot hold: the check below refuses it.
    seen = _kernel.execute(conn, HINTS, params).all()
    mine: set[int] = set()
    if seen and sum(int(row.amount) for row in seen) <= stripes * MAX_AMOUNT:
        had = {row.stripe for row in seen}
        fresh = [
            item_params(counter, item, sg_stripe=stripe, sg_stripes=stripes, sg_amount=0)
            for stripe in ids
            if stripe not in had
        ]
        if fresh:
            mine = pick.add_stripes(conn, fresh)
    # Stripe 0, then the stripes its count names: the old stripes, not the new ones above.
    rows = pick.lock_named(conn, counter, item)
    total = sum(int(row.amount) for row in rows)
    if not rows or total > stripes * MAX_AMOUNT:
        if mine:
            drop(conn, counter, item, sorted(mine))
        if not rows:
            if pick.has_gate:
                drop(conn, counter, item, [GATE])  # no gate row for an item that is not there
            return Outcome.NOT_FOUND, None
        raise InvalidArgument(
            f"{label} item {item!r} holds {total}, more than {stripes} stripe(s) of at most "
            f"{MAX_AMOUNT} can: restripe it to at least {-(-total // MAX_AMOUNT)} stripes; nothing "
            f"changed"
        )
    new = dict(zip(ids, split(total, stripes), strict=True))
    old = {row.stripe for row in rows}
    # Stripe 0 is in both: rows are updated in place (a waiting reader re-reads them), the old
    # ones the new count lacks deleted.
    for stripe, amount in new.items():
        if stripe in old or stripe in mine:
            values = item_params(counter, item, sg_stripe=stripe, sg_amount=amount, sg_stripes=stripes)
            _kernel.execute(conn, SET_STRIPE, values)
    drop(conn, counter, item, sorted(old - new.keys()))
    # Only when the plan came from a snapshot older than the last restripe's commit.
    missing = [
        item_params(counter, item, sg_stripe=stripe, sg_stripes=stripes, sg_amount=amount)
        for stripe, amount in new.items()
        if stripe not in old and stripe not in mine
    ]
    if missing:
        _kernel.execute(conn, insert_rows(missing))
    pick.saw(counter, item, stripes)
    return Outcome.APPLIED, total


def drop(conn: Connection, counter: str, item: str, stripes: Sequence[int]) -> None:
    """Delete these stripes of ``item`` (or its gate), one statement each (see ``DROP_STRIPE``)."""
    for stripe in stripes:
        _kernel.execute(conn, DROP_STRIPE, item_params(counter, item, sg_stripe=stripe))
