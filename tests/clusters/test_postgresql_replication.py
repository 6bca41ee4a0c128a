"""stateguard on a PostgreSQL primary with one streaming standby started by the tests, through failovers.

The engine reaches the primary through a libpq multi-host URL with ``target_session_attrs=read-write``
(the same URL before and after a promotion).  The durability tests run acknowledged guarded writes
(an idempotency key completed, a message consumed once, a one-time token consumed, all in one
transaction), SIGKILL the primary, promote the standby, and run every acknowledged write again on the
new primary: a write that survived answers REPEATED (replayed), a lost one answers APPLIED a second
time.  Each test prints its measured line (``pytest -s``); docs/explanation/clusters-postgresql.md
holds the table.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, String, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import (
    ConfigurationError,
    Outcome,
    ReplicationTimeout,
    StateMachine,
    consume_once,
    consume_token,
    decrement,
    emit,
    idempotent,
    set_durability,
    version_column,
)

from .._support import pg_cluster
from .._support.failover_units import (
    LEASE,
    TOKEN_SCOPE,
    Measured,
    count_losses,
    issue_tokens,
    multi_host_url,
    routing_engine,
    server_port,
    storm,
    unit,
)
from ..conftest import count_statements
from ._started import fresh_tables

pytestmark = pytest.mark.failover


class Base(DeclarativeBase):
    pass


class Order(Base):
    """An order moved pending -> paid -> shipped across a failover."""

    __tablename__ = "pgr_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    version: Mapped[int] = version_column()

    flow = StateMachine(
        "status",
        states=["pending", "paid", "shipped"],
        transitions=[["pay", "pending", "paid"], ["ship", "paid", "shipped"]],
    )


class Stock(Base):
    """A counter changed with a ref under durability="replicated"."""

    __tablename__ = "pgr_stock"
    id: Mapped[int] = mapped_column(primary_key=True)
    amount: Mapped[int] = mapped_column(default=0)


@pytest.fixture
def cluster(pg_pair: pg_cluster.PgReplicaPair) -> pg_cluster.PgReplicaPair:
    """The package's primary and standby (tests/clusters/conftest.py, shared with
    test_postgresql_durable_sessions.py)."""
    return pg_pair


@pytest.fixture
def pair(cluster: pg_cluster.PgReplicaPair) -> pg_cluster.PgReplicaPair:
    """The pair made whole again (a test before may have failed it over), asynchronous, fresh tables."""
    if not cluster.healthy:
        cluster.repair()
    cluster.set_synchronous(False)
    assert cluster.primary is not None
    fresh_tables(cluster.primary.url, Base.metadata)
    cluster.wait_replayed()
    return cluster


def routing_url(pair: pg_cluster.PgReplicaPair) -> str:
    """The libpq multi-host URL: the standby listed first, so reaching the primary proves the routing."""
    assert pair.primary is not None and pair.standby is not None
    return multi_host_url([pair.standby.port, pair.primary.port], pg_cluster.DATABASE)


def test_a_read_write_multi_host_url_reaches_the_primary_before_and_after_a_promotion(
    pair: pg_cluster.PgReplicaPair,
) -> None:
    """The same URL reaches the primary, refuses the lone standby, then reaches the promoted one."""
    assert pair.primary is not None and pair.standby is not None
    old, new = pair.primary, pair.standby
    url = routing_url(pair)
    engine = routing_engine(url)
    try:
        assert server_port(engine) == old.port  # the read-only standby, listed first, was skipped
        with Session(engine) as s, s.begin():
            s.add(Order(id=1))
        token = issue_tokens(engine, 1)[0]
        with Session(engine) as s, s.begin():
            assert Order.flow.pay(s, 1).outcome is Outcome.APPLIED
            assert consume_once(s, "billing", "m-route").outcome is Outcome.APPLIED
            assert consume_token(s, token, scope=TOKEN_SCOPE).outcome is Outcome.APPLIED
        with Session(engine) as s:
            with idempotent(s, scope="charges", key="k-route", lease=LEASE) as call:
                assert not call.replayed
                call.complete({"charged": 1})
            s.commit()

        pair.stop_primary()
        engine.dispose()
        with pytest.raises(sa_exc.OperationalError, match=r"read-only|refused|failed"):
            server_port(engine)  # only a standby is left: no session is handed out for writes
        pair.promote()
        engine.dispose()

        assert server_port(engine) == new.port
        with Session(engine) as s, s.begin():
            assert Order.flow.pay(s, 1).outcome is Outcome.REPEATED
            assert Order.flow.ship(s, 1).outcome is Outcome.APPLIED
            assert consume_once(s, "billing", "m-route").outcome is Outcome.REPEATED
            assert consume_token(s, token, scope=TOKEN_SCOPE).outcome is Outcome.REPEATED
        with Session(engine) as s:
            with idempotent(s, scope="charges", key="k-route", lease=LEASE) as call:
                assert call.replayed and call.response == {"charged": 1}
            s.commit()
    finally:
        engine.dispose()


def test_an_asynchronous_failover_mid_storm_is_measured_and_every_unit_survives_whole_or_not_at_all(
    pair: pg_cluster.PgReplicaPair,
) -> None:
    """SIGKILL the primary under 4 writers, promote the async standby: losses are counted, none partial."""
    engine = routing_engine(routing_url(pair))
    try:
        tokens = issue_tokens(engine, 600)
        pair.wait_replayed()
        measured = storm(engine, tokens, writers=4, kill_after=150, kill=pair.kill_primary)
        pair.promote()
        engine.dispose()
        count_losses(engine, tokens, measured)
        print(measured.line("async standby, primary SIGKILLed mid-storm, synchronous_commit=on"))
        # What the async standby had is a matter of timing: only the bookkeeping is asserted.
        assert measured.tokens_twice == measured.lost <= len(measured.acknowledged)
    finally:
        engine.dispose()


def test_an_asynchronous_standby_cut_off_loses_every_write_acknowledged_after_the_cut(
    pair: pg_cluster.PgReplicaPair,
) -> None:
    """Standby stopped, 40 units acknowledged, primary SIGKILLed, standby promoted: all 40 are gone."""
    engine = routing_engine(routing_url(pair))
    try:
        tokens = issue_tokens(engine, 40)
        pair.wait_replayed()
        pair.stop_standby()  # asynchronous: the primary goes on acknowledging alone
        measured = Measured()
        for n, token in enumerate(tokens):
            unit(engine, n, token)
            measured.acknowledged.append(n)
        pair.kill_primary()
        pair.start_standby()
        pair.promote()
        engine.dispose()
        count_losses(engine, tokens, measured)
        print(measured.line("async standby cut off, then primary SIGKILLed, synchronous_commit=on"))
        # The standby stopped before any of these commits: it cannot have one of them.
        assert measured.lost == measured.tokens_twice == len(tokens)
    finally:
        engine.dispose()


def test_a_synchronous_standby_with_remote_apply_loses_no_acknowledged_write(
    pair: pg_cluster.PgReplicaPair,
) -> None:
    """Sync standby, remote_apply set by the application, SIGKILL mid-storm: 0 lost, 0 consumed twice."""
    pair.set_synchronous(True)
    engine = routing_engine(routing_url(pair), remote_apply=True)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SHOW synchronous_commit")).scalar_one() == "remote_apply"
        tokens = issue_tokens(engine, 600)
        measured = storm(engine, tokens, writers=4, kill_after=150, kill=pair.kill_primary)
        pair.promote()
        engine.dispose()
        count_losses(engine, tokens, measured)
        print(measured.line("sync standby, primary SIGKILLed mid-storm, synchronous_commit=remote_apply"))
        assert measured.lost == 0 and measured.tokens_twice == 0 and measured.messages_twice == 0
        assert measured.blocks_twice == 0
    finally:
        engine.dispose()


@pytest.mark.cancel
def test_a_cancelled_synchronous_replication_wait_returns_a_commit_that_a_failover_loses(
    pair: pg_cluster.PgReplicaPair,
) -> None:
    """Sync standby down: COMMIT waits; cancelled, it returns with a WARNING; only the primary has the row.

    The server then says, as a WARNING and not an error, "canceling wait for synchronous replication
    due to user request" with the detail "The transaction has already committed locally, but might
    not have been replicated to the standby."  Without ``durability="replicated"`` (the application
    set remote_apply on the engine itself) the call's outcome was APPLIED and ``commit()`` returns
    normally, so the write looks durable while only the primary has it; after a failover it is
    gone.  The same cancelled wait under ``durability="replicated"`` raises ReplicationTimeout:
    ``test_a_cancelled_wait_of_a_durable_call_raises_replication_timeout_and_the_row_is_on_the_primary``.
    """
    pair.set_synchronous(True)
    assert pair.primary is not None and pair.standby is not None
    primary, standby = pair.primary, pair.standby
    engine = routing_engine(routing_url(pair), remote_apply=True)
    notices: list[tuple[str | None, str, str]] = []
    outcome: dict[str, Any] = {}

    def commit_alone() -> None:
        try:
            with Session(engine) as s:
                raw = s.connection().connection.driver_connection
                assert raw is not None
                # A Diagnostic is readable only inside the handler: keep its fields.
                raw.add_notice_handler(
                    lambda d: notices.append(
                        (d.severity_nonlocalized, d.message_primary or "", d.message_detail or "")
                    )
                )
                outcome["consume"] = consume_once(s, "billing", "m-local").outcome
                s.commit()
                outcome["committed"] = True
        except BaseException as exc:  # reported by the test
            outcome["error"] = exc

    try:
        pair.stop_standby()
        writer = threading.Thread(target=commit_alone)
        writer.start()
        waiting = None
        deadline = time.monotonic() + 20
        while waiting is None and time.monotonic() < deadline:
            waiting = primary.scalar("SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep'")
            time.sleep(0.02)
        assert waiting is not None, f"no COMMIT waited for the standby: {outcome}"
        time.sleep(0.5)
        assert writer.is_alive() and "committed" not in outcome, "COMMIT returned without its standby"

        assert primary.scalar("SELECT pg_cancel_backend(%s)", waiting) is True
        writer.join(timeout=20)
        assert not writer.is_alive()
        assert outcome.get("committed") is True and "error" not in outcome, outcome
        assert outcome["consume"] is Outcome.APPLIED
        warned = [n for n in notices if "synchronous replication" in n[1]]
        assert len(warned) == 1, notices
        severity, message, detail = warned[0]
        assert severity == "WARNING" and message.startswith("canceling wait for synchronous replication"), (
            message
        )
        assert "already committed locally" in detail, detail
        count = "SELECT count(*) FROM stateguard_consumed_messages WHERE message_id = 'm-local'"
        assert primary.scalar(count) == 1

        pair.kill_primary()
        pair.start_standby()  # its primary is gone: it shows what it had received
        assert standby.scalar("SELECT pg_is_in_recovery()") is True
        assert standby.scalar(count) == 0
        pair.promote()
        assert standby.scalar(count) == 0  # acknowledged by COMMIT, lost by the failover
    finally:
        engine.dispose()


# -- durability="replicated" ---------------------------------------------------------------------

CONSUMED = "SELECT count(*) FROM stateguard_consumed_messages WHERE message_id = %s"
TOKENS_CONSUMED = "SELECT count(*) FROM stateguard_tokens WHERE consumed_ms IS NOT NULL"
EVENTS = "SELECT count(*) FROM stateguard_outbox WHERE topic = %s"
COMPLETED = "SELECT count(*) FROM stateguard_idempotency_keys WHERE idem_key = %s AND status = 'completed'"
SET_REMOTE_APPLY = "set_config('synchronous_commit', 'remote_apply', true)"


def durable_unit(engine: Engine, n: int, token: str, **durable: Any) -> list[Any]:
    """Unit ``n`` with every durable call (token, counter with ref, emit, completion); their returns."""
    returned: list[Any] = []
    with Session(engine) as s:
        with idempotent(s, scope="charges", key=f"k{n}", lease=LEASE) as call:
            returned.append(consume_token(s, token, scope=TOKEN_SCOPE, **durable))
            returned.append(decrement(s, Stock.amount, 1, by=1, ref=f"order-{n}", **durable))
            returned.append(emit(s, "charged", {"n": n}, key=f"order-{n}", **durable))
            returned.append(call.complete({"n": n}, **durable))
        s.commit()
    return returned


def seed_stock(engine: Engine, amount: int = 100) -> None:
    with Session(engine) as s, s.begin():
        s.add(Stock(id=1, amount=amount))


def wait_for_sync_wait(primary: pg_cluster.PgNode, timeout: float = 20.0) -> Any:
    """The pid of a backend whose COMMIT waits for the synchronous standby (``None``: none did)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = primary.scalar("SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep'")
        if pid is not None:
            return pid
        time.sleep(0.02)
    return None


def test_a_durable_unit_with_a_healthy_synchronous_standby_commits_and_the_standby_has_it_at_once(
    pair: pg_cluster.PgReplicaPair,
) -> None:
    """Sync standby up: the durable calls answer as usual, commit normally, and the standby shows them."""
    pair.set_synchronous(True)
    assert pair.primary is not None and pair.standby is not None
    engine = routing_engine(routing_url(pair))
    try:
        seed_stock(engine)
        [token] = issue_tokens(engine, 1)
        with count_statements(engine) as counted:
            token_result, stock_result, event_id, response = durable_unit(
                engine, 1, token, durability="replicated"
            )
        assert token_result.outcome is Outcome.APPLIED and stock_result.outcome is Outcome.APPLIED
        assert isinstance(event_id, int) and response == {"n": 1}
        # One set_config for the whole transaction, however many durable calls it holds.
        assert sum(SET_REMOTE_APPLY in sql for sql in counted.statements) == 1, counted.statements
        # remote_apply: COMMIT returned once the standby had applied it, so it shows there already.
        standby = pair.standby
        assert standby.scalar(TOKENS_CONSUMED) == 1
        assert standby.scalar(EVENTS, "charged") == 1
        assert standby.scalar(COMPLETED, "k1") == 1
        assert standby.scalar("SELECT amount FROM pgr_stock WHERE id = 1") == 99
        # The connection's next, non-durable transaction commits as the server is configured.
        with Session(engine) as s, s.begin():
            assert s.execute(text("SHOW synchronous_commit")).scalar_one() == "on"
    finally:
        engine.dispose()


def test_a_durable_call_without_a_synchronous_standby_is_refused_and_writes_nothing(
    pair: pg_cluster.PgReplicaPair,
) -> None:
    """synchronous_standby_names empty (async standby): ConfigurationError before the write, none made."""
    assert pair.primary is not None
    engine = routing_engine(routing_url(pair))
    try:
        [token] = issue_tokens(engine, 1)
        with Session(engine) as s, s.begin():
            with pytest.raises(ConfigurationError, match="synchronous_standby_names is empty"):
                consume_token(s, token, scope=TOKEN_SCOPE, durability="replicated")
            with pytest.raises(ConfigurationError, match=r"no synchronous standby|has none"):
                emit(s, "charged", {"n": 1}, durability="replicated")
        assert pair.primary.scalar(TOKENS_CONSUMED) == 0
        assert pair.primary.scalar(EVENTS, "charged") == 0
        # The same engine's default: refused in the same way; "local" opts a call out.
        set_durability(engine, "replicated")
        try:
            with Session(engine) as s, s.begin():
                with pytest.raises(ConfigurationError):
                    consume_token(s, token, scope=TOKEN_SCOPE)
                assert consume_token(s, token, scope=TOKEN_SCOPE, durability="local").applied
        finally:
            set_durability(engine, None)
        assert pair.primary.scalar(TOKENS_CONSUMED) == 1
    finally:
        engine.dispose()


@pytest.mark.cancel
def test_a_durable_commit_past_its_timeout_with_the_standby_down_raises_replication_timeout(
    pair: pg_cluster.PgReplicaPair,
) -> None:
    """Standby stopped, timeout 1 s: the commit raises ReplicationTimeout; the rows are on the primary."""
    pair.set_synchronous(True)
    assert pair.primary is not None and pair.standby is not None
    primary, standby = pair.primary, pair.standby
    engine = routing_engine(routing_url(pair))
    set_durability(engine, "replicated", timeout=timedelta(seconds=1))
    try:
        seed_stock(engine)
        [token, other] = issue_tokens(engine, 2)
        pair.wait_replayed()
        pair.stop_standby()
        ran: list[str] = []
        started = time.monotonic()
        with Session(engine) as s:
            r = consume_token(s, token, scope=TOKEN_SCOPE)  # the engine's default: replicated
            r.on_commit(ran.append, "payout")
            event_id = emit(s, "charged", {"n": 1})
            with pytest.raises(ReplicationTimeout, match="committed on the PostgreSQL primary") as raised:
                s.commit()
            waited = time.monotonic() - started
            error = raised.value
            assert error.value == (r, event_id) and error.acknowledged == 0 and error.wanted == 1
            assert ran == [], "an on_commit callback ran for a commit the standby did not confirm"
            assert len(error.callbacks) == 1
            error.callbacks[0]()
            assert ran == ["payout"]
            # The session is usable, and its connection takes no stray cancel: a 1.5 s statement runs.
            assert s.execute(text("SELECT pg_sleep(1.5), 1")).one()[1] == 1
            s.commit()
        assert 1.0 <= waited < 10, waited
        assert primary.scalar(TOKENS_CONSUMED) == 1 and primary.scalar(EVENTS, "charged") == 1
        # A non-durable transaction on the same engine with the standby down: as the server says
        # (synchronous_commit = on waits for the standby too, so it is run with "local").
        with Session(engine) as s, s.begin():
            assert consume_token(s, other, scope=TOKEN_SCOPE, durability="local").applied
            s.execute(text("SET LOCAL synchronous_commit = local"))

        pair.kill_primary()
        pair.start_standby()
        assert standby.scalar(TOKENS_CONSUMED) == 0  # what the error warned about: a failover loses it
    finally:
        set_durability(engine, None)
        engine.dispose()


@pytest.mark.cancel
@pytest.mark.lost_reply
@pytest.mark.parametrize("ended_by", ["pg_cancel_backend", "pg_terminate_backend"])
def test_a_durable_commit_whose_wait_is_ended_is_never_passed_off_as_confirmed(
    pair: pg_cluster.PgReplicaPair, ended_by: str
) -> None:
    """No timeout: COMMIT waits for the stopped standby until another session ends the wait.

    pg_cancel_backend: the primary keeps the write and the commit raises ReplicationTimeout.
    pg_terminate_backend: the primary keeps the write, and the connection closes with the reply:
    the commit raises OperationalError, a lost reply.  Either way the same calls sent again (the
    standby back) answer REPEATED.
    """
    pair.set_synchronous(True)
    assert pair.primary is not None and pair.standby is not None
    primary = pair.primary
    engine = routing_engine(routing_url(pair))
    message_id, topic = f"m-{ended_by}", f"charged-{ended_by}"
    outcome: dict[str, Any] = {}

    def commit_alone() -> None:
        try:
            with Session(engine) as s:
                outcome["consume"] = consume_once(s, "billing", message_id).outcome
                outcome["event"] = emit(s, topic, {"m": 1}, durability="replicated")
                s.commit()
                outcome["committed"] = True
        except BaseException as exc:  # asserted by the test
            outcome["error"] = exc

    try:
        pair.stop_standby()
        writer = threading.Thread(target=commit_alone)
        writer.start()
        waiting = wait_for_sync_wait(primary)
        assert waiting is not None, f"no COMMIT waited for the standby: {outcome}"
        assert primary.scalar(f"SELECT {ended_by}(%s)", waiting) is True
        writer.join(timeout=20)
        assert not writer.is_alive()
        assert "committed" not in outcome, "a commit the standby never confirmed passed for durable"
        error = outcome["error"]
        if ended_by == "pg_cancel_backend":
            assert isinstance(error, ReplicationTimeout), repr(error)
            assert "due to user request" in str(error) and "already committed locally" in str(error)
            assert error.value == (outcome["event"],)
        else:
            assert isinstance(error, sa_exc.OperationalError), repr(error)
        assert primary.scalar(CONSUMED, message_id) == 1
        assert primary.scalar(EVENTS, topic) == 1
        pair.start_standby()
        with Session(engine) as s, s.begin():
            assert consume_once(s, "billing", message_id).outcome is Outcome.REPEATED
    finally:
        engine.dispose()


@pytest.mark.cancel
def test_a_separate_mode_completion_the_standby_did_not_confirm_raises_and_the_call_stays_completed(
    pair: pg_cluster.PgReplicaPair,
) -> None:
    """Separate mode commits in complete(): ReplicationTimeout from it, the key completed, not released."""
    pair.set_synchronous(True)
    assert pair.primary is not None
    # synchronous_commit=local: the claim's own commit (on entering the block) does not wait.
    engine = routing_engine(routing_url(pair), local=True)
    set_durability(engine, None, timeout=timedelta(seconds=1))
    try:
        pair.stop_standby()
        with Session(engine) as s:
            with pytest.raises(ReplicationTimeout) as raised:
                with idempotent(s, scope="charges", key="k-sep", lease=LEASE, mode="separate") as call:
                    call.complete({"charged": 7}, durability="replicated")
            assert raised.value.value == ({"charged": 7},)
            assert repr(call).count("completed") == 1, repr(call)
        assert pair.primary.scalar(COMPLETED, "k-sep") == 1
    finally:
        set_durability(engine, None)
        engine.dispose()


def test_a_savepoint_rolled_back_after_a_durable_call_makes_the_next_one_set_remote_apply_again(
    pair: pg_cluster.PgReplicaPair,
) -> None:
    """ROLLBACK TO SAVEPOINT undoes set_config: the next durable call sends it again, and COMMIT waits."""
    pair.set_synchronous(True)
    assert pair.standby is not None
    standby = pair.standby
    # Non-durable commits do not wait: only the durable transaction's setting can make this one wait.
    engine = routing_engine(routing_url(pair), local=True)
    try:
        [first, second] = issue_tokens(engine, 2)
        with count_statements(engine) as counted, Session(engine) as s:
            with s.begin():
                savepoint = s.begin_nested()
                assert consume_token(s, first, scope=TOKEN_SCOPE, durability="replicated").applied
                savepoint.rollback()
                assert s.execute(text("SHOW synchronous_commit")).scalar_one() == "local"
                assert consume_token(s, second, scope=TOKEN_SCOPE, durability="replicated").applied
                assert s.execute(text("SHOW synchronous_commit")).scalar_one() == "remote_apply"
        assert sum(SET_REMOTE_APPLY in sql for sql in counted.statements) == 2, counted.statements
        # remote_apply: the standby shows the second token consumed when COMMIT returned; not the first.
        assert standby.scalar(TOKENS_CONSUMED) == 1
    finally:
        engine.dispose()


def test_durability_replicated_on_an_engine_that_commits_locally_loses_no_acknowledged_write(
    pair: pg_cluster.PgReplicaPair,
) -> None:
    """Engine commits locally, set_durability(engine, "replicated"), SIGKILL mid-storm: 0 lost."""
    pair.set_synchronous(True)
    engine = routing_engine(routing_url(pair), local=True)
    try:
        tokens = issue_tokens(engine, 600)
        pair.wait_replayed()  # issued by non-durable (local) commits: on the standby before the storm
        set_durability(engine, "replicated")
        measured = storm(engine, tokens, writers=4, kill_after=150, kill=pair.kill_primary)
        set_durability(engine, None)  # the promoted standby has no standby of its own to confirm reruns
        pair.promote()
        engine.dispose()
        count_losses(engine, tokens, measured)
        scenario = 'sync standby, primary SIGKILLed mid-storm, engine local + durability="replicated"'
        print(measured.line(scenario))
        assert measured.lost == 0 and measured.tokens_twice == 0 and measured.blocks_twice == 0
    finally:
        set_durability(engine, None)
        engine.dispose()
