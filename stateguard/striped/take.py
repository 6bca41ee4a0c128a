"""Taking units from an item's stripes, and adding them back: the algorithm, written once.

A decrement first tries one free stripe that holds it (:meth:`Pick.fast`),
then what its dialect family does when every such stripe is busy or none
holds enough (:meth:`Pick.when_busy`), and last the ordered sweep: every
stripe of the item locked in stripe order, ``by`` taken from as many as
needed, INSUFFICIENT only when the whole item lacks it.  Everyone who locks
several stripes takes them in that one order, so sweeps do not deadlock one
another except through a stripe a fast path left locked; the family's
:meth:`Pick.guard_sweep` deals with that.  An increment takes a free stripe
with room, else waits for stripe 0, which every item has.
"""

from __future__ import annotations

from sqlalchemy import Connection

from .. import _kernel
from ..exceptions import InvalidArgument
from ..result import Outcome
from .limits import MAX_AMOUNT
from .pick import Pick, Taken
from .statements import item_params


def take(pick: Pick, conn: Connection, counter: str, item: str, by: int) -> Taken:
    """Take ``by`` off ``item``: from a free stripe, else as the family decides, else from several.

    ``(APPLIED, None | total left)``, ``(INSUFFICIENT, total)`` or ``(NOT_FOUND, None)``.
    """
    if pick.fast(conn, counter, item, by, -1):
        return Outcome.APPLIED, None
    decided = pick.when_busy(conn, counter, item, by)
    if decided is not None:
        return decided
    return pick.guard_sweep(conn, lambda: take_locked(pick, conn, counter, item, by))


def take_locked(pick: Pick, conn: Connection, counter: str, item: str, by: int) -> Taken:
    """The ordered sweep: lock every stripe of ``item`` in stripe order and take ``by`` from them."""
    rows = pick.lock_all(conn, counter, item)
    if not rows:
        return Outcome.NOT_FOUND, None
    total = sum(int(row.amount) for row in rows)
    if not pick.take_from(conn, counter, item, rows, by):
        return Outcome.INSUFFICIENT, total
    return Outcome.APPLIED, total - by


def add_to_stripe_0(pick: Pick, conn: Connection, counter: str, item: str, by: int, label: str) -> bool:
    """An increment no free stripe took (all held by others, or too full): wait for stripe 0
    (every item has one).  ``False``: no such item.

    :raises InvalidArgument: stripe 0 holds more than ``MAX_AMOUNT - by`` (the change would
        exceed the BIGINT range of a stripe); nothing changed and the transaction stays usable
        (the guard is in the statement, which the database never fails).
    """
    params = item_params(counter, item, sg_by=by, sg_room=MAX_AMOUNT - by, sg_stripe=0)
    applied, _ = _kernel.run_guarded(conn, pick.increment_one, params, returning=pick.returning)
    if applied:
        return True
    if _kernel.execute(conn, pick.stripe_0, params).scalar() is None:
        return False
    raise InvalidArgument(
        f"adding {by} to {label} item {item!r} would exceed the BIGINT range of a stripe "
        f"(at most {MAX_AMOUNT}); nothing changed"
    )
