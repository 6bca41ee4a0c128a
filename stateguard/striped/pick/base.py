"""The one interface behind which each dialect family picks, waits for and locks stripes.

The striped counter's algorithm (:mod:`stateguard.striped.take`,
:mod:`stateguard.striped.restripe`) is written once against :class:`Pick`;
a family's module implements the few steps where the databases really
differ (how a free stripe is found, what a decrement no free stripe took
does next, how the stripes are swept in one order, how restripes queue) and
inherits the steps they share.  One instance exists per
:class:`~stateguard._sql.Backend` (:func:`stateguard.striped.pick.pick_for`).
"""

from __future__ import annotations

import abc
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Final

from sqlalchemy import Connection, Row, Select, Update
from sqlalchemy import exc as sa_exc
from sqlalchemy.sql.dml import ReturningUpdate

from ... import _kernel
from ...exceptions import DeadlockDetected
from ...result import Outcome
from ...tables import counter_stripes
from ..limits import MAX_AMOUNT, SPACE, ids_of
from ..statements import (
    by_stripe,
    item_params,
    pick_and_change,
    stripe_0,
    stripe_values,
    sweep_every,
    sweep_named,
)

#: What a decrement came to: ``(APPLIED, None | total left)``, ``(INSUFFICIENT, total)`` or
#: ``(NOT_FOUND, None)``.
Taken = tuple[Outcome, int | None]
#: Stripes read by a sweep: ``stripe``, ``stripes`` (the item's count), ``amount``.
Rows = Sequence[Row[Any]]

#: Fresh reads of an item's stripes when they disagree with its stripe count (a concurrent restripe).
SWEEPS: Final = 5
#: Sweeps of a slow-path decrement chosen as a deadlock victim where the transaction survives it
#: (each costs one ``deadlock_timeout``); then DeadlockDetected, for the caller to retry.
DEADLOCK_SWEEPS: Final = 3


class Pick(abc.ABC):
    """How one dialect family finds, waits for and locks the stripes of an item.

    Subclasses implement :meth:`fast`, :meth:`sweep_once` and
    :meth:`hold_gate`, and may override :meth:`when_busy`,
    :meth:`add_stripes`, :meth:`guard_sweep` and :meth:`saw`; the statements
    they share are built once, in ``__init__``::

        pick = pick_for(_kernel.backend(conn.dialect))
        if not pick.fast(conn, "stock", "sku-1", 1, -1):
            ...
    """

    #: Whether restripes queue on the item's gate row (row locks); without row locks the
    #: database's one write lock is the gate.
    has_gate: ClassVar[bool] = True

    def __init__(self, backend: _kernel.Backend) -> None:
        self.backend = backend
        #: The UPDATEs of this backend say what they changed with RETURNING (else the row count).
        self.returning = backend.returning
        #: Take ``:by`` from ``:stripe`` / add it, only if the change fits the stripe.
        self.decrement_one: Update | ReturningUpdate[Any] = by_stripe(
            returning=self.returning, sign=-1, guarded=True
        )
        self.increment_one: Update | ReturningUpdate[Any] = by_stripe(
            returning=self.returning, sign=1, guarded=True
        )
        #: Take ``:by`` from ``:stripe``, a stripe this transaction locked and read.
        self.take_exactly: Update | ReturningUpdate[Any] = by_stripe(
            returning=self.returning, sign=-1, guarded=False
        )
        #: Stripe 0's amount, as the increment's UPDATE of it saw it.
        self.stripe_0: Select[Any] = stripe_0(locking_read=False)
        #: The stripes named in ``:ids``, locked in stripe order (restripe; InnoDB's sweep).
        self.named_sweep: Select[Any, Any, Any] = sweep_named(locks=True)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} for {self.backend.name}>"

    # -- what each family implements ------------------------------------------

    @abc.abstractmethod
    def fast(self, conn: Connection, counter: str, item: str, by: int, sign: int) -> bool:
        """Change one free stripe the change fits (holding ``by`` for a decrement, room for it
        for an increment), starting at a random one; whether one was found."""

    def when_busy(self, conn: Connection, counter: str, item: str, by: int) -> Taken | None:
        """A decrement no free stripe took: decide it without the ordered sweep where the family
        can; ``None`` (nothing changed): the sweep decides.  By default, the sweep."""
        return None

    @abc.abstractmethod
    def sweep_once(self, conn: Connection, counter: str, item: str) -> Rows:
        """One sweep: the item's stripes locked in stripe order (``[]``: no such item)."""

    @abc.abstractmethod
    def hold_gate(self, conn: Connection, params: Mapping[str, Any]) -> None:
        """Restripe: wait until no other restripe of the item is under way, and keep the others
        out until this transaction ends."""

    def add_stripes(self, conn: Connection, rows: Sequence[Mapping[str, Any]]) -> set[int]:
        """Restripe, before it locks anything: insert new stripes; the ids it inserted.

        An id taken already (only when the plan came from a snapshot older than the last
        restripe's commit) is left alone (``ON CONFLICT DO NOTHING``); the caller inserts what
        is still missing once it holds the stripes.
        """
        stmt = _kernel.insert_or_skip(self.backend, counter_stripes).values(stripe_values(rows))
        return set(_kernel.execute(conn, stmt.returning(counter_stripes.c.stripe)).scalars())

    def saw(self, counter: str, item: str, stripes: int) -> None:
        """Note the stripe count a row of the item carried (a hint some families name stripes by)."""
        return None

    def guard_sweep(self, conn: Connection, sweep: Callable[[], Taken]) -> Taken:
        """Run the slow path's ``sweep`` so that a deadlock does not end the caller's transaction.

        In a savepoint: a stripe this transaction's fast path examined stays locked, so two
        sweeps can deadlock.  PostgreSQL aborts only the victim's statement, and ROLLBACK TO
        SAVEPOINT releases the locks its sweep took, so the other one goes on and the victim
        sweeps again; when what the other waits for is a stripe the victim held before its
        savepoint, no rollback to it frees that, and after :data:`DEADLOCK_SWEEPS` rounds the
        retryable DeadlockDetected propagates.  InnoDB rolls the victim's whole transaction
        back: the rollback to the savepoint then fails, and DeadlockDetected propagates at once.
        """
        for attempt in range(DEADLOCK_SWEEPS):
            savepoint = conn.begin_nested()
            try:
                found = sweep()
            except DeadlockDetected as deadlock:
                if attempt == DEADLOCK_SWEEPS - 1:
                    _kernel.abandon_savepoint(savepoint)
                    raise
                try:
                    savepoint.rollback()
                except sa_exc.DBAPIError:
                    # The database ended the whole transaction (InnoDB): the caller retries it.
                    raise deadlock from None
                continue
            except BaseException:
                _kernel.abandon_savepoint(savepoint)
                raise
            savepoint.commit()
            return found
        raise AssertionError("unreachable")  # pragma: no cover

    # -- what every family shares ------------------------------------------------

    def lock_all(self, conn: Connection, counter: str, item: str) -> Rows:
        """Every stripe of the item, locked in stripe order; ``[]`` when the item does not exist.

        A statement whose snapshot predates a committed restripe misses the stripes it
        inserted (PostgreSQL, READ COMMITTED: a locked row is re-read at its latest version, a
        new row is not seen); the stripe count on the rows then disagrees with the rows found,
        and a fresh sweep sees them all.
        """
        rows: Rows = []
        for _ in range(SWEEPS):
            rows = self.sweep_once(conn, counter, item)
            # Stripe 0 is updated in place by a restripe, so a missing item is truly missing.
            if not rows:
                break
            self.saw(counter, item, rows[0].stripes)
            if len(rows) == rows[0].stripes:
                break
        return rows

    def lock_named(self, conn: Connection, counter: str, item: str) -> Rows:
        """Lock stripe 0, then the other stripes of the count it carries, by name (restripe's sweep:
        the new stripes it inserted are not among them).

        Stripe 0 is every item's, and a restripe deletes stripes, and commits the ones it
        inserted, only while holding it; so while this transaction holds it, the count on it
        names exactly the committed stripes.  Two statements where the count last seen would
        have done with one: this is the slow path.
        """
        params = item_params(counter, item, sg_ids=(0,))
        first = _kernel.execute(conn, self.named_sweep, params).all()
        if not first:
            return first
        self.saw(counter, item, first[0].stripes)
        rest = ids_of(first[0].stripes)[1:]
        if not rest:
            return first
        params["sg_ids"] = rest
        return [*first, *_kernel.execute(conn, self.named_sweep, params).all()]

    def change_picked(self, conn: Connection, params: Mapping[str, Any], stripe: int, sign: int) -> bool:
        """Change ``stripe``, which this transaction just picked and locked: the UPDATE cannot miss it."""
        stmt = self.decrement_one if sign < 0 else self.increment_one
        return _kernel.run_guarded(conn, stmt, {**params, "sg_stripe": stripe}, returning=self.returning)[0]

    def take_from(self, conn: Connection, counter: str, item: str, rows: Rows, by: int) -> bool:
        """Take ``by`` from ``rows`` (stripes this transaction locked), the fullest first: the fewest
        UPDATEs, and stripes stay even.  ``False`` (nothing changed) when they hold less."""
        if sum(int(row.amount) for row in rows) < by:
            return False
        takes: dict[int, int] = {}
        left = by
        for row in sorted(rows, key=lambda row: -int(row.amount)):
            take = min(left, max(int(row.amount), 0))
            if take:
                takes[row.stripe] = take
                left -= take
            if not left:
                break
        for stripe, take in takes.items():
            _kernel.execute(conn, self.take_exactly, item_params(counter, item, sg_by=take, sg_stripe=stripe))
        return True


class OneStatementPick(Pick):
    """The families whose pick is one statement that finds a free stripe and changes it, and whose
    sweep reads every stripe of the item: PostgreSQL (``locks``: ``SKIP LOCKED`` and ``FOR UPDATE``)
    and SQLite (no row locks: its one writer holds the whole database)."""

    def __init__(self, backend: _kernel.Backend, *, locks: bool) -> None:
        super().__init__(backend)
        self.take_any = pick_and_change(skip_locked=locks, sign=-1)
        self.add_any = pick_and_change(skip_locked=locks, sign=1)
        self.every_sweep = sweep_every(locks=locks)

    def fast(self, conn: Connection, counter: str, item: str, by: int, sign: int) -> bool:
        params = item_params(
            counter, item, sg_by=by, sg_room=MAX_AMOUNT - by, sg_start=random.randrange(SPACE)
        )
        stmt = self.take_any if sign < 0 else self.add_any
        return _kernel.execute(conn, stmt, params).first() is not None

    def sweep_once(self, conn: Connection, counter: str, item: str) -> Rows:
        return _kernel.execute(conn, self.every_sweep, item_params(counter, item)).all()
