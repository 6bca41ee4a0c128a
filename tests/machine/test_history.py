"""Transition history: one log row per APPLIED transition, request-id repeat detection."""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from stateguard import InvalidArgument, Outcome, SerializationConflict, retry_on_conflict
from stateguard.tables import create_tables, drop_tables, transition_log
from tests._support.models import Base, Invoice, Order
from tests.conftest import Backend, count_statements


@pytest.fixture
def engine(backend: Backend) -> Any:
    eng = backend.create(Base.metadata)
    create_tables(eng)
    with eng.begin() as conn:
        conn.execute(transition_log.delete())
    yield eng
    drop_tables(eng)


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
