"""Guarded counters at the edge of an integer column's range, on every backend.

A change whose new value the column cannot hold is :class:`~stateguard.InvalidArgument`
(no bound to cross) or INSUFFICIENT (a bound, which fits the column, is crossed first):
never the driver's error ("bigint out of range" aborts a PostgreSQL transaction,
MariaDB refuses it in strict mode, SQLite turns it into a REAL).  Nothing changes,
no ledger row stays behind and the transaction goes on.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import BigInteger, Integer, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import (
    InvalidArgument,
    Outcome,
    decrement,
    increment,
    release,
    reserve,
)
from stateguard.tables import counter_ledger
from tests.conftest import count_statements

BIG_MAX = 2**63 - 1
BIG_MIN = -(2**63)
INT_MAX = 2**31 - 1
INT_MIN = -(2**31)


class RangeBase(DeclarativeBase):
    pass


class Tally(RangeBase):
    __tablename__ = "sg_range_tallies"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    big: Mapped[int] = mapped_column(BigInteger)
    small: Mapped[int] = mapped_column(Integer)
    big_cap: Mapped[int] = mapped_column(BigInteger)


pytestmark = pytest.mark.tables(RangeBase.metadata)


def _rows(engine: Any, **rows: tuple[int, int]) -> None:
    with Session(engine) as s, s.begin():
        for key, (big, small) in rows.items():
            s.add(Tally(id=int(key[1:]), big=big, small=small, big_cap=BIG_MAX))


def _read(s: Session, key: int) -> tuple[int, int]:
    big, small = s.execute(select(Tally.big, Tally.small).where(Tally.id == key)).one()
    return int(big), int(small)


def _ledger(s: Session) -> int:
    return int(s.execute(select(func.count()).select_from(counter_ledger)).scalar_one())


@pytest.mark.limits
@pytest.mark.parametrize("ref", [None, "order-1"])
def test_increment_past_the_bigint_maximum_is_refused(engine: Any, ref: str | None) -> None:
    _rows(engine, k1=(BIG_MAX - 10, 0))
    with Session(engine) as s:
        with count_statements(engine) as c, pytest.raises(InvalidArgument) as info:
            increment(s, Tally.big, 1, by=100, ref=ref)
        message = str(info.value)
        assert "Tally.big" in message and str(BIG_MIN) in message and str(BIG_MAX) in message, message
        assert "range" in message, message
        # The hot path is one UPDATE; the refusal reads the row (and forgets the ref's claim).
        kinds = [x.split()[0] for x in c.statements]
        assert kinds == (["UPDATE", "SELECT"] if ref is None else ["INSERT", "UPDATE", "DELETE", "SELECT"])
        # The transaction goes on: nothing changed, no ledger row, the same ref applies up to the top.
        assert _read(s, 1) == (BIG_MAX - 10, 0)
        assert _ledger(s) == 0
        r = increment(s, Tally.big, 1, by=10, ref=ref)
        assert r.outcome is Outcome.APPLIED
        assert r.value in (BIG_MAX, None)  # MariaDB does not report it
        s.commit()
    with Session(engine) as s:
        assert _read(s, 1) == (BIG_MAX, 0)
        assert _ledger(s) == (0 if ref is None else 1)
        with pytest.raises(InvalidArgument):
            increment(s, Tally.big, 1)  # at the maximum, even 1 is too much
        if ref is not None:
            # The undo of the increment that reached the top applies as ever.
            assert release(s, Tally.big, ref).outcome is Outcome.APPLIED
            assert _read(s, 1) == (BIG_MAX - 10, 0)
        s.commit()


@pytest.mark.limits
@pytest.mark.parametrize("ref", [None, "order-2"])
def test_decrement_without_floor_below_the_bigint_minimum_is_refused(engine: Any, ref: str | None) -> None:
    _rows(engine, k1=(BIG_MIN + 5, 0))
    with Session(engine) as s:
        with pytest.raises(InvalidArgument) as info:
            decrement(s, Tally.big, 1, by=6, floor=None, ref=ref)
        assert "Tally.big" in str(info.value) and str(BIG_MIN) in str(info.value)
        assert _read(s, 1) == (BIG_MIN + 5, 0)
        assert _ledger(s) == 0
        assert decrement(s, Tally.big, 1, by=5, floor=None, ref=ref).outcome is Outcome.APPLIED
        s.commit()
    with Session(engine) as s:
        assert _read(s, 1) == (BIG_MIN, 0)


@pytest.mark.limits
def test_a_32_bit_integer_column_is_guarded_at_its_own_range(engine: Any) -> None:
    """``Integer`` is 32-bit on PostgreSQL and MariaDB; stateguard holds SQLite to the declared type too."""
    _rows(engine, k1=(0, INT_MAX - 1), k2=(0, INT_MIN + 1))
    with Session(engine) as s:
        with pytest.raises(InvalidArgument) as info:
            increment(s, Tally.small, 1, by=2, ref="up")
        assert "Tally.small" in str(info.value) and str(INT_MAX) in str(info.value)
        with pytest.raises(InvalidArgument) as info:
            decrement(s, Tally.small, 2, by=2, floor=None, ref="down")
        assert str(INT_MIN) in str(info.value)
        assert _read(s, 1) == (0, INT_MAX - 1) and _read(s, 2) == (0, INT_MIN + 1)
        assert _ledger(s) == 0
        assert increment(s, Tally.small, 1, by=1, ref="up").outcome is Outcome.APPLIED
        assert decrement(s, Tally.small, 2, by=1, floor=None, ref="down").outcome is Outcome.APPLIED
        s.commit()
    with Session(engine) as s:
        assert _read(s, 1) == (0, INT_MAX) and _read(s, 2) == (0, INT_MIN)
        assert _ledger(s) == 2


@pytest.mark.limits
def test_a_bound_is_crossed_before_the_range(engine: Any) -> None:
    """With a ceiling or floor (which fits the column) the overflowing change is INSUFFICIENT."""
    _rows(engine, k1=(BIG_MAX - 10, INT_MIN + 1))
    with Session(engine) as s:
        r = increment(s, Tally.big, 1, by=100, ceiling=BIG_MAX, ref="c1")
        assert r.outcome is Outcome.INSUFFICIENT and r.value == BIG_MAX - 10
        r = increment(s, Tally.big, 1, by=100, ceiling=Tally.big_cap, ref="c2")
        assert r.outcome is Outcome.INSUFFICIENT and r.value == BIG_MAX - 10
        r = decrement(s, Tally.small, 1, by=5, ref="c3")  # floor 0
        assert r.outcome is Outcome.INSUFFICIENT and r.value == INT_MIN + 1
        r = decrement(s, Tally.small, 1, by=5, floor=INT_MIN)
        assert r.outcome is Outcome.INSUFFICIENT and r.value == INT_MIN + 1
        assert _read(s, 1) == (BIG_MAX - 10, INT_MIN + 1) and _ledger(s) == 0
        assert increment(s, Tally.big, 1, by=10, ceiling=Tally.big_cap).outcome is Outcome.APPLIED
        s.commit()
    with Session(engine) as s:
        assert _read(s, 1) == (BIG_MAX, INT_MIN + 1)


@pytest.mark.limits
def test_reserve_stays_all_or_nothing_at_the_range_edge(engine: Any) -> None:
    _rows(engine, k1=(0, 10), k2=(0, INT_MIN + 1))
    with Session(engine) as s:
        r = reserve(s, Tally.small, {1: 3, 2: 5}, ref="res")
        assert r.outcome is Outcome.INSUFFICIENT and r.key == 2 and r.value == INT_MIN + 1
        assert _read(s, 1) == (0, 10) and _read(s, 2) == (0, INT_MIN + 1)
        assert _ledger(s) == 0
        assert reserve(s, Tally.small, {1: 3}, ref="res").outcome is Outcome.APPLIED
        s.commit()
    with Session(engine) as s:
        assert _read(s, 1) == (0, 7)


def _unreleased(s: Session, ref: str) -> int:
    return int(
        s.execute(
            select(func.count())
            .select_from(counter_ledger)
            .where(counter_ledger.c.ref == ref, counter_ledger.c.released_at.is_(None))
        ).scalar_one()
    )


@pytest.mark.limits
def test_a_release_past_the_maximum_is_refused_and_gives_nothing_back(engine: Any) -> None:
    """Units given back to a row refilled to the top since: InvalidArgument, not the driver's error,
    and all or nothing (the row given back first is undone too); the ref stays unreleased, so a
    caller that catches the error and commits loses no units, and the release applies once there
    is room."""
    _rows(engine, k1=(100, 0), k2=(100, 0))
    with Session(engine) as s:
        assert reserve(s, Tally.big, {1: 30, 2: 40}, ref="order").outcome is Outcome.APPLIED
        assert increment(s, Tally.big, 2, by=BIG_MAX - 60).outcome is Outcome.APPLIED
        assert _read(s, 2) == (BIG_MAX, 0)
        # Loaded ORM objects: row 1 is given back first (and synced), then the savepoint rolls
        # back; the loaded object must not keep the undone 100.
        t1, t2 = s.get(Tally, 1), s.get(Tally, 2)
        assert t1 is not None and t2 is not None and (t1.big, t2.big) == (70, BIG_MAX)
        with pytest.raises(InvalidArgument) as info:
            release(s, Tally.big, "order")
        message = str(info.value)
        assert "Tally.big" in message and str(BIG_MAX) in message and "order" in message, message
        assert (t1.big, t2.big) == (70, BIG_MAX)
        assert _read(s, 1) == (70, 0) and _read(s, 2) == (BIG_MAX, 0)
        assert _unreleased(s, "order") == 2
        s.commit()  # the caller swallowed the error and committed
    with Session(engine) as s:
        assert _read(s, 1) == (70, 0) and _read(s, 2) == (BIG_MAX, 0)
        assert _unreleased(s, "order") == 2
        assert decrement(s, Tally.big, 2, by=40).outcome is Outcome.APPLIED
        r = release(s, Tally.big, "order")
        assert r.outcome is Outcome.APPLIED and r.value == {1: 30, 2: 40}
        assert _read(s, 1) == (100, 0) and _read(s, 2) == (BIG_MAX, 0)
        assert release(s, Tally.big, "order").outcome is Outcome.REPEATED
        s.commit()
