"""The transactional outbox: events stored in the transaction that caused them, published by a relay.

An ``after_commit`` callback is lost when its process dies right after COMMIT.
:func:`emit` stores the event *in* the transaction instead, so it exists
exactly when the change that caused it does; a :class:`Relay` (or
:class:`AsyncRelay`) claims committed events on a lease, hands them to a
:class:`Sink` outside any transaction and marks what the sink took: at least
once, one key's events in id order, relays sharing the work.  A consumer that
records each event id with :func:`~stateguard.consume_once` applies each once::

    with Session(engine) as session, session.begin():
        Order.flow.pay(session, 7)                                   # the change
        emit(session, "order.paid", {"order": 7}, key="order-7")    # its event, same transaction

    Relay(engine, RedisStreamSink(redis, stream="orders")).run(stop_event)

An event the sink refuses holds back only its key and is parked *dead* after
``max_attempts`` refusals (:func:`requeue_dead` gives it back); a sink that is
down refuses nothing, so an outage parks no event.  Not promised: order across
keys, a bound on latency, delivery exactly once.  Modules: :mod:`.events`,
:mod:`.statements`, :mod:`.relay`, :mod:`.refusals`, :mod:`.wakeup`
(LISTEN/NOTIFY, the adaptive poll), :mod:`.dead`, :mod:`.sinks`.  Using it:
``docs/how-to/outbox.md``; the design: ``docs/explanation/relay.md``.
"""

from __future__ import annotations

from .async_relay import AsyncRelay
from .dead import purge_published, requeue_dead
from .events import MAX_DEPTH as MAX_DEPTH
from .events import MAX_TOPIC as MAX_TOPIC
from .events import CallableSink, OutboxEvent, Sink, emit
from .events import payload_text as payload_text
from .relay import DEFAULT_MAX_ATTEMPTS as DEFAULT_MAX_ATTEMPTS
from .relay import MAX_BATCH as MAX_BATCH
from .relay import Relay
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
