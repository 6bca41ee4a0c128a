"""Metadata of history entries: a bad value is a typed error that writes nothing, edge values round
trip or are refused cleanly, nesting past MariaDB's JSON depth is refused, and metadata without
history=True is InvalidArgument, on every backend."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Engine, String, func, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from stateguard import (
    InvalidArgument,
    StateMachine,
)
from tests._support.bulk_models import (
    BOrder,
    BulkBase,
    _nothing_written,
    _seed,
)
from tests.conftest import Backend


class Plain(BulkBase):
    __tablename__ = "bh_plain"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    status: Mapped[str] = mapped_column(String(20), default="new")

    flow = StateMachine("status", states=["new", "done"], transitions=[["finish", "new", "done"]])


@pytest.fixture
def db(engine: Engine, backend: Backend) -> Iterator[Backend]:
    backend.create(BulkBase.metadata)
    yield backend


@pytest.mark.hostile
def test_metadata_without_history_is_invalid_argument(db: Backend) -> None:
    engine = db.engine
    with Session(engine) as s, s.begin():
        s.add(Plain(id=1))
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            Plain.flow.finish.many(s, [1], metadata={"a": 1})
        with pytest.raises(InvalidArgument):
            Plain.flow.finish(s, 1, request_id="r1")
    with Session(engine) as s:
        assert s.get_one(Plain, 1).status == "new"


def _nested(depth: int) -> dict[str, Any]:
    d: dict[str, Any] = {"leaf": 1}
    for _ in range(depth - 1):
        d = {"d": d}
    return d


@pytest.mark.hostile
@pytest.mark.parametrize(
    "meta",
    [
        {"big": "x" * (1 << 20)},
        _nested(101),
        {"s": {1, 2}},
        {"o": object()},
        {"nan": float("nan")},
        {"inf": float("inf")},
        {1: "int key"},
        {"u": "\ud83d"},
        {"\udfff": "surrogate key"},
        ["not", "a", "mapping"],
        "text",
        {"b": b"bytes"},
        {"d": Decimal("1.5")},
        {"t": datetime.datetime(2026, 1, 1)},
        {"u": uuid.UUID(int=1)},
    ],
    ids=[
        "huge",
        "deep",
        "set",
        "object",
        "nan",
        "inf",
        "int-key",
        "surrogate",
        "surrogate-key",
        "list",
        "str",
        "bytes",
        "decimal",
        "datetime",
        "uuid",
    ],
)
def test_bad_metadata_typed_error_nothing_written(db: Backend, meta: Any) -> None:
    engine = db.engine
    _seed(engine, 2)
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            BOrder.flow.pay(s, 1, metadata=meta)
        with pytest.raises(InvalidArgument):
            BOrder.flow.pay.many(s, [1, 2], metadata=meta)
        assert s.execute(select(func.count()).select_from(BOrder)).scalar() == 2
    _nothing_written(engine, 2)


def _pay_with_metadata(engine: Engine, meta: Any) -> bool:
    """pay(1) and pay.many([2]) with ``meta``: True when refused (InvalidArgument, nothing written),
    False when both stored it exactly."""
    with Session(engine) as s, s.begin():
        try:
            BOrder.flow.pay(s, 1, metadata=meta)
            BOrder.flow.pay.many(s, [2], metadata=meta)
        except InvalidArgument:
            refused = True
        else:
            refused = False
    if refused:
        _nothing_written(engine, 2)
        return True
    with Session(engine) as s:
        assert BOrder.flow.history(s, 1)[0].metadata == meta
        assert BOrder.flow.history(s, 2)[0].metadata == meta
    return False


@pytest.mark.parametrize(
    "meta",
    [
        {"nul": "a\x00b"},
        {"k\x00": 1},
        _nested(30),
        {"big": "y" * ((1 << 20) - 64)},
        {"odd": "\u2028\u2029\ufeff\U0010ffff", "e": "", "z": 0, "neg": -(2**63), "f": 1e308},
        {"big": 2**70, "tiny": 1e-320, "list": [[[]]], "nested": [{"a": [{"b": None}]}]},
        {},
    ],
    ids=["nul-value", "nul-key", "deep-30", "near-1MiB", "odd-unicode", "numbers", "empty"],
)
def test_edge_metadata_round_trips_or_is_refused_cleanly(db: Backend, meta: Any) -> None:
    """Valid JSON: stored exactly (or, if a database cannot store it, InvalidArgument, nothing written)."""
    engine = db.engine
    _seed(engine, 2)
    _pay_with_metadata(engine, meta)


# README (Reliability, limits): transition metadata nested too deep is InvalidArgument, nothing written,
# on every backend.  (stateguard once allowed 100 levels, and MariaDB's JSON CHECK (JSON_VALID), which
# takes 32, refused the log row with a raw OperationalError 4025 after the UPDATE ran.)
@pytest.mark.parametrize("depth", [33, 60, 100])
def test_metadata_nested_past_mariadb_json_depth(db: Backend, depth: int) -> None:
    engine = db.engine
    _seed(engine, 2)
    meta = _nested(depth)
    assert _pay_with_metadata(engine, meta), f"metadata {depth} levels deep was stored"
