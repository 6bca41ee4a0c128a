"""Striped counters: one hot item's amount split over K rows, so K buyers take stock at once.

A guarded counter (:mod:`stateguard.counters`) is one row: every buyer's
UPDATE holds that row's lock until its transaction commits, so one hot item
serialises all of them whatever the statement.  A :class:`StripedCounter`
keeps an item's amount in K rows ("stripes") of ``stateguard_counter_stripes``
and a decrement takes from one stripe that nobody else holds:

- PostgreSQL, one statement::

      UPDATE stateguard_counter_stripes SET amount = amount - :by
      WHERE counter = :c AND item = :i AND amount >= :by AND stripe = (
          SELECT stripe FROM stateguard_counter_stripes
          WHERE counter = :c AND item = :i AND amount >= :by
          ORDER BY stripe > :start, stripe DESC LIMIT 1
          FOR UPDATE SKIP LOCKED)
      RETURNING amount

  The subselect starts at a random stripe (the last one at or below a random
  ``:start``; stripe ids are spread evenly over ``[0, 2**20)``) and
  ``SKIP LOCKED`` passes over stripes another transaction holds.
- MariaDB cannot UPDATE a table it reads in a subquery (error 1093), so the
  same pick is a ``SELECT ... FOR UPDATE SKIP LOCKED`` (10.6+) of the
  item's stripes named one by one (``stripe IN (...)``, those at or below
  ``:start`` first, then the rest), then ``UPDATE`` of that stripe: two
  statements.  Not a range: in REPEATABLE READ a locking range scan also
  locks the record that ends it (a stripe it did not return, or the next
  item's), until COMMIT, and two buyers holding such strays deadlocked
  with plenty of stock.  The ids come from the stripe count this process
  last saw on the item's rows (stripe 0 alone the first time).  A short
  stripe the pick examines stays locked until the end of the transaction
  (REPEATABLE READ keeps the locks of rows a locking read examined):
  other buyers skip it.
- SQLite has one writer: the PostgreSQL statement without ``FOR UPDATE``.
  Striping buys nothing there (every write holds the whole database until
  COMMIT); it stays correct.

When no free stripe holds ``by``, a read without locks tells why:

- PostgreSQL (plain reads see the latest committed rows; those of
  uncommitted decrements still show their units): a total below ``by`` is
  INSUFFICIENT then and there, with no lock taken.  If some stripe holds
  ``by`` but another buyer has it locked (the common case under load), the
  decrement waits for that one stripe, as a single-row counter would.
  Otherwise (stock spread thinner than ``by``) it locks the stripes nobody
  holds (``SKIP LOCKED``) and takes ``by`` from them, the fullest first; if
  they hold less, it gives them back and waits for a stripe with units
  that another transaction holds, then reads again.  Each attempt runs in a
  savepoint, rolled back when it does not apply (which frees what it
  locked).  So a decrement waits only while holding nothing of the item
  but what its transaction held before, and no two decrements wait for
  each other's gathered stripes.  What a transaction held before includes
  a stripe its fast path examined: PostgreSQL keeps the lock of a row whose
  newest version, committed just before it was locked, failed the
  re-check, and no savepoint taken after that can free it.  A deadlock
  met while waiting here runs through such an earlier lock (or the
  caller's own): the victim raises the retryable
  :class:`~stateguard.DeadlockDetected` at once, after one
  ``deadlock_timeout``, since waiting again in the same transaction would
  meet the same cycle.  Locking every stripe in order, as before, made two
  decrements holding such stripes wait for each other every round.
- MariaDB: if some stripe holds ``by`` but is locked, the decrement waits
  for it (REPEATABLE READ's plain reads show the transaction's first
  snapshot: the read only picks the stripe).

Otherwise, or after a few rounds on PostgreSQL, the slow path locks every
stripe of the item in stripe order (``SELECT ... ORDER BY stripe FOR
UPDATE``, waiting; on MariaDB stripe 0 first, then the stripes its count
names, never a stripe a restripe deleted), and takes ``by`` from as many stripes as needed:
INSUFFICIENT only when the whole item lacks it.  Everyone who locks several
stripes takes them in the same order, a fast-path buyer holds one stripe
and waits for nothing, and one waiting for a single stripe holds no other,
so they cannot deadlock one another, except through a stripe a fast path
left locked (InnoDB keeps the locks of the rows a locking read examined).
On PostgreSQL the sweep runs in a savepoint: a victim rolls back to it,
which frees what it locked there, and sweeps again (no error, one
``deadlock_timeout`` of waiting); after ``_DEADLOCK_SWEEPS`` rounds, or at
once on MariaDB (InnoDB rolls the victim's whole transaction back), it
raises the retryable :class:`~stateguard.DeadlockDetected`
(``retry_on_conflict`` retries it; the retry is a new transaction and holds
nothing).  That happens only when stock runs low.

:meth:`StripedCounter.restripe` first takes the item's gate exclusively
(a row of the item that is no stripe: stripe ``-1``, amount 0, made by the
item's first restripe; reads over the item's stripes leave it out), so
restripes of one item run one after another; then it inserts its new
stripes (amount 0, not yet committed: decrements skip them), and only then
locks stripe 0 and the stripes its count names, in stripe order, and
spreads the total over the new count.  Inserting first keeps it out of
deadlocks on MariaDB: a decrement keeps an InnoDB lock where it looked up
a stripe the item no longer has, or not yet (a gap lock, or the deleted
row's lock when its wait ended on a stripe a restripe deleted), until it
commits, and an INSERT there waits for it.  A restripe that inserted while
holding the stripes waited for a decrement that waited for one of them; now
it waits holding only the gate and its new rows.  For the same reason a
MariaDB decrement about to wait for a busy stripe (picked from its
snapshot, which may show a stripe a restripe under way is inserting again)
first takes the gate shared without waiting, and waits for stripe 0 instead
while a restripe holds it.  One corner keeps the old exposure: a restripe in
a transaction whose snapshot is older than the last restripe's commit
(MariaDB, REPEATABLE READ) plans from that snapshot and inserts what it
finds still missing once it holds the stripes.

``ref=`` uses the same idempotent ledger as the guarded counters
(``stateguard_counter_ledger``, table name ``stateguard_counter_stripes``,
the counter's name as column): a ref applies once, whatever happens, and is
REPEATED on redelivery; :meth:`StripedCounter.release` gives back what a ref
took.
"""

from __future__ import annotations

import bisect
import functools
import json
import random
from collections.abc import Mapping, Sequence
from typing import Any, Final

from sqlalchemy import Connection, bindparam, delete, desc, insert, select, update
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import mysql, postgresql
from sqlalchemy.orm import Session

from . import _kernel
from ._async import dual_method
from .counters import (
    LedgerTarget,
    Shortfall,
    ledger_claim,
    ledger_forget,
    ledger_release,
    reserve_all,
)
from .exceptions import DeadlockDetected, InvalidArgument, LockNotAcquired
from .result import Outcome, Result
from .tables import DIGEST_PREFIX, MAX_REF, counter_stripes, row_key

__all__ = ["MAX_ITEM", "MAX_STRIPES", "StripedCounter"]

#: The most stripes an item can have.
MAX_STRIPES: Final = 1024
#: Longest item key accepted (characters).
MAX_ITEM: Final = 200
#: Longest counter name accepted (characters).
MAX_NAME: Final = 100
#: Stripe ids are spread over [0, SPACE): stripe i of K is ``i * SPACE // K``.
SPACE: Final = 1 << 20
#: The largest amount a stripe (a BIGINT) holds.
MAX_AMOUNT: Final = (1 << 63) - 1
#: Fresh reads of an item's stripes when they disagree with its stripe count (a concurrent restripe).
_SWEEPS: Final = 5
#: Sweeps of a slow-path decrement chosen as a deadlock victim where the transaction survives it
#: (each costs one ``deadlock_timeout``); then DeadlockDetected, for the caller to retry.
_DEADLOCK_SWEEPS: Final = 3
#: Rounds of a PostgreSQL decrement no free stripe took (read, then wait for one stripe or take
#: from the free ones) before the ordered sweep.
_WAITS: Final = 8

#: InnoDB: each item's stripe count as this process last saw it, keyed by (counter, item), for
#: naming the stripes one by one (see :func:`_pick_among`).  A hint: a stale one (another process
#: restriped) costs a slower path once, never a wrong answer: stripe 0 is among every item's
#: stripes and every row carries the true count, which the caller then remembers.
_counts: Final = _kernel.Memo(4096)

#: Marks a ledger ``row_key`` that holds an item as given rather than as JSON (see :func:`_ledger_key`).
_AS_GIVEN: Final = "="

_s = counter_stripes
_same_item = (_s.c.counter == bindparam("sg_counter"), _s.c.item == bindparam("sg_item"))
#: The stripes of the item, not its restripe gate (see :data:`_GATE`), for the reads that range
#: over the item.
_item_stripes = (*_same_item, _s.c.stripe >= 0)


@functools.lru_cache(maxsize=256)
def _ids_of(stripes: int) -> tuple[int, ...]:
    return tuple(stripe_ids(stripes))


def stripe_ids(stripes: int) -> list[int]:
    """The stripe ids of an item with ``stripes`` stripes (stripe 0 always exists)."""
    return [i * SPACE // stripes for i in range(stripes)]


def _memo(kind: str, backend: _kernel.Backend, build: Any) -> Any:
    return _kernel.memo.get_or_build(("striped", kind, backend), build)


def _fits(sign: int) -> Any:
    """A stripe the change fits: holding ``:by`` (a decrement), or with room for it below
    :data:`MAX_AMOUNT` (an increment: ``amount <= :room``, ``:room`` = MAX_AMOUNT - by, so the
    statement never computes a value a BIGINT cannot hold)."""
    if sign < 0:
        return _s.c.amount >= bindparam("sg_by")
    return _s.c.amount <= bindparam("sg_room")


def _pick(backend: _kernel.Backend, wrap: bool | None, sign: int) -> Any:
    """The stripe a change starts at: the last one at or below ``:start`` (``wrap``: above it;
    ``None``: either, at or below first), free (``SKIP LOCKED``) and one the change fits."""
    start: Any = bindparam("sg_start")
    # A decrement's ``amount >= :by`` (1 or more) never matches the restripe gate (amount 0);
    # an increment's room would.
    where = [*(_same_item if sign < 0 else _item_stripes), _fits(sign)]
    if wrap is None:
        order: list[Any] = [_s.c.stripe > start, desc(_s.c.stripe)]
    else:
        where.append(_s.c.stripe > start if wrap else _s.c.stripe <= start)
        order = [desc(_s.c.stripe)]
    stmt = select(_s.c.stripe).where(*where).order_by(*order).limit(1)
    if backend.row_locks:
        stmt = stmt.with_for_update(skip_locked=True)
    return stmt


def _named(stmt: Any) -> Any:
    """InnoDB: ``stmt`` reads only the stripes named in ``:ids``, each looked up by its whole key.

    Not a range of stripes: in REPEATABLE READ a locking range scan also locks the record
    that ends it (a stripe it skipped past, or the next item's) until COMMIT, though it returned
    nothing from it, and two buyers holding such strays waited for each other with plenty of
    stock (a deadlock).  A whole key looked up by equality is locked alone, or (skipped or
    missing) only the gap before the next record, which no UPDATE waits for.  The optimizer
    must not turn the lookups back into a scan of the item: ``BETWEEN`` for the item's columns
    leaves it no equality on a prefix of the key to scan by ("ref" access, which it chose for
    some small tables), and ``FORCE INDEX`` no table scan.
    """
    return stmt.with_hint(_s, "FORCE INDEX (PRIMARY)").where(
        _s.c.counter.between(bindparam("sg_counter"), bindparam("sg_counter")),
        _s.c.item.between(bindparam("sg_item"), bindparam("sg_item")),
        _s.c.stripe.in_(bindparam("sg_ids", expanding=True)),
    )


def _pick_among(sign: int) -> Any:
    """InnoDB: the last free stripe of ``:ids`` the change fits, and the item's stripe count
    (see :func:`_named`)."""
    return _kernel.memo.get_or_build(
        ("striped", "pick-among", sign),
        lambda: (
            _named(select(_s.c.stripe, _s.c.stripes))
            .where(_fits(sign))
            .order_by(desc(_s.c.stripe))
            .limit(1)
            .with_for_update(skip_locked=True)
        ),
    )


def _one_statement(backend: _kernel.Backend, sign: int) -> Any:
    """PostgreSQL and SQLite: pick a stripe and change it in one statement (RETURNING its amount)."""

    def build() -> Any:
        by: Any = bindparam("sg_by")
        pick = _pick(backend, None, sign).scalar_subquery()
        where = [*_same_item, _s.c.stripe == pick, _fits(sign)]
        new = _s.c.amount - by if sign < 0 else _s.c.amount + by
        return update(_s).where(*where).values(amount=new).returning(_s.c.amount)

    return _memo(f"one-{sign}", backend, build)


def _by_stripe(backend: _kernel.Backend, sign: int, guarded: bool) -> Any:
    """Change one named stripe (``:stripe``), a stripe this transaction locked or stripe 0."""

    def build() -> Any:
        by: Any = bindparam("sg_by")
        where = [*_same_item, _s.c.stripe == bindparam("sg_stripe")]
        if guarded:
            where.append(_fits(sign))
        new = _s.c.amount - by if sign < 0 else _s.c.amount + by
        stmt = update(_s).where(*where).values(amount=new)
        return stmt.returning(_s.c.amount) if backend.returning else stmt

    return _memo(f"by-stripe-{sign}-{guarded}", backend, build)


def _sweep(backend: _kernel.Backend, named: bool) -> Any:
    """Stripes of the item locked in stripe order (the slow path's and restripe's one order).

    ``named``: only the stripes named in ``:ids`` (InnoDB's slow path, and restripe on every
    backend: it must not lock the new stripes it inserted itself); InnoDB looks each one up by
    its whole key (see :func:`_named`: a range would also lock the next item's first stripe).
    Otherwise every stripe of the item (PostgreSQL's slow path).  The caller checks the stripe
    count on the rows found.
    """

    def build() -> Any:
        stmt = select(_s.c.stripe, _s.c.stripes, _s.c.amount)
        if not named:
            stmt = stmt.where(*_item_stripes)
        elif backend.locking_read:
            stmt = _named(stmt)
        else:
            stmt = stmt.where(*_same_item, _s.c.stripe.in_(bindparam("sg_ids", expanding=True)))
        stmt = stmt.order_by(_s.c.stripe)
        return stmt.with_for_update() if backend.row_locks else stmt

    return _memo(f"sweep-{named}", backend, build)


def _free() -> Any:
    """PostgreSQL: the stripes of the item no other transaction holds, locked (``SKIP LOCKED``)."""
    return _kernel.memo.get_or_build(
        ("striped", "free"),
        lambda: (
            select(_s.c.stripe, _s.c.amount)
            .where(*_item_stripes)
            .order_by(_s.c.stripe)
            .with_for_update(skip_locked=True)
        ),
    )


def _lock_one() -> Any:
    """PostgreSQL: lock one stripe (``:stripe``), waiting for the transaction that holds it."""
    return _kernel.memo.get_or_build(
        ("striped", "lock-one"),
        lambda: (
            select(_s.c.stripe).where(*_same_item, _s.c.stripe == bindparam("sg_stripe")).with_for_update()
        ),
    )


def _stripe_0(backend: _kernel.Backend) -> Any:
    """Stripe 0's amount (an increment's guarded UPDATE of it matched nothing: missing or full?)."""

    def build() -> Any:
        stmt = select(_s.c.amount).where(*_same_item, _s.c.stripe == 0)
        # InnoDB: the UPDATE read the latest committed row; a plain SELECT would read the snapshot.
        return stmt.with_for_update() if backend.locking_read else stmt

    return _memo("stripe-0", backend, build)


def _hints() -> Any:
    """Each stripe's amount, read without locks: which stripe is worth waiting for."""
    return _kernel.memo.get_or_build(
        ("striped", "hints"),
        lambda: select(_s.c.stripe, _s.c.amount, _s.c.stripes).where(*_item_stripes),
    )


def _amounts() -> Any:
    return _kernel.memo.get_or_build(
        ("striped", "amounts"),
        lambda: select(_s.c.amount).where(*_item_stripes).order_by(_s.c.stripe),
    )


def _stripe_values(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "counter": r["sg_counter"],
            "item": r["sg_item"],
            "stripe": r["sg_stripe"],
            "stripes": r["sg_stripes"],
            "amount": r["sg_amount"],
        }
        for r in rows
    ]


def _insert_rows(rows: Sequence[Mapping[str, Any]]) -> Any:
    """One multi-row INSERT of new stripes (create, restripe: rare, so not memoised)."""
    return insert(_s).values(_stripe_values(rows))


def _add_stripes(conn: Connection, backend: _kernel.Backend, rows: Sequence[Mapping[str, Any]]) -> set[int]:
    """Restripe, before it locks anything: insert new stripes; the ids it inserted.

    An id taken already (only when the plan came from a snapshot older than the last restripe's
    commit) is left alone: PostgreSQL and SQLite skip that row (``ON CONFLICT DO NOTHING``); InnoDB
    rolls back the whole statement (duplicate key, 1062; the transaction stays usable) and
    nothing is inserted.  The caller inserts what is still missing once it holds the stripes.
    """
    if backend.on_conflict:
        stmt = _kernel.insert_or_skip(backend, _s).values(_stripe_values(rows)).returning(_s.c.stripe)
        return set(_kernel.execute(conn, stmt).scalars())
    try:
        _kernel.execute(conn, _insert_rows(rows))
    except sa_exc.IntegrityError as error:
        if _kernel.is_duplicate_key(error):
            return set()
        raise
    return {int(r["sg_stripe"]) for r in rows}


_CREATE: Final = _kernel.InsertOnce(
    _s,
    {
        _s.c.counter: bindparam("sg_counter"),
        _s.c.item: bindparam("sg_item"),
        _s.c.stripe: bindparam("sg_stripe"),
        _s.c.stripes: bindparam("sg_stripes"),
        _s.c.amount: bindparam("sg_amount"),
    },
    returning=[_s.c.stripe],
)


def _set_stripe() -> Any:
    return _kernel.memo.get_or_build(
        ("striped", "set"),
        lambda: (
            update(_s)
            .where(*_same_item, _s.c.stripe == bindparam("sg_stripe"))
            .values(amount=bindparam("sg_amount"), stripes=bindparam("sg_stripes"))
        ),
    )


def _drop_stripe() -> Any:
    """Delete one stripe (``:stripe``), by its whole key.

    One by one, not ``stripe IN (...)``: MariaDB may run such a DELETE as a scan of the table
    (no index hint is allowed in a single-table DELETE), locking the rows of other items with
    next-key locks; a restripe then waited for a decrement of another item (a deadlock).  A
    whole key is a single-row lookup, which locks that row alone.
    """
    return _kernel.memo.get_or_build(
        ("striped", "drop"),
        lambda: delete(_s).where(*_same_item, _s.c.stripe == bindparam("sg_stripe")),
    )


#: The restripe gate: a row of the item that is no stripe (stripe ids start at 0; amount 0,
#: ``stripes`` 0), made by the item's first restripe and kept.  Restripes take it exclusively,
#: first, so they run one after another without holding anything a decrement waits for.  A
#: MariaDB decrement about to wait for a busy stripe takes it shared first, without waiting
#: (:meth:`StripedCounter._restripe_under_way`).  Reads that range over the item leave it out.
_GATE: Final = -1


def _gate(backend: _kernel.Backend) -> Any:
    """Restripe: make the item's gate row or lock the one there, waiting for the restripe (or the
    waiting decrements) that hold it: ``INSERT ... ON DUPLICATE KEY UPDATE`` / ``ON CONFLICT DO
    UPDATE``, which lock an existing row exclusively in one statement."""

    def build() -> Any:
        values = {
            "counter": bindparam("sg_counter"),
            "item": bindparam("sg_item"),
            "stripe": _GATE,
            "stripes": 0,
            "amount": 0,
        }
        if backend.locking_read:
            return mysql.insert(_s).values(values).on_duplicate_key_update(amount=_s.c.amount)
        return (
            postgresql.insert(_s)
            .values(values)
            .on_conflict_do_update(index_elements=list(_s.primary_key), set_={"amount": _s.c.amount})
        )

    return _memo("gate", backend, build)


def _gate_shared() -> Any:
    """InnoDB: the item's gate row locked shared, or refused at once (``NOWAIT``) while a
    restripe holds it or waits for it (see :meth:`StripedCounter._restripe_under_way`)."""
    return _kernel.memo.get_or_build(
        ("striped", "gate-shared"),
        lambda: (
            select(_s.c.stripe)
            .where(*_same_item, _s.c.stripe == _GATE)
            .with_for_update(read=True, nowait=True)
        ),
    )


def _ledger_key(item: str) -> str:
    """The ledger's ``row_key`` of ``item``: its JSON when that fits the column, else ``=`` and the item.

    The JSON form is what every ledger row held before the second form existed, so a ref
    redelivered after an upgrade still finds its row.  200 characters of quotes, backslashes or
    control characters escape to more JSON than the column's 255 characters hold (``row_key``
    would store a digest, which ``release`` cannot read back); the item itself (at most
    :data:`MAX_ITEM` characters, stored as given in the stripes table already) always fits.  No
    JSON text and no digest starts with ``=``, so the two forms never name the same item.
    """
    stored = row_key((item,))
    return _AS_GIVEN + item if stored.startswith(DIGEST_PREFIX) else stored


def _item_of(stored: str) -> str:
    """The item a ledger ``row_key`` written by :func:`_ledger_key` names."""
    if stored.startswith(_AS_GIVEN):
        return stored[len(_AS_GIVEN) :]
    item: str = json.loads(stored)
    return item


def _split(total: int, stripes: int) -> list[int]:
    """``total`` over ``stripes`` as evenly as integers allow (the first ones get the remainder)."""
    share, extra = divmod(total, stripes)
    return [share + (1 if i < extra else 0) for i in range(stripes)]


def _check_int(value: Any, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{what} must be an int, got {value!r}")
    if not low <= value <= high:
        raise InvalidArgument(f"{what} must be from {low} to {high}, got {value}; nothing was sent")
    return value


def _needed_ref(ref: Any, call: str) -> str:
    if ref is None:
        raise InvalidArgument(f"{call} needs a ref (it is idempotent per ref)")
    return _kernel.check_storable(_check_ref(ref) or "", "ref")


def _check_ref(ref: Any) -> str | None:
    if ref is None:
        return None
    if not isinstance(ref, str) or not ref or len(ref) > MAX_REF:
        raise InvalidArgument(f"ref must be a non-empty string of at most {MAX_REF} characters, got {ref!r}")
    return _kernel.check_storable(ref, "ref")


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
        self.stripes = _check_int(stripes, "stripes", 1, MAX_STRIPES)
        #: How the counter ledger names this counter's changes.
        self.target = LedgerTarget(_s.fullname, name, f"StripedCounter({name!r})")

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
        return _kernel.own_connection(session, _s)

    def _params(self, item: str, **more: Any) -> dict[str, Any]:
        return {"sg_counter": self.name, "sg_item": item, **more}

    def _result(self, session: Session, outcome: Outcome, key: Any, value: Any = None) -> Result:
        return Result(
            outcome,
            model=StripedCounter,
            key=key,
            value=value,
            session=session,
            same_request=outcome is Outcome.REPEATED,
        )

    # ----------------------------------------------------------------------
    # The algorithm (written once; the dialect differences are the statements above)
    # ----------------------------------------------------------------------

    def _ids(self, item: str) -> tuple[int, ...]:
        """InnoDB: the item's stripe ids as last seen; just stripe 0 (every item's) before that."""
        k = _counts.get((self.name, item))
        return _ids_of(k) if k is not None else (0,)

    def _saw(self, item: str, stripes: int) -> None:
        """Remember the stripe count a row of ``item`` carried (see :data:`_counts`)."""
        if _counts.get((self.name, item)) != stripes:
            _counts.put((self.name, item), stripes)

    def _fast(
        self,
        conn: Connection,
        backend: _kernel.Backend,
        item: str,
        by: int,
        sign: int,
        ids: tuple[int, ...] | None = None,
    ) -> bool:
        """Change one free stripe (holding ``by`` for a decrement); whether one was found.

        InnoDB: ``ids`` are the stripes to name (default: those of the count last seen).
        """
        start = random.randrange(SPACE)
        params = self._params(item, sg_by=by, sg_room=MAX_AMOUNT - by, sg_start=start)
        if backend.returning:
            return _kernel.execute(conn, _one_statement(backend, sign), params).first() is not None
        if backend.locking_read:
            ids = self._ids(item) if ids is None else ids
            cut = bisect.bisect_right(ids, start)
            for part in (ids[:cut], ids[cut:]):
                row = (
                    _kernel.execute(conn, _pick_among(sign), {**params, "sg_ids": part}).first()
                    if part
                    else None
                )
                if row is not None:
                    # The locked row's count is the latest (the ids named may be the snapshot's).
                    self._saw(item, row.stripes)
                    return self._change_picked(conn, backend, params, row.stripe, sign)
            return False
        for wrap in (False, True):
            stripe = _kernel.execute(conn, _pick(backend, wrap, sign), params).scalar()
            if stripe is not None:
                return self._change_picked(conn, backend, params, stripe, sign)
        return False

    def _change_picked(
        self, conn: Connection, backend: _kernel.Backend, params: dict[str, Any], stripe: int, sign: int
    ) -> bool:
        # Locked by this transaction: the UPDATE cannot miss it.
        stmt = _by_stripe(backend, sign, True)
        return _kernel.run_guarded(conn, stmt, {**params, "sg_stripe": stripe}, returning=backend.returning)[
            0
        ]

    def _take(
        self, conn: Connection, backend: _kernel.Backend, item: str, by: int
    ) -> tuple[Outcome, int | None]:
        """Take ``by`` off ``item``: from a free stripe, else a busy one that holds it, else from several.

        ``(APPLIED, None)``, ``(INSUFFICIENT, total)`` or ``(NOT_FOUND, None)``.
        """
        if self._fast(conn, backend, item, by, -1):
            return Outcome.APPLIED, None
        if backend.row_locks:
            if backend.locking_read:
                if self._wait_for_one(conn, backend, item, by):
                    return Outcome.APPLIED, None
            else:
                decided = self._settle(conn, backend, item, by)
                if decided is not None:
                    return decided
        return self._slow_decrement(conn, backend, item, by)

    def _wait_for_one(self, conn: Connection, backend: _kernel.Backend, item: str, by: int) -> bool:
        """MariaDB: a decrement no free stripe took waits for one busy stripe that holds ``by``.

        The fast path fails when every stripe that holds ``by`` is held by another buyer
        (the common case under load) or when none holds it (stock low, ``by`` large).  A
        read without locks tells them apart: for the first, wait for one such stripe, as a
        single-row counter would, instead of locking every stripe (which would make everyone
        after it wait for all of them).  When the read shows the fast path named the stripes of
        a stale count, it tries them all first.  ``False`` (nothing changed): no stripe seemed to hold
        ``by``, or the one waited for no longer does; the sweep decides.  No savepoint: InnoDB
        rolls a deadlock victim's whole transaction back.  The read only picks the stripe:
        REPEATABLE READ's plain reads show the transaction's first snapshot.
        """
        params = self._params(item, sg_by=by)
        rows = _kernel.execute(conn, _hints(), params).all()
        # The fast path named the stripes of another count (stripe 0 alone, the first time): name
        # the snapshot's before waiting for one.  Not remembered: the snapshot may predate a
        # restripe whose count this process already saw.  The pick's locked row carries the
        # latest count, which _fast remembers.
        stale = rows and _counts.get((self.name, item)) != rows[0].stripes
        if stale and self._fast(conn, backend, item, by, -1, _ids_of(rows[0].stripes)):
            return True
        candidates = [r.stripe for r in rows if r.amount >= by]
        if not candidates:
            return False
        params["sg_stripe"] = random.choice(candidates)
        if params["sg_stripe"] != 0 and self._restripe_under_way(conn, item):
            # The stripe, read from this transaction's snapshot, may be one that restripe is
            # inserting; stripe 0 never is (and the sweep starts with it).
            if 0 not in candidates:
                return False
            params["sg_stripe"] = 0
        stmt = _by_stripe(backend, -1, True)
        return _kernel.run_guarded(conn, stmt, params, returning=backend.returning)[0]

    def _restripe_under_way(self, conn: Connection, item: str) -> bool:
        """MariaDB: whether a restripe of ``item`` holds (or waits for) its gate; if not, none can
        start before this transaction ends.

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
            _kernel.execute(conn, _gate_shared(), self._params(item)).all()
        except LockNotAcquired:
            return True
        return False

    def _settle(
        self, conn: Connection, backend: _kernel.Backend, item: str, by: int
    ) -> tuple[Outcome, int | None] | None:
        """PostgreSQL: a decrement no free stripe took, never waiting while it holds what it took.

        Each round reads the stripes without locks (READ COMMITTED: the latest committed
        rows; those of uncommitted decrements still show their units).  A total below ``by``
        is INSUFFICIENT then and there.  If a stripe holds ``by``, wait for it alone, as a
        single-row counter would.  Otherwise (stock spread thinner than ``by``) lock the
        stripes nobody holds (``SKIP LOCKED``) and take ``by`` from them if they hold it; if
        not, give them back and wait for a stripe with units that another transaction holds,
        then read again.  Every attempt runs in a savepoint and is rolled back when it does not
        apply (which frees what it locked).

        So this call waits only while holding nothing of the item but what its transaction
        held before (a stripe its fast path re-checked after a concurrent commit stays
        locked: PostgreSQL keeps the lock of a row whose newest version failed the
        re-check): a transaction waiting for it never waits for this one's gathered stripes.
        A deadlock here therefore runs through such an earlier lock, which no savepoint frees:
        the victim rolls back to its savepoint and raises DeadlockDetected at once (retrying
        in the same transaction would meet the same cycle, one ``deadlock_timeout`` a round).
        ``None`` (nothing changed) after ``_WAITS`` rounds or for an item that is not there:
        the ordered sweep decides.

        :raises DeadlockDetected: chosen as a deadlock victim; nothing changed by this call.
        """
        params = self._params(item, sg_by=by)
        for _ in range(_WAITS):
            rows = _kernel.execute(conn, _hints(), params).all()
            if not rows:
                return None
            total = sum(int(r.amount) for r in rows)
            if total < by:
                return Outcome.INSUFFICIENT, total
            holding = [r.stripe for r in rows if r.amount >= by]
            savepoint = conn.begin_nested()
            try:
                if holding:
                    one = {**params, "sg_stripe": random.choice(holding)}
                    stmt = _by_stripe(backend, -1, True)
                    applied = _kernel.run_guarded(conn, stmt, one, returning=backend.returning)[0]
                else:
                    free = _kernel.execute(conn, _free(), params).all()
                    applied = self._take_from(conn, backend, item, free, by)
                    if not applied:
                        savepoint.rollback()
                        savepoint = conn.begin_nested()
                        mine = {r.stripe for r in free}
                        busy = [r for r in rows if r.amount > 0 and r.stripe not in mine]
                        if busy:
                            # Any busy stripe will do (a commit there is what this waits for); a
                            # random one, so a deadlock victim does not wait for the same again.
                            one = {**params, "sg_stripe": random.choice(busy).stripe}
                            _kernel.execute(conn, _lock_one(), one).all()
            except DeadlockDetected:
                # This call waited holding nothing taken in the savepoint, so the cycle runs
                # through a lock its transaction held before (a stripe its fast path examined,
                # an earlier decrement, the caller's own rows): waiting again would meet the same
                # cycle.  The transaction stays usable; the caller's retry holds nothing.
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

    def _add_to_stripe_0(self, conn: Connection, backend: _kernel.Backend, item: str, by: int) -> bool:
        """An increment no free stripe took (all held by others, or too full): wait for stripe 0
        (every item has one).  ``False``: no such item.

        :raises InvalidArgument: stripe 0 holds more than ``MAX_AMOUNT - by`` (the change would
            exceed the BIGINT range); nothing changed and the transaction stays usable (the
            guard is in the statement, which the database never fails).
        """
        params = self._params(item, sg_by=by, sg_room=MAX_AMOUNT - by, sg_stripe=0)
        applied, _ = _kernel.run_guarded(
            conn, _by_stripe(backend, 1, True), params, returning=backend.returning
        )
        if applied:
            return True
        found = _kernel.execute(conn, _stripe_0(backend), params).scalar()
        if found is None:
            return False
        raise InvalidArgument(
            f"adding {by} to {self.target.name} item {item!r} would exceed the BIGINT range of a stripe "
            f"(at most {MAX_AMOUNT}); nothing changed"
        )

    def _lock_all(self, conn: Connection, backend: _kernel.Backend, item: str) -> Sequence[Any]:
        """Every stripe of ``item``, locked in stripe order; ``[]`` when the item does not exist.

        A statement whose snapshot predates a committed restripe misses the
        stripes it inserted (PostgreSQL, READ COMMITTED: a locked row is
        re-read at its latest version, a new row is not seen); the stripe
        count on the rows then disagrees with the rows found, and a fresh
        statement sees them all.  InnoDB: stripe 0, then the stripes its count names
        (:meth:`_lock_named`; a locking range scan would also lock the next item's first stripe).
        """
        rows: Sequence[Any] = []
        for _ in range(_SWEEPS):
            params = self._params(item)
            if backend.locking_read:
                rows = self._lock_named(conn, backend, item)
            else:
                rows = _kernel.execute(conn, _sweep(backend, False), params).all()
            # Stripe 0 is updated in place by a restripe, so a missing item is truly missing.
            if not rows:
                break
            self._saw(item, rows[0].stripes)
            if len(rows) == rows[0].stripes:
                break
        return rows

    def _lock_named(self, conn: Connection, backend: _kernel.Backend, item: str) -> Sequence[Any]:
        """Lock stripe 0, then the other stripes of the count it carries, by name (InnoDB's sweep,
        and restripe's on every backend: the new stripes it inserted are not among them).

        Stripe 0 is every item's and a restripe deletes stripes, and commits the ones it inserted,
        only while holding it, so while this transaction holds it the count on it names exactly the
        committed stripes.
        Stripes named from a count seen earlier may have been deleted by a restripe since, and
        the locks of deleted rows live on: a buyer whose wait for such a stripe ended when the
        restripe committed keeps it (InnoDB locks the delete-marked record and REPEATABLE READ
        keeps the lock), so a sweep naming it waited for that buyer while holding stripe 0, which
        the buyer's own sweep then waited for (deadlocks of decrements queued behind a restripe).
        Two statements where the stripe count last seen would have done with one: the sweep is the
        slow path.
        """
        params = self._params(item, sg_ids=(0,))
        first = _kernel.execute(conn, _sweep(backend, True), params).all()
        if not first:
            return first
        self._saw(item, first[0].stripes)
        rest = _ids_of(first[0].stripes)[1:]
        if not rest:
            return first
        params["sg_ids"] = rest
        return [*first, *_kernel.execute(conn, _sweep(backend, True), params).all()]

    def _slow_decrement(
        self, conn: Connection, backend: _kernel.Backend, item: str, by: int
    ) -> tuple[Outcome, int | None]:
        """Take ``by`` from as many stripes as needed, all of them locked in stripe order.

        In a savepoint where there are row locks: a stripe this transaction's fast path examined
        stays locked (see the module docstring), so two slow paths can deadlock.  PostgreSQL
        aborts only the victim's statement, and ROLLBACK TO SAVEPOINT releases the locks its
        sweep took, so the other one goes on and the victim sweeps again; when what the other
        waits for is a stripe the victim held before its savepoint, no rollback to it frees
        that, and after ``_DEADLOCK_SWEEPS`` rounds the retryable DeadlockDetected propagates.
        InnoDB rolls the victim's whole transaction back: the rollback to the savepoint then
        fails, and DeadlockDetected propagates at once.
        """
        if not backend.row_locks:
            return self._take_locked(conn, backend, item, by)
        for attempt in range(_DEADLOCK_SWEEPS):
            savepoint = conn.begin_nested()
            try:
                found = self._take_locked(conn, backend, item, by)
            except DeadlockDetected as deadlock:
                if attempt == _DEADLOCK_SWEEPS - 1:
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

    def _take_locked(
        self, conn: Connection, backend: _kernel.Backend, item: str, by: int
    ) -> tuple[Outcome, int | None]:
        rows = self._lock_all(conn, backend, item)
        if not rows:
            return Outcome.NOT_FOUND, None
        total = sum(int(r.amount) for r in rows)
        if not self._take_from(conn, backend, item, rows, by):
            return Outcome.INSUFFICIENT, total
        return Outcome.APPLIED, total - by

    def _take_from(
        self, conn: Connection, backend: _kernel.Backend, item: str, rows: Sequence[Any], by: int
    ) -> bool:
        """Take ``by`` from ``rows`` (stripes this transaction locked), the fullest first: the fewest
        UPDATEs, and stripes stay even.  ``False`` (nothing changed) when they hold less."""
        if sum(int(r.amount) for r in rows) < by:
            return False
        takes: dict[int, int] = {}
        left = by
        for row in sorted(rows, key=lambda r: -int(r.amount)):
            take = min(left, max(int(row.amount), 0))
            if take:
                takes[row.stripe] = take
                left -= take
            if not left:
                break
        stmt = _by_stripe(backend, -1, False)
        for stripe, take in takes.items():
            _kernel.execute(conn, stmt, self._params(item, sg_by=take, sg_stripe=stripe))
        return True

    def _change(
        self,
        session: Session,
        conn: Connection,
        backend: _kernel.Backend,
        item: str,
        by: int,
        sign: int,
        ref: str | None,
    ) -> Result:
        """Claim the ref (if any), change a stripe, classify; input already checked."""
        ledger_id = None
        if ref is not None:
            delta = -by if sign < 0 else by
            ledger_id = ledger_claim(conn, backend, self.target, _ledger_key(item), item, ref, delta)
            if ledger_id is None:
                return self._result(session, Outcome.REPEATED, item)
        value: int | None = None
        if sign < 0:
            outcome, value = self._take(conn, backend, item, by)
        elif self._fast(conn, backend, item, by, sign):
            return self._result(session, Outcome.APPLIED, item)
        else:
            try:
                added = self._add_to_stripe_0(conn, backend, item, by)
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
        _check_int(amount, "amount", 0, MAX_AMOUNT)
        k = self.stripes if stripes is None else _check_int(stripes, "stripes", 1, MAX_STRIPES)
        conn = self._conn(session)
        ids = stripe_ids(k)
        rows = [
            self._params(item, sg_stripe=stripe, sg_stripes=k, sg_amount=share)
            for stripe, share in zip(ids, _split(amount, k), strict=True)
        ]
        # Stripe 0 decides: a concurrent create of the same item waits on it and then finds it taken.
        if _CREATE(conn, rows[0]) is None:
            return self._result(session, Outcome.REPEATED, item)
        if rows[1:]:
            _kernel.execute(conn, _insert_rows(rows[1:]))
        self._saw(item, k)
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
        _check_int(by, "by", 1, MAX_AMOUNT)
        _check_ref(ref)
        conn = self._conn(session)
        return self._change(session, conn, _kernel.backend(conn.dialect), item, by, -1, ref)

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
        _check_int(by, "by", 1, MAX_AMOUNT)
        _check_ref(ref)
        conn = self._conn(session)
        return self._change(session, conn, _kernel.backend(conn.dialect), item, by, 1, ref)

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
        checked_ref = _needed_ref(ref, "reserve")
        if not isinstance(amounts, Mapping) or not amounts:
            raise InvalidArgument("reserve needs a non-empty mapping of items to amounts")
        resolved: dict[str, int] = {}
        for item, by in amounts.items():
            resolved[self._item(item)] = _check_int(by, "an amount", 1, MAX_AMOUNT)
        conn = self._conn(session)
        backend = _kernel.backend(conn.dialect)
        done = reserve_all(
            conn, backend, self.target, checked_ref, sorted(resolved),
            lambda item: self._change(session, conn, backend, item, resolved[item], -1, checked_ref),
            _ledger_key,
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
        checked_ref = _needed_ref(ref, "release")
        conn = self._conn(session)
        backend = _kernel.backend(conn.dialect)

        def undo_entries(rows: Sequence[Any]) -> list[tuple[Any, Any]]:
            undo: dict[str, int] = {}
            for row in rows:
                item = _item_of(row.row_key)
                undo[item] = undo.get(item, 0) - int(row.delta)
            return sorted(undo.items())

        def give_back(item: str, delta: int) -> Shortfall | None:
            return self._give_back(conn, backend, item, delta)

        found = ledger_release(conn, backend, self.target, checked_ref, undo_entries, give_back)
        if isinstance(found, Outcome):
            return self._result(session, found, checked_ref)
        if isinstance(found, Shortfall):
            return self._result(session, Outcome.INSUFFICIENT, found.key, found.value)
        return self._result(session, Outcome.APPLIED, checked_ref, dict(found))

    release = dual_method(_release, operation="striped.release")

    def _give_back(
        self, conn: Connection, backend: _kernel.Backend, item: str, delta: int
    ) -> Shortfall | None:
        """Add ``delta`` back to ``item``: a free stripe if any, else stripe 0.

        A released increment (``delta < 0``) takes its units back as a decrement does: from
        one free stripe holding them, else from as many stripes as needed (never below zero);
        a :class:`~stateguard.counters.Shortfall` when the item has less in all.
        """
        if delta > 0 and not self._fast(conn, backend, item, delta, 1):
            self._add_to_stripe_0(conn, backend, item, delta)
        elif delta < 0:
            outcome, value = self._take(conn, backend, item, -delta)
            if outcome is Outcome.INSUFFICIENT:
                return Shortfall(item, value)
        return None

    def _total(self, session: Session, item: str) -> int | None:
        """The item's amount (the sum of its stripes, read without locks), or ``None`` for no such item::

        left = stock.total(session, "sku-1")
        """
        item = self._item(item)
        conn = self._conn(session)
        # Summed here, not by SUM(): the stripes may hold more than a BIGINT in all (SQLite's SUM
        # then fails with "integer overflow"); an item has at most MAX_STRIPES of them.
        amounts = _kernel.execute(conn, _amounts(), self._params(item)).scalars().all()
        return sum(int(a) for a in amounts) if amounts else None

    total = dual_method(_total, operation="striped.total")

    def _stripe_amounts(self, session: Session, item: str) -> list[int]:
        """The amount of each stripe of ``item`` in stripe order (``[]``: no such item)::

        stock.stripe_amounts(session, "sku-1")     # [13, 13, 13, 13, 12, 12, 12, 12]
        """
        item = self._item(item)
        conn = self._conn(session)
        return [int(a) for a in _kernel.execute(conn, _amounts(), self._params(item)).scalars()]

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
        k = _check_int(stripes, "stripes", 1, MAX_STRIPES)
        conn = self._conn(session)
        backend = _kernel.backend(conn.dialect)
        # SQLite: a read-then-write holds the write lock from the read on (it is the gate there).
        _kernel.sqlite_write_lock(conn)
        params = self._params(item)
        if backend.row_locks:
            # Behind this, no other restripe of the item is under way until this one commits.
            _kernel.execute(conn, _gate(backend), params)
        ids = stripe_ids(k)
        # Insert the new stripes before locking anything a decrement waits for (see the module
        # docstring: InnoDB keeps a decrement's lock where a stripe is missing or deleted, and an
        # INSERT there waits for that decrement's COMMIT).  Waiting here holds only the gate and
        # rows no decrement has seen committed.  Planned from a read without locks: behind the
        # gate no restripe is under way, so it is current unless this transaction's snapshot is
        # older than the last restripe's commit (InnoDB, REPEATABLE READ); then ids found taken
        # are left alone and what is still missing is inserted below.  No plan for a total the
        # new count cannot hold: the check below refuses it.
        seen = _kernel.execute(conn, _hints(), params).all()
        mine: set[int] = set()
        if seen and sum(int(r.amount) for r in seen) <= k * MAX_AMOUNT:
            had = {r.stripe for r in seen}
            fresh = [self._params(item, sg_stripe=s, sg_stripes=k, sg_amount=0) for s in ids if s not in had]
            if fresh:
                mine = _add_stripes(conn, backend, fresh)
        # Stripe 0, then the stripes its count names: the old stripes, not the new ones above.
        rows = self._lock_named(conn, backend, item)
        total = sum(int(r.amount) for r in rows)
        if not rows or total > k * MAX_AMOUNT:
            if mine:
                self._drop(conn, item, sorted(mine))
            if not rows:
                if backend.row_locks:
                    self._drop(conn, item, [_GATE])  # no gate row for an item that is not there
                return self._result(session, Outcome.NOT_FOUND, item)
            raise InvalidArgument(
                f"{self.target.name} item {item!r} holds {total}, more than {k} stripe(s) of at most "
                f"{MAX_AMOUNT} can: restripe it to at least {-(-total // MAX_AMOUNT)} stripes; nothing "
                f"changed"
            )
        new = dict(zip(ids, _split(total, k), strict=True))
        old = {r.stripe for r in rows}
        # Stripe 0 is in both: rows are updated in place (a waiting reader re-reads them), the old
        # ones the new count lacks deleted.
        for s, a in new.items():
            if s in old or s in mine:
                _kernel.execute(
                    conn, _set_stripe(), self._params(item, sg_stripe=s, sg_amount=a, sg_stripes=k)
                )
        self._drop(conn, item, sorted(old - new.keys()))
        # Only when the plan came from a snapshot older than the last restripe's commit.
        missing = [
            self._params(item, sg_stripe=s, sg_stripes=k, sg_amount=a)
            for s, a in new.items()
            if s not in old and s not in mine
        ]
        if missing:
            _kernel.execute(conn, _insert_rows(missing))
        self._saw(item, k)
        return self._result(session, Outcome.APPLIED, item, total)

    restripe = dual_method(_restripe, operation="striped.restripe")

    def _drop(self, conn: Connection, item: str, stripes: Sequence[int]) -> None:
        """Delete these stripes of ``item`` (or its gate), one statement each (see :func:`_drop_stripe`)."""
        for stripe in stripes:
            _kernel.execute(conn, _drop_stripe(), self._params(item, sg_stripe=stripe))
