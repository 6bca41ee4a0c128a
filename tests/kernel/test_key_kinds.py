"""Keys that are not ints or strs in the counter ledger and the transition log, on every backend.

Regressions checked: an Enum primary key with ``ref=``
was "released" (APPLIED) while nothing was given back (the ledger's JSON
``"Color.red"`` matched no row); on SQLite a Uuid or Date key could never be
released (raw StatementError); the same ref applied three times to one
``NUMERIC(10, 2)`` key spelled ``1.5``, ``1.50`` and ``1.500``; a ref reused
after its release could never be released again (a permanent, "retryable"
SerializationConflict).  Keys are now spelled one way (canonical_key) and
read back as their column's Python type (decode_key).
"""

from __future__ import annotations

import datetime
import enum
import uuid
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Date, Engine, Integer, Numeric, String, Uuid, select
from sqlalchemy import Enum as SAEnum
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import Outcome, StateMachine, decrement, release, reserve


class Color(enum.Enum):
    red = "R"
    blue = "B"


class _Base(DeclarativeBase):
    pass


class ByColor(_Base):
    __tablename__ = "kk_by_color"
    id: Mapped[Color] = mapped_column(SAEnum(Color, native_enum=False), primary_key=True)
    amount: Mapped[int] = mapped_column(Integer)


class ByUuid(_Base):
    __tablename__ = "kk_by_uuid"
    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True)
    amount: Mapped[int] = mapped_column(Integer)


class ByDate(_Base):
    __tablename__ = "kk_by_date"
    id: Mapped[datetime.date] = mapped_column(Date, primary_key=True)
    amount: Mapped[int] = mapped_column(Integer)


class ByPrice(_Base):
    """A NUMERIC(10, 2) key, a counter and a logged machine."""

    __tablename__ = "kk_by_price"
    id: Mapped[Decimal] = mapped_column(Numeric(10, 2), primary_key=True)
    amount: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(20), default="new")

    flow = StateMachine(
        "status", states=["new", "done"], transitions=[["finish", "new", "done"]], history=True
    )


class Plain(_Base):
    __tablename__ = "kk_plain"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    amount: Mapped[int] = mapped_column(Integer)


UID = uuid.UUID("0193a5e4-7c1a-7000-8000-000000000001")
DAY = datetime.date(2026, 11, 24)
KEYS: dict[str, tuple[type[Any], Any]] = {
    "enum": (ByColor, Color.red),
    "uuid": (ByUuid, UID),
    "date": (ByDate, DAY),
    "decimal": (ByPrice, Decimal("1.50")),
}


def _seed(s: Session) -> None:
    s.add_all([ByColor(id=Color.red, amount=10), ByColor(id=Color.blue, amount=10)])
    s.add_all([ByUuid(id=UID, amount=10), ByDate(id=DAY, amount=10), ByPrice(id=Decimal("1.50"), amount=10)])
    s.add_all([Plain(id=1, amount=10), Plain(id=2, amount=10)])


pytestmark = pytest.mark.tables(_Base.metadata, seed=_seed)


def _amount(engine: Engine, model: type[Any], key: Any) -> int:
    with Session(engine) as s:
        return int(s.execute(select(model.amount).where(model.id == key)).scalar_one())


@pytest.mark.parametrize("kind", list(KEYS))
def test_release_gives_back_what_a_refd_decrement_took(engine: Engine, kind: str) -> None:
    """decrement with ref then release: the amount is back, the second release is REPEATED."""
    model, key = KEYS[kind]
    with Session(engine) as s, s.begin():
        assert decrement(s, model.amount, key, by=3, ref="order-1").outcome is Outcome.APPLIED
    assert _amount(engine, model, key) == 7
    with Session(engine) as s, s.begin():
        r = release(s, model.amount, "order-1")
        assert r.outcome is Outcome.APPLIED and r.value == {key: 3}
    with Session(engine) as s, s.begin():
        assert release(s, model.amount, "order-1").outcome is Outcome.REPEATED
    assert _amount(engine, model, key) == 10


def test_reserve_and_release_over_enum_keys(engine: Engine) -> None:
    """reserve orders Enum keys (by value) and release gives both back."""
    with Session(engine) as s, s.begin():
        r = reserve(s, ByColor.amount, {Color.red: 1, Color.blue: 2}, ref="order-2")
        assert r.outcome is Outcome.APPLIED
    with Session(engine) as s, s.begin():
        assert release(s, ByColor.amount, "order-2").value == {Color.red: 1, Color.blue: 2}
    assert _amount(engine, ByColor, Color.red) == _amount(engine, ByColor, Color.blue) == 10


@pytest.mark.parametrize(
    ("model", "spellings"),
    [
        (ByPrice, [Decimal("1.50"), Decimal("1.5"), Decimal("1.500")]),
        (ByPrice, [Decimal("1.50"), 1.5, Decimal("1.500")]),
    ],
    ids=["decimal", "decimal-and-float"],
)
def test_one_ref_applies_once_however_the_key_is_spelled(
    engine: Engine, model: type[Any], spellings: list[Any]
) -> None:
    """The database matches every spelling to one row, so the ledger must too: APPLIED once, then REPEATED."""
    outcomes = []
    for key in spellings:
        with Session(engine) as s, s.begin():
            outcomes.append(decrement(s, model.amount, key, by=3, ref="order-3").outcome)
    assert outcomes == [Outcome.APPLIED] + [Outcome.REPEATED] * (len(spellings) - 1)
    assert _amount(engine, model, spellings[0]) == 7


def test_request_id_is_found_however_a_decimal_key_is_spelled(engine: Engine) -> None:
    """A retry with the same request_id and another spelling of the key is REPEATED with same_request."""
    with Session(engine) as s, s.begin():
        assert ByPrice.flow.finish(s, Decimal("1.50"), request_id="r-1").applied
    with Session(engine) as s, s.begin():
        again = ByPrice.flow.finish(s, Decimal("1.5"), request_id="r-1")
    assert (again.outcome, again.same_request) == (Outcome.REPEATED, True)


def test_a_ref_reused_after_its_release_is_released_again(engine: Engine) -> None:
    """decrement(1, ref) / release / decrement(2, same ref) / release gives row 2 back, then REPEATED."""
    with Session(engine) as s, s.begin():
        assert decrement(s, Plain.amount, 1, by=2, ref="order-9").applied
    with Session(engine) as s, s.begin():
        assert release(s, Plain.amount, "order-9").value == {1: 2}
    with Session(engine) as s, s.begin():
        assert decrement(s, Plain.amount, 2, by=2, ref="order-9").applied
    with Session(engine) as s, s.begin():
        r = release(s, Plain.amount, "order-9")
        assert (r.outcome, r.value) == (Outcome.APPLIED, {2: 2})
    with Session(engine) as s, s.begin():
        assert release(s, Plain.amount, "order-9").outcome is Outcome.REPEATED
    assert _amount(engine, Plain, 1) == _amount(engine, Plain, 2) == 10
