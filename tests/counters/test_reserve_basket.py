"""reserve()'s all-or-nothing basket, shared by guarded and striped counters: outcomes, an
AsyncSession, racing threads with one ref applying once, and a release undone with its savepoint."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import Engine, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from stateguard import (
    Outcome,
    RefConflict,
    Result,
    StripedCounter,
    create_tables,
    drop_tables,
    reserve,
    retry_on_conflict,
)
from stateguard.tables import counter_ledger
from tests._support.async_helpers import AsyncTarget, target_from
from tests._support.counter_workers import Bin, CounterBase
from tests.conftest import Backend, backends_with


@pytest.fixture(params=["aiosqlite", "asyncpg", "aiomysql"])
def target(request: pytest.FixtureRequest) -> AsyncTarget:
    return target_from(request)


# --------------------------------------------------------------------------
# reserve() / StripedCounter.reserve(): the shared basket
# --------------------------------------------------------------------------


@pytest.fixture
def bins(backend: Backend) -> Iterator[Engine]:
    eng = backend.create(CounterBase.metadata)
    drop_tables(eng)
    create_tables(eng)
    with Session(eng) as s, s.begin():
        s.add_all(Bin(id=k, qty=5, cap=0) for k in (1, 2, 3))
    yield eng
    drop_tables(eng)


def _qty(engine: Engine) -> dict[int, int]:
    with Session(engine) as s:
        return {b.id: b.qty for b in s.scalars(select(Bin).order_by(Bin.id))}


def test_reserve_basket_outcomes(bins: Engine) -> None:
    engine = bins
    with Session(engine) as s, s.begin():
        done = reserve(s, Bin.qty, {3: 2, 1: 1}, ref="o")
        assert done.outcome is Outcome.APPLIED and done.key == "o" and set(done.value) == {1, 3}
    with Session(engine) as s, s.begin():
        again = reserve(s, Bin.qty, {1: 1, 3: 2}, ref="o")
        assert again.outcome is Outcome.REPEATED and set(again.value) == {1, 3}
        for other in ({1: 1}, {1: 1, 3: 2, 2: 1}, {1: 2, 3: 2}):
            with pytest.raises(RefConflict):
                reserve(s, Bin.qty, other, ref="o")
        short = reserve(s, Bin.qty, {1: 1, 2: 1, 3: 9}, ref="p")
        assert (short.outcome, short.key, short.value) == (Outcome.INSUFFICIENT, 3, 3)
        missing = reserve(s, Bin.qty, {1: 1, 404: 1}, ref="p")
        assert (missing.outcome, missing.key) == (Outcome.NOT_FOUND, 404)
        # the ref of an undone call is still free, in the same transaction
        assert reserve(s, Bin.qty, {1: 1, 2: 1}, ref="p").applied
    assert _qty(engine) == {1: 3, 2: 4, 3: 3}
    with engine.connect() as conn:
        ledger = sorted((r.ref, r.row_key) for r in conn.execute(select(counter_ledger)))
    assert ledger == [("o", "1"), ("o", "3"), ("p", "1"), ("p", "2")]


def test_striped_reserve_basket_outcomes(bins: Engine) -> None:
    engine = bins
    stock = StripedCounter(f"bridge-{uuid.uuid4().hex[:8]}", stripes=2)
    with Session(engine) as s, s.begin():
        for item in ("a", "b", "c"):
            assert stock.create(s, item, amount=5).applied
    with Session(engine) as s, s.begin():
        assert stock.reserve(s, {"b": 2, "a": 1}, ref="o").outcome is Outcome.APPLIED
    with Session(engine) as s, s.begin():
        assert stock.reserve(s, {"a": 1, "b": 2}, ref="o").outcome is Outcome.REPEATED
        for other in ({"a": 1}, {"a": 1, "b": 2, "c": 1}, {"a": 1, "b": 3}):
            with pytest.raises(RefConflict):
                stock.reserve(s, other, ref="o")
        short = stock.reserve(s, {"a": 1, "c": 6}, ref="p")
        assert (short.outcome, short.key) == (Outcome.INSUFFICIENT, "c")
        assert stock.reserve(s, {"a": 1, "c": 5}, ref="p").applied
    with Session(engine) as s:
        assert [stock.total(s, i) for i in ("a", "b", "c")] == [3, 3, 0]


def test_reserve_basket_under_an_async_session(bins: Engine, backend: Backend) -> None:
    from tests._support.async_helpers import async_target

    driver = {"sqlite": "aiosqlite", "postgresql": "asyncpg", "mariadb": "aiomysql"}[backend.name]
    target = async_target(driver, backend)

    async def main() -> tuple[Outcome, Outcome]:
        engine = target.engine()
        try:
            async with AsyncSession(engine) as s, s.begin():
                first = await reserve(s, Bin.qty, {2: 2, 1: 2}, ref="x")
            async with AsyncSession(engine) as s, s.begin():
                second = await reserve(s, Bin.qty, {1: 2, 2: 2}, ref="x")
                with pytest.raises(RefConflict):
                    await reserve(s, Bin.qty, {1: 2}, ref="x")
            return first.outcome, second.outcome
        finally:
            await engine.dispose()

    assert asyncio.run(main()) == (Outcome.APPLIED, Outcome.REPEATED)
    assert _qty(bins) == {1: 3, 2: 3, 3: 5}


@pytest.mark.parametrize("backend", backends_with("concurrent_writers"), indirect=True)
def test_reserve_races_one_ref_in_threads_applies_once(backend: Backend) -> None:
    """Eight threads reserving the same basket under one ref: one APPLIED, the rest REPEATED (or a
    retryable conflict, retried by retry_on_conflict), the stock taken once."""
    engine = backend.create(CounterBase.metadata)
    drop_tables(engine)
    create_tables(engine)
    try:
        with Session(engine) as s, s.begin():
            s.add_all(Bin(id=k, qty=10, cap=0) for k in (1, 2))
        barrier = threading.Barrier(8)

        def one() -> Outcome:
            barrier.wait()

            def unit() -> Result:
                with Session(engine) as s, s.begin():
                    return reserve(s, Bin.qty, {1: 3, 2: 4}, ref="race")

            return retry_on_conflict(unit, attempts=20).outcome

        with ThreadPoolExecutor(8) as pool:
            outcomes = [f.result() for f in [pool.submit(one) for _ in range(8)]]
        assert sorted(o.name for o in outcomes) == ["APPLIED"] + ["REPEATED"] * 7
        assert _qty(engine) == {1: 7, 2: 6}
    finally:
        drop_tables(engine)


@pytest.mark.rollback
def test_a_refs_release_is_undone_with_its_savepoint_basket(bins: Engine) -> None:
    """An INSUFFICIENT basket leaves the rows and the ledger exactly as they were, even mid-transaction
    after other writes (the savepoint rolls back only the basket)."""
    engine = bins
    with Session(engine) as s, s.begin():
        s.execute(update(Bin).where(Bin.id == 3).values(qty=1))
        assert reserve(s, Bin.qty, {1: 1, 3: 2}, ref="z").outcome is Outcome.INSUFFICIENT
        assert s.scalar(select(Bin.qty).where(Bin.id == 3)) == 1
    assert _qty(engine) == {1: 5, 2: 5, 3: 1}
    with engine.connect() as conn:
        assert conn.scalar(select(func.count()).select_from(counter_ledger)) == 0
