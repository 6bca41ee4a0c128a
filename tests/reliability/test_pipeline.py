"""The exactly-once pipeline end to end, with SIGKILLs at its three dangerous points.

Requests with retries (each sent twice by each of 2 handlers, twins at the same instant) go through
``idempotent()`` to a transition on a model with ``events=True``; its event commits with it; 2 relays
(separate processes) publish the outbox into a Redis stream; 3 consumers (separate processes) read it
in a consumer group and apply each event's effect with ``consume_once`` and an effect row in the same
transaction.  A handler is SIGKILLed after its COMMIT (its retries are replayed), a relay after its
XADD and before marking (its batch is published again after the lease), a consumer before its COMMIT
(another consumer takes its pending entries over).  Afterwards: one event per applied transition, one
effect per event, none lost, and each key's events in the stream in id order.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue as queue_mod
import signal
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from stateguard import create_tables, drop_tables
from stateguard.tables import consumed_messages, outbox
from tests._support.processes import worker_context
from tests.conftest import REDIS_URL, Backend
from tests.reliability import _pipeline_workers as pw
from tests.reliability._storm import Sizes

#: Orders at CI sizes (times the soak factor); each gets "pay" then "ship": 2 transitions, 2 events.
ORDERS = 60
#: Seconds the whole pipeline may take at CI sizes before the test counts it as hung.
DEADLINE_S = 90.0


class _Proc:
    """A worker process with its own queues and events (never shared with another worker)."""

    def __init__(self, ctx: Any, target: Callable[..., None], spec: pw.Spec, *args: Any) -> None:
        self.spec = spec
        self.results, self.held, self.go, self.stop = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
        extra = (
            (self.results, self.held, self.go)
            if target is pw.handler
            else (self.stop, self.results, self.held, self.go)
        )
        self.process = ctx.Process(target=target, args=(spec, *args, *extra), name=spec.worker, daemon=True)
        self.process.start()
        self.killed = False

    def kill(self) -> None:
        assert self.process.pid is not None
        with contextlib.suppress(ProcessLookupError):  # it may have just exited on its own
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)
        self.killed = True

    def result(self, timeout: float) -> Any:
        try:
            error, value = self.results.get(timeout=max(timeout, 0.1))
        except queue_mod.Empty:
            raise AssertionError(f"{self.spec.worker} reported nothing in {timeout:.0f} s") from None
        assert error is None, f"{self.spec.worker} failed:\n{error}"
        return value


def _held(proc: _Proc, until: float) -> pw.Held:
    """What ``proc`` holds once it reached its hold point (fails at once if it reported an error instead)."""
    while time.monotonic() < until:
        try:
            held: pw.Held = proc.held.get(timeout=0.2)
            return held
        except queue_mod.Empty:
            pass
        if not proc.results.empty():
            proc.result(1)  # raises with the worker's traceback
            raise AssertionError(f"{proc.spec.worker} finished without reaching its hold point")
    raise AssertionError(f"{proc.spec.worker} never reached its hold point")


def _wait_for(what: str, done: Callable[[], bool], until: float) -> None:
    while not done():
        assert time.monotonic() < until, f"timed out waiting for {what}"
        time.sleep(0.1)


def _counts(backend: Backend) -> tuple[int, int, int]:
    """(events, unpublished events, effect rows)."""
    with Session(backend.engine) as s:
        events = s.execute(select(func.count()).select_from(outbox)).scalar_one()
        unpublished = s.execute(
            select(func.count()).select_from(outbox).where(outbox.c.published_ms.is_(None))
        ).scalar_one()
        effects = s.execute(select(func.count()).select_from(pw.PipeEffect)).scalar_one()
    return int(events), int(unpublished), int(effects)


def test_pipeline_applies_every_effect_exactly_once_through_sigkills(
    backend: Backend, redis_client: Any, sizes: Sizes
) -> None:
    """Handler killed after COMMIT, relay killed after XADD, consumer killed before COMMIT: every applied
    transition has one event, every event one effect, none lost, per-key order held in the stream."""
    engine = backend.create(pw.Base.metadata)
    drop_tables(engine)
    create_tables(engine)
    orders = list(range(1, ORDERS * sizes.factor + 1))
    with Session(engine) as s, s.begin():
        s.add_all([pw.PipeOrder(id=i, status="new") for i in orders])
    stream = f"sg-test-pipeline-{uuid.uuid4().hex}"
    redis_client.xgroup_create(stream, pw.GROUP, id="0", mkstream=True)
    ctx = worker_context()
    procs: list[_Proc] = []

    def spawn(target: Callable[..., None], worker: str, *args: Any, hold: bool = False) -> _Proc:
        spec = pw.Spec(backend.name, backend.url, REDIS_URL, stream, worker, hold)
        proc = _Proc(ctx, target, spec, *args)
        procs.append(proc)
        return proc

    until = time.monotonic() + DEADLINE_S * sizes.factor
    try:
        barrier = ctx.Barrier(3)  # h1, h2 and the test: h0 commits its held request before anyone starts
        h0 = spawn(pw.handler, "h0", orders, barrier, hold=True)
        handlers = [spawn(pw.handler, f"h{i}", orders, barrier) for i in (1, 2)]
        r0 = spawn(pw.relay, "r0", hold=True)
        c0 = spawn(pw.consumer, "c0", hold=True)
        relays = [spawn(pw.relay, "r1"), spawn(pw.relay, "r2")]  # each waits for its go
        consumers = [spawn(pw.consumer, name) for name in ("c0-restarted", "c1", "c2")]

        # 1. A handler dies after COMMIT, before answering: its client will retry.
        held_request = _held(h0, until)
        first = orders[0]
        assert held_request.items == (first, "pay")
        with Session(engine) as s:
            assert s.get(pw.PipeOrder, first).status == "paid"  # type: ignore[union-attr]
        h0.kill()
        barrier.wait(max(until - time.monotonic(), 1))

        # 2. The only relay dies after XADD, before marking; then two relays share the work.
        held_batch = _held(r0, until)
        in_stream = {int(f[b"id"]) for _, f in redis_client.xrange(stream)}
        assert len(held_batch.items) == pw.BATCH and set(held_batch.items) <= in_stream, held_batch
        with Session(engine) as s:
            unmarked = s.execute(
                select(func.count())
                .select_from(outbox)
                .where(outbox.c.id.in_(held_batch.items), outbox.c.published_ms.is_(None))
            ).scalar_one()
        assert unmarked == len(held_batch.items), held_batch
        r0.kill()
        for p in relays:
            p.go.set()

        # 3. The only consumer dies after its effect row, before COMMIT; then three consumers.
        held_message = _held(c0, until)
        c0.kill()
        with Session(engine) as s:  # its effect row and its consume_once record died with it
            assert not s.scalars(
                select(pw.PipeEffect).where(pw.PipeEffect.event_id == held_message.items[0])
            ).all()
            assert not s.scalars(
                select(consumed_messages.c.message_id).where(
                    consumed_messages.c.message_id == str(held_message.items[0])
                )
            ).all()
        for p in consumers:
            p.go.set()

        handled = [h.result(until - time.monotonic()) for h in handlers]
        expected = 2 * len(orders)

        def all_applied() -> bool:
            events, unpublished, effects = _counts(backend)
            assert events <= expected and effects <= expected, (events, effects)
            if not (events == expected and unpublished == 0 and effects == expected):
                return False
            # And the group has read and acknowledged every entry, the copies published again too (a
            # relay holding row locks publishes the killed relay's batch again at once, so they can
            # still be in the stream, or pending on the killed consumer, once every effect is applied).
            (group,) = [
                g for g in redis_client.xinfo_groups(stream) if g["name"] in (pw.GROUP, pw.GROUP.encode())
            ]
            # lag: entries not yet delivered to the group (Redis 7; None when it cannot tell).
            return bool(group["pending"] == 0 and group.get("lag", 0) in (0, None))

        _wait_for("every event published and applied", all_applied, until)
        for p in relays + consumers:
            p.stop.set()
        published = [p.result(until - time.monotonic()) for p in relays]
        consumed = [p.result(until - time.monotonic()) for p in consumers]
        for p in procs:
            p.process.join(max(until - time.monotonic(), 1))
        entries = redis_client.xrange(stream)
        pending = redis_client.xpending(stream, pw.GROUP)["pending"]
        with Session(engine) as s:
            final = {o.id: (o.status, o.version) for o in s.scalars(select(pw.PipeOrder))}
            events = s.execute(select(outbox.c.id, outbox.c.key, outbox.c.payload)).all()
            effects = s.execute(select(pw.PipeEffect.event_id, pw.PipeEffect.consumer)).all()
            consumed_ids = (
                s.execute(
                    select(consumed_messages.c.message_id).where(consumed_messages.c.consumer == pw.GROUP)
                )
                .scalars()
                .all()
            )
    finally:
        for p in procs:
            if p.process.is_alive():
                p.kill()
        redis_client.delete(stream)
        drop_tables(engine)

    # Every request's transition applied once (the killed handler's included), its retries replayed.
    assert final == {i: ("shipped", 3) for i in orders}
    executed = Counter((o, t) for h in handled for o, t, replayed, _ in h if not replayed)
    executed[(first, "pay")] += 1  # by h0, whose answer died with it
    assert executed == Counter({(o, t): 1 for o in orders for t in pw.TRIGGERS}), executed
    assert all(r == {"outcome": "APPLIED"} for h in handled for _, _, _, r in h)
    retried = [replayed for h in handled for o, t, replayed, _ in h if (o, t) == (first, "pay")]
    assert retried == [True] * 4  # 2 handlers x 2 sends of the request whose handler was killed

    # One event per applied transition.
    payloads = {i: json.loads(p) for i, _, p in events}
    keys = {i: k for i, k, _ in events}
    per_transition = Counter((p["key"], p["trigger"]) for p in payloads.values())
    assert per_transition == Counter({(o, t): 1 for o in orders for t in pw.TRIGGERS}), per_transition

    # Every event's effect applied once, none lost; consume_once recorded each once.
    applied = Counter(e for e, _ in effects)
    assert sorted(applied) == sorted(payloads) and set(applied.values()) == {1}, applied
    assert sorted(int(m) for m in consumed_ids) == sorted(payloads)
    assert sum(a for a, _ in consumed) == expected  # every effect by a surviving consumer
    # The killed relay's batch came twice: consume_once turned each second copy away.
    assert sum(r for _, r in consumed) >= len(held_batch.items), (consumed, held_batch)
    assert pending == 0

    # The stream: every event at least once, the killed relay's batch again, each key's events in id order.
    ids = [int(f[b"id"]) for _, f in entries]
    seen = Counter(ids)
    assert set(seen) == set(payloads)
    assert all(seen[i] >= 2 for i in held_batch.items), (held_batch, seen)
    order_of: dict[str, list[int]] = defaultdict(list)
    for i in dict.fromkeys(ids):  # first appearances, in stream order
        order_of[keys[i]].append(i)
    for key, key_ids in order_of.items():
        assert key_ids == sorted(key_ids), (key, key_ids)
    assert sum(published) >= expected - len(held_batch.items)

    # The killed consumer's message: applied by someone else, once.
    [dead_event] = held_message.items
    assert [c for e, c in effects if e == dead_event] != ["c0"]
    assert "c0" not in {c for _, c in effects}
