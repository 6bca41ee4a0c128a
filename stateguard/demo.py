"""``stateguard demo``: a storm of retried, redelivered and double-clicked requests.

The demo creates its own tables (``sg_demo_*``, dropped and recreated on every
run), then fires each logical request 2-4 times from many worker threads, the
way production traffic does: a client retries after a timeout while the first
call is still running (two workers released together by a barrier), a queue
redelivers a message later, a user double-clicks.  Every scheme records a
side-effect row only when its call was APPLIED, in the same transaction, and
the demo then counts them: the invariant is *side effects == APPLIED, and at
most one side effect per (order, trigger)*.

Each scheme is one scenario function registered with :func:`scenario`; it
returns rows of the result table.  Adding a scheme to the demo is appending
one function::

    @scenario("flash sale")
    def flash_sale(run: DemoRun) -> list[SchemeRow]:
        ids = run.create_orders(run.orders)

        def deliver(session: Session, request: Request, worker: str) -> Result:
            result = reserve(session, request.order_id)      # one guarded statement
            if result.applied:
                run.side_effect(session, "flash sale", request, worker)
            return result

        tally = run.fire(run.plan([[[Request(i, "reserve")] for i in ids]]), deliver)
        return [run.row("flash sale", "guarded counter", tally)]
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sqlalchemy import Engine, String, func, insert, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from .counters import decrement
from .inserts import insert_once
from .machine import StateMachine
from .result import Outcome, Result
from .retry import retry_on_conflict
from .tables import create_tables
from .versioning import guarded_update, version_column

__all__ = [
    "SCENARIOS",
    "DemoBase",
    "DemoInbox",
    "DemoOrder",
    "DemoReport",
    "DemoRun",
    "DemoSideEffect",
    "DemoStock",
    "Progress",
    "Request",
    "Scenario",
    "SchemeRow",
    "Tally",
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
    """What the deliveries of one scheme returned."""

    attempts: int = 0
    retried: int = 0
    outcomes: Counter[Outcome] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)


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

    @property
    def ok(self) -> bool:
        return all(row.ok for row in self.rows)


class Progress:
    """Receives progress events; this base class ignores them (the CLI draws them)."""

    def begin(self, index: int, count: int, title: str) -> None:
        """Scenario ``index`` (1-based) of ``count`` starts."""

    def total(self, deliveries: int) -> None:
        """The running scenario will make ``deliveries`` deliveries."""

    def advance(self) -> None:
        """One delivery finished (called from worker threads)."""

    def end(self, rows: Sequence[SchemeRow]) -> None:
        """The running scenario finished."""


# --------------------------------------------------------------------------
# The run: plans, workers, checks
# --------------------------------------------------------------------------

Deliver = Callable[[Session, Request, str], Result]
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

    def fire(self, plan: Sequence[Group], deliver: Deliver) -> Tally:
        """Run every delivery of ``plan`` on ``workers`` threads and count the outcomes.

        Each delivery is one unit of work in its own session and transaction,
        re-run by :func:`retry_on_conflict` when the database reports a
        conflict (``retried`` counts those re-runs).  Members of a group wait
        for each other at a barrier and are released together.
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
        tally = Tally()
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
                calls = 0

                def once(request: Request = request) -> Result:
                    nonlocal calls
                    calls += 1
                    with Session(self.engine) as session, session.begin():
                        return deliver(session, request, name)

                outcome: Outcome | None = None
                error: str | None = None
                try:
                    outcome = retry_on_conflict(once, attempts=10, backoff=0.005, max_backoff=0.2).outcome
                except Exception as exc:  # counted and reported, the storm goes on
                    error = f"{request.request_id}: {type(exc).__name__}: {_first_line(exc)}"
                with lock:
                    tally.attempts += 1
                    tally.retried += max(0, calls - 1)
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
    pays: list[Group] = []
    follow_ups: list[Group] = []
    for order_id in ids:
        pays.append([Request(order_id, "pay")])
        roll = run.rng.random()
        if roll < 0.15:
            # A customer cancels while the warehouse ships: only one may win.
            follow_ups.append([Request(order_id, "ship"), Request(order_id, "cancel")])
        elif roll < 0.35:
            follow_ups.append([Request(order_id, "cancel")])
        else:
            follow_ups.append([Request(order_id, "ship")])

    def deliver(session: Session, request: Request, worker: str) -> Result:
        values = {"paid_at": _now()} if request.action == "pay" else None
        result = DemoOrder.flow.fire(session, request.action, request.order_id, values=values)
        if result.applied:
            run.side_effect(session, scheme, request, worker)
        return result

    tally = run.fire(run.plan([pays, follow_ups]), deliver)
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
    first: list[Group] = []
    later: list[Group] = []
    for order_id in ids:
        roll = run.rng.random()
        if roll < 0.25:
            # Paying and cancelling exclude each other; both arrive at once.
            first.append([Request(order_id, "pay"), Request(order_id, "cancel")])
        else:
            first.append([Request(order_id, "pay")])
            if roll < 0.45:
                later.append([Request(order_id, "cancel")])
    columns = {"pay": ("paid_at", "cancelled_at"), "cancel": ("cancelled_at", "paid_at")}

    def deliver(session: Session, request: Request, worker: str) -> Result:
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
        result = guarded_update(session, DemoOrder, order, {done: _now()}, expected_version=order.version)
        if result.applied:
            run.side_effect(session, scheme, request, worker)
        return result

    tally = run.fire(run.plan([first, later]), deliver)
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

    def deliver(session: Session, request: Request, worker: str) -> Result:
        result = insert_once(session, DemoInbox, {"message_id": request.request_id})
        if result.applied:
            run.side_effect(session, scheme, request, worker)
        return result

    tally = run.fire(run.plan([paid, shipped]), deliver)
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

    def deliver(session: Session, request: Request, worker: str) -> Result:
        result = decrement(session, DemoStock.amount, 1, by=1, ref=f"demo-{token}-{request.request_id}")
        if result.applied:
            run.side_effect(session, scheme, request, worker)
        return result

    tally = run.fire(run.plan([purchases]), deliver)
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
) -> DemoReport:
    """Drop and create the ``sg_demo_*`` tables on ``engine`` and run every scenario.

    ::

        report = run_demo(sqlite_engine("sqlite:///demo.db"), orders=50)
        print(render(report))
        assert report.ok
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
    run = DemoRun(engine, workers, orders, random.Random(seed), progress)
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
