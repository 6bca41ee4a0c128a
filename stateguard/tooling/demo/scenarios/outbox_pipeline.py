"""The outbox pipeline: exactly-once effects end to end, over an at-least-once broker.

Requests under ``idempotent()`` fire a transition and ``emit()`` its event in
the same transaction; two relays publish into a broker (in-process queues,
or a Redis stream with ``--redis``) that loses every fourth
acknowledgement; three consumers apply each event, the stateguard ones
through ``consume_once``.  The invariant: effects == APPLIED transitions,
none twice, every order paid before it is shipped.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from ....result import Outcome, Result
from ....retry import retry_on_conflict
from ....tables import create_tables, idempotency_keys
from ..models import DemoOrder, DemoSideEffect
from ..results import HAND_WRITTEN, STATEGUARD, Request, SchemeRow
from ..storm import DemoRun, Group, first_line, scenario

__all__ = ["PIPELINE_SCOPE", "PIPELINE_TOPICS", "outbox_pipeline"]

#: The demo's outbox topics: its relays publish only these, never an application's own events.
PIPELINE_TOPICS = ("sg_demo.order.paid", "sg_demo.order.shipped")
_PIPELINE_TOPIC = dict(zip(("pay", "ship"), PIPELINE_TOPICS, strict=True))
#: Scope prefix of the pipeline's idempotency keys and consumer names; a run deletes earlier runs' rows.
PIPELINE_SCOPE = "stateguard-demo-pipeline:"
#: Partitions of the in-process broker: one consumer each, a key always in the same one.
_PARTITIONS = 3
#: Every how many-th sink call loses its acknowledgement (the batch was delivered, the relay hears an error).
_LOST_ACK_EVERY = 4
#: How long the pipeline may take to drain after the last request.
_DRAIN_PATIENCE = 60.0


class _LostAck(Exception):
    """The broker took the batch but its acknowledgement never reached the relay."""


@scenario("outbox pipeline")
def outbox_pipeline(run: DemoRun) -> list[SchemeRow]:
    """Retried requests -> transition + ``emit()`` -> 2 relays -> broker -> 3 ``consume_once`` consumers.

    Each request carries an idempotency key (``idempotent()``; retries and
    double-clicks replay the stored answer); an APPLIED ``pay`` or ``ship``
    emits its event in the transition's transaction.  Two relay threads
    publish the events into an in-process broker (a :class:`CallableSink`
    feeding one queue per partition, a key always in the same partition)
    that loses every fourth acknowledgement, so relays publish some batches
    again: at least once.  Three consumers, one per partition, record each
    event id with ``consume_once`` in the transaction of their effect (the
    side-effect row).  The invariant: effects == APPLIED transitions, none
    twice, each order paid before shipped.
    """
    from ....tables import consumed_messages, outbox

    scheme = "outbox pipeline"
    create_tables(run.engine)
    with run.engine.begin() as conn:
        # Earlier runs' leftovers: unpublished demo events would be published (and counted) again.
        conn.execute(delete(outbox).where(outbox.c.topic.in_(PIPELINE_TOPICS)))
        conn.execute(delete(idempotency_keys).where(idempotency_keys.c.scope.startswith(PIPELINE_SCOPE)))
        conn.execute(delete(consumed_messages).where(consumed_messages.c.consumer.startswith(PIPELINE_SCOPE)))
    ids = run.create_orders(run.orders)
    # Everyone pays; most orders are shipped later (the relays publish meanwhile).
    waves = [
        [[Request(i, "pay")] for i in ids],
        [[Request(i, "ship")] for i in ids if run.rng.random() < 0.7],
    ]
    plan = run.plan(waves)
    naive_plan, _ = run.same_storm(plan, ids)
    rows = [_pipeline(run, HAND_WRITTEN, naive_plan), _pipeline(run, STATEGUARD, plan)]
    run.notes.append(
        f"{scheme}: published = events the broker got, redelivered = events it got more than once "
        f"(every {_LOST_ACK_EVERY}th acknowledgement lost),"
    )
    run.notes.append(
        f"{scheme}: deduplicated = deliveries consume_once answered REPEATED; "
        "side effects must equal APPLIED transitions; the hand-written consumer applies every delivery"
    )
    return rows


def _pipeline(run: DemoRun, code: str, plan: Sequence[Group]) -> SchemeRow:
    """One variant of the outbox pipeline; the hand-written consumer has no ``consume_once``."""
    from ....idempotency import idempotent
    from ....inserts import consume_once
    from ....outbox import CallableSink, OutboxEvent, Relay, emit
    from ....tables import outbox

    scheme = "outbox pipeline"
    effects_key = run.key(scheme, code)
    token = uuid.uuid4().hex[:8]
    key_scope = f"{PIPELINE_SCOPE}{token}"
    consumer = f"{PIPELINE_SCOPE}warehouse-{token}"

    lock = threading.Lock()
    deliveries: Counter[int] = Counter()  # event id -> times the broker got it
    sink_calls = 0
    partitions: list[queue.Queue[OutboxEvent | None]] = [queue.Queue() for _ in range(_PARTITIONS)]
    counts: Counter[str] = Counter()
    errors: list[str] = []

    def route(event: OutboxEvent) -> None:
        partitions[zlib.crc32((event.key or "").encode()) % _PARTITIONS].put(event)

    stream = f"{PIPELINE_SCOPE.rstrip(':')}-{token}"
    stream_sink = None
    if run.redis is not None:
        from ....redis import RedisStreamSink

        stream_sink = RedisStreamSink(run.redis, stream=stream)
        if code == STATEGUARD:
            run.notes.append(f"{scheme}: the broker is the Redis stream {stream!r} (deleted after the run)")
    elif code == STATEGUARD:
        run.notes.append(
            f"{scheme}: the broker is in-process queues (stateguard demo --redis URL: a Redis stream)"
        )

    def broker(events: Sequence[OutboxEvent]) -> None:
        nonlocal sink_calls
        if stream_sink is None:
            for event in events:
                route(event)
        else:
            stream_sink.publish(events)  # the stream reader routes them to the consumers
        with lock:
            deliveries.update(e.id for e in events)
            sink_calls += 1
            lost = sink_calls % _LOST_ACK_EVERY == 2
        if lost:
            raise _LostAck(f"the broker's acknowledgement of {len(events)} events was lost")

    stop = threading.Event()
    read_all = threading.Event()

    def stream_reader() -> None:
        """Read the Redis stream in order and hand each entry to its key's consumer."""
        last: Any = "0-0"
        read = 0
        try:
            while True:
                with lock:
                    written = sum(deliveries.values())
                if read_all.is_set() and read >= written:
                    return
                for _, entries in run.redis.xread({stream: last}, count=500, block=50) or []:
                    for entry_id, fields in entries:
                        last, read = entry_id, read + 1
                        key = fields[b"key"].decode()
                        event = OutboxEvent(
                            int(fields[b"id"]),
                            fields[b"topic"].decode(),
                            key or None,
                            json.loads(fields[b"payload"]),
                            0,
                        )
                        route(event)
        except Exception as error:  # reported under the table
            with lock:
                errors.append(f"stream reader: {type(error).__name__}: {first_line(error)}")

    def relay_loop(relay: Relay) -> None:
        while not stop.is_set():
            try:
                published = relay.run_once()
            except _LostAck:
                continue  # the claim was released: this or the other relay publishes the batch again
            except Exception as error:  # retryable conflicts included: reported, then the loop goes on
                if not getattr(error, "retryable", False):
                    with lock:
                        errors.append(f"relay: {type(error).__name__}: {first_line(error)}")
                    stop.wait(0.05)
                continue
            if published == 0:
                stop.wait(0.01)

    def consume(event: OutboxEvent) -> Outcome:
        def once() -> Result:
            with Session(run.engine) as session, session.begin():
                if code == HAND_WRITTEN:  # apply whatever arrives: a redelivery applies again
                    result = Result(Outcome.APPLIED, model=DemoOrder, key=event.id)
                else:
                    result = consume_once(session, consumer, str(event.id))
                if result.applied:
                    payload = event.payload
                    request = Request(int(payload["order"]), str(payload["trigger"]))
                    run.side_effect(session, effects_key, request, f"c{event.id % _PARTITIONS}")
                return result

        return retry_on_conflict(once, attempts=1000, backoff=0.005, max_backoff=0.2, max_time=60).outcome

    def consumer_loop(inbox: queue.Queue[OutboxEvent | None]) -> None:
        while True:
            event = inbox.get()
            try:
                if event is None:
                    return
                outcome = consume(event)
                with lock:
                    counts["deduplicated" if outcome is Outcome.REPEATED else "consumed"] += 1
            except Exception as error:  # reported under the table
                with lock:
                    errors.append(f"consumer: {type(error).__name__}: {first_line(error)}")
            finally:
                inbox.task_done()

    def request(session: Session, req: Request, worker: str) -> Result:
        with idempotent(session, scope=key_scope, key=req.request_id) as call:
            if call.replayed:
                return Result(Outcome.REPEATED, model=DemoOrder, key=req.order_id)
            result = DemoOrder.flow.fire(session, req.action, req.order_id)
            if result.applied:
                # The event commits with the transition, or neither does.  Its key (one per order,
                # unique to the run) keeps an order's events in order and clear of other keys.
                payload = {"order": req.order_id, "trigger": req.action}
                emit(session, _PIPELINE_TOPIC[req.action], payload, key=f"{key_scope}:{req.order_id}")
            call.complete({"order": req.order_id, "outcome": result.outcome.name})
            return result

    threads = [
        threading.Thread(target=consumer_loop, args=(q,), name=f"stateguard-demo-c{i}", daemon=True)
        for i, q in enumerate(partitions)
    ]
    sink = CallableSink(broker)
    threads += [
        threading.Thread(
            target=relay_loop,
            args=(Relay(run.engine, sink, topics=PIPELINE_TOPICS, batch=20),),
            name=f"stateguard-demo-r{i}",
            daemon=True,
        )
        for i in range(2)
    ]
    reader = threading.Thread(target=stream_reader, name="stateguard-demo-reader", daemon=True)
    if stream_sink is not None:
        reader.start()
    for t in threads:
        t.start()
    try:
        tally = run.fire(plan, request)
        deadline = time.monotonic() + _DRAIN_PATIENCE
        pending = -1
        while time.monotonic() < deadline:
            with run.engine.connect() as conn:
                pending = int(
                    conn.scalar(
                        select(func.count())
                        .select_from(outbox)
                        .where(outbox.c.topic.in_(PIPELINE_TOPICS), outbox.c.published_ms.is_(None))
                    )
                    or 0
                )
            if pending == 0:
                break
            time.sleep(0.02)
    finally:
        stop.set()
        for t in threads[_PARTITIONS:]:
            t.join()
        read_all.set()
        if stream_sink is not None:
            reader.join()
            run.redis.delete(stream)
        for q in partitions:
            q.join()  # every published event consumed
            q.put(None)
        for t in threads[:_PARTITIONS]:
            t.join()

    applied = tally.outcomes[Outcome.APPLIED]
    published = len(deliveries)
    redelivered = sum(1 for n in deliveries.values() if n > 1)
    extra = sum(deliveries.values()) - published
    problems: list[str] = (
        [f"{pending} events were still unpublished after {_DRAIN_PATIENCE:.0f}s"] if pending else []
    )
    if published != applied:
        problems.append(f"{published} events were published for {applied} APPLIED transitions")
    if code == STATEGUARD and counts["deduplicated"] != extra:
        problems.append(
            f"consume_once said REPEATED {counts['deduplicated']} times for {extra} extra deliveries"
        )
    with run.engine.connect() as conn:
        effects = conn.execute(
            select(DemoSideEffect.order_id, DemoSideEffect.action)
            .where(DemoSideEffect.scheme == effects_key)
            .order_by(DemoSideEffect.id)
        ).all()
    seen_paid: set[int] = set()
    out_of_order = 0
    for order_id, action in effects:
        if action == "pay":
            seen_paid.add(order_id)
        elif order_id not in seen_paid:
            out_of_order += 1
    if out_of_order:
        problems.append(f"{out_of_order} orders were shipped by a consumer before they were paid")
    problems.extend(errors[:5])
    tally.counts.update(published=published, redelivered=redelivered, deduplicated=counts["deduplicated"])
    damage = run.duplicates(scheme, code, {"pay": "double charges", "ship": "parcels sent twice"})
    if code == STATEGUARD and any(damage.values()):
        problems.append(f"damage {damage}")
    if code == STATEGUARD:
        how = "idempotent() -> transition + emit() -> 2 relays -> broker -> 3 consumers with consume_once"
    else:
        how = "the same pipeline, consumers apply every delivery (no consume_once)"
    return run.row(scheme, how, tally, problems=problems, code=code, damage=damage)
