"""``stateguard demo``: a storm of retried, redelivered and double-clicked requests.

The demo works in its own namespace (:func:`open_namespace`: a PostgreSQL
schema, a MariaDB/MySQL database or a SQLite file, ``--schema``, dropped after
the run unless ``--keep``), creates its tables there (``sg_demo_*`` and
stateguard's own), then fires each logical request 2-4 times from many worker
threads, the way production traffic does: a client retries after a timeout
while the first call is still running (two workers released together by a
barrier), a queue redelivers a message later, a user double-clicks.  Every
scheme records a side-effect row only when its call was APPLIED, in the same
transaction, and the demo then counts them: the invariant is *side effects ==
APPLIED, and at most one side effect per (order, trigger)*.

Every scheme runs the same storm twice (:meth:`DemoRun.same_storm`, on fresh
orders): first through the code people usually write (:data:`HAND_WRITTEN`:
load, check in Python, save; ``SELECT`` then ``INSERT``; read-modify-write
stock; an endpoint without the idempotency middleware; a consumer without
``consume_once``), then through stateguard (:data:`STATEGUARD`).  Nothing
slows the hand-written code down to widen its race windows.  The damage of
both variants (double charges, oversold units, lost updates, duplicate rows)
is counted with SQL in the tables afterwards (:attr:`SchemeRow.damage`); only
a stateguard row that breaks its invariant makes the run fail.

The HTTP scenario ("http retry storm") sends ``POST /payments`` with an
``Idempotency-Key`` through :class:`stateguard.asgi.IdempotencyMiddleware` on
a Starlette app, in-process (:func:`asgi_request`); there the handler is
naive and charges on every call, and APPLIED means "the handler ran".  It
needs starlette (``pip install 'stateguard[demo]'``) and is skipped, with a
note under the table, without it.

Scenarios that are not one database unit of work per delivery use
:meth:`DemoRun.storm` instead of :meth:`DemoRun.fire`.

Each scheme is one scenario function registered with :func:`scenario`; it
returns rows of the result table.  Adding a scheme to the demo is appending
one function::

    @scenario("flash sale")
    def flash_sale(run: DemoRun) -> list[SchemeRow]:
        ids = run.create_orders(run.orders)

        def buy(session: Session, request: Request) -> Result:
            return reserve(session, request.order_id)        # one guarded statement

        # The side effect is recorded only when the call was APPLIED.
        deliver = run.with_side_effect("flash sale", buy)
        tally = run.fire(run.plan([[[Request(i, "reserve")] for i in ids]]), deliver)
        return [run.row("flash sale", "guarded counter", tally)]
"""

from __future__ import annotations

import contextlib
import datetime
import json
import queue
import random
import re
import textwrap
import threading
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    Column,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    delete,
    event,
    func,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.engine import URL
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from ..counters import decrement
from ..exceptions import InvalidArgument
from ..inserts import insert_once
from ..machine import StateMachine
from ..result import Outcome, Result
from ..retry import retry_on_conflict
from ..tables import create_tables, idempotency_keys
from ..versioning import guarded_update, version_column
from .terminal import Progress

if TYPE_CHECKING:
    from ..asgi import ASGIApp, Message

__all__ = [
    "PIPELINE_SCOPE",
    "PIPELINE_TOPICS",
    "SCENARIOS",
    "Delivery",
    "DemoBase",
    "DemoInbox",
    "DemoOrder",
    "DemoReport",
    "DemoRun",
    "DemoSideEffect",
    "DemoStock",
    "HttpAnswer",
    "Progress",
    "Request",
    "Scenario",
    "SchemeRow",
    "Tally",
    "asgi_request",
    "render",
    "run_demo",
    "scenario",
]


# --------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------


class DemoBase(DeclarativeBase):
    """The demo's own metadata, so it drops and creates only its ``sg_demo_*`` tables."""


class DemoOrder(DemoBase):
    """An order driven by a state machine (and, in the optimistic scheme, by timestamps)."""

    __tablename__ = "sg_demo_orders"
    #: Dead ends by design (``stateguard check`` reports undeclared dead ends).
    __stateguard_final__ = ("shipped", "cancelled")
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    version: Mapped[int] = version_column()
    paid_at: Mapped[datetime.datetime | None]
    cancelled_at: Mapped[datetime.datetime | None]

    flow = StateMachine(
        "status",
        states=["pending", "paid", "shipped", "cancelled"],
        transitions=[
            {"trigger": "pay", "source": "pending", "dest": "paid"},
            {"trigger": "ship", "source": "paid", "dest": "shipped"},
            {"trigger": "cancel", "source": ["pending", "paid"], "dest": "cancelled"},
        ],
    )


class DemoSideEffect(DemoBase):
    """One row per side effect that ran (charge the card, send the parcel, ...).

    Deliberately no unique constraint: a double side effect must be counted,
    not turned into an error that hides it.
    """

    __tablename__ = "sg_demo_side_effects"
    id: Mapped[int] = mapped_column(primary_key=True)
    scheme: Mapped[str] = mapped_column(String(40), index=True)
    order_id: Mapped[int]
    action: Mapped[str] = mapped_column(String(20))
    request_id: Mapped[str] = mapped_column(String(60))
    worker: Mapped[str] = mapped_column(String(20))


class DemoStock(DemoBase):
    """One hot stock row for the flash sale (no CHECK: only the guard keeps it >= 0)."""

    __tablename__ = "sg_demo_stock"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    amount: Mapped[int]


class DemoInbox(DemoBase):
    """Processed message ids of a message consumer (the insert-once scheme)."""

    __tablename__ = "sg_demo_inbox"
    id: Mapped[int] = mapped_column(primary_key=True)
    message_id: Mapped[str] = mapped_column(String(60), unique=True)


class DemoPlainInbox(DemoBase):
    """The hand-written consumer's inbox: no unique constraint, only a ``SELECT`` before each ``INSERT``."""

    __tablename__ = "sg_demo_inbox_plain"
    id: Mapped[int] = mapped_column(primary_key=True)
    message_id: Mapped[str] = mapped_column(String(60), index=True)


# --------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------


#: The ``code`` of a row run by stateguard.
STATEGUARD = "stateguard"
#: The ``code`` of a row run by the usual hand-written code (load, check in Python, save).
HAND_WRITTEN = "hand-written"


@dataclass(frozen=True, slots=True)
class Request:
    """One logical request; the demo delivers each of them several times."""

    order_id: int
    action: str

    @property
    def request_id(self) -> str:
        return f"{self.order_id}:{self.action}"


@dataclass
class Tally:
    """What the deliveries of one scheme returned.

    ``counts`` holds named extras a scenario reports next to the table
    (``{"409 in progress": 12}``).
    """

    attempts: int = 0
    retried: int = 0
    outcomes: Counter[Outcome] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)


@dataclass
class Delivery:
    """One delivery of a request, as a :meth:`DemoRun.storm` sender sees it.

    The sender counts its own re-sends in ``retried`` and anything worth
    reporting in ``counts``; they are added to the tally even when it raises.
    """

    request: Request
    worker: str
    retried: int = 0
    counts: Counter[str] = field(default_factory=Counter)


@dataclass
class SchemeRow:
    """One row of the result table."""

    scheme: str
    how: str
    attempts: int
    applied: int
    repeated: int
    rejected: int
    retried: int
    side_effects: int
    problems: list[str] = field(default_factory=list)
    other: dict[str, int] = field(default_factory=dict)
    #: :data:`STATEGUARD` or :data:`HAND_WRITTEN` (the usual code, run on the same storm).
    code: str = "stateguard"
    #: The damage measured in the database afterwards, by kind (``{"double charges": 12}``).
    damage: dict[str, int] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``"scheme (how)"``, e.g. ``"state machine (pay/ship/cancel)"``."""
        return f"{self.scheme} ({self.how})"

    @property
    def naive(self) -> bool:
        """``True`` for the hand-written variant (its damage is the point, not a failure of the demo)."""
        return self.code == HAND_WRITTEN

    @property
    def held(self) -> bool:
        """``True`` when the invariant held and nothing unexpected happened."""
        return not self.problems

    @property
    def ok(self) -> bool:
        """Whether the row is as it should be.

        A stateguard row holds the invariant; a hand-written row raised nothing (its damage is expected).
        """
        return not self.other.get("errors") if self.naive else self.held

    @property
    def damage_total(self) -> int:
        return sum(self.damage.values())


@dataclass
class DemoReport:
    """All rows of a demo run."""

    rows: list[SchemeRow]
    seed: int
    workers: int
    orders: int
    url: str
    elapsed: float
    #: Lines the scenarios want printed under the table (what a row means, skipped scenarios).
    notes: list[str] = field(default_factory=list)
    #: Where the demo wrote (``'PostgreSQL schema "sg_demo"'``), when known.
    namespace: str = ""
    #: What happened to the namespace after the run (dropped, or kept and how to drop it).
    afterwards: str = ""
    #: The database's name for the notes (``"postgresql"``, ``"mariadb"``, ``"sqlite"``).
    dialect: str = ""

    @property
    def ok(self) -> bool:
        """Every stateguard row held its invariant and no hand-written row raised."""
        return all(row.ok for row in self.rows)


# --------------------------------------------------------------------------
# The run: plans, workers, checks
# --------------------------------------------------------------------------

Deliver = Callable[[Session, Request, str], Result]
Call = Callable[[Session, Request], Result]
Sender = Callable[[Delivery], Outcome]
Group = list[Request]

#: How long a worker waits for its twin at the barrier before going alone.
_BARRIER_TIMEOUT = 30.0


def _now() -> datetime.datetime:
    # Naive UTC: DateTime columns without a time zone on every backend.
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
                    error = f"{request.request_id}: {type(exc).__name__}: {_first_line(exc)}"
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


# --------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------


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


#: Where each of DemoOrder.flow's triggers leaves from and goes (for the hand-written variant).
_SOURCES = {"pay": ("pending",), "ship": ("paid",), "cancel": ("pending", "paid")}
_DESTS = {"pay": "paid", "ship": "shipped", "cancel": "cancelled"}
_TWICE = {"pay": "double charges", "ship": "parcels sent twice", "cancel": "double refunds"}


def _count(run: DemoRun, query: Any) -> int:
    with run.engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(query.subquery())) or 0)


def _both(run: DemoRun, scheme: str, code: str, actions: Sequence[str]) -> int:
    """Orders whose side effects include every one of ``actions`` (shipped and cancelled, ...)."""
    return _count(
        run,
        select(DemoSideEffect.order_id)
        .where(DemoSideEffect.scheme == run.key(scheme, code), DemoSideEffect.action.in_(actions))
        .group_by(DemoSideEffect.order_id)
        .having(func.count(func.distinct(DemoSideEffect.action)) == len(actions)),
    )


@scenario("state machine")
def state_machine(run: DemoRun) -> list[SchemeRow]:
    """pay, then ship or cancel (sometimes both, racing): by hand, then through ``Order.flow.<trigger>``."""
    scheme = "state machine"
    ids = run.create_orders(run.orders)

    def requests(order_id: int, roll: float) -> tuple[Group, Group]:
        pay = [Request(order_id, "pay")]
        if roll < 0.15:
            # A customer cancels while the warehouse ships: only one may win.
            return pay, [Request(order_id, "ship"), Request(order_id, "cancel")]
        return pay, [Request(order_id, "cancel" if roll < 0.35 else "ship")]

    plan = run.plan(run.two_waves(ids, requests))
    naive_plan, _ = run.same_storm(plan, ids)

    def fire(session: Session, request: Request) -> Result:
        values = {"paid_at": _now()} if request.action == "pay" else None
        return DemoOrder.flow.fire(session, request.action, request.order_id, values=values)

    def by_hand(session: Session, request: Request) -> Result:
        # Load, check the status in Python, save: the check is stale by the time the UPDATE runs.
        order = session.get(DemoOrder, request.order_id)
        if order is None:
            return Result(Outcome.NOT_FOUND, model=DemoOrder, key=request.order_id)
        dest = _DESTS[request.action]
        if order.status == dest:
            return Result(Outcome.REPEATED, model=DemoOrder, key=order.id)
        if order.status not in _SOURCES[request.action]:
            return Result(Outcome.REJECTED, model=DemoOrder, key=order.id)
        values: dict[str, Any] = {"status": dest}
        if request.action == "pay":
            values["paid_at"] = _now()
        session.execute(update(DemoOrder).where(DemoOrder.id == order.id).values(**values))
        return Result(Outcome.APPLIED, model=DemoOrder, key=order.id)

    def damage(code: str) -> dict[str, int]:
        found = run.duplicates(scheme, code, _TWICE)
        found["shipped and cancelled"] = _both(run, scheme, code, ("ship", "cancel"))
        return found

    rows = run.side_by_side(
        scheme,
        [(HAND_WRITTEN, naive_plan, by_hand), (STATEGUARD, plan, fire)],
        damage,
        {STATEGUARD: "Order.flow.fire(): one guarded UPDATE", HAND_WRITTEN: "load, check status, UPDATE"},
    )
    run.notes.append(
        f"{scheme}: REPEATED = the order was already in the trigger's destination (a twin or a "
        "redelivery won); REJECTED = its state does not allow the trigger (a ship after a cancel, "
        "the loser of ship vs cancel)"
    )
    return rows


@scenario("optimistic version")
def optimistic_version(run: DemoRun) -> list[SchemeRow]:
    """Load, look, write: by hand (saving the whole row back), then ``guarded_update(expected_version=)``."""
    scheme = "optimistic version"
    ids = run.create_orders(run.orders)

    def requests(order_id: int, roll: float) -> tuple[Group, Group | None]:
        if roll < 0.25:
            # Paying and cancelling exclude each other; both arrive at once.
            return [Request(order_id, "pay"), Request(order_id, "cancel")], None
        return [Request(order_id, "pay")], [Request(order_id, "cancel")] if roll < 0.45 else None

    plan = run.plan(run.two_waves(ids, requests))
    naive_plan, naive_ids = run.same_storm(plan, ids)
    columns = {"pay": ("paid_at", "cancelled_at"), "cancel": ("cancelled_at", "paid_at")}

    def look(session: Session, request: Request) -> DemoOrder | Result:
        done, excluded = columns[request.action]
        order = session.get(DemoOrder, request.order_id)
        if order is None:
            return Result(Outcome.NOT_FOUND, model=DemoOrder, key=request.order_id)
        if getattr(order, done) is not None:
            return Result(Outcome.REPEATED, model=DemoOrder, key=request.order_id, version=order.version)
        if getattr(order, excluded) is not None:
            return Result(Outcome.REJECTED, model=DemoOrder, key=request.order_id, version=order.version)
        return order

    def look_then_write(session: Session, request: Request) -> Result:
        order = look(session, request)
        if isinstance(order, Result):
            return order
        # This check in Python is safe only because the write below is
        # conditional on the version read here: if anyone wrote in between,
        # it matches no row (STALE) and retry_on_conflict runs it all again.
        done = columns[request.action][0]
        return guarded_update(session, DemoOrder, order, {done: _now()}, expected_version=order.version)

    def by_hand(session: Session, request: Request) -> Result:
        order = look(session, request)
        if isinstance(order, Result):
            return order
        # The whole row saved back as it was read, plus this change: the version is
        # written but never compared, so a write made meanwhile is silently undone.
        row = {"paid_at": order.paid_at, "cancelled_at": order.cancelled_at, "version": order.version + 1}
        row[columns[request.action][0]] = _now()
        session.execute(update(DemoOrder).where(DemoOrder.id == order.id).values(**row))
        return Result(Outcome.APPLIED, model=DemoOrder, key=order.id, version=order.version + 1)

    orders_of = {HAND_WRITTEN: naive_ids, STATEGUARD: ids}

    def damage(code: str) -> dict[str, int]:
        found = run.duplicates(scheme, code, {"pay": "double charges", "cancel": "double refunds"})
        found["paid and cancelled"] = _both(run, scheme, code, ("pay", "cancel"))
        # Every APPLIED write recorded its side effect and added 1 to the version it read:
        # a version below the number of writes is that many writes overwritten unseen.
        writes = (
            select(DemoSideEffect.order_id, func.count().label("n"))
            .where(DemoSideEffect.scheme == run.key(scheme, code))
            .group_by(DemoSideEffect.order_id)
            .subquery()
        )
        with run.engine.connect() as conn:
            lost = conn.scalar(
                select(func.coalesce(func.sum(writes.c.n - DemoOrder.version), 0))
                .select_from(writes.join(DemoOrder, DemoOrder.id == writes.c.order_id))
                .where(DemoOrder.id.in_(orders_of[code]), writes.c.n > DemoOrder.version)
            )
        found["lost updates"] = int(lost or 0)
        return found

    rows = run.side_by_side(
        scheme,
        [(HAND_WRITTEN, naive_plan, by_hand), (STATEGUARD, plan, look_then_write)],
        damage,
        {
            STATEGUARD: "guarded_update(expected_version=...), retry_on_conflict",
            HAND_WRITTEN: "load, check, save the row back (version not compared)",
        },
    )
    run.notes.append(
        f"{scheme}: REJECTED = pay and cancel exclude each other, and a quarter of the orders send both "
        "at once: whichever loses is REJECTED"
    )
    run.notes.append(
        f"{scheme}: lost updates = writes another write overwrote without seeing them "
        "(the row's version is lower than the number of writes that ran); a double charge is one too"
    )
    return rows


@scenario("insert-once")
def insert_once_consumer(run: DemoRun) -> list[SchemeRow]:
    """A message consumer under at-least-once redelivery: ``SELECT`` then ``INSERT``, then ``insert_once``."""
    scheme = "insert-once"
    ids = run.create_orders(run.orders)
    paid = [[Request(order_id, "pay")] for order_id in ids]
    shipped = [[Request(order_id, "ship")] for order_id in ids if run.rng.random() < 0.7]
    plan = run.plan([paid, shipped])
    naive_plan, _ = run.same_storm(plan, ids)
    messages = len(paid) + len(shipped)

    def consume(session: Session, request: Request) -> Result:
        return insert_once(session, DemoInbox, {"message_id": request.request_id})

    def by_hand(session: Session, request: Request) -> Result:
        seen = session.scalar(
            select(DemoPlainInbox.id).where(DemoPlainInbox.message_id == request.request_id).limit(1)
        )
        if seen is not None:
            return Result(Outcome.REPEATED, model=DemoPlainInbox, key=request.request_id)
        session.add(DemoPlainInbox(message_id=request.request_id))
        session.flush()
        return Result(Outcome.APPLIED, model=DemoPlainInbox, key=request.request_id)

    inbox_of: dict[str, type[DemoInbox] | type[DemoPlainInbox]] = {
        HAND_WRITTEN: DemoPlainInbox,
        STATEGUARD: DemoInbox,
    }

    def damage(code: str) -> dict[str, int]:
        inbox = inbox_of[code]
        found = {
            "duplicate rows": _count(
                run, select(inbox.message_id).group_by(inbox.message_id).having(func.count() > 1)
            )
        }
        found.update(run.duplicates(scheme, code, {"pay": "double charges", "ship": "parcels sent twice"}))
        return found

    rows = run.side_by_side(
        scheme,
        [(HAND_WRITTEN, naive_plan, by_hand), (STATEGUARD, plan, consume)],
        damage,
        {STATEGUARD: "insert_once() into an inbox with a unique key", HAND_WRITTEN: "SELECT, then INSERT"},
    )
    run.notes.append(
        f"{scheme}: APPLIED = messages processed the first time: {messages} messages for {len(ids)} orders "
        "(a pay for each, a ship for ~70%), so APPLIED exceeds the order count"
    )
    run.notes.append(
        f"{scheme}: the hand-written inbox has no unique constraint (with one, its race is an IntegrityError "
        "instead: an error and a redelivery)"
    )
    return rows


@scenario("flash sale")
def flash_sale(run: DemoRun) -> list[SchemeRow]:
    """More buyers than stock, every purchase retried: read-modify-write, then ``decrement`` with a ref."""
    scheme = "flash sale"
    stock = max(1, run.orders // 4)
    token = uuid.uuid4().hex[:8]  # refs are unique per run
    create_tables(run.engine)
    rows_of = {STATEGUARD: 1, HAND_WRITTEN: 2}
    with run.engine.begin() as conn:
        conn.execute(insert(DemoStock), [{"id": i, "amount": stock} for i in rows_of.values()])
    buyers = run.create_orders(run.orders)
    plan = run.plan([[[Request(buyer, "buy")] for buyer in buyers]])
    naive_plan, _ = run.same_storm(plan, buyers)
    naive_key = run.key(scheme, HAND_WRITTEN)

    def buy(session: Session, request: Request) -> Result:
        return decrement(
            session, DemoStock.amount, rows_of[STATEGUARD], by=1, ref=f"demo-{token}-{request.request_id}"
        )

    def by_hand(session: Session, request: Request) -> Result:
        bought = session.scalar(
            select(DemoSideEffect.id)
            .where(DemoSideEffect.scheme == naive_key, DemoSideEffect.order_id == request.order_id)
            .limit(1)
        )
        if bought is not None:
            return Result(Outcome.REPEATED, model=DemoStock, key=request.order_id)
        left = session.scalar(select(DemoStock.amount).where(DemoStock.id == rows_of[HAND_WRITTEN]))
        if left is None or left < 1:
            return Result(Outcome.INSUFFICIENT, model=DemoStock, key=request.order_id)
        session.execute(
            update(DemoStock).where(DemoStock.id == rows_of[HAND_WRITTEN]).values(amount=left - 1)
        )
        return Result(Outcome.APPLIED, model=DemoStock, key=request.order_id)

    rows = []
    for code, deliveries, call in ((HAND_WRITTEN, naive_plan, by_hand), (STATEGUARD, plan, buy)):
        engine = run.hand_engine if code == HAND_WRITTEN else run.engine
        tally = run.fire(deliveries, run.with_side_effect(run.key(scheme, code), call), engine=engine)
        with run.engine.connect() as conn:
            left = int(conn.scalar(select(DemoStock.amount).where(DemoStock.id == rows_of[code])) or 0)
            sold = int(
                conn.scalar(
                    select(func.count())
                    .select_from(DemoSideEffect)
                    .where(DemoSideEffect.scheme == run.key(scheme, code))
                )
                or 0
            )
        damage = {
            "oversold units": max(0, sold - stock),
            "lost updates": max(0, sold - (stock - left)),
        }
        damage.update(run.duplicates(scheme, code, {"buy": "double charges"}))
        how = (
            f"decrement(ref=...) on stock {stock}"
            if code == STATEGUARD
            else f"read stock, check, write stock - 1 (stock {stock})"
        )
        problems = [] if code == HAND_WRITTEN or not sum(damage.values()) else [f"damage {damage}"]
        rows.append(run.row(scheme, how, tally, code=code, damage=damage, problems=problems))
    run.notes.append(
        f"{scheme}: {run.orders} buyers for {stock} units; APPLIED = units sold, INSUFFICIENT = sold out; "
        "oversold = sold beyond the stock, lost updates = sales the stock row does not show"
    )
    return rows


# --------------------------------------------------------------------------
# HTTP: the Idempotency-Key header through the ASGI middleware
# --------------------------------------------------------------------------

#: Scope prefix of the demo's idempotency keys; a run deletes the keys of earlier runs.
DEMO_KEY_SCOPE = "stateguard-demo:"
#: How long the demo's payment provider takes: the window in which retries arrive.
_PROVIDER_LATENCY = 0.01
#: How long a client keeps retrying 409 and 503 answers before it reports an error.
_CLIENT_PATIENCE = 60.0


@dataclass(frozen=True, slots=True)
class HttpAnswer:
    """An HTTP response as the demo's client received it (header names in lower case)."""

    status: int
    headers: dict[str, str]
    body: bytes


async def asgi_request(
    app: ASGIApp, method: str, path: str, headers: Sequence[tuple[bytes, bytes]], body: bytes
) -> HttpAnswer:
    """Send one request to ``app`` in-process, as an ASGI server would, and collect the response.

    The demo's transport: no sockets and no HTTP client library.  Run it on
    an event loop, e.g. through an anyio blocking portal from worker threads::

        with anyio.from_thread.start_blocking_portal() as portal:
            answer = portal.call(asgi_request, app, "POST", "/payments", headers, b'{"amount": 1}')
    """
    import anyio

    finished = anyio.Event()
    delivered = False
    status = 0
    out_headers: dict[str, str] = {}
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        # The client stays connected until the response is complete.
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
            for name, value in message.get("headers", ()):
                out_headers[bytes(name).decode("latin-1").lower()] = bytes(value).decode("latin-1")
        elif message["type"] == "http.response.body":
            chunks.append(bytes(message.get("body", b"")))
            if not message.get("more_body", False):
                finished.set()

    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode("ascii"),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"demo.invalid"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode("ascii")),
            *headers,
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("demo.invalid", 80),
        "state": {},
    }
    try:
        await app(scope, receive, send)
    finally:
        finished.set()
    return HttpAnswer(status, out_headers, b"".join(chunks))


@scenario("http retry storm")
def http_retry_storm(run: DemoRun) -> list[SchemeRow]:
    """POST /payments with an Idempotency-Key through ``IdempotencyMiddleware`` on a Starlette app.

    The handler is deliberately naive: every call charges (records a side
    effect), so only the middleware keeps it to once per key.  Each payment
    is sent 2-4 times (twins at the same instant, retries later); clients
    send a 409 (in progress) or 503 again (the provider fails the first call
    of a tenth of the payments: the middleware releases the key).  After
    the storm a tenth of the keys are reused for another amount: each must
    get 422.  The app runs in-process on one event loop (an anyio portal),
    as under an ASGI server; the clients are the demo's worker threads.
    """
    scheme = "http retry storm"
    try:
        from anyio.from_thread import BlockingPortal, start_blocking_portal
        from starlette.applications import Starlette
        from starlette.concurrency import run_in_threadpool
        from starlette.requests import Request as HttpRequest
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route
    except ImportError as error:
        run.notes.append(
            f"{scheme}: skipped: it needs starlette ({error}); pip install 'stateguard[demo]' to run it"
        )
        return []
    from ..asgi import IdempotencyMiddleware

    token = uuid.uuid4().hex[:8]
    key_scope = f"{DEMO_KEY_SCOPE}{token}"  # keys outlive the sg_demo_* tables: unique per run
    create_tables(run.engine)
    with run.engine.begin() as conn:
        conn.execute(delete(idempotency_keys).where(idempotency_keys.c.scope.startswith(DEMO_KEY_SCOPE)))
    ids = run.create_orders(run.orders)
    flaky_first = run.rng.sample(ids, max(1, len(ids) // 10))
    reused_first = run.rng.sample(ids, max(1, len(ids) // 10))
    plan = run.plan([[[Request(order_id, "pay")] for order_id in ids]])
    naive_plan, naive_ids = run.same_storm(plan, ids)
    moved = dict(zip(ids, naive_ids, strict=True))
    session_factory = sessionmaker(run.engine)
    lock = threading.Lock()
    rows: list[SchemeRow] = []

    for code in (HAND_WRITTEN, STATEGUARD):
        orders = ids if code == STATEGUARD else naive_ids
        deliveries = plan if code == STATEGUARD else naive_plan
        flaky = {o if code == STATEGUARD else moved[o] for o in flaky_first}
        reused = [o if code == STATEGUARD else moved[o] for o in reused_first]
        amounts = {order_id: 100 * (1 + i % 50) for i, order_id in enumerate(orders)}
        key = run.key(scheme, code)
        #: order id -> payment ids seen in 201 answers (a replay must show the first call's).
        seen: dict[int, set[int]] = {}

        def charge(order_id: int, amount: int, idem_key: str, worker: str, *, key: str = key,
                   flaky: set[int] = flaky) -> Response:  # fmt: skip
            with lock:
                fail = order_id in flaky
                flaky.discard(order_id)
            time.sleep(_PROVIDER_LATENCY)
            if fail:
                return JSONResponse({"error": "payment provider unavailable, try again"}, status_code=503)
            with session_factory() as session, session.begin():
                effect = DemoSideEffect(
                    scheme=key, order_id=order_id, action="pay", request_id=idem_key, worker=worker
                )
                session.add(effect)
                session.flush()
                payment_id = effect.id
            return JSONResponse(
                {"payment_id": payment_id, "order_id": order_id, "amount": amount},
                status_code=201,
                headers={"Location": f"/payments/{payment_id}"},
            )

        def create_payment(charge: Callable[..., Response]) -> Callable[[HttpRequest], Any]:
            async def endpoint(request: HttpRequest) -> Response:
                body = await request.json()
                idem_key = request.headers.get("idempotency-key", "")
                worker = request.headers.get("x-demo-worker", "?")
                return await run_in_threadpool(
                    charge, int(body["order_id"]), int(body["amount"]), idem_key, worker
                )

            return endpoint

        app = Starlette(routes=[Route("/payments", create_payment(charge), methods=["POST"])])
        if code == STATEGUARD:
            app.add_middleware(
                IdempotencyMiddleware,
                session_factory=session_factory,
                required_paths=["/payments"],
                scope=key_scope,
            )

        def client(portal: BlockingPortal, *, other_amount: bool, app: Any = app, amounts: dict[int, int]
                   = amounts, seen: dict[int, set[int]] = seen) -> Sender:  # fmt: skip
            def send(delivery: Delivery) -> Outcome:
                order_id = delivery.request.order_id
                amount = amounts[order_id] + (1 if other_amount else 0)
                body = json.dumps({"order_id": order_id, "amount": amount}).encode("utf-8")
                headers = [
                    (b"idempotency-key", f"order-{order_id}-pay".encode("ascii")),
                    (b"x-demo-worker", delivery.worker.encode("ascii")),
                ]
                deadline = time.monotonic() + _CLIENT_PATIENCE
                while True:
                    answer = portal.call(asgi_request, app, "POST", "/payments", headers, body)
                    if answer.status not in (409, 503):
                        break
                    if answer.status == 409 and "retry-after" not in answer.headers:
                        raise RuntimeError("409 without a Retry-After header")
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"still HTTP {answer.status} after {_CLIENT_PATIENCE:.0f}s of retries"
                        )
                    delivery.retried += 1
                    delivery.counts["409 in progress" if answer.status == 409 else "503 released"] += 1
                    # A real client waits Retry-After seconds (or backs off); the demo a few milliseconds.
                    time.sleep(random.uniform(0.002, 0.01))
                if answer.status == 422:
                    return Outcome.REJECTED
                if answer.status != 201:
                    raise RuntimeError(
                        f"HTTP {answer.status}: {answer.body[:120].decode('utf-8', 'replace')}"
                    )
                payment_id = int(json.loads(answer.body)["payment_id"])
                with lock:
                    seen.setdefault(order_id, set()).add(payment_id)
                replayed = answer.headers.get("idempotency-replayed") == "true"
                return Outcome.REPEATED if replayed else Outcome.APPLIED

            return send

        with start_blocking_portal() as portal:
            tally = run.storm(deliveries, client(portal, other_amount=False))
            # Every key is completed now: a buggy client reuses some for another amount.
            reuse = [[Request(order_id, "pay")] for order_id in reused]
            run.storm(reuse, client(portal, other_amount=True), tally=tally)

        damage = run.duplicates(scheme, code, {"pay": "double charges"})
        how = (
            "Starlette + IdempotencyMiddleware, POST /payments with Idempotency-Key"
            if code == STATEGUARD
            else "Starlette, the Idempotency-Key header ignored"
        )
        if code == HAND_WRITTEN:
            rows.append(run.row(scheme, how, tally, code=code, damage=damage))
            continue
        with run.engine.connect() as conn:
            per_order = {
                int(order_id): int(n)
                for order_id, n in conn.execute(
                    select(DemoSideEffect.order_id, func.count())
                    .where(DemoSideEffect.scheme == key)
                    .group_by(DemoSideEffect.order_id)
                )
            }
            completed = conn.scalar(
                select(func.count())
                .select_from(idempotency_keys)
                .where(idempotency_keys.c.scope == key_scope, idempotency_keys.c.status == "completed")
            )
        executions = [per_order.get(order_id, 0) for order_id in ids]
        problems: list[str] = []
        never = executions.count(0)
        if never:
            problems.append(f"{never} payments never ran")
        if completed != len(ids):
            problems.append(f"{completed} of {len(ids)} idempotency keys are completed")
        mixed = sorted(order_id for order_id, payments in seen.items() if len(payments) > 1)
        if mixed:
            problems.append(
                f"{len(mixed)} keys were answered with different payments, e.g. order {mixed[0]}: "
                f"{sorted(seen[mixed[0]])}"
            )
        refused = tally.outcomes[Outcome.REJECTED]
        if refused != len(reused):
            problems.append(
                f"{refused} of {len(reused)} keys reused for another amount were refused with 422"
            )
        if sum(damage.values()):
            problems.append(f"damage {damage}")
        run.notes.append(
            f"{scheme}: executions per key: min {min(executions)}, max {max(executions)} "
            f"over {len(ids)} keys (must be exactly 1)"
        )
        rows.append(run.row(scheme, how, tally, problems=problems, code=code, damage=damage))
    run.notes.append(f"{scheme}: APPLIED = the handler ran, REPEATED = the stored response replayed,")
    run.notes.append(
        f"{scheme}: REJECTED = 422 (a key reused for another amount), retried = 409 and 503 answers resent"
    )
    return rows


# --------------------------------------------------------------------------
# The outbox pipeline: exactly-once effects end to end
# --------------------------------------------------------------------------

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
    from ..tables import consumed_messages, outbox

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
    from ..idempotency import idempotent
    from ..inserts import consume_once
    from ..outbox import CallableSink, OutboxEvent, Relay, emit
    from ..tables import outbox

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
        from ..outbox.sinks.redis_streams import RedisStreamSink

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
                errors.append(f"stream reader: {type(error).__name__}: {_first_line(error)}")

    def relay_loop(relay: Relay) -> None:
        while not stop.is_set():
            try:
                published = relay.run_once()
            except _LostAck:
                continue  # the claim was released: this or the other relay publishes the batch again
            except Exception as error:  # retryable conflicts included: reported, then the loop goes on
                if not getattr(error, "retryable", False):
                    with lock:
                        errors.append(f"relay: {type(error).__name__}: {_first_line(error)}")
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
                    errors.append(f"consumer: {type(error).__name__}: {_first_line(error)}")
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


# --------------------------------------------------------------------------
# The demo's own namespace: a schema, a database or a file
# --------------------------------------------------------------------------

#: The table that marks a namespace as made by ``stateguard demo`` (only such a namespace is ever dropped).
MARKER_TABLE = "sg_demo_namespace"
#: ``--schema`` default.
DEFAULT_SCHEMA = "sg_demo"
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,47}\Z")
#: Outside DemoBase: run_demo drops and creates DemoBase's tables, never the marker.
_marker = Table(MARKER_TABLE, MetaData(), Column("id", Integer, primary_key=True), Column("note", String(80)))


class DemoNamespaceTaken(InvalidArgument):
    """The demo's namespace (``--schema``) already exists and was not made by the demo.

    The demo never writes into, nor drops, a schema, database or file it did
    not create: pass another ``--schema NAME``.
    """


@dataclass
class DemoNamespace:
    """Where the demo writes: its own PostgreSQL schema, MariaDB/MySQL database or SQLite file.

    ``engine`` sees only that namespace (every table the demo creates,
    stateguard's own tables included, lands there); :meth:`drop` removes it
    all.  Made by :func:`open_namespace`::

        namespace = open_namespace(make_url("postgresql+psycopg://app@db/app"), "sg_demo", connect)
        try:
            report = run_demo(namespace.engine)
        finally:
            namespace.drop()
    """

    name: str
    #: ``'PostgreSQL schema "sg_demo"'``, ``'MariaDB database `sg_demo`'``, ``'SQLite file /x/a.sg_demo.db'``.
    where: str
    engine: Engine
    #: How to get rid of it by hand (``DROP SCHEMA ... CASCADE``, ``rm ...``), printed with ``--keep``.
    drop_hint: str
    _drop: Callable[[], None]
    #: The engine on the database ``--db`` names (PostgreSQL, MariaDB), which drops the namespace.
    admin: Engine | None = None

    def drop(self) -> None:
        """Dispose of the engines and drop the whole namespace (schema, database or file)."""
        self.engine.dispose()
        try:
            self._drop()
        finally:
            self.close()

    def close(self) -> None:
        """Dispose of the engines and keep the namespace (``--keep``)."""
        self.engine.dispose()
        if self.admin is not None:
            self.admin.dispose()


def namespace_url(url: URL, name: str) -> URL:
    """The URL of the demo's namespace ``name`` on the database ``url`` names.

    * PostgreSQL: ``url`` itself (the schema is chosen by ``search_path``);
    * MariaDB/MySQL: the database ``name`` on the same server;
    * SQLite: the file ``<stem>.<name>.db`` next to ``url``'s file (an
      attached database would not hide the user's same-named tables: SQLite
      looks unqualified names up in ``main`` first).

    ::

        namespace_url(make_url("sqlite:///shop.db"), "sg_demo")   # sqlite:///shop.sg_demo.db
    """
    check_schema_name(name)
    backend = url.get_backend_name()
    if backend == "sqlite":
        database = url.database or ""
        if database in ("", ":memory:") or database.startswith("file:"):
            raise InvalidArgument(f"the demo needs a SQLite file path, got {database!r}")
        path = Path(database)
        return url.set(database=str(path.with_name(f"{path.stem}.{name}.db")))
    if backend in ("mysql", "mariadb"):
        return url.set(database=name)
    return url


def check_schema_name(name: str) -> str:
    """``name`` if it is a valid ``--schema`` (lower-case letters, digits, ``_``; 48 at most).

    Anything else raises :class:`~stateguard.InvalidArgument`::

        check_schema_name("sg_demo")
    """
    if not _SCHEMA_NAME.match(name):
        raise InvalidArgument(
            f"--schema must be lower-case letters, digits and _ (not starting with a digit, "
            f"48 characters at most), got {name!r}"
        )
    return name


def open_namespace(url: URL, name: str, connect: Callable[[URL], Engine]) -> DemoNamespace:
    """Create the demo's namespace ``name`` on ``url`` and return an engine that sees only it.

    ``connect(url)`` makes a connected engine (the CLI's ``open_engine``).
    A namespace of that name left by an earlier ``--keep`` or interrupted
    run (it has the :data:`MARKER_TABLE`) is dropped and made again; one
    that exists without the marker raises :class:`DemoNamespaceTaken` and
    nothing is written.  See :func:`namespace_url` for what a namespace is
    on each backend.
    """
    check_schema_name(name)
    backend = url.get_backend_name()
    if backend == "sqlite":
        namespace = _sqlite_namespace(url, name, connect)
    else:
        namespace = _server_namespace(url, name, connect)
    try:
        with namespace.engine.begin() as conn:
            _marker.create(conn)
            conn.execute(
                insert(_marker), [{"id": 1, "note": "made by stateguard demo; dropped after the run"}]
            )
    except BaseException:
        namespace.drop()
        raise
    return namespace


def _server_namespace(url: URL, name: str, connect: Callable[[URL], Engine]) -> DemoNamespace:
    backend = url.get_backend_name()
    admin = connect(url)
    try:
        if backend == "postgresql":
            namespace = _pg_namespace(admin, url, name, connect)
        elif backend in ("mysql", "mariadb"):
            namespace = _mysql_namespace(admin, url, name, connect)
        else:
            raise InvalidArgument(f"the demo runs on PostgreSQL, MariaDB/MySQL and SQLite, not {backend}")
    except BaseException:
        admin.dispose()
        raise
    return namespace


def _taken(where: str) -> DemoNamespaceTaken:
    return DemoNamespaceTaken(
        f"{where} already exists and was not made by stateguard demo (it has no {MARKER_TABLE} table); "
        "the demo never writes into it: pass another --schema NAME"
    )


def _pg_namespace(admin: Engine, url: URL, name: str, connect: Callable[[URL], Engine]) -> DemoNamespace:
    where = f'PostgreSQL schema "{name}"'
    with admin.connect() as conn, conn.begin():
        exists = conn.scalar(text("SELECT 1 FROM pg_namespace WHERE nspname = :n"), {"n": name})
        if exists:
            if conn.scalar(text("SELECT to_regclass(:t)"), {"t": f'"{name}".{MARKER_TABLE}'}) is None:
                raise _taken(where)
            conn.execute(text(f'DROP SCHEMA "{name}" CASCADE'))
        conn.execute(text(f'CREATE SCHEMA "{name}"'))
    engine = connect(url)

    @event.listens_for(engine, "connect", insert=True)
    def search_path(dbapi_connection: Any, record: Any) -> None:
        autocommit = dbapi_connection.autocommit
        dbapi_connection.autocommit = True
        cursor = dbapi_connection.cursor()
        cursor.execute(f'SET search_path TO "{name}"')
        cursor.close()
        dbapi_connection.autocommit = autocommit

    engine.dispose()  # the connection open_engine tested predates the listener

    def drop() -> None:
        with admin.connect() as conn, conn.begin():
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))

    return DemoNamespace(name, where, engine, f'DROP SCHEMA "{name}" CASCADE', drop, admin)


def _mysql_namespace(admin: Engine, url: URL, name: str, connect: Callable[[URL], Engine]) -> DemoNamespace:
    kind = "MariaDB" if getattr(admin.dialect, "is_mariadb", False) else "MySQL"
    where = f"{kind} database `{name}`"
    with admin.connect() as conn:
        exists = conn.scalar(
            text("SELECT 1 FROM information_schema.schemata WHERE schema_name = :n"), {"n": name}
        )
        if exists:
            marked = conn.scalar(
                text("SELECT 1 FROM information_schema.tables WHERE table_schema = :n AND table_name = :t"),
                {"n": name, "t": MARKER_TABLE},
            )
            if not marked:
                raise _taken(where)
            conn.execute(text(f"DROP DATABASE `{name}`"))
        conn.execute(text(f"CREATE DATABASE `{name}`"))
        conn.commit()
    engine = connect(url.set(database=name))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))
            conn.commit()

    return DemoNamespace(name, where, engine, f"DROP DATABASE `{name}`", drop, admin)


def _sqlite_files(path: Path) -> list[Path]:
    return [path, *(path.with_name(path.name + suffix) for suffix in ("-wal", "-shm", "-journal"))]


def _sqlite_namespace(url: URL, name: str, connect: Callable[[URL], Engine]) -> DemoNamespace:
    import sqlite3

    ns_url = namespace_url(url, name)
    path = Path(ns_url.database or "").resolve()
    where = f"SQLite file {path}"
    if path.exists():
        # Read-only look (a plain connect would create nothing, but must not change anything either).
        probe = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            marked = probe.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (MARKER_TABLE,)
            ).fetchone()
        except sqlite3.DatabaseError as error:
            raise DemoNamespaceTaken(
                f"{where} exists and is not a SQLite database ({error}): pass another --schema NAME"
            ) from error
        finally:
            probe.close()
        if not marked:
            raise _taken(where)
        for file in _sqlite_files(path):
            file.unlink(missing_ok=True)
    engine = connect(ns_url)

    def drop() -> None:
        for file in _sqlite_files(path):
            file.unlink(missing_ok=True)

    return DemoNamespace(name, where, engine, f"rm {path}", drop)


# --------------------------------------------------------------------------
# Running and rendering
# --------------------------------------------------------------------------


def run_demo(
    engine: Engine,
    *,
    workers: int = 8,
    orders: int = 120,
    seed: int | None = None,
    progress: Progress | None = None,
    scenarios: Sequence[Scenario] | None = None,
    redis: Any = None,
) -> DemoReport:
    """Drop and create the ``sg_demo_*`` tables on ``engine`` and run every scenario.

    ``engine`` should see only the demo's own namespace (:func:`open_namespace`;
    ``stateguard demo`` does that): the scenarios also create stateguard's
    tables there::

        report = run_demo(sqlite_engine("sqlite:///demo.db"), orders=50)
        print(render(report))
        if not report.ok:
            raise SystemExit(1)
    """
    if workers < 1 or orders < 1:
        raise ValueError("workers and orders must be at least 1")
    if seed is None:
        seed = random.SystemRandom().randrange(1, 100_000)
    progress = progress or Progress()
    chosen = list(SCENARIOS if scenarios is None else scenarios)
    started = time.monotonic()
    DemoBase.metadata.drop_all(engine)
    DemoBase.metadata.create_all(engine)
    naive = hand_written_engine(engine, workers)
    run = DemoRun(engine, workers, orders, random.Random(seed), progress, redis=redis, naive_engine=naive)
    rows: list[SchemeRow] = []
    try:
        for i, sc in enumerate(chosen, 1):
            progress.begin(i, len(chosen), sc.title)
            new = sc.fn(run)
            progress.end(new)
            rows.extend(new)
    finally:
        if naive is not None:
            naive.dispose()
    progress.done()
    return DemoReport(
        rows=rows,
        seed=seed,
        workers=workers,
        orders=orders,
        url=engine.url.render_as_string(hide_password=True),
        elapsed=time.monotonic() - started,
        notes=run.notes,
        dialect="mariadb" if engine.dialect.name == "mysql" else engine.dialect.name,
    )


def hand_written_engine(engine: Engine, workers: int) -> Engine | None:
    """The engine of the hand-written variants: on SQLite a plain ``create_engine()``, else ``None``.

    On SQLite most applications use SQLAlchemy's default engine, where the
    driver (pysqlite) opens the transaction only at the first write: the
    ``SELECT`` of a load-check-save reads outside the transaction that
    writes, as it does on PostgreSQL at READ COMMITTED.  stateguard runs on
    the demo's :func:`~stateguard.sqlite_engine` (real BEGINs), on which the
    same hand-written code is refused at its first write whenever its read
    went stale, and re-run.
    """
    if engine.dialect.name != "sqlite":
        return None
    return create_engine(engine.url, pool_size=workers, max_overflow=workers, connect_args={"timeout": 60})


_GREEN = "\x1b[32m"
_RED = "\x1b[1;31m"
_BOLD = "\x1b[1m"
_DIM = "\x1b[2m"
_RESET = "\x1b[0m"

#: The columns of the results table (the terminal's and the HTML page's).
COLUMNS = (
    "scheme",
    "code",
    "attempts",
    "APPLIED",
    "REPEATED",
    "REJECTED",
    "retried",
    "side effects",
    "invariant",
    "damage (measured in the database afterwards)",
)

_BACKENDS = {"postgresql": "PostgreSQL", "mariadb": "MariaDB/MySQL", "sqlite": "SQLite"}

#: What "retried" counts for the storms of one database unit of work per delivery, by dialect.
_RETRIED = {
    "postgresql": "serialization failures and deadlocks PostgreSQL reported (40001, 40P01)",
    "mariadb": "deadlocks and lock wait timeouts InnoDB reported (1213, 1205)",
    "sqlite": "SQLITE_BUSY, 'database is locked': a transaction whose read went stale before it wrote",
}


def damage_text(row: SchemeRow) -> str:
    """``"12 double charges, 3 lost updates"``, or ``"none"`` when every kind is 0::

    damage_text(row)   # 'none (0 double charges, 0 lost updates)' for a stateguard row
    """
    kinds = ", ".join(f"{n} {kind}" for kind, n in row.damage.items())
    if not row.damage:
        return "-"
    return kinds if row.damage_total else f"none ({kinds})"


def explanations(report: DemoReport) -> list[str]:
    """The lines under the table that say what its numbers mean on this run's database::

    for line in explanations(report):
        print(line)
    """
    here = _RETRIED.get(report.dialect)
    others = [f"{name}: {_RETRIED[key]}" for key, name in _BACKENDS.items() if key != report.dialect]
    naive = [r for r in report.rows if r.naive]
    out = [
        "code: hand-written = the usual code (load, check in Python, save; SELECT then INSERT; "
        "read-modify-write stock; the Idempotency-Key header ignored; a consumer without deduplication), "
        "stateguard = the same requests, delivered the same way, through stateguard",
        "attempts = deliveries (each request 2-4 times); APPLIED = calls that changed something and ran "
        "the side effect; REPEATED = already done (a duplicate answered as such); REJECTED = not allowed "
        "in the row's state any more",
        "retried = deliveries re-run whole by retry_on_conflict because the database refused them"
        + (f"; here ({_BACKENDS.get(report.dialect, report.dialect)}): {here}" if here else "")
        + f"; on {'; on '.join(others)}; the optimistic row adds its STALE re-runs (the version moved "
        "between read and write); the HTTP row counts 409 (in progress) and 503 answers resent",
        "damage = counted with SQL in the tables afterwards (side-effect rows per order and action, the "
        "stock row, row versions, the inbox), never computed from the outcomes; stateguard's rows are "
        "counted the same way",
        "nothing widens the race windows: no sleeps in the hand-written code, which is raced only by the "
        "storm's own twins and redeliveries (the HTTP handler's 10 ms provider call is the same in both "
        "variants)",
    ]
    if report.dialect == "sqlite" and naive:
        out.append(
            "on SQLite the hand-written code runs on a plain create_engine(), as most applications do: "
            "pysqlite begins the transaction at the first write, so the SELECT reads outside it and the "
            "check can be stale; SQLite lets one writer in at a time, which does not help a check made "
            "before the write. stateguard runs on stateguard.sqlite_engine() (real BEGINs); there the "
            "hand-written code would be refused at its first write whenever its read went stale "
            "(SQLITE_BUSY) and would have to be re-run whole"
        )
    return out


def render(report: DemoReport, *, color: bool = False) -> str:
    """The result table as text (ANSI colours only when ``color``)::

    print(render(run_demo(engine), color=sys.stdout.isatty()))
    """

    def paint(text: str, code: str) -> str:
        return f"{code}{text}{_RESET}" if color else text

    cells: list[tuple[str, ...]] = [
        (
            row.scheme,
            row.code,
            str(row.attempts),
            str(row.applied),
            str(row.repeated),
            str(row.rejected),
            str(row.retried),
            str(row.side_effects),
            "ok" if row.held else "VIOLATED",
            damage_text(row),
        )
        for row in report.rows
    ]
    widths = [max(len(c[i]) for c in [COLUMNS, *cells]) for i in range(len(COLUMNS))]

    def line(values: Sequence[str], verdict_code: str | None = None) -> str:
        # scheme and code left, counts right, verdict and damage left; the long
        # damage goes last so it never pushes the numbers apart.
        parts = [values[0].ljust(widths[0]), values[1].ljust(widths[1])]
        parts.extend(v.rjust(w) for v, w in zip(values[2:-2], widths[2:-2], strict=True))
        verdict = values[-2].ljust(widths[-2])
        parts.append(paint(verdict, verdict_code) if verdict_code else verdict)
        parts.append(values[-1])
        return "  ".join(parts).rstrip()

    if report.namespace.startswith("SQLite"):
        where = f"in the {report.namespace}"
    else:
        where = f"on {report.url}" + (f", in the {report.namespace}" if report.namespace else "")
    out = [
        paint(
            f"stateguard demo: {report.orders} orders per scheme and variant, {report.workers} workers, "
            f"seed {report.seed}, {where}",
            _BOLD,
        ),
        "each request is sent 2-4 times: twins at the same instant, redeliveries later; every scheme",
        "runs the same storm twice, through hand-written code and through stateguard; only an APPLIED",
        "call records its side effect (in the same transaction)",
        "",
        paint(line(COLUMNS), _BOLD),
    ]
    for row, values in zip(report.rows, cells, strict=True):
        code = None
        if color:
            code = _GREEN if row.held else (_RED if not row.naive else _BOLD)
        out.append(line(values, code))
    out.append("")
    for text_line in explanations(report):
        out.extend(textwrap.wrap(text_line, 100, subsequent_indent="    ", break_on_hyphens=False))
    for row in report.rows:
        if row.other:
            extra = ", ".join(f"{k} {v}" for k, v in sorted(row.other.items()))
            out.append(f"{DemoRun.key(row.scheme, row.code)}: also {extra}")
    out.extend(f"{row.scheme}: {row.code} = {row.how}" for row in report.rows)
    out.extend(report.notes)
    for row in report.rows:
        if not row.naive:
            out.extend(paint(p, _RED) for p in row.problems)
        elif row.other.get("errors"):
            out.extend(paint(p, _RED) for p in row.problems if p.split(": ", 1)[-1].startswith("unexpected"))
    naive = [r for r in report.rows if r.naive]
    damaged = sum(1 for r in naive if r.damage_total)
    if report.ok:
        verdict = (
            "stateguard: invariant held in every scheme (side effects == APPLIED, at most one per (order, "
            f"trigger), no damage); the hand-written code did damage in {damaged} of {len(naive)} schemes "
            "on the same storms"
        )
    else:
        verdict = "INVARIANT VIOLATED: see the problems above"
    out.append(paint(verdict, _GREEN if report.ok else _RED))
    out.append(paint(f"finished in {report.elapsed:.1f}s; {report.afterwards}".rstrip("; "), _DIM))
    return "\n".join(out)
