"""Hostile strings and values are refused typed before any statement.

NUL (PostgreSQL refuses it in text), lone surrogates (no UTF-8 for them: the
driver raised UnicodeEncodeError), strings longer than their ``String(n)``
column (PostgreSQL aborts the transaction), NaN / Infinity and deeply nested
or huge metadata (not JSON, or more than the log takes) in keys, values=,
refs and request ids: each is InvalidArgument, nothing is written and the
transaction stays usable, on every backend.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Engine, Integer, Numeric, String, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import (
    InvalidArgument,
    Outcome,
    StateMachine,
    consume_once,
    decrement,
    guarded_update,
    increment,
    insert_once,
    version_column,
)
from stateguard.machine.history import MAX_META_BYTES
from stateguard.tables import transition_log


class _Base(DeclarativeBase):
    pass


class Item(_Base):
    """A str key, a short text column, a counter, a version and a logged machine."""

    __tablename__ = "hostile_items"
    code: Mapped[str] = mapped_column(String(40), primary_key=True)
    note: Mapped[str | None] = mapped_column(String(10))
    qty: Mapped[int] = mapped_column(Integer, default=10)
    price: Mapped[Decimal] = mapped_column(Numeric(12, 2), default=Decimal("5.00"))
    status: Mapped[str] = mapped_column(String(20), default="new")
    version: Mapped[int] = version_column()

    flow = StateMachine(
        "status",
        states=["new", "done"],
        transitions=[["finish", "new", "done"]],
        history=True,
    )


def _seed(s: Session) -> None:
    s.add(Item(code="a"))


pytestmark = pytest.mark.tables(_Base.metadata, seed=_seed)


def _deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


NUL = "x\x00y"
SURROGATE = "x\ud800y"

CALLS: dict[str, Callable[[Session], Any]] = {
    "key-nul": lambda s: Item.flow.finish(s, NUL),
    "key-surrogate": lambda s: Item.flow.finish(s, SURROGATE),
    "values-nul": lambda s: Item.flow.finish(s, "a", values={"note": NUL}),
    "values-surrogate": lambda s: Item.flow.finish(s, "a", values={"note": SURROGATE}),
    "values-too-long": lambda s: Item.flow.finish(s, "a", values={"note": "x" * 11}),
    "many-values-too-long": lambda s: Item.flow.finish.many(s, ["a"], values={"note": "x" * 11}),
    "guarded-update-nul": lambda s: guarded_update(s, Item, "a", {"note": NUL}, expected_version=1),
    "guarded-update-too-long": lambda s: guarded_update(s, Item, "a", {"note": "é" * 11}, expected_version=1),
    "counter-key-surrogate": lambda s: decrement(s, Item.qty, SURROGATE),
    "ref-nul": lambda s: decrement(s, Item.qty, "a", ref=NUL),
    "ref-surrogate": lambda s: decrement(s, Item.qty, "a", ref=SURROGATE),
    "request-id-nul": lambda s: Item.flow.finish(s, "a", request_id=NUL),
    "request-id-surrogate": lambda s: Item.flow.finish(s, "a", request_id=SURROGATE),
    "metadata-nan": lambda s: Item.flow.finish(s, "a", metadata={"score": math.nan}),
    "metadata-inf": lambda s: Item.flow.finish(s, "a", metadata={"score": math.inf}),
    "metadata-deep": lambda s: Item.flow.finish(s, "a", metadata={"deep": _deep(100_000)}),
    "metadata-surrogate": lambda s: Item.flow.finish(s, "a", metadata={"note": SURROGATE}),
    "metadata-huge": lambda s: Item.flow.finish(s, "a", metadata={"blob": "x" * MAX_META_BYTES}),
    "insert-once-nul": lambda s: insert_once(s, Item, {"code": "b", "note": NUL}),
    "insert-once-too-long": lambda s: insert_once(s, Item, {"code": "b", "note": "x" * 11}),
    "insert-once-int-range": lambda s: insert_once(s, Item, {"code": "b", "qty": 2**31}),
    "consume-once-surrogate": lambda s: consume_once(s, "c", SURROGATE),
    # Regression: checked only after the UPDATE, or never.
    "metadata-list": lambda s: Item.flow.finish(s, "a", request_id="r", metadata=["by", "user:12"]),
    "metadata-str": lambda s: Item.flow.finish(s, "a", metadata="by user 12"),
    "metadata-int-key": lambda s: Item.flow.finish(s, "a", metadata={1: 2}),
    "metadata-150-deep": lambda s: Item.flow.finish(s, "a", metadata={"deep": _deep(150)}),
    "values-bytes-for-text": lambda s: Item.flow.finish(s, "a", values={"note": b"x"}),
    "values-int-for-text": lambda s: Item.flow.finish(s, "a", values={"note": 10**60}),
    "insert-once-bytes-key": lambda s: insert_once(s, Item, {"code": b"b"}),
    "guarded-update-int-for-text": lambda s: guarded_update(s, Item, "a", {"note": 7}, expected_version=1),
    "int-by-beyond-numeric-precision": lambda s: increment(s, Item.price, "a", by=10**11),
    "int-floor-beyond-numeric-precision": lambda s: decrement(s, Item.price, "a", by=1, floor=-(10**11)),
}


@pytest.mark.hostile
@pytest.mark.parametrize("call", CALLS.values(), ids=list(CALLS))
def test_hostile_value_is_invalid_argument_and_the_transaction_goes_on(
    engine: Engine, call: Callable[[Session], Any]
) -> None:
    """The call raises InvalidArgument, nothing was written, and the same transaction still works."""
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            call(s)
        assert s.execute(select(func.count()).select_from(Item)).scalar_one() == 1
        assert Item.flow.finish(s, "a", values={"note": "ok"}).outcome is Outcome.APPLIED
    with Session(engine) as s:
        item = s.get(Item, "a")
        assert item is not None and (item.status, item.note, item.qty, item.version) == ("done", "ok", 10, 2)
        assert item.price == Decimal("5.00")
        assert s.execute(select(func.count()).select_from(transition_log)).scalar_one() == 1


@pytest.mark.hostile
def test_values_at_the_column_length_and_non_ascii_text_still_apply(engine: Engine) -> None:
    """Ten characters (CJK too) fit String(10); metadata just under the limit is stored."""
    with Session(engine) as s, s.begin():
        r = Item.flow.finish(s, "a", values={"note": "商" * 10}, metadata={"blob": "x" * 1000})
        assert r.outcome is Outcome.APPLIED
    with Session(engine) as s:
        assert s.get(Item, "a").note == "商" * 10  # type: ignore[union-attr]
