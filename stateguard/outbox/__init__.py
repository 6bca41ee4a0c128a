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
   its events unpublished (see below for a refused event); a relay that dies
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

An event the sink refuses holds back only its key.  When the sink raises,
the relay takes the batch apart (halves, depth first, a key's earlier events
first) and publishes the rest in the same cycle; a sink error that names its
events (``event_ids``, as :class:`~stateguard.PublishFailed` does) refuses
just those.  A refused event is counted (``refusals``), kept leased for
``retry_delay`` (1 s, doubling, at most a minute) so its key's later events
wait behind it, and after ``max_attempts`` (10) refusals parked *dead*
(``dead_ms``): never deleted, never claimed, listed as stuck by ``stateguard
inspect``, given back by :func:`requeue_dead` (``stateguard outbox
requeue``).  A refusal counts when the sink took other events of the same
round; in a round where it took nothing (it is down) only the oldest
refused event's does.  Key order, ``Relay(key_order=...)``:

* ``"skip_dead"`` (default): once an event is dead its key's later events
  are published; the dead one comes after them if it is requeued.
* ``"strict"``: a dead event holds back every later event of its key until
  it is requeued and published.

``Relay.run()`` ends only when its stop event is set: any error of the sink
or the database is logged and retried after a bounded, jittered pause; only
the relay's own setup (the outbox table or its columns missing) ends it,
with a :class:`~stateguard.ConfigurationError` saying what to run.

Not promised: any order across keys, a bound on publish latency, delivery
exactly once (a consumer deduplicates by the event id: :attr:`OutboxEvent.id`).

The package's modules: :mod:`.events` (events, sinks, emit),
:mod:`.statements` (the relay's statements), :mod:`.relay` (the cycle and
the loop), :mod:`.dead` (requeue and purge); :mod:`.sinks` (brokers).
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
