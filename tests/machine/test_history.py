"""Transition history: one log row per APPLIED transition, request-id repeat detection."""

from __future__ import annotations

import random
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from stateguard import (
    InvalidArgument,
    Outcome,
    SerializationConflict,
    StateguardError,
    retry_on_conflict,
)
from stateguard.machine.history import HistoryEntry
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
from tests._support.models import Base, Invoice, Order
from tests.conftest import Backend, backends_with, count_statements

pytestmark = pytest.mark.tables(Base.metadata)


def _invoices(engine: Any, n: int) -> None:
    with Session(engine) as s, s.begin():
        s.add_all([Invoice(id=i) for i in range(1, n + 1)])


def _log_count(engine: Any) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(transition_log)).scalar_one())


def test_applied_transitions_are_logged_in_order_with_real_sources(engine: Any) -> None:
    """Each APPLIED call writes one row; the source of a multi-source trigger is the real previous state."""
    _invoices(engine, 1)
    with Session(engine) as s, s.begin():
        assert Invoice.flow.send(s, 1, request_id="r1", metadata={"by": "user:12"}).applied
        assert Invoice.flow.pay(s, 1).applied
        assert Invoice.flow.void(s, 1, request_id="r3").applied
        assert not Invoice.flow.pay(s, 1).applied  # REJECTED: writes nothing
        assert Invoice.flow.reopen(s, 1).applied
        assert Invoice.flow.void(s, 1).applied
    with Session(engine) as s:
        entries = Invoice.flow.history(s, 1)
    assert [(e.trigger, e.source, e.dest) for e in entries] == [
        ("send", "draft", "sent"),
        ("pay", "sent", "paid"),
        ("void", "paid", "void"),
        ("reopen", "void", "draft"),
        ("void", "draft", "void"),
    ]
    assert entries[0].request_id == "r1" and entries[0].metadata == {"by": "user:12"}
    assert [e.version for e in entries] == [2, 3, 4, 5, 6]
    assert all(e.at is not None for e in entries)


def test_request_id_repeat_is_exact_after_the_row_moved_on(engine: Any) -> None:
    """A retried request reports REPEATED even after later transitions; another request id is REJECTED."""
    _invoices(engine, 1)
    with Session(engine) as s, s.begin():
        Invoice.flow.send(s, 1, request_id="req-send")
        Invoice.flow.pay(s, 1, request_id="req-pay")
    with Session(engine) as s, s.begin():
        Invoice.flow.void(s, 1)
        Invoice.flow.reopen(s, 1)
    with Session(engine) as s, s.begin():
        # The row is back in 'draft', a source of 'send': without the log a retry would apply again.
        again = Invoice.flow.send(s, 1, request_id="req-send")
        assert again.outcome is Outcome.REPEATED and again.state == "sent"
        other = Invoice.flow.pay(s, 1, request_id="req-other")
        assert other.outcome is Outcome.REJECTED and other.state == "draft"
        retried = Invoice.flow.pay(s, 1, request_id="req-pay")
        assert retried.outcome is Outcome.REPEATED
    assert _log_count(engine) == 4


def test_history_statement_counts(engine: Any) -> None:
    """Single source: UPDATE + log INSERT; a request id adds a lookup; several sources add a locked read."""
    _invoices(engine, 3)
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as c:
            Invoice.flow.send(s, 1)
        assert len(c) == 2
        with count_statements(engine) as c:
            Invoice.flow.send(s, 2, request_id="x")
        assert len(c) == 3
        with count_statements(engine) as c:
            Invoice.flow.void(s, 3)
        assert len(c) == 3


def test_bulk_transitions_log_in_one_insert(engine: Any) -> None:
    """many() writes the log rows of a chunk with one multi-row INSERT, with the real sources."""
    _invoices(engine, 6)
    with Session(engine) as s, s.begin():
        Invoice.flow.send.many(s, [1, 2, 3])
        Invoice.flow.pay(s, 3)
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as c:
            results = Invoice.flow.void.many(s, [1, 3, 4, 99], metadata={"batch": 7})
        inserts = [x for x in c.statements if x.lstrip().upper().startswith("INSERT")]
        assert len(inserts) == 1
    assert {k: r.outcome for k, r in results.items()} == {
        1: Outcome.APPLIED,
        3: Outcome.APPLIED,
        4: Outcome.APPLIED,
        99: Outcome.NOT_FOUND,
    }
    with Session(engine) as s:
        assert [(e.source, e.metadata) for e in Invoice.flow.history(s, 3)][-1] == ("paid", {"batch": 7})
        assert Invoice.flow.history(s, 4)[-1].source == "draft"
        assert Invoice.flow.history(s, 1)[-1].source == "sent"
    assert _log_count(engine) == 3 + 1 + 3


def test_history_is_off_by_default_and_inputs_are_checked(engine: Any) -> None:
    """request_id on a machine without history, or a bad request id, is InvalidArgument."""
    with Session(engine) as s, s.begin():
        s.add(Order(id=1))
        s.flush()
        with pytest.raises(InvalidArgument):
            Order.flow.pay(s, 1, request_id="r")
        with pytest.raises(InvalidArgument):
            Order.flow.history(s, 1)
        s.add(Invoice(id=1))
        s.flush()
        with pytest.raises(InvalidArgument):
            Invoice.flow.send(s, 1, request_id="")
        with pytest.raises(InvalidArgument):
            Invoice.flow.send(s, 1, metadata={"x": object()})
        assert s.get_one(Invoice, 1).status == "draft"


def test_log_rows_equal_applied_count_under_a_16_thread_storm(engine: Any, backend: Backend) -> None:
    """16 threads fire send/pay/void/reopen at shared rows: log rows == APPLIED results, and sources chain."""
    n_rows, n_threads, per_thread = 10, 16, 25
    _invoices(engine, n_rows)
    barrier = threading.Barrier(n_threads)
    applied: list[tuple[int, str]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rnd = random.Random(seed)
        try:
            barrier.wait()
            for _ in range(per_thread):
                key = rnd.randint(1, n_rows)
                trig = rnd.choice(["send", "pay", "void", "reopen"])

                def unit(trig: str = trig, key: int = key) -> Any:
                    with Session(engine) as s, s.begin():
                        return Invoice.flow.fire(s, trig, key)

                r = retry_on_conflict(unit, attempts=20, backoff=0.005)
                if r.applied:
                    with lock:
                        applied.append((key, trig))
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert _log_count(engine) == len(applied)
    with Session(engine) as s:
        for key in range(1, n_rows + 1):
            entries = Invoice.flow.history(s, key)
            # Each entry starts where the previous one ended: the logged sources are the real ones.
            state = "draft"
            for e in entries:
                assert e.source == state, (key, [(x.trigger, x.source, x.dest, x.version) for x in entries])
                state = e.dest
            assert s.get_one(Invoice, key).status == state
            assert sorted(e.trigger for e in entries) == sorted(t for k, t in applied if k == key)


def test_same_request_racing_after_a_cycle_is_refused_by_the_unique_index(engine: Any) -> None:
    """A logged request id can never be logged twice: the unique index refuses the second insert."""
    _invoices(engine, 1)
    with Session(engine) as s, s.begin():
        Invoice.flow.send(s, 1, request_id="dup")
    with Session(engine) as s, pytest.raises(SerializationConflict), s.begin():
        from stateguard.machine import history

        conn = s.connection()
        history.record(conn, Invoice.flow.send, [((1,), "draft", "sent", 9)], "dup", None)


def test_log_rows_of_a_batch_that_outgrow_one_insert_are_all_written(engine: Any) -> None:
    """where() over 7,300 rows (9 parameters each: over psycopg's 65,535 for one statement) and many()
    with 500 KB of metadata on 40 rows (20 MB: over MariaDB's 16 MiB packet) log every row, in several
    INSERTs, with its metadata."""
    n = 7300
    with engine.begin() as conn:
        conn.execute(
            Invoice.__table__.insert(), [{"id": i, "status": "draft", "version": 1} for i in range(1, n + 1)]
        )
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as c:
            assert len(Invoice.flow.send.where(s, Invoice.id > 0)) == n
        assert len([x for x in c.statements if "stateguard_transition_log" in x]) > 1
    assert _log_count(engine) == n
    blob = {"blob": "é" * 250_000}
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as c:
            results = Invoice.flow.pay.many(s, range(1, 41), metadata=blob)
        assert all(r.applied for r in results.values())
        assert len([x for x in c.statements if "stateguard_transition_log" in x]) > 1
    with Session(engine) as s:
        assert all(Invoice.flow.history(s, k)[-1].metadata == blob for k in (1, 20, 40))
    assert _log_count(engine) == n + 40


def _nested(containers: int, innermost: Any) -> Any:
    value = innermost
    for i in range(containers):
        value = {"d": value} if i % 2 else [value]
    return value


@pytest.mark.parametrize(
    ("meta", "stored"),
    [
        ({"d": _nested(30, 1)}, True),  # 31 levels of objects and lists: MariaDB's JSON depth 32
        ({"d": _nested(29, [])}, True),
        ({"d": _nested(31, 1)}, False),
        ({"d": _nested(30, {})}, False),
        ({"d": _nested(99, 1)}, False),
    ],
    ids=["31-levels", "31-levels-empty-innermost", "32-levels", "32-levels-empty-innermost", "100-levels"],
)
def test_metadata_depth_limit_is_the_same_on_every_backend(engine: Any, meta: Any, stored: bool) -> None:
    """Metadata of 31 nested objects/lists is logged and read back on every backend (MariaDB's JSON
    column included); 32 is InvalidArgument before any statement, on every backend, nothing written."""
    _invoices(engine, 2)
    with Session(engine) as s, s.begin():
        if stored:
            Invoice.flow.send(s, 1, metadata=meta)
            Invoice.flow.send.many(s, [2], metadata=meta)
        else:
            with count_statements(engine) as c:
                with pytest.raises(InvalidArgument, match="nests deeper than 31 levels"):
                    Invoice.flow.send(s, 1, metadata=meta)
                with pytest.raises(InvalidArgument, match="nests deeper than 31 levels"):
                    Invoice.flow.send.many(s, [2], metadata=meta)
            assert c.statements == []
    with Session(engine) as s:
        assert [e.metadata for k in (1, 2) for e in Invoice.flow.history(s, k)] == (
            [meta, meta] if stored else []
        )
        assert set(s.scalars(select(Invoice.status))) == {"sent" if stored else "draft"}


@pytest.fixture
def db(engine: Engine, backend: Backend) -> Iterator[Backend]:
    backend.create(BulkBase.metadata)
    yield backend


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
@pytest.mark.tables(BulkBase.metadata)
@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_many_waiting_on_refunded_row_is_applied_not_rejected(
    backend: Any, engine: Engine, batch_trigger: str
) -> None:
    """A row moved back into the trigger's source while the batch waited for it must be APPLIED:
    REJECTED with state 'pending' for pay (source 'pending') contradicts the row."""
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
            ids.append(_conn_id(s, backend.name))
            started.set()
            out.update(getattr(BOrder.flow, batch_trigger).many(s, [1, 2, 3]))
        done.set()

    t = threading.Thread(target=batch)
    t.start()
    try:
        assert started.wait(JOIN)
        _wait_blocked(engine, backend.name, ids[0], done)
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


@pytest.mark.tables(BulkBase.metadata)
@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_same_request_id_racing_after_row_came_back_to_source(backend: Any, engine: Engine) -> None:
    """The first call applied and moved the row back (uncommitted); the retry with the same request
    id waits on the row.  After the commit it must end REPEATED (after a retry of the unit of work
    when the log's unique index catches it), never a second application."""
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
                ids.append(_conn_id(s, backend.name))
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
        _wait_blocked(engine, backend.name, ids[0], done)
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


@pytest.mark.hostile
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


@pytest.mark.hostile
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
