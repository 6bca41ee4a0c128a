"""Attacks on the promises of README's "One-time tokens", "Insert once", "Message consumers",
"Scheduled sweeper", "Defaults" and "Errors" sections: real races (barriers, a holder that keeps
its transaction open), hostile values, clock skew, purges racing writers, on every backend and
on the local Redis.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, String, func, select, text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, scoped_session, sessionmaker

from stateguard import (
    AsyncRedisTokens,
    InvalidArgument,
    Outcome,
    RedisTokens,
    StateMachine,
    consume_once,
    consume_token,
    issue_token,
    purge_expired_tokens,
    retry_on_conflict,
    sqlite_engine,
)
from stateguard.exceptions import DeadlockDetected, SerializationConflict
from stateguard.tables import consumed_messages, tokens
from stateguard.tokens import token_digest
from tests.conftest import REDIS_URL, Backend, count_statements

HOUR = timedelta(hours=1)
SHORT = timedelta(milliseconds=150)


class Base(DeclarativeBase): ...


class Parcel(Base):
    """A consumer's business write, next to consume_once in one transaction."""

    __tablename__ = "attack_parcels"
    message_id: Mapped[str] = mapped_column(String(100), primary_key=True)


class SweepOrder(Base):
    """The README sweeper's orders: pending rows cancelled by where(), paid concurrently."""

    __tablename__ = "attack_sweep_orders"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    flow = StateMachine(
        "status",
        states=["pending", "paid", "cancelled"],
        transitions=[["pay", "pending", "paid"], ["cancel", "pending", "cancelled"]],
    )


def _issue(engine: Engine, scope: str, ttl: timedelta = HOUR) -> str:
    with Session(engine) as session, session.begin():
        return issue_token(session, scope=scope, ttl=ttl)


def _consume(engine: Engine, token: str, scope: str, **kw: Any) -> Any:
    with Session(engine) as session, session.begin():
        return consume_token(session, token, scope=scope, **kw)


def _token_rows(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(tokens)).scalar_one())


def _run_threads(n: int, target: Callable[[int], Any]) -> list[Any]:
    """Run ``target(i)`` in ``n`` threads; each result, or the exception it raised."""
    results: list[Any] = [None] * n

    def run(i: int) -> None:
        try:
            results[i] = target(i)
        except BaseException as error:  # recorded: the test asserts on it
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a racing thread hung"
    return results


def _outcomes(results: list[Any]) -> Counter[str]:
    return Counter(r.outcome.name if hasattr(r, "outcome") else f"{type(r).__name__}: {r}" for r in results)


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


def test_expired_tokens_raced_by_consumers_and_purges_are_never_applied(
    engine: Engine, backend: Backend
) -> None:
    """Expired tokens consumed by 6 threads while 2 threads purge them in batches of 1: every
    answer is REJECTED or NOT_FOUND, no error, and live tokens issued meanwhile survive."""
    expired = [_issue(engine, "exp", SHORT) for _ in range(12)]
    time.sleep(SHORT.total_seconds() * 2)
    barrier = threading.Barrier(8)
    live: list[str] = []

    def actor(i: int) -> Any:
        barrier.wait()
        if i >= 6:
            deleted = 0
            while (n := purge_expired_tokens(engine, batch=1)) == 1:
                deleted += n
                live.append(_issue(engine, "exp"))
            return deleted
        return [_consume(engine, t, "exp").outcome for t in expired]

    results = _run_threads(8, actor)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    assert sum(results[6:]) == 12
    seen = {o for r in results[:6] for o in r}
    assert seen <= {Outcome.REJECTED, Outcome.NOT_FOUND}, seen
    assert all(_consume(engine, t, "exp").outcome is Outcome.APPLIED for t in live)
    assert _token_rows(engine) == len(live)


def test_purge_racing_issuers_and_consumers_deletes_only_expired_tokens(
    engine: Engine, backend: Backend
) -> None:
    """Four threads issue and consume live tokens and issue short-lived ones while a purger loops
    with batch=3: every live token is APPLIED exactly once and stays (REPEATED) after the race."""
    barrier = threading.Barrier(5)
    stop = threading.Event()

    def actor(i: int) -> Any:
        barrier.wait()
        if i == 4:
            purged = 0
            while not stop.is_set():
                purged += purge_expired_tokens(engine, batch=3)
            return purged
        mine = []
        for _ in range(15):
            _issue(engine, "mixed", timedelta(milliseconds=1))
            token = _issue(engine, "mixed")
            mine.append((token, _consume(engine, token, "mixed").outcome))
        return mine

    def run_all(i: int) -> Any:
        try:
            return actor(i)
        finally:
            if i != 4:
                done.append(i)
                if len(done) == 4:
                    stop.set()

    done: list[int] = []
    results = _run_threads(5, run_all)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    pairs = [p for r in results[:4] for p in r]
    assert [o for _, o in pairs] == [Outcome.APPLIED] * 60
    time.sleep(0.01)
    while purge_expired_tokens(engine, batch=1000) == 1000:
        ...
    assert _token_rows(engine) == 60
    assert {_consume(engine, t, "mixed").outcome for t, _ in pairs} == {Outcome.REPEATED}


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


# --------------------------------------------------------------------------
# One-time tokens: hostile values, ttl and clock
# --------------------------------------------------------------------------

HOSTILE = [
    pytest.param("a\x00b", id="nul"),
    pytest.param("tok\ud800", id="lone-surrogate"),
    pytest.param(b"bytes-token", id="bytes"),
    pytest.param(None, id="none"),
    pytest.param(12345, id="int"),
    pytest.param("", id="empty"),
    pytest.param(" \t\n", id="blank"),
    pytest.param("x" * 256, id="256-chars"),
]


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_token_scope_and_request_id_are_typed_send_nothing_and_keep_the_transaction(
    engine: Engine, value: Any
) -> None:
    """Each hostile value as the token, the scope and the request_id is an InvalidArgument before any
    statement; the caller's transaction (PostgreSQL aborts on a failed statement) stays usable."""
    token = _issue(engine, "hostile")
    with Session(engine) as session, session.begin():
        session.connection()
        with count_statements(engine) as sent:
            with pytest.raises(InvalidArgument):
                consume_token(session, value, scope="hostile")
            with pytest.raises(InvalidArgument):
                consume_token(session, token, scope=value)
            if value is not None:  # None is "no request id"
                with pytest.raises(InvalidArgument):
                    consume_token(session, token, scope="hostile", request_id=value)
            with pytest.raises(InvalidArgument):
                issue_token(session, scope=value, ttl=HOUR)
            with pytest.raises(InvalidArgument):
                consume_once(session, value, "m")
            with pytest.raises(InvalidArgument):
                consume_once(session, "c", value)
        assert len(sent) == 0, sent.statements
        assert consume_token(session, token, scope="hostile").outcome is Outcome.APPLIED
        assert consume_once(session, "c", "m").applied


def test_values_at_the_length_limits_are_characters_not_bytes(engine: Engine, backend: Backend) -> None:
    """Limits count characters: a 200-emoji scope, a 255-emoji message id and a 200-emoji request id
    work (4 UTF-8 bytes each on MariaDB's utf8mb4); one more character is InvalidArgument; keys that
    differ only in their last 4-byte character stay distinct (nothing truncated)."""
    scope = "\U0001f600" * 200
    token = _issue(engine, scope)
    rid = "\u00e9" * 199 + "\U0001f4b3"
    first = _consume(engine, token, scope, request_id=rid)
    assert first.outcome is Outcome.APPLIED
    again = _consume(engine, token, scope, request_id=rid)
    assert (again.outcome, again.same_request) == (Outcome.REPEATED, True)
    assert _consume(engine, "\U0001f600" * 255, scope).outcome is Outcome.NOT_FOUND
    with Session(engine) as session, session.begin():
        with pytest.raises(InvalidArgument):
            issue_token(session, scope=scope + "x", ttl=HOUR)
        with pytest.raises(InvalidArgument):
            consume_token(session, "\U0001f600" * 256, scope=scope)
        with pytest.raises(InvalidArgument):
            consume_token(session, token, scope=scope, request_id=rid + "x")
        consumer = "\u4e2d" * 200
        m1, m2 = "m" * 254 + "\U0001f600", "m" * 254 + "\U0001f601"
        assert consume_once(session, consumer, m1).applied
        assert consume_once(session, consumer, m2).applied
        assert consume_once(session, consumer, m1).outcome is Outcome.REPEATED
        with pytest.raises(InvalidArgument):
            consume_once(session, consumer + "x", m1)
        with pytest.raises(InvalidArgument):
            consume_once(session, consumer, m1 + "x")
    with engine.connect() as conn:
        stored = set(conn.execute(select(consumed_messages.c.message_id)).scalars())
    assert stored == {m1, m2}


@pytest.mark.parametrize(
    "ttl",
    [timedelta(0), timedelta(seconds=-1), timedelta(microseconds=999), 60, 1.5, None, "1h"],
    ids=["zero", "negative", "sub-ms", "int", "float", "none", "str"],
)
def test_bad_ttls_are_typed_and_write_nothing(engine: Engine, ttl: Any) -> None:
    with Session(engine) as session, session.begin():
        with pytest.raises(InvalidArgument):
            issue_token(session, scope="ttl", ttl=ttl)
    assert _token_rows(engine) == 0


def test_extreme_ttls_one_ms_and_timedelta_max(engine: Engine, backend: Backend) -> None:
    """ttl=1 ms expires (REJECTED, then purged); ttl=timedelta.max (~2.7 million years) is live,
    consumable once, and never purged."""
    tiny = _issue(engine, "ttl", timedelta(milliseconds=1))
    huge = _issue(engine, "ttl", timedelta.max)
    time.sleep(0.05)
    assert _consume(engine, tiny, "ttl").outcome is Outcome.REJECTED
    assert purge_expired_tokens(engine) == 1
    assert _consume(engine, tiny, "ttl").outcome is Outcome.NOT_FOUND
    assert _consume(engine, huge, "ttl").outcome is Outcome.APPLIED
    assert purge_expired_tokens(engine) == 0
    assert _consume(engine, huge, "ttl").outcome is Outcome.REPEATED


@pytest.fixture
def skewed_clock(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """Skew the application process's wall clock (time.time and time.time_ns) by some seconds."""
    real_time, real_ns = time.time, time.time_ns

    def skew(seconds: float) -> None:
        monkeypatch.setattr(time, "time", lambda: real_time() + seconds)
        monkeypatch.setattr(time, "time_ns", lambda: real_ns() + int(seconds * 1e9))

    return skew


@pytest.mark.parametrize("hours", [-6, 6, 24 * 365])
def test_expiry_is_judged_on_the_database_clock_whatever_the_app_clock(
    engine: Engine, backend: Backend, skewed_clock: Callable[[float], None], hours: int
) -> None:
    """With the application's wall clock hours off in either direction: a 1-hour token is live, a
    short one expires after its real ttl, and a purge removes only the expired one."""
    skewed_clock(hours * 3600)
    live = _issue(engine, "skew")
    short = _issue(engine, "skew", SHORT)
    assert _consume(engine, live, "skew").outcome is Outcome.APPLIED
    skewed_clock(-hours * 3600)
    time.sleep(SHORT.total_seconds() * 2)
    assert _consume(engine, short, "skew").outcome is Outcome.REJECTED
    assert purge_expired_tokens(engine) == 1
    assert _consume(engine, live, "skew").outcome is Outcome.REPEATED


def test_request_id_tells_the_same_request_apart(engine: Engine) -> None:
    """A retry with the consuming request id is REPEATED with same_request=True (a UUID equals its
    text); any other id, or none, is REPEATED with same_request=False."""
    rid = uuid.uuid4()
    token = _issue(engine, "rid")
    assert _consume(engine, token, "rid", request_id=rid).outcome is Outcome.APPLIED
    for other, same in [(rid, True), (str(rid), True), (str(uuid.uuid4()), False), (None, False)]:
        result = _consume(engine, token, "rid", request_id=other)
        assert (result.outcome, result.same_request) == (Outcome.REPEATED, same), other


def test_scope_and_token_compare_exactly(engine: Engine, backend: Backend) -> None:
    """MariaDB's default collations fold case and pad spaces: a token of scope "Pay:1" must be
    NOT_FOUND in "pay:1", "Pay:1 " and "Pay:1\\t", and the token's own case and trailing space matter."""
    token = _issue(engine, "Pay:1")
    for scope in ["pay:1", "Pay:1 ", "PAY:1", "Pay:1\t", "\uff30ay:1"]:
        assert _consume(engine, token, scope).outcome is Outcome.NOT_FOUND, repr(scope)
    for variant in [token.swapcase(), token + " ", " " + token]:
        assert _consume(engine, variant, "Pay:1").outcome is Outcome.NOT_FOUND, repr(variant)
    assert _consume(engine, token, "Pay:1").outcome is Outcome.APPLIED


# --------------------------------------------------------------------------
# Purge arguments and transactions
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch",
    [0, -1, True, 1.5, "10", None, 10**3 + 0.0],
    ids=["0", "-1", "bool", "float", "str", "none", "1000.0"],
)
def test_bad_purge_batches_are_invalid_argument(engine: Engine, batch: Any) -> None:
    expired = _issue(engine, "purge", timedelta(milliseconds=1))
    time.sleep(0.01)
    with pytest.raises(InvalidArgument):
        purge_expired_tokens(engine, batch=batch)
    assert _consume(engine, expired, "purge").outcome is Outcome.REJECTED  # nothing deleted


# Found: a batch of 2**63 or more (a positive int, the documented contract) escaped as a raw driver
# error: SQLite OverflowError, PostgreSQL DataError "bigint out of range" (aborting a caller's
# transaction), MariaDB ProgrammingError 1064 for 2**70 (a LIMIT literal).  Now clamped to 2**63 - 1.
@pytest.mark.parametrize("batch", [2**63 - 1, 2**63, 2**70], ids=["int64-max", "2**63", "2**70"])
def test_huge_purge_batch_is_clamped_and_purges(engine: Engine, backend: Backend, batch: int) -> None:
    expired = _issue(engine, "purge", timedelta(milliseconds=1))
    live = _issue(engine, "purge")
    time.sleep(0.01)
    assert purge_expired_tokens(engine, batch=batch) == 1
    assert _consume(engine, expired, "purge").outcome is Outcome.NOT_FOUND  # purged
    assert _consume(engine, live, "purge").outcome is Outcome.APPLIED


def test_purge_in_a_rolled_back_connection_deletes_nothing_and_keeps_consumed_live_tokens(
    engine: Engine, backend: Backend
) -> None:
    """A purge in the caller's Connection rolls back with it; consumed-but-unexpired tokens are never
    purged (a replay stays REPEATED, not NOT_FOUND)."""
    expired = _issue(engine, "keep", timedelta(milliseconds=1))
    consumed = _issue(engine, "keep")
    assert _consume(engine, consumed, "keep").applied
    time.sleep(0.01)
    with engine.connect() as conn:
        with conn.begin() as tx:
            assert purge_expired_tokens(conn) == 1
            tx.rollback()
    assert _consume(engine, expired, "keep").outcome is Outcome.REJECTED
    assert purge_expired_tokens(engine, batch=10) == 1
    assert _consume(engine, consumed, "keep").outcome is Outcome.REPEATED
    assert _token_rows(engine) == 1


def test_wrong_session_objects_are_invalid_argument_and_scoped_session_works(engine: Engine) -> None:
    """Errors: an Engine, a Connection or a sessionmaker where a Session is expected is InvalidArgument;
    a scoped_session is used through its current session."""
    factory = sessionmaker(engine)
    with engine.connect() as conn:
        for wrong in (engine, conn, factory):
            with pytest.raises(InvalidArgument):
                issue_token(wrong, scope="s", ttl=HOUR)
            with pytest.raises(InvalidArgument):
                consume_token(wrong, "t", scope="s")
            with pytest.raises(InvalidArgument):
                consume_once(wrong, "c", "m")
    scoped = scoped_session(factory)
    try:
        token = issue_token(scoped, scope="s", ttl=HOUR)
        scoped.commit()
        assert consume_token(scoped, token, scope="s").applied
        assert consume_once(scoped, "c", "m").applied
        scoped.commit()
    finally:
        scoped.remove()
    assert _consume(engine, token, "s").outcome is Outcome.REPEATED


# --------------------------------------------------------------------------
# Insert once / consume_once
# --------------------------------------------------------------------------


@pytest.fixture
def parcels(backend: Backend, engine: Engine) -> Engine:
    return backend.create(Base.metadata)


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
    allowed = (DeadlockDetected,) if backend.name == "mariadb" else ()
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


# --------------------------------------------------------------------------
# Redis tokens
# --------------------------------------------------------------------------


@pytest.fixture
def redis_scope(redis_client: Any) -> Iterator[str]:
    """A scope unique to this test; its keys are deleted afterwards."""
    scope = f"sg-attack-{uuid.uuid4().hex[:10]}"
    yield scope
    for key in redis_client.scan_iter(match=f"stateguard:token:{scope}*", count=1000):
        redis_client.delete(key)


def test_redis_64_threads_from_a_barrier_consume_once(redis_client: Any, redis_scope: str) -> None:
    """64 threads, each with its own RedisTokens and client, released together on one token: one
    APPLIED and 63 REPEATED; a token of a neighbouring scope (scope + ":x") is untouched."""
    tokens_ = RedisTokens(redis_client)
    token = tokens_.issue(scope=redis_scope, ttl=HOUR)
    neighbour = tokens_.issue(scope=redis_scope + ":x", ttl=HOUR)
    barrier = threading.Barrier(64)
    import redis

    def consume(i: int) -> Any:
        client = redis.Redis.from_url(REDIS_URL)
        try:
            mine = RedisTokens(client)
            barrier.wait()
            return mine.consume(token, scope=redis_scope)
        finally:
            client.close()

    outcomes = _outcomes(_run_threads(64, consume))
    assert outcomes == Counter({"APPLIED": 1, "REPEATED": 63}), outcomes
    assert tokens_.consume(neighbour, scope=redis_scope + ":x").outcome is Outcome.APPLIED
    assert tokens_.consume(token, scope=redis_scope + ":x").outcome is Outcome.NOT_FOUND


def test_redis_async_tasks_on_one_object_consume_once(redis_scope: str) -> None:
    """200 asyncio tasks on one AsyncRedisTokens, gathered at once: exactly one APPLIED."""
    import redis.asyncio as aredis

    async def main() -> Counter[str]:
        pool = aredis.BlockingConnectionPool.from_url(REDIS_URL, max_connections=32, timeout=30)
        client = aredis.Redis(connection_pool=pool)
        try:
            tokens_ = AsyncRedisTokens(client)
            token = await tokens_.issue(scope=redis_scope, ttl=HOUR)
            results = await asyncio.gather(
                *(tokens_.consume(token, scope=redis_scope) for _ in range(200)), return_exceptions=True
            )
            return _outcomes(list(results))
        finally:
            await client.aclose()
            # A pool passed in is not closed with its client: its connections' StreamWriters would
            # outlive this event loop and warn "loop is closed" in a later test.
            await pool.aclose()

    outcomes = asyncio.run(main())
    assert outcomes == Counter({"APPLIED": 1, "REPEATED": 199}), outcomes


def test_redis_tombstone_keeps_the_ttl_and_ttl_edges(redis_client: Any, redis_scope: str) -> None:
    """A consumed token's tombstone keeps the remaining TTL (no key without expiry is left behind);
    ttl=1 ms expires to NOT_FOUND; timedelta.max is accepted or refused as InvalidArgument, never a
    raw Redis error; bad ttls are InvalidArgument and write nothing."""
    tokens_ = RedisTokens(redis_client)
    token = tokens_.issue(scope=redis_scope, ttl=timedelta(seconds=30))
    assert tokens_.consume(token, scope=redis_scope).applied
    pttl = redis_client.pttl(RedisTokens.key(redis_scope, token))
    assert 0 < pttl <= 30_000
    assert tokens_.consume(token, scope=redis_scope).outcome is Outcome.REPEATED
    tiny = tokens_.issue(scope=redis_scope, ttl=timedelta(milliseconds=1))
    time.sleep(0.05)
    assert tokens_.consume(tiny, scope=redis_scope).outcome is Outcome.NOT_FOUND
    try:
        huge = tokens_.issue(scope=redis_scope, ttl=timedelta.max)
    except InvalidArgument:
        pass
    else:
        assert tokens_.consume(huge, scope=redis_scope).applied
        assert redis_client.pttl(RedisTokens.key(redis_scope, huge)) > 0
    for bad in [timedelta(0), timedelta(seconds=-5), timedelta(microseconds=10), 60]:
        with pytest.raises(InvalidArgument):
            tokens_.issue(scope=redis_scope, ttl=bad)
    for hostile in ["a\x00b", "x\udc00", b"raw", None, "", "x" * 256]:
        with pytest.raises(InvalidArgument):
            tokens_.consume(hostile, scope=redis_scope)  # type: ignore[arg-type]
    keys = list(redis_client.scan_iter(match=f"stateguard:token:{redis_scope}*"))
    assert all(redis_client.pttl(k) > 0 for k in keys), keys


def test_redis_and_sql_tokens_store_only_the_digest(
    redis_client: Any, redis_scope: str, engine: Engine
) -> None:
    """Neither Redis nor the table holds the token itself, only its SHA-256."""
    token = RedisTokens(redis_client).issue(scope=redis_scope, ttl=HOUR)
    keys = [k.decode() for k in redis_client.scan_iter(match=f"stateguard:token:{redis_scope}*")]
    assert keys == [f"stateguard:token:{redis_scope}:{token_digest(token)}"]
    assert token not in redis_client.get(keys[0]).decode()
    sql_token = _issue(engine, "digest")
    with engine.connect() as conn:
        row = conn.execute(select(tokens)).one()
    assert row.token_hash == token_digest(sql_token) and sql_token not in str(tuple(row))


# --------------------------------------------------------------------------
# More attacks: sweepers, SQLite lock upgrades, Redis caller identity
# --------------------------------------------------------------------------


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


# Found: Trigger.where(limit=2**63) (a positive int, as documented) escaped as a raw OverflowError
# (SQLite) / DataError "bigint out of range" (PostgreSQL).  Now clamped like a purge batch.
def test_sweep_with_a_huge_limit_is_clamped(parcels: Engine, backend: Backend) -> None:
    with Session(parcels) as session, session.begin():
        session.add_all([SweepOrder(id=1), SweepOrder(id=2)])
    with Session(parcels) as session, session.begin():
        moved = SweepOrder.flow.cancel.where(session, SweepOrder.id > 0, limit=2**63)
    assert sorted(moved) == [1, 2]


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


_BUSY_SCRIPT = """
local s = redis.call('TIME')
local start = s[1] * 1000000 + s[2]
while true do
    local n = redis.call('TIME')
    if n[1] * 1000000 + n[2] - start > tonumber(ARGV[1]) then break end
end
return 1
"""


# Found: README: "calling consume again for the same token on the same RedisTokens object from the
# same thread ... goes on under the failed call's id ... Any other caller gets REPEATED."  A thread
# whose consume timed out (the script still ran: the token is now used:<its call id>) and then ended
# handed its identity to the next new thread that got the recycled thread ident, which was told
# APPLIED without having consumed the token: _caller() keyed pending calls by threading.get_ident().
def test_redis_a_new_thread_never_inherits_a_dead_threads_lost_consume(
    redis_client: Any, redis_scope: str
) -> None:
    import redis

    slow = redis.Redis.from_url(REDIS_URL, socket_timeout=0.1, retry=None)
    try:
        tokens_ = RedisTokens(slow)
        token = tokens_.issue(scope=redis_scope, ttl=HOUR)
        seen: dict[str, Any] = {}

        def stall_server() -> None:
            blocker = redis.Redis.from_url(REDIS_URL)
            try:
                blocker.eval(_BUSY_SCRIPT, 0, 400_000)  # Redis runs nothing else for 0.4 s
            finally:
                blocker.close()

        def first_caller() -> None:
            seen["first_ident"] = threading.get_ident()
            stall = threading.Thread(target=stall_server)
            stall.start()
            time.sleep(0.05)
            try:
                seen["first"] = tokens_.consume(token, scope=redis_scope)
            except redis.RedisError as error:  # the reply did not come within socket_timeout
                seen["first"] = error
            stall.join()

        def later_caller() -> None:
            # Only the new thread that got the dead thread's recycled ident consumes.
            if threading.get_ident() == seen["first_ident"]:
                seen["later"] = tokens_.consume(token, scope=redis_scope)

        t = threading.Thread(target=first_caller)
        t.start()
        t.join(30)
        assert isinstance(seen["first"], redis.RedisError), seen
        time.sleep(0.1)
        stored = redis_client.get(RedisTokens.key(redis_scope, token))
        assert stored is not None and stored.startswith(b"used:"), "the timed-out consume did not run"
        for _ in range(2000):  # new threads until one gets the dead thread's ident
            t = threading.Thread(target=later_caller)
            t.start()
            t.join(30)
            if "later" in seen:
                break
        else:
            pytest.skip("no new thread got the dead thread's ident")
        assert seen["later"].outcome is Outcome.REPEATED, "a new thread inherited a dead thread's consume"
    finally:
        slow.close()


# --------------------------------------------------------------------------
# The sweeper's lock (README "Scheduled sweeper")
# --------------------------------------------------------------------------


def test_sweeper_lock_timeout_zero_gives_up_at_once_and_is_not_retried(backend: Backend) -> None:
    """A second sweeper with timeout=0 gets LockNotAcquired at once (no wait), retry_on_conflict(...,
    lock_not_acquired=False) calls it once; SQLite has no named locks: NotSupported."""
    from stateguard import LockNotAcquired, NotSupported, advisory_lock

    engine = backend.engine
    name = f"cron:sweep-{uuid.uuid4().hex[:8]}"
    if backend.name == "sqlite":
        with Session(engine) as session, session.begin():
            with pytest.raises(NotSupported):
                with advisory_lock(session, name, timeout=0):
                    pass
        return
    calls: list[float] = []

    def second_sweeper() -> None:
        with Session(engine) as session, session.begin():
            calls.append(time.monotonic())
            with advisory_lock(session, name, timeout=0):
                pytest.fail("the second sweeper took a held lock")

    with Session(engine) as holder, holder.begin():
        with advisory_lock(holder, name):
            started = time.monotonic()
            with pytest.raises(LockNotAcquired):
                retry_on_conflict(second_sweeper, lock_not_acquired=False)
            assert len(calls) == 1 and time.monotonic() - started < 2
    with Session(engine) as session, session.begin():
        with advisory_lock(session, name, timeout=0):
            pass  # free again once the holder ended


@pytest.mark.parametrize("server", ["pg", "mariadb"])
def test_sweeper_lock_in_the_readme_shape_is_held_as_documented(
    request: pytest.FixtureRequest, server: str
) -> None:
    """README's sweeper shape, `with session.begin():` around `with advisory_lock(...)`: on PostgreSQL
    the lock is held until the COMMIT; on MariaDB GET_LOCK is released when the block exits (before the
    COMMIT), and a commit inside the block keeps the lock over the commit, as the README says.

    Found: the README's comment said "held until COMMIT" for both."""
    from stateguard import LockNotAcquired, advisory_lock

    backend: Backend = request.getfixturevalue(server)
    engine = backend.engine
    name = f"cron:sweep-{uuid.uuid4().hex[:8]}"

    def taken_by_another() -> bool:
        with Session(engine) as other, other.begin():
            try:
                with advisory_lock(other, name, timeout=0):
                    return False
            except LockNotAcquired:
                return True

    with Session(engine) as session, session.begin():
        with advisory_lock(session, name, timeout=0):
            session.execute(text("SELECT 1"))
            assert taken_by_another()
        # After the block, before the COMMIT of session.begin():
        assert taken_by_another() is (server == "pg")
    assert not taken_by_another()
    with Session(engine) as session:
        with advisory_lock(session, name, timeout=0):
            session.execute(text("SELECT 1"))
            assert taken_by_another()
            session.commit()  # inside the block: held up to the commit on both, released with it
            assert not taken_by_another()
    assert not taken_by_another()


@pytest.mark.parametrize("server", ["pg", "mariadb"])
def test_sweeper_lock_does_not_stay_behind_after_a_failed_batch(
    request: pytest.FixtureRequest, server: str
) -> None:
    """A batch that raises inside the lock: the lock is free for the next sweeper (never left in a
    pooled connection), on a pool of one connection that is reused at once."""
    from stateguard import advisory_lock

    backend: Backend = request.getfixturevalue(server)
    engine = backend.new_engine(pool_size=1, max_overflow=0)
    other_engine = backend.new_engine(pool_size=1, max_overflow=0)
    name = f"cron:sweep-{uuid.uuid4().hex[:8]}"
    try:
        with pytest.raises(ZeroDivisionError):
            with Session(engine) as session, session.begin():
                with advisory_lock(session, name, timeout=0):
                    _ = 1 / 0
        with Session(other_engine) as session, session.begin():
            with advisory_lock(session, name, timeout=0):
                pass
    finally:
        engine.dispose()
        other_engine.dispose()


def test_redis_wait_replicas_without_replicas_is_a_typed_timeout_with_the_value(
    redis_client: Any, redis_scope: str
) -> None:
    """wait_replicas=1 on a server with no replica: issue and APPLIED consume raise ReplicationTimeout
    whose .value is the token / the Result (the write happened on the master); REPEATED and
    NOT_FOUND wrote nothing and are answered, not raised."""
    from stateguard import ReplicationTimeout

    if int(redis_client.info("replication").get("connected_slaves", 0)) > 0:
        pytest.skip("this Redis has replicas")
    durable = RedisTokens(redis_client, wait_replicas=1, wait_timeout=0.05)
    with pytest.raises(ReplicationTimeout) as issued:
        durable.issue(scope=redis_scope, ttl=HOUR)
    token = issued.value.value
    assert isinstance(token, str) and redis_client.get(RedisTokens.key(redis_scope, token)) is not None
    with pytest.raises(ReplicationTimeout) as consumed:
        durable.consume(token, scope=redis_scope)
    assert consumed.value.value.outcome is Outcome.APPLIED
    # They still send WAIT and wait wait_timeout (the docstring's "each consume that wrote" is not
    # what happens), but they are answered, not raised.
    assert durable.consume(token, scope=redis_scope).outcome is Outcome.REPEATED
    assert durable.consume("never-issued", scope=redis_scope).outcome is Outcome.NOT_FOUND


@pytest.mark.parametrize("suffix", ["*", "?", "[a-z]", "{tag}", ":", "\\", " ", "\u00e9\U0001f600"])
def test_redis_scopes_with_glob_and_hash_tag_characters_stay_separate(
    redis_client: Any, redis_scope: str, suffix: str
) -> None:
    """A scope with glob, hash-tag or separator characters is its own scope: its token is NOT_FOUND
    in the bare scope and in a look-alike, APPLIED in its own."""
    tokens_ = RedisTokens(redis_client)
    scope = redis_scope + suffix
    token = tokens_.issue(scope=scope, ttl=HOUR)
    for other in [redis_scope, redis_scope + "x", redis_scope + suffix + suffix]:
        assert tokens_.consume(token, scope=other).outcome is Outcome.NOT_FOUND, other
    assert tokens_.consume(token, scope=scope).outcome is Outcome.APPLIED
    assert tokens_.consume(token, scope=scope).outcome is Outcome.REPEATED


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


def test_a_consumed_token_that_then_expires_stays_repeated_until_purged(
    engine: Engine, backend: Backend
) -> None:
    """Consumed, then past its ttl: a replay is REPEATED (not REJECTED, not APPLIED) until the purge,
    NOT_FOUND after it."""
    token = _issue(engine, "late", SHORT)
    assert _consume(engine, token, "late").applied
    time.sleep(SHORT.total_seconds() * 2)
    assert _consume(engine, token, "late").outcome is Outcome.REPEATED
    assert purge_expired_tokens(engine) == 1
    assert _consume(engine, token, "late").outcome is Outcome.NOT_FOUND


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
