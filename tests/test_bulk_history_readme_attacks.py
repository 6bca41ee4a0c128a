"""Attacks on the README's "Bulk transitions" and "Transition history" promises.

Trigger.many(), Trigger.where(), history=True, request_id, metadata, HistoryEntry and
flow.history(), plus what "Loaded objects and savepoints" says about them, on SQLite,
PostgreSQL and MariaDB, with real threads released together by barriers.
"""

from __future__ import annotations

import contextlib
import datetime
import random
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Engine, String, func, select, text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from stateguard import (
    InvalidArgument,
    Outcome,
    StateguardError,
    StateMachine,
    version_column,
)
from stateguard.machine.history import HistoryEntry
from stateguard.tables import transition_log
from tests.conftest import Backend, _only

JOIN = 60.0


class Base(DeclarativeBase):
    pass


class BOrder(Base):
    __tablename__ = "bh_orders"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    version: Mapped[int] = version_column()
    amount: Mapped[int] = mapped_column(default=0)
    note: Mapped[str | None] = mapped_column(String(50))

    flow = StateMachine(
        "status",
        states=["pending", "paid", "shipped", "cancelled", "approved"],
        transitions=[
            {"trigger": "pay", "source": "pending", "dest": "paid"},
            {"trigger": "ship", "source": "paid", "dest": "shipped"},
            {"trigger": "cancel", "source": ["pending", "paid"], "dest": "cancelled"},
            {"trigger": "refund", "source": "paid", "dest": "pending"},
            {"trigger": "approve", "source": "pending", "dest": "approved", "where": lambda c: c.amount > 0},
            {"trigger": "renote", "source": "paid", "dest": "paid"},
        ],
        history=True,
    )


class Slot(Base):
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


class Tag(Base):
    __tablename__ = "bh_tags"
    name: Mapped[str] = mapped_column(String(400), primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="draft")

    flow = StateMachine(
        "status", states=["draft", "live"], transitions=[["publish", "draft", "live"]], history=True
    )


class Plain(Base):
    __tablename__ = "bh_plain"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    status: Mapped[str] = mapped_column(String(20), default="new")

    flow = StateMachine("status", states=["new", "done"], transitions=[["finish", "new", "done"]])


@pytest.fixture
def db(engine: Engine, backend: Backend) -> Iterator[Backend]:
    backend.create(Base.metadata)
    yield backend


@pytest.fixture(params=["postgresql", "mariadb"])
def server(request: pytest.FixtureRequest, namespaces: Any) -> Iterator[Backend]:
    from stateguard import create_tables, drop_tables

    for b in _only(request.param, namespaces):
        drop_tables(b.engine)
        create_tables(b.engine)
        b.create(Base.metadata)
        yield b
        drop_tables(b.engine)


# -- helpers -------------------------------------------------------------------


def _seed(engine: Engine, n: int, **kw: Any) -> None:
    with Session(engine) as s, s.begin():
        s.execute(
            BOrder.__table__.insert(),
            [{"id": i, "status": "pending", "version": 1, **kw} for i in range(1, n + 1)],
        )


def _rows(engine: Engine) -> dict[int, tuple[str, int, str | None]]:
    with Session(engine) as s:
        return {
            r.id: (r.status, r.version, r.note)
            for r in s.execute(select(BOrder.id, BOrder.status, BOrder.version, BOrder.note))
        }


def _log(engine: Engine, model: str = "bh_orders") -> list[Any]:
    with Session(engine) as s:
        return list(
            s.execute(
                select(
                    transition_log.c.row_key,
                    transition_log.c.trigger,
                    transition_log.c.source,
                    transition_log.c.dest,
                    transition_log.c.version,
                    transition_log.c.request_id,
                    transition_log.c.meta,
                )
                .where(transition_log.c.model == model)
                .order_by(transition_log.c.id)
            )
        )


def _threads(n: int, work: Callable[[int, threading.Barrier], Any]) -> list[Any]:
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = work(i, barrier)
        except BaseException as error:
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN)
    assert not any(t.is_alive() for t in threads), "a worker hung (deadlock?)"
    assert not errors, errors
    return results


def _nothing_written(engine: Engine, n: int) -> None:
    assert _rows(engine) == {i: ("pending", 1, None) for i in range(1, n + 1)}
    assert _log(engine) == []


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


def test_many_integer_limits_of_the_key_column(db: Backend) -> None:
    engine = db.engine
    with Session(engine) as s, s.begin():
        s.add_all([BOrder(id=2**31 - 1), BOrder(id=-(2**31))])
    with Session(engine) as s, s.begin():
        res = BOrder.flow.pay.many(s, [2**31 - 1, -(2**31), 0])
    assert [r.outcome for r in res.values()] == [Outcome.APPLIED, Outcome.APPLIED, Outcome.NOT_FOUND]
    assert sorted(r.row_key for r in _log(engine)) == sorted([str(2**31 - 1), str(-(2**31))])


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


def _conn_id(session: Session, name: str) -> int:
    q = "SELECT pg_backend_pid()" if name == "postgresql" else "SELECT CONNECTION_ID()"
    return int(session.execute(text(q)).scalar_one())


def _wait_blocked(engine: Engine, name: str, conn_id: int, ready: threading.Event) -> None:
    """Poll the server until connection ``conn_id`` waits on a row lock.

    MariaDB refreshes information_schema.innodb_trx at most every 0.1 s, so the poll waits that
    long between reads (a condition poll, not a sleep hoping for a race)."""
    if name == "postgresql":
        q = f"SELECT count(*) FROM pg_stat_activity WHERE pid = {conn_id} AND wait_event_type = 'Lock'"
    else:
        q = (
            "SELECT count(*) FROM information_schema.innodb_trx "
            f"WHERE trx_mysql_thread_id = {conn_id} AND trx_state = 'LOCK WAIT'"
        )
    for _ in range(300):
        with engine.connect() as c:
            if c.execute(text(q)).scalar():
                return
        if ready.wait(0.12):
            return
    raise AssertionError("the batch never waited on the held row")


# README: many()'s outcomes are exact per key while other transactions move some of the same rows: a
# row the batch waited for is judged as that transaction committed it (paid: REPEATED, cancelled:
# REJECTED, refunded back to pending: APPLIED; see test_many_waiting_on_refunded_row_is_applied_...).
@pytest.mark.parametrize("holder_trigger", ["pay", "cancel", "refund"])
def test_many_waiting_on_held_row_reports_its_committed_outcome(server: Backend, holder_trigger: str) -> None:
    engine = server.engine
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
            ids.append(_conn_id(s, server.name))
            started.set()
            out.update(BOrder.flow.pay.many(s, [5, 4, 3, 2, 1]))
        done.set()

    t = threading.Thread(target=batch)
    t.start()
    try:
        assert started.wait(JOIN)
        _wait_blocked(engine, server.name, ids[0], done)
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
def test_many_locks_only_its_own_rows(server: Backend) -> None:
    engine = server.engine
    _seed(engine, 10)
    other = server.new_engine(pool_size=1, max_overflow=0)
    holder = Session(engine)
    holder.begin()
    try:
        holder.execute(select(BOrder.id).where(BOrder.id == 3).with_for_update()).all()
        with Session(other) as s, s.begin():
            if server.name == "postgresql":
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


# -- where(): sweepers -------------------------------------------------------------


@pytest.mark.parametrize("limit", [0, -1, True, 1.0, "5"])
def test_where_bad_limit(db: Backend, limit: Any) -> None:
    engine = db.engine
    _seed(engine, 3)
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            BOrder.flow.cancel.where(s, BOrder.id > 0, limit=limit)
    _nothing_written(engine, 3)


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


def test_where_skips_rows_locked_by_another_sweeper(server: Backend) -> None:
    engine = server.engine
    _seed(engine, 9)
    other = server.new_engine(pool_size=1, max_overflow=0)
    with Session(engine) as first, first.begin():
        assert BOrder.flow.cancel.where(first, BOrder.id > 0, limit=3) == [1, 2, 3]
        with Session(other) as second, second.begin():
            if server.name == "postgresql":
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


# README: chunk_size is "keys per UPDATE"; a large one (10**6) works, with history=True too: the log
# rows go in as many INSERTs as the driver's parameter limit needs.  (On PostgreSQL the log INSERT once
# took chunk_size rows x 9 parameters: over 65,535, a raw error.)
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


# -- history, request_id, metadata ---------------------------------------------------


def test_history_entries_shape_and_order(db: Backend) -> None:
    engine = db.engine
    _seed(engine, 1)
    rid = uuid.uuid4()
    with Session(engine) as s, s.begin():
        BOrder.flow.pay(s, 1, request_id=rid, metadata={"by": "u:1"})
        BOrder.flow.refund(s, 1)
        BOrder.flow.pay(s, 1, request_id="second")
        BOrder.flow.renote(s, 1, metadata={"n": [1, 2.5, None, True, "ü🙂"]})
        BOrder.flow.cancel(s, 1)
    with Session(engine) as s:
        h = BOrder.flow.history(s, 1)
        assert BOrder.flow.history(s, 999) == []
        assert BOrder.flow.history(s, s.get_one(BOrder, 1)) == h
    assert all(isinstance(e, HistoryEntry) for e in h)
    assert [(e.trigger, e.source, e.dest, e.request_id, e.metadata, e.version) for e in h] == [
        ("pay", "pending", "paid", str(rid), {"by": "u:1"}, 2),
        ("refund", "paid", "pending", None, None, 3),
        ("pay", "pending", "paid", "second", None, 4),
        ("renote", "paid", "paid", None, {"n": [1, 2.5, None, True, "ü🙂"]}, 5),
        ("cancel", "paid", "cancelled", None, None, 6),
    ]
    ats = [e.at for e in h]
    assert all(a is not None for a in ats)


def test_request_id_retry_after_row_moved_on(db: Backend) -> None:
    engine = db.engine
    _seed(engine, 2)
    with Session(engine) as s, s.begin():
        assert BOrder.flow.pay(s, 1, request_id="r1").outcome is Outcome.APPLIED
        assert BOrder.flow.ship(s, 1).outcome is Outcome.APPLIED
    with Session(engine) as s, s.begin():
        again = BOrder.flow.pay(s, 1, request_id="r1")
        assert again.outcome is Outcome.REPEATED and again.same_request
        other = BOrder.flow.pay(s, 1, request_id="r2")
        assert other.outcome is Outcome.REJECTED and not other.same_request
        # the same request id on another row and on another trigger is a different request
        assert BOrder.flow.pay(s, 2, request_id="r1").outcome is Outcome.APPLIED
        assert BOrder.flow.ship(s, 2, request_id="r1").outcome is Outcome.APPLIED
    assert [(r.row_key, r.trigger, r.request_id) for r in _log(engine)] == [
        ("1", "pay", "r1"),
        ("1", "ship", None),
        ("2", "pay", "r1"),
        ("2", "ship", "r1"),
    ]


def test_request_id_retry_after_row_came_back_to_source(db: Backend) -> None:
    engine = db.engine
    _seed(engine, 1)
    with Session(engine) as s, s.begin():
        BOrder.flow.pay(s, 1, request_id="r1")
        BOrder.flow.refund(s, 1)
    with Session(engine) as s, s.begin():
        r = BOrder.flow.pay(s, 1, request_id="r1")
        assert r.outcome is Outcome.REPEATED and r.same_request
    assert _rows(engine)[1][0] == "pending"
    with Session(engine) as s, s.begin():
        assert BOrder.flow.pay(s, 1, request_id="r2").outcome is Outcome.APPLIED
    assert [r.request_id for r in _log(engine)] == ["r1", None, "r2"]


def test_self_loop_retry_recognised_only_by_request_id(db: Backend) -> None:
    engine = db.engine
    _seed(engine, 1)
    with Session(engine) as s, s.begin():
        BOrder.flow.pay(s, 1)
        assert BOrder.flow.renote(s, 1, request_id="n1", values={"note": "a"}).applied
    with Session(engine) as s, s.begin():
        r = BOrder.flow.renote(s, 1, request_id="n1", values={"note": "b"})
        assert r.outcome is Outcome.REPEATED and r.same_request
        assert BOrder.flow.renote(s, 1, values={"note": "c"}).outcome is Outcome.APPLIED
    assert _rows(engine)[1] == ("paid", 4, "c")
    assert [(r.trigger, r.request_id) for r in _log(engine)] == [
        ("pay", None),
        ("renote", "n1"),
        ("renote", None),
    ]


# README: many() "reads back only the keys that did not apply, so outcomes are exact per key even while
# other transactions move some of the same rows".  A row refunded back to 'pending' by a transaction the
# batch waited for is APPLIED.  (On PostgreSQL it was once REJECTED with state 'pending' and left
# unpaid: the UPDATE filtered it on its snapshot's 'paid' version, and the read after found 'pending'.)
@pytest.mark.parametrize("batch_trigger", ["pay", "cancel"])
def test_many_waiting_on_refunded_row_is_applied_not_rejected(server: Backend, batch_trigger: str) -> None:
    """A row moved back into the trigger's source while the batch waited for it must be APPLIED:
    REJECTED with state 'pending' for pay (source 'pending') contradicts the row."""
    engine = server.engine
    _seed(engine, 3)
    with Session(engine) as s, s.begin():
        BOrder.flow.pay.many(s, [1, 2, 3])
        if batch_trigger == "pay":
            BOrder.flow.ship(s, 1)
    holder = Session(engine)
    holder.begin()
    assert BOrder.flow.refund(holder, 2).applied
    out: dict[int, Any] = {}
    ids: list[int] = []
    started, done = threading.Event(), threading.Event()

    def batch() -> None:
        with Session(engine) as s, s.begin():
            ids.append(_conn_id(s, server.name))
            started.set()
            out.update(getattr(BOrder.flow, batch_trigger).many(s, [1, 2, 3]))
        done.set()

    t = threading.Thread(target=batch)
    t.start()
    try:
        assert started.wait(JOIN)
        _wait_blocked(engine, server.name, ids[0], done)
    finally:
        holder.commit()
        holder.close()
        t.join(JOIN)
    assert done.is_set()
    r2 = out[2]
    assert (r2.outcome, r2.state) == (Outcome.APPLIED, "paid" if batch_trigger == "pay" else "cancelled")
    with Session(engine) as s:
        h = BOrder.flow.history(s, 2)
    assert [(e.trigger, e.source, e.dest) for e in h][-2:] == [
        ("refund", "paid", "pending"),
        (batch_trigger, "pending", r2.state),
    ]


def test_same_request_id_racing_after_row_came_back_to_source(server: Backend) -> None:
    """The first call applied and moved the row back (uncommitted); the retry with the same request
    id waits on the row.  After the commit it must end REPEATED (after a retry of the unit of work
    when the log's unique index catches it), never a second application."""
    engine = server.engine
    _seed(engine, 1)
    holder = Session(engine)
    holder.begin()
    assert BOrder.flow.pay(holder, 1, request_id="same").applied
    assert BOrder.flow.refund(holder, 1).applied
    ids: list[int] = []
    started, done = threading.Event(), threading.Event()
    got: list[Any] = []
    attempts: list[str] = []

    def retry() -> None:
        for _ in range(3):
            with Session(engine) as s:
                s.begin()
                ids.append(_conn_id(s, server.name))
                started.set()
                try:
                    r = BOrder.flow.pay(s, 1, request_id="same")
                except StateguardError as error:
                    assert error.retryable, error
                    attempts.append(type(error).__name__)
                    s.rollback()
                    continue
                s.commit()
                got.append(r)
                break
        done.set()

    t = threading.Thread(target=retry)
    t.start()
    try:
        assert started.wait(JOIN)
        _wait_blocked(engine, server.name, ids[0], done)
    finally:
        holder.commit()
        holder.close()
        t.join(JOIN)
    assert len(got) == 1, attempts
    assert got[0].outcome is Outcome.REPEATED and got[0].same_request
    assert _rows(engine)[1][:2] == ("pending", 3)
    assert [(r.trigger, r.request_id) for r in _log(engine)] == [("pay", "same"), ("refund", None)]


def test_same_request_id_from_16_threads_one_application(db: Backend) -> None:
    engine = db.engine
    _seed(engine, 3)
    with Session(engine) as s, s.begin():
        BOrder.flow.pay(s, 2, request_id="old")
        BOrder.flow.refund(s, 2)

    def work(i: int, barrier: threading.Barrier) -> tuple[Outcome, bool, Outcome, bool]:
        with Session(engine) as s:
            barrier.wait()
            with s.begin():
                a = BOrder.flow.pay(s, 1, request_id="same")
            with s.begin():
                b = BOrder.flow.pay(s, 2, request_id="old")
            return a.outcome, a.same_request, b.outcome, b.same_request

    outs = _threads(16, work)
    assert Counter(o[0] for o in outs) == Counter({Outcome.APPLIED: 1, Outcome.REPEATED: 15})
    assert all(o[2] is Outcome.REPEATED and o[3] for o in outs)
    log = _log(engine)
    assert [(r.row_key, r.request_id) for r in log if r.row_key == "1"] == [("1", "same")]
    assert _rows(engine)[2][0] == "pending"


@pytest.mark.parametrize(
    "rid",
    ["", "x" * 201, "a\x00b", "\udc80", 5, b"r", 1.5, ["r"]],
    ids=["empty", "too-long", "nul", "surrogate", "int", "bytes", "float", "list"],
)
def test_bad_request_ids_refused_nothing_written(db: Backend, rid: Any) -> None:
    engine = db.engine
    _seed(engine, 1)
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            BOrder.flow.pay(s, 1, request_id=rid)
        assert s.execute(select(func.count()).select_from(BOrder)).scalar() == 1
    _nothing_written(engine, 1)


def test_request_id_odd_but_valid_text_round_trips(db: Backend) -> None:
    engine = db.engine
    _seed(engine, 4)
    rids = ["x" * 200, "ünï 🙂 '\"\\%_", "R1", "r1 "]
    with Session(engine) as s, s.begin():
        for k, rid in enumerate(rids, 1):
            assert BOrder.flow.pay(s, k, request_id=rid).applied
        BOrder.flow.refund.many(s, [1, 2, 3, 4])
    with Session(engine) as s, s.begin():
        # exact spelling: "R1" and "r1 " are other requests than "r1"
        for k, rid in enumerate(rids, 1):
            r = BOrder.flow.pay(s, k, request_id=rid)
            assert r.outcome is Outcome.REPEATED and r.same_request, rid
        assert BOrder.flow.pay(s, 3, request_id="r1").outcome is Outcome.APPLIED
        assert BOrder.flow.refund(s, 3).applied
        assert BOrder.flow.pay(s, 4, request_id="r1").outcome is Outcome.APPLIED
    with Session(engine) as s:
        assert [e.request_id for e in BOrder.flow.history(s, 2)] == [rids[1], None]


def _nested(depth: int) -> dict[str, Any]:
    d: dict[str, Any] = {"leaf": 1}
    for _ in range(depth - 1):
        d = {"d": d}
    return d


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


# -- composite and string keys --------------------------------------------------------


ODD_CODES = ["a", "a'b", 'q"q', "x y", "ü", "🙂", "\\", "%_", "-", "20-chars-exactly-abc", "Ω"]


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
