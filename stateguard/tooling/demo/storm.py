"""The storm: plans of twin and redelivered requests, fired from many worker threads.

:class:`DemoRun` is what a scenario works with: it creates orders, turns
logical requests into deliveries (:meth:`DemoRun.plan`: 2-4 copies each,
twins released together by a barrier, redeliveries in later waves), fires
them (:meth:`DemoRun.fire`, one unit of work per delivery, or
:meth:`DemoRun.storm` for anything else), runs a hand-written and a
stateguard variant on the same storm (:meth:`DemoRun.side_by_side`) and
checks the side-effect invariant in the database (:meth:`DemoRun.row`).
Scenarios register with :func:`scenario` into :data:`SCENARIOS`.
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, Select, func, insert, select
from sqlalchemy.orm import Session

from ...result import Outcome, Result
from ...retry import retry_on_conflict
from ..terminal import Progress
from .models import DemoOrder, DemoSideEffect
from .results import HAND_WRITTEN, STATEGUARD, Delivery, Request, SchemeRow, Tally

__all__ = [
    "SCENARIOS",
    "Call",
    "Deliver",
    "DemoRun",
    "Group",
    "Scenario",
    "ScenarioFn",
    "Sender",
    "first_line",
    "now",
    "scenario",
]

Deliver = Callable[[Session, Request, str], Result]
Call = Callable[[Session, Request], Result]
Sender = Callable[[Delivery], Outcome]
Group = list[Request]

#: How long a worker waits for its twin at the barrier before going alone.
_BARRIER_TIMEOUT = 30.0


def now() -> datetime.datetime:
    """The time now, naive UTC: the demo's DateTime columns have no time zone on any backend."""
    return datetime.datetime.now(datetime.UTC).replace(tzinfo=None)


@dataclass
class DemoRun:
    """What a scenario works with: the engine, the sizes, a seeded RNG and helpers."""

    engine: Engine
    workers: int
    orders: int
    rng: random.Random
    progress: Progress = field(default_factory=Progress)
    #: A redis-py client: the outbox pipeline then publishes to a Redis stream (``stateguard demo --redis``).
    redis: Any = None
    #: Lines for the report, under the table (see :attr:`DemoReport.notes`).
    notes: list[str] = field(default_factory=list)
    #: The engine of the hand-written variants (``engine`` when ``None``): :func:`hand_written_engine`.
    naive_engine: Engine | None = None
    _next_id: int = 1

    def create_orders(self, n: int) -> list[int]:
        """Insert ``n`` pending orders with fresh ids (never shared between scenarios)."""
        ids = list(range(self._next_id, self._next_id + n))
        self._next_id += n
        with self.engine.begin() as conn:
            conn.execute(insert(DemoOrder), [{"id": i, "status": "pending"} for i in ids])
        return ids

    def plan(self, waves: Sequence[Sequence[Group]]) -> list[Group]:
        """Turn logical requests into deliveries, grouped by what fires at the same moment.

        ``waves`` is a list of waves; a wave is a list of groups of requests
        that race each other (``[pay]``, or ``[ship, cancel]``).  Each request
        is delivered 2-4 times: half the time its first delivery has a twin
        fired at the same instant (a retry racing the original, a
        double-click), and every other copy is a redelivery in a later wave.
        """
        rng = self.rng
        out: list[list[Group]] = [[] for _ in range(len(waves) + 1)]
        for w, groups in enumerate(waves):
            for group in groups:
                first: Group = []
                for request in group:
                    copies = rng.randint(2, 4)
                    together = 2 if rng.random() < 0.5 else 1
                    first.extend([request] * together)
                    for _ in range(copies - together):
                        out[rng.randint(w + 1, len(waves))].append([request])
                out[w].append(first)
        plan: list[Group] = []
        for wave in out:
            rng.shuffle(wave)
            for group in wave:
                # A barrier needs that many free workers at once.
                size = max(1, self.workers)
                plan.extend(group[i : i + size] for i in range(0, len(group), size))
        return plan

    def two_waves(
        self, ids: Sequence[int], requests: Callable[[int, float], tuple[Group, Group | None]]
    ) -> list[list[Group]]:
        """Two waves for :meth:`plan`, with one roll of the RNG per order.

        ``requests(order_id, roll)`` returns the group of requests the order
        sends first and the group it sends later (or ``None``); ``roll`` is
        uniform in [0, 1) and decides which kind of traffic the order gets.
        """
        first: list[Group] = []
        later: list[Group] = []
        for order_id in ids:
            now, then = requests(order_id, self.rng.random())
            first.append(now)
            if then is not None:
                later.append(then)
        return [first, later]

    @property
    def hand_engine(self) -> Engine:
        """The engine of the hand-written variants."""
        return self.naive_engine or self.engine

    def fire(self, plan: Sequence[Group], deliver: Deliver, *, engine: Engine | None = None) -> Tally:
        """Run every delivery of ``plan`` on ``workers`` threads and count the outcomes.

        Each delivery is one unit of work in its own session and transaction,
        re-run by :func:`retry_on_conflict` when the database reports a
        conflict (``retried`` counts those re-runs).  Members of a group wait
        for each other at a barrier and are released together.
        """

        def send(delivery: Delivery) -> Outcome:
            calls = 0

            def once() -> Result:
                nonlocal calls
                calls += 1
                if calls > 1:
                    delivery.retried += 1
                with Session(engine or self.engine) as session, session.begin():
                    return deliver(session, delivery.request, delivery.worker)

            # Bounded by time, not by a handful of attempts: on SQLite a unit that
            # reads before it writes (the optimistic scheme) begins DEFERRED and
            # loses its upgrade to every writer that committed since its read
            # (SQLITE_BUSY_SNAPSHOT), so under 8 workers on 2 cores it may need
            # many short re-runs; each one is counted in "retried".
            return retry_on_conflict(once, attempts=1000, backoff=0.005, max_backoff=0.2, max_time=60).outcome

        return self.storm(plan, send)

    def storm(self, plan: Sequence[Group], send: Sender, *, tally: Tally | None = None) -> Tally:
        """Run ``send`` for every delivery of ``plan`` on ``workers`` threads and count the outcomes.

        The machinery under :meth:`fire`, for deliveries that are not one
        database unit of work (an HTTP request, say): ``send`` does the whole
        delivery, its retries included, and returns the final outcome.  An
        exception is counted as an error and the storm goes on.  Pass
        ``tally`` to add to an earlier storm's counts.
        """
        work: queue.SimpleQueue[tuple[threading.Barrier | None, Request] | None] = queue.SimpleQueue()
        total = 0
        for group in plan:
            barrier = threading.Barrier(len(group)) if len(group) > 1 else None
            for request in group:
                work.put((barrier, request))
                total += 1
        workers = max(1, self.workers)
        for _ in range(workers):
            work.put(None)
        # Groups sit next to each other in one FIFO queue and are never larger
        # than the pool, so a worker waiting at a barrier always has its twins
        # picked up by the next free workers: no deadlock.
        self.progress.total(total)
        tally = Tally() if tally is None else tally
        lock = threading.Lock()

        def worker(name: str) -> None:
            while True:
                item = work.get()
                if item is None:
                    return
                barrier, request = item
                if barrier is not None:
                    # A timed-out barrier only costs the twin its simultaneity.
                    with contextlib.suppress(threading.BrokenBarrierError):
                        barrier.wait(_BARRIER_TIMEOUT)
                delivery = Delivery(request, name)
                outcome: Outcome | None = None
                error: str | None = None
                try:
                    outcome = send(delivery)
                except Exception as exc:  # counted and reported, the storm goes on
                    error = f"{request.request_id}: {type(exc).__name__}: {first_line(exc)}"
                with lock:
                    tally.attempts += 1
                    tally.retried += delivery.retried
                    tally.counts.update(delivery.counts)
                    if outcome is not None:
                        tally.outcomes[outcome] += 1
                    if error is not None:
                        tally.errors.append(error)
                self.progress.advance()

        threads = [
            threading.Thread(target=worker, args=(f"w{i}",), name=f"stateguard-demo-w{i}", daemon=True)
            for i in range(workers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return tally

    def side_effect(self, session: Session, scheme: str, request: Request, worker: str) -> None:
        """Record a side effect in ``session``'s transaction (call it only when APPLIED)."""
        session.add(
            DemoSideEffect(
                scheme=scheme,
                order_id=request.order_id,
                action=request.action,
                request_id=request.request_id,
                worker=worker,
            )
        )

    def with_side_effect(self, scheme: str, call: Call) -> Deliver:
        """A :data:`Deliver` that makes ``call`` and records the side effect only when it was APPLIED.

        The side effect joins the call's transaction: it commits, or rolls
        back, with the write that decided the outcome::

            def consume(session: Session, request: Request) -> Result:
                return insert_once(session, DemoInbox, {"message_id": request.request_id})

            tally = run.fire(plan, run.with_side_effect("insert-once", consume))
        """

        def deliver(session: Session, request: Request, worker: str) -> Result:
            result = call(session, request)
            if result.applied:
                self.side_effect(session, scheme, request, worker)
            return result

        return deliver

    @staticmethod
    def key(scheme: str, code: str = STATEGUARD) -> str:
        """The ``scheme`` value of a variant's side-effect rows (``"flash sale [hand-written]"``)."""
        return scheme if code == STATEGUARD else f"{scheme} [{code}]"

    def same_storm(self, plan: Sequence[Group], ids: Sequence[int]) -> tuple[list[Group], list[int]]:
        """``plan`` again, delivery for delivery, on fresh orders (for the other variant of a scheme).

        Returns the plan and the new order ids, in the order of ``ids``.
        """
        other = self.create_orders(len(ids))
        moved = dict(zip(ids, other, strict=True))
        return [
            [Request(moved.get(r.order_id, r.order_id), r.action) for r in group] for group in plan
        ], other

    def count(self, query: Select[Any]) -> int:
        """The number of rows ``query`` returns, counted in the database."""
        with self.engine.connect() as conn:
            return int(conn.scalar(select(func.count()).select_from(query.subquery())) or 0)

    def orders_with_all(self, scheme: str, code: str, actions: Sequence[str]) -> int:
        """Orders whose side effects include every one of ``actions`` (shipped and cancelled, ...)."""
        return self.count(
            select(DemoSideEffect.order_id)
            .where(DemoSideEffect.scheme == self.key(scheme, code), DemoSideEffect.action.in_(actions))
            .group_by(DemoSideEffect.order_id)
            .having(func.count(func.distinct(DemoSideEffect.action)) == len(actions))
        )

    def duplicates(self, scheme: str, code: str, labels: dict[str, str]) -> dict[str, int]:
        """Side effects beyond one per (order, action), counted in the database, by ``labels[action]``."""
        per = (
            select(DemoSideEffect.action, (func.count() - 1).label("extra"))
            .where(DemoSideEffect.scheme == self.key(scheme, code))
            .group_by(DemoSideEffect.order_id, DemoSideEffect.action)
            .subquery()
        )
        with self.engine.connect() as conn:
            found = dict(
                conn.execute(select(per.c.action, func.sum(per.c.extra)).group_by(per.c.action)).all()
            )
        return {label: int(found.get(action) or 0) for action, label in labels.items()}

    def side_by_side(
        self,
        scheme: str,
        variants: Sequence[tuple[str, Sequence[Group], Call]],
        damage: Callable[[str], dict[str, int]],
        how: dict[str, str],
    ) -> list[SchemeRow]:
        """Fire each ``(code, plan, call)`` variant of ``scheme`` with its side effect and make its row.

        ``damage(code)`` is counted in the database after that variant's storm;
        damage in the stateguard row is a problem (the demo then exits 1).
        """
        rows = []
        for code, deliveries, call in variants:
            engine = self.hand_engine if code == HAND_WRITTEN else self.engine
            tally = self.fire(deliveries, self.with_side_effect(self.key(scheme, code), call), engine=engine)
            row = self.row(scheme, how[code], tally, code=code, damage=damage(code))
            if code == STATEGUARD and row.damage_total:
                row.problems.append(f"{scheme}: damage {row.damage}")
            rows.append(row)
        return rows

    def row(
        self,
        scheme: str,
        how: str,
        tally: Tally,
        *,
        problems: Sequence[str] = (),
        code: str = STATEGUARD,
        damage: dict[str, int] | None = None,
    ) -> SchemeRow:
        """The table row for ``scheme``, with the side-effect invariant checked in the database."""
        applied = tally.outcomes[Outcome.APPLIED]
        key = self.key(scheme, code)
        with self.engine.connect() as conn:
            effects = conn.scalar(
                select(func.count()).select_from(DemoSideEffect).where(DemoSideEffect.scheme == key)
            )
            doubles = conn.execute(
                select(DemoSideEffect.order_id, DemoSideEffect.action, func.count())
                .where(DemoSideEffect.scheme == key)
                .group_by(DemoSideEffect.order_id, DemoSideEffect.action)
                .having(func.count() > 1)
                .order_by(DemoSideEffect.order_id, DemoSideEffect.action)
            ).all()
        side_effects = int(effects or 0)
        found: list[str] = []
        if side_effects != applied:
            found.append(f"{side_effects} side effects ran for {applied} APPLIED calls")
        found.extend(f"order {o}: {action!r} side effect ran {n} times" for o, action, n in doubles[:5])
        if len(doubles) > 5:
            found.append(f"... and {len(doubles) - 5} more (order, trigger) pairs ran more than once")
        found.extend(problems)
        found.extend(f"unexpected error: {e}" for e in tally.errors[:5])
        if len(tally.errors) > 5:
            found.append(f"... and {len(tally.errors) - 5} more errors")
        other = {
            o.name: n
            for o, n in tally.outcomes.items()
            if o not in (Outcome.APPLIED, Outcome.REPEATED, Outcome.REJECTED) and n
        }
        other.update((name, n) for name, n in tally.counts.items() if n)
        if tally.errors:
            other["errors"] = len(tally.errors)
        return SchemeRow(
            scheme=scheme,
            how=how,
            attempts=tally.attempts,
            applied=applied,
            repeated=tally.outcomes[Outcome.REPEATED],
            rejected=tally.outcomes[Outcome.REJECTED],
            retried=tally.retried,
            side_effects=side_effects,
            problems=[f"{key}: {p}" for p in found],
            other=other,
            code=code,
            damage=dict(damage or {}),
        )


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (each note under the table is one line)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


@dataclass(frozen=True)
class Scenario:
    """A registered scenario: a title (for progress) and the function."""

    title: str
    fn: Callable[[DemoRun], list[SchemeRow]]


#: The scenarios ``stateguard demo`` runs, in order.
SCENARIOS: list[Scenario] = []


ScenarioFn = Callable[[DemoRun], list[SchemeRow]]


def scenario(title: str) -> Callable[[ScenarioFn], ScenarioFn]:
    """Register a scenario function (appended to :data:`SCENARIOS`)::

    @scenario("insert-once")
    def consumer(run: DemoRun) -> list[SchemeRow]: ...
    """

    def register(fn: ScenarioFn) -> ScenarioFn:
        SCENARIOS.append(Scenario(title, fn))
        return fn

    return register
