"""Worker functions for the counter storms (importable by spawned processes)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Integer, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import SerializationConflict, decrement, reserve


class StockBase(DeclarativeBase):
    pass


class Stock(StockBase):
    """No CHECK constraint on purpose: only stateguard's guard keeps the amount >= 0."""

    __tablename__ = "stock_items"
    id: Mapped[int] = mapped_column(primary_key=True)
    amount: Mapped[int] = mapped_column(Integer)
    reserved_max: Mapped[int] = mapped_column(Integer, default=0)


def _engine(name: str, url: str) -> Any:
    kw: dict[str, Any] = {"pool_size": 2}
    if name == "sqlite":
        kw["connect_args"] = {"timeout": 60}
    return create_engine(url, **kw)


def _retry(fn: Any) -> Any:
    for _ in range(100):
        try:
            return fn()
        except SerializationConflict:
            continue
    raise AssertionError("too many conflicts")


def buy(name: str, url: str, worker: str, times: int, barrier: Any, use_ref: bool) -> dict[str, int]:
    """Buy one unit ``times`` times (each in its own transaction); count the outcomes."""
    engine = _engine(name, url)
    counts: dict[str, int] = {}
    try:
        barrier.wait()
        for i in range(times):
            ref = f"{worker}-{i}" if use_ref else None

            def unit(ref: str | None = ref) -> Any:
                with Session(engine) as s, s.begin():
                    return decrement(s, Stock.amount, 1, by=1, ref=ref)

            r = _retry(unit)
            if r.value is not None and r.value < 0:  # pragma: no cover - would be an oversell
                counts["negative"] = counts.get("negative", 0) + 1
            counts[r.outcome.name] = counts.get(r.outcome.name, 0) + 1
    finally:
        engine.dispose()
    return counts


def retried_purchases(name: str, url: str, refs: list[str], barrier: Any) -> dict[str, int]:
    """Send every purchase (a ref) once; several workers send the same refs."""
    engine = _engine(name, url)
    counts: dict[str, int] = {}
    try:
        barrier.wait()
        for ref in refs:

            def unit(ref: str = ref) -> Any:
                with Session(engine) as s, s.begin():
                    return decrement(s, Stock.amount, 1, by=1, ref=ref)

            r = _retry(unit)
            counts[r.outcome.name] = counts.get(r.outcome.name, 0) + 1
    finally:
        engine.dispose()
    return counts


def reserve_pairs(name: str, url: str, worker: int, rounds: int, barrier: Any) -> dict[str, int]:
    """Reserve items 1 and 2 in alternating key order of the mapping (stateguard sorts them)."""
    engine = _engine(name, url)
    counts: dict[str, int] = {}
    try:
        barrier.wait()
        for i in range(rounds):
            amounts = {1: 1, 2: 1} if (worker + i) % 2 else {2: 1, 1: 1}

            def unit(amounts: dict[int, int] = amounts, i: int = i) -> Any:
                with Session(engine) as s, s.begin():
                    return reserve(s, Stock.amount, amounts, ref=f"w{worker}-{i}")

            r = _retry(unit)
            counts[r.outcome.name] = counts.get(r.outcome.name, 0) + 1
    finally:
        engine.dispose()
    return counts
