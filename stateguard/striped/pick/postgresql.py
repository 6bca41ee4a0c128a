"""PostgreSQL (and the databases that speak its SQL): the pick is one statement.

``UPDATE ... WHERE stripe = (SELECT ... FOR UPDATE SKIP LOCKED) RETURNING``
picks a free stripe that holds the change, starting at a random one, and
changes it.  A decrement no free stripe took reads the stripes without locks
(READ COMMITTED shows the latest committed rows) and either answers
INSUFFICIENT at once, waits for one busy stripe that holds it, or gathers it
from the stripes nobody holds, each attempt in a savepoint
(:meth:`PostgreSQLPick.when_busy`); the ordered sweep is the last resort.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Final

from sqlalchemy import Connection, Select, bindparam, select
from sqlalchemy.dialects import postgresql

from ... import _kernel
from ...exceptions import DeadlockDetected
from ...result import Outcome
from ...tables import counter_stripes
from ..limits import GATE
from ..statements import HINTS, ITEM_STRIPES, SAME_ITEM, item_params
from .base import OneStatementPick, Taken

#: Rounds of a decrement no free stripe took (read, then wait for one stripe or take from the
#: free ones) before the ordered sweep.
WAITS: Final = 8


def gate_statement() -> postgresql.Insert:
    """Make the item's gate row, or lock the one there exclusively, waiting for the restripe that
    holds it: ``INSERT ... ON CONFLICT DO UPDATE``, one statement either way."""
    values = {"counter": bindparam("sg_counter"), "item": bindparam("sg_item"), "stripe": GATE}
    return (
        postgresql.insert(counter_stripes)
        .values({**values, "stripes": 0, "amount": 0})
        .on_conflict_do_update(
            index_elements=list(counter_stripes.primary_key), set_={"amount": counter_stripes.c.amount}
        )
    )


def free_statement() -> Select[Any, Any]:
    """The stripes of the item no other transaction holds, locked (``SKIP LOCKED``), in stripe order."""
    return (
        select(counter_stripes.c.stripe, counter_stripes.c.amount)
        .where(*ITEM_STRIPES)
        .order_by(counter_stripes.c.stripe)
        .with_for_update(skip_locked=True)
    )


def lock_one_statement() -> Select[Any]:
    """Lock one stripe (``:stripe``), waiting for the transaction that holds it."""
    one = counter_stripes.c.stripe == bindparam("sg_stripe")
    return select(counter_stripes.c.stripe).where(*SAME_ITEM, one).with_for_update()


class PostgreSQLPick(OneStatementPick):
    """The pick of PostgreSQL's SQL: ``FOR UPDATE SKIP LOCKED`` inside the UPDATE."""

    def __init__(self, backend: _kernel.Backend) -> None:
        super().__init__(backend, locks=True)
        self.gate = gate_statement()
        self.free = free_statement()
        self.lock_one = lock_one_statement()

    def hold_gate(self, conn: Connection, params: Mapping[str, Any]) -> None:
        _kernel.execute(conn, self.gate, params)

    def when_busy(self, conn: Connection, counter: str, item: str, by: int) -> Taken | None:
        """Decide a decrement no free stripe took, never waiting while holding what it took.

        Each round reads the stripes without locks (READ COMMITTED: the latest committed rows;
        those of uncommitted decrements still show their units).  A total below ``by`` is
        INSUFFICIENT then and there.  If a stripe holds ``by``, wait for it alone, as a
        single-row counter would.  Otherwise (stock spread thinner than ``by``) lock the stripes
        nobody holds (``SKIP LOCKED``) and take ``by`` from them if they hold it; if not, give
        them back and wait for a stripe with units that another transaction holds, then read
        again.  Every attempt runs in a savepoint, rolled back when it does not apply (which
        frees what it locked).

        So this waits only while holding nothing of the item but what its transaction held
        before (a stripe its fast path re-checked after a concurrent commit stays locked:
        PostgreSQL keeps the lock of a row whose newest version failed the re-check), and a
        transaction waiting for it never waits for this one's gathered stripes.  A deadlock here
        therefore runs through such an earlier lock, which no savepoint frees: the victim rolls
        back to its savepoint and raises DeadlockDetected at once (retrying in the same
        transaction would meet the same cycle, one ``deadlock_timeout`` a round).  ``None``
        (nothing changed) after :data:`WAITS` rounds or for an item that is not there.

        :raises DeadlockDetected: chosen as a deadlock victim; nothing changed by this call.
        """
        params = item_params(counter, item, sg_by=by)
        for _ in range(WAITS):
            rows = _kernel.execute(conn, HINTS, params).all()
            if not rows:
                return None
            total = sum(int(row.amount) for row in rows)
            if total < by:
                return Outcome.INSUFFICIENT, total
            holding = [row.stripe for row in rows if row.amount >= by]
            savepoint = conn.begin_nested()
            try:
                if holding:
                    one = {**params, "sg_stripe": random.choice(holding)}
                    applied = _kernel.run_guarded(conn, self.decrement_one, one, returning=self.returning)[0]
                else:
                    free = _kernel.execute(conn, self.free, params).all()
                    applied = self.take_from(conn, counter, item, free, by)
                    if not applied:
                        savepoint.rollback()
                        savepoint = conn.begin_nested()
                        mine = {row.stripe for row in free}
                        busy = [row for row in rows if row.amount > 0 and row.stripe not in mine]
                        if busy:
                            # Any busy stripe will do (a commit there is what this waits for); a
                            # random one, so a deadlock victim does not wait for the same again.
                            one = {**params, "sg_stripe": random.choice(busy).stripe}
                            _kernel.execute(conn, self.lock_one, one).all()
            except DeadlockDetected:
                # This waited holding nothing taken in the savepoint, so the cycle runs through a
                # lock its transaction held before (a stripe its fast path examined, an earlier
                # decrement, the caller's own rows): waiting again would meet the same cycle.  The
                # transaction stays usable; the caller's retry holds nothing.
                savepoint.rollback()
                raise
            except BaseException:
                _kernel.abandon_savepoint(savepoint)
                raise
            if applied:
                savepoint.commit()
                return Outcome.APPLIED, None
            savepoint.rollback()  # frees a stripe that no longer holds ``by``, or the one waited for
        return None
