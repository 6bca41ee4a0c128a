"""Benchmark scenarios.  Each compares stateguard with the alternatives in the SAME run,
on the same database, and returns a :class:`~bench.models.Table`."""

from __future__ import annotations

import gc
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, bindparam, func, select, update
from sqlalchemy.orm import Session

from stateguard import decrement

from .models import (
    BareOrder,
    Effect,
    GuardedOrder,
    PlainOrder,
    Purchase,
    RacyOrder,
    Stock,
    Table,
    counting,
    drop,
    fill,
    make_engine,
    median,
    pct,
    reset,
    scale_model,
    worker_processes,
)


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _raw_conn(engine: Engine) -> tuple[Any, str]:
    """A raw DB-API connection and the conditional UPDATE in its paramstyle."""
    name = engine.dialect.name
    url = engine.url
    t = PlainOrder.__tablename__
    sql = f"UPDATE {t} SET status = 'paid', version = version + 1 WHERE id = %s AND status IN ('pending')"
    if name == "postgresql":
        import psycopg

        conn = psycopg.connect(
            host=url.host,
            port=url.port,
            user=url.username,
            password=url.password,
            dbname=url.database,
            options=url.query.get("options") or "",
        )
        return conn, sql + " RETURNING version"
    if name in ("mysql", "mariadb"):
        import pymysql
        from pymysql.constants import CLIENT

        # FOUND_ROWS: the same matched-rows count SQLAlchemy's dialect asks for.
        conn = pymysql.connect(
            host=url.host,
            port=url.port or 3306,
            user=url.username,
            password=url.password or "",
            database=url.database,
            client_flag=CLIENT.FOUND_ROWS,
        )
        return conn, sql
    import sqlite3

    conn = sqlite3.connect(url.database or "", timeout=60)
    return conn, sql.replace("%s", "?") + " RETURNING version"


# ---------------------------------------------------------------------------
# 1. single transition, no contention
# ---------------------------------------------------------------------------


#: A transition costs no more than the same UPDATE written by hand on a Session (PostgreSQL's target;
#: the other databases are reported against it too).
SINGLE_TARGET = 1.00


def single_transition(url: str, n: int) -> Table:
    """Each variant pays ``n`` fresh 'pending' rows of its own, one call per transaction."""
    engine = make_engine(url)
    reset(engine, GuardedOrder, PlainOrder, BareOrder)
    names = [
        "stateguard",
        "hand-written Core",
        "Core, status = 'pending'",
        "ORM load-check-save",
        "ORM + version_id_col",
        "raw driver",
        "Core, table without CHECK",
    ]
    # Every variant pays its own fresh rows (its own id range of the plain
    # table, or its own table).
    base = {name: k * n for k, name in enumerate(names)}
    base["stateguard"] = base["Core, table without CHECK"] = 0
    with Session(engine) as s, s.begin():
        s.add_all([GuardedOrder(id=i) for i in range(1, n + 1)])
        s.add_all([PlainOrder(id=base[name] + i) for name in names[1:-1] for i in range(1, n + 1)])
        s.add_all([BareOrder(id=i) for i in range(1, n + 1)])
    plain = PlainOrder.__table__
    returning = engine.dialect.name not in ("mysql", "mariadb")
    # The statement stateguard sends, written by hand and built once.
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
    # What one would write by hand for a single source state.
    eq_stmt = (
        update(plain)
        .where(plain.c.id == bindparam("pk"), plain.c.status == "pending")
        .values(status="paid", version=plain.c.version + 1)
    )
    if returning:
        core_stmt = core_stmt.returning(plain.c.version)
        bare_stmt = bare_stmt.returning(bare.c.version)
        eq_stmt = eq_stmt.returning(plain.c.version)
    raw, raw_sql = _raw_conn(engine)

    def stateguard_call(i: int) -> None:
        with Session(engine) as s, s.begin():
            if not GuardedOrder.flow.pay(s, i).applied:
                raise AssertionError("not applied")

    def core_call(i: int, stmt: Any = core_stmt) -> None:
        with Session(engine) as s, s.begin():
            result = s.connection().execute(stmt, {"pk": i})
            ok = result.first() is not None if returning else result.rowcount == 1
            if not ok:
                raise AssertionError("not applied")

    def orm_call(i: int, model: Any = RacyOrder) -> None:
        # The usual code: load, check in Python, set, commit (RacyOrder: no
        # version check, PlainOrder: SQLAlchemy's version_id_col on flush).
        with Session(engine) as s, s.begin():
            order = s.get(model, i)
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

    calls: dict[str, Callable[[int], None]] = {
        "stateguard": stateguard_call,
        "hand-written Core": core_call,
        "Core, status = 'pending'": lambda i: core_call(i, eq_stmt),
        "ORM load-check-save": orm_call,
        "ORM + version_id_col": lambda i: orm_call(i, PlainOrder),
        "raw driver": raw_call,
        "Core, table without CHECK": lambda i: core_call(i, bare_stmt),
    }
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    stmts: dict[str, int] = dict.fromkeys(names, 0)
    rnd = random.Random(n)
    try:
        with counting(engine) as box:
            for i in range(1, n + 1):
                # Interleaved: call i of every variant runs back to back, in a
                # fresh random order per round, so drift (autovacuum,
                # checkpoints, other load) hits all alike and no variant always
                # runs right after the same neighbour.
                order = list(names)
                rnd.shuffle(order)
                for name in order:
                    before = box[0]
                    c0 = time.process_time()
                    t0 = time.perf_counter()
                    calls[name](base[name] + i)
                    wall[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.process_time() - c0)
                    stmts[name] += box[0] - before
    finally:
        raw.close()
        drop(engine)
        engine.dispose()
    med = {k: median(v) for k, v in wall.items()}
    cpu_med = {k: median(v) for k, v in cpu.items()}
    table = Table(
        f"1. single transition, no contention ({engine.dialect.name}, {n} calls per variant, interleaved)"
    )
    for name in names:
        table.rows.append(
            {
                "variant": name,
                "median_us": round(med[name] * 1e6, 1),
                "p99_us": round(pct(wall[name], 0.99) * 1e6, 1),
                "client_cpu_us": round(cpu_med[name] * 1e6, 1),
                "stmts_per_call": "n/a (raw)" if name == "raw driver" else round(stmts[name] / n, 2),
                "x_core": round(med[name] / med["hand-written Core"], 3),
                "x_raw": round(med[name] / med["raw driver"], 3),
            }
        )
    x_core = med["stateguard"] / med["hand-written Core"]
    x_orm = med["ORM load-check-save"] / med["stateguard"]
    x_cpu = cpu_med["stateguard"] / cpu_med["hand-written Core"]
    table.notes += [
        f"target stateguard <= {SINGLE_TARGET:.2f}x hand-written Core, a Session UPDATE (median latency): "
        f"{x_core:.3f}x, {_verdict(x_core <= SINGLE_TARGET)}",
        f"target ORM load-check-save >= 2x stateguard (median latency): {x_orm:.2f}x, {_verdict(x_orm >= 2)}",
        f"client CPU per call (median process_time), stateguard / Core: {x_cpu:.3f}x",
        "statements counted by SQLAlchemy's before_cursor_execute (BEGIN/COMMIT are not statements)",
        "every variant but the last updates a table with the states CHECK constraint stateguard adds "
        "by default; the last row shows what that constraint costs",
        "hand-written Core is stateguard's statement (status IN ('pending'): an expanding IN, rendered "
        "again at every execution); \"Core, status = 'pending'\" is the same UPDATE with a plain equality",
    ]
    return table


# ---------------------------------------------------------------------------
# 2. contention
# ---------------------------------------------------------------------------


def _pay_stateguard(s: Session, k: int) -> bool:
    return GuardedOrder.flow.pay(s, k).applied


def _pay_load_check_save(s: Session, k: int, model: Any = RacyOrder) -> bool:
    # django-fsm-style code: load, check in Python, set, commit.
    order = s.get(model, k)
    if order is None or order.status != "pending":
        return False
    order.status = "paid"
    return True


def _pay_versioned(s: Session, k: int) -> bool:
    return _pay_load_check_save(s, k, PlainOrder)


PAYERS: dict[str, Callable[[Session, int], bool]] = {
    "stateguard": _pay_stateguard,
    "naive ORM load-check-save": _pay_load_check_save,
    "ORM + version_id_col": _pay_versioned,
}


def _pay_all(engine: Engine, barrier: Any, variant: str, keys: list[int]) -> dict[str, Any]:
    """Fire ``pay`` at every key; the side effect is written in the same transaction."""
    pay = PAYERS[variant]
    counts = {"applied": 0, "repeated": 0, "errors": 0}
    kinds: set[str] = set()
    # Connect before the clock starts: each worker holds one pooled connection
    # through the barrier, so no worker pays a connection setup in the race.
    warm = engine.connect()
    barrier.wait(timeout=300)
    warm.close()
    start = time.monotonic()
    for k in keys:
        try:
            with Session(engine) as s, s.begin():
                applied = pay(s, k)
                if applied:
                    s.add(Effect(order_id=k))
            counts["applied" if applied else "repeated"] += 1
        except Exception as error:
            counts["errors"] += 1
            kinds.add(type(error).__name__)
    return {"counts": counts, "kinds": sorted(kinds), "start": start, "end": time.monotonic()}


#: A worker: (engine, barrier, *args) -> {"counts": ..., "kinds": ..., "start": ..., "end": ...}.
Job = Callable[..., dict[str, Any]]


def _job_in_process(url: str, job: Job, args: tuple[Any, ...], barrier: Any, queue: Any) -> None:
    engine = make_engine(url, pool_size=1)
    try:
        queue.put(job(engine, barrier, *args))
    except BaseException as error:
        queue.put({"failed": repr(error)})
        raise
    finally:
        engine.dispose()


def _run_workers(
    url: str, engine: Engine, mode: str, job: Job, args: list[tuple[Any, ...]]
) -> dict[str, Any]:
    """Run one ``job`` per entry of ``args`` in threads or processes, all started by one barrier.

    Returns the summed counts, the error kinds and the elapsed time from the
    barrier to the last worker's end.
    """
    results: list[dict[str, Any]] = []
    if mode == "threads":
        barrier = threading.Barrier(len(args))
        lock = threading.Lock()

        def work(a: tuple[Any, ...]) -> None:
            out = job(engine, barrier, *a)
            with lock:
                results.append(out)

        threads = [threading.Thread(target=work, args=(a,)) for a in args]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        ctx = worker_processes()
        pbarrier = ctx.Barrier(len(args))
        queue = ctx.Queue()
        procs = [ctx.Process(target=_job_in_process, args=(url, job, a, pbarrier, queue)) for a in args]
        for p in procs:
            p.start()
        results = [queue.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        failed = [r["failed"] for r in results if "failed" in r]
        if failed:
            raise RuntimeError(f"worker process failed: {failed[0]}")
    counts: dict[str, int] = {}
    kinds: set[str] = set()
    for r in results:
        for k, v in r["counts"].items():
            counts[k] = counts.get(k, 0) + v
        kinds.update(r["kinds"])
    elapsed = max(r["end"] for r in results) - min(r["start"] for r in results)
    latencies = [x for r in results for x in r.get("latencies", ())]
    return {"counts": counts, "kinds": kinds, "elapsed": elapsed, "latencies": latencies}


def contention(
    url: str, orders: int, workers: int, modes: tuple[str, ...] = ("threads", "processes")
) -> Table:
    """``workers`` workers each fire ``pay`` at every one of ``orders`` orders, in random order."""
    engine = make_engine(url, pool_size=workers + 2)
    table = Table(
        f"2. contention ({engine.dialect.name}): {orders} orders, {workers} workers each paying every order"
    )
    kinds: dict[str, set[str]] = {}
    try:
        for mode in modes:
            for variant in PAYERS:
                reset(engine, GuardedOrder, PlainOrder, Effect)
                with Session(engine) as s, s.begin():
                    s.add_all([GuardedOrder(id=i) for i in range(1, orders + 1)])
                    s.add_all([PlainOrder(id=i) for i in range(1, orders + 1)])
                keysets = []
                for w in range(workers):
                    keys = list(range(1, orders + 1))
                    random.Random(w).shuffle(keys)
                    keysets.append(keys)
                out = _run_workers(url, engine, mode, _pay_all, [(variant, keys) for keys in keysets])
                elapsed, total = out["elapsed"], out["counts"]
                kinds.setdefault(variant, set()).update(out["kinds"])
                with Session(engine) as s:
                    effects = s.scalar(select(func.count()).select_from(Effect)) or 0
                    distinct = s.scalar(select(func.count(func.distinct(Effect.order_id)))) or 0
                table.rows.append(
                    {
                        "variant": variant,
                        "workers": f"{workers} {mode}",
                        "calls_per_s": round(orders * workers / elapsed),
                        "applied": total["applied"],
                        "repeated": total["repeated"],
                        "double_applications": effects - distinct,
                        "errors": total["errors"],
                    }
                )
    finally:
        drop(engine)
        engine.dispose()
    for variant, found in kinds.items():
        if found:
            table.notes.append(f"{variant} errors: {', '.join(sorted(found))}")
    table.notes.append(
        "double_applications: side-effect rows (written in the paying transaction) beyond one per order"
    )
    return table


# ---------------------------------------------------------------------------
# 3. flash sale on one hot row
# ---------------------------------------------------------------------------

_stock = Stock.__table__


def _buy_stateguard(s: Session) -> str:
    return "ok" if decrement(s, Stock.amount, 1, by=1).applied else "sold out"


def _buy_conditional(s: Session) -> str:
    r = s.connection().execute(
        update(_stock).where(_stock.c.id == 1, _stock.c.amount >= 1).values(amount=_stock.c.amount - 1)
    )
    return "ok" if r.rowcount == 1 else "sold out"


def _buy_for_update(s: Session) -> str:
    row = s.execute(select(Stock).where(Stock.id == 1).with_for_update()).scalar_one()
    if row.amount < 1:
        return "sold out"
    row.amount -= 1
    return "ok"


def _buy_version_retry(s: Session) -> str:
    for _ in range(5):
        amount, version = s.execute(select(Stock.amount, Stock.version).where(Stock.id == 1)).one()
        if amount < 1:
            return "sold out"
        r = s.connection().execute(
            update(_stock)
            .where(_stock.c.id == 1, _stock.c.version == version)
            .values(amount=amount - 1, version=version + 1)
        )
        if r.rowcount == 1:
            return "ok"
        # A fresh transaction for the next attempt: at REPEATABLE READ
        # (MariaDB) the same snapshot would show the same old version forever.
        s.rollback()
        s.begin()
    return "gave up"


def _buy_naive(s: Session) -> str:
    amount = s.scalar(select(Stock.amount).where(Stock.id == 1))
    if amount is None or amount < 1:
        return "sold out"
    s.connection().execute(update(_stock).where(_stock.c.id == 1).values(amount=amount - 1))
    return "ok"


#: One purchase of one unit inside an open transaction: "ok", "sold out" or "gave up".
#: Adding a variant is adding a function here.
BUYERS: dict[str, Callable[[Session], str]] = {
    "stateguard decrement": _buy_stateguard,
    "conditional UPDATE (hand-written)": _buy_conditional,
    "SELECT ... FOR UPDATE": _buy_for_update,
    "optimistic version retry (5)": _buy_version_retry,
    "naive ORM read-check-write": _buy_naive,
}


def _buy_all(engine: Engine, barrier: Any, variant: str, buyer: int, purchases: int) -> dict[str, Any]:
    """``purchases`` attempts to buy one unit, each in its own transaction."""
    buy = BUYERS[variant]
    counts = {"ok": 0, "sold out": 0, "gave up": 0, "errors": 0}
    kinds: set[str] = set()
    # Connect before the clock starts: each worker holds one pooled connection
    # through the barrier, so no worker pays a connection setup in the race.
    warm = engine.connect()
    barrier.wait(timeout=300)
    warm.close()
    start = time.monotonic()
    for _ in range(purchases):
        try:
            with Session(engine) as s:
                s.begin()
                outcome = buy(s)
                if outcome == "ok":
                    s.add(Purchase(stock_id=1, buyer=f"b{buyer}"))
                s.commit()
        except Exception as error:
            outcome = "errors"
            kinds.add(type(error).__name__)
        counts[outcome] += 1
    return {"counts": counts, "kinds": sorted(kinds), "start": start, "end": time.monotonic()}


def flash_sale(
    url: str,
    stock: int,
    buyers: int,
    per_buyer: int,
    rounds: int = 3,
    modes: tuple[str, ...] = ("threads", "processes"),
) -> Table:
    """``buyers`` workers each try ``per_buyer`` purchases of one unit from one row of ``stock``.

    With threads, ``rounds`` rounds run every variant once in a fresh random
    order, and the median throughput is reported (one sale takes about a
    second: a single one is at the mercy of whatever else the machine does);
    processes run one round (spawning costs more than the sale).
    """
    engine = make_engine(url, pool_size=buyers + 2)
    table = Table(
        f"3. flash sale ({engine.dialect.name}): stock {stock}, {buyers} workers x {per_buyer} purchases "
        f"of 1; {rounds} rounds with threads (median throughput, summed counts), 1 with processes"
    )
    kinds: dict[str, set[str]] = {}
    rnd = random.Random(stock)
    try:
        for mode in modes:
            n_rounds = rounds if mode == "threads" else 1
            rates: dict[str, list[float]] = {name: [] for name in BUYERS}
            rows: dict[str, dict[str, Any]] = {}
            for _ in range(n_rounds):
                order = list(BUYERS)
                rnd.shuffle(order)
                for name in order:
                    reset(engine, Stock, Purchase)
                    with Session(engine) as s, s.begin():
                        s.add(Stock(id=1, amount=stock, version=0))
                    out = _run_workers(
                        url, engine, mode, _buy_all, [(name, b, per_buyer) for b in range(buyers)]
                    )
                    kinds.setdefault(name, set()).update(out["kinds"])
                    with Session(engine) as s:
                        left = s.scalar(select(Stock.amount).where(Stock.id == 1)) or 0
                        sold = s.scalar(select(func.count()).select_from(Purchase)) or 0
                    rates[name].append(buyers * per_buyer / out["elapsed"])
                    row = rows.setdefault(
                        name,
                        dict.fromkeys(("sold", "oversell", "lost_updates", "gave_up", "errors"), 0),
                    )
                    row["sold"] += sold
                    row["oversell"] += max(0, sold - stock) + max(0, -left)
                    # Purchases recorded that never came off the stock, or the reverse.
                    row["lost_updates"] += abs(sold - (stock - left))
                    row["gave_up"] += out["counts"]["gave up"]
                    row["errors"] += out["counts"]["errors"]
            for name in BUYERS:
                table.rows.append(
                    {
                        "variant": name,
                        "workers": f"{buyers} {mode}",
                        "attempts_per_s": round(median(rates[name])),
                        **rows[name],
                    }
                )
            guarded = rows["stateguard decrement"]
            x = median(rates["stateguard decrement"]) / median(rates["SELECT ... FOR UPDATE"])
            clean = guarded["oversell"] == guarded["gave_up"] == guarded["errors"] == 0 and guarded[
                "sold"
            ] == n_rounds * min(stock, buyers * per_buyer)
            table.notes.append(
                f"{mode}: target stateguard >= 2x FOR UPDATE throughput: {x:.2f}x, {_verdict(x >= 2)}; "
                f"0 oversell, 0 give-ups, all stock sold: {_verdict(clean)}"
            )
    finally:
        drop(engine)
        engine.dispose()
    for name, found in kinds.items():
        if found:
            table.notes.append(f"{name} errors: {', '.join(sorted(found))}")
    if engine.dialect.name == "sqlite":
        table.notes.append(
            "SQLite has no FOR UPDATE (SQLAlchemy drops it) and the driver BEGINs only at the first write, "
            "so on a plain engine that variant is the naive code; stateguard.sqlite_engine() "
            "(BEGIN IMMEDIATE) would serialize it"
        )
    return table


# ---------------------------------------------------------------------------
# 5. load cost, bulk, scale
# ---------------------------------------------------------------------------


def load_cost(url: str, n: int, repeat: int) -> Table:
    """Load ``n`` rows of the stateguard model vs the same model without stateguard."""
    engine = make_engine(url)
    reset(engine, GuardedOrder, PlainOrder)
    times: dict[str, list[float]] = {"stateguard model": [], "plain model": []}
    try:
        with Session(engine) as s, s.begin():
            s.add_all([GuardedOrder(id=i) for i in range(1, n + 1)])
            s.add_all([PlainOrder(id=i) for i in range(1, n + 1)])
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
                    if len(loaded) != n:
                        raise AssertionError(f"loaded {len(loaded)} of {n}")
    finally:
        drop(engine)
        engine.dispose()
    plain_med, plain_min = median(times["plain model"]), min(times["plain model"])
    table = Table(f"5a. loading {n} rows ({engine.dialect.name}), {repeat} loads each, alternating")
    for name, ts in times.items():
        table.rows.append(
            {
                "variant": name,
                "median_ms": round(median(ts) * 1e3, 2),
                "min_ms": round(min(ts) * 1e3, 2),
                "x_plain_median": round(median(ts) / plain_med, 3),
                "x_plain_min": round(min(ts) / plain_min, 3),
            }
        )
    x = median(times["stateguard model"]) / plain_med
    table.notes.append(f"target stateguard model <= 1.10x plain (median): {x:.3f}x, {_verdict(x <= 1.10)}")
    return table


def bulk(url: str, n: int) -> Table:
    """``pay.many()`` over ``n`` rows vs ``n`` single calls."""
    engine = make_engine(url)
    reset(engine, GuardedOrder)
    try:
        with Session(engine) as s, s.begin():
            s.add_all([GuardedOrder(id=i) for i in range(1, 2 * n + 1)])
        t0 = time.perf_counter()
        with Session(engine) as s, s.begin():
            results = GuardedOrder.flow.pay.many(s, range(1, n + 1))
        many_s = time.perf_counter() - t0
        if sum(r.applied for r in results.values()) != n:
            raise AssertionError("many() did not apply to every row")
        t0 = time.perf_counter()
        for i in range(n + 1, 2 * n + 1):
            with Session(engine) as s, s.begin():
                GuardedOrder.flow.pay(s, i)
        single_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        with Session(engine) as s, s.begin():
            for i in range(n + 1, 2 * n + 1):
                GuardedOrder.flow.ship(s, i)
        single_one_tx = time.perf_counter() - t0
    finally:
        drop(engine)
        engine.dispose()
    table = Table(f"5b. bulk ({engine.dialect.name}): {n} rows")
    table.rows = [
        {"variant": "many(), one transaction", "seconds": round(many_s, 3), "x_many": 1.0},
        {
            "variant": "single calls, one transaction each",
            "seconds": round(single_s, 3),
            "x_many": round(single_s / many_s, 1),
        },
        {
            "variant": "single calls, all in one transaction",
            "seconds": round(single_one_tx, 3),
            "x_many": round(single_one_tx / many_s, 1),
        },
    ]
    return table


def scale(url: str, sizes: list[int], calls: int) -> Table:
    """Transition latency on tables of different sizes, the sizes interleaved call by call."""
    engine = make_engine(url)
    models = {size: scale_model(size) for size in sizes}
    reset(engine, *models.values())
    wall: dict[int, list[float]] = {size: [] for size in sizes}
    try:
        for size, model in models.items():
            fill(engine, model.__tablename__, size)
        rnd = random.Random(calls)
        keys = {size: rnd.sample(range(1, size + 1), calls) for size in sizes}
        for i in range(calls):
            order = list(sizes)
            rnd.shuffle(order)
            for size in order:
                model = models[size]
                t0 = time.perf_counter()
                with Session(engine) as s, s.begin():
                    if not model.flow.pay(s, keys[size][i]).applied:
                        raise AssertionError("not applied")
                wall[size].append(time.perf_counter() - t0)
    finally:
        drop(engine)
        engine.dispose()
    smallest = median(wall[sizes[0]])
    table = Table(
        f"5c. transition latency vs table size ({engine.dialect.name}), {calls} calls each, interleaved"
    )
    for size in sizes:
        table.rows.append(
            {
                "rows_in_table": size,
                "median_us": round(median(wall[size]) * 1e6, 1),
                "p99_us": round(pct(wall[size], 0.99) * 1e6, 1),
                "x_smallest": round(median(wall[size]) / smallest, 3),
            }
        )
    return table
