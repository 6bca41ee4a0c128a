"""The relays: claim a batch, publish it through the sink, mark what the sink accepted; repeat.

:class:`Relay` (an Engine) and :class:`AsyncRelay` (an AsyncEngine) share
one cycle and one loop, written once in :class:`_RelayCore` as generators of
steps.  A batch the sink refuses is taken apart (:meth:`_RelayCore._isolate`)
so that one event the sink always refuses holds back only its own key; each
refusal is counted on the event and an event refused ``max_attempts`` times
is parked dead (:mod:`stateguard.outbox.dead`).  With ``hold="locks"``
(PostgreSQL's default) the cycle is one transaction instead
(:mod:`stateguard.outbox.held`).  ``run()`` survives every
error of the sink and of the database and ends only when asked to, or when
the relay's own setup is wrong (stateguard's table or its columns missing).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import random
import threading
import uuid
from collections.abc import Callable, Coroutine, Iterable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

from sqlalchemy import Connection, Dialect, Engine
from sqlalchemy import exc as sa_exc
from sqlalchemy import inspect as sa_inspect

from .. import _compat, _kernel
from .._async import Steps, run_steps, step
from ..exceptions import ConfigurationError, InvalidArgument, SerializationConflict
from ..tables import outbox
from .events import MAX_TOPIC, OutboxEvent, Sink
from .held import _Holding, _holds_locks
from .refusals import _Isolation, _Round
from .statements import (
    HOLDS,
    KEY_ORDERS,
    LEASE,
    LOCKS,
    SKIP_DEAD,
    STRICT,
    _begin,
    _claim_once_statement,
    _claim_statement,
    _event,
    _followers_statement,
    _heads_statement,
    _mark_statement,
    _refuse_statement,
    _release_statement,
)
from .wakeup import AsyncListener, Listener, Poll, notifies

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

log = logging.getLogger("stateguard.outbox")

T = TypeVar("T")
#: The engine a relay runs on: an Engine (Relay) or an AsyncEngine (AsyncRelay).
E = TypeVar("E", "Engine", "AsyncEngine")

#: Largest ``batch`` a relay or a purge accepts (one statement's IN list).
MAX_BATCH: Final = 10_000
#: How often the sink may refuse an event before it is parked dead (``max_attempts``).
DEFAULT_MAX_ATTEMPTS: Final = 10
#: The first wait before a refused event is tried again; it doubles with each refusal.
DEFAULT_RETRY_DELAY: Final = timedelta(seconds=1)
#: The longest wait before a refused event is tried again (or ``retry_delay``, if longer).
MAX_RETRY_DELAY_MS: Final = 60_000
#: The longest pause of ``run()`` after rounds that failed one after another (a sink or database down).
MAX_BACKOFF_S: Final = 30.0
#: Characters of a refusal's error kept in ``last_error``.
MAX_ERROR: Final = 500

#: How often the mark is tried again after a serialization failure or deadlock before the
#: events are left to their lease (published again later: at least once).
_MARK_ATTEMPTS: Final = 3


def _autocommit(dialect: Any) -> bool:
    """Whether a relay runs its steps in autocommit: each is one statement (PostgreSQL).

    The claim (one ``UPDATE ... RETURNING`` with the heads locked ``FOR UPDATE
    SKIP LOCKED`` in it), the mark and the release are each one statement
    there, atomic on their own: autocommit saves the BEGIN and COMMIT round
    trips.  SQLite takes its write lock with a BEGIN IMMEDIATE first, MariaDB
    sets READ COMMITTED first: they keep their transaction.
    """
    backend = _kernel.backend(dialect)
    return backend.returning and backend.row_locks


def _error_text(error: BaseException) -> str:
    """``"Type: message"`` as ``last_error`` keeps it: at most 500 characters, valid UTF-8."""
    text = f"{type(error).__name__}: {error}"[:MAX_ERROR]
    return text.encode("utf-8", "replace").decode("utf-8")


class _RelayCore(_Isolation, _Holding, Generic[E]):
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
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        retry_delay: timedelta = DEFAULT_RETRY_DELAY,
        key_order: str = SKIP_DEAD,
        hold: str | None = None,
    ) -> None:
        dialect = self._dialect_of(engine)
        if not callable(getattr(sink, "publish", None)):
            raise InvalidArgument(
                f"{type(self).__name__} needs a sink with a publish(events) method (a Sink), got {sink!r}: "
                f"wrap a function in CallableSink(fn)"
            )
        if batch is not None and type(batch) is int and batch > MAX_BATCH:
            raise InvalidArgument(f"batch must be at most {MAX_BATCH}, got {batch!r}")
        if type(max_attempts) is not int or max_attempts < 1:
            raise InvalidArgument(
                f"max_attempts must be an int >= 1 (refusals before an event is parked dead), "
                f"got {max_attempts!r}"
            )
        if key_order not in KEY_ORDERS:
            raise InvalidArgument(
                f"key_order must be {SKIP_DEAD!r} (a dead event lets its key's later events go) or "
                f"{STRICT!r} (they wait until it is requeued and published), got {key_order!r}"
            )
        if hold is None:
            hold = LOCKS if _holds_locks(dialect) else LEASE
        elif hold not in HOLDS:
            raise InvalidArgument(
                f"hold must be {LOCKS!r} (the row locks of a transaction open over the publish), "
                f"{LEASE!r} (a committed lease) or None (locks where the database can), got {hold!r}"
            )
        elif hold == LOCKS and not _holds_locks(dialect):
            raise InvalidArgument(
                f"hold={LOCKS!r} needs PostgreSQL (one locking claim statement that returns its rows); "
                f"{_kernel.backend(dialect).name} relays hold their claims with a lease: "
                f"hold={LEASE!r} or None"
            )
        self.sink = sink
        #: How the relay holds a claimed batch while it publishes it: ``"locks"`` or ``"lease"``.
        self.hold = hold
        self.batch = _kernel.check_batch(batch)
        self.lease_ms = _kernel.duration_ms(lease, "lease")
        self.max_attempts = max_attempts
        self.retry_delay_ms = _kernel.duration_ms(retry_delay, "retry_delay")
        self.key_order = key_order
        if topics is None:
            self.topics: tuple[str, ...] | None = None
        else:
            if isinstance(topics, str):
                raise InvalidArgument(f"topics must be a list of topics, not one str: pass [{topics!r}]")
            self.topics = tuple(_kernel.check_text(t, "topic", MAX_TOPIC) for t in topics)
            if not self.topics:
                raise InvalidArgument("topics must name at least one topic (or be None: every topic)")
        self.engine: E = engine
        #: What each step's transaction begins on: autocommit where each step is one statement.
        self._steps_engine: E = (
            engine.execution_options(isolation_level="AUTOCOMMIT") if _autocommit(dialect) else engine
        )
        #: What a held claim's transaction begins on (hold="locks"): READ COMMITTED, whatever the
        #: engine's own level, so the claim's locking read re-checks rows changed since its snapshot.
        self._held_engine: E = engine.execution_options(isolation_level="READ COMMITTED")
        #: Whether run() waits on LISTEN/NOTIFY (PostgreSQL) rather than polling alone.
        self._notified = notifies(_kernel.backend(dialect))
        #: The listening connection of run(), while it runs (tests reach it to kill it).
        self._listener: Any = None
        #: The last error of the relay's own making that ends run() (its setup is wrong).
        self._fatal: BaseException | None = None
        self._schema_checked = False

    @staticmethod
    def _dialect_of(engine: Any) -> Dialect:
        """The engine's dialect; :class:`InvalidArgument` for anything but the relay's kind of engine."""
        raise NotImplementedError

    def run_once(self) -> int | Coroutine[Any, Any, int]:
        """One cycle: its count, or (AsyncRelay) a coroutine of it."""
        raise NotImplementedError

    def _db(self, fn: Callable[..., T], /, *args: Any) -> Steps[T]:
        """``fn(conn, *args)`` in a short transaction of its own (on PostgreSQL one statement)."""
        raise NotImplementedError

    def _call_sink(self, fn: Callable[..., Any], /, *args: Any) -> Steps[Any]:
        """``fn(*args)``, a method of the sink (``publish``, ``probe``): its result, awaited if need be."""
        raise NotImplementedError

    def _publish(self, events: list[OutboxEvent]) -> Steps[Any]:
        """Hand ``events`` to the sink."""
        return self._call_sink(self.sink.publish, events)

    def _idle(self, stop: Any, seconds: float) -> Steps[Any]:
        """Wait ``seconds`` or until ``stop`` is set."""
        raise NotImplementedError

    def _make_listener(self) -> Listener | AsyncListener:
        """A :class:`~.wakeup.Listener` (or its async twin) on the relay's engine."""
        raise NotImplementedError

    # -- the statements of one cycle, each in its own transaction ---------------

    def _claim(self, conn: Connection, owner: str) -> list[OutboxEvent]:
        """Claim up to ``batch`` events (see the package docstring for why this keeps per-key order)."""
        backend = _begin(conn)
        strict = self.key_order == STRICT
        params: dict[str, Any] = {"sg_batch": self.batch}
        if self.topics is not None:
            params["sg_topics"] = list(self.topics)
        if backend.returning:
            params["sg_owner"] = owner
            params["sg_lease"] = self.lease_ms
            stmt = _claim_once_statement(backend, self.topics is not None, strict)
            claimed = _kernel.execute(conn, stmt, params)
            return sorted((_event(r) for r in claimed), key=lambda e: e.id)
        heads = [
            _event(r)
            for r in _kernel.execute(conn, _heads_statement(backend, self.topics is not None, strict), params)
        ]
        if not heads:
            return []
        taken = {e.id: e for e in heads}
        head_of = {e.key: e.id for e in heads if e.key is not None}
        if head_of and len(taken) < self.batch:
            # The heads are locked by this transaction: no other relay can claim any event of
            # their keys until this claim commits (it would have to lock the same head).
            rows = _kernel.execute(conn, _followers_statement(backend, strict), {"sg_keys": list(head_of)})
            blocked: set[str] = set()
            for row in rows:
                key = row.key
                if key in blocked or row.id == head_of[key]:
                    continue
                free = row.dead_ms is None and (
                    row.claimed_until_ms is None or row.claimed_until_ms <= row.sg_now
                )
                wanted = self.topics is None or row.topic in self.topics
                if row.id < head_of[key] or not free or not wanted or len(taken) >= self.batch:
                    # Contiguous only: an event this relay cannot take holds back every later one of its key.
                    blocked.add(key)
                    continue
                taken[row.id] = _event(row)
        ids = sorted(taken)
        _kernel.execute(
            conn, _claim_statement(backend), {"sg_ids": ids, "sg_owner": owner, "sg_lease": self.lease_ms}
        )
        return [taken[i] for i in ids]

    def _count_refusals(
        self,
        conn: Connection,
        backend: _kernel.Backend,
        owner: str | None,
        counted: list[tuple[OutboxEvent, BaseException]],
        delayed: bool,
    ) -> list[int]:
        """Count the refusals of ``counted`` (``owner`` None: the row locks are this transaction's);
        the ids parked dead."""
        dead: list[int] = []
        stmt = _refuse_statement(backend, held=owner is None)
        for event, error in counted:
            refusals = event._refusals + 1
            buried = refusals >= self.max_attempts
            delay = min(
                self.retry_delay_ms * 2 ** min(event._refusals, 32),
                max(MAX_RETRY_DELAY_MS, self.retry_delay_ms),
            )
            params = {
                "sg_id": event.id,
                "sg_error": _error_text(error),
                "sg_delay": delay if delayed else None,  # now + NULL: NULL, free at once
                "sg_dead": 1 if buried else 0,
            }
            if owner is not None:
                params["sg_owner"] = owner
            if _kernel.execute(conn, stmt, params).rowcount and buried:
                dead.append(event.id)
        return dead

    @staticmethod
    def _mark(conn: Connection, owner: str, ids: list[int]) -> int:
        backend = _begin(conn)
        result = _kernel.execute(conn, _mark_statement(backend), {"sg_ids": ids, "sg_owner": owner})
        return len(result.all()) if result.returns_rows else int(result.rowcount)

    @staticmethod
    def _release(conn: Connection, owner: str, ids: list[int]) -> int:
        backend = _begin(conn)
        return int(
            _kernel.execute(conn, _release_statement(backend), {"sg_ids": ids, "sg_owner": owner}).rowcount
        )

    def _settle(
        self,
        conn: Connection,
        owner: str,
        counted: list[tuple[OutboxEvent, BaseException]],
        free: list[int],
        delayed: bool,
    ) -> list[int]:
        """Count the refusals of ``counted`` (parked dead once refused ``max_attempts`` times;
        ``delayed``: claimable again only after their retry delay) and give ``free`` back at once;
        return the ids parked dead."""
        backend = _begin(conn)
        dead = self._count_refusals(conn, backend, owner, counted, delayed)
        if free:
            _kernel.execute(conn, _release_statement(backend), {"sg_ids": free, "sg_owner": owner})
        return dead

    @staticmethod
    def _check_schema(conn: Connection) -> None:
        """:class:`ConfigurationError` when stateguard's outbox table, or a column of it, is missing."""
        try:
            # schema_for_object: the schema a schema_translate_map sends the table to.
            schema = conn.schema_for_object(outbox)
            have = {c["name"] for c in sa_inspect(conn).get_columns(outbox.name, schema=schema)}
        except sa_exc.NoSuchTableError:
            have = set()
        missing = [c.name for c in outbox.columns if c.name not in have]
        if not have:
            raise ConfigurationError(
                f"stateguard's table {outbox.name} is missing from this database; create it with "
                f"`alembic upgrade stateguard@head` (see stateguard.migrations_location()) or "
                f"stateguard.create_tables(engine)"
            )
        if missing:
            raise ConfigurationError(
                f"{outbox.name} lacks the columns {', '.join(missing)} of this stateguard version: run "
                f"`alembic upgrade stateguard@head` (see stateguard.migrations_location())"
            )

    # -- the cycle -------------------------------------------------------------

    def _cycle(self) -> Steps[int]:
        """Claim, publish, mark: the one algorithm of both relays."""
        if self.hold == LOCKS:
            return (yield from self._held_cycle())
        owner = uuid.uuid4().hex
        events = yield from self._claimed(self._db, self._claim, owner)
        if not events:
            return 0
        outcome = yield from self._isolate(events)
        accepted = outcome.accepted
        if accepted:
            yield from self._mark_accepted(owner, accepted)
        taken = {e.id for e in accepted}
        rest = [e for e in events if e.id not in taken]
        if rest:
            yield from self._give_back(owner, outcome, rest)
        return outcome.published()

    def _claimed(
        self, run: Callable[..., Steps[list[OutboxEvent]]], /, *args: Any
    ) -> Steps[list[OutboxEvent]]:
        """The events ``run(*args)`` (either hold's claim) returns; none when it lost a race.

        ``run`` is called here, not by the caller: a synchronous relay's ``_db``
        runs its statement when called, not when iterated.

        A conflict rolled the claim's transaction back: nothing was claimed, the
        next cycle tries again.  A :class:`ConfigurationError` (stateguard_outbox
        was dropped since) ends the relay.
        """
        try:
            return (yield from run(*args))
        except SerializationConflict as error:
            log.info("outbox relay: claim not made (%s), retrying on the next cycle", error)
            return []
        except ConfigurationError as error:
            self._fatal = error
            raise

    def _mark_accepted(self, owner: str, accepted: list[OutboxEvent]) -> Steps[None]:
        ids = [e.id for e in accepted]
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

    def _give_back(self, owner: str, outcome: _Round, rest: list[OutboxEvent]) -> Steps[None]:
        """Release what the sink did not take; count the refusals :meth:`_isolate` found.

        A counted event is claimable again after its retry delay when the
        sink took other events of the round (they keep flowing while it
        waits), at once when it took nothing (``run()``'s backoff spaces the
        next try).  Every other event of ``rest`` (untried, behind a refused
        event of its key, or failed while the sink was down) is free at once
        and nothing is counted for it: a sink that is down for any number of
        rounds parks no event.
        """
        counted = outcome.refused if outcome.interrupt is None else []
        kept = {e.id for e, _ in counted}
        free = [e.id for e in rest if e.id not in kept]
        try:
            dead = yield from self._db(self._settle, owner, counted, free, bool(outcome.accepted))
        except Exception:  # the lease frees them later; the sink's error matters
            log.warning(
                "outbox relay: giving back %d outbox events failed; they wait for the lease", len(rest)
            )
            return
        self._report(counted, dead)

    def _report(self, counted: list[tuple[OutboxEvent, BaseException]], dead: list[int]) -> None:
        """Log the refusals counted in a round, and the events they parked dead."""
        for event, error in counted:
            log.warning(
                "outbox relay: the sink refused event %d (topic %r, key %r): %s",
                event.id,
                event.topic,
                event.key,
                _error_text(error),
            )
        if dead:
            log.error(
                "outbox relay: events %s refused %d times are parked dead (stateguard inspect lists them; "
                "requeue them with stateguard.requeue_dead() or `stateguard outbox requeue`)",
                dead,
                self.max_attempts,
            )

    def _serve(self, stop: Any, idle_sleep: float) -> Steps[None]:
        """Cycles until ``stop`` is set: at once after one that published, after a wake-up (a NOTIFY,
        or the adaptive poll's sleep, :mod:`.wakeup`) after one that found nothing, after a bounded,
        jittered backoff after rounds that failed."""
        idle = _kernel.required_seconds(idle_sleep, "idle_sleep")
        failed = 0
        poll = Poll()
        self._listener = self._make_listener() if self._notified else None
        try:
            while not stop.is_set():
                try:
                    if not self._schema_checked:
                        # Once per relay: a table of an older stateguard would fail only at a refusal.
                        try:
                            yield from self._db(self._check_schema)
                        except ConfigurationError as error:
                            self._fatal = error
                            raise
                        self._schema_checked = True
                    # through run_once(), which a subclass may extend (the CLI counts with it)
                    published = yield from step(self.run_once())
                except Exception as error:
                    if error is self._fatal:
                        log.error("outbox relay: stopped: %s", error)
                        raise
                    failed += 1
                    pause = _backoff(idle, failed)
                    log.warning(
                        "outbox relay: batch not published, retrying in %.2f s: %s",
                        pause,
                        _error_text(error),
                    )
                    yield from self._idle(stop, pause)
                    continue
                failed = 0
                if published:
                    poll.worked()
                    continue
                listener = self._listener
                if listener is not None and listener.usable and (yield from step(listener.wait(stop, idle))):
                    continue
                yield from self._idle(stop, poll.seconds(idle))
        finally:
            listener, self._listener = self._listener, None
            if listener is not None:
                yield from step(listener.close())


def _backoff(idle: float, failed: int) -> float:
    """The pause after ``failed`` failed rounds in a row: ``idle`` doubling up to 30 s, jittered."""
    ceiling = min(max(idle, MAX_BACKOFF_S), idle * 2 ** min(failed - 1, 32))
    return float(ceiling * random.uniform(0.5, 1.0))  # spread relays that failed together, not security


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

    ``hold`` is how the relay holds a batch while the sink publishes it:

    * ``"locks"`` (the default on PostgreSQL): the claim is a ``SELECT ...
      FOR UPDATE SKIP LOCKED`` in a READ COMMITTED transaction that stays
      open over the publish and commits with the mark.  Each event is
      written once (the mark), not twice (lease, then mark); a relay that
      dies frees its batch at once (its transaction rolls back with its
      connection), and one whose publish outlasts ``lease`` loses its
      session (``idle_in_transaction_session_timeout``), so its batch goes
      to another relay as after a lease.  It costs a connection, and an open
      transaction (holding back VACUUM), per relay for as long as a publish
      takes.  ``attempts`` counts the publishes and refusals that committed.
    * ``"lease"`` (MariaDB's and SQLite's only way): the claim commits a
      lease on each event, the publish runs outside any transaction, and
      the mark is a second write.

    Both keep the same order per key and may run side by side on one table.

    An event the sink refuses holds back only its own key: the relay takes a
    refused batch apart and publishes the rest.  The refused event is tried
    again after ``retry_delay`` (doubling, at most a minute), its key's later
    events waiting behind it; refused ``max_attempts`` times it is parked
    *dead*: never deleted, listed by ``stateguard inspect``, given back by
    :func:`~stateguard.requeue_dead`.  ``key_order="skip_dead"`` (the
    default) then lets the key's later events go; ``key_order="strict"``
    keeps them waiting until the dead event is requeued and published.

    What counts as a refusal: a sink that is *down* refuses nothing, however
    long it lasts, so an outage parks no event and keeps every key's order.
    A refusal is counted for an event only when the sink works and still
    does not take it:

    * the sink's error names it refused (``refused_ids`` of
      :class:`~stateguard.PublishFailed`: a nack, an unroutable or too
      large message); events it names only as not published
      (``event_ids``: unconfirmed, unsent) are given back uncounted;
    * or the relay isolated it (published it alone after its batch failed),
      the sink took other events after that failure in the same round (or
      answered the sink's ``probe()``), and it failed again when tried alone
      once more;
    * or, with no such evidence (nothing else to try, a sink without
      ``probe()``), it failed alone with an error that is not one of an
      unreachable sink.

    Never counted: OSError (connection refused or reset, timeouts), classes
    named ``ConnectionError`` or ``TimeoutError`` (redis-py's too),
    retryable errors (``PublishFailed`` that refuses nothing), a
    ConfigurationError, a round in which three events in a row failed alone
    (the round ends there), a failed ``probe()``.  Those events are free
    again at once and ``run()`` backs off.

    ``run()`` wakes on PostgreSQL's LISTEN/NOTIFY: :func:`~stateguard.emit`
    and transitions with ``events=True`` NOTIFY in their own statement, so an
    idle relay claims an event moments after its COMMIT; elsewhere it polls
    adaptively (``stateguard.outbox.wakeup``).  A lost notification loses
    no event: the poll every ``idle_sleep`` finds it.  On PostgreSQL the
    claim and the mark commit without waiting for the disk flush: a crash
    can only free a claim again or publish an event again (at least once).

    :raises InvalidArgument: a sink without ``publish``, a ``batch`` that is
        not an int from 1 to 10000, a ``lease`` or ``retry_delay`` that is not
        a positive timedelta, ``max_attempts`` not an int >= 1, an unknown
        ``key_order``, or bad ``topics``, a ``hold`` that is not ``"locks"``,
        ``"lease"`` or None, ``"locks"`` elsewhere than on PostgreSQL.
    """

    @staticmethod
    def _dialect_of(engine: Any) -> Dialect:
        if not isinstance(engine, Engine):
            raise InvalidArgument(
                f"Relay needs an Engine, got {type(engine).__name__}"
                + ("; use AsyncRelay with an AsyncEngine" if "Async" in type(engine).__name__ else "")
            )
        return engine.dialect

    def run_once(self) -> int:
        """Claim one batch, publish what the sink takes, mark it published; return how many were.

        0 means nothing was free to claim.  Events the sink refused are given
        back (see the class docstring); when it took none of the batch, the
        sink's first error is raised.

        :raises Exception: what the sink raised when it took nothing of the
            batch (the batch stays unpublished);
            :class:`~stateguard.SerializationConflict` from the database
            (retryable: run again).
        """
        return run_steps(self._cycle())

    def run(self, stop_event: threading.Event | None = None, *, idle_sleep: float = 1.0) -> None:
        """Run batches until ``stop_event`` is set (forever without one).

        After a batch that published, the next comes at once; after one that
        found nothing, it waits for a wake-up: a NOTIFY on PostgreSQL (at most
        ``idle_sleep`` seconds, the poll that finds what a lost notification
        announced), elsewhere an adaptive poll (5 ms, doubling up to
        ``idle_sleep`` while rounds keep finding nothing); ``stop_event`` ends
        any wait at once (within 50 ms on PostgreSQL).  Any error of the sink
        (whatever its type, a :class:`~stateguard.StateguardError` too) or of
        the database is logged (logger ``stateguard.outbox``) and the batch
        tried again after a pause that doubles from ``idle_sleep`` up to 30
        seconds (jittered) while rounds keep failing.  It returns only when
        ``stop_event`` is set; it raises only for the relay's own setup
        (:class:`~stateguard.ConfigurationError`: stateguard's outbox table or
        its columns are missing, an async sink on this synchronous relay) and
        for KeyboardInterrupt and SystemExit.
        """
        run_steps(self._serve(stop_event if stop_event is not None else threading.Event(), idle_sleep))

    def _db(self, fn: Callable[..., T], /, *args: Any) -> Steps[T]:
        with _commit_conflicts(), self._steps_engine.begin() as conn:
            return step(fn(conn, *args))

    def _open(self) -> Steps[Connection]:
        conn = self._held_engine.connect()
        try:
            conn.begin()
        except BaseException:
            conn.close()
            raise
        return step(conn)

    def _on(self, conn: Connection, fn: Callable[..., T], /, *args: Any) -> Steps[T]:
        return step(fn(conn, *args))

    def _end(self, conn: Connection, commit: bool) -> Steps[None]:
        try:
            if commit:
                conn.commit()
        finally:
            conn.close()  # rolls back what is not committed
        return step(None)

    def _call_sink(self, fn: Callable[..., Any], /, *args: Any) -> Steps[Any]:
        result = fn(*args)
        if inspect.isawaitable(result):
            if inspect.iscoroutine(result):
                result.close()
            self._fatal = InvalidArgument(
                f"the sink {self.sink!r} returned an awaitable: an async sink needs AsyncRelay; "
                f"the batch stays unpublished"
            )
            raise self._fatal
        return step(result)

    def _idle(self, stop: threading.Event, seconds: float) -> Steps[None]:
        stop.wait(seconds)
        return step(None)

    def _make_listener(self) -> Listener:
        return Listener(self.engine)


@contextlib.contextmanager
def _commit_conflicts() -> Iterator[None]:
    """Raise a conflict the COMMIT of a relay's transaction reports as its typed error.

    The statements map their own conflicts; a Galera node certifies the claim
    (or the mark) only at COMMIT, and a relay on another node that claimed the
    same events first makes this COMMIT fail with 1213: DeadlockDetected (a
    SerializationConflict), which the cycle treats as "nothing claimed".
    """
    try:
        yield
    except sa_exc.DBAPIError as error:
        mapped = _kernel.conflict_error(error)
        if mapped is None:
            raise
        raise mapped from error


#: Names this module defined before AsyncRelay got a module of its own, and where they live now.
_MOVED: Final = {"AsyncRelay": "stateguard.outbox.async_relay"}


def __getattr__(name: str) -> Any:
    return _compat.moved(__name__, name, _MOVED)
