"""``Trigger.where()`` sweeps: sweepers racing each other and single transitions move every row once,
a huge limit is clamped or refused typed, the limit follows key order, and locked rows are skipped."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, String, func, select, text
from sqlalchemy.orm import Mapped, Session, mapped_column

from stateguard import (
    InvalidArgument,
    StateMachine,
    retry_on_conflict,
)
from tests._support.bulk_models import (
    BOrder,
    BulkBase,
    _log,
    _nothing_written,
    _rows,
    _seed,
    _threads,
)
from tests._support.token_races import (
    TokenBase,
    _run_threads,
)
from tests.conftest import Backend, backends_with


class SweepOrder(TokenBase):
    """The README sweeper's orders: pending rows cancelled by where(), paid concurrently."""

    __tablename__ = "sg_test_sweep_orders"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    flow = StateMachine(
        "status",
        states=["pending", "paid", "cancelled"],
        transitions=[["pay", "pending", "paid"], ["cancel", "pending", "cancelled"]],
    )


# --------------------------------------------------------------------------
# Insert once / consume_once
# --------------------------------------------------------------------------


@pytest.fixture
def parcels(backend: Backend, engine: Engine) -> Engine:
    return backend.create(TokenBase.metadata)


def test_two_sweepers_and_a_payer_racing_never_move_a_row_twice(parcels: Engine, backend: Backend) -> None:
    """README sweeper, without the lock: two sweepers (where(limit=5) in a loop) and a payer start
    together on 60 pending orders.  No row is cancelled by both sweepers, no paid row is cancelled,
    and what the calls reported is exactly what the table holds."""
    with Session(parcels) as session, session.begin():
        session.add_all([SweepOrder(id=i) for i in range(1, 61)])
    barrier = threading.Barrier(3)

    def sweep_once() -> list[Any]:
        with Session(parcels) as session, session.begin():
            return SweepOrder.flow.cancel.where(session, SweepOrder.id > 0, limit=5)

    def actor(i: int) -> list[Any]:
        barrier.wait()
        moved: list[Any] = []
        if i == 2:
            for key in range(60, 0, -3):
                with Session(parcels) as session, session.begin():
                    if retry_on_conflict(lambda k=key: SweepOrder.flow.pay(session, k)).applied:
                        moved.append(key)
            return moved
        while batch := retry_on_conflict(sweep_once):
            moved.extend(batch)
        return moved

    results = _run_threads(3, actor)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    first, second, paid = results
    assert len(first) == len(set(first)) and len(second) == len(set(second))
    assert not set(first) & set(second), "a row was cancelled by both sweepers"
    assert not (set(first) | set(second)) & set(paid), "a paid row was cancelled"
    with Session(parcels) as session:
        states = dict(session.execute(select(SweepOrder.id, SweepOrder.status)).all())
    assert {k for k, v in states.items() if v == "cancelled"} == set(first) | set(second)
    assert {k for k, v in states.items() if v == "paid"} == set(paid)
    assert "pending" not in states.values()


# Regression: Trigger.where(limit=2**63) (a positive int, as documented) escaped as a raw OverflowError
# (SQLite) / DataError "bigint out of range" (PostgreSQL).  Now clamped like a purge batch.
@pytest.mark.limits
def test_sweep_with_a_huge_limit_is_clamped(parcels: Engine, backend: Backend) -> None:
    with Session(parcels) as session, session.begin():
        session.add_all([SweepOrder(id=1), SweepOrder(id=2)])
    with Session(parcels) as session, session.begin():
        moved = SweepOrder.flow.cancel.where(session, SweepOrder.id > 0, limit=2**63)
    assert sorted(moved) == [1, 2]


@pytest.fixture
def db(engine: Engine, backend: Backend) -> Iterator[Backend]:
    backend.create(BulkBase.metadata)
    yield backend


# -- where(): sweepers -------------------------------------------------------------


@pytest.mark.hostile
@pytest.mark.parametrize("limit", [0, -1, True, 1.0, "5"])
def test_where_bad_limit(db: Backend, limit: Any) -> None:
    engine = db.engine
    _seed(engine, 3)
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            BOrder.flow.cancel.where(s, BOrder.id > 0, limit=limit)
    _nothing_written(engine, 3)


@pytest.mark.limits
@pytest.mark.parametrize("limit", [2**31, 2**63 - 1, 2**63, 10**30])
def test_where_huge_limit_sweeps_all_or_is_refused(db: Backend, limit: int) -> None:
    engine = db.engine
    _seed(engine, 5)
    with Session(engine) as s, s.begin():
        try:
            swept = BOrder.flow.cancel.where(s, BOrder.id > 0, limit=limit)
        except InvalidArgument:
            swept = None
        assert s.execute(select(func.count()).select_from(BOrder)).scalar() == 5
    if swept is None:
        _nothing_written(engine, 5)
    else:
        assert swept == [1, 2, 3, 4, 5]
        assert len(_log(engine)) == 5


@pytest.mark.parametrize("cond", [True, "id > 0", None, 1])
def test_where_condition_must_be_sql(db: Backend, cond: Any) -> None:
    engine = db.engine
    _seed(engine, 3)
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            BOrder.flow.cancel.where(s, cond)
    _nothing_written(engine, 3)


def test_where_limit_in_key_order_and_only_source_rows(db: Backend) -> None:
    engine = db.engine
    _seed(engine, 10)
    with Session(engine) as s, s.begin():
        BOrder.flow.pay(s, 2)
        BOrder.flow.ship(s, 2)
        BOrder.flow.pay(s, 4)
    with Session(engine) as s, s.begin():
        assert BOrder.flow.cancel.where(s, BOrder.id < 9, limit=3) == [1, 3, 4]  # 2 is shipped
        assert BOrder.flow.cancel.where(s, BOrder.id < 9, limit=100) == [5, 6, 7, 8]
        assert BOrder.flow.cancel.where(s, BOrder.id < 9) == []
    log = [r for r in _log(engine) if r.trigger == "cancel"]
    assert [(r.row_key, r.source) for r in log] == [
        ("1", "pending"),
        ("3", "pending"),
        ("4", "paid"),
        ("5", "pending"),
        ("6", "pending"),
        ("7", "pending"),
        ("8", "pending"),
    ]


def test_where_sweepers_racing_each_row_exactly_once(db: Backend) -> None:
    engine = db.engine
    n = 240
    _seed(engine, n)

    def work(i: int, barrier: threading.Barrier) -> list[int]:
        got: list[int] = []
        barrier.wait()
        while True:
            with Session(engine) as s, s.begin():
                keys = BOrder.flow.cancel.where(s, BOrder.id > 0, limit=7)
            got.extend(keys)
            if not keys:
                return got

    outs = _threads(8, work)
    allk = [k for o in outs for k in o]
    assert sorted(allk) == list(range(1, n + 1))
    log = _log(engine)
    assert len(log) == n
    assert sorted(int(r.row_key) for r in log) == list(range(1, n + 1))


def test_where_racing_single_transitions(db: Backend) -> None:
    engine = db.engine
    n = 150
    _seed(engine, n)

    def work(i: int, barrier: threading.Barrier) -> tuple[str, list[int]]:
        barrier.wait()
        if i < 4:
            got = []
            for k in range(1 + i, n + 1, 4):
                with Session(engine) as s, s.begin():
                    if BOrder.flow.pay(s, k, request_id=f"p{k}").applied:
                        got.append(k)
            return "pay", got
        swept: list[int] = []
        while True:
            with Session(engine) as s, s.begin():
                keys = BOrder.flow.cancel.where(s, BOrder.status == "pending", limit=5)
            swept.extend(keys)
            if not keys:
                return "cancel", swept

    outs = _threads(8, work)
    paid = sorted(k for t, ks in outs if t == "pay" for k in ks)
    swept = sorted(k for t, ks in outs if t == "cancel" for k in ks)
    assert not set(paid) & set(swept)
    assert sorted(paid + swept) == list(range(1, n + 1))
    rows = _rows(engine)
    assert {k for k, v in rows.items() if v[0] == "paid"} == set(paid)
    assert {k for k, v in rows.items() if v[0] == "cancelled"} == set(swept)
    log = _log(engine)
    assert len(log) == n
    assert all(r.request_id == f"p{r.row_key}" for r in log if r.trigger == "pay")


@pytest.mark.tables(BulkBase.metadata)
@pytest.mark.parametrize("backend", backends_with("skip_locked"), indirect=True)
def test_where_skips_rows_locked_by_another_sweeper(backend: Any, engine: Engine) -> None:
    _seed(engine, 9)
    other = backend.new_engine(pool_size=1, max_overflow=0)
    with Session(engine) as first, first.begin():
        assert BOrder.flow.cancel.where(first, BOrder.id > 0, limit=3) == [1, 2, 3]
        with Session(other) as second, second.begin():
            if backend.name == "postgresql":
                second.execute(text("SET LOCAL lock_timeout = '5s'"))
            else:
                second.execute(text("SET SESSION innodb_lock_wait_timeout = 5"))
            assert BOrder.flow.cancel.where(second, BOrder.id > 0, limit=3) == [4, 5, 6]
    other.dispose()
    assert [k for k, v in sorted(_rows(engine).items()) if v[0] == "cancelled"] == [1, 2, 3, 4, 5, 6]


# README: where() "transitions the rows matching a condition" (limit None = every matching row) and
# history=True writes one log row per APPLIED one: a sweep of 8,000 rows logs all 8,000.  (On PostgreSQL
# the sweep's log was once one INSERT of 9 parameters a row, over psycopg's 65,535: a raw error.)
def test_where_sweeps_many_rows_in_one_call_with_history(db: Backend) -> None:
    engine = db.engine
    n = 8000
    _seed(engine, n)
    with Session(engine) as s, s.begin():
        swept = BOrder.flow.pay.where(s, BOrder.id > 0)
    assert swept == list(range(1, n + 1))
    assert len(_log(engine)) == n


@pytest.mark.rollback
def test_loaded_instances_after_where_and_rolled_back_savepoint(db: Backend) -> None:
    engine = db.engine
    _seed(engine, 3)
    with Session(engine) as s, s.begin():
        objs = {o.id: o for o in s.scalars(select(BOrder).order_by(BOrder.id))}
        sp = s.begin_nested()
        assert BOrder.flow.cancel.where(s, BOrder.id <= 2, values={"note": "w"}) == [1, 2]
        assert (objs[1].status, objs[1].version, objs[1].note) == ("cancelled", 2, "w")
        sp.rollback()
        assert (objs[1].status, objs[1].version, objs[1].note) == ("pending", 1, None)
        objs[2].amount = 1
        s.flush()
    assert _rows(engine) == {1: ("pending", 1, None), 2: ("pending", 2, None), 3: ("pending", 1, None)}
    assert _log(engine) == []
