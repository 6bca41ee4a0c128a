"""Unique request ids: time-ordered UUIDv7 and 64-bit Snowflake ids.

* :func:`new_request_id`: an RFC 9562 UUIDv7, for ids clients or servers
  make on their own (idempotency keys, message ids).  No coordination.
* :class:`Snowflake`: compact 64-bit ids (41 bits of milliseconds, 10 bits
  of worker id, 12 bits of sequence) that sort by time.  The worker id is
  leased from ``stateguard_worker_leases`` with a conditional UPDATE, so two
  live generators never share one, and the generator waits rather than
  going backwards when the clock does.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any, Final

from sqlalchemy import Engine, bindparam, func, select, update

from . import _kernel
from . import observe as _observe
from .exceptions import InvalidArgument, WorkerIdsExhausted, WorkerLeaseLost
from .tables import worker_leases

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_EPOCH_MS", "MAX_WORKERS", "Snowflake", "new_request_id"]


# --------------------------------------------------------------------------
# UUIDv7
# --------------------------------------------------------------------------

# Python 3.11's uuid module has no uuid7 (it arrives in 3.14), and the
# packages that add it (uuid6, uuid-utils, uuid7) would become the only
# runtime dependency beyond sqlalchemy, alembic and transitions for about
# twenty lines.  This follows RFC 9562 section 6.2, method 1 (the layout
# CPython 3.14 uses): after the 48-bit Unix millisecond timestamp, a 42-bit
# counter (12 bits of rand_a and the top 30 bits of rand_b) seeded randomly
# each millisecond with its top bit clear, then 32 random bits.  Within one
# millisecond the counter increments, so ids from one process are strictly
# increasing; if it overflows, or the clock steps back, the timestamp is
# advanced by one instead (section 6.2: "the timestamp ... MAY be incremented").
_v7_lock = threading.Lock()
_v7_last_ms = 0
_v7_counter = 0

_VERSION_7: Final = 0x7 << 76
_VARIANT_RFC: Final = 0b10 << 62


def _v7_reset() -> None:
    # A forked child would otherwise continue its parent's counter in the same
    # millisecond; the 32 random bits would still differ, but reseeding keeps
    # the guarantee from resting on chance alone.  The lock is made anew: a
    # thread of the parent may have held it at the fork, and that thread does
    # not exist in the child to release it.
    global _v7_lock, _v7_last_ms, _v7_counter
    _v7_lock = threading.Lock()
    _v7_last_ms = 0
    _v7_counter = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_v7_reset)


def new_request_id() -> uuid.UUID:
    """A new time-ordered UUID, version 7 (RFC 9562).

    Ids sort by creation time (to the millisecond across processes, strictly
    within one process), which keeps B-tree indexes on them compact, and
    carry 74 bits that are random or counter::

        request_id = new_request_id()
        headers["Idempotency-Key"] = str(request_id)
    """
    global _v7_last_ms, _v7_counter
    with _v7_lock:
        now = time.time_ns() // 1_000_000
        if now > _v7_last_ms:
            _v7_last_ms = now
            _v7_counter = secrets.randbits(41)  # top bit of the 42 clear: room to count
        else:
            _v7_counter += 1
            if _v7_counter >= 1 << 42:
                _v7_last_ms += 1
                _v7_counter = secrets.randbits(41)
        ms, counter = _v7_last_ms, _v7_counter
    value = (
        (ms & 0xFFFF_FFFF_FFFF) << 80
        | _VERSION_7
        | (counter >> 30) << 64
        | _VARIANT_RFC
        | (counter & 0x3FFF_FFFF) << 32
        | secrets.randbits(32)
    )
    return uuid.UUID(int=value)


# --------------------------------------------------------------------------
# Snowflake
# --------------------------------------------------------------------------

#: The default custom epoch of :class:`Snowflake` ids: 2024-01-01T00:00:00Z.
#: 41 bits of milliseconds after it last until 2093.
DEFAULT_EPOCH_MS: Final = int(datetime(2024, 1, 1, tzinfo=UTC).timestamp() * 1000)

#: Worker ids per namespace (10 bits).
MAX_WORKERS: Final = 1024

_TIME_BITS: Final = 41
_WORKER_BITS: Final = 10
_SEQUENCE_BITS: Final = 12
_MAX_SEQUENCE: Final = (1 << _SEQUENCE_BITS) - 1
#: The longest single sleep of next_id() waiting for the clock to pass the last millisecond used.
_MAX_NAP: Final = 0.05
_MAX_NAMESPACE: Final = 100
#: The longest lease a Snowflake takes: a worker id is meant to come back soon after its holder dies.
_MAX_LEASE: Final = timedelta(days=365)


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


# Statements built once; every value is bound.
#
# Two clocks, kept apart.  Leases are judged and stored on the database's
# clock inside each statement (lease_expires_ms = db_now + lease), so a host
# whose clock runs ahead never takes a live worker id.  The ids carry the
# application's clock, so a holder stores in last_ms, at every claim and
# renewal, a horizon on its own clock that no id it issues before its next
# renewal can pass (its clock + lease: it renews, or stops, a third of a lease
# later); the next holder starts after that, and an orderly close() stores the
# exact last millisecond instead.
_NOW: Final = _kernel.db_now_ms()
#: How many free (never leased, released or expired) rows one look reads.
_FREE_BATCH: Final = 8
# Free or not is the database's judgement (its clock), as in the UPDATE; the server filters, so a
# claim reads a few rows, not the namespace's 1,024.
_FREE_ROWS: Final = (
    select(worker_leases.c.worker_id, worker_leases.c.last_ms)
    .where(
        worker_leases.c.namespace == bindparam("sg_ns"),
        (worker_leases.c.owner.is_(None)) | (worker_leases.c.lease_expires_ms < _NOW),
    )
    .order_by(worker_leases.c.worker_id)
    .limit(_FREE_BATCH)
)
#: How many worker rows the namespace has, and its highest worker id: ids are created lowest
#: unused first, so with no gap (no row deleted by hand) the next unused one is the count.
_ID_SPAN: Final = select(func.count(), func.max(worker_leases.c.worker_id)).where(
    worker_leases.c.namespace == bindparam("sg_ns")
)
_ALL_IDS: Final = (
    select(worker_leases.c.worker_id)
    .where(worker_leases.c.namespace == bindparam("sg_ns"))
    .order_by(worker_leases.c.worker_id)
)
_SAME_ROW: Final = (
    worker_leases.c.namespace == bindparam("sg_ns"),
    worker_leases.c.worker_id == bindparam("sg_worker"),
)
# last_ms = :seen in the WHERE: the taker's ids start after the value it read,
# and the row cannot have moved on (another holder came and went) since.
_CLAIM: Final = (
    update(worker_leases)
    .where(
        *_SAME_ROW,
        worker_leases.c.last_ms == bindparam("sg_seen_last"),
        (worker_leases.c.owner.is_(None)) | (worker_leases.c.lease_expires_ms < _NOW),
    )
    .values(
        last_ms=bindparam("sg_last"),
        owner=bindparam("sg_owner"),
        lease_expires_ms=_NOW + bindparam("sg_lease"),
    )
)
_RENEW: Final = (
    update(worker_leases)
    .where(*_SAME_ROW, worker_leases.c.owner == bindparam("sg_owner"))
    .values(lease_expires_ms=_NOW + bindparam("sg_lease"), last_ms=bindparam("sg_last"))
)
_RELEASE: Final = (
    update(worker_leases)
    .where(*_SAME_ROW, worker_leases.c.owner == bindparam("sg_owner"))
    .values(owner=None, lease_expires_ms=0, last_ms=bindparam("sg_last"))
)
_NEW_ROW_VALUES: Final = {
    "namespace": bindparam("sg_ns"),
    "worker_id": bindparam("sg_worker"),
    "owner": bindparam("sg_owner"),
    "lease_expires_ms": _NOW + bindparam("sg_lease"),
    "last_ms": bindparam("sg_last"),
}
_INSERT: Final = _kernel.InsertOnce(worker_leases, _NEW_ROW_VALUES, returning=[worker_leases.c.namespace])


class Snowflake:
    """A generator of unique, time-ordered 64-bit ids with a leased worker id.

    An id is ``milliseconds since epoch_ms`` (41 bits) ``| worker id`` (10
    bits) ``| sequence`` (12 bits): up to 4096 ids per millisecond per
    worker, 1024 workers per namespace, until 2093 with the default epoch::

        ids = Snowflake(engine, namespace="orders")
        order.id = ids.next_id()
        ...
        ids.close()        # or: with Snowflake(engine) as ids: ...

    The worker id is leased from ``stateguard_worker_leases`` (create it
    with :func:`stateguard.create_tables` or the alembic revisions): the
    constructor claims a free or expired row with a conditional UPDATE (or
    creates the next row), so two live generators never hold the same worker
    id.  The lease lasts ``lease`` and is renewed (conditionally on still
    owning it) by a daemon thread every third of it, and by
    :meth:`next_id` itself when a renewal is due, so an id is never issued
    under an expired lease: a generator that cannot renew raises
    :class:`WorkerLeaseLost` instead.  :meth:`close` releases the worker id.

    Ids never go backwards: with the lease the generator stores (``last_ms``)
    a millisecond its ids cannot pass before its next renewal (the exact last
    one used, on :meth:`close`), so the next holder of a worker id starts
    after it; when the clock steps back, or 4096 ids were issued in one
    millisecond, :meth:`next_id` waits (sleeps) until the clock passes the
    last millisecond used.  Leases are judged and stored on the database's
    clock, so a host whose clock runs ahead or behind never takes a live
    worker id; ids carry the host's clock.  One generator is thread-safe; use one per
    process, created after any fork: a forked child's copy shares the
    parent's worker id, so it refuses to issue ids (and its :meth:`close`
    leaves the parent's lease alone).

    :raises WorkerIdsExhausted: all 1024 worker ids of ``namespace`` are live.
    :raises InvalidArgument: bad ``namespace``, ``lease`` (1 s to 365 days) or
        ``epoch_ms`` (not in the future).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        namespace: str = "default",
        lease: timedelta = timedelta(seconds=60),
        epoch_ms: int = DEFAULT_EPOCH_MS,
        heartbeat: bool = True,
        _clock: Callable[[], int] | None = None,
        _sleep: Callable[[float], None] | None = None,
    ) -> None:
        if not isinstance(engine, Engine):
            raise InvalidArgument(f"Snowflake needs a SQLAlchemy Engine, got {type(engine).__name__}")
        # Non-blank, at most 100 characters, no NUL (PostgreSQL) or lone surrogate (no UTF-8).
        _kernel.check_text(namespace, "namespace", _MAX_NAMESPACE)
        if not isinstance(lease, timedelta) or not timedelta(seconds=1) <= lease <= _MAX_LEASE:
            raise InvalidArgument(
                f"lease must be a timedelta from 1 second to 365 days, got {lease!r}; a dead "
                "holder's worker id comes back only when its lease ends"
            )
        clock = _clock or _wall_ms
        if type(epoch_ms) is not int or not 0 <= epoch_ms <= clock():
            raise InvalidArgument(
                f"epoch_ms must be an int of epoch milliseconds in the past, got {epoch_ms!r}"
            )
        self.engine = engine
        self.namespace = namespace
        self.epoch_ms = epoch_ms
        self._clock = clock
        self._sleep = _sleep or time.sleep
        self._pid = os.getpid()
        self._lease_ms = lease // timedelta(milliseconds=1)
        self._owner = secrets.token_hex(16)
        self._lock = threading.Lock()  # the generator's state
        self._renew_lock = threading.Lock()  # one renewal round trip at a time
        self._closed = False
        self._lost: WorkerLeaseLost | None = None
        self.worker_id, self._last_ms = self._claim()
        # As if last_ms's sequence were used up: the first id comes from a later
        # millisecond, so it cannot repeat one the previous holder issued.
        self._sequence = _MAX_SEQUENCE
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if heartbeat:
            self._thread = threading.Thread(
                target=self._heartbeat, name=f"stateguard-snowflake-{namespace}", daemon=True
            )
            self._thread.start()

    # -- leasing -----------------------------------------------------------

    def _set_deadlines(self, started_ms: int, started_mono: float) -> None:
        # A renewal falls due by the wall clock (that is what other hosts judge
        # the lease by in the table) or by the monotonic clock, whichever comes
        # first, so a wall clock stepping back does not stretch this
        # generator's lease.
        self._renew_ms = started_ms + self._lease_ms // 3
        self._renew_mono = started_mono + self._lease_ms / 3000

    def _claim(self) -> tuple[int, int]:
        params: dict[str, Any] = {
            "sg_ns": self.namespace,
            "sg_owner": self._owner,
            "sg_lease": self._lease_ms,
        }
        for _ in range(4 * MAX_WORKERS):
            started_mono = time.monotonic()
            now = self._clock()
            with self.engine.connect() as conn:
                free = _kernel.execute(conn, _FREE_ROWS, params).all()
            for row in free:
                params["sg_worker"] = row.worker_id
                params["sg_seen_last"] = row.last_ms
                params["sg_last"] = max(row.last_ms, self._horizon(now))
                with self.engine.begin() as conn:
                    if _kernel.execute(conn, _CLAIM, params).rowcount == 1:
                        self._set_deadlines(now, started_mono)
                        return row.worker_id, int(row.last_ms)
            if len(free) == _FREE_BATCH:
                continue  # racers took all we read and more free rows may be left: reuse before creating
            unused = self._unused(params)
            if unused is None:
                if not free:
                    raise WorkerIdsExhausted(
                        f"all {MAX_WORKERS} worker ids of Snowflake namespace {self.namespace!r} are "
                        f"leased by live generators; close unused generators, wait for dead ones' "
                        f"leases to expire, or use another namespace",
                        namespace=self.namespace,
                    )
                continue  # every free row was taken by someone else meanwhile: look again
            params["sg_worker"] = unused
            params["sg_last"] = self._horizon(now)
            if self._insert(params):
                self._set_deadlines(now, started_mono)
                return unused, 0
        raise WorkerIdsExhausted(  # pragma: no cover - 4096 lost races in a row
            f"could not lease a worker id in Snowflake namespace {self.namespace!r}: every attempt "
            f"lost a race with another generator; retry",
            namespace=self.namespace,
        )

    def _unused(self, params: dict[str, Any]) -> int | None:
        """The lowest worker id the namespace has no row for (``None``: all 1,024 exist)."""
        with self.engine.connect() as conn:
            span: Any = _kernel.execute(conn, _ID_SPAN, params).one()
            count, top = int(span[0]), span[1]
            if top is None or top == count - 1:  # no rows, or 0 .. count-1 with no gap
                return count if count < MAX_WORKERS else None
            # A gap (rows deleted by hand): find it.
            taken = set(_kernel.execute(conn, _ALL_IDS, params).scalars())
        return next((w for w in range(MAX_WORKERS) if w not in taken), None)

    def _insert(self, params: dict[str, Any]) -> bool:
        """Create the worker row already leased to us; ``False`` if someone created it first."""
        with self.engine.begin() as conn:
            return _INSERT(conn, params) is not None

    def _horizon(self, now: int) -> int:
        """A millisecond (application clock) that no id issued before the next renewal can reach."""
        return now + self._lease_ms

    def _lease_params(self) -> dict[str, Any]:
        """The parameters naming our lease row, with the last millisecond used so far."""
        with self._lock:
            last = self._last_ms
        return {
            "sg_ns": self.namespace,
            "sg_worker": self.worker_id,
            "sg_owner": self._owner,
            "sg_last": last,
        }

    def _renew(self, *, due_only: bool) -> None:
        """Extend the lease (conditional on still owning it) or raise :class:`WorkerLeaseLost`."""
        with self._renew_lock:
            if self._lost is not None:
                raise self._lost
            if self._closed:
                return
            started_mono = time.monotonic()
            now = self._clock()
            if due_only and now < self._renew_ms and started_mono < self._renew_mono:
                return  # another thread renewed meanwhile
            params = self._lease_params()
            params["sg_lease"] = self._lease_ms
            params["sg_last"] = max(params["sg_last"], self._horizon(now))
            with self.engine.begin() as conn:
                renewed = _kernel.execute(conn, _RENEW, params).rowcount == 1
            if not renewed:
                self._lost = WorkerLeaseLost(
                    f"Snowflake lost its lease on worker id {self.worker_id} of namespace "
                    f"{self.namespace!r} (it expired and was taken over or released); it issues "
                    f"no more ids: create a new Snowflake",
                    namespace=self.namespace,
                    worker_id=self.worker_id,
                )
                raise self._lost
            self._set_deadlines(now, started_mono)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self._lease_ms / 3000):
            try:
                self._renew(due_only=False)
            except WorkerLeaseLost:
                return
            except Exception:
                # A database hiccup: next_id() renews synchronously when due.
                continue

    # -- ids ---------------------------------------------------------------

    def next_id(self) -> int:
        """The next id: larger than every id this worker id has issued before.

        Renews the lease first when it is due (one UPDATE); waits when the
        clock stepped back or the millisecond's 4096 ids are used up::

            payment.id = ids.next_id()

        :raises WorkerLeaseLost: the lease could not be renewed; no id was issued.
        :raises InvalidArgument: the generator was closed, or this is a forked
            copy of it (it would repeat the parent's ids).
        """
        if self._closed:
            raise InvalidArgument("this Snowflake is closed; create a new one")
        if os.getpid() != self._pid:
            raise InvalidArgument(
                f"this Snowflake was created in process {self._pid} and this is a forked copy "
                f"(process {os.getpid()}) sharing its worker id; create a Snowflake in each "
                f"process after forking"
            )
        if self._lost is not None:
            raise self._lost
        if _observe.hooked or log.isEnabledFor(logging.DEBUG):
            backend = _kernel.backend(self.engine.dialect).name
            with _observe.observed("next_id", log, scope=str(self.worker_id), backend=backend):
                return self._next_id()
        return self._next_id()

    def _next_id(self) -> int:
        while True:
            now = self._clock()
            if now >= self._renew_ms or time.monotonic() >= self._renew_mono:
                self._renew(due_only=True)
                now = self._clock()
            with self._lock:
                if self._closed:
                    # close() ran meanwhile and stored last_ms for the next holder of this worker id:
                    # an id issued now could be one that holder issues too.
                    raise InvalidArgument("this Snowflake was closed while next_id() ran; no id was issued")
                last = self._last_ms
                if now == last and self._sequence < _MAX_SEQUENCE:
                    self._sequence += 1
                    sequence = self._sequence
                elif now > last:
                    self._last_ms = now
                    self._sequence = sequence = 0
                else:
                    sequence = -1
            if sequence >= 0:
                break
            # The clock is behind the last millisecond used (it stepped back, or
            # this millisecond's sequence is used up): wait until it passes it, looking at
            # the clock again at least every _MAX_NAP seconds (a clock stepped back by hours
            # and corrected a moment later by NTP must not keep this asleep for hours).
            self._sleep(min(max(0.0005, (last - now) / 1000), _MAX_NAP))
        elapsed = now - self.epoch_ms
        if elapsed >= 1 << _TIME_BITS:  # pragma: no cover - the year 2093 with the default epoch
            raise InvalidArgument(f"epoch_ms {self.epoch_ms} is more than 2**41 ms in the past")
        return elapsed << (_WORKER_BITS + _SEQUENCE_BITS) | self.worker_id << _SEQUENCE_BITS | sequence

    def close(self) -> None:
        """Stop renewing and release the worker id, keeping its ``last_ms``.

        Idempotent; a ``with`` block calls it on exit::

            ids.close()
        """
        with self._lock:  # a next_id() in another thread issues no id after this
            if self._closed:
                return
            self._closed = True
        if os.getpid() != self._pid:
            return  # a forked copy: the lease is the parent's to release
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._renew_lock:
            if self._lost is not None:
                return
            with self.engine.begin() as conn:
                _kernel.execute(conn, _RELEASE, self._lease_params())

    def __enter__(self) -> Snowflake:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Snowflake namespace={self.namespace!r} worker_id={self.worker_id}>"

    @staticmethod
    def parse(snowflake_id: int, *, epoch_ms: int = DEFAULT_EPOCH_MS) -> tuple[int, int, int]:
        """Split an id into ``(epoch milliseconds, worker id, sequence)``.

        Pass the ``epoch_ms`` the generator used, if not the default::

            ms, worker, seq = Snowflake.parse(order.id)
        """
        return (
            (snowflake_id >> (_WORKER_BITS + _SEQUENCE_BITS)) + epoch_ms,
            (snowflake_id >> _SEQUENCE_BITS) & (MAX_WORKERS - 1),
            snowflake_id & _MAX_SEQUENCE,
        )
