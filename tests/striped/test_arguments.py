"""Wrong arguments to the striped counter's calls are InvalidArgument before any statement, and an
async engine or sessionmaker where a Session belongs is a typed error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from stateguard import (
    InvalidArgument,
    Outcome,
    StripedCounter,
)
from tests.conftest import count_statements

LEDGER = "stateguard_counter_ledger"


def check_item(engine: Engine, counter: StripedCounter, item: str, expected: int) -> list[int]:
    with Session(engine) as s:
        total, amounts = counter.total(s, item), counter.stripe_amounts(s, item)
    assert all(a >= 0 for a in amounts), amounts
    assert sum(amounts) == total == expected, (item, total, expected, amounts)
    return amounts


def ledger(engine: Engine, counter: StripedCounter) -> list[tuple[Any, ...]]:
    with Session(engine) as s:
        rows = s.execute(
            text(f"SELECT ref, row_key, delta, released_at FROM {LEDGER} WHERE column_name = :c"),
            {"c": counter.name},
        ).all()
    return [tuple(r) for r in rows]


# ---------------------------------------------------------------- hostile input


HOSTILE: list[tuple[str, Callable[[StripedCounter, Any], Any]]] = [
    ("nul item", lambda c, s: c.decrement(s, "sku\x00", by=1)),
    ("surrogate item", lambda c, s: c.increment(s, "sku\udfff", by=1)),
    ("201 emoji", lambda c, s: c.create(s, "\U0001f600" * 201, amount=1)),
    ("bytes item", lambda c, s: c.decrement(s, b"sku", by=1)),
    ("None item", lambda c, s: c.total(s, None)),
    ("blank item", lambda c, s: c.stripe_amounts(s, " \t\n")),
    ("negative by", lambda c, s: c.decrement(s, "sku", by=-1)),
    ("huge by", lambda c, s: c.decrement(s, "sku", by=2**63)),
    ("huge increment", lambda c, s: c.increment(s, "sku", by=2**64)),
    ("bool by", lambda c, s: c.increment(s, "sku", by=True)),
    ("str by", lambda c, s: c.increment(s, "sku", by="1")),
    ("huge amount", lambda c, s: c.create(s, "new", amount=2**63)),
    ("bool stripes", lambda c, s: c.restripe(s, "sku", stripes=True)),
    ("int ref", lambda c, s: c.decrement(s, "sku", by=1, ref=42)),
    ("nul ref", lambda c, s: c.decrement(s, "sku", by=1, ref="r\x00")),
    ("surrogate ref", lambda c, s: c.release(s, "\ud800")),
    ("blank ref", lambda c, s: c.release(s, "")),
    ("list basket", lambda c, s: c.reserve(s, [("sku", 1)], ref="r")),
    ("zero in basket", lambda c, s: c.reserve(s, {"sku": 1, "other": 0}, ref="r")),
    ("bad key in basket", lambda c, s: c.reserve(s, {"sku": 1, 5: 1}, ref="r")),
    ("float in basket", lambda c, s: c.reserve(s, {"sku": 1.5}, ref="r")),
    (
        "huge basket bad tail",
        lambda c, s: c.reserve(s, {**{f"i{n}": 1 for n in range(500)}, "x": -1}, ref="r"),
    ),
]


@pytest.mark.hostile
@pytest.mark.parametrize("call", [c for _, c in HOSTILE], ids=[n for n, _ in HOSTILE])
def test_hostile_input_is_invalid_argument_and_sends_nothing(engine: Engine, call: Any) -> None:
    c = StripedCounter("hostile", stripes=3)
    with Session(engine) as s, s.begin():
        c.create(s, "sku", amount=7)
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as counted, pytest.raises(InvalidArgument):
            call(c, s)
        assert len(counted) == 0
        # the transaction goes on
        assert c.decrement(s, "sku", by=1).outcome is Outcome.APPLIED
    check_item(engine, c, "sku", 6)
    assert ledger(engine, c) == []


@pytest.mark.hostile
def test_an_async_engine_or_sessionmaker_where_a_session_belongs(engine: Engine) -> None:
    from sqlalchemy.orm import sessionmaker

    c = StripedCounter("wrongobj", stripes=2)
    with Session(engine) as s, s.begin():
        c.create(s, "sku", amount=4)
    factory = sessionmaker(engine)
    with count_statements(engine) as counted:
        for wrong in (factory, engine, "session", 0):
            with pytest.raises(InvalidArgument):
                c.decrement(wrong, "sku", by=1)
            with pytest.raises(InvalidArgument):
                c.reserve(wrong, {"sku": 1}, ref="r")
    assert len(counted) == 0
    check_item(engine, c, "sku", 4)
