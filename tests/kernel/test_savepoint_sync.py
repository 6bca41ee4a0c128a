"""Loaded objects stay true when a savepoint stateguard wrote in is rolled back.

stateguard makes a loaded instance agree with the row it just wrote.  When the
savepoint around that write is rolled back, the row is back to its old value;
an instance still holding the new one would write it back on its next flush
(a lost update).  The attributes synced inside a rolled-back savepoint are
expired instead, so they reload from the database.
"""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, Integer, String
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import (
    Outcome,
    StateMachine,
    decrement,
    guarded_update,
    idempotent,
    reserve,
    version_column,
)


class _Base(DeclarativeBase):
    pass


class Stock(_Base):
    """Stock with a version (ORM flushes are version-checked) and a state machine."""

    __tablename__ = "sp_stock"
    id: Mapped[int] = mapped_column(primary_key=True)
    amount: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(10), default="open")
    note: Mapped[str | None] = mapped_column(String(20))
    version: Mapped[int] = version_column()

    flow = StateMachine("status", states=["open", "held"], transitions=[["hold", "open", "held"]])


def _seed(s: Session) -> None:
    s.add_all([Stock(id=1, amount=5), Stock(id=2, amount=3)])


pytestmark = pytest.mark.tables(_Base.metadata, seed=_seed)


def _amount(engine: Engine, key: int) -> int:
    with Session(engine) as s:
        return s.get_one(Stock, key).amount


@pytest.mark.rollback
def test_a_reservation_rolled_back_by_its_savepoint_leaves_no_trace_on_loaded_rows(engine: Engine) -> None:
    """The issue's example: reserve ends INSUFFICIENT; a.amount reads 5 again, and +10 stores 15, not 13."""
    with Session(engine) as s, s.begin():
        a = s.get_one(Stock, 1)
        assert a.amount == 5
        r = reserve(s, Stock.amount, {1: 2, 2: 5}, ref="o1")
        assert r.outcome is Outcome.INSUFFICIENT
        assert a.amount == 5
        a.amount += 10
    assert _amount(engine, 1) == 15


@pytest.mark.rollback
def test_a_users_own_savepoint_rolled_back_restores_the_state_and_version(engine: Engine) -> None:
    """A trigger inside session.begin_nested() that is rolled back: state and version reload."""
    with Session(engine) as s, s.begin():
        a = s.get_one(Stock, 1)
        version = a.version
        nested = s.begin_nested()
        assert Stock.flow.hold(s, 1).outcome is Outcome.APPLIED
        assert (a.status, a.version) == ("held", version + 1)
        nested.rollback()
        assert (a.status, a.version) == ("open", version)
        a.note = "after"  # an ORM flush checks the version: it must be the real one
    with Session(engine) as s:
        b = s.get_one(Stock, 1)
        assert (b.status, b.note, b.version) == ("open", "after", version + 1)


@pytest.mark.rollback
def test_a_released_savepoint_keeps_the_sync_until_the_outer_one_rolls_back(engine: Engine) -> None:
    """Inner savepoint released, outer rolled back: the decrement synced inside both is undone too."""
    with Session(engine) as s, s.begin():
        a = s.get_one(Stock, 1)
        outer = s.begin_nested()
        inner = s.begin_nested()
        assert decrement(s, Stock.amount, 1, by=2).value == 3
        inner.commit()
        assert a.amount == 3
        outer.rollback()
        assert a.amount == 5
        a.amount += 1
    assert _amount(engine, 1) == 6


@pytest.mark.rollback
def test_a_committed_savepoint_keeps_what_was_synced(engine: Engine) -> None:
    """Nothing is expired when the savepoint stands: the synced values are the row's."""
    with Session(engine) as s, s.begin():
        a = s.get_one(Stock, 1)
        with s.begin_nested():
            guarded_update(s, Stock, 1, {"note": "kept"}, expected_version=a.version)
        assert a.note == "kept"
    with Session(engine) as s:
        assert s.get_one(Stock, 1).note == "kept"


@pytest.mark.rollback
def test_a_guarded_write_inside_an_idempotent_block_that_raises_is_undone_on_the_instance(
    engine: Engine,
) -> None:
    """idempotent() rolls its savepoint back when the block raises: the loaded stock reads 5 again."""
    with Session(engine) as s, s.begin():
        a = s.get_one(Stock, 1)
        with pytest.raises(RuntimeError):
            with idempotent(s, scope="sp", key="k-1"):
                assert decrement(s, Stock.amount, 1, by=2).applied
                assert a.amount == 3
                raise RuntimeError("payment provider down")
        assert a.amount == 5
        a.amount += 10
    assert _amount(engine, 1) == 15
