"""The transactional outbox: events stored in the transaction that caused them, published by a relay.

An ``after_commit`` callback is lost when its process dies right after COMMIT.
:func:`emit` stores the event *in* the transaction instead, so it exists
exactly when the change that caused it does; a :class:`Relay` (or
:class:`AsyncRelay`) then claims committed events on a lease, hands them to a
:class:`Sink` outside any transaction, and marks them published with an
owner-checked UPDATE: at least once, one key's events in id order, relays
sharing the work.  A consumer that records each event id with
:func:`~stateguard.consume_once` applies each one once::

    with Session(engine) as session, session.begin():
        Order.flow.pay(session, 7)                                   # the change
        emit(session, "order.paid", {"order": 7}, key="order-7")    # its event, same transaction

    Relay(engine, RedisStreamSink(redis, stream="orders")).run(stop_event)

A relay claims a batch of committed events in one short transaction,
publishes it outside any transaction and marks what the sink took; events
of one key are published in id order.  An event the sink refuses holds back
only its key and is parked *dead* after ``max_attempts`` refusals (never
deleted; :func:`requeue_dead` gives it back); a sink that is down refuses
nothing, so an outage parks no event.  ``Relay.run()`` ends only when asked
to, waking on LISTEN/NOTIFY on PostgreSQL and polling adaptively elsewhere.
Using it: ``docs/how-to/outbox.md``; the design (claim, per-key order,
refusals, dead events, key-order modes, wake-ups): ``docs/explanation/relay.md``.

Not promised: any order across keys, a bound on publish latency, delivery
exactly once (a consumer deduplicates by the event id: :attr:`OutboxEvent.id`).

The package's modules: :mod:`.events` (events, sinks, emit),
:mod:`.statements` (the relay's statements), :mod:`.relay` (the cycle and
the loop), :mod:`.refusals` (a failed batch taken apart, refusal or
outage), :mod:`.wakeup` (LISTEN/NOTIFY, the adaptive poll), :mod:`.dead`
(requeue and purge); :mod:`.sinks` (brokers).
"""

from __future__ import annotations

from .dead import purge_published, requeue_dead
from .events import MAX_DEPTH as MAX_DEPTH
from .events import MAX_TOPIC as MAX_TOPIC
from .events import CallableSink, OutboxEvent, Sink, emit
from .events import payload_text as payload_text
from .relay import DEFAULT_MAX_ATTEMPTS as DEFAULT_MAX_ATTEMPTS
from .relay import MAX_BATCH as MAX_BATCH
from .relay import AsyncRelay, Relay
from .statements import KEY_ORDERS as KEY_ORDERS
from .statements import SKIP_DEAD as SKIP_DEAD
from .statements import STRICT as STRICT

__all__ = [
    "AsyncRelay",
    "CallableSink",
    "OutboxEvent",
    "Relay",
    "Sink",
    "emit",
    "purge_published",
    "requeue_dead",
]
