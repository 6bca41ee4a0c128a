"""Integers beyond what their column's type holds are refused before any statement, on every backend.

PostgreSQL refuses an out-of-range bound parameter with an error that aborts
the caller's transaction; MariaDB and SQLite would answer NOT_FOUND for a row
that cannot exist.  stateguard checks every integer that reaches a statement
(primary keys, expected versions, fences, amounts, values) against the range
its column's declared type holds (on SQLite too, so a model tested there
refuses what production refuses), raises InvalidArgument, and the caller's
transaction stays usable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import BigInteger, Engine, Integer, SmallInteger, String, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import (
    InvalidArgument,
    Outcome,
    StateMachine,
    decrement,
    fence_column,
    guarded_update,
    increment,
    reserve,
    row_lock,
    version_column,
)

INT_MAX = 2**31 - 1
BIG_MAX = 2**63 - 1


class _Base(DeclarativeBase):
    pass


class Account(_Base):
    """An INTEGER key, a SMALLINT counter, a BIGINT fence and a version."""

    __tablename__ = "limit_accounts"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    status: Mapped[str] = mapped_column(String(20), default="open")
    small: Mapped[int] = mapped_column(SmallInteger, default=10)
    big: Mapped[int] = mapped_column(BigInteger, default=0)
    version: Mapped[int] = version_column()
    fence: Mapped[int | None] = fence_column()

    flow = StateMachine(
        "status",
        states=["open", "closed"],
        transitions=[["close", "open", "closed"], ["reopen", "closed", "open"]],
    )


class Wide(_Base):
    """BIGINT on the servers, SQLite's INTEGER rowid there: 64-bit keys everywhere."""

    __tablename__ = "limit_wide"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="open")

    flow = StateMachine("status", states=["open", "closed"], transitions=[["close", "open", "closed"]])


def _seed(s: Session) -> None:
    s.add(Account(id=1))
    s.add(Account(id=INT_MAX))
    s.add(Wide(id=2**40))


pytestmark = pytest.mark.tables(_Base.metadata, seed=_seed, stateguard=False)


def _state(engine: Engine) -> list[Any]:
    with Session(engine) as s:
        return list(s.execute(select(Account.id, Account.status, Account.small, Account.version)).all())


def _refused_then_usable(engine: Engine, call: Callable[[Session], Any], needle: str) -> None:
    """``call`` raises InvalidArgument naming ``needle``; the same transaction then works; nothing changed."""
    before = _state(engine)
    with Session(engine) as s, s.begin():
        s.execute(select(func.count()).select_from(Account)).scalar_one()  # the transaction is open
        with pytest.raises(InvalidArgument) as info:
            call(s)
        assert needle in str(info.value) and "nothing was sent" in str(info.value)
        # Still usable: on PostgreSQL an out-of-range parameter would have aborted it.
        assert s.execute(select(func.count()).select_from(Account)).scalar_one() == 2
        s.rollback()
    assert _state(engine) == before


@pytest.mark.limits
@pytest.mark.parametrize("key", [INT_MAX + 1, -(2**31) - 1, 2**63, -(2**63) - 1, 2**70])
def test_a_trigger_refuses_a_key_its_integer_column_cannot_hold(engine: Engine, key: int) -> None:
    """Order.flow.pay(session, 2**31) on an INTEGER key: InvalidArgument, the transaction survives."""
    _refused_then_usable(engine, lambda s: Account.flow.close(s, key), "primary key")


@pytest.mark.limits
def test_the_largest_key_the_column_holds_still_works(engine: Engine) -> None:
    """The boundary itself (2**31 - 1) is a valid key and applies."""
    with Session(engine) as s, s.begin():
        assert Account.flow.close(s, INT_MAX).outcome is Outcome.APPLIED
        assert Account.flow.close(s, -(2**31)).outcome is Outcome.NOT_FOUND


@pytest.mark.limits
def test_a_64_bit_key_of_a_bigint_column_is_accepted_on_every_backend(engine: Engine) -> None:
    """BIGINT (INTEGER with a variant on SQLite) keys up to 2**63 - 1 pass; beyond is refused."""
    with Session(engine) as s, s.begin():
        assert Wide.flow.close(s, 2**40).outcome is Outcome.APPLIED
        assert Wide.flow.close(s, BIG_MAX).outcome is Outcome.NOT_FOUND
        with pytest.raises(InvalidArgument):
            Wide.flow.close(s, BIG_MAX + 1)


@pytest.mark.limits
def test_many_refuses_an_out_of_range_key_before_any_row_moves(engine: Engine) -> None:
    """many() with one key beyond INTEGER: InvalidArgument, key 1 untouched."""
    _refused_then_usable(engine, lambda s: Account.flow.close.many(s, [1, INT_MAX + 1]), "primary key")


@pytest.mark.limits
def test_expected_version_and_fence_beyond_their_columns_are_refused(engine: Engine) -> None:
    """expected_version beyond INTEGER and a fence beyond BIGINT: InvalidArgument."""
    _refused_then_usable(
        engine, lambda s: Account.flow.close(s, 1, expected_version=INT_MAX + 1), "expected_version"
    )
    _refused_then_usable(engine, lambda s: Account.flow.close(s, 1, fence=2**63), "fence")
    _refused_then_usable(
        engine,
        lambda s: guarded_update(s, Account, 1, {"big": 1}, expected_version=2**40),
        "expected_version",
    )


@pytest.mark.limits
def test_values_beyond_their_column_are_refused(engine: Engine) -> None:
    """values={'small': 2**15} on a SMALLINT column, in a trigger and in guarded_update: InvalidArgument."""
    _refused_then_usable(
        engine, lambda s: Account.flow.close(s, 1, values={"small": 2**15}), "values['small']"
    )
    _refused_then_usable(
        engine, lambda s: guarded_update(s, Account, 1, {"big": 2**63}, expected_version=1), "values['big']"
    )


@pytest.mark.limits
def test_counter_amounts_and_bounds_beyond_the_column_are_refused(engine: Engine) -> None:
    """decrement/increment/reserve by more than a SMALLINT holds, or with such a floor: InvalidArgument."""
    _refused_then_usable(engine, lambda s: decrement(s, Account.small, 1, by=2**15), "by")
    _refused_then_usable(engine, lambda s: increment(s, Account.small, 1, by=1, ceiling=2**15), "ceiling")
    _refused_then_usable(engine, lambda s: decrement(s, Account.small, 1, by=1, floor=-(2**15) - 1), "floor")
    _refused_then_usable(engine, lambda s: reserve(s, Account.small, {1: 2**16}, ref="r-1"), "amount")
    _refused_then_usable(engine, lambda s: decrement(s, Account.small, INT_MAX + 1, by=1), "primary key")


@pytest.mark.limits
def test_row_lock_refuses_an_out_of_range_key(engine: Engine) -> None:
    """row_lock on a key beyond INTEGER: InvalidArgument (checked before SQLite's own NotSupported)."""
    _refused_then_usable(engine, lambda s: row_lock(s, Account, INT_MAX + 1), "primary key")
