"""``stateguard demo``: a storm of retried, redelivered and double-clicked requests.

The demo creates its own tables (``sg_demo_*``, dropped and recreated on every
run), then fires each logical request 2-4 times from many worker threads, the
way production traffic does: a client retries after a timeout while the first
call is still running (two workers released together by a barrier), a queue
redelivers a message later, a user double-clicks.  Every scheme records a
side-effect row only when its call was APPLIED, in the same transaction, and
the demo then counts them: the invariant is *side effects == APPLIED, and at
most one side effect per (order, trigger)*.

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
import threading
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, String, delete, func, insert, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from ..counters import decrement
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


# --------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------


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

    @property
    def label(self) -> str:
        """``"scheme (how)"``, e.g. ``"state machine (pay/ship/cancel)"``."""
        return f"{self.scheme} ({self.how})"

    @property
    def ok(self) -> bool:
        """``True`` when the invariant held and nothing unexpected happened."""
        return not self.problems


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

    @property
    def ok(self) -> bool:
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

    def fire(self, plan: Sequence[Group], deliver: Deliver) -> Tally:
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
                with Session(self.engine) as session, session.begin():
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

    def row(self, scheme: str, how: str, tally: Tally, *, problems: Sequence[str] = ()) -> SchemeRow:
        """The table row for ``scheme``, with the side-effect invariant checked in the database."""
        applied = tally.outcomes[Outcome.APPLIED]
        with self.engine.connect() as conn:
            effects = conn.scalar(
                select(func.count()).select_from(DemoSideEffect).where(DemoSideEffect.scheme == scheme)
            )
            doubles = conn.execute(
                select(DemoSideEffect.order_id, DemoSideEffect.action, func.count())
                .where(DemoSideEffect.scheme == scheme)
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
            problems=[f"{scheme}: {p}" for p in found],
            other=other,
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


@scenario("state machine")
def state_machine(run: DemoRun) -> list[SchemeRow]:
    """pay, then ship or cancel (sometimes both, racing), through ``Order.flow.<trigger>``."""
    scheme = "state machine"
    ids = run.create_orders(run.orders)

    def requests(order_id: int, roll: float) -> tuple[Group, Group]:
        pay = [Request(order_id, "pay")]
        if roll < 0.15:
            # A customer cancels while the warehouse ships: only one may win.
            return pay, [Request(order_id, "ship"), Request(order_id, "cancel")]
        return pay, [Request(order_id, "cancel" if roll < 0.35 else "ship")]

    def fire(session: Session, request: Request) -> Result:
        values = {"paid_at": _now()} if request.action == "pay" else None
        return DemoOrder.flow.fire(session, request.action, request.order_id, values=values)

    tally = run.fire(run.plan(run.two_waves(ids, requests)), run.with_side_effect(scheme, fire))
    with run.engine.connect() as conn:
        both = conn.scalar(
            select(func.count()).select_from(
                select(DemoSideEffect.order_id)
                .where(DemoSideEffect.scheme == scheme, DemoSideEffect.action.in_(["ship", "cancel"]))
                .group_by(DemoSideEffect.order_id)
                .having(func.count(func.distinct(DemoSideEffect.action)) > 1)
                .subquery()
            )
        )
    problems = [f"{both} orders were both shipped and cancelled"] if both else []
    return [run.row(scheme, "pay/ship/cancel", tally, problems=problems)]


@scenario("optimistic version")
def optimistic_version(run: DemoRun) -> list[SchemeRow]:
    """Load, look, write with ``guarded_update(expected_version=...)``; STALE re-runs the whole unit."""
    scheme = "optimistic version"
    ids = run.create_orders(run.orders)

    def requests(order_id: int, roll: float) -> tuple[Group, Group | None]:
        if roll < 0.25:
            # Paying and cancelling exclude each other; both arrive at once.
            return [Request(order_id, "pay"), Request(order_id, "cancel")], None
        return [Request(order_id, "pay")], [Request(order_id, "cancel")] if roll < 0.45 else None

    columns = {"pay": ("paid_at", "cancelled_at"), "cancel": ("cancelled_at", "paid_at")}

    def look_then_write(session: Session, request: Request) -> Result:
        done, excluded = columns[request.action]
        order = session.get(DemoOrder, request.order_id)
        if order is None:
            return Result(Outcome.NOT_FOUND, model=DemoOrder, key=request.order_id)
        # This check in Python is safe only because the write below is
        # conditional on the version read here: if anyone wrote in between,
        # it matches no row (STALE) and retry_on_conflict runs it all again.
        if getattr(order, done) is not None:
            return Result(Outcome.REPEATED, model=DemoOrder, key=request.order_id, version=order.version)
        if getattr(order, excluded) is not None:
            return Result(Outcome.REJECTED, model=DemoOrder, key=request.order_id, version=order.version)
        return guarded_update(session, DemoOrder, order, {done: _now()}, expected_version=order.version)

    tally = run.fire(run.plan(run.two_waves(ids, requests)), run.with_side_effect(scheme, look_then_write))
    with run.engine.connect() as conn:
        both = conn.scalar(
            select(func.count())
            .select_from(DemoOrder)
            .where(
                DemoOrder.id.in_(ids),
                DemoOrder.paid_at.is_not(None),
                DemoOrder.cancelled_at.is_not(None),
            )
        )
    problems = [f"{both} orders were both paid and cancelled"] if both else []
    return [
        run.row(scheme, "guarded_update with expected_version, retry_on_conflict", tally, problems=problems)
    ]


@scenario("insert-once")
def insert_once_consumer(run: DemoRun) -> list[SchemeRow]:
    """A message consumer under at-least-once redelivery, deduplicated by ``insert_once``."""
    scheme = "insert-once"
    ids = run.create_orders(run.orders)
    paid = [[Request(order_id, "pay")] for order_id in ids]
    shipped = [[Request(order_id, "ship")] for order_id in ids if run.rng.random() < 0.7]

    def consume(session: Session, request: Request) -> Result:
        return insert_once(session, DemoInbox, {"message_id": request.request_id})

    tally = run.fire(run.plan([paid, shipped]), run.with_side_effect(scheme, consume))
    return [run.row(scheme, "message consumer redelivery, insert_once", tally)]


@scenario("flash sale")
def flash_sale(run: DemoRun) -> list[SchemeRow]:
    """More buyers than stock, every purchase retried: ``decrement`` with a ref per purchase."""
    scheme = "flash sale"
    stock = max(1, run.orders // 4)
    token = uuid.uuid4().hex[:8]  # refs are unique per run: the ledger outlives the demo tables
    create_tables(run.engine)
    with run.engine.begin() as conn:
        conn.execute(insert(DemoStock), [{"id": 1, "amount": stock}])
    buyers = run.create_orders(run.orders)
    purchases = [[Request(buyer, "buy")] for buyer in buyers]

    def buy(session: Session, request: Request) -> Result:
        return decrement(session, DemoStock.amount, 1, by=1, ref=f"demo-{token}-{request.request_id}")

    tally = run.fire(run.plan([purchases]), run.with_side_effect(scheme, buy))
    with run.engine.connect() as conn:
        left = int(conn.scalar(select(DemoStock.amount).where(DemoStock.id == 1)) or 0)
    sold = tally.outcomes[Outcome.APPLIED]
    problems = []
    oversell = max(0, sold - stock) + max(0, -left)
    if oversell or stock - left != sold:
        problems.append(f"oversell {oversell}: stock {stock}, sold {sold}, left {left}")
    row = run.row(scheme, f"decrement with a ref per purchase, stock {stock}, oversell {oversell}", tally,
                  problems=problems)  # fmt: skip
    return [row]


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
    amounts = {order_id: 100 * (1 + order_id % 50) for order_id in ids}
    flaky = set(run.rng.sample(ids, max(1, len(ids) // 10)))
    reused = run.rng.sample(ids, max(1, len(ids) // 10))
    session_factory = sessionmaker(run.engine)
    lock = threading.Lock()
    #: order id -> payment ids seen in 201 answers (a replay must show the first call's).
    seen: dict[int, set[int]] = {}

    def charge(order_id: int, amount: int, key: str, worker: str) -> Response:
        with lock:
            fail = order_id in flaky
            flaky.discard(order_id)
        time.sleep(_PROVIDER_LATENCY)
        if fail:
            return JSONResponse({"error": "payment provider unavailable, try again"}, status_code=503)
        with session_factory() as session, session.begin():
            effect = DemoSideEffect(
                scheme=scheme, order_id=order_id, action="pay", request_id=key, worker=worker
            )
            session.add(effect)
            session.flush()
            payment_id = effect.id
        return JSONResponse(
            {"payment_id": payment_id, "order_id": order_id, "amount": amount},
            status_code=201,
            headers={"Location": f"/payments/{payment_id}"},
        )

    async def create_payment(request: HttpRequest) -> Response:
        body = await request.json()
        key = request.headers["idempotency-key"]
        worker = request.headers.get("x-demo-worker", "?")
        return await run_in_threadpool(charge, int(body["order_id"]), int(body["amount"]), key, worker)

    app = Starlette(routes=[Route("/payments", create_payment, methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware,
        session_factory=session_factory,
        required_paths=["/payments"],
        scope=key_scope,
    )

    def client(portal: BlockingPortal, *, other_amount: bool) -> Sender:
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
                    raise TimeoutError(f"still HTTP {answer.status} after {_CLIENT_PATIENCE:.0f}s of retries")
                delivery.retried += 1
                delivery.counts["409 in progress" if answer.status == 409 else "503 released"] += 1
                # A real client waits Retry-After seconds (or backs off); the demo a few milliseconds.
                time.sleep(random.uniform(0.002, 0.01))
            if answer.status == 422:
                return Outcome.REJECTED
            if answer.status != 201:
                raise RuntimeError(f"HTTP {answer.status}: {answer.body[:120].decode('utf-8', 'replace')}")
            payment_id = int(json.loads(answer.body)["payment_id"])
            with lock:
                seen.setdefault(order_id, set()).add(payment_id)
            replayed = answer.headers.get("idempotency-replayed") == "true"
            return Outcome.REPEATED if replayed else Outcome.APPLIED

        return send

    with start_blocking_portal() as portal:
        plan = run.plan([[[Request(order_id, "pay")] for order_id in ids]])
        tally = run.storm(plan, client(portal, other_amount=False))
        # Every key is completed now: a buggy client reuses some for another amount.
        reuse = [[Request(order_id, "pay")] for order_id in reused]
        run.storm(reuse, client(portal, other_amount=True), tally=tally)

    with run.engine.connect() as conn:
        per_order = {
            int(order_id): int(n)
            for order_id, n in conn.execute(
                select(DemoSideEffect.order_id, func.count())
                .where(DemoSideEffect.scheme == scheme)
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
        problems.append(f"{refused} of {len(reused)} keys reused for another amount were refused with 422")
    run.notes.append(
        f"{scheme}: executions per key: min {min(executions)}, max {max(executions)} over {len(ids)} keys "
        f"(must be exactly 1)"
    )
    run.notes.append(f"{scheme}: APPLIED = the handler ran, REPEATED = the stored response replayed,")
    run.notes.append(
        f"{scheme}: REJECTED = 422 (a key reused for another amount), retried = 409 and 503 answers resent"
    )
    row = run.row(scheme, "Starlette + IdempotencyMiddleware, POST /payments with Idempotency-Key", tally,
                  problems=problems)  # fmt: skip
    return [row]


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
    from ..idempotency import idempotent
    from ..inserts import consume_once
    from ..outbox import CallableSink, OutboxEvent, Relay, emit
    from ..tables import consumed_messages, outbox

    scheme = "outbox pipeline"
    token = uuid.uuid4().hex[:8]
    key_scope = f"{PIPELINE_SCOPE}{token}"
    consumer = f"{PIPELINE_SCOPE}warehouse-{token}"
    create_tables(run.engine)
    with run.engine.begin() as conn:
        # Earlier runs' leftovers: unpublished demo events would be published (and counted) again.
        conn.execute(delete(outbox).where(outbox.c.topic.in_(PIPELINE_TOPICS)))
        conn.execute(delete(idempotency_keys).where(idempotency_keys.c.scope.startswith(PIPELINE_SCOPE)))
        conn.execute(delete(consumed_messages).where(consumed_messages.c.consumer.startswith(PIPELINE_SCOPE)))
    ids = run.create_orders(run.orders)

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
        from ..redis import RedisStreamSink

        stream_sink = RedisStreamSink(run.redis, stream=stream)
        run.notes.append(f"{scheme}: the broker is the Redis stream {stream!r} (deleted after the run)")
    else:
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
                result = consume_once(session, consumer, str(event.id))
                if result.applied:
                    payload = event.payload
                    request = Request(int(payload["order"]), str(payload["trigger"]))
                    run.side_effect(session, scheme, request, f"c{event.id % _PARTITIONS}")
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
        # Everyone pays; most orders are shipped later (the relays publish meanwhile).
        waves = [
            [[Request(i, "pay")] for i in ids],
            [[Request(i, "ship")] for i in ids if run.rng.random() < 0.7],
        ]
        tally = run.fire(run.plan(waves), request)
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
    if counts["deduplicated"] != extra:
        problems.append(
            f"consume_once said REPEATED {counts['deduplicated']} times for {extra} extra deliveries"
        )
    with run.engine.connect() as conn:
        effects = conn.execute(
            select(DemoSideEffect.order_id, DemoSideEffect.action)
            .where(DemoSideEffect.scheme == scheme)
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
    run.notes.append(
        f"{scheme}: published = events the broker got, redelivered = events it got more than once "
        f"(every {_LOST_ACK_EVERY}th acknowledgement lost),"
    )
    run.notes.append(
        f"{scheme}: deduplicated = deliveries consume_once answered REPEATED; "
        "side effects must equal APPLIED transitions"
    )
    how = "idempotent() -> transition + emit() -> 2 relays -> broker -> 3 consumers with consume_once"
    return [run.row(scheme, how, tally, problems=problems)]


# --------------------------------------------------------------------------
# Running and rendering
# --------------------------------------------------------------------------


def run_demo(
    engine: Engine,
    *,
    workers: int = 8,
    orders: int = 200,
    seed: int | None = None,
    progress: Progress | None = None,
    scenarios: Sequence[Scenario] | None = None,
    redis: Any = None,
) -> DemoReport:
    """Drop and create the ``sg_demo_*`` tables on ``engine`` and run every scenario.

    ::

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
    run = DemoRun(engine, workers, orders, random.Random(seed), progress, redis=redis)
    rows: list[SchemeRow] = []
    for i, sc in enumerate(chosen, 1):
        progress.begin(i, len(chosen), sc.title)
        new = sc.fn(run)
        progress.end(new)
        rows.extend(new)
    return DemoReport(
        rows=rows,
        seed=seed,
        workers=workers,
        orders=orders,
        url=engine.url.render_as_string(hide_password=True),
        elapsed=time.monotonic() - started,
        notes=run.notes,
    )


_GREEN = "\x1b[32m"
_RED = "\x1b[1;31m"
_BOLD = "\x1b[1m"
_DIM = "\x1b[2m"
_RESET = "\x1b[0m"

_COLUMNS = (
    "scheme",
    "attempts",
    "APPLIED",
    "REPEATED",
    "REJECTED",
    "retried",
    "side effects",
    "invariant",
    "how",
)


def render(report: DemoReport, *, color: bool = False) -> str:
    """The result table as text (ANSI colours only when ``color``)::

    print(render(run_demo(engine), color=sys.stdout.isatty()))
    """

    def paint(text: str, code: str) -> str:
        return f"{code}{text}{_RESET}" if color else text

    cells: list[tuple[str, ...]] = [
        (
            row.scheme,
            str(row.attempts),
            str(row.applied),
            str(row.repeated),
            str(row.rejected),
            str(row.retried),
            str(row.side_effects),
            "ok" if row.ok else "VIOLATED",
            row.how,
        )
        for row in report.rows
    ]
    widths = [max(len(c[i]) for c in [_COLUMNS, *cells]) for i in range(len(_COLUMNS))]

    def line(values: Sequence[str], verdict_code: str | None = None) -> str:
        # scheme left, counts right, verdict and "how" left; the long "how"
        # goes last so it never pushes the numbers apart.
        parts = [values[0].ljust(widths[0])]
        parts.extend(v.rjust(w) for v, w in zip(values[1:-2], widths[1:-2], strict=True))
        verdict = values[-2].ljust(widths[-2])
        parts.append(paint(verdict, verdict_code) if verdict_code else verdict)
        parts.append(values[-1])
        return "  ".join(parts).rstrip()

    out = [
        paint(
            f"stateguard demo: {report.orders} orders per scheme, {report.workers} workers, "
            f"seed {report.seed}, on {report.url}",
            _BOLD,
        ),
        "each request is sent 2-4 times: twins at the same instant, redeliveries later;",
        "only an APPLIED call records its side effect (in the same transaction)",
        "",
        paint(line(_COLUMNS), _BOLD),
    ]
    out.extend(
        line(values, (_GREEN if row.ok else _RED) if color else None)
        for row, values in zip(report.rows, cells, strict=True)
    )
    out.append("")
    for row in report.rows:
        if row.other:
            extra = ", ".join(f"{k} {v}" for k, v in sorted(row.other.items()))
            out.append(f"{row.scheme}: also {extra}")
    out.extend(report.notes)
    for row in report.rows:
        out.extend(paint(p, _RED) for p in row.problems)
    verdict = (
        "invariant held: side effects == APPLIED, at most one per (order, trigger)"
        if report.ok
        else "INVARIANT VIOLATED: see the problems above"
    )
    out.append(paint(verdict, _GREEN if report.ok else _RED))
    out.append(
        paint(
            f"finished in {report.elapsed:.1f}s; the sg_demo_* tables are kept for inspection",
            _DIM,
        )
    )
    return "\n".join(out)
