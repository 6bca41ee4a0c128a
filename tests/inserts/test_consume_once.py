"""consume_once() under real races and rollbacks, on every backend: twins from a barrier consume a
message once, redeliveries waiting on a failed handler apply once, a duplicate leaves the transaction
usable, a rolled-back savepoint makes the message consumable again, and ids compare exactly."""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, String, func, select, text
from sqlalchemy.orm import Mapped, Session, mapped_column

from stateguard import (
    Outcome,
    consume_once,
    consume_token,
    retry_on_conflict,
)
from stateguard.exceptions import DeadlockDetected, SerializationConflict
from stateguard.tables import consumed_messages
from tests._support.token_races import (
    TokenBase,
    _issue,
    _outcomes,
    _run_threads,
)
from tests.conftest import Backend, capable


class Parcel(TokenBase):
    """A consumer's business write, next to consume_once in one transaction."""

    __tablename__ = "sg_test_parcels"
    message_id: Mapped[str] = mapped_column(String(100), primary_key=True)


# --------------------------------------------------------------------------
# Insert once / consume_once
# --------------------------------------------------------------------------


@pytest.fixture
def parcels(backend: Backend, engine: Engine) -> Engine:
    return backend.create(TokenBase.metadata)


def test_twins_racing_from_a_barrier_consume_a_message_once(parcels: Engine, backend: Backend) -> None:
    """8 deliveries of one message, released together, each holding its transaction 0.2 s after
    consume_once: exactly one APPLIED (one parcel), 7 REPEATED, no error."""
    barrier = threading.Barrier(8)

    def deliver(i: int) -> Any:
        with Session(parcels) as session, session.begin():
            session.connection()
            barrier.wait()
            result = consume_once(session, "warehouse", "msg-1")
            if result.applied:
                session.add(Parcel(message_id="msg-1"))
            time.sleep(0.2)
            return result

    outcomes = _outcomes(_run_threads(8, deliver))
    assert outcomes == Counter({"APPLIED": 1, "REPEATED": 7}), outcomes
    with Session(parcels) as session:
        assert session.query(Parcel).count() == 1


def test_redeliveries_waiting_on_a_failed_handler_apply_exactly_once(
    parcels: Engine, backend: Backend
) -> None:
    """The first handler consumed the message and fails (rolls back) while 5 redeliveries wait on its
    key.  Exactly one must handle it; the others are REPEATED or, on MariaDB, a typed retryable
    DeadlockDetected (InnoDB's duplicate-key S-lock deadlock) whose retry is REPEATED: one parcel."""
    holder = Session(parcels)
    holder.begin()
    assert consume_once(holder, "warehouse", "msg-2").applied
    barrier = threading.Barrier(6)
    attempts: list[Any] = []

    def handle() -> bool:
        with Session(parcels) as session, session.begin():
            result = consume_once(session, "warehouse", "msg-2")
            if result.applied:
                session.add(Parcel(message_id="msg-2"))
            return result.applied

    def redeliver(i: int) -> Any:
        barrier.wait()
        try:
            first = handle()
        except BaseException as error:
            attempts.append(error)
            return retry_on_conflict(handle)
        attempts.append(first)
        return first

    runner_results: list[Any] = []
    runner = threading.Thread(target=lambda: runner_results.extend(_run_threads(5, redeliver)))
    runner.start()
    barrier.wait()
    time.sleep(0.5)
    assert runner.is_alive(), "redeliveries did not wait for the first handler's key"
    holder.rollback()
    holder.close()
    runner.join(120)
    assert [r for r in runner_results if isinstance(r, BaseException)] == []
    assert sorted(runner_results) == [False, False, False, False, True]
    errors = [a for a in attempts if isinstance(a, BaseException)]
    allowed = (DeadlockDetected,) if capable(backend, "duplicate_inserts_deadlock") else ()
    assert all(isinstance(e, allowed) and e.retryable for e in errors), errors
    with Session(parcels) as session:
        assert session.query(Parcel).count() == 1


def test_a_duplicate_leaves_the_transaction_usable(parcels: Engine, backend: Backend) -> None:
    """Inside one open transaction: APPLIED, then REPEATED for the same message, a NOT_FOUND token, an
    expired-token REJECTED, then more writes: everything before and after commits (PostgreSQL would
    refuse every later statement if any of these had failed inside the transaction)."""
    expired = _issue(parcels, "t", timedelta(milliseconds=1))
    time.sleep(0.01)
    with Session(parcels) as session, session.begin():
        session.add(Parcel(message_id="before"))
        assert consume_once(session, "billing", "m").applied
        assert consume_once(session, "billing", "m").outcome is Outcome.REPEATED
        assert consume_token(session, "forged", scope="t").outcome is Outcome.NOT_FOUND
        assert consume_token(session, expired, scope="t").outcome is Outcome.REJECTED
        session.add(Parcel(message_id="after"))
        session.flush()
        assert consume_once(session, "billing", "m2").applied
    with Session(parcels) as session:
        assert {p.message_id for p in session.query(Parcel)} == {"before", "after"}
    with parcels.connect() as conn:
        assert conn.execute(select(func.count()).select_from(consumed_messages)).scalar_one() == 2


@pytest.mark.rollback
def test_a_rolled_back_savepoint_makes_the_message_and_token_consumable_again(
    parcels: Engine, backend: Backend
) -> None:
    """consume_once and consume_token inside a SAVEPOINT that rolls back: the same transaction can
    consume both again (APPLIED), and after COMMIT each is consumed once."""
    token = _issue(parcels, "sp")
    with Session(parcels) as session, session.begin():
        nested = session.begin_nested()
        assert consume_once(session, "billing", "sp-msg").applied
        assert consume_token(session, token, scope="sp").applied
        session.add(Parcel(message_id="sp-msg"))
        nested.rollback()
        assert consume_once(session, "billing", "sp-msg").applied
        assert consume_token(session, token, scope="sp").applied
        session.add(Parcel(message_id="sp-msg"))
    with Session(parcels) as session, session.begin():
        assert consume_once(session, "billing", "sp-msg").outcome is Outcome.REPEATED
        assert consume_token(session, token, scope="sp").outcome is Outcome.REPEATED
        assert session.query(Parcel).count() == 1


def test_message_ids_and_consumers_compare_exactly(engine: Engine, backend: Backend) -> None:
    """One message id in two consumer groups is two APPLIED; case, trailing/leading space, tab,
    width and "ss"/"ß" variants are distinct keys on every backend (MariaDB folds them by default)."""
    ids = ["msg-A", "msg-a", "msg-A ", " msg-A", "msg-A\t", "\uff4dsg-A", "stra\u00dfe", "strasse"]
    with Session(engine) as session, session.begin():
        for consumer in ["billing", "Billing", "billing "]:
            for mid in ids:
                assert consume_once(session, consumer, mid).applied, (consumer, mid)
    with Session(engine) as session, session.begin():
        for consumer in ["billing", "Billing", "billing "]:
            for mid in ids:
                assert consume_once(session, consumer, mid).outcome is Outcome.REPEATED
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(consumed_messages)).scalar_one() == 24


def test_consume_once_under_repeatable_read_after_a_twin_committed_is_typed(pg: Backend) -> None:
    """PostgreSQL REPEATABLE READ: a delivery whose snapshot predates its twin's COMMIT gets a typed,
    retryable SerializationConflict (never a raw driver error, never APPLIED); its retry is REPEATED."""
    from stateguard import create_tables, drop_tables

    engine = pg.engine
    drop_tables(engine)
    create_tables(engine)
    try:
        rr = engine.execution_options(isolation_level="REPEATABLE READ")
        late = Session(rr)
        late.begin()
        late.execute(text("SELECT count(*) FROM stateguard_consumed_messages")).all()
        with Session(engine) as session, session.begin():
            assert consume_once(session, "c", "rr").applied
        with pytest.raises(SerializationConflict):
            consume_once(late, "c", "rr")
        late.rollback()
        late.close()
        with Session(rr) as session, session.begin():
            assert consume_once(session, "c", "rr").outcome is Outcome.REPEATED
    finally:
        drop_tables(engine)
