"""MariaDB and MySQL (InnoDB): the pick is a locking read of named stripes, then an UPDATE.

InnoDB cannot UPDATE a table it reads in a subquery (error 1093), so the pick
is ``SELECT ... FOR UPDATE SKIP LOCKED`` of the item's stripes named one by
one (``stripe IN (...)``: those at or below a random start first, then the
rest), then ``UPDATE`` of the stripe it locked.  Named, not a range: in
REPEATABLE READ a locking range scan also locks the record that ends it (a
stripe it did not return, or the next item's) until COMMIT, and two buyers
holding such strays deadlocked with plenty of stock.  The names come from the
stripe count this process last saw on the item's rows (:data:`stripe_counts`).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Mapping, Sequence
from typing import Any, Final

from sqlalchemy import Connection, Select, bindparam, desc, select
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import mysql

from ... import _kernel
from ...exceptions import LockNotAcquired
from ...result import Outcome
from ...tables import counter_stripes
from ..limits import GATE, MAX_AMOUNT, SPACE, ids_of
from ..statements import HINTS, SAME_ITEM, SWEPT, fits, insert_rows, item_params, stripe_0
from .base import Pick, Rows, Taken

#: Each item's stripe count as this process last saw it, keyed by (counter, item), for naming
#: the stripes one by one.  A hint: a stale one (another process restriped) costs a slower path
#: once, never a wrong answer: stripe 0 is among every item's stripes and every row carries the
#: true count, which the caller then remembers.
stripe_counts: Final = _kernel.Memo(4096)


def named(stmt: Select[Any, Any, Any]) -> Select[Any, Any, Any]:
    """``stmt`` reading only the stripes named in ``:ids``, each looked up by its whole key.

    A whole key looked up by equality is locked alone, or (skipped or missing) only the gap
    before the next record, which no UPDATE waits for.  The optimizer must not turn the lookups
    back into a scan of the item: ``BETWEEN`` for the item's columns leaves it no equality on a
    prefix of the key to scan by ("ref" access, which it chose for some small tables), and
    ``FORCE INDEX`` no table scan.
    """
    return stmt.with_hint(counter_stripes, "FORCE INDEX (PRIMARY)").where(
        counter_stripes.c.counter.between(bindparam("sg_counter"), bindparam("sg_counter")),
        counter_stripes.c.item.between(bindparam("sg_item"), bindparam("sg_item")),
        counter_stripes.c.stripe.in_(bindparam("sg_ids", expanding=True)),
    )


def pick_among_statement(sign: int) -> Select[Any, Any]:
    """The last free stripe of ``:ids`` the change fits, and the item's stripe count."""
    return (
        named(select(counter_stripes.c.stripe, counter_stripes.c.stripes))
        .where(fits(sign))
        .order_by(desc(counter_stripes.c.stripe))
        .limit(1)
        .with_for_update(skip_locked=True)
    )


def named_sweep_statement() -> Select[Any, Any, Any]:
    """The stripes of ``:ids``, each by its whole key, locked in stripe order."""
    return named(select(*SWEPT)).order_by(counter_stripes.c.stripe).with_for_update()


def gate_statement() -> mysql.Insert:
    """Make the item's gate row, or lock the one there exclusively, waiting for the restripe (or
    the waiting decrements) that hold it: ``INSERT ... ON DUPLICATE KEY UPDATE``."""
    values = {"counter": bindparam("sg_counter"), "item": bindparam("sg_item"), "stripe": GATE}
    return (
        mysql.insert(counter_stripes)
        .values({**values, "stripes": 0, "amount": 0})
        .on_duplicate_key_update(amount=counter_stripes.c.amount)
    )


def gate_shared_statement() -> Select[Any]:
    """The item's gate row locked shared, or refused at once (``NOWAIT``) while a restripe holds
    it or waits for it (see :meth:`InnoDBPick.restripe_under_way`)."""
    return (
        select(counter_stripes.c.stripe)
        .where(*SAME_ITEM, counter_stripes.c.stripe == GATE)
        .with_for_update(read=True, nowait=True)
    )


class InnoDBPick(Pick):
    """The pick of InnoDB: a ``SKIP LOCKED`` read of named stripes, the UPDATE of the one locked.

    A stripe the pick examines and finds short stays locked until the end of the transaction
    (REPEATABLE READ keeps the locks of rows a locking read examined): other buyers skip it.
    """

    def __init__(self, backend: _kernel.Backend) -> None:
        super().__init__(backend)
        self.take_among = pick_among_statement(-1)
        self.add_among = pick_among_statement(1)
        # The UPDATE read the latest committed row; a plain SELECT would read the snapshot.
        self.stripe_0 = stripe_0(locking_read=True)
        self.named_sweep = named_sweep_statement()
        self.gate = gate_statement()
        self.gate_shared = gate_shared_statement()

    def ids(self, counter: str, item: str) -> tuple[int, ...]:
        """The item's stripe ids as last seen; just stripe 0 (every item's) before that."""
        stripes = stripe_counts.get((counter, item))
        return ids_of(stripes) if stripes is not None else (0,)

    def saw(self, counter: str, item: str, stripes: int) -> None:
        if stripe_counts.get((counter, item)) != stripes:
            stripe_counts.put((counter, item), stripes)

    def fast(self, conn: Connection, counter: str, item: str, by: int, sign: int) -> bool:
        return self.fast_among(conn, counter, item, by, sign, self.ids(counter, item))

    def fast_among(
        self, conn: Connection, counter: str, item: str, by: int, sign: int, ids: tuple[int, ...]
    ) -> bool:
        """:meth:`fast` over the stripes ``ids``: those at or below a random start, then the rest."""
        start = random.randrange(SPACE)
        params = item_params(counter, item, sg_by=by, sg_room=MAX_AMOUNT - by, sg_start=start)
        stmt = self.take_among if sign < 0 else self.add_among
        cut = bisect.bisect_right(ids, start)
        for part in (ids[:cut], ids[cut:]):
            row = _kernel.execute(conn, stmt, {**params, "sg_ids": part}).first() if part else None
            if row is not None:
                # The locked row's count is the latest (the ids named may be the snapshot's).
                self.saw(counter, item, row.stripes)
                return self.change_picked(conn, params, row.stripe, sign)
        return False

    def sweep_once(self, conn: Connection, counter: str, item: str) -> Rows:
        """Stripe 0, then the stripes its count names (:meth:`lock_named`).

        Stripes named from a count seen earlier may have been deleted by a restripe since, and
        the locks of deleted rows live on: a buyer whose wait for such a stripe ended when the
        restripe committed keeps it (InnoDB locks the delete-marked record and REPEATABLE READ
        keeps the lock), so a sweep naming it waited for that buyer while holding stripe 0, which
        the buyer's own sweep then waited for (deadlocks of decrements queued behind a restripe).
        """
        return self.lock_named(conn, counter, item)

    def hold_gate(self, conn: Connection, params: Mapping[str, Any]) -> None:
        _kernel.execute(conn, self.gate, params)

    def add_stripes(self, conn: Connection, rows: Sequence[Mapping[str, Any]]) -> set[int]:
        """Insert new stripes; an id taken already makes InnoDB roll back the whole statement
        (duplicate key, 1062; the transaction stays usable) and nothing is inserted."""
        try:
            _kernel.execute(conn, insert_rows(rows))
        except sa_exc.IntegrityError as error:
            if _kernel.is_duplicate_key(error):
                return set()
            raise
        return {int(row["sg_stripe"]) for row in rows}

    def when_busy(self, conn: Connection, counter: str, item: str, by: int) -> Taken | None:
        """Wait for one busy stripe that holds ``by``, as a single-row counter would.

        The fast path fails when every stripe that holds ``by`` is held by another buyer (the
        common case under load) or when none holds it (stock low, ``by`` large).  A read without
        locks tells them apart, instead of locking every stripe (which would make everyone after
        it wait for all of them).  When the read shows the fast path named the stripes of a stale
        count, it tries them all first.  ``None`` (nothing changed): no stripe seemed to hold
        ``by``, or the one waited for no longer does; the sweep decides.  No savepoint: InnoDB
        rolls a deadlock victim's whole transaction back.  The read only picks the stripe:
        REPEATABLE READ's plain reads show the transaction's first snapshot.
        """
        params = item_params(counter, item, sg_by=by)
        rows = _kernel.execute(conn, HINTS, params).all()
        # The fast path named the stripes of another count (stripe 0 alone, the first time): name
        # the snapshot's before waiting for one.  Not remembered: the snapshot may predate a
        # restripe whose count this process already saw.  The pick's locked row carries the
        # latest count, which fast_among remembers.
        stale = rows and stripe_counts.get((counter, item)) != rows[0].stripes
        if stale and self.fast_among(conn, counter, item, by, -1, ids_of(rows[0].stripes)):
            return Outcome.APPLIED, None
        candidates = [row.stripe for row in rows if row.amount >= by]
        if not candidates:
            return None
        params["sg_stripe"] = random.choice(candidates)
        if params["sg_stripe"] != 0 and self.restripe_under_way(conn, counter, item):
            # The stripe, read from this transaction's snapshot, may be one that restripe is
            # inserting; stripe 0 never is (and the sweep starts with it).
            if 0 not in candidates:
                return None
            params["sg_stripe"] = 0
        applied = _kernel.run_guarded(conn, self.decrement_one, params, returning=self.returning)[0]
        return (Outcome.APPLIED, None) if applied else None

    def restripe_under_way(self, conn: Connection, counter: str, item: str) -> bool:
        """Whether a restripe of the item holds (or waits for) its gate; if not, none can start
        before this transaction ends.

        A decrement waiting for a busy stripe picked from its snapshot (which may be older than
        the last restripe) could pick one that a restripe under way is inserting again, while
        the decrement holds a lock where that restripe inserts next (a stripe its fast path named
        that the item did not have, or a deleted one): a deadlock.  So it first takes the gate
        shared without waiting (``LOCK IN SHARE MODE NOWAIT``, one statement on this slow path):
        refused means a restripe holds it or is queued for it, and the decrement waits for stripe
        0 instead, which no restripe inserts and one holds only after its inserts.  Granted, the
        shared lock keeps restripes out until this transaction ends (InnoDB queues record locks
        in order: once a restripe waits for the gate, a later shared request conflicts with it).
        An item not yet restriped has no gate row: the read then locks the gap where it goes, and
        a first restripe queued there may start while this transaction holds that gap lock; but
        the stripes of such an item never changed, so no snapshot shows one it inserts (an item
        restriped only by a stateguard without the gate is the exception, until its next
        restripe).
        """
        try:
            _kernel.execute(conn, self.gate_shared, item_params(counter, item)).all()
        except LockNotAcquired:
            return True
        return False
