"""The public face of striped counters: :class:`StripedCounter` and its calls.

Each call checks its arguments, finds its dialect family's
:class:`~stateguard.striped.pick.Pick` and runs the algorithm of
:mod:`~stateguard.striped.take`, :mod:`~stateguard.striped.restripe` or
:mod:`~stateguard.striped.ledger`, which is written once for every family.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from .. import _kernel
from .._async import dual_method
from .._ledger import LedgerTarget, Shortfall, ledger_claim, ledger_forget, ledger_release, reserve_all
from ..exceptions import InvalidArgument
from ..result import Outcome, Result
from ..tables import counter_stripes
from .ledger import give_back, ledger_key, undo_entries
from .limits import (
    MAX_AMOUNT,
    MAX_ITEM,
    MAX_NAME,
    MAX_STRIPES,
    check_int,
    check_ref,
    needed_ref,
    split,
    stripe_ids,
)
from .pick import Pick, pick_for
from .restripe import restripe
from .statements import AMOUNTS, CREATE, insert_rows, item_params
from .take import add_to_stripe_0, take

__all__ = ["StripedCounter"]


class StripedCounter:
    """A counter per item whose amount lives in several rows, for items many buyers hit at once.

    ``name`` tells this counter's items from another's in the shared table
    (``"stock"``, ``"coupons"``); ``stripes`` is how many rows a new item
    gets (1 to 1024; about the number of buyers that should not wait for
    one another).  Items are str keys (up to 200 characters).  The calls
    mirror :func:`~stateguard.decrement` and friends without the column
    argument, and work on a Session or (awaited) an AsyncSession::

        stock = StripedCounter("stock", stripes=8)
        stock.create(session, "sku-1", amount=100)
        r = stock.decrement(session, "sku-1", by=2, ref="order-42")
        if r.outcome is Outcome.INSUFFICIENT:
            raise OutOfStock("sku-1", left=r.value)

    :raises InvalidArgument: a blank or oversize ``name``, ``stripes``
        outside 1..1024.
    """

    __slots__ = ("name", "stripes", "target")

    def __init__(self, name: str, *, stripes: int = 8) -> None:
        self.name = _kernel.check_text(name, "counter name", MAX_NAME)
        self.stripes = check_int(stripes, "stripes", 1, MAX_STRIPES)
        #: How the counter ledger names this counter's changes.
        self.target = LedgerTarget(counter_stripes.fullname, name, f"StripedCounter({name!r})")

    def __repr__(self) -> str:
        return f"StripedCounter({self.name!r}, stripes={self.stripes})"

    # ----------------------------------------------------------------------
    # Checks and plumbing
    # ----------------------------------------------------------------------

    def _item(self, item: Any) -> str:
        return _kernel.check_text(item, "item", MAX_ITEM)

    def _conn(self, session: Session) -> Connection:
        if session.autoflush:
            session.flush()
        return _kernel.own_connection(session, counter_stripes)

    def _result(self, session: Session, outcome: Outcome, key: Any, value: Any = None) -> Result:
        return Result(
            outcome,
            model=StripedCounter,
            key=key,
            value=value,
            session=session,
            same_request=outcome is Outcome.REPEATED,
        )

    def _change(
        self, session: Session, conn: Connection, pick: Pick, item: str, by: int, sign: int, ref: str | None
    ) -> Result:
        """Claim the ref (if any), change a stripe, classify; input already checked."""
        ledger_id = None
        backend = pick.backend
        if ref is not None:
            delta = -by if sign < 0 else by
            ledger_id = ledger_claim(conn, backend, self.target, ledger_key(item), item, ref, delta)
            if ledger_id is None:
                return self._result(session, Outcome.REPEATED, item)
        value: int | None = None
        if sign < 0:
            outcome, value = take(pick, conn, self.name, item, by)
        elif pick.fast(conn, self.name, item, by, sign):
            return self._result(session, Outcome.APPLIED, item)
        else:
            try:
                added = add_to_stripe_0(pick, conn, self.name, item, by, self.target.name)
            except InvalidArgument:
                if ledger_id is not None:
                    ledger_forget(conn, backend, ledger_id)  # no trace: the database is unchanged
                raise
            outcome = Outcome.APPLIED if added else Outcome.NOT_FOUND
        if outcome is not Outcome.APPLIED and ledger_id is not None:
            # Nothing changed: forget the claim, so the same ref can apply later.
            ledger_forget(conn, backend, ledger_id)
        return self._result(session, outcome, item, value if outcome is Outcome.INSUFFICIENT else None)

    # ----------------------------------------------------------------------
    # The public calls
    # ----------------------------------------------------------------------

    def _create(self, session: Session, item: str, *, amount: int = 0, stripes: int | None = None) -> Result:
        """Create ``item`` with ``amount`` split over ``stripes`` stripes (default: the counter's).

        APPLIED when created; REPEATED (nothing changed) when the item
        exists already, whatever its amount::

            stock.create(session, "sku-1", amount=100)               # 8 stripes of 12 or 13
            stock.create(session, "sku-2", amount=5, stripes=1)      # a cold item: one row

        :raises InvalidArgument: a bad item, ``amount`` (an int from 0) or
            ``stripes`` (1 to 1024); nothing was sent.
        """
        item = self._item(item)
        check_int(amount, "amount", 0, MAX_AMOUNT)
        count = self.stripes if stripes is None else check_int(stripes, "stripes", 1, MAX_STRIPES)
        conn = self._conn(session)
        rows = [
            item_params(self.name, item, sg_stripe=stripe, sg_stripes=count, sg_amount=share)
            for stripe, share in zip(stripe_ids(count), split(amount, count), strict=True)
        ]
        # Stripe 0 decides: a concurrent create of the same item waits on it and then finds it taken.
        if CREATE(conn, rows[0]) is None:
            return self._result(session, Outcome.REPEATED, item)
        if rows[1:]:
            _kernel.execute(conn, insert_rows(rows[1:]))
        pick_for(_kernel.backend(conn.dialect)).saw(self.name, item, count)
        return self._result(session, Outcome.APPLIED, item, amount)

    create = dual_method(_create, operation="striped.create")

    def _decrement(self, session: Session, item: str, *, by: int = 1, ref: str | None = None) -> Result:
        """Take ``by`` off ``item`` unless it has less in all: one statement on PostgreSQL and SQLite.

        Outcomes, as :func:`~stateguard.decrement` (floor 0):

        - APPLIED (``.value`` is ``None``: the item's total is not read, that
          would touch every stripe; :meth:`total` reads it);
        - INSUFFICIENT: all stripes together hold less than ``by``; nothing
          changed, ``.value`` is the total found;
        - NOT_FOUND: no such item;
        - with ``ref``: REPEATED when this ref already took the same amount;
          :class:`~stateguard.RefConflict` when it took another.

        ::

            r = stock.decrement(session, "sku-1", by=2, ref="order-42")
            r.raise_for_outcome()    # InsufficientQuantity / NotFound

        :raises InvalidArgument: a bad item, ``by`` (an int from 1) or ``ref``;
            nothing was sent.
        """
        item = self._item(item)
        check_int(by, "by", 1, MAX_AMOUNT)
        check_ref(ref)
        conn = self._conn(session)
        return self._change(session, conn, pick_for(_kernel.backend(conn.dialect)), item, by, -1, ref)

    decrement = dual_method(_decrement, operation="striped.decrement")

    def _increment(self, session: Session, item: str, *, by: int = 1, ref: str | None = None) -> Result:
        """Add ``by`` to ``item`` (a restock), on a free stripe: APPLIED, NOT_FOUND, or with ``ref`` REPEATED.

        No ceiling (a bound on the total would have to lock every stripe)::

            stock.increment(session, "sku-1", by=50, ref="delivery-7")

        :raises InvalidArgument: a bad item, ``by`` or ``ref`` (nothing was sent); or no stripe
            has room for ``by`` below 2**63 - 1 (a BIGINT): the guard is in the statement, so
            nothing changed and the transaction stays usable.
        """
        item = self._item(item)
        check_int(by, "by", 1, MAX_AMOUNT)
        check_ref(ref)
        conn = self._conn(session)
        return self._change(session, conn, pick_for(_kernel.backend(conn.dialect)), item, by, 1, ref)

    increment = dual_method(_increment, operation="striped.increment")

    def _reserve(self, session: Session, amounts: Mapping[str, int], *, ref: str) -> Result:
        """Decrement several items all-or-nothing, idempotently per ``ref`` (as :func:`~stateguard.reserve`).

        Items are taken in sorted order whatever the mapping's order.  APPLIED
        (``.key`` is ``ref``, ``.value`` maps each item to ``None``),
        REPEATED, or INSUFFICIENT / NOT_FOUND for the first item short or
        missing (``.key``; everything this call did was undone)::

            r = stock.reserve(session, {"sku-1": 2, "sku-2": 1}, ref="order-42")
            r.raise_for_outcome()

        :raises RefConflict: the ref names a different reservation (other amounts, more or fewer items).
        :raises InvalidArgument: bad items, amounts or ref; nothing was sent.
        """
        checked_ref = needed_ref(ref, "reserve")
        if not isinstance(amounts, Mapping) or not amounts:
            raise InvalidArgument("reserve needs a non-empty mapping of items to amounts")
        resolved: dict[str, int] = {}
        for item, by in amounts.items():
            resolved[self._item(item)] = check_int(by, "an amount", 1, MAX_AMOUNT)
        conn = self._conn(session)
        pick = pick_for(_kernel.backend(conn.dialect))
        done = reserve_all(
            conn, pick.backend, self.target, checked_ref, sorted(resolved),
            lambda item: self._change(session, conn, pick, item, resolved[item], -1, checked_ref),
            ledger_key,
        )  # fmt: skip
        if isinstance(done, Result):
            return done
        outcome = next(iter(done.values())).outcome
        return self._result(session, outcome, checked_ref, dict.fromkeys(sorted(resolved)))

    reserve = dual_method(_reserve, operation="striped.reserve")

    def _release(self, session: Session, ref: str) -> Result:
        """Give back everything ``ref`` took from this counter, exactly once (as :func:`~stateguard.release`).

        APPLIED the first time (``.value`` maps each item to the amount given
        back), REPEATED after, NOT_FOUND for a ref that took nothing.  Releasing an
        increment's ref takes its units back as :meth:`decrement` would (from stripes
        that have them, never below zero): INSUFFICIENT when they are gone (``.key``
        the item, ``.value`` its total); then nothing changed and the ref is not
        released::

            if stock.release(session, "order-42"):
                notify_restock()

        :raises InvalidArgument: a bad ref; or an item has no stripe with room for its
            units below 2**63 - 1: nothing was given back and the ref is not released,
            even if the caller commits.
        """
        checked_ref = needed_ref(ref, "release")
        conn = self._conn(session)
        pick = pick_for(_kernel.backend(conn.dialect))

        def give_back_to(item: str, delta: int) -> Shortfall | None:
            return give_back(pick, conn, self.name, item, delta, self.target.name)

        found = ledger_release(conn, pick.backend, self.target, checked_ref, undo_entries, give_back_to)
        if isinstance(found, Outcome):
            return self._result(session, found, checked_ref)
        if isinstance(found, Shortfall):
            return self._result(session, Outcome.INSUFFICIENT, found.key, found.value)
        return self._result(session, Outcome.APPLIED, checked_ref, dict(found))

    release = dual_method(_release, operation="striped.release")

    def _total(self, session: Session, item: str) -> int | None:
        """The item's amount (the sum of its stripes, read without locks), or ``None`` for no such item.

        For example::

            left = stock.total(session, "sku-1")
        """
        item = self._item(item)
        conn = self._conn(session)
        # Summed here, not by SUM(): the stripes may hold more than a BIGINT in all (SQLite's SUM
        # then fails with "integer overflow"); an item has at most MAX_STRIPES of them.
        amounts = _kernel.execute(conn, AMOUNTS, item_params(self.name, item)).scalars().all()
        return sum(int(amount) for amount in amounts) if amounts else None

    total = dual_method(_total, operation="striped.total")

    def _stripe_amounts(self, session: Session, item: str) -> list[int]:
        """The amount of each stripe of ``item`` in stripe order (``[]``: no such item).

        For example::

            stock.stripe_amounts(session, "sku-1")     # [13, 13, 13, 13, 12, 12, 12, 12]
        """
        item = self._item(item)
        conn = self._conn(session)
        amounts = _kernel.execute(conn, AMOUNTS, item_params(self.name, item)).scalars()
        return [int(amount) for amount in amounts]

    stripe_amounts = dual_method(_stripe_amounts, operation="striped.stripe_amounts")

    def _restripe(self, session: Session, item: str, *, stripes: int) -> Result:
        """Spread ``item``'s total over ``stripes`` stripes (more for a flash sale, 1 after it).

        Waits for another restripe of the item to end, inserts the new stripes,
        then locks every old stripe in stripe order (concurrent decrements wait
        or take other stripes; none is lost), so the total is kept exactly.
        Where there are row locks the item keeps a gate row (stripe ``-1``,
        amount 0) that restripes queue on; :meth:`total` and
        :meth:`stripe_amounts` leave it out.  APPLIED (``.value``: the total)
        or NOT_FOUND::

            stock.restripe(session, "sku-1", stripes=32)

        :raises InvalidArgument: a bad item or ``stripes`` (1 to 1024), or too few stripes
            to hold the total (each holds at most 2**63 - 1); nothing changed.
        """
        item = self._item(item)
        count = check_int(stripes, "stripes", 1, MAX_STRIPES)
        conn = self._conn(session)
        pick = pick_for(_kernel.backend(conn.dialect))
        outcome, total = restripe(pick, conn, self.name, item, count, self.target.name)
        return self._result(session, outcome, item, total)

    restripe = dual_method(_restripe, operation="striped.restripe")
