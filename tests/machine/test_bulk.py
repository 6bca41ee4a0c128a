"""Bulk transitions: Trigger.many() and Trigger.where()."""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest
from sqlalchemy import event, func, select, update
from sqlalchemy.orm import Session

from stateguard import InvalidArgument, Outcome, retry_on_conflict
from tests._support.models import Base, Order, Shipment, SideEffect, Ticket
from tests.conftest import Backend, count_statements


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
    assert len(c) == (2 if backend.name == "mariadb" else 1)


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

    def sweeper() -> None:
        try:
            barrier.wait()
            while keys := retry_on_conflict(sweep):
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


@pytest.mark.parametrize("server", ["pg", "mariadb"])
def test_many_waits_for_rows_moved_into_its_source_and_applies_to_them(
    server: str, request: pytest.FixtureRequest
) -> None:
    """Another transaction holds rows it moved into close's source (a reopen) or made pass its guard
    (priority): the batch waits for them and, after that COMMIT, closes them (APPLIED), however the
    rows stood in the snapshot the batch started from."""
    backend: Backend = request.getfixturevalue(server)
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
