"""The transactional outbox: events stored in the transaction that caused them, published by a relay.

``after_commit`` callbacks run in the process that committed: if it dies
between COMMIT and the callback, the side effect never happens.  An outbox
stores the event *in* the transaction instead (:func:`emit`), so the event
exists exactly when the change that caused it does; a :class:`Relay` then
hands committed events to a :class:`Sink` (a Redis stream, a queue, a
function) at least once, and a consumer that records what it handled with
:func:`~stateguard.consume_once` applies each one once::

    with Session(engine) as session, session.begin():
        order.pay(session)                                  # the change
        emit(session, "order.paid", {"order": 7}, key="order-7")   # its event, same transaction

    relay = Relay(engine, RedisStreamSink(redis, stream="orders"))
    relay.run(stop_event)                                   # claim, publish, mark; repeat

How a relay works (one :meth:`Relay.run_once`, three short steps):

1. *Claim*, in one short transaction (one ``UPDATE ... RETURNING``
   statement on PostgreSQL and SQLite): up to ``batch`` unpublished events whose
   lease is free (never claimed, or the claim's lease ended on the database's
   clock), in id order.  PostgreSQL and MariaDB lock them with ``FOR UPDATE
   SKIP LOCKED``, so relays never wait on each other; SQLite holds its write
   lock for the transaction.  The claim writes a fresh claim token and a
   lease end on every event it took.
2. *Publish* the batch through the sink, outside any transaction.
3. *Mark* the events published, in one short transaction, owner-checked:
   only rows still carrying this claim's token.  A sink that raises leaves
   the batch unpublished (its claim is released at once); a relay that dies
   between 2 and 3 leaves the events claimed until the lease ends, and
   another relay publishes them again: delivery is **at least once**.

Per-key order: events with the same ``key`` are published in id order.  A
relay claims an event of a key only together with that key's *head*, the
key's earliest unpublished event, and only when it locked that head itself
(``SKIP LOCKED`` skips a head another relay is claiming; a head another
relay claimed carries a live lease and is not free).  The events it takes
after a head are that key's next unpublished events, contiguous and free, in
id order, all published by one sink call in id order and marked by one
statement.  So while one relay holds any event of a key no other relay can
claim one, and a key's next event becomes a head only once every earlier one
was marked published, that is after the sink accepted it.  (A relay whose
lease ended while it was still publishing may deliver a duplicate late, after
a later event of its key: a consumer with ``consume_once`` ignores it.)
The id order is the order of the INSERTs; two transactions that emit for
one key at once without a common lock (a state machine transition holds the
row's lock) commit in an order of their own.

Not promised: any order across keys, a bound on publish latency, delivery
exactly once (a consumer deduplicates by the event id: :attr:`OutboxEvent.id`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final, Generic, Protocol, TypeVar, runtime_checkable

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Connection,
    Engine,
    and_,
    any_,
    bindparam,
    case,
    exists,
    func,
    insert,
    or_,
    select,
    text,
    union_all,
    update,
)
from sqlalchemy.orm import Session

from .. import _sql, _write
from .._async import Awaited, Steps, dual, dual_bind, run_steps, step
from ..exceptions import InvalidArgument, SerializationConflict, StateguardError
from ..tables import MAX_KEY, outbox

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = [
    "AsyncRelay",
    "CallableSink",
    "OutboxEvent",
    "Relay",
    "Sink",
    "emit",
    "purge_published",
]

log = logging.getLogger("stateguard.outbox")

T = TypeVar("T")
#: The engine a relay runs on: an Engine (Relay) or an AsyncEngine (AsyncRelay).
E = TypeVar("E", "Engine", "AsyncEngine")

#: Longest topic accepted (characters): the ``topic`` column's length.
MAX_TOPIC: Final = 200
#: Largest ``batch`` a relay or a purge accepts (one statement's IN list).
MAX_BATCH: Final = 10_000
#: How deep a payload may nest (lists and objects): deeper is InvalidArgument, not a RecursionError.
MAX_DEPTH: Final = 100

_o = outbox


# --------------------------------------------------------------------------
# Events and sinks
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OutboxEvent:
    """One event as a relay hands it to a sink.

    ``id`` is unique and stable across redeliveries: a consumer deduplicates
    with ``consume_once(session, consumer, str(event.id))``.  ``payload`` is
    what :func:`emit` got, read back from its JSON (tuples come back as lists).
    ``created_ms`` is the database's clock at the INSERT (epoch milliseconds).
    """

    id: int
    topic: str
    key: str | None
    payload: Any
    created_ms: int
    # The stored JSON text, kept by the relay so that a sink does not serialise the payload again.
    _json: str | None = field(default=None, repr=False, compare=False)

    def payload_json(self) -> str:
        """The payload as JSON text, as stored (compact, non-ASCII kept as is)."""
        return self._json if self._json is not None else _write.dumps_json(self.payload)


@runtime_checkable
class Sink(Protocol):
    """Where a relay publishes events: any object with this one method.

    ``publish(events)`` gets a batch in id order and must return only once
    every event of it is accepted (written to the stream, acknowledged by
    the broker).  Raising means *nothing* of the batch counts as published:
    the relay releases its claim and the whole batch comes again.  A sink
    may get an event more than once (a relay that died after ``publish`` and
    before marking; a retried batch after a partial failure): delivery is at
    least once, and consumers deduplicate by :attr:`OutboxEvent.id`.  For
    :class:`AsyncRelay`, ``publish`` may return an awaitable, which is
    awaited.  A Kafka sink is a few lines::

        class KafkaSink:
            def __init__(self, producer): self.producer = producer
            def publish(self, events):
                for e in events:
                    self.producer.produce(e.topic, e.payload_json(), key=e.key, headers={"id": str(e.id)})
                if self.producer.flush(30) != 0:
                    raise RuntimeError("kafka did not acknowledge the batch")
    """

    def publish(self, events: Sequence[OutboxEvent]) -> Any:
        """Publish ``events`` (id order) or raise; see the class docstring."""


class CallableSink:
    """A :class:`Sink` made of a function: ``CallableSink(lambda events: ...)``.

    The function gets each batch (a sequence of :class:`OutboxEvent`, id
    order); it may be a coroutine function for :class:`AsyncRelay`.
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[Sequence[OutboxEvent]], Any]) -> None:
        if not callable(fn):
            raise InvalidArgument(f"CallableSink needs a function of a batch of events, got {fn!r}")
        self.fn = fn

    def publish(self, events: Sequence[OutboxEvent]) -> Any:
        """Call the function with the batch."""
        return self.fn(events)


# --------------------------------------------------------------------------
# emit
# --------------------------------------------------------------------------


def payload_text(payload: Any) -> str:
    """``payload`` as the JSON text the outbox stores, or InvalidArgument (nothing sent).

    JSON values only (dict with str keys, list, tuple, str, int, float, bool,
    None); no NaN or infinity (``allow_nan=False``: other JSON readers
    refuse them); no lone surrogates (no UTF-8 for them).
    """
    return _write.json_text(payload, "payload", MAX_DEPTH)


def _insert(backend: _sql.Backend) -> Any:
    def build() -> Any:
        stmt = insert(_o).values(
            topic=bindparam("sg_topic"),
            key=bindparam("sg_key"),
            payload=bindparam("sg_payload"),
            created_ms=_sql.db_now_ms(),
            attempts=0,
        )
        # MariaDB answers with LAST_INSERT_ID in the OK packet (lastrowid): no RETURNING needed.
        return stmt.returning(_o.c.id) if backend.returning else stmt

    return _write.memo.get_or_build(("outbox_insert", backend), build)


@dual
def emit(session: Session, topic: str, payload: Any, *, key: str | None = None) -> int:
    """Store an event in the session's current transaction and return its id.

    One INSERT into ``stateguard_outbox``: a relay sees the event only after
    the transaction commits, and a rollback discards it with the rest::

        with Session(engine) as session, session.begin():
            session.add(Invoice(id=7, total=120))
            emit(session, "invoice.created", {"id": 7, "total": 120}, key="invoice-7")

        event_id = await emit(async_session, "invoice.created", {...})   # AsyncSession: awaited

    Events with the same ``key`` are published in id order (see the module
    docstring); ``key=None`` events have no order with any other.

    :raises InvalidArgument: a blank, oversize (200 / 255 characters) or
        non-str ``topic`` or ``key``; a payload that is not JSON (NaN or
        infinity, non-str object keys, lone surrogates, nesting deeper than
        100, a circular reference) or too large for a MariaDB statement;
        nothing was written.
    """
    _write.check_text(topic, "topic", MAX_TOPIC)
    if key is not None:
        _write.check_text(key, "key", MAX_KEY)
    text = payload_text(payload)
    if session.autoflush:
        session.flush()
    conn = _write.own_connection(session, _o)
    _write.check_statement_size(conn, text, "payload")
    backend = _sql.backend(conn.dialect)
    result = _write.execute(conn, _insert(backend), {"sg_topic": topic, "sg_key": key, "sg_payload": text})
    return int(result.scalar_one() if backend.returning else result.lastrowid)


# --------------------------------------------------------------------------
# The relay's statements (each runs in a short transaction of its own)
# --------------------------------------------------------------------------

_EVENT_COLUMNS: Final = (_o.c.id, _o.c.topic, _o.c.key, _o.c.payload, _o.c.created_ms)


def _lease_free() -> Any:
    return or_(_o.c.claimed_until_ms.is_(None), _o.c.claimed_until_ms <= _sql.db_now_ms())


def _head_conditions(topics: bool) -> list[Any]:
    """Unpublished, not leased, and its key's earliest unpublished event (or keyless); of ``:sg_topics``."""
    earlier = _o.alias("sg_earlier")
    earlier_pending = exists().where(
        earlier.c.key == _o.c.key, earlier.c.published_ms.is_(None), earlier.c.id < _o.c.id
    )
    conditions = [_o.c.published_ms.is_(None), _lease_free(), or_(_o.c.key.is_(None), ~earlier_pending)]
    if topics:
        conditions.append(_o.c.topic.in_(bindparam("sg_topics", expanding=True)))
    return conditions


def _heads_statement(backend: _sql.Backend, topics: bool) -> Any:
    """Free unpublished events that are their key's earliest unpublished one (or have no key)."""

    def build() -> Any:
        conditions = _head_conditions(topics)
        stmt = select(*_EVENT_COLUMNS).where(*conditions).order_by(_o.c.id).limit(bindparam("sg_batch"))
        if backend.row_locks:
            # PostgreSQL re-checks the WHERE of a row it locks that changed since its snapshot
            # (EvalPlanQual), InnoDB's locking read reads the latest committed row: a head
            # another relay claimed meanwhile shows its live lease and is left out.
            stmt = stmt.with_for_update(skip_locked=True)
        return stmt

    return _write.memo.get_or_build(("outbox_heads", backend, topics), build)


def _followers_statement(backend: _sql.Backend) -> Any:
    """Every unpublished event of the given keys, id order, with the lease state on the database clock."""

    def build() -> Any:
        return (
            select(*_EVENT_COLUMNS, _o.c.claimed_until_ms, _sql.db_now_ms().label("sg_now"))
            .where(_o.c.key.in_(bindparam("sg_keys", expanding=True)), _o.c.published_ms.is_(None))
            .order_by(_o.c.id)
        )

    return _write.memo.get_or_build(("outbox_followers", backend), build)


def _claim_statement(backend: _sql.Backend) -> Any:
    def build() -> Any:
        return (
            update(_o)
            .where(_o.c.id.in_(bindparam("sg_ids", expanding=True)), _o.c.published_ms.is_(None))
            .values(
                claimed_by=bindparam("sg_owner"),
                claimed_until_ms=_sql.db_now_ms() + bindparam("sg_lease"),
                attempts=_o.c.attempts + 1,
            )
        )

    return _write.memo.get_or_build(("outbox_claim", backend), build)


def _claim_once_statement(backend: _sql.Backend, topics: bool) -> Any:
    """The whole claim as one ``UPDATE ... RETURNING`` (PostgreSQL, SQLite): one round trip.

    The same rule as the three statements of :meth:`_RelayCore._claim`, in SQL:
    ``sg_heads`` locks up to ``batch`` free heads (``FOR UPDATE SKIP LOCKED``
    on PostgreSQL; SQLite holds its write lock); ``sg_followers`` numbers the
    other unpublished events of their keys in id order with a running count
    of events this relay may not take (earlier than the head, claimed by a
    live lease, of a topic it does not publish), so only the contiguous run
    right after each head has a count of 0; the heads and, in id order, as
    many of those as fit in ``batch`` are claimed.  The followers come from
    the statement's snapshot: another relay can claim an event of a key only
    while holding the key's head, which this statement locked (or, when that
    relay committed first, PostgreSQL's re-check of the locked head sees its
    live lease and leaves the key out).  On PostgreSQL the relay runs it in
    autocommit: one round trip claims a batch.
    """

    def build() -> Any:
        conditions = _head_conditions(topics)
        # ORDER BY (published_ms, id), all NULL: id order, and the order of ix_stateguard_outbox_pending,
        # so the planner walks that index from the first unpublished event instead of the primary key
        # through every published one (what it chose for ORDER BY id while its statistics were stale).
        heads_select = (
            select(_o.c.id, _o.c.key)
            .where(*conditions)
            .order_by(_o.c.published_ms, _o.c.id)
            .limit(bindparam("sg_batch"))
        )
        if backend.row_locks:
            heads_select = heads_select.with_for_update(skip_locked=True)
        heads = heads_select.cte("sg_heads").prefix_with("MATERIALIZED")
        ev = _o.alias("sg_ev")
        now = _sql.db_now_ms()
        free = or_(ev.c.claimed_until_ms.is_(None), ev.c.claimed_until_ms <= now)
        ok = and_(ev.c.id > heads.c.id, free)
        if topics:
            ok = and_(ok, ev.c.topic.in_(bindparam("sg_topics", expanding=True)))
        bad = case((ok, 0), else_=1)
        followers = (
            select(
                ev.c.id,
                func.sum(bad).over(partition_by=ev.c.key, order_by=ev.c.id).label("sg_bad"),
            )
            .select_from(ev.join(heads, ev.c.key == heads.c.key))
            .where(ev.c.published_ms.is_(None), ev.c.id != heads.c.id)
            .cte("sg_followers")
        )
        ranked = (
            select(followers.c.id, func.row_number().over(order_by=followers.c.id).label("sg_rank"))
            .where(followers.c.sg_bad == 0)
            .subquery("sg_ranked")
        )
        room: Any = bindparam("sg_batch") - select(func.count()).select_from(heads).scalar_subquery()
        picked = union_all(select(heads.c.id), select(ranked.c.id).where(ranked.c.sg_rank <= room))
        if backend.array_params:
            # id = ANY(ARRAY(...)): the picked ids are computed once and the rows reached through the
            # primary key, whatever the planner estimates (an IN (...) join became a nested loop over
            # every unpublished row while the table had no statistics).
            chosen = _o.c.id == func.any(func.array(picked.scalar_subquery()))
        else:
            chosen = _o.c.id.in_(picked)
        return (
            update(_o)
            .where(chosen, _o.c.published_ms.is_(None))
            .values(
                claimed_by=bindparam("sg_owner"),
                claimed_until_ms=_sql.db_now_ms() + bindparam("sg_lease"),
                attempts=_o.c.attempts + 1,
            )
            .returning(*_EVENT_COLUMNS)
        )

    return _write.memo.get_or_build(("outbox_claim_once", backend, topics), build)


def _ids_in(backend: _sql.Backend) -> Any:
    """``id`` among the bound list ``sg_ids``: ``= ANY(:sg_ids)``, one ARRAY parameter, on PostgreSQL.

    One statement text whatever the batch's size, and a primary-key lookup the
    planner keeps: with an expanded IN list of a batch's ids and ``published_ms
    IS NULL`` it walked ix_stateguard_outbox_pending over every unpublished event
    (about 5 ms a mark for 5,000 unpublished events; see bench/README.md, scenario 6).
    """
    if backend.array_params:
        return _o.c.id == any_(bindparam("sg_ids", type_=ARRAY(BigInteger)))
    return _o.c.id.in_(bindparam("sg_ids", expanding=True))


def _owned_update(backend: _sql.Backend, what: str, values: Callable[[], dict[str, Any]]) -> Any:
    """``UPDATE`` of the batch ``:sg_ids`` this relay (``:sg_owner``) still holds unpublished (built once)."""

    def build() -> Any:
        mine = (_ids_in(backend), _o.c.claimed_by == bindparam("sg_owner"), _o.c.published_ms.is_(None))
        return update(_o).where(*mine).values(**values())

    return _write.memo.get_or_build((f"outbox_{what}", backend), build)


def _mark_statement(backend: _sql.Backend) -> Any:
    """Mark the batch published (and free its lease)."""
    return _owned_update(
        backend, "mark", lambda: {"published_ms": _sql.db_now_ms(), "claimed_until_ms": None}
    )


def _release_statement(backend: _sql.Backend) -> Any:
    """Give the batch back unpublished: claimable again at once."""
    return _owned_update(backend, "release", lambda: {"claimed_until_ms": None})


_READ_COMMITTED: Final = text("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")


def _begin(conn: Connection) -> _sql.Backend:
    """Start one of the relay's short transactions on ``conn``; its Backend.

    SQLite: take the write lock first (its only lock).  InnoDB: READ
    COMMITTED, whose locking reads lock only the rows they return, with no
    gap locks: at REPEATABLE READ the claim's index scan would lock the gaps
    new events are inserted into (emit would wait on a relay) and the rows it
    rejected, and claims and marks of several relays deadlock on them.
    """
    backend = _sql.backend(conn.dialect)
    if backend.locking_read:
        # Before the transaction's first statement: SET TRANSACTION applies to the next one.
        _write.execute(conn, _READ_COMMITTED)
    _write.sqlite_write_lock(conn)
    return backend


def _event(row: Any) -> OutboxEvent:
    stored = row.payload
    return OutboxEvent(int(row.id), row.topic, row.key, json.loads(stored), int(row.created_ms), stored)


# --------------------------------------------------------------------------
# Relays
# --------------------------------------------------------------------------


def _autocommit(dialect: Any) -> bool:
    """Whether a relay runs its steps in autocommit: each is one statement (PostgreSQL).

    The claim (one ``UPDATE ... RETURNING`` with the heads locked ``FOR UPDATE
    SKIP LOCKED`` in it), the mark and the release are each one statement
    there, atomic on their own: autocommit saves the BEGIN and COMMIT round
    trips.  SQLite takes its write lock with a BEGIN IMMEDIATE first, MariaDB
    sets READ COMMITTED first: they keep their transaction.
    """
    backend = _sql.backend(dialect)
    return backend.returning and backend.row_locks


#: How often the mark is tried again after a serialization failure or deadlock before the
#: events are left to their lease (published again later: at least once).
_MARK_ATTEMPTS: Final = 3


class _RelayCore(Generic[E]):
    """What :class:`Relay` and :class:`AsyncRelay` share: the options, the cycle and the loop, written once.

    The cycle and the loop are generators of steps (``stateguard._async.Steps``):
    each database step and each publish goes through ``yield from``
    :meth:`_db` / :meth:`_publish` / :meth:`_idle`, which the sync relay runs at
    once and the async one awaits.
    """

    def __init__(
        self,
        engine: E,
        sink: Sink | Any,
        *,
        topics: Iterable[str] | None = None,
        batch: int = 100,
        lease: timedelta = timedelta(seconds=30),
    ) -> None:
        dialect = self._dialect_of(engine)
        if not callable(getattr(sink, "publish", None)):
            raise InvalidArgument(
                f"{type(self).__name__} needs a sink with a publish(events) method (a Sink), got {sink!r}: "
                f"wrap a function in CallableSink(fn)"
            )
        if batch is not None and type(batch) is int and batch > MAX_BATCH:
            raise InvalidArgument(f"batch must be at most {MAX_BATCH}, got {batch!r}")
        self.sink = sink
        self.batch = _write.check_batch(batch)
        self.lease_ms = _write.duration_ms(lease, "lease")
        if topics is None:
            self.topics: tuple[str, ...] | None = None
        else:
            if isinstance(topics, str):
                raise InvalidArgument(f"topics must be a list of topics, not one str: pass [{topics!r}]")
            self.topics = tuple(_write.check_text(t, "topic", MAX_TOPIC) for t in topics)
            if not self.topics:
                raise InvalidArgument("topics must name at least one topic (or be None: every topic)")
        self.engine: E = engine
        #: What each step's transaction begins on: autocommit where each step is one statement.
        self._steps_engine: E = (
            engine.execution_options(isolation_level="AUTOCOMMIT") if _autocommit(dialect) else engine
        )

    @staticmethod
    def _dialect_of(engine: Any) -> Any:
        """The engine's dialect; :class:`InvalidArgument` for anything but the relay's kind of engine."""
        raise NotImplementedError

    def run_once(self) -> Any:
        """One cycle: its count, or (AsyncRelay) a coroutine of it."""
        raise NotImplementedError

    def _db(self, fn: Callable[..., T], /, *args: Any) -> Steps[T]:
        """``fn(conn, *args)`` in a short transaction of its own (on PostgreSQL one statement)."""
        raise NotImplementedError

    def _publish(self, events: list[OutboxEvent]) -> Steps[Any]:
        """Hand ``events`` to the sink."""
        raise NotImplementedError

    def _idle(self, stop: Any, seconds: float) -> Steps[Any]:
        """Wait ``seconds`` or until ``stop`` is set."""
        raise NotImplementedError

    # -- the statements of one cycle, each in its own transaction ---------------

    def _claim(self, conn: Connection, owner: str) -> list[OutboxEvent]:
        """Claim up to ``batch`` events (see the module docstring for why this keeps per-key order)."""
        backend = _begin(conn)
        params: dict[str, Any] = {"sg_batch": self.batch}
        if self.topics is not None:
            params["sg_topics"] = list(self.topics)
        if backend.returning:
            params["sg_owner"] = owner
            params["sg_lease"] = self.lease_ms
            claimed = _write.execute(conn, _claim_once_statement(backend, self.topics is not None), params)
            return sorted((_event(r) for r in claimed), key=lambda e: e.id)
        heads = [
            _event(r)
            for r in _write.execute(conn, _heads_statement(backend, self.topics is not None), params)
        ]
        if not heads:
            return []
        taken = {e.id: e for e in heads}
        head_of = {e.key: e.id for e in heads if e.key is not None}
        if head_of and len(taken) < self.batch:
            # The heads are locked by this transaction: no other relay can claim any event of
            # their keys until this claim commits (it would have to lock the same head).
            rows = _write.execute(conn, _followers_statement(backend), {"sg_keys": list(head_of)})
            blocked: set[str] = set()
            for row in rows:
                key = row.key
                if key in blocked or row.id == head_of[key]:
                    continue
                free = row.claimed_until_ms is None or row.claimed_until_ms <= row.sg_now
                wanted = self.topics is None or row.topic in self.topics
                if row.id < head_of[key] or not free or not wanted or len(taken) >= self.batch:
                    # Contiguous only: an event this relay cannot take holds back every later one of its key.
                    blocked.add(key)
                    continue
                taken[row.id] = _event(row)
        ids = sorted(taken)
        _write.execute(
            conn, _claim_statement(backend), {"sg_ids": ids, "sg_owner": owner, "sg_lease": self.lease_ms}
        )
        return [taken[i] for i in ids]

    @staticmethod
    def _mark(conn: Connection, owner: str, ids: list[int]) -> int:
        backend = _begin(conn)
        return int(
            _write.execute(conn, _mark_statement(backend), {"sg_ids": ids, "sg_owner": owner}).rowcount
        )

    @staticmethod
    def _release(conn: Connection, owner: str, ids: list[int]) -> int:
        backend = _begin(conn)
        return int(
            _write.execute(conn, _release_statement(backend), {"sg_ids": ids, "sg_owner": owner}).rowcount
        )

    def _cycle(self) -> Steps[int]:
        """Claim, publish, mark: the one algorithm of both relays."""
        owner = uuid.uuid4().hex
        try:
            events = yield from self._db(self._claim, owner)
        except SerializationConflict as error:
            # The claim's transaction rolled back: nothing was claimed, the next cycle tries again.
            log.info("outbox relay: claim not made (%s), retrying on the next cycle", error)
            return 0
        if not events:
            return 0
        ids = [e.id for e in events]
        try:
            yield from self._publish(events)
        except BaseException:
            # Nothing of the batch counts as published: free it for the next claim at once.
            try:
                yield from self._db(self._release, owner, ids)
            except Exception:  # the lease frees it later; the sink's error matters
                log.warning(
                    "releasing the claim of %d outbox events failed; they wait for the lease", len(ids)
                )
            raise
        for attempt in range(_MARK_ATTEMPTS):
            try:
                marked = yield from self._db(self._mark, owner, ids)
                break
            except SerializationConflict:
                if attempt == _MARK_ATTEMPTS - 1:
                    raise
        if marked < len(ids):
            # The lease ended before the mark and another relay claimed (some of) them: the sink
            # gets those again.  A lease shorter than a batch's publishing makes this common.
            log.warning(
                "outbox relay: %d of %d published events had been claimed by another relay before "
                "they were marked (lease %d ms too short?); they will be published again",
                len(ids) - marked,
                len(ids),
                self.lease_ms,
            )
        return len(events)

    def _serve(self, stop: Any, idle_sleep: float) -> Steps[None]:
        """Cycles until ``stop`` is set, waiting ``idle_sleep`` after one that published nothing."""
        idle = _write.required_seconds(idle_sleep, "idle_sleep")
        while not stop.is_set():
            try:
                # through run_once(), which a subclass may extend (the CLI counts with it)
                published = yield from step(self.run_once())
            except Exception as error:  # _keep_running decides
                _keep_running(error)
                published = 0
            if published == 0:
                yield from self._idle(stop, idle)


class Relay(_RelayCore[Engine]):
    """Publish committed outbox events through a :class:`Sink`, at least once, per-key in order.

    ::

        relay = Relay(engine, RedisStreamSink(redis.Redis(), stream="events"), batch=500)
        relay.run_once()          # one batch: claimed, published, marked; returns how many
        relay.run(stop_event)     # until stop_event (a threading.Event) is set

    Several relays (threads or processes, on one or several machines) share
    the work: each claims different events (``SKIP LOCKED`` on PostgreSQL
    and MariaDB, the write lock on SQLite), and events of one key are
    published in id order.  ``topics`` limits a relay to those topics (a
    key's event of another topic then holds back its later events until a
    relay for that topic published it).  ``lease`` is how long a claim
    lasts on the database's clock: a relay that dies with a batch leaves it
    to another relay after the lease, so the sink may see it twice (at least
    once); make it comfortably longer than a batch takes to publish.

    :raises InvalidArgument: a sink without ``publish``, a ``batch`` that is
        not an int from 1 to 10000, a ``lease`` that is not a positive
        timedelta, or bad ``topics``.
    """

    @staticmethod
    def _dialect_of(engine: Any) -> Any:
        if not isinstance(engine, Engine):
            raise InvalidArgument(
                f"Relay needs an Engine, got {type(engine).__name__}"
                + ("; use AsyncRelay with an AsyncEngine" if "Async" in type(engine).__name__ else "")
            )
        return engine.dialect

    def run_once(self) -> int:
        """Claim one batch, publish it, mark it published; return how many events were published.

        0 means nothing was free to claim.

        :raises Exception: what the sink raised (the batch stays unpublished
            and is claimable again at once);
            :class:`~stateguard.SerializationConflict` from the database
            (retryable: run again).
        """
        return run_steps(self._cycle())

    def run(self, stop_event: threading.Event | None = None, *, idle_sleep: float = 1.0) -> None:
        """Run batches until ``stop_event`` is set (forever without one).

        After a batch that found nothing to publish, waits ``idle_sleep``
        seconds (or until ``stop_event`` is set).  A sink error or a
        retryable database error is logged (logger ``stateguard.outbox``)
        and retried after ``idle_sleep``; other errors propagate.
        """
        run_steps(self._serve(stop_event if stop_event is not None else threading.Event(), idle_sleep))

    def _db(self, fn: Callable[..., T], /, *args: Any) -> Steps[T]:
        with self._steps_engine.begin() as conn:
            return step(fn(conn, *args))

    def _publish(self, events: list[OutboxEvent]) -> Steps[Any]:
        result = self.sink.publish(events)
        if inspect.isawaitable(result):
            if inspect.iscoroutine(result):
                result.close()
            raise InvalidArgument(
                f"the sink {self.sink!r} returned an awaitable: an async sink needs AsyncRelay; "
                f"the batch stays unpublished"
            )
        return step(result)

    def _idle(self, stop: threading.Event, seconds: float) -> Steps[None]:
        stop.wait(seconds)
        return step(None)


class AsyncRelay(_RelayCore["AsyncEngine"]):
    """:class:`Relay` on an :class:`~sqlalchemy.ext.asyncio.AsyncEngine`: the same cycle, awaited.

    ::

        relay = AsyncRelay(async_engine, CallableSink(send_batch))
        await relay.run_once()
        await relay.run(stop)     # stop: an asyncio.Event

    The sink's ``publish`` may be a coroutine function (a ``redis.asyncio``
    client's :class:`~stateguard.redis.RedisStreamSink`); a synchronous one
    runs in the event loop's thread.
    """

    @staticmethod
    def _dialect_of(engine: Any) -> Any:
        if type(engine).__name__ != "AsyncEngine" or not hasattr(engine, "sync_engine"):
            raise InvalidArgument(f"AsyncRelay needs an AsyncEngine, got {type(engine).__name__}")
        return engine.sync_engine.dialect

    async def run_once(self) -> int:
        """Claim one batch, publish it, mark it published; return how many events were published."""
        return await Awaited(self._cycle())

    async def run(self, stop_event: asyncio.Event | None = None, *, idle_sleep: float = 1.0) -> None:
        """Run batches until ``stop_event`` is set (forever without one); see :meth:`Relay.run`."""
        await Awaited(self._serve(stop_event if stop_event is not None else asyncio.Event(), idle_sleep))

    def _db(self, fn: Callable[..., T], /, *args: Any) -> Steps[T]:
        return step(self._in_transaction(fn, args))

    async def _in_transaction(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        async with self._steps_engine.begin() as conn:
            return await conn.run_sync(fn, *args)

    def _publish(self, events: list[OutboxEvent]) -> Steps[Any]:
        return step(self.sink.publish(events))

    def _idle(self, stop: asyncio.Event, seconds: float) -> Steps[None]:
        return step(self._wait(stop, seconds))

    @staticmethod
    async def _wait(stop: asyncio.Event, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)


def _keep_running(error: Exception) -> None:
    """Log an error a running relay survives (the sink's, a retryable conflict); re-raise any other."""
    if isinstance(error, StateguardError) and not error.retryable:
        raise error
    log.warning("outbox relay: batch not published, retrying: %s: %s", type(error).__name__, error)


# --------------------------------------------------------------------------
# Purge
# --------------------------------------------------------------------------


@dual_bind
def purge_published(bind: Engine | Connection | Session, *, older_than: timedelta, batch: int = 1000) -> int:
    """Delete at most ``batch`` events published more than ``older_than`` ago; return how many.

    Unpublished events are never deleted.  Ages are judged on the database's
    clock.  With an Engine the batch runs in its own short transaction; with
    a Connection or Session in the caller's.  Loop until it returns less
    than ``batch`` (``stateguard purge --outbox-retention`` does)::

        while purge_published(engine, older_than=timedelta(days=7)) == 1000:
            pass

    :raises InvalidArgument: ``older_than`` is not a positive timedelta or
        ``batch`` not a positive int.
    """
    old = and_(_o.c.published_ms.is_not(None), _o.c.published_ms <= _sql.db_now_ms() - bindparam("sg_older"))
    return _write.purge_rows(_o, bind, batch, old, sg_older=_write.duration_ms(older_than, "older_than"))
