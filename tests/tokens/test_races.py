"""One-time tokens under real races, on every backend: waiters behind an open consumption get one
winner, expired tokens raced by consumers are never applied, and snapshots older than a concurrent
consume (REPEATABLE READ) are typed errors, never a second APPLIED; on ``sqlite_engine`` a read
before the consume is a typed conflict, not a lock upgrade failure."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import pytest
from sqlalchemy import Engine, func, select, text
from sqlalchemy.orm import Session

from stateguard import (
    Outcome,
    consume_once,
    consume_token,
    issue_token,
    sqlite_engine,
)
from stateguard.exceptions import SerializationConflict
from stateguard.tables import consumed_messages, tokens
from tests._support.token_races import (
    HOUR,
    _consume,
    _issue,
    _outcomes,
    _run_threads,
    _token_rows,
)
from tests.conftest import Backend

# --------------------------------------------------------------------------
# One-time tokens: real races
# --------------------------------------------------------------------------


@pytest.mark.parametrize("holder_ends", ["rollback", "commit"])
def test_waiters_behind_an_open_consumption_get_exactly_one_winner(
    engine: Engine, backend: Backend, holder_ends: str
) -> None:
    """A consumer holds its consumption uncommitted while 8 threads, released by a barrier, consume
    the same token and block on its row.  Holder rolls back: exactly one waiter APPLIED, the rest
    REPEATED.  Holder commits: every waiter REPEATED (never NOT_FOUND or REJECTED)."""
    token = _issue(engine, "race")
    holder = Session(engine)
    holder.begin()
    assert consume_token(holder, token, scope="race").outcome is Outcome.APPLIED
    barrier = threading.Barrier(9)

    def waiter(i: int) -> Any:
        with Session(engine) as session, session.begin():
            session.connection()  # a pooled connection before the race starts
            barrier.wait()
            return consume_token(session, token, scope="race", request_id=f"w{i}")

    threads_done: list[Any] = []
    runner = threading.Thread(target=lambda: threads_done.extend(_run_threads(8, waiter)))
    runner.start()
    barrier.wait()
    time.sleep(0.5)  # every waiter is now blocked behind the holder's row lock
    assert runner.is_alive(), "waiters did not wait for the holder's uncommitted consumption"
    getattr(holder, holder_ends)()
    holder.close()
    runner.join(120)
    outcomes = _outcomes(threads_done)
    if holder_ends == "rollback":
        assert outcomes == Counter({"APPLIED": 1, "REPEATED": 7}), outcomes
    else:
        assert outcomes == Counter({"REPEATED": 8}), outcomes
    assert _consume(engine, token, "race").outcome is Outcome.REPEATED


def test_consume_under_repeatable_read_after_a_concurrent_commit_is_typed(pg: Backend) -> None:
    """PostgreSQL REPEATABLE READ: a consumer whose snapshot predates another consumer's COMMIT must
    not be told APPLIED; it gets SerializationConflict (typed, retryable) and its retry REPEATED."""
    from stateguard import create_tables, drop_tables

    engine = pg.engine
    drop_tables(engine)
    create_tables(engine)
    try:
        token = _issue(engine, "rr")
        rr = engine.execution_options(isolation_level="REPEATABLE READ")
        late = Session(rr)
        late.begin()
        late.execute(text("SELECT count(*) FROM stateguard_tokens")).all()  # snapshot taken
        assert _consume(engine, token, "rr").outcome is Outcome.APPLIED
        with pytest.raises(SerializationConflict) as caught:
            consume_token(late, token, scope="rr")
        assert caught.value.retryable
        late.rollback()
        late.close()
        assert _consume(rr, token, "rr").outcome is Outcome.REPEATED
    finally:
        drop_tables(engine)


def test_sqlite_engine_read_first_then_consume_is_a_typed_conflict(tmp_path: Any) -> None:
    """sqlite_engine(): two requests read first (DEFERRED), one consumes and commits; the other's
    consume cannot upgrade its lock: a typed, retryable SerializationConflict (never a raw
    "database is locked"), and its retry is REPEATED."""
    from stateguard import create_tables

    engine = sqlite_engine(f"sqlite:///{tmp_path}/read-first.db")
    try:
        create_tables(engine)
        token = _issue(engine, "rf")
        first, second = Session(engine), Session(engine)
        for session in (first, second):
            session.begin()
            session.execute(select(func.count()).select_from(tokens)).scalar_one()
        assert consume_token(first, token, scope="rf").applied
        first.commit()
        with pytest.raises(SerializationConflict) as caught:
            consume_token(second, token, scope="rf")
        assert caught.value.retryable
        second.rollback()
        first.close()
        second.close()
        assert _consume(engine, token, "rf").outcome is Outcome.REPEATED
    finally:
        engine.dispose()


@pytest.mark.rollback
def test_a_token_issued_in_a_rolled_back_transaction_does_not_exist(engine: Engine, backend: Backend) -> None:
    """issue_token writes in the caller's transaction: rolled back, the token is NOT_FOUND; issued
    and consumed in one transaction that rolls back, it is gone too."""
    with Session(engine) as session:
        session.begin()
        ghost = issue_token(session, scope="rb", ttl=HOUR)
        assert consume_token(session, ghost, scope="rb").applied
        session.rollback()
    assert _consume(engine, ghost, "rb").outcome is Outcome.NOT_FOUND
    assert _token_rows(engine) == 0


def test_mariadb_snapshot_older_than_a_concurrent_consume_is_never_applied(mariadb: Backend) -> None:
    """MariaDB REPEATABLE READ: a request that read the token's row (snapshot) before another request
    consumed and committed it gets REPEATED (the locking read sees the latest row), never APPLIED,
    and a consume_once twin likewise."""
    from stateguard import create_tables, drop_tables

    engine = mariadb.engine
    drop_tables(engine)
    create_tables(engine)
    try:
        token = _issue(engine, "snap")
        late = Session(engine)
        late.begin()
        late.execute(select(tokens.c.consumed_ms)).all()
        late.execute(select(consumed_messages.c.message_id)).all()
        assert _consume(engine, token, "snap").applied
        with Session(engine) as session, session.begin():
            assert consume_once(session, "c", "snap").applied
        assert consume_token(late, token, scope="snap").outcome is Outcome.REPEATED
        assert consume_once(late, "c", "snap").outcome is Outcome.REPEATED
        late.rollback()
        late.close()
    finally:
        drop_tables(engine)
