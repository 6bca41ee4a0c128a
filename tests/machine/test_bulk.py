"""Bulk transitions: Trigger.many() and Trigger.where()."""

from __future__ import annotations

import contextlib
import random
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, String, event, func, select, text, update
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker

from stateguard import (
    InvalidArgument,
    Outcome,
    StateguardError,
    StateMachine,
    retry_on_conflict,
)
from stateguard.tables import transition_log
from tests._support.bulk_models import (
    JOIN,
    BOrder,
    BulkBase,
    _conn_id,
    _log,
    _nothing_written,
    _rows,
    _seed,
    _threads,
    _wait_blocked,
)
from tests._support.models import Base, Order, Shipment, SideEffect, Ticket
from tests.conftest import Backend, backends_with, capable, count_statements


def _orders(engine: Any, states: dict[int, str]) -> None:
    with Session(engine) as s, s.begin():
        s.add_all([Order(id=i, status=st) for i, st in states.items()])


def test_many_reports_every_outcome_per_key(backend: Backend) -> None:
    """many() returns APPLIED, REPEATED, REJECTED and NOT_FOUND per key, in the order given."""
    engine = backend.create(Base.metadata)
    _orders(engine, {1: "pending", 2: "pending", 3: "paid", 4: "shipped"})
    with Session(engine) as s, s.begin():
        results = Order.flow.pay.many(s, [4, 1, 99, 3, 2, 1])
    assert list(results) == [4, 1, 99, 3, 2]
    assert {k: r.outcome for k, r in results.items()} == {
        1: Outcome.APPLIED,
        2: Outcome.APPLIED,
        3: Outcome.REPEATED,
        4: Outcome.REJECTED,
        99: Outcome.NOT_FOUND,
    }
    assert results[1].state == "paid" and results[1].version == 2
    assert results[4].state == "shipped"
    with Session(engine) as s:
        assert dict(s.execute(select(Order.id, Order.status).order_by(Order.id)).all()) == {
            1: "paid",
            2: "paid",
            3: "paid",
            4: "shipped",
        }


def test_many_sets_values_and_syncs_loaded_instances(backend: Backend) -> None:
    """values= are written for applied rows only, and loaded instances see the new state and version."""
    engine = backend.create(Base.metadata)
    _orders(engine, {1: "pending", 2: "shipped"})
    with Session(engine) as s, s.begin():
        one = s.get_one(Order, 1)
        Order.flow.pay.many(s, [one, 2], values={"note": "batch", "paid_at": func.now()})
        assert one.status == "paid" and one.version == 2
        assert one.note == "batch" and one.paid_at is not None
        assert s.get_one(Order, 2).note is None


def test_many_is_chunked_and_uses_two_statements_per_chunk_at_most(backend: Backend) -> None:
    """Chunks bound the statement size; each chunk is at most one UPDATE plus one read."""
    engine = backend.create(Base.metadata)
    _orders(engine, {i: ("pending" if i % 2 else "paid") for i in range(1, 51)})
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as c:
            results = Order.flow.pay.many(s, range(1, 51), chunk_size=10)
    assert sum(r.applied for r in results.values()) == 25
    assert sum(r.outcome is Outcome.REPEATED for r in results.values()) == 25
    assert len(c) == 10  # 5 chunks x (UPDATE + read), or (locking read + UPDATE) on MariaDB


def test_many_all_applied_is_one_statement_per_chunk_with_returning(backend: Backend) -> None:
    """When every key applies, PostgreSQL and SQLite need only the UPDATE ... RETURNING."""
    engine = backend.create(Base.metadata)
    _orders(engine, {i: "pending" for i in range(1, 21)})
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as c:
            results = Order.flow.pay.many(s, range(1, 21))
    assert all(r.applied for r in results.values())
    assert len(c) == (1 if capable(backend, "update_returning") else 2)


def test_many_with_composite_keys_and_several_destinations(backend: Backend) -> None:
    """Tuple keys work and a multi-destination trigger reports where each row went."""
    engine = backend.create(Base.metadata)
    with Session(engine) as s, s.begin():
        s.add_all(
            [
                Shipment(warehouse="w", number=1, stage="new"),
                Shipment(warehouse="w", number=2, stage="packed"),
                Shipment(warehouse="w", number=3, stage="sent"),
                Shipment(warehouse="w", number=4, stage="delivered"),
            ]
        )
    with Session(engine) as s, s.begin():
        results = Shipment.flow.advance.many(s, [("w", n) for n in range(1, 6)])
    assert [(r.outcome, r.state) for r in results.values()] == [
        (Outcome.APPLIED, "packed"),
        (Outcome.APPLIED, "sent"),
        (Outcome.REPEATED, "sent"),
        (Outcome.REJECTED, "delivered"),
        (Outcome.NOT_FOUND, None),
    ]


@pytest.mark.hostile
def test_many_rejects_bad_input_without_writing(backend: Backend) -> None:
    """A bad key anywhere in the batch raises InvalidArgument before anything is written."""
    engine = backend.create(Base.metadata)
    _orders(engine, {1: "pending"})
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            Order.flow.pay.many(s, [1, "two"])
        with pytest.raises(InvalidArgument):
            Order.flow.pay.many(s, [1], values={"status": "paid"})
        with pytest.raises(InvalidArgument):
            Order.flow.pay.many(s, [1], chunk_size=0)
        assert s.get_one(Order, 1).status == "pending"


def test_where_sweeps_matching_rows_in_source_states(backend: Backend) -> None:
    """where() transitions the matching rows that are in a source state and returns their keys."""
    engine = backend.create(Base.metadata)
    with Session(engine) as s, s.begin():
        s.add_all([Ticket(id=i, priority=i % 7) for i in range(1, 21)])
        s.add(Ticket(id=21, priority=1, state="closed"))
    with Session(engine) as s, s.begin():
        first = Ticket.flow.close.where(s, Ticket.id > 5, limit=4)
        rest = Ticket.flow.close.where(s, Ticket.id > 0)
    # The declared guard (priority < 5) still applies to a sweep.
    eligible = [i for i in range(1, 21) if i % 7 < 5]
    assert first == [i for i in eligible if i > 5][:4]
    assert sorted(first + rest) == eligible
    with Session(engine) as s:
        closed = s.scalars(select(Ticket.id).where(Ticket.state == "closed").order_by(Ticket.id)).all()
    assert sorted(closed) == sorted([*eligible, 21])


def test_many_is_exact_while_other_workers_move_the_same_rows(backend: Backend) -> None:
    """Concurrent single pays and bulk pays over the same keys: exactly one APPLIED per row in total."""
    engine = backend.create(Base.metadata)
    n_orders, n_single, n_bulk = 60, 8, 4
    _orders(engine, {i: "pending" for i in range(1, n_orders + 1)})
    barrier = threading.Barrier(n_single + n_bulk)
    applied: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def single(worker: int) -> None:
        keys = list(range(1, n_orders + 1))
        random.Random(worker).shuffle(keys)
        try:
            barrier.wait()
            for k in keys:
                with Session(engine) as s, s.begin():
                    r = Order.flow.pay(s, k)
                    if r.applied:
                        s.add(SideEffect(order_id=k, what="pay", worker=f"single-{worker}"))
                        with lock:
                            applied.append(k)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    def bulk(worker: int) -> None:
        keys = list(range(1, n_orders + 1))
        random.Random(100 + worker).shuffle(keys)
        try:
            barrier.wait()
            for start in range(0, n_orders, 15):
                with Session(engine) as s, s.begin():
                    results = Order.flow.pay.many(s, keys[start : start + 15], chunk_size=7)
                    for k, r in results.items():
                        assert r.outcome in (Outcome.APPLIED, Outcome.REPEATED), r
                        if r.applied:
                            s.add(SideEffect(order_id=k, what="pay", worker=f"bulk-{worker}"))
                            with lock:
                                applied.append(k)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=single, args=(i,)) for i in range(n_single)]
    threads += [threading.Thread(target=bulk, args=(i,)) for i in range(n_bulk)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert sorted(applied) == list(range(1, n_orders + 1))
    with Session(engine) as s:
        per_order = dict(
            s.execute(select(SideEffect.order_id, func.count()).group_by(SideEffect.order_id)).all()
        )
        assert per_order == {i: 1 for i in range(1, n_orders + 1)}
        assert set(s.scalars(select(Order.status))) == {"paid"}


def test_where_limit_picks_rows_once_on_postgresql(pg: Backend) -> None:
    """On PostgreSQL the LIMIT .. SKIP LOCKED pick is a MATERIALIZED CTE, evaluated once per statement."""
    engine = pg.create(Base.metadata)
    _orders(engine, {i: "pending" for i in range(1, 6)})
    with Session(engine) as s, s.begin(), count_statements(engine) as sent:
        assert Order.flow.pay.where(s, Order.id > 0, limit=2) == [1, 2]
    [update] = [st for st in sent.statements if st.lstrip().upper().startswith("WITH")]
    assert "AS MATERIALIZED" in update and "FOR UPDATE SKIP LOCKED" in update


def test_where_limit_is_never_exceeded_by_concurrent_sweepers(backend: Backend) -> None:
    """Sweepers with limit=2 race each other and writers of the same rows: no sweep moves more than 2."""
    engine = backend.create(Base.metadata)
    n_orders, n_sweepers, n_touchers, limit = 300, 6, 3, 2
    _orders(engine, {i: "pending" for i in range(1, n_orders + 1)})
    barrier = threading.Barrier(n_sweepers + n_touchers)
    done = threading.Event()
    sizes: list[int] = []
    swept: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def sweep() -> list[int]:
        with Session(engine) as s, s.begin():
            keys: list[int] = Order.flow.pay.where(s, Order.id > 0, limit=limit)
            return keys

    def touch(rnd: random.Random, worker: int) -> bool:
        with Session(engine) as s, s.begin():
            low = s.scalar(select(func.min(Order.id)).where(Order.status == "pending"))
            if low is None:
                return False
            # Core, not the ORM: no version check, just a concurrent write of the row.
            s.execute(update(Order).where(Order.id == low + rnd.randint(0, 3)).values(note=f"t-{worker}"))
            return True

    def pending() -> int:
        with Session(engine) as s:
            return s.scalar(select(func.count()).select_from(Order).where(Order.status == "pending")) or 0

    def sweeper() -> None:
        try:
            barrier.wait()
            # An empty sweep does not mean nothing is left: rows a toucher holds are skipped
            # (SKIP LOCKED), so a sweeper stops only once no pending row remains.
            while (keys := retry_on_conflict(sweep)) or pending():
                with lock:
                    sizes.append(len(keys))
                    swept.extend(keys)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)
        finally:
            done.set()

    def toucher(worker: int) -> None:
        # Concurrent writers of another column of the rows the sweepers pick next.
        rnd = random.Random(worker)
        try:
            barrier.wait()
            while not done.is_set() and retry_on_conflict(lambda: touch(rnd, worker)):
                pass
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=sweeper) for _ in range(n_sweepers)]
    threads += [threading.Thread(target=toucher, args=(i,)) for i in range(n_touchers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors[:3]
    assert max(sizes) <= limit, sorted(sizes)[-5:]
    assert sorted(swept) == list(range(1, n_orders + 1))  # each row by exactly one sweep


def test_many_and_where_read_only_the_named_rows_on_mariadb(mariadb: Backend) -> None:
    """On MariaDB every statement many() and where()'s sweep send that names rows by key is planned as
    lookups on the primary key (EXPLAIN type range/const), never a scan that locks other rows."""
    engine = mariadb.create(Base.metadata)
    _orders(engine, {i: ("paid" if i in (4, 9) else "pending") for i in range(1, 11)})
    sent: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, *args: Any) -> None:
        if statement.lstrip().upper().startswith(("SELECT", "UPDATE")):
            sent.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", record)
    try:
        with Session(engine) as s, s.begin():
            # 7 of 10 rows: left alone, MariaDB's optimizer scans the whole index for these.
            paid = Order.flow.pay.many(s, [1, 2, 4, 5, 6, 7, 8])
            swept = Order.flow.ship.where(s, Order.id > 0)
            cancelled = Order.flow.cancel.many(s, [1, 2, 3, 5, 6, 7, 9, 10])
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert [k for k, r in paid.items() if r.applied] == [1, 2, 5, 6, 7, 8]
    assert swept == [1, 2, 4, 5, 6, 7, 8, 9]
    assert [k for k, r in cancelled.items() if r.applied] == [3, 10]
    by_key = [(st, p) for st, p in sent if " IN (" in st]
    assert len(by_key) == 5  # two (probe + UPDATE) per many(), the sweep's UPDATE
    with engine.connect() as conn:
        for statement, parameters in by_key:
            plans = conn.exec_driver_sql("EXPLAIN " + statement, parameters).mappings().all()
            assert [(p["table"], p["type"], p["key"]) for p in plans] == [("orders", "range", "PRIMARY")], (
                statement,
                plans,
            )


def _wait_until_waiting(engine: Any, name: str, conn_id: int, done: threading.Event) -> None:
    """Poll the server until connection ``conn_id`` waits on a row lock (or ``done`` is set)."""
    if name == "postgresql":
        q = f"SELECT count(*) FROM pg_stat_activity WHERE pid = {conn_id} AND wait_event_type = 'Lock'"
    else:
        q = (
            "SELECT count(*) FROM information_schema.innodb_trx "
            f"WHERE trx_mysql_thread_id = {conn_id} AND trx_state = 'LOCK WAIT'"
        )
    for _ in range(300):
        with engine.connect() as c:
            if c.exec_driver_sql(q).scalar():
                return
        # MariaDB refreshes innodb_trx at most every 0.1 s.
        if done.wait(0.12):
            return


@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_many_waits_for_rows_moved_into_its_source_and_applies_to_them(backend: Backend) -> None:
    """Another transaction holds rows it moved into close's source (a reopen) or made pass its guard
    (priority): the batch waits for them and, after that COMMIT, closes them (APPLIED), however the
    rows stood in the snapshot the batch started from."""
    engine = backend.create(Base.metadata)
    with Session(engine) as s, s.begin():
        s.add_all([Ticket(id=1, state="closed"), Ticket(id=2, state="closed")])
        s.add_all([Ticket(id=3, state="open", priority=9), Ticket(id=4, state="closed")])
    holder = Session(engine)
    holder.begin()
    assert Ticket.flow.reopen(holder, 2).applied
    holder.execute(update(Ticket).where(Ticket.id == 3).values(priority=1))
    out: dict[Any, Any] = {}
    ids: list[int] = []
    started, done = threading.Event(), threading.Event()
    pid = "SELECT pg_backend_pid()" if backend.name == "postgresql" else "SELECT CONNECTION_ID()"

    def batch() -> None:
        with Session(engine) as s, s.begin():
            ids.append(int(s.connection().exec_driver_sql(pid).scalar_one()))
            started.set()
            out.update(Ticket.flow.close.many(s, [1, 2, 3, 4]))
        done.set()

    t = threading.Thread(target=batch)
    t.start()
    try:
        assert started.wait(60)
        _wait_until_waiting(engine, backend.name, ids[0], done)
        waited = not done.is_set()
    finally:
        holder.commit()
        holder.close()
        t.join(60)
    assert done.is_set() and waited
    assert {k: (r.outcome, r.state) for k, r in out.items()} == {
        1: (Outcome.REPEATED, "closed"),
        2: (Outcome.APPLIED, "closed"),
        3: (Outcome.APPLIED, "closed"),
        4: (Outcome.REPEATED, "closed"),
    }
    with Session(engine) as s:
        assert set(s.scalars(select(Ticket.state))) == {"closed"}


class Slot(BulkBase):
    __tablename__ = "bh_slots"
    day: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    code: Mapped[str] = mapped_column(String(20), primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="free")

    flow = StateMachine(
        "status",
        states=["free", "held", "gone"],
        transitions=[["hold", "free", "held"], ["drop", ["free", "held"], "gone"]],
        history=True,
    )


class Tag(BulkBase):
    __tablename__ = "bh_tags"
    name: Mapped[str] = mapped_column(String(400), primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="draft")

    flow = StateMachine(
        "status", states=["draft", "live"], transitions=[["publish", "draft", "live"]], history=True
    )


@pytest.fixture
def db(engine: Engine, backend: Backend) -> Iterator[Backend]:
    backend.create(BulkBase.metadata)
    yield backend


# -- many(): shapes of the key list ------------------------------------------------


def test_many_outcomes_per_key_exact_with_one_log_row_per_applied(db: Backend) -> None:
    engine = db.engine
    _seed(engine, 6)
    with Session(engine) as s, s.begin():
        BOrder.flow.pay(s, 2)
        BOrder.flow.cancel(s, 3)
    with Session(engine) as s, s.begin():
        res = BOrder.flow.pay.many(s, [6, 1, 2, 3, 99, 4], values={"note": "batch"}, metadata={"by": "cron"})
    assert list(res) == [6, 1, 2, 3, 99, 4]  # the order the keys were given
    assert {k: r.outcome for k, r in res.items()} == {
        6: Outcome.APPLIED,
        1: Outcome.APPLIED,
        2: Outcome.REPEATED,
        3: Outcome.REJECTED,
        99: Outcome.NOT_FOUND,
        4: Outcome.APPLIED,
    }
    assert res[3].state == "cancelled" and res[2].state == "paid"
    assert res[1].version == 2 and res[2].version == 2
    rows = _rows(engine)
    assert (
        rows[1] == ("paid", 2, "batch")
        and rows[4] == ("paid", 2, "batch")
        and rows[6] == ("paid", 2, "batch")
    )
    assert (
        rows[2] == ("paid", 2, None) and rows[3] == ("cancelled", 2, None) and rows[5] == ("pending", 1, None)
    )
    bulk = [r for r in _log(engine) if r.meta == {"by": "cron"}]
    assert sorted((r.row_key, r.trigger, r.source, r.dest, r.version) for r in bulk) == [
        (k, "pay", "pending", "paid", 2) for k in ["1", "4", "6"]
    ]


def test_many_duplicate_keys_and_instances_one_result_one_log_row(db: Backend) -> None:
    engine = db.engine
    _seed(engine, 3)
    with Session(engine) as s, s.begin():
        o2 = s.get_one(BOrder, 2)
        res = BOrder.flow.pay.many(s, [3, 1, 3, o2, 2, 1, 2, o2])
        assert set(res) == {1, 2, 3}
        assert all(r.outcome is Outcome.APPLIED for r in res.values())
        assert o2.status == "paid" and o2.version == 2
    assert len(_log(engine)) == 3
    assert sorted(r.row_key for r in _log(engine)) == ["1", "2", "3"]


def test_many_empty_and_generator_inputs(db: Backend) -> None:
    engine = db.engine
    _seed(engine, 4)
    with Session(engine) as s, s.begin():
        assert BOrder.flow.pay.many(s, []) == {}
        assert BOrder.flow.pay.many(s, iter(())) == {}
        res = BOrder.flow.pay.many(s, (k for k in [4, 2]))
    assert {k: r.outcome for k, r in res.items()} == {4: Outcome.APPLIED, 2: Outcome.APPLIED}
    assert len(_log(engine)) == 2


@pytest.mark.hostile
@pytest.mark.parametrize(
    "targets",
    [5, "12", b"12", None, [None], ["1"], [1.5], [True], [2**31], [-(2**31) - 1], [(1, 2)], [object()]],
    ids=[
        "int",
        "str",
        "bytes",
        "None",
        "None-key",
        "str-key",
        "float",
        "bool",
        "int32+1",
        "int32-2",
        "tuple",
        "object",
    ],
)
def test_many_bad_targets_are_invalid_argument_and_nothing_written(db: Backend, targets: Any) -> None:
    engine = db.engine
    _seed(engine, 3)
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            BOrder.flow.pay.many(s, [1, 2, *targets] if isinstance(targets, list) else targets)
        # the transaction stays usable (PostgreSQL would abort it on a refused parameter)
        assert s.execute(select(func.count()).select_from(BOrder)).scalar() == 3
    _nothing_written(engine, 3)


@pytest.mark.limits
def test_many_integer_limits_of_the_key_column(db: Backend) -> None:
    engine = db.engine
    with Session(engine) as s, s.begin():
        s.add_all([BOrder(id=2**31 - 1), BOrder(id=-(2**31))])
    with Session(engine) as s, s.begin():
        res = BOrder.flow.pay.many(s, [2**31 - 1, -(2**31), 0])
    assert [r.outcome for r in res.values()] == [Outcome.APPLIED, Outcome.APPLIED, Outcome.NOT_FOUND]
    assert sorted(r.row_key for r in _log(engine)) == sorted([str(2**31 - 1), str(-(2**31))])


@pytest.mark.hostile
@pytest.mark.parametrize("chunk_size", [0, -1, True, 1.0, None, "10"])
def test_many_bad_chunk_size(db: Backend, chunk_size: Any) -> None:
    engine = db.engine
    _seed(engine, 3)
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            BOrder.flow.pay.many(s, [1, 2, 3], chunk_size=chunk_size)
    _nothing_written(engine, 3)


@pytest.mark.parametrize("chunk_size", [1, 2, 7, 10**9])
def test_many_chunk_sizes_same_exact_result(db: Backend, chunk_size: int) -> None:
    engine = db.engine
    _seed(engine, 15)
    with Session(engine) as s, s.begin():
        BOrder.flow.pay(s, 5)
        BOrder.flow.cancel(s, 9)
    keys = [15, 3, 5, 9, 100, 1, 2, 4, 6, 7, 8, 10, 11, 12, 13, 14, 101]
    with Session(engine) as s, s.begin():
        res = BOrder.flow.pay.many(s, keys, chunk_size=chunk_size, metadata={"c": chunk_size})
    want = {k: Outcome.APPLIED for k in keys}
    want.update({5: Outcome.REPEATED, 9: Outcome.REJECTED, 100: Outcome.NOT_FOUND, 101: Outcome.NOT_FOUND})
    assert {k: r.outcome for k, r in res.items()} == want
    logged = [r for r in _log(engine) if r.meta == {"c": chunk_size}]
    assert len(logged) == 13
    assert {r.dest for r in logged} == {"paid"}


def test_many_with_sql_guard_and_values(db: Backend) -> None:
    engine = db.engine
    _seed(engine, 4)
    with Session(engine) as s, s.begin():
        s.execute(BOrder.__table__.update().where(BOrder.id.in_([2, 4])).values(amount=5))
    with Session(engine) as s, s.begin():
        res = BOrder.flow.approve.many(s, [1, 2, 3, 4], values={"note": "ok", "amount": BOrder.amount + 1})
    assert {k: r.outcome for k, r in res.items()} == {
        1: Outcome.REJECTED,
        2: Outcome.APPLIED,
        3: Outcome.REJECTED,
        4: Outcome.APPLIED,
    }
    with Session(engine) as s:
        got = {o.id: (o.status, o.amount, o.note) for o in s.scalars(select(BOrder))}
    assert got == {
        1: ("pending", 0, None),
        2: ("approved", 6, "ok"),
        3: ("pending", 0, None),
        4: ("approved", 6, "ok"),
    }
    assert sorted(r.row_key for r in _log(engine)) == ["2", "4"]


@pytest.mark.hostile
@pytest.mark.parametrize(
    "values",
    [
        {"note": "x\x00y"},
        {"note": "\ud800"},
        {"note": "x" * 51},
        {"amount": 2**31},
        {"note": 5},
        {"nope": 1},
        {"status": "paid"},
    ],
    ids=["nul", "surrogate", "too-long", "int-overflow", "wrong-type", "unknown-col", "state-col"],
)
def test_many_bad_values_refused_before_anything_written(db: Backend, values: dict[str, Any]) -> None:
    engine = db.engine
    _seed(engine, 3)
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            BOrder.flow.pay.many(s, [1, 2, 3], values=values)
        assert s.execute(select(func.count()).select_from(BOrder)).scalar() == 3
    _nothing_written(engine, 3)


@pytest.mark.hostile
@pytest.mark.parametrize("wrong", ["engine", "connection", "sessionmaker"])
def test_wrong_session_objects(db: Backend, wrong: str) -> None:
    engine = db.engine
    _seed(engine, 2)
    with engine.connect() as conn:
        obj = {"engine": engine, "connection": conn, "sessionmaker": sessionmaker(engine)}[wrong]
        with pytest.raises(InvalidArgument):
            BOrder.flow.pay.many(obj, [1, 2])
        with pytest.raises(InvalidArgument):
            BOrder.flow.pay.where(obj, BOrder.id > 0)
        with pytest.raises(InvalidArgument):
            BOrder.flow.history(obj, 1)
        with pytest.raises(InvalidArgument):
            BOrder.flow.pay(obj, 1, request_id="r")
    _nothing_written(engine, 2)


@pytest.mark.rollback
def test_many_on_session_with_aborted_transaction_writes_nothing(db: Backend) -> None:
    engine = db.engine
    _seed(engine, 2)
    with Session(engine) as s:
        s.begin()
        with pytest.raises(Exception):  # noqa: B017 - any driver error
            s.execute(text("SELECT * FROM no_such_table_bh"))
        try:
            BOrder.flow.pay.many(s, [1, 2], metadata={"x": 1})
        except Exception as error:
            raised: BaseException | None = error
        else:
            raised = None
        print("aborted transaction:", db.name, type(raised), raised)
        if db.name == "postgresql":  # the transaction is aborted there: the call cannot run
            assert raised is not None
        s.rollback()
    _nothing_written(engine, 2)


def test_many_large_batch_crosses_chunks(db: Backend) -> None:
    engine = db.engine
    n = 2500
    _seed(engine, n)
    keys = list(range(1, n + 1))
    random.Random(3).shuffle(keys)
    with Session(engine) as s, s.begin():
        res = BOrder.flow.pay.many(s, [*keys, n + 1, n + 2])
    assert Counter(r.outcome for r in res.values()) == Counter({Outcome.APPLIED: n, Outcome.NOT_FOUND: 2})
    assert len(_log(engine)) == n


# -- many(): concurrency -----------------------------------------------------------


def test_overlapping_many_batches_8_threads_in_different_orders(db: Backend) -> None:
    engine = db.engine
    n = 120
    _seed(engine, n)
    rng = random.Random(11)
    batches = []
    for i in range(8):
        keys = rng.sample(range(1, n + 1), 70)
        if i % 2:
            keys.reverse()
        batches.append(keys)

    def work(i: int, barrier: threading.Barrier) -> dict[int, Outcome]:
        with Session(engine) as s:
            barrier.wait()
            with s.begin():
                res = BOrder.flow.pay.many(s, batches[i], chunk_size=16)
            return {k: r.outcome for k, r in res.items()}

    outs = _threads(8, work)
    applied = Counter(k for o in outs for k, v in o.items() if v is Outcome.APPLIED)
    touched = {k for b in batches for k in b}
    assert set(applied) == touched and set(applied.values()) == {1}
    for o in outs:
        assert set(o.values()) <= {Outcome.APPLIED, Outcome.REPEATED}
    rows = _rows(engine)
    assert {k for k, v in rows.items() if v[0] == "paid"} == touched
    log = _log(engine)
    assert len(log) == len(touched)
    assert Counter(r.row_key for r in log).most_common(1)[0][1] == 1


def _reset(engine: Engine) -> None:
    with engine.begin() as c:
        c.execute(transition_log.delete())
        c.execute(BOrder.__table__.delete())


# README: "every chunk locks its rows in key order, so two overlapping batches cannot deadlock each
# other".  Overlapping many() batches of different triggers (pay / cancel / ship, history=True) all
# commit, and every row's log chain agrees with the row.  (On MariaDB the chunk's UPDATE once scanned
# the whole primary index and locked rows outside the batch out of key order: DeadlockDetected 1213.)
@pytest.mark.cancel
def test_many_pay_and_cancel_racing_history_chains_consistent(db: Backend) -> None:
    engine = db.engine
    n = 60
    for rnd in range(4):
        _reset(engine)
        _seed(engine, n)
        rng = random.Random(5 + rnd)
        plans = [(("pay", "cancel", "ship")[i % 3], rng.sample(range(1, n + 1), 40)) for i in range(9)]

        def work(
            i: int, barrier: threading.Barrier, plans: list[tuple[str, list[int]]] = plans
        ) -> list[tuple[int, str, Outcome, Any]]:
            trigger, keys = plans[i]
            with Session(engine) as s:
                barrier.wait()
                with s.begin():
                    res = getattr(BOrder.flow, trigger).many(s, keys, metadata={"w": i})
                return [(k, trigger, r.outcome, r.state) for k, r in res.items()]

        outs = [x for o in _threads(9, work) for x in o]
        applied = [(k, t, st) for k, t, oc, st in outs if oc is Outcome.APPLIED]
        log = _log(engine)
        assert len(log) == len(applied)
        rows = _rows(engine)
        by_key: dict[str, list[Any]] = {}
        for r in log:
            by_key.setdefault(r.row_key, []).append(r)
        for k in range(1, n + 1):
            chain = by_key.get(str(k), [])
            state, version = "pending", 1
            for e in chain:
                assert e.source == state, (k, chain)
                state, version = e.dest, version + 1
                assert e.version == version
            assert rows[k][:2] == (state, version), (k, chain, rows[k])
        assert Counter((k, t) for k, t, _ in applied) == Counter((int(r.row_key), r.trigger) for r in log)


# README: many()'s outcomes are exact per key while other transactions move some of the same rows: a
# row the batch waited for is judged as that transaction committed it (paid: REPEATED, cancelled:
# REJECTED, refunded back to pending: APPLIED; see test_many_waiting_on_refunded_row_is_applied_...).
@pytest.mark.parametrize("holder_trigger", ["pay", "cancel", "refund"])
@pytest.mark.tables(BulkBase.metadata)
@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_many_waiting_on_held_row_reports_its_committed_outcome(
    backend: Any, engine: Engine, holder_trigger: str
) -> None:
    _seed(engine, 5)
    with Session(engine) as s, s.begin():
        BOrder.flow.pay(s, 3)  # refund needs a paid row
    holder = Session(engine)
    holder.begin()
    want_state = {"pay": "paid", "cancel": "cancelled", "refund": "pending"}[holder_trigger]
    if holder_trigger == "pay":
        r = BOrder.flow.pay(holder, 4)
        key = 4
    else:
        r = getattr(BOrder.flow, holder_trigger)(holder, 3)
        key = 3
    assert r.outcome is Outcome.APPLIED
    done = threading.Event()
    out: dict[int, Any] = {}
    ids: list[int] = []
    started = threading.Event()

    def batch() -> None:
        with Session(engine) as s, s.begin():
            ids.append(_conn_id(s, backend.name))
            started.set()
            out.update(BOrder.flow.pay.many(s, [5, 4, 3, 2, 1]))
        done.set()

    t = threading.Thread(target=batch)
    t.start()
    try:
        assert started.wait(JOIN)
        _wait_blocked(engine, backend.name, ids[0], done)
        assert not done.is_set()
    finally:
        holder.commit()
        holder.close()
        t.join(JOIN)
    assert done.is_set()
    got = {k: r.outcome for k, r in out.items()}
    if holder_trigger == "pay":
        assert got == {
            5: Outcome.APPLIED,
            4: Outcome.REPEATED,
            3: Outcome.REPEATED,
            2: Outcome.APPLIED,
            1: Outcome.APPLIED,
        }
    elif holder_trigger == "cancel":
        assert got == {
            5: Outcome.APPLIED,
            4: Outcome.APPLIED,
            3: Outcome.REJECTED,
            2: Outcome.APPLIED,
            1: Outcome.APPLIED,
        }
    else:  # refunded back to pending while the batch waited: the batch pays it again
        assert got == {k: Outcome.APPLIED for k in [5, 4, 3, 2, 1]}
    assert out[key].state in (want_state, "paid")
    rows = _rows(engine)
    log = _log(engine)
    assert len(log) == sum(1 for v in rows.values() for _ in range(v[1] - 1))


# README: a batch locks only the rows it names.  With row 3 locked by another transaction,
# many([1, 2, 4, 5, 6, 7, 8]) on a 10-row table applies to all seven without waiting for row 3.  (On
# MariaDB the chunk's `UPDATE ... WHERE id IN (...)` once scanned the whole index, waited for row 3 and
# ended LockNotAcquired 1205: what made the overlapping batches above deadlock.)
@pytest.mark.tables(BulkBase.metadata)
@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_many_locks_only_its_own_rows(backend: Any, engine: Engine) -> None:
    _seed(engine, 10)
    other = backend.new_engine(pool_size=1, max_overflow=0)
    holder = Session(engine)
    holder.begin()
    try:
        holder.execute(select(BOrder.id).where(BOrder.id == 3).with_for_update()).all()
        with Session(other) as s, s.begin():
            if backend.name == "postgresql":
                s.execute(text("SET LOCAL lock_timeout = '2s'"))
            else:
                s.execute(text("SET SESSION innodb_lock_wait_timeout = 2"))
            res = BOrder.flow.pay.many(s, [1, 2, 4, 5, 6, 7, 8])
        assert {k: r.outcome for k, r in res.items()} == {k: Outcome.APPLIED for k in [1, 2, 4, 5, 6, 7, 8]}
    finally:
        holder.rollback()
        holder.close()
        other.dispose()
    assert len(_log(engine)) == 7


# -- many(): processes ---------------------------------------------------------------


def _proc_many(url: str, keys: list[int], chunk: int, barrier: Any) -> dict[int, str]:
    """A spawned worker: its own engine, released with the others by ``barrier``."""
    from sqlalchemy import create_engine

    eng = create_engine(url, connect_args={"timeout": 60} if url.startswith("sqlite") else {})
    try:
        with Session(eng) as s:
            barrier.wait(JOIN)
            with s.begin():
                res = BOrder.flow.pay.many(s, keys, chunk_size=chunk, metadata={"p": len(keys)})
            return {k: r.outcome.value for k, r in res.items()}
    finally:
        eng.dispose()


def test_overlapping_many_from_4_processes(db: Backend, procs: Any) -> None:
    manager, pool = procs
    engine = db.engine
    n = 200
    _seed(engine, n)
    rng = random.Random(17)
    batches = [rng.sample(range(1, n + 1), 120) for _ in range(4)]
    barrier = manager.Barrier(4)
    futures = [pool.submit(_proc_many, db.url, b, 13 + i, barrier) for i, b in enumerate(batches)]
    outs = [f.result(timeout=JOIN) for f in futures]
    applied = Counter(k for o in outs for k, v in o.items() if v == "applied")
    touched = {k for b in batches for k in b}
    assert set(applied) == touched and set(applied.values()) == {1}
    assert all(set(o.values()) <= {"applied", "repeated"} for o in outs)
    log = _log(engine)
    assert sorted(int(r.row_key) for r in log) == sorted(touched)
    assert {k for k, v in _rows(engine).items() if v[0] == "paid"} == touched


# README: chunk_size is "keys per UPDATE"; a large one (10**6) works, with history=True too: the log
# rows go in as many INSERTs as the driver's parameter limit needs.  (On PostgreSQL the log INSERT once
# took chunk_size rows x 9 parameters: over 65,535, a raw error.)
@pytest.mark.limits
def test_many_huge_chunk_size_with_history(db: Backend) -> None:
    engine = db.engine
    n = 8000
    _seed(engine, n)
    with Session(engine) as s, s.begin():
        res = BOrder.flow.pay.many(s, range(1, n + 1), chunk_size=10**6, metadata={"m": 1})
    assert all(r.outcome is Outcome.APPLIED for r in res.values()) and len(res) == n
    assert len(_log(engine)) == n


# -- loaded objects and savepoints -------------------------------------------------


def test_loaded_instances_after_many_and_flush(db: Backend) -> None:
    engine = db.engine
    _seed(engine, 4)
    with Session(engine) as other, other.begin():
        BOrder.flow.cancel(other, 3)
    with Session(engine) as s, s.begin():
        objs = {o.id: o for o in s.scalars(select(BOrder).order_by(BOrder.id))}
        res = BOrder.flow.pay.many(s, [1, 2, 3], values={"note": "n"})
        assert res[3].outcome is Outcome.REJECTED
        assert (objs[1].status, objs[1].version, objs[1].note) == ("paid", 2, "n")
        assert (objs[3].status, objs[3].version) == ("cancelled", 2)  # found state synced
        objs[1].amount = 7
        objs[3].amount = 8
        s.flush()  # no StaleDataError: version agrees with the row
    rows = _rows(engine)
    assert (
        rows[1] == ("paid", 3, "n") and rows[3] == ("cancelled", 3, None) and rows[4] == ("pending", 1, None)
    )


@pytest.mark.rollback
def test_savepoint_rolled_back_around_many_expires_synced_instances(db: Backend) -> None:
    engine = db.engine
    _seed(engine, 3)
    with Session(engine) as s, s.begin():
        objs = {o.id: o for o in s.scalars(select(BOrder).order_by(BOrder.id))}
        sp = s.begin_nested()
        res = BOrder.flow.pay.many(s, [1, 2], values={"note": "sp"}, metadata={"sp": True})
        assert all(r.applied for r in res.values())
        assert objs[1].status == "paid" and objs[1].note == "sp"
        sp.rollback()
        assert (objs[1].status, objs[1].version, objs[1].note) == ("pending", 1, None)
        assert (objs[2].status, objs[2].version) == ("pending", 1)
        objs[1].amount = 4  # flush must not write back the rolled-back state
        s.flush()
        assert BOrder.flow.history(s, 1) == []
    rows = _rows(engine)
    assert rows == {1: ("pending", 2, None), 2: ("pending", 1, None), 3: ("pending", 1, None)}
    assert _log(engine) == []


@pytest.mark.rollback
def test_savepoint_released_around_many_keeps_sync(db: Backend) -> None:
    engine = db.engine
    _seed(engine, 2)
    with Session(engine) as s, s.begin():
        o = s.get_one(BOrder, 1)
        with s.begin_nested():
            with s.begin_nested():
                BOrder.flow.pay.many(s, [1, 2])
        assert (o.status, o.version) == ("paid", 2)
        o.note = "after"
        s.flush()
    assert _rows(engine)[1] == ("paid", 3, "after")
    assert len(_log(engine)) == 2


# -- composite and string keys --------------------------------------------------------


ODD_CODES = ["a", "a'b", 'q"q', "x y", "ü", "🙂", "\\", "%_", "-", "20-chars-exactly-abc", "Ω"]


@pytest.mark.hostile
def test_composite_keys_many_history_and_odd_text(db: Backend) -> None:
    engine = db.engine
    with Session(engine) as s, s.begin():
        s.add_all([Slot(day=d, code=c) for d in (1, 2) for c in ODD_CODES])
    keys = [(2, c) for c in ODD_CODES] + [(1, "a"), (2, "a"), (1, "missing"), (3, "a")]
    with Session(engine) as s, s.begin():
        res = Slot.flow.hold.many(s, keys, metadata={"k": "v"})
        assert set(res) == set(keys)
        assert res[(1, "missing")].outcome is Outcome.NOT_FOUND and res[(3, "a")].outcome is Outcome.NOT_FOUND
        assert res[(1, "a")].outcome is Outcome.APPLIED
        assert all(res[(2, c)].outcome is Outcome.APPLIED for c in ODD_CODES)
        dropped = Slot.flow.drop.many(s, [(2, "🙂"), (1, "🙂")])
        assert [r.outcome for r in dropped.values()] == [Outcome.APPLIED, Outcome.APPLIED]
    with Session(engine) as s:
        for c in ODD_CODES:
            h = Slot.flow.history(s, (2, c))
            want = [("hold", "free", "held")] + ([("drop", "held", "gone")] if c == "🙂" else [])
            assert [(e.trigger, e.source, e.dest) for e in h] == want, c
        assert [(e.trigger, e.source) for e in Slot.flow.history(s, (1, "🙂"))] == [("drop", "free")]
        assert Slot.flow.history(s, (1, "b")) == []
    assert len(_log(engine, "bh_slots")) == len(ODD_CODES) + 1 + 2


TAGS = ["plain", "x" * 400, "字" * 300, "🙂" * 100, "a'b\"c\\d", "tab\there", "new\nline", "%_*?", "ẞ"]


def test_string_keys_many_and_history(db: Backend) -> None:
    engine = db.engine
    with Session(engine) as s, s.begin():
        s.add_all([Tag(name=t) for t in TAGS])
    with Session(engine) as s, s.begin():
        res = Tag.flow.publish.many(s, [*reversed(TAGS), "absent", TAGS[0]], metadata={"t": 1})
        assert list(res) == [*reversed(TAGS), "absent"]
        assert res["absent"].outcome is Outcome.NOT_FOUND
        assert all(res[t].outcome is Outcome.APPLIED for t in TAGS)
    with Session(engine) as s, s.begin():
        assert all(r.outcome is Outcome.REPEATED for r in Tag.flow.publish.many(s, TAGS).values())
        for t in TAGS:
            h = Tag.flow.history(s, t)
            assert [(e.trigger, e.source, e.dest, e.metadata) for e in h] == [
                ("publish", "draft", "live", {"t": 1})
            ], t
    assert len(_log(engine, "bh_tags")) == len(TAGS)
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            Tag.flow.publish.many(s, ["plain", "nul\x00"])
        with pytest.raises(InvalidArgument):
            Tag.flow.publish.many(s, ["plain", "\udc00"])
        with pytest.raises(InvalidArgument):
            Tag.flow.publish.many(s, ["plain", 5])


@pytest.mark.hostile
@pytest.mark.parametrize(
    "bad",
    [(1, "a\x00"), (1, "\ud800"), (1,), (1, "a", 2), (2**31, "a"), ("1", "a"), (1, 5), 1],
    ids=["nul", "surrogate", "short", "long", "int-overflow", "str-for-int", "int-for-str", "scalar"],
)
def test_composite_bad_keys_refused(db: Backend, bad: Any) -> None:
    engine = db.engine
    with Session(engine) as s, s.begin():
        s.add(Slot(day=1, code="a"))
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            Slot.flow.hold.many(s, [(1, "a"), bad])
        # a read: refusing the key or finding nothing are both fine, a raw driver error is not
        with contextlib.suppress(InvalidArgument):
            assert Slot.flow.history(s, bad) == []
        assert s.execute(select(func.count()).select_from(Slot)).scalar() == 1
    with Session(engine) as s:
        assert s.get_one(Slot, (1, "a")).status == "free"
    assert _log(engine, "bh_slots") == []


def test_many_rejects_instance_of_another_model(db: Backend) -> None:
    engine = db.engine
    _seed(engine, 2)
    with Session(engine) as s, s.begin():
        s.add(Slot(day=1, code="a"))
    with Session(engine) as s, s.begin():
        slot = s.get_one(Slot, (1, "a"))
        with pytest.raises(InvalidArgument):
            BOrder.flow.pay.many(s, [1, slot])
        with pytest.raises(InvalidArgument):
            BOrder.flow.pay.many(s, [1, BOrder(id=77)])  # transient, no row
    _nothing_written(engine, 2)


def test_errors_are_stateguard_errors(db: Backend) -> None:
    assert issubclass(InvalidArgument, StateguardError) and issubclass(InvalidArgument, ValueError)
