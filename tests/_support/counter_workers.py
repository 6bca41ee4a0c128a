"""Models and workers for tests/test_counters.py (importable by spawned processes)."""

from __future__ import annotations

import random
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from sqlalchemy import Integer, Numeric, String, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import (
    DeadlockDetected,
    Outcome,
    RefConflict,
    SerializationConflict,
    decrement,
    release,
    reserve,
)


class CounterBase(DeclarativeBase):
    pass


class Bin(CounterBase):
    """No CHECK constraint on purpose: only stateguard's guard keeps ``qty`` >= 0."""

    __tablename__ = "counter_bins"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    qty: Mapped[int] = mapped_column(Integer)
    cap: Mapped[int] = mapped_column(Integer, default=0)
    version: Mapped[int] = mapped_column(Integer, default=1)
    __mapper_args__ = {"version_id_col": version}


class Wallet(CounterBase):
    """A numeric counter behind a composite primary key."""

    __tablename__ = "counter_wallets"
    owner: Mapped[str] = mapped_column(String(40), primary_key=True)
    currency: Mapped[str] = mapped_column(String(3), primary_key=True)
    balance: Mapped[Decimal] = mapped_column(Numeric(12, 2))


def make_engine(name: str, url: str) -> Any:
    kw: dict[str, Any] = {"pool_size": 2}
    if name == "sqlite":
        kw["connect_args"] = {"timeout": 60}
    return create_engine(url, **kw)


class Conflicts:
    """Run a unit of work again after a retryable conflict, counting them by kind.

    With ``deadlocks=False`` a deadlock is not retried but raised at once:
    the tests that prove there are none should fail fast, not crawl through
    the database's deadlock timeout again and again.
    """

    def __init__(self, *, deadlocks: bool = True) -> None:
        self.retry_deadlocks = deadlocks
        self.deadlocks = 0
        self.serialization = 0

    def run(self, fn: Callable[[], Any]) -> Any:
        for _ in range(200):
            try:
                return fn()
            except DeadlockDetected:
                self.deadlocks += 1
                if not self.retry_deadlocks:
                    raise
            except SerializationConflict:
                self.serialization += 1
        raise AssertionError("too many conflicts")


def send_purchases(
    name: str, url: str, refs: list[str], seed: int, barrier: Any
) -> tuple[dict[str, str], int]:
    """Send each ref's purchase (1 unit of bin 1) once, in a seeded order; outcome per ref."""
    engine = make_engine(name, url)
    order = list(refs)
    random.Random(seed).shuffle(order)
    outcomes: dict[str, str] = {}
    conflicts = Conflicts()
    try:
        barrier.wait()
        for ref in order:

            def unit(ref: str = ref) -> Any:
                with Session(engine) as s, s.begin():
                    return decrement(s, Bin.qty, 1, ref=ref)

            outcomes[ref] = conflicts.run(unit).outcome.name
    finally:
        engine.dispose()
    return outcomes, conflicts.deadlocks


def buy_many(name: str, url: str, times: int, barrier: Any) -> dict[str, int]:
    """Buy one unit of bin 1 ``times`` times without a ref; count outcomes and negative values."""
    engine = make_engine(name, url)
    counts: dict[str, int] = {}
    conflicts = Conflicts()
    try:
        barrier.wait()
        for _ in range(times):

            def unit() -> Any:
                with Session(engine) as s, s.begin():
                    return decrement(s, Bin.qty, 1)

            r = conflicts.run(unit)
            counts[r.outcome.name] = counts.get(r.outcome.name, 0) + 1
            if r.value is not None and r.value < 0:  # pragma: no cover - an oversell
                counts["negative"] = counts.get("negative", 0) + 1
    finally:
        engine.dispose()
    return counts


def same_ref_different_amounts(engine: Any, rounds: int, by: int, barrier: Any) -> list[tuple[int, str]]:
    """Per round, take ``by`` from bin 1 under the round's shared ref; (round, outcome or error)."""
    conflicts = Conflicts()
    seen: list[tuple[int, str]] = []
    for i in range(rounds):
        barrier.wait()

        def unit(i: int = i) -> Any:
            with Session(engine) as s, s.begin():
                return decrement(s, Bin.qty, 1, by=by, ref=f"round-{i}")

        try:
            seen.append((i, conflicts.run(unit).outcome.name))
        except RefConflict:
            seen.append((i, "RefConflict"))
    return seen


def reserve_and_release(
    engine: Any, worker: int, rounds: int, keys: list[int], barrier: Any
) -> tuple[dict[str, int], Conflicts]:
    """Reserve ``keys`` in a random mapping order, commit, then release it; count outcomes."""
    rng = random.Random(worker)
    counts: dict[str, int] = {}
    conflicts = Conflicts(deadlocks=False)
    barrier.wait()
    for i in range(rounds):
        order = list(keys)
        rng.shuffle(order)
        ref = f"rr-{worker}-{i}"

        def take(order: list[int] = order, ref: str = ref) -> Any:
            with Session(engine) as s, s.begin():
                return reserve(s, Bin.qty, {k: 1 for k in order}, ref=ref)

        def give_back(ref: str = ref) -> Any:
            with Session(engine) as s, s.begin():
                return release(s, Bin.qty, ref)

        r = conflicts.run(take)
        counts[f"reserve {r.outcome.name}"] = counts.get(f"reserve {r.outcome.name}", 0) + 1
        if r.outcome is Outcome.APPLIED and i % 2:
            back = conflicts.run(give_back)
            counts[f"release {back.outcome.name}"] = counts.get(f"release {back.outcome.name}", 0) + 1
    return counts, conflicts
