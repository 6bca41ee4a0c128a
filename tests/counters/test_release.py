"""``release()`` of guarded counters is all or nothing and gives back exactly once: past the column's
range it changes nothing (even when the caller commits), inside the caller's savepoints it follows
them, racing itself from eight threads it applies once; every check re-reads the database after the
caller committed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import BigInteger, Integer, String, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Mapped, Session, mapped_column

from stateguard import (
    InvalidArgument,
    Outcome,
    StripedCounter,
    async_sqlite_engine,
    create_tables,
    decrement,
    increment,
    release,
    reserve,
)
from tests._support.release_stock import AtkBase, _race, _unreleased
from tests.conftest import Backend, capable
from tests.counters.test_ranges import BIG_MAX, INT_MAX


class AtkStock(AtkBase):
    __tablename__ = "sg_atk_stock"
    id: Mapped[str] = mapped_column(String(20), primary_key=True)
    small: Mapped[int] = mapped_column(Integer)
    big: Mapped[int] = mapped_column(BigInteger)


class AtkUnique(AtkBase):
    __tablename__ = "sg_atk_unique"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)


pytestmark = pytest.mark.tables(AtkBase.metadata)


def _seed(engine: Any, **rows: tuple[int, int]) -> None:
    with Session(engine) as s, s.begin():
        for key, (small, big) in rows.items():
            s.add(AtkStock(id=key, small=small, big=big))


def _state(engine: Any) -> dict[str, tuple[int, int]]:
    with Session(engine) as s:
        return {
            k: (int(a), int(b)) for k, a, b in s.execute(select(AtkStock.id, AtkStock.small, AtkStock.big))
        }


def _set(engine: Any, key: str, **values: int) -> None:
    with Session(engine) as s, s.begin():
        s.execute(update(AtkStock).where(AtkStock.id == key).values(**values))


# --------------------------------------------------------------------------
# Plain release: multi-row refs, a row refilled to the top since
# --------------------------------------------------------------------------


@pytest.mark.limits
@pytest.mark.parametrize("column,top", [("small", INT_MAX), ("big", BIG_MAX)])
@pytest.mark.parametrize("full_row", ["a", "b", "c"])
def test_multirow_release_past_range_changes_nothing_even_when_committed(
    engine: Any, column: str, top: int, full_row: str
) -> None:
    _seed(engine, a=(10, 10), b=(10, 10), c=(10, 10))
    col = getattr(AtkStock, column)
    with Session(engine) as s, s.begin():
        assert reserve(s, col, {"a": 2, "b": 3, "c": 4}, ref="r1").outcome is Outcome.APPLIED
    _set(engine, full_row, **{column: top})  # refilled to the top since
    before = _state(engine)
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            release(s, col, "r1")
        # caller catches and commits
    assert _state(engine) == before
    assert _unreleased(engine, "r1") == 3
    # lower the full row, now the release applies exactly once
    _set(engine, full_row, **{column: top - 100})
    with Session(engine) as s, s.begin():
        assert release(s, col, "r1").outcome is Outcome.APPLIED
    with Session(engine) as s, s.begin():
        assert release(s, col, "r1").outcome is Outcome.REPEATED
    after = _state(engine)
    idx = 0 if column == "small" else 1
    expect = {"a": 10, "b": 10, "c": 10}
    expect[full_row] = top - 100 + {"a": 2, "b": 3, "c": 4}[full_row]
    assert {k: v[idx] for k, v in after.items()} == expect
    assert _unreleased(engine, "r1") == 0


@pytest.mark.limits
def test_release_exactly_at_the_top_applies(engine: Any) -> None:
    """Giving back to exactly INT_MAX fits the column: APPLIED."""
    _seed(engine, a=(10, 10))
    with Session(engine) as s, s.begin():
        assert decrement(s, AtkStock.small, "a", by=5, ref="r").outcome is Outcome.APPLIED
    _set(engine, "a", small=INT_MAX - 5)
    with Session(engine) as s, s.begin():
        assert release(s, AtkStock.small, "r").outcome is Outcome.APPLIED
    assert _state(engine)["a"][0] == INT_MAX
    with Session(engine) as s, s.begin():
        assert release(s, AtkStock.small, "r").outcome is Outcome.REPEATED
    assert _state(engine)["a"][0] == INT_MAX


def test_release_of_an_increment_whose_units_are_gone_keeps_nothing(
    engine: Any,
) -> None:
    _seed(engine, a=(0, 0))
    with Session(engine) as s, s.begin():
        assert increment(s, AtkStock.small, "a", by=7, ref="deliv").outcome is Outcome.APPLIED
    with Session(engine) as s, s.begin():
        assert decrement(s, AtkStock.small, "a", by=3).outcome is Outcome.APPLIED
    with Session(engine) as s, s.begin():
        r = release(s, AtkStock.small, "deliv")
        assert r.outcome is Outcome.INSUFFICIENT
        assert r.key == "a" and r.value == 4
    assert _state(engine)["a"] == (4, 0)
    assert _unreleased(engine, "deliv") == 1
    _set(engine, "a", small=100)
    with Session(engine) as s, s.begin():
        assert release(s, AtkStock.small, "deliv").outcome is Outcome.APPLIED
    with Session(engine) as s, s.begin():
        assert release(s, AtkStock.small, "deliv").outcome is Outcome.REPEATED
    assert _state(engine)["a"] == (93, 0)


@pytest.mark.rollback
def test_release_inside_users_own_savepoint(engine: Any) -> None:
    _seed(engine, a=(10, 10), b=(10, 10))
    with Session(engine) as s, s.begin():
        reserve(s, AtkStock.small, {"a": 1, "b": 2}, ref="r")
    _set(engine, "b", small=INT_MAX)
    before = _state(engine)
    with Session(engine) as s, s.begin():
        nested = s.begin_nested()
        with pytest.raises(InvalidArgument):
            release(s, AtkStock.small, "r")
        nested.commit()  # the user's savepoint is released, not rolled back
        s.add(AtkUnique(id=1))  # the transaction goes on
    assert _state(engine) == before
    assert _unreleased(engine, "r") == 2
    _set(engine, "b", small=5)
    with Session(engine) as s, s.begin():
        nested = s.begin_nested()
        assert release(s, AtkStock.small, "r").outcome is Outcome.APPLIED
        nested.commit()
    with Session(engine) as s, s.begin():
        with s.begin_nested():
            assert release(s, AtkStock.small, "r").outcome is Outcome.REPEATED
    st = _state(engine)
    assert st["a"][0] == 10 and st["b"][0] == 7
    with Session(engine) as s:
        assert s.get(AtkUnique, 1) is not None


@pytest.mark.rollback
def test_release_in_savepoint_then_user_rolls_back_savepoint(engine: Any) -> None:
    """A release rolled back with the user's savepoint is not recorded: it applies later, once."""
    _seed(engine, a=(10, 10))
    with Session(engine) as s, s.begin():
        decrement(s, AtkStock.small, "a", by=4, ref="r")
    with Session(engine) as s, s.begin():
        nested = s.begin_nested()
        assert release(s, AtkStock.small, "r").outcome is Outcome.APPLIED
        nested.rollback()
    assert _state(engine)["a"][0] == 6
    assert _unreleased(engine, "r") == 1
    with Session(engine) as s, s.begin():
        assert release(s, AtkStock.small, "r").outcome is Outcome.APPLIED
        assert release(s, AtkStock.small, "r").outcome is Outcome.REPEATED
    assert _state(engine)["a"][0] == 10


def test_release_after_callers_failed_statement(backend: Backend, engine: Any) -> None:
    """The caller's earlier statement failed (duplicate key, caught); on MariaDB the transaction
    goes on (no savepoint of the caller).  A failing release afterwards still changes nothing."""
    _seed(engine, a=(10, 10), b=(10, 10))
    with Session(engine) as s, s.begin():
        s.add(AtkUnique(id=1))
    with Session(engine) as s, s.begin():
        reserve(s, AtkStock.big, {"a": 1, "b": 2}, ref="r")
    _set(engine, "a", big=BIG_MAX)
    before = _state(engine)
    with Session(engine) as s:
        s.begin()
        if capable(backend, "error_aborts_transaction"):  # the caller needs a savepoint to go on
            with pytest.raises(IntegrityError):
                with s.begin_nested():
                    s.execute(text("INSERT INTO sg_atk_unique (id) VALUES (1)"))
        else:
            with pytest.raises(IntegrityError):
                s.execute(text("INSERT INTO sg_atk_unique (id) VALUES (1)"))
        with pytest.raises(InvalidArgument):
            release(s, AtkStock.big, "r")
        s.execute(text("INSERT INTO sg_atk_unique (id) VALUES (2)"))
        s.commit()
    assert _state(engine) == before
    assert _unreleased(engine, "r") == 2
    with Session(engine) as s:
        assert s.get(AtkUnique, 2) is not None


def test_release_racing_itself_from_8_threads(backend: Backend, engine: Any) -> None:
    _seed(engine, a=(100, 100), b=(100, 100), c=(100, 100))
    with Session(engine) as s, s.begin():
        reserve(s, AtkStock.small, {"a": 5, "b": 6, "c": 7}, ref="race")
    eng = backend.new_engine() if capable(backend, "concurrent_writers") else engine

    def one() -> Outcome:
        with Session(eng) as s, s.begin():
            return release(s, AtkStock.small, "race").outcome

    results, errors = _race([one] * 8)
    if eng is not engine:
        eng.dispose()
    # Some errors (deadlock/lock wait, sqlite busy) may be acceptable to retry; but the state must be exact.
    applied = [r for r in results if r is Outcome.APPLIED]
    assert len(applied) <= 1, (results, errors)
    st = _state(engine)
    if applied:
        assert {k: v[0] for k, v in st.items()} == {"a": 100, "b": 100, "c": 100}
        assert _unreleased(engine, "race") == 0
    else:
        assert {k: v[0] for k, v in st.items()} == {"a": 95, "b": 94, "c": 93}
    assert not errors, errors
    assert len(applied) == 1
    assert sorted(r.name for r in results) == ["APPLIED"] + ["REPEATED"] * 7


# --------------------------------------------------------------------------
# Async (aiosqlite)
# --------------------------------------------------------------------------


@pytest.mark.limits
def test_async_release_past_range_changes_nothing(tmp_path: Any) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession

    async def main() -> None:
        eng = async_sqlite_engine(f"sqlite+aiosqlite:///{tmp_path}/a.db")
        await create_tables(eng)
        async with eng.begin() as conn:
            await conn.run_sync(AtkBase.metadata.create_all)
        async with AsyncSession(eng) as s, s.begin():
            s.add_all([AtkStock(id="a", small=10, big=10), AtkStock(id="b", small=10, big=10)])
        async with AsyncSession(eng) as s, s.begin():
            assert (await reserve(s, AtkStock.small, {"a": 1, "b": 2}, ref="r")).outcome is Outcome.APPLIED
        async with AsyncSession(eng) as s, s.begin():
            await s.execute(update(AtkStock).where(AtkStock.id == "a").values(small=INT_MAX))
        async with AsyncSession(eng) as s, s.begin():
            with pytest.raises(InvalidArgument):
                await release(s, AtkStock.small, "r")
        async with AsyncSession(eng) as s:
            rows = dict((await s.execute(select(AtkStock.id, AtkStock.small))).all())
            assert rows == {"a": INT_MAX, "b": 8}
        c = StripedCounter("async", stripes=1)
        async with AsyncSession(eng) as s, s.begin():
            await c.create(s, "k", amount=10)
            await c.decrement(s, "k", by=3, ref="o")
            await c.increment(s, "k", by=BIG_MAX - 7)
        async with AsyncSession(eng) as s, s.begin():
            with pytest.raises(InvalidArgument):
                await c.release(s, "o")
        async with AsyncSession(eng) as s:
            assert await c.total(s, "k") == BIG_MAX
        await eng.dispose()

    asyncio.run(main())


# --------------------------------------------------------------------------
# One ref over several increments / mixed rows
# --------------------------------------------------------------------------


def test_one_ref_incrementing_two_rows_release_short_on_one_changes_nothing(engine: Any) -> None:
    """If a ref may take several rows by increment (a delivery of two skus), a release whose second
    row's units are gone gives back nothing on the first row either.  If a second increment under a
    used ref is refused instead (RefConflict or REPEATED), that is recorded and nothing else checked."""
    from stateguard import RefConflict

    _seed(engine, a=(0, 0), b=(0, 0))
    with Session(engine) as s, s.begin():
        assert increment(s, AtkStock.small, "a", by=5, ref="d").outcome is Outcome.APPLIED
        try:
            second = increment(s, AtkStock.small, "b", by=6, ref="d").outcome
        except RefConflict:
            second = None
    if second is not Outcome.APPLIED:
        print("SECOND-INCREMENT-UNDER-USED-REF:", second)
        assert _state(engine)["b"][0] == 0
        return
    with Session(engine) as s, s.begin():
        decrement(s, AtkStock.small, "b", by=4)
    before = _state(engine)
    with Session(engine) as s, s.begin():
        r = release(s, AtkStock.small, "d")
        assert r.outcome is Outcome.INSUFFICIENT and r.key == "b" and r.value == 2
    assert _state(engine) == before
    assert _unreleased(engine, "d") == 2


def test_release_mixed_increment_and_decrement_rows_one_full(engine: Any) -> None:
    """A basket reserved (decrement) on a and a delivery (increment) on b under separate refs;
    the reserve's release with a refilled-to-top row gives nothing; the other ref is unaffected."""
    _seed(engine, a=(10, 10), b=(10, 10), c=(10, 10))
    with Session(engine) as s, s.begin():
        reserve(s, AtkStock.small, {"a": 1, "c": 1}, ref="bk")
        increment(s, AtkStock.small, "b", by=3, ref="dl")
    _set(engine, "c", small=INT_MAX)
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            release(s, AtkStock.small, "bk")
        assert release(s, AtkStock.small, "dl").outcome is Outcome.APPLIED
    st = _state(engine)
    assert {k: v[0] for k, v in st.items()} == {"a": 9, "b": 10, "c": INT_MAX}
    assert _unreleased(engine, "bk") == 2 and _unreleased(engine, "dl") == 0


@pytest.mark.limits
def test_async_server_release_past_range(backend: Backend, engine: Any) -> None:
    """The same on an AsyncSession against the backend (psycopg async / aiomysql / aiosqlite)."""
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    _seed(engine, a=(10, 10), b=(10, 10))
    with Session(engine) as s, s.begin():
        reserve(s, AtkStock.big, {"a": 1, "b": 2}, ref="r")
    _set(engine, "b", big=BIG_MAX)
    url = engine.url
    if backend.name == "mariadb":
        url = url.set(drivername="mysql+aiomysql")
    elif backend.name == "sqlite":
        url = url.set(drivername="sqlite+aiosqlite")
    c = StripedCounter("asrv", stripes=2)
    with Session(engine) as s, s.begin():
        c.create(s, "k", amount=0)
        c.increment(s, "k", by=10, ref="inc")
        c.decrement(s, "k", by=10)

    async def main() -> None:
        if backend.name == "sqlite":
            eng = async_sqlite_engine(url.render_as_string(hide_password=False))
        else:
            eng = create_async_engine(url)
        try:
            async with AsyncSession(eng) as s, s.begin():
                with pytest.raises(InvalidArgument):
                    await release(s, AtkStock.big, "r")
            async with AsyncSession(eng) as s, s.begin():
                r = await c.release(s, "inc")
                assert r.outcome is Outcome.INSUFFICIENT
        finally:
            await eng.dispose()

    asyncio.run(main())
    st = _state(engine)
    assert {k: v[1] for k, v in st.items()} == {"a": 9, "b": BIG_MAX}
    assert _unreleased(engine, "r") == 2 and _unreleased(engine, "inc") == 1
    with Session(engine) as s:
        assert c.total(s, "k") == 0


@pytest.mark.limits
def test_release_of_int_max_reservation(engine: Any) -> None:
    _seed(engine, a=(INT_MAX, 0), b=(5, 0))
    with Session(engine) as s, s.begin():
        assert reserve(s, AtkStock.small, {"a": INT_MAX, "b": 5}, ref="m").outcome is Outcome.APPLIED
    _set(engine, "a", small=1)
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            release(s, AtkStock.small, "m")
    assert {k: v[0] for k, v in _state(engine).items()} == {"a": 1, "b": 0}
    _set(engine, "a", small=0)
    with Session(engine) as s, s.begin():
        assert release(s, AtkStock.small, "m").outcome is Outcome.APPLIED
        assert release(s, AtkStock.small, "m").outcome is Outcome.REPEATED
    assert {k: v[0] for k, v in _state(engine).items()} == {"a": INT_MAX, "b": 5}
