"""Workers of the exactly-once pipeline test (importable by spawned processes).

Three kinds of process, each with its own engine and its own queues and events
(see :class:`tests.reliability._storm.Channels` for why nothing is shared: a
process SIGKILLed while writing to a shared queue hangs every later writer):

* a **handler** sends every request (an order's ``pay``, then its ``ship``)
  twice, through :func:`stateguard.idempotent`; it fires the transition of a
  model with ``events=True``, so the event commits with it;
* a **relay** runs a :class:`stateguard.Relay` into a Redis stream
  (:class:`stateguard.RedisStreamSink`); the held one first waits for a full
  batch of committed events, so its death leaves a whole batch to redeliver;
* a **consumer** reads the stream in a consumer group (``XREADGROUP``, and
  ``XAUTOCLAIM`` for entries a dead consumer left pending) and applies each
  event's effect with :func:`stateguard.consume_once` and an effect row in
  the same transaction.

Relays and consumers without a hold wait until the test sets their ``go``
event.  A worker given a hold stops at its hold point (a handler after the
COMMIT of its first request, a relay after its first XADD and before
marking, a consumer after its first effect row and before COMMIT), puts a
:class:`Held` on its own queue and waits on its own event until the test
SIGKILLs it.
"""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import redis
from sqlalchemy import Engine, Integer, String, create_engine, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import (
    RedisStreamSink,
    Relay,
    RequestInProgress,
    StateMachine,
    consume_once,
    idempotent,
    retry_on_conflict,
    version_column,
)
from stateguard.tables import outbox

#: The consumer group, in Redis and in consume_once.
GROUP = "pipeline-effects"
#: The idempotency scope of the requests.
SCOPE = "pipeline"
#: Seconds a relay's claim lasts (a killed relay's batch is published again after it).
LEASE_S = 3.0
#: Milliseconds an entry stays pending with a dead consumer before another one takes it over.
RECLAIM_IDLE_MS = 1500
#: Seconds any worker may run before it gives up (the test's own deadline is shorter).
WORKER_FOR = 150.0
#: Seconds a held worker waits to be killed.
HOLD_FOR = 60.0
#: Events per relay batch; the held relay waits for this many before its first (held) claim.
BATCH = 7


class Base(DeclarativeBase):
    pass


class PipeOrder(Base):
    """An order whose transitions write their own outbox events."""

    __tablename__ = "pl_orders"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    status: Mapped[str] = mapped_column(String(20), default="new")
    version: Mapped[int] = version_column()

    flow = StateMachine(
        "status",
        states=["new", "paid", "shipped"],
        transitions=[["pay", "new", "paid"], ["ship", "paid", "shipped"]],
        events=True,
    )


class PipeEffect(Base):
    """One row per applied effect (no unique key: a double application leaves two rows)."""

    __tablename__ = "pl_effects"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    event_id: Mapped[int] = mapped_column(Integer)
    event_key: Mapped[str] = mapped_column(String(200))
    trigger: Mapped[str] = mapped_column(String(20))
    consumer: Mapped[str] = mapped_column(String(40))


TRIGGERS = ("pay", "ship")


def request_key(order: int, trigger: str) -> str:
    """The idempotency key a client sends (and re-sends) for ``trigger`` on ``order``."""
    return f"order-{order}-{trigger}"


class Held(NamedTuple):
    """What a held worker tells the test: who it is and what it holds."""

    worker: str
    what: str  # "request" (key), "batch" (event ids), "message" (event id)
    items: tuple[Any, ...]


@dataclass(frozen=True)
class Spec:
    """Everything a worker process needs (picklable)."""

    backend: str
    url: str
    redis_url: str
    stream: str
    worker: str
    hold: bool = False


def make_engine(spec: Spec) -> Engine:
    kw: dict[str, Any] = {"pool_size": 2, "max_overflow": 2}
    if spec.backend == "sqlite":
        kw["connect_args"] = {"timeout": 60}
    return create_engine(spec.url, **kw)


def _gate(spec: Spec, go: Any) -> None:
    """A worker without a hold starts when the test sets ``go`` (relays, consumers: all at once)."""
    if not spec.hold and not go.wait(HOLD_FOR):
        raise TimeoutError(f"{spec.worker}: never told to start")


def _hold(held_q: Any, go: Any, held: Held) -> None:
    held_q.put(held)
    go.wait(HOLD_FOR)
    raise TimeoutError(f"{held.worker}: held for {HOLD_FOR} s and never killed")


# --------------------------------------------------------------------------
# Request handlers
# --------------------------------------------------------------------------


def _request(engine: Engine, order: int, trigger: str) -> tuple[bool, dict[str, Any]]:
    """One HTTP request: (replayed, response).  A 409 (RequestInProgress) is retried, as a client would."""

    def unit() -> tuple[bool, dict[str, Any]]:
        key = request_key(order, trigger)
        with Session(engine) as session, session.begin():
            with idempotent(session, scope=SCOPE, key=key, fingerprint={"t": trigger, "o": order}) as call:
                if call.replayed:
                    return True, dict(call.response)
                result = getattr(PipeOrder.flow, trigger)(session, order)
                return False, dict(call.complete({"outcome": result.outcome.name}))

    deadline = time.monotonic() + WORKER_FOR
    while True:
        try:
            return retry_on_conflict(unit, attempts=30)
        except RequestInProgress:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def handler(spec: Spec, orders: list[int], barrier: Any, results: Any, held_q: Any, go: Any) -> None:
    """Send every request twice (the client's retry); with a hold, first send one request and hold after it.

    Puts ``(traceback or None, [(order, trigger, replayed, response), ...])`` on ``results``.
    """
    engine = make_engine(spec)
    out: list[tuple[int, str, bool, dict[str, Any]]] = []
    try:
        if spec.hold:
            order = orders[0]
            out.append((order, "pay", *_request(engine, order, "pay")))  # committed
            _hold(held_q, go, Held(spec.worker, "request", (order, "pay")))
        barrier.wait(WORKER_FOR)
        for order in orders:
            for trigger in TRIGGERS:
                for _ in range(2):
                    out.append((order, trigger, *_request(engine, order, trigger)))
        results.put((None, out))
    except BaseException:
        results.put((traceback.format_exc(), out))
    finally:
        engine.dispose()


# --------------------------------------------------------------------------
# Relays
# --------------------------------------------------------------------------


class _HoldingSink(RedisStreamSink):
    """XADD a batch, then (once) tell the test and wait to be killed before the relay marks it."""

    def __init__(self, client: Any, stream: str, held_q: Any, go: Any, worker: str) -> None:
        super().__init__(client, stream=stream)
        self._held_q, self._go, self._worker = held_q, go, worker

    def publish(self, events: Any) -> Any:
        reply = super().publish(events)
        _hold(self._held_q, self._go, Held(self._worker, "batch", tuple(e.id for e in events)))
        return reply


def _unpublished(engine: Engine) -> int:
    with engine.connect() as conn:
        query = select(func.count()).select_from(outbox).where(outbox.c.published_ms.is_(None))
        return int(conn.execute(query).scalar_one())


def relay(spec: Spec, stop: Any, results: Any, held_q: Any, go: Any) -> None:
    """Run a relay into the stream until ``stop`` is set; puts ``(traceback or None, published)``."""
    engine = make_engine(spec)
    client = redis.Redis.from_url(spec.redis_url)
    published = 0
    try:
        sink = (
            _HoldingSink(client, spec.stream, held_q, go, spec.worker)
            if spec.hold
            else RedisStreamSink(client, stream=spec.stream)
        )
        r = Relay(engine, sink, batch=BATCH, lease=timedelta(seconds=LEASE_S))
        _gate(spec, go)
        deadline = time.monotonic() + WORKER_FOR
        while spec.hold and _unpublished(engine) < BATCH:  # a full batch to kill it with
            if time.monotonic() > deadline:
                raise TimeoutError(f"{spec.worker}: fewer than {BATCH} events after {WORKER_FOR} s")
            time.sleep(0.01)
        while not stop.is_set() and time.monotonic() < deadline:
            n = r.run_once()
            published += n
            if n == 0:
                stop.wait(0.02)
        results.put((None, published))
    except BaseException:
        results.put((traceback.format_exc(), published))
    finally:
        client.close()
        engine.dispose()


# --------------------------------------------------------------------------
# Consumers
# --------------------------------------------------------------------------


def _apply(engine: Engine, spec: Spec, fields: dict[bytes, bytes], hold: tuple[Any, Any] | None) -> bool:
    """Apply one entry's effect once; True if this call applied it.  ``hold``: (held_q, go) or None."""
    event_id = fields[b"id"].decode()
    payload = json.loads(fields[b"payload"])

    def unit() -> bool:
        with Session(engine) as session, session.begin():
            if not consume_once(session, GROUP, event_id).applied:
                return False
            session.add(
                PipeEffect(
                    event_id=int(event_id),
                    event_key=fields[b"key"].decode(),
                    trigger=payload["trigger"],
                    consumer=spec.worker,
                )
            )
            session.flush()
            if hold is not None:
                _hold(hold[0], hold[1], Held(spec.worker, "message", (int(event_id),)))
            return True

    return retry_on_conflict(unit, attempts=30)


def consumer(spec: Spec, stop: Any, results: Any, held_q: Any, go: Any) -> None:
    """Read the stream in the group until ``stop`` is set.

    Puts ``(traceback or None, (applied, repeated))`` on ``results``.
    """
    engine = make_engine(spec)
    client = redis.Redis.from_url(spec.redis_url)
    applied = repeated = 0
    hold = (held_q, go) if spec.hold else None
    try:
        client.ping()
        with engine.connect():
            pass
        _gate(spec, go)
        deadline = time.monotonic() + WORKER_FOR
        while not stop.is_set() and time.monotonic() < deadline:
            # Entries a dead consumer left pending first, then new ones.
            _, entries, *_ = client.xautoclaim(
                spec.stream, GROUP, spec.worker, min_idle_time=RECLAIM_IDLE_MS, start_id="0-0", count=10
            )
            if not entries:
                got: Any = client.xreadgroup(GROUP, spec.worker, {spec.stream: ">"}, count=10, block=100)
                entries = got[0][1] if got else []
            for entry_id, fields in entries:
                if fields is None:  # trimmed: cannot happen without maxlen
                    raise AssertionError(f"entry {entry_id!r} has no fields")
                if _apply(engine, spec, fields, hold):
                    applied += 1
                else:
                    repeated += 1
                client.xack(spec.stream, GROUP, entry_id)
        results.put((None, (applied, repeated)))
    except BaseException:
        results.put((traceback.format_exc(), (applied, repeated)))
    finally:
        client.close()
        engine.dispose()
