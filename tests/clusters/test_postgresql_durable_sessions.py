"""``durability="replicated"`` on the ways an application runs its sessions, with the standby stopped.

A private primary with a synchronous standby (tests/_support/pg_cluster.py); the engines commit
locally (``synchronous_commit=local``), so only a durable transaction waits for the standby, and
the standby is stopped, so a durable COMMIT can only end by its 1 s timeout.  Each session set-up
below must either refuse the durable call (nothing written) or raise ReplicationTimeout from the
commit: never answer as if the standby had confirmed the write.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Literal

import pytest
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.orm import Session

from stateguard import (
    ConfigurationError,
    ReplicationTimeout,
    consume_token,
    emit,
    set_durability,
)

from .._support import pg_cluster
from .._support.failover_units import TOKEN_SCOPE, issue_tokens
from ._started import fresh_tables

TIMEOUT = timedelta(seconds=1)
TOKENS_CONSUMED = "SELECT count(*) FROM stateguard_tokens WHERE consumed_ms IS NOT NULL"


@pytest.fixture
def cluster(pg_pair: pg_cluster.PgReplicaPair) -> pg_cluster.PgReplicaPair:
    """The package's primary and standby (tests/clusters/conftest.py, shared with
    test_postgresql_replication.py)."""
    return pg_pair


@pytest.fixture
def pair(cluster: pg_cluster.PgReplicaPair) -> Iterator[pg_cluster.PgReplicaPair]:
    """The pair made whole (the other module fails it over), synchronous, fresh stateguard tables;
    the standby running again afterwards."""
    if not cluster.healthy:
        cluster.repair()
    if cluster.standby is not None and not cluster.standby.running:
        cluster.start_standby()
    cluster.set_synchronous(True)
    assert cluster.primary is not None
    fresh_tables(cluster.primary.url)
    cluster.wait_replayed()
    yield cluster
    if cluster.standby is not None and not cluster.standby.running:
        cluster.start_standby()


def local_engine(pair: pg_cluster.PgReplicaPair, *options: str, **kwargs: Any) -> Engine:
    """An engine on the primary whose non-durable COMMITs do not wait for the standby."""
    assert pair.primary is not None
    flags = " ".join(["-c synchronous_commit=local", *(f"-c {o}" for o in options)])
    return create_engine(pair.primary.url, connect_args={"options": flags, "connect_timeout": 3}, **kwargs)


def one_token_then_stop_standby(pair: pg_cluster.PgReplicaPair, engine: Engine) -> str:
    [token] = issue_tokens(engine, 1)
    pair.wait_replayed()
    pair.stop_standby()
    return token


@pytest.mark.cancel
def test_a_cancelled_wait_raises_replication_timeout_on_a_connection_that_hides_warnings(
    pair: pg_cluster.PgReplicaPair,
) -> None:
    """client_min_messages=error (set on a role, a database or the URL) hides the WARNING: still raised.

    PostgreSQL sends the "canceling wait for synchronous replication" WARNING only when the
    session's client_min_messages lets warnings through; with ``error`` the cancelled COMMIT returns
    like any other, and without the WARNING stateguard would pass the write off as confirmed.
    """
    assert pair.primary is not None
    engine = local_engine(pair, "client_min_messages=error")
    set_durability(engine, "replicated", timeout=TIMEOUT)
    try:
        token = one_token_then_stop_standby(pair, engine)
        with Session(engine) as s:
            assert consume_token(s, token, scope=TOKEN_SCOPE).applied
            with pytest.raises(ReplicationTimeout, match="already committed locally"):
                s.commit()
            # The setting is the session's again once the transaction ended.
            assert s.execute(text("SHOW client_min_messages")).scalar_one() == "error"
            s.rollback()
        assert pair.primary.scalar(TOKENS_CONSUMED) == 1
    finally:
        set_durability(engine, None)
        engine.dispose()


@pytest.mark.lag
def test_a_durable_call_in_an_autocommit_session_is_refused_and_writes_nothing(
    pair: pg_cluster.PgReplicaPair,
) -> None:
    """isolation_level=AUTOCOMMIT: each statement commits itself, before any remote_apply COMMIT.

    The write would be committed (locally, the standby stopped) the moment it ran, so the call
    cannot keep its promise: it refuses with ConfigurationError before writing.
    """
    assert pair.primary is not None
    engine = local_engine(pair)
    try:
        token = one_token_then_stop_standby(pair, engine)
        autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        set_durability(engine, "replicated", timeout=TIMEOUT)  # also the copy's: they share the dialect
        with Session(autocommit) as s, s.begin():
            with pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
                consume_token(s, token, scope=TOKEN_SCOPE)
            with pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
                emit(s, "charged", {"n": 1}, durability="replicated")
        assert pair.primary.scalar(TOKENS_CONSUMED) == 0
        assert pair.primary.scalar("SELECT count(*) FROM stateguard_outbox") == 0
    finally:
        set_durability(engine, None)
        engine.dispose()


@pytest.mark.cancel
@pytest.mark.parametrize("mode", ["conditional_savepoint", "create_savepoint", "rollback_only"])
def test_a_session_joined_into_an_outside_transaction_never_passes_a_durable_call_off_as_confirmed(
    pair: pg_cluster.PgReplicaPair,
    mode: Literal["conditional_savepoint", "create_savepoint", "rollback_only"],
) -> None:
    """Session(bind=connection) inside the application's connection.begin(): the session never COMMITs.

    The COMMIT that waits for the standby is the application's ``transaction.commit()``, which no
    session event sees: no timer bounds it, and a cancelled wait's WARNING comes after the
    session has disarmed.  The durable call has to refuse (nothing written), since the session
    cannot report on a COMMIT it does not send.
    """
    assert pair.primary is not None
    engine = local_engine(pair)
    set_durability(engine, "replicated", timeout=TIMEOUT)
    outside: dict[str, Any] = {}
    ran: list[str] = []
    try:
        token = one_token_then_stop_standby(pair, engine)
        with engine.connect() as conn:
            transaction = conn.begin()
            with Session(bind=conn, join_transaction_mode=mode) as s:
                with pytest.raises(ConfigurationError, match="does not commit"):
                    consume_token(s, token, scope=TOKEN_SCOPE).on_commit(ran.append, "payout")
                s.commit()

            def commit_outside() -> None:
                try:
                    transaction.commit()
                    outside["committed"] = True
                except BaseException as exc:  # asserted by the test
                    outside["error"] = exc

            committer = threading.Thread(target=commit_outside, daemon=True)
            committer.start()
            committer.join(10)
            if committer.is_alive():  # a durable COMMIT nobody bounds: end its wait as an operator would
                waiting = pair.primary.scalar("SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep'")
                pair.primary.scalar("SELECT pg_cancel_backend(%s)", waiting)
                committer.join(10)
                pytest.fail(f"the outside COMMIT waited for the standby with no timeout: {outside}")
        assert ran == []
        assert pair.primary.scalar(TOKENS_CONSUMED) == 0
    finally:
        set_durability(engine, None)
        engine.dispose()


@pytest.mark.cancel
def test_a_durable_call_in_a_two_phase_session_is_refused_and_writes_nothing(
    pair: pg_cluster.PgReplicaPair,
) -> None:
    """Session(twophase=True): PREPARE TRANSACTION, then COMMIT PREPARED without remote_apply.

    PREPARE TRANSACTION waits for the standby but no timer bounds it (the timer starts on COMMIT),
    and the setting of the transaction is gone once it is prepared, so COMMIT PREPARED commits as
    the session is configured (here locally): the call refuses before writing.
    """
    assert pair.primary is not None
    engine = local_engine(pair)
    set_durability(engine, "replicated", timeout=TIMEOUT)
    try:
        token = one_token_then_stop_standby(pair, engine)
        with Session(engine, twophase=True) as s:
            with pytest.raises(ConfigurationError, match="two-phase"):
                consume_token(s, token, scope=TOKEN_SCOPE)
            s.rollback()
        assert pair.primary.scalar(TOKENS_CONSUMED) == 0
    finally:
        set_durability(engine, None)
        engine.dispose()


@pytest.mark.cancel
def test_a_session_bound_to_a_connection_it_commits_itself_raises_replication_timeout(
    pair: pg_cluster.PgReplicaPair,
) -> None:
    """Session(bind=connection) that sends the COMMIT (no outside transaction, or control_fully): raised."""
    assert pair.primary is not None
    engine = local_engine(pair)
    set_durability(engine, "replicated", timeout=TIMEOUT)
    try:
        [first, second] = issue_tokens(engine, 2)
        pair.wait_replayed()
        pair.stop_standby()
        with engine.connect() as conn:
            with Session(bind=conn) as s:  # the session begins the connection's transaction
                assert consume_token(s, first, scope=TOKEN_SCOPE).applied
                with pytest.raises(ReplicationTimeout):
                    s.commit()
            conn.begin()
            with Session(bind=conn, join_transaction_mode="control_fully") as s:
                assert consume_token(s, second, scope=TOKEN_SCOPE).applied
                with pytest.raises(ReplicationTimeout):
                    s.commit()
        assert pair.primary.scalar(TOKENS_CONSUMED) == 2
    finally:
        set_durability(engine, None)
        engine.dispose()


@pytest.mark.rollback
def test_a_durable_call_rolled_back_with_its_savepoint_leaves_a_plain_commit_alone(
    pair: pg_cluster.PgReplicaPair,
) -> None:
    """ROLLBACK TO SAVEPOINT undid the durable call: the COMMIT is a plain one, not cut short or reported.

    The engine commits with the server's ``synchronous_commit = on`` (so this COMMIT waits for the
    stopped standby as every COMMIT on it does), and a 1 s timeout is set for durable commits.
    The only durable write was rolled back, so the transaction asked for nothing: its COMMIT must
    not be cancelled by stateguard's timer, and no ReplicationTimeout may name the rolled-back
    token as committed on the primary.
    """
    assert pair.primary is not None
    engine = create_engine(pair.primary.url, connect_args={"connect_timeout": 3})
    set_durability(engine, None, timeout=TIMEOUT)
    outcome: dict[str, Any] = {}
    try:
        plain = local_engine(pair)
        token = one_token_then_stop_standby(pair, plain)
        plain.dispose()

        def commit_alone() -> None:
            try:
                with Session(engine) as s, s.begin():
                    savepoint = s.begin_nested()
                    assert consume_token(s, token, scope=TOKEN_SCOPE, durability="replicated").applied
                    savepoint.rollback()
                    emit(s, "plain", {"n": 1})
                outcome["committed"] = True
            except BaseException as exc:  # asserted by the test
                outcome["error"] = exc

        writer = threading.Thread(target=commit_alone, daemon=True)
        writer.start()
        writer.join(3)
        assert "error" not in outcome, repr(outcome.get("error"))
        # Still waiting, as a plain COMMIT with synchronous_commit = on does: the standby comes back.
        assert writer.is_alive(), outcome
        pair.start_standby()
        writer.join(30)
        assert outcome == {"committed": True}, outcome
        assert pair.primary.scalar(TOKENS_CONSUMED) == 0
    finally:
        set_durability(engine, None)
        engine.dispose()


@pytest.mark.rollback
def test_a_released_savepoint_keeps_its_durable_call_when_a_later_one_is_rolled_back(
    pair: pg_cluster.PgReplicaPair,
) -> None:
    """Released savepoint's durable call stays; a sibling's rolled back is dropped; the commit raises."""
    assert pair.primary is not None
    engine = local_engine(pair)
    set_durability(engine, None, timeout=TIMEOUT)
    try:
        [kept, undone] = issue_tokens(engine, 2)
        pair.wait_replayed()
        pair.stop_standby()
        with Session(engine) as s:
            with s.begin_nested():
                r = consume_token(s, kept, scope=TOKEN_SCOPE, durability="replicated")
            savepoint = s.begin_nested()
            assert consume_token(s, undone, scope=TOKEN_SCOPE, durability="replicated").applied
            savepoint.rollback()
            # The released savepoint's set_config holds for the transaction.
            assert s.execute(text("SHOW synchronous_commit")).scalar_one() == "remote_apply"
            with pytest.raises(ReplicationTimeout) as raised:
                s.commit()
            assert raised.value.value == (r,)
        assert pair.primary.scalar(TOKENS_CONSUMED) == 1
    finally:
        set_durability(engine, None)
        engine.dispose()


class _FailingSink(logging.Handler):
    """A log handler whose sink is down: ``emit`` raises (the standard handlers would swallow it)."""

    def emit(self, record: logging.LogRecord) -> None:
        raise RuntimeError("the log sink is down")


@pytest.mark.failing_observer
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_failing_notice_handler_and_log_sink_of_the_application_do_not_hide_a_cancelled_wait(
    pair: pg_cluster.PgReplicaPair,
) -> None:
    """The application's notice handler (added first) raises, and so does the log handler psycopg reports to.

    psycopg calls the notice handlers in order and logs a failing one with ``logger.exception``;
    a log handler that raises there ends the loop (the exception is "ignored" in libpq's notice
    receiver), so the handlers after it never see the WARNING.  stateguard's must still see it.
    """
    assert pair.primary is not None
    engine = local_engine(pair)

    @event.listens_for(engine, "connect")
    def add_failing_handler(dbapi_connection: Any, record: Any) -> None:
        def failing(diagnostic: Any) -> None:
            raise ValueError("the application's notice handler fails")

        dbapi_connection.add_notice_handler(failing)

    set_durability(engine, "replicated", timeout=TIMEOUT)
    psycopg_log = logging.getLogger("psycopg")
    sink = _FailingSink()
    try:
        token = one_token_then_stop_standby(pair, engine)
        psycopg_log.addHandler(sink)
        with Session(engine) as s:
            assert consume_token(s, token, scope=TOKEN_SCOPE).applied
            with pytest.raises(ReplicationTimeout, match="already committed locally"):
                s.commit()
    finally:
        psycopg_log.removeHandler(sink)
        set_durability(engine, None)
        engine.dispose()
