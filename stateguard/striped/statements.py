"""The statements every dialect family of the striped counter shares, built once.

They read and write ``stateguard_counter_stripes`` by the item's whole key
(``counter``, ``item``, ``stripe``); parameters are named ``sg_*``
(:func:`item_params`).  What one family alone runs lives in its module under
:mod:`stateguard.striped.pick`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from sqlalchemy import (
    BindParameter,
    ColumnElement,
    Delete,
    Insert,
    Select,
    Update,
    bindparam,
    delete,
    desc,
    insert,
    select,
    update,
)
from sqlalchemy.sql.dml import ReturningUpdate

from .. import _kernel
from ..tables import counter_stripes

#: The rows of one item: its stripes and (where it has one) its restripe gate.
SAME_ITEM: Final[tuple[ColumnElement[bool], ...]] = (
    counter_stripes.c.counter == bindparam("sg_counter"),
    counter_stripes.c.item == bindparam("sg_item"),
)
#: The stripes of the item, not its restripe gate, for the reads that range over the item.
ITEM_STRIPES: Final[tuple[ColumnElement[bool], ...]] = (*SAME_ITEM, counter_stripes.c.stripe >= 0)


def item_params(counter: str, item: str, **more: Any) -> dict[str, Any]:
    """The parameters naming ``counter``'s ``item`` (and ``more``) for these statements."""
    return {"sg_counter": counter, "sg_item": item, **more}


def fits(sign: int) -> ColumnElement[bool]:
    """A stripe the change fits: holding ``:by`` (a decrement), or with room for it below
    MAX_AMOUNT (an increment: ``amount <= :room``, ``:room`` = MAX_AMOUNT - by, so the
    statement never computes a value a BIGINT cannot hold)."""
    if sign < 0:
        return counter_stripes.c.amount >= bindparam("sg_by")
    return counter_stripes.c.amount <= bindparam("sg_room")


def pick_one(*, skip_locked: bool, wrap: bool | None, sign: int) -> Select[Any]:
    """The stripe a change starts at: the last one at or below ``:start`` (``wrap``: above it;
    ``None``: either, at or below first), one the change fits, and free (``skip_locked``:
    ``FOR UPDATE SKIP LOCKED``)."""
    start: BindParameter[int] = bindparam("sg_start")
    # A decrement's ``amount >= :by`` (1 or more) never matches the restripe gate (amount 0);
    # an increment's room would.
    where = [*(SAME_ITEM if sign < 0 else ITEM_STRIPES), fits(sign)]
    if wrap is None:
        order: list[ColumnElement[Any]] = [counter_stripes.c.stripe > start, desc(counter_stripes.c.stripe)]
    else:
        where.append(counter_stripes.c.stripe > start if wrap else counter_stripes.c.stripe <= start)
        order = [desc(counter_stripes.c.stripe)]
    stmt = select(counter_stripes.c.stripe).where(*where).order_by(*order).limit(1)
    return stmt.with_for_update(skip_locked=True) if skip_locked else stmt


def pick_and_change(*, skip_locked: bool, sign: int) -> ReturningUpdate[Any]:
    """Pick a stripe (:func:`pick_one`) and change it in one statement, RETURNING its amount."""
    pick = pick_one(skip_locked=skip_locked, wrap=None, sign=sign).scalar_subquery()
    by: BindParameter[int] = bindparam("sg_by")
    new = counter_stripes.c.amount - by if sign < 0 else counter_stripes.c.amount + by
    where = [*SAME_ITEM, counter_stripes.c.stripe == pick, fits(sign)]
    return update(counter_stripes).where(*where).values(amount=new).returning(counter_stripes.c.amount)


def by_stripe(*, returning: bool, sign: int, guarded: bool) -> Update | ReturningUpdate[Any]:
    """Change one named stripe (``:stripe``), one this transaction locked or stripe 0;
    ``guarded``: only if the change fits it (:func:`fits`)."""
    by: BindParameter[int] = bindparam("sg_by")
    where = [*SAME_ITEM, counter_stripes.c.stripe == bindparam("sg_stripe")]
    if guarded:
        where.append(fits(sign))
    new = counter_stripes.c.amount - by if sign < 0 else counter_stripes.c.amount + by
    stmt = update(counter_stripes).where(*where).values(amount=new)
    return stmt.returning(counter_stripes.c.amount) if returning else stmt


#: What a sweep reads of each stripe.
SWEPT: Final = (counter_stripes.c.stripe, counter_stripes.c.stripes, counter_stripes.c.amount)


def sweep_every(*, locks: bool) -> Select[Any, Any, Any]:
    """Every stripe of the item in stripe order, locked (``locks``) in that order."""
    stmt = select(*SWEPT).where(*ITEM_STRIPES)
    stmt = stmt.order_by(counter_stripes.c.stripe)
    return stmt.with_for_update() if locks else stmt


def sweep_named(*, locks: bool) -> Select[Any, Any, Any]:
    """The stripes named in ``:ids`` in stripe order, locked (``locks``) in that order."""
    named = counter_stripes.c.stripe.in_(bindparam("sg_ids", expanding=True))
    stmt = select(*SWEPT).where(*SAME_ITEM, named)
    stmt = stmt.order_by(counter_stripes.c.stripe)
    return stmt.with_for_update() if locks else stmt


def stripe_0(*, locking_read: bool) -> Select[Any]:
    """Stripe 0's amount (an increment's guarded UPDATE of it matched nothing: missing or full?);
    ``locking_read`` where a plain SELECT would read an older snapshot than the UPDATE did."""
    stmt = select(counter_stripes.c.amount).where(*SAME_ITEM, counter_stripes.c.stripe == 0)
    return stmt.with_for_update() if locking_read else stmt


#: Each stripe's amount and count, read without locks: which stripe is worth waiting for.
HINTS: Final = select(counter_stripes.c.stripe, counter_stripes.c.amount, counter_stripes.c.stripes).where(
    *ITEM_STRIPES
)
#: Each stripe's amount in stripe order (``total``, ``stripe_amounts``).
AMOUNTS: Final = select(counter_stripes.c.amount).where(*ITEM_STRIPES).order_by(counter_stripes.c.stripe)
#: Restripe: set one stripe's amount and the item's new stripe count.
SET_STRIPE: Final = (
    update(counter_stripes)
    .where(*SAME_ITEM, counter_stripes.c.stripe == bindparam("sg_stripe"))
    .values(amount=bindparam("sg_amount"), stripes=bindparam("sg_stripes"))
)
#: Delete one stripe (``:stripe``, or the gate) by its whole key.  One by one, not ``stripe IN
#: (...)``: MariaDB may run such a DELETE as a scan of the table (a single-table DELETE takes no
#: index hint), locking other items' rows with next-key locks, and a restripe then waited for a
#: decrement of another item (a deadlock).  A whole key is a single-row lookup: one row locked.
DROP_STRIPE: Final[Delete] = delete(counter_stripes).where(
    *SAME_ITEM, counter_stripes.c.stripe == bindparam("sg_stripe")
)
#: Create an item's stripe 0, or find it taken (a concurrent create of the same item waits on it).
CREATE: Final = _kernel.InsertOnce(
    counter_stripes,
    {
        counter_stripes.c.counter: bindparam("sg_counter"),
        counter_stripes.c.item: bindparam("sg_item"),
        counter_stripes.c.stripe: bindparam("sg_stripe"),
        counter_stripes.c.stripes: bindparam("sg_stripes"),
        counter_stripes.c.amount: bindparam("sg_amount"),
    },
    returning=[counter_stripes.c.stripe],
)


def stripe_values(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rows of :func:`item_params` (with ``sg_stripe``, ``sg_stripes``, ``sg_amount``) as column values."""
    return [
        {
            "counter": row["sg_counter"],
            "item": row["sg_item"],
            "stripe": row["sg_stripe"],
            "stripes": row["sg_stripes"],
            "amount": row["sg_amount"],
        }
        for row in rows
    ]


def insert_rows(rows: Sequence[Mapping[str, Any]]) -> Insert:
    """One multi-row INSERT of new stripes (create, restripe: rare, so not memoised)."""
    return insert(counter_stripes).values(stripe_values(rows))
