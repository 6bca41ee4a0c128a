"""The flash sale on one hot item, striped: ``python -m bench run --only striped``.

``buyers`` worker processes each make ``per_buyer`` purchases of one unit,
each in its own transaction that also records a purchase row (the work an
application does between taking the stock and COMMIT).  Four variants run
in the same run, interleaved (a fresh random order every round; the median
throughput of the rounds is reported):

- ``StripedCounter.decrement`` on one item of K stripes;
- stateguard's single-row conditional ``decrement`` (one hot row);
- ``SELECT ... FOR UPDATE`` then UPDATE (one hot row);
- the ceiling: the same single-row ``decrement``, each worker its own row,
  so no buyer ever waits for another's lock.

Stock is exactly the number of attempts, so every attempt should sell:
``sold`` must equal the stock, with 0 oversell and 0 give-ups.  A retryable
conflict (a deadlock victim) is retried, up to 20 times, and counted.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from stateguard import SerializationConflict, StripedCounter, create_tables, decrement, drop_tables

from .models import Purchase, Stock, Table, drop, make_engine, median, reset
from .scenarios import _run_workers

ITEM = "hot"


def _counter(stripes: int) -> StripedCounter:
    return StripedCounter("bench", stripes=stripes)


def _buy_striped(s: Session, buyer: int, stripes: int) -> bool:
    return _counter(stripes).decrement(s, ITEM, by=1).applied


def _buy_single(s: Session, buyer: int, stripes: int) -> bool:
    return decrement(s, Stock.amount, 1, by=1).applied


def _buy_for_update(s: Session, buyer: int, stripes: int) -> bool:
    row = s.execute(select(Stock).where(Stock.id == 1).with_for_update()).scalar_one()
    if row.amount < 1:
        return False
    row.amount -= 1
    s.flush()
    return True


def _buy_own_row(s: Session, buyer: int, stripes: int) -> bool:
    return decrement(s, Stock.amount, buyer + 1, by=1).applied


STRIPED = "striped decrement"
SINGLE = "single-row decrement"
FOR_UPDATE = "SELECT ... FOR UPDATE"
CEILING = "ceiling: own row per worker"

#: One purchase of one unit inside an open transaction: whether it sold.
BUYERS: dict[str, Callable[[Session, int, int], bool]] = {
    STRIPED: _buy_striped,
    SINGLE: _buy_single,
    FOR_UPDATE: _buy_for_update,
    CEILING: _buy_own_row,
}


def _buy_all(
    engine: Engine, barrier: Any, variant: str, buyer: int, purchases: int, stripes: int
) -> dict[str, Any]:
    """``purchases`` attempts to buy one unit, each in its own transaction (retrying conflicts)."""
    buy = BUYERS[variant]
    counts = {"ok": 0, "sold out": 0, "gave up": 0, "errors": 0, "retries": 0}
    kinds: set[str] = set()
    warm = engine.connect()
    barrier.wait(timeout=300)
    warm.close()
    start = time.monotonic()
    for _ in range(purchases):
        outcome = "gave up"
        for _attempt in range(20):
            try:
                with Session(engine) as s, s.begin():
                    sold = buy(s, buyer, stripes)
                    if sold:
                        s.add(Purchase(stock_id=1, buyer=f"b{buyer}"))
                outcome = "ok" if sold else "sold out"
                break
            except SerializationConflict as error:
                counts["retries"] += 1
                kinds.add(type(error).__name__)
            except Exception as error:
                outcome = "errors"
                kinds.add(type(error).__name__)
                break
        counts[outcome] += 1
    return {"counts": counts, "kinds": sorted(kinds), "start": start, "end": time.monotonic()}


def _left(engine: Engine, variant: str, stripes: int) -> int:
    with Session(engine) as s:
        if variant == STRIPED:
            return _counter(stripes).total(s, ITEM) or 0
        return int(s.scalar(select(func.coalesce(func.sum(Stock.amount), 0))) or 0)


def striped_flash_sale(url: str, buyers: int, per_buyer: int, rounds: int, stripes: int) -> Table:
    """The four variants, ``buyers`` processes, ``rounds`` interleaved rounds (see the module docstring)."""
    engine = make_engine(url, pool_size=buyers + 2)
    stock = buyers * per_buyer
    table = Table(
        f"3b. flash sale, striped ({engine.dialect.name}): stock {stock} = {buyers} processes x {per_buyer} "
        f"purchases of 1, {stripes} stripes; {rounds} interleaved rounds (median throughput, summed counts)"
    )
    rnd = random.Random(stock)
    rates: dict[str, list[float]] = {name: [] for name in BUYERS}
    rows: dict[str, dict[str, Any]] = {}
    kinds: dict[str, set[str]] = {}
    try:
        for _ in range(rounds):
            order = list(BUYERS)
            rnd.shuffle(order)
            for name in order:
                reset(engine, Stock, Purchase)
                drop_tables(engine)
                create_tables(engine)
                with Session(engine) as s, s.begin():
                    if name == STRIPED:
                        _counter(stripes).create(s, ITEM, amount=stock)
                    elif name == CEILING:
                        s.add_all(Stock(id=b + 1, amount=per_buyer, version=0) for b in range(buyers))
                    else:
                        s.add(Stock(id=1, amount=stock, version=0))
                out = _run_workers(
                    url,
                    engine,
                    "processes",
                    _buy_all,
                    [(name, b, per_buyer, stripes) for b in range(buyers)],
                )
                kinds.setdefault(name, set()).update(out["kinds"])
                left = _left(engine, name, stripes)
                with Session(engine) as s:
                    sold = s.scalar(select(func.count()).select_from(Purchase)) or 0
                rates[name].append(stock / out["elapsed"])
                row = rows.setdefault(
                    name, dict.fromkeys(("sold", "oversell", "lost", "gave_up", "retries"), 0)
                )
                row["sold"] += sold
                row["oversell"] += max(0, sold - stock) + max(0, -left)
                row["lost"] += abs(sold - (stock - left))
                row["gave_up"] += out["counts"]["gave up"] + out["counts"]["errors"]
                row["retries"] += out["counts"]["retries"]
    finally:
        drop(engine)
        drop_tables(engine)
        engine.dispose()
    ceiling = median(rates[CEILING])
    for name in BUYERS:
        rate = median(rates[name])
        table.rows.append(
            {
                "variant": name,
                "purchases_per_s": round(rate),
                "of_ceiling": f"{rate / ceiling:.2f}",
                "rounds": " ".join(str(round(r)) for r in rates[name]),
                **rows[name],
            }
        )
    striped, single = median(rates[STRIPED]), median(rates[SINGLE])
    s_row = rows[STRIPED]
    clean = s_row["oversell"] == s_row["gave_up"] == s_row["lost"] == 0 and s_row["sold"] == rounds * stock
    near = "met" if striped >= 0.85 * ceiling else "MISSED"
    table.notes.append(
        f"striped / ceiling {striped / ceiling:.2f} (target >= 0.85: {near}); "
        f"striped / single-row {striped / single:.2f}x (target >= 1.25x: "
        f"{'met' if striped >= 1.25 * single else 'MISSED'}); single-row / FOR UPDATE "
        f"{single / median(rates[FOR_UPDATE]):.2f}x; ceiling / single-row {ceiling / single:.2f}x"
    )
    table.notes.append(
        f"striped: 0 oversell, 0 lost, 0 give-ups, all stock sold: {'met' if clean else 'MISSED'}"
    )
    for name, found in kinds.items():
        if found:
            table.notes.append(f"{name} retried or failed: {', '.join(sorted(found))}")
    if engine.dialect.name == "sqlite":
        table.notes.append(
            "SQLite has one writer: every variant holds the whole database from its first write to "
            "COMMIT, so striping buys nothing; it has no FOR UPDATE (SQLAlchemy drops it), so that "
            "variant is the naive read-check-write there (lost updates)"
        )
    return table
