"""Benchmark scenarios.  Each compares stateguard with the alternatives in the SAME run,
on the same database, and returns rows of a table (dicts) plus notes."""

from __future__ import annotations

import gc
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import (
    CheckConstraint,
    Engine,
    Integer,
    String,
    bindparam,
    create_engine,
    event,
    func,
    select,
    update,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import StateMachine, version_column

STATES = ["pending", "paid", "shipped", "cancelled"]
TRANSITIONS = [
    {"trigger": "pay", "source": "pending", "dest": "paid"},
    {"trigger": "ship", "source": "paid", "dest": "shipped"},
    {"trigger": "cancel", "source": ["pending", "paid"], "dest": "cancelled"},
]


class Base(DeclarativeBase):
    pass


class GuardedOrder(Base):
    """The stateguard model."""

    __tablename__ = "sg_bench_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    version: Mapped[int] = version_column()
    paid_at: Mapped[datetime | None]
    note: Mapped[str | None] = mapped_column(String(50))

    flow = StateMachine("status", states=STATES, transitions=TRANSITIONS)


class PlainOrder(Base):
    """The same table without stateguard (version_id_col set by hand).

    It carries the same CHECK constraint stateguard adds to GuardedOrder, so
    every variant pays the same database-side cost; the constraint's own cost
    is measured separately against BareOrder.
    """

    __tablename__ = "sg_bench_plain_orders"
    __table_args__ = (
        CheckConstraint(f"status IN ({', '.join(repr(x) for x in STATES)})", name="ck_plain_states"),
    )
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    version: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    paid_at: Mapped[datetime | None]
    note: Mapped[str | None] = mapped_column(String(50))

    __mapper_args__ = {"version_id_col": version}


class BareOrder(Base):
    """The same columns with no CHECK constraint at all."""

    __tablename__ = "sg_bench_bare_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    version: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    paid_at: Mapped[datetime | None]
    note: Mapped[str | None] = mapped_column(String(50))


class RacyOrder(Base):
    """The same table mapped without a version check (the usual load-check-save code)."""

    __table__ = PlainOrder.__table__


class Stock(Base):
    __tablename__ = "sg_bench_stock"
    id: Mapped[int] = mapped_column(primary_key=True)
    amount: Mapped[int] = mapped_column(Integer, nullable=False)
    version: Mapped[int] = mapped_column(Integer, nullable=False, default=0)


class Purchase(Base):
    __tablename__ = "sg_bench_purchases"
    id: Mapped[int] = mapped_column(primary_key=True)
    stock_id: Mapped[int] = mapped_column(Integer)
    buyer: Mapped[str] = mapped_column(String(40))


class Effect(Base):
    __tablename__ = "sg_bench_effects"
    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[int] = mapped_column(Integer)


@dataclass
class Table:
    title: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def make_engine(url: str, **kw: Any) -> Engine:
    kw.setdefault("pool_size", 16)
    if url.startswith("sqlite"):
        kw.setdefault("connect_args", {"timeout": 60})
    return create_engine(url, **kw)


def reset(engine: Engine) -> None:
    Base.metadata.drop_all(engine)
    Base.metadata.create_all(engine)


@contextmanager
def counting(engine: Engine) -> Iterator[list[int]]:
    box = [0]

    def on(*_: Any) -> None:
        box[0] += 1

    event.listen(engine, "before_cursor_execute", on)
    try:
        yield box
    finally:
        event.remove(engine, "before_cursor_execute", on)


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))]


def _raw_conn(engine: Engine) -> tuple[Any, str]:
    """A raw DB-API connection and the conditional UPDATE in its paramstyle."""
    name = engine.dialect.name
    t = "sg_bench_plain_orders"
    if name == "postgresql":
        import psycopg

        url = engine.url
        conn = psycopg.connect(
            host=url.host,
            port=url.port,
            user=url.username,
            dbname=url.database,
            options=url.query.get("options") or "",
        )
        sql = f"UPDATE {t} SET status = 'paid', version = version + 1 WHERE id = %s AND status IN ('pending')"
        return conn, sql + " RETURNING version"
    if name in ("mysql", "mariadb"):
        import pymysql
        from pymysql.constants import CLIENT

        url = engine.url
        conn = pymysql.connect(
            host=url.host,
            port=url.port or 3306,
            user=url.username,
            password=url.password or "",
            database=url.database,
            client_flag=CLIENT.FOUND_ROWS,
        )
        return (
            conn,
            f"UPDATE {t} SET status = 'paid', version = version + 1 WHERE id = %s AND status IN ('pending')",
        )
    import sqlite3

    conn = sqlite3.connect(engine.url.database or "", timeout=60)
    sql = f"UPDATE {t} SET status = 'paid', version = version + 1 WHERE id = ? AND status IN ('pending')"
    return conn, sql + " RETURNING version"


# ---------------------------------------------------------------------------
# 1. single transition, no contention
# ---------------------------------------------------------------------------


def single_transition(url: str, n: int) -> Table:
    engine = make_engine(url)
    reset(engine)
    names = [
        "stateguard",
        "hand-written Core",
        "ORM load-check-save",
        "ORM + version_id_col",
        "raw driver",
        "Core, table without CHECK",
    ]
    # Every variant pays its own fresh rows (its own id range), and the calls
    # are interleaved: call i of every variant runs back to back, in a random
    # order, so drift (autovacuum, checkpoints, other load) hits all alike.
    base = {name: k * n for k, name in enumerate(names)}
    with Session(engine) as s, s.begin():
        s.add_all([GuardedOrder(id=i) for i in range(1, n + 1)])
        s.add_all([PlainOrder(id=base[name] + i) for name in names[1:-1] for i in range(1, n + 1)])
        s.add_all([BareOrder(id=i) for i in range(1, n + 1)])
    base["Core, table without CHECK"] = 0
    plain = PlainOrder.__table__
    returning = engine.dialect.name not in ("mysql", "mariadb")
    core_stmt = (
        update(plain)
        .where(plain.c.id == bindparam("pk"), plain.c.status.in_(["pending"]))
        .values(status="paid", version=plain.c.version + 1)
    )
    bare = BareOrder.__table__
    bare_stmt = (
        update(bare)
        .where(bare.c.id == bindparam("pk"), bare.c.status.in_(["pending"]))
        .values(status="paid", version=bare.c.version + 1)
    )
    if returning:
        core_stmt = core_stmt.returning(plain.c.version)
        bare_stmt = bare_stmt.returning(bare.c.version)
    raw, raw_sql = _raw_conn(engine)

    def stateguard_call(i: int) -> None:
        with Session(engine) as s, s.begin():
            if not GuardedOrder.flow.pay(s, i).applied:
                raise AssertionError("not applied")

    def core_call(i: int) -> None:
        with Session(engine) as s, s.begin():
            result = s.connection().execute(core_stmt, {"pk": i})
            ok = result.first() is not None if returning else result.rowcount == 1
            if not ok:
                raise AssertionError("not applied")

    def bare_call(i: int) -> None:
        with Session(engine) as s, s.begin():
            result = s.connection().execute(bare_stmt, {"pk": i})
            ok = result.first() is not None if returning else result.rowcount == 1
            if not ok:
                raise AssertionError("not applied")

    def orm_call(i: int) -> None:
        # The usual racy code: load, check in Python, set, commit (no version check).
        with Session(engine) as s, s.begin():
            order = s.get(RacyOrder, i)
            if order is None or order.status != "pending":
                raise AssertionError("not pending")
            order.status = "paid"

    def orm_version_call(i: int) -> None:
        # The same with SQLAlchemy's version_id_col check on flush.
        with Session(engine) as s, s.begin():
            order = s.get(PlainOrder, i)
            if order is None or order.status != "pending":
                raise AssertionError("not pending")
            order.status = "paid"

    def raw_call(i: int) -> None:
        cur = raw.cursor()
        cur.execute(raw_sql, (i,))
        if returning:
            if cur.fetchone() is None:
                raise AssertionError("not applied")
        elif cur.rowcount != 1:
            raise AssertionError("not applied")
        raw.commit()

    calls: dict[str, Callable[[int], None]] = dict(
        zip(names, [stateguard_call, core_call, orm_call, orm_version_call, raw_call, bare_call], strict=True)
    )
    times: dict[str, list[float]] = {k: [] for k in names}
    stmts: dict[str, int] = dict.fromkeys(names, 0)
    box = [0]

    def on(*_: Any) -> None:
        box[0] += 1

    event.listen(engine, "before_cursor_execute", on)
    try:
        rnd = random.Random(n)
        for i in range(1, n + 1):
            # A fresh random order per round: a fixed rotation would always run
            # a variant right after the same neighbour (e.g. the raw driver's
            # COMMIT on its own connection) and charge it that neighbour's wake.
            order = list(names)
            rnd.shuffle(order)
            for name in order:
                before = box[0]
                t0 = time.perf_counter()
                calls[name](base[name] + i)
                times[name].append(time.perf_counter() - t0)
                stmts[name] += box[0] - before
    finally:
        event.remove(engine, "before_cursor_execute", on)
    raw.close()
    engine.dispose()
    core_med = statistics.median(times["hand-written Core"])
    raw_med = statistics.median(times["raw driver"])
    table = Table(
        f"1. single transition, no contention ({engine.dialect.name}, {n} calls per variant, interleaved)"
    )
    for name, ts in times.items():
        med = statistics.median(ts)
        table.rows.append(
            {
                "variant": name,
                "median_us": round(med * 1e6, 1),
                "p99_us": round(_pct(ts, 0.99) * 1e6, 1),
                "stmts_per_call": "n/a (raw)" if name == "raw driver" else round(stmts[name] / n, 2),
                "x_core": round(med / core_med, 3),
                "x_raw": round(med / raw_med, 3),
            }
        )
    table.notes.append(
        "statements counted by SQLAlchemy's before_cursor_execute (BEGIN/COMMIT are not statements)"
    )
    table.notes.append(
        "every variant but the last updates a table with the states CHECK constraint stateguard adds "
        "by default; the last row shows what that constraint costs"
    )
    return table


# ---------------------------------------------------------------------------
# 2. contention
# ---------------------------------------------------------------------------


def contention(url: str, orders: int, workers: int) -> Table:
    engine = make_engine(url, pool_size=workers + 2)
    table = Table(
        f"2. contention ({engine.dialect.name}): {orders} orders, {workers} threads paying every order"
    )
    for name in ("stateguard", "naive ORM"):
        reset(engine)
        with Session(engine) as s, s.begin():
            s.add_all([GuardedOrder(id=i) for i in range(1, orders + 1)])
        barrier = threading.Barrier(workers)
        counts = {"applied": 0, "repeated": 0, "errors": 0}
        lock = threading.Lock()

        def work(
            seed: int,
            name: str = name,
            barrier: threading.Barrier = barrier,
            counts: dict[str, int] = counts,
            lock: threading.Lock = lock,
        ) -> None:
            keys = list(range(1, orders + 1))
            random.Random(seed).shuffle(keys)
            barrier.wait()
            for k in keys:
                try:
                    with Session(engine) as s, s.begin():
                        if name == "stateguard":
                            applied = GuardedOrder.flow.pay(s, k).applied
                        else:
                            # django-fsm-style: load, check, save (no version check: the table's
                            # version column is not wired on this path because we UPDATE by hand).
                            status = s.scalar(select(GuardedOrder.status).where(GuardedOrder.id == k))
                            applied = status == "pending"
                            if applied:
                                s.execute(
                                    update(GuardedOrder.__table__)
                                    .where(GuardedOrder.__table__.c.id == k)
                                    .values(status="paid")
                                )
                        if applied:
                            s.add(Effect(order_id=k))
                    with lock:
                        counts["applied" if applied else "repeated"] += 1
                except Exception:
                    with lock:
                        counts["errors"] += 1

        threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        with Session(engine) as s:
            effects = s.scalar(select(func.count()).select_from(Effect)) or 0
            distinct = s.scalar(select(func.count(func.distinct(Effect.order_id)))) or 0
        table.rows.append(
            {
                "variant": name,
                "calls_per_s": round(orders * workers / elapsed),
                "applied": counts["applied"],
                "repeated": counts["repeated"],
                "double_applications": effects - distinct,
                "errors": counts["errors"],
            }
        )
    engine.dispose()
    return table


# ---------------------------------------------------------------------------
# 3. flash sale on one hot row
# ---------------------------------------------------------------------------


def flash_sale(url: str, stock: int, buyers: int, per_buyer: int) -> Table:
    engine = make_engine(url, pool_size=buyers + 2)
    stock_t = Stock.__table__
    table = Table(
        f"3. flash sale ({engine.dialect.name}): stock {stock}, {buyers} threads x {per_buyer} purchases of 1"
    )
    variants: dict[str, Callable[[Session, str], str]] = {}

    def conditional(s: Session, buyer: str) -> str:
        r = s.connection().execute(
            update(stock_t)
            .where(stock_t.c.id == 1, stock_t.c.amount >= 1)
            .values(amount=stock_t.c.amount - 1)
        )
        return "ok" if r.rowcount == 1 else "sold out"

    def for_update(s: Session, buyer: str) -> str:
        row = s.execute(select(Stock).where(Stock.id == 1).with_for_update()).scalar_one()
        if row.amount < 1:
            return "sold out"
        row.amount -= 1
        return "ok"

    def version_retry(s: Session, buyer: str) -> str:
        for _ in range(5):
            amount, version = s.execute(select(Stock.amount, Stock.version).where(Stock.id == 1)).one()
            if amount < 1:
                return "sold out"
            r = s.connection().execute(
                update(stock_t)
                .where(stock_t.c.id == 1, stock_t.c.version == version)
                .values(amount=amount - 1, version=version + 1)
            )
            if r.rowcount == 1:
                return "ok"
            s.rollback()
            s.begin()
        return "gave up"

    def naive(s: Session, buyer: str) -> str:
        amount = s.scalar(select(Stock.amount).where(Stock.id == 1))
        if amount is None or amount < 1:
            return "sold out"
        s.connection().execute(update(stock_t).where(stock_t.c.id == 1).values(amount=amount - 1))
        return "ok"

    variants = {
        "conditional UPDATE (hand-written)": conditional,
        "SELECT ... FOR UPDATE": for_update,
        "optimistic version retry (5)": version_retry,
        "naive ORM read-check-write": naive,
    }
    try:
        from stateguard import decrement  # type: ignore[attr-defined]

        def guarded(s: Session, buyer: str) -> str:
            r = decrement(s, Stock.amount, 1, by=1)
            return "ok" if r.applied else "sold out"

        variants = {"stateguard decrement": guarded, **variants}
    except ImportError:
        table.notes.append("stateguard.decrement is not available yet: its row is missing")
    for name, fn in variants.items():
        reset(engine)
        with Session(engine) as s, s.begin():
            s.add(Stock(id=1, amount=stock, version=0))
        barrier = threading.Barrier(buyers)
        counts = {"ok": 0, "sold out": 0, "gave up": 0, "errors": 0}
        lock = threading.Lock()

        def work(
            b: int,
            fn: Callable[[Session, str], str] = fn,
            barrier: threading.Barrier = barrier,
            counts: dict[str, int] = counts,
            lock: threading.Lock = lock,
        ) -> None:
            barrier.wait()
            for _ in range(per_buyer):
                try:
                    with Session(engine) as s:
                        s.begin()
                        outcome = fn(s, f"b{b}")
                        if outcome == "ok":
                            s.add(Purchase(stock_id=1, buyer=f"b{b}"))
                        s.commit()
                except Exception:
                    outcome = "errors"
                with lock:
                    counts[outcome] += 1

        threads = [threading.Thread(target=work, args=(i,)) for i in range(buyers)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        with Session(engine) as s:
            left = s.scalar(select(Stock.amount).where(Stock.id == 1)) or 0
            sold = s.scalar(select(func.count()).select_from(Purchase)) or 0
        table.rows.append(
            {
                "variant": name,
                "purchases_per_s": round(buyers * per_buyer / elapsed),
                "sold": sold,
                "oversell": max(0, sold - stock),
                "lost_updates": max(0, (stock - left) - sold) + max(0, sold - (stock - left)),
                "gave_up": counts["gave up"],
                "errors": counts["errors"],
            }
        )
    engine.dispose()
    return table


# ---------------------------------------------------------------------------
# 5. load cost, bulk
# ---------------------------------------------------------------------------


def load_cost(url: str, n: int, repeat: int) -> Table:
    engine = make_engine(url)
    reset(engine)
    with Session(engine) as s, s.begin():
        s.add_all([GuardedOrder(id=i) for i in range(1, n + 1)])
        s.add_all([PlainOrder(id=i) for i in range(1, n + 1)])
    times: dict[str, list[float]] = {"stateguard model": [], "plain model": []}
    for rnd in range(repeat):
        pairs = [("stateguard model", GuardedOrder), ("plain model", PlainOrder)]
        if rnd % 2:
            pairs.reverse()
        for name, model in pairs:
            with Session(engine) as s:
                # As timeit does: a collection triggered mid-load by earlier
                # garbage would be charged to whichever model loads then.
                gc.collect()
                gc.disable()
                try:
                    t0 = time.perf_counter()
                    loaded = s.scalars(select(model)).all()
                    times[name].append(time.perf_counter() - t0)
                finally:
                    gc.enable()
                assert len(loaded) == n
    engine.dispose()
    plain = statistics.median(times["plain model"])
    table = Table(f"5a. loading {n} rows ({engine.dialect.name}), median of {repeat}")
    for name, ts in times.items():
        table.rows.append(
            {
                "variant": name,
                "median_ms": round(statistics.median(ts) * 1e3, 2),
                "x_plain": round(statistics.median(ts) / plain, 3),
            }
        )
    return table


def bulk(url: str, n: int) -> Table:
    engine = make_engine(url)
    reset(engine)
    with Session(engine) as s, s.begin():
        s.add_all([GuardedOrder(id=i) for i in range(1, 2 * n + 1)])
    t0 = time.perf_counter()
    with Session(engine) as s, s.begin():
        results = GuardedOrder.flow.pay.many(s, range(1, n + 1))
    many_s = time.perf_counter() - t0
    assert sum(r.applied for r in results.values()) == n
    t0 = time.perf_counter()
    for i in range(n + 1, 2 * n + 1):
        with Session(engine) as s, s.begin():
            assert GuardedOrder.flow.pay(s, i).applied
    single_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with Session(engine) as s, s.begin():
        for i in range(n + 1, 2 * n + 1):
            GuardedOrder.flow.ship(s, i)
    single_one_tx = time.perf_counter() - t0
    engine.dispose()
    table = Table(f"5b. bulk ({engine.dialect.name}): {n} rows")
    table.rows = [
        {"variant": "many(), one transaction", "seconds": round(many_s, 3), "speedup_vs_many": 1.0},
        {
            "variant": "single calls, one transaction each",
            "seconds": round(single_s, 3),
            "speedup_vs_many": round(single_s / many_s, 1),
        },
        {
            "variant": "single calls, all in one transaction",
            "seconds": round(single_one_tx, 3),
            "speedup_vs_many": round(single_one_tx / many_s, 1),
        },
    ]
    return table


def scale(url: str, sizes: list[int], calls: int) -> Table:
    engine = make_engine(url)
    table = Table(f"5c. transition latency vs table size ({engine.dialect.name}), {calls} calls each")
    for size in sizes:
        reset(engine)
        with Session(engine) as s, s.begin():
            for start in range(1, size + 1, 10000):
                s.execute(
                    GuardedOrder.__table__.insert(),
                    [
                        {"id": i, "status": "pending", "version": 0}
                        for i in range(start, min(size, start + 9999) + 1)
                    ],
                )
        keys = random.Random(size).sample(range(1, size + 1), calls)
        ts = []
        for k in keys:
            t0 = time.perf_counter()
            with Session(engine) as s, s.begin():
                GuardedOrder.flow.pay(s, k)
            ts.append(time.perf_counter() - t0)
        table.rows.append(
            {
                "rows_in_table": size,
                "median_us": round(statistics.median(ts) * 1e6, 1),
                "p99_us": round(_pct(ts, 0.99) * 1e6, 1),
            }
        )
    engine.dispose()
    return table
