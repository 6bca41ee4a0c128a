"""The relay's statements, each built once per backend and run in a short transaction of its own.

The claim (heads of keys, their contiguous followers), the mark, the
release and the refusal of a batch's events; :func:`_begin` starts each of
the relay's transactions.  Which events a claim may take is written here
once, for both key-order modes (see :mod:`stateguard.outbox`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final, TypeAlias

from sqlalchemy import (
    ARRAY,
    CTE,
    BigInteger,
    ColumnElement,
    Connection,
    Label,
    Select,
    Text,
    Update,
    any_,
    bindparam,
    case,
    cast,
    exists,
    func,
    literal,
    or_,
    select,
    text,
    true,
    update,
)
from sqlalchemy.sql.dml import ReturningUpdate
from sqlalchemy.sql.selectable import Exists

from .. import _kernel
from ..tables import outbox
from .events import OutboxEvent

#: What :func:`_event` reads: id, topic, key, payload, created_ms, refusals (Core columns, untyped).
_EventRow: TypeAlias = tuple[Any, Any, Any, Any, Any, Any]

_EVENT_COLUMNS: Final = (
    outbox.c.id,
    outbox.c.topic,
    outbox.c.key,
    outbox.c.payload,
    outbox.c.created_ms,
    outbox.c.refusals,
)

#: The key-order modes of a relay (``Relay(key_order=...)``): what a dead event does to its key.
SKIP_DEAD: Final = "skip_dead"
STRICT: Final = "strict"
KEY_ORDERS: Final = (SKIP_DEAD, STRICT)

#: How a relay holds the events it publishes (``Relay(hold=...)``): the row locks of one transaction
#: open over the publish (PostgreSQL's default), or a committed lease (every other backend's).
LOCKS: Final = "locks"
LEASE: Final = "lease"
HOLDS: Final = (LOCKS, LEASE)


def _async_commit(backend: _kernel.Backend) -> bool:
    """Whether the relay's own writes commit without waiting for the WAL flush: PostgreSQL proper
    (CockroachDB has no synchronous_commit).

    ``synchronous_commit = off`` for the claim's and the mark's transactions
    only (``set_config(..., true)`` in their RETURNING): a PostgreSQL crash
    may forget the last fraction of a second of them, which makes a claim
    free again or a published event come again: the relay's promise (at
    least once) holds, and neither waits for a disk flush.  The events
    themselves are written by the application's own transaction.
    """
    return backend.commit_without_flush


def _no_flush() -> Label[Any]:
    """``set_config('synchronous_commit', 'off', true)``: this statement's transaction commits without
    waiting for its WAL to reach the disk (see :func:`_async_commit`)."""
    # A scalar subquery: an InitPlan, run once for the statement, not once per row returned.
    setting = func.set_config(literal("synchronous_commit"), literal("off"), true())
    return select(setting).scalar_subquery().label("sg_no_flush")


def _lease_free() -> ColumnElement[bool]:
    return or_(outbox.c.claimed_until_ms.is_(None), outbox.c.claimed_until_ms <= _kernel.db_now_ms())


def _head_conditions(topics: bool, strict: bool) -> list[ColumnElement[bool]]:
    """Unpublished, alive, not leased, and its key's earliest unpublished event (or keyless); of
    ``:sg_topics``.

    An earlier *dead* event of the key counts only in strict key order: by
    default a dead event no longer holds back the later events of its key.
    """
    earlier = outbox.alias("sg_earlier")
    before = [earlier.c.key == outbox.c.key, earlier.c.published_ms.is_(None), earlier.c.id < outbox.c.id]
    if not strict:
        before.append(earlier.c.dead_ms.is_(None))
    earlier_pending = exists().where(*before)
    conditions = [
        outbox.c.published_ms.is_(None),
        outbox.c.dead_ms.is_(None),
        _lease_free(),
        or_(outbox.c.key.is_(None), ~earlier_pending),
    ]
    if topics:
        conditions.append(outbox.c.topic.in_(bindparam("sg_topics", expanding=True)))
    return conditions


def _heads_statement(backend: _kernel.Backend, topics: bool, strict: bool) -> Select[*_EventRow]:
    """Free unpublished events that are their key's earliest unpublished one (or have no key)."""

    def build() -> Select[*_EventRow]:
        conditions = _head_conditions(topics, strict)
        stmt = select(*_EVENT_COLUMNS).where(*conditions).order_by(outbox.c.id).limit(bindparam("sg_batch"))
        if backend.row_locks:
            # PostgreSQL re-checks the WHERE of a row it locks that changed since its snapshot
            # (EvalPlanQual), InnoDB's locking read reads the latest committed row: a head
            # another relay claimed meanwhile shows its live lease and is left out.
            stmt = stmt.with_for_update(skip_locked=True)
        return stmt

    return _kernel.memo.get_or_build(("outbox_heads", backend, topics, strict), build)


def _followers_statement(backend: _kernel.Backend, strict: bool) -> Select[*tuple[Any, ...]]:
    """Every unpublished event of the given keys, id order, with the lease state on the database clock
    (dead ones only in strict key order, where they hold back what follows them)."""

    def build() -> Select[*tuple[Any, ...]]:
        conditions = [outbox.c.key.in_(bindparam("sg_keys", expanding=True)), outbox.c.published_ms.is_(None)]
        if not strict:
            conditions.append(outbox.c.dead_ms.is_(None))
        return (
            select(
                *_EVENT_COLUMNS,
                outbox.c.claimed_until_ms,
                outbox.c.dead_ms,
                _kernel.db_now_ms().label("sg_now"),
            )
            .where(*conditions)
            .order_by(outbox.c.id)
        )

    return _kernel.memo.get_or_build(("outbox_followers", backend, strict), build)


def _claim_statement(backend: _kernel.Backend) -> Update:
    def build() -> Update:
        return (
            update(outbox)
            .where(
                outbox.c.id.in_(bindparam("sg_ids", expanding=True)),
                outbox.c.published_ms.is_(None),
                outbox.c.dead_ms.is_(None),
            )
            .values(
                claimed_by=bindparam("sg_owner"),
                claimed_until_ms=_kernel.db_now_ms() + bindparam("sg_lease"),
                attempts=outbox.c.attempts + 1,
            )
        )

    return _kernel.memo.get_or_build(("outbox_claim", backend), build)


def _claimable(topics: bool, strict: bool) -> list[ColumnElement[bool]]:
    """Free unpublished events whose key has no earlier event a relay could not take anyway (leased,
    of a topic it does not publish, dead in strict order); of ``:sg_topics``."""
    now = _kernel.db_now_ms()
    earlier = outbox.alias("sg_earlier")
    before = [earlier.c.key == outbox.c.key, earlier.c.published_ms.is_(None), earlier.c.id < outbox.c.id]
    if not strict:
        before.append(earlier.c.dead_ms.is_(None))
    untakeable = [earlier.c.claimed_until_ms > now]
    if strict:
        untakeable.append(earlier.c.dead_ms.is_not(None))
    if topics:
        untakeable.append(earlier.c.topic.not_in(bindparam("sg_topics", expanding=True)))
    held_back = exists().where(*before, or_(*untakeable))
    conditions = [
        outbox.c.published_ms.is_(None),
        outbox.c.dead_ms.is_(None),
        _lease_free(),
        or_(outbox.c.key.is_(None), ~held_back),
    ]
    if topics:
        conditions.append(outbox.c.topic.in_(bindparam("sg_topics", expanding=True)))
    return conditions


def _whole_keys(heads: CTE, strict: bool) -> ColumnElement[bool]:
    """The condition on a row of the locked prefix ``heads``: keyless, or every earlier unpublished
    event of its key (alive ones, unless ``strict``) is in ``heads`` too.

    Checked once per key first (no such event before the key's last row in
    ``heads``: the common case, every row of the key passes), then row by row
    for the keys that fail it (a row before the gap still passes).
    """

    def gap(outside: Any, key: Any, below: Any) -> Exists:
        conditions = [outside.c.key == key, outside.c.published_ms.is_(None), outside.c.id < below]
        if not strict:
            conditions.append(outside.c.dead_ms.is_(None))
        conditions.append(outside.c.id.not_in(select(heads.c.id).scalar_subquery()))
        return exists().where(*conditions)

    keys = (
        select(heads.c.key, func.max(heads.c.id).label("sg_last"))
        .where(heads.c.key.is_not(None))
        .group_by(heads.c.key)
        .cte("sg_keys")
    )
    whole = select(keys.c.key).where(~gap(outbox.alias("sg_behind"), keys.c.key, keys.c.sg_last))
    return or_(
        heads.c.key.is_(None),
        heads.c.key.in_(whole),
        ~gap(outbox.alias("sg_outside"), heads.c.key, heads.c.id),
    )


def _prefix(columns: Any, topics: bool, strict: bool, lock: bool) -> CTE:
    """``sg_heads``: the first ``:sg_batch`` claimable events (``lock``: ``FOR UPDATE SKIP LOCKED``)."""
    # ORDER BY (published_ms, id), all NULL: id order, and the order of ix_stateguard_outbox_pending,
    # so the planner walks that index from the first unpublished event instead of the primary key
    # through every published one (what it chose for ORDER BY id while its statistics were stale).
    heads_select = (
        select(*columns)
        .where(*_claimable(topics, strict))
        .order_by(outbox.c.published_ms, outbox.c.id)
        .limit(bindparam("sg_batch"))
    )
    if lock:
        heads_select = heads_select.with_for_update(skip_locked=True)
    return heads_select.cte("sg_heads").prefix_with("MATERIALIZED")


def _held_claim_statement(backend: _kernel.Backend, topics: bool, strict: bool) -> Select[*tuple[Any, ...]]:
    """The claim of a relay that holds its events' row locks over the publish (``hold="locks"``):
    a ``SELECT`` of :func:`_claim_once_statement`'s choice that writes nothing.

    The events stay locked by the relay's transaction until it marks them
    published and commits (or rolls back: a relay that dies frees them at
    once); another relay skips them (``SKIP LOCKED``) and, seeing them
    unpublished, keeps their keys' later events out of its own claim.  The
    same statement makes the rest of the transaction commit without waiting
    for the WAL flush and ends the session of a relay that sits on its claim
    longer than its lease (``idle_in_transaction_session_timeout``,
    ``:sg_lease`` ms): its events are free again, as after a lease.
    """

    def build() -> Select[*tuple[Any, ...]]:
        heads = _prefix(_EVENT_COLUMNS, topics, strict, lock=True)
        settings = []
        if _async_commit(backend):
            timeout = func.set_config(
                literal("idle_in_transaction_session_timeout"),
                cast(bindparam("sg_lease", type_=BigInteger), Text),
                true(),
            )
            settings = [_no_flush(), select(timeout).scalar_subquery().label("sg_timeout")]
        columns = [heads.c[c.name] for c in _EVENT_COLUMNS]
        return select(*columns, *settings).where(_whole_keys(heads, strict)).order_by(heads.c.id)

    return _kernel.memo.get_or_build(("outbox_held_claim", backend, topics, strict), build)


def _claim_once_statement(
    backend: _kernel.Backend, topics: bool, strict: bool
) -> ReturningUpdate[*tuple[Any, ...]]:
    """The whole claim as one ``UPDATE ... RETURNING`` (PostgreSQL, SQLite): one round trip.

    The same rule as the three statements of :meth:`_RelayCore._claim`, in SQL,
    as a prefix of the outbox: ``sg_heads`` locks (``FOR UPDATE SKIP LOCKED``
    on PostgreSQL; SQLite holds its write lock) the first ``batch`` free
    unpublished events in id order whose key has no earlier event this relay
    could not take anyway (leased, of a topic it does not publish, dead in
    strict order): so a key held back by such an event never fills the batch
    with events it cannot claim.  Of those, an event is claimed when every
    earlier unpublished event of its key is among them: a key's events go
    together from its head on, contiguous, in id order, and an earlier event
    that another relay holds locked (skipped) or claimed after this
    statement's snapshot (its lease seen at the lock) keeps the key's later
    events out.  Another relay can claim an event of a key only while
    holding all of the key's earlier unpublished events, which this
    statement locked.  In the common case (no other relay, nothing refused)
    it claims the first ``batch`` unpublished events, as a plain ``SELECT
    ... LIMIT ... FOR UPDATE SKIP LOCKED`` would.
    """

    def build() -> ReturningUpdate[*tuple[Any, ...]]:
        heads = _prefix((outbox.c.id, outbox.c.key), topics, strict, lock=backend.row_locks)
        picked = select(heads.c.id).where(_whole_keys(heads, strict))
        if backend.array_params:
            # id = ANY(ARRAY(...)): the picked ids are computed once and the rows reached through the
            # primary key, whatever the planner estimates (an IN (...) join became a nested loop over
            # every unpublished row while the table had no statistics).
            chosen = outbox.c.id == func.any(func.array(picked.scalar_subquery()))
        else:
            chosen = outbox.c.id.in_(picked)
        return (
            update(outbox)
            .where(chosen, outbox.c.published_ms.is_(None), outbox.c.dead_ms.is_(None))
            .values(
                claimed_by=bindparam("sg_owner"),
                claimed_until_ms=_kernel.db_now_ms() + bindparam("sg_lease"),
                attempts=outbox.c.attempts + 1,
            )
            .returning(*_EVENT_COLUMNS, *((_no_flush(),) if _async_commit(backend) else ()))
        )

    return _kernel.memo.get_or_build(("outbox_claim_once", backend, topics, strict), build)


def _ids_in(backend: _kernel.Backend) -> ColumnElement[bool]:
    """``id`` among the bound list ``sg_ids``: ``= ANY(:sg_ids)``, one ARRAY parameter, on PostgreSQL.

    One statement text whatever the batch's size, and a primary-key lookup the
    planner keeps: with an expanded IN list of a batch's ids and ``published_ms
    IS NULL`` it walked ix_stateguard_outbox_pending over every unpublished event
    (about 5 ms a mark for 5,000 unpublished events; see bench/README.md, scenario 6).
    """
    if backend.array_params:
        return outbox.c.id == any_(bindparam("sg_ids", type_=ARRAY(BigInteger)))
    return outbox.c.id.in_(bindparam("sg_ids", expanding=True))


def _owned_update(backend: _kernel.Backend, what: str, values: Callable[[], dict[str, Any]]) -> Update:
    """``UPDATE`` of the batch ``:sg_ids`` this relay (``:sg_owner``) still holds unpublished (built once)."""

    def build() -> Update:
        mine = (
            _ids_in(backend),
            outbox.c.claimed_by == bindparam("sg_owner"),
            outbox.c.published_ms.is_(None),
        )
        return update(outbox).where(*mine).values(**values())

    return _kernel.memo.get_or_build((f"outbox_{what}", backend), build)


def _mark_statement(backend: _kernel.Backend) -> Update | ReturningUpdate[Any]:
    """Mark the batch published (and free its lease); on PostgreSQL it returns a row per event marked,
    committed without waiting for the WAL flush (:func:`_async_commit`)."""

    def build() -> Update | ReturningUpdate[Any]:
        mine = (
            _ids_in(backend),
            outbox.c.claimed_by == bindparam("sg_owner"),
            outbox.c.published_ms.is_(None),
        )
        stmt = update(outbox).where(*mine).values(published_ms=_kernel.db_now_ms(), claimed_until_ms=None)
        return stmt.returning(_no_flush()) if _async_commit(backend) else stmt

    return _kernel.memo.get_or_build(("outbox_mark", backend), build)


def _held_mark_statement(backend: _kernel.Backend) -> Update:
    """Mark the batch ``:sg_ids`` published, in the transaction whose claim holds their row locks
    (``hold="locks"``): no owner to check, and the publish counted as the attempt the claim counts
    in lease mode."""

    def build() -> Update:
        return (
            update(outbox)
            .where(_ids_in(backend), outbox.c.published_ms.is_(None))
            .values(published_ms=_kernel.db_now_ms(), claimed_until_ms=None, attempts=outbox.c.attempts + 1)
        )

    return _kernel.memo.get_or_build(("outbox_held_mark", backend), build)


def _release_statement(backend: _kernel.Backend) -> Update:
    """Give the batch back unpublished: claimable again at once."""
    return _owned_update(backend, "release", lambda: {"claimed_until_ms": None})


def _refuse_statement(backend: _kernel.Backend, held: bool = False) -> Update:
    """One refused event of the batch (``:sg_id``) back unpublished, claimable after ``:sg_delay`` ms,
    its refusal counted and its error kept; ``:sg_dead`` 1: parked dead instead (executemany).
    ``held``: in the transaction that holds its row lock (``hold="locks"``), no owner to check, the
    attempt counted here."""

    def build() -> Update:
        now = _kernel.db_now_ms()
        dead = bindparam("sg_dead", type_=BigInteger) == 1
        mine = [outbox.c.id == bindparam("sg_id"), outbox.c.published_ms.is_(None)]
        if not held:
            mine.insert(1, outbox.c.claimed_by == bindparam("sg_owner"))
        values: dict[str, Any] = {
            "refusals": outbox.c.refusals + 1,
            "last_error": bindparam("sg_error"),
            "claimed_until_ms": case((dead, None), else_=now + bindparam("sg_delay", type_=BigInteger)),
            "dead_ms": case((dead, now), else_=None),
        }
        if held:
            values["attempts"] = outbox.c.attempts + 1
        return update(outbox).where(*mine).values(**values)

    return _kernel.memo.get_or_build(("outbox_refuse", backend, held), build)


def _requeue_statement(backend: _kernel.Backend, ids: bool, key: bool) -> Update:
    """Dead events (of ``:sg_ids``, of ``:sg_key``) alive again, refusals from 0, claimable at once."""

    def build() -> Update:
        conditions: list[ColumnElement[bool]] = [
            outbox.c.dead_ms.is_not(None),
            outbox.c.published_ms.is_(None),
        ]
        if ids:
            conditions.append(outbox.c.id.in_(bindparam("sg_ids", expanding=True)))
        if key:
            conditions.append(outbox.c.key == bindparam("sg_key"))
        return update(outbox).where(*conditions).values(dead_ms=None, refusals=0, claimed_until_ms=None)

    return _kernel.memo.get_or_build(("outbox_requeue", backend, ids, key), build)


_READ_COMMITTED: Final = text("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")


def _begin(conn: Connection) -> _kernel.Backend:
    """Start one of the relay's short transactions on ``conn``; its Backend.

    SQLite: take the write lock first (its only lock).  InnoDB: READ
    COMMITTED, whose locking reads lock only the rows they return, with no
    gap locks: at REPEATABLE READ the claim's index scan would lock the gaps
    new events are inserted into (emit would wait on a relay) and the rows it
    rejected, and claims and marks of several relays deadlock on them.
    """
    backend = _kernel.backend(conn.dialect)
    if backend.locks_scanned_rows:  # InnoDB gap locks: see above
        # Before the transaction's first statement: SET TRANSACTION applies to the next one.
        _kernel.execute(conn, _READ_COMMITTED)
    _kernel.sqlite_write_lock(conn)
    return backend


#: ``json.loads`` without its per-call checks: the stored payload is always a str.
_decode: Final = json.JSONDecoder().decode


def _event(row: Any) -> OutboxEvent:
    # By position (a Row's attributes are looked up by name, several times slower): the first
    # columns of every claim's rows are _EVENT_COLUMNS, in that order.
    event_id, topic, key, stored, created_ms, refusals = row[:6]
    return OutboxEvent(int(event_id), topic, key, _decode(stored), int(created_ms), stored, int(refusals))
