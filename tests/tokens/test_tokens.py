"""One-time tokens (stateguard.tokens) on every SQL backend and on Redis."""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, select, text
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.orm import Session

from stateguard import (
    InvalidArgument,
    NotFound,
    Outcome,
    RedisTokens,
    TransitionRejected,
    consume_token,
    create_tables,
    drop_tables,
    issue_token,
    purge_expired_tokens,
)
from stateguard.tables import tokens as tokens_table
from tests._support import token_workers as w
from tests.conftest import REDIS_URL, Backend, count_statements

MINUTE = timedelta(minutes=1)


#: A ttl short enough to wait out: expiry is the database's clock, so tests wait instead of moving a clock.
SHORT = timedelta(milliseconds=200)


def _outlive(ttl: timedelta = SHORT) -> None:
    """Sleep until tokens issued with ``ttl`` before this call have expired on the database's clock."""
    time.sleep(ttl.total_seconds() + 0.05)


@pytest.fixture
def scope(redis_client: Any) -> Iterator[str]:
    """A scope unique to the test; its Redis keys are deleted afterwards."""
    name = f"sgt-{uuid.uuid4().hex[:12]}"
    yield name
    keys = list(redis_client.scan_iter(match=f"stateguard:token:{name}:*"))
    if keys:
        redis_client.delete(*keys)


def _issue(engine: Engine, scope: str = "s", ttl: timedelta = MINUTE) -> str:
    with Session(engine) as s, s.begin():
        return issue_token(s, scope=scope, ttl=ttl)


def _consume(engine: Engine, token: str, scope: str = "s") -> Any:
    with Session(engine) as s, s.begin():
        return consume_token(s, token, scope=scope)


# --------------------------------------------------------------------------
# SQL: outcomes
# --------------------------------------------------------------------------


def test_first_consume_applies_and_later_ones_repeat(engine: Engine) -> None:
    """A token is APPLIED in one UPDATE the first time and REPEATED (UPDATE + SELECT) after."""
    token = _issue(engine)
    assert len(token) >= 40
    with count_statements(engine) as c:
        first = _consume(engine, token)
    assert first.outcome is Outcome.APPLIED and first.applied
    assert [s.split()[0] for s in c.statements] == ["UPDATE"]
    with count_statements(engine) as c:
        again = _consume(engine, token)
    assert again.outcome is Outcome.REPEATED
    assert [s.split()[0] for s in c.statements] == ["UPDATE", "SELECT"]
    assert again.raise_for_outcome() is again
    assert token not in repr(first) and first.key == hashlib.sha256(token.encode()).hexdigest()


def test_unknown_tokens_and_other_scopes_are_not_found(engine: Engine) -> None:
    """A forged token and a real token presented for another scope are NOT_FOUND and change nothing."""
    token = _issue(engine, scope="payments:alice")
    assert _consume(engine, "not-a-token", "payments:alice").outcome is Outcome.NOT_FOUND
    other = _consume(engine, token, "payments:bob")
    assert other.outcome is Outcome.NOT_FOUND
    with pytest.raises(NotFound):
        other.raise_for_outcome()
    assert _consume(engine, token, "payments:alice").outcome is Outcome.APPLIED


def test_expired_tokens_are_rejected(engine: Engine) -> None:
    """A token consumed after its expiry is REJECTED; one consumed before it is APPLIED."""
    late, on_time = _issue(engine, ttl=SHORT), _issue(engine, ttl=MINUTE)
    _outlive()
    assert _consume(engine, on_time).outcome is Outcome.APPLIED
    r = _consume(engine, late)
    assert r.outcome is Outcome.REJECTED and r.state == "expired"
    with pytest.raises(TransitionRejected):
        r.raise_for_outcome()
    # Consumed before it expired: still a replay, not an expiry.
    assert _consume(engine, on_time).outcome is Outcome.REPEATED


@pytest.mark.rollback
def test_a_rolled_back_consumption_leaves_the_token_usable(engine: Engine) -> None:
    """Consumption is part of the caller's transaction: a rollback gives the token back."""
    token = _issue(engine)
    with Session(engine) as s:
        assert consume_token(s, token, scope="s").applied
        s.rollback()
    assert _consume(engine, token).outcome is Outcome.APPLIED


def test_only_the_hash_is_stored(engine: Engine) -> None:
    """The table holds the token's SHA-256, scope and times, never the token itself."""
    token = _issue(engine, scope="links")
    with engine.connect() as conn:
        row = conn.execute(select(tokens_table)).one()
    assert row.token_hash == hashlib.sha256(token.encode()).hexdigest()
    assert token not in [str(v) for v in row]
    assert row.scope == "links" and row.consumed_ms is None
    assert row.expires_ms - row.created_ms == 60_000


def test_on_commit_runs_only_for_the_consumer(engine: Engine) -> None:
    """``on_commit`` fires after commit for the APPLIED consumption and never for the repeat."""
    token = _issue(engine)
    ran: list[str] = []
    for _ in range(2):
        with Session(engine) as s, s.begin():
            consume_token(s, token, scope="s").on_commit(ran.append, "sent")
    assert ran == ["sent"]


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("token", "scope"),
    [
        (None, "s"),
        (b"bytes", "s"),
        ("", "s"),
        ("   ", "s"),
        ("x" * 256, "s"),
        ("a\x00b", "s"),
        ("tok", ""),
        ("tok", 7),
        ("tok", "s" * 201),
        ("tok", "sc\x00ope"),
    ],
)
def test_bad_consume_input_is_typed_and_sends_nothing(engine: Engine, token: Any, scope: Any) -> None:
    """Bad tokens and scopes raise InvalidArgument before any SQL is sent."""
    with count_statements(engine) as c, Session(engine) as s, pytest.raises(InvalidArgument):
        consume_token(s, token, scope=scope)
    assert len(c) == 0


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("scope", "ttl"),
    [("", MINUTE), (None, MINUTE), ("s", timedelta(0)), ("s", timedelta(seconds=-1)), ("s", 60)],
)
def test_bad_issue_input_is_typed_and_writes_nothing(engine: Engine, scope: Any, ttl: Any) -> None:
    """A blank scope or a ttl that is not a positive timedelta raises InvalidArgument with no SQL."""
    with count_statements(engine) as c, Session(engine) as s, pytest.raises(InvalidArgument):
        issue_token(s, scope=scope, ttl=ttl)
    assert len(c) == 0


# --------------------------------------------------------------------------
# SQL: purge
# --------------------------------------------------------------------------


def test_purge_deletes_expired_tokens_in_batches(engine: Engine) -> None:
    """Expired tokens go in batches of at most ``batch``; live ones (consumed or not) stay."""
    with Session(engine) as s, s.begin():
        for _ in range(25):
            issue_token(s, scope="old", ttl=SHORT)
        live = [issue_token(s, scope="new", ttl=MINUTE) for _ in range(3)]
    assert _consume(engine, live[0], "new").applied
    _outlive()
    assert [purge_expired_tokens(engine, batch=10) for _ in range(4)] == [10, 10, 5, 0]
    with engine.connect() as conn:
        assert sorted(conn.execute(select(tokens_table.c.scope)).scalars()) == ["new"] * 3
    assert _consume(engine, live[0], "new").outcome is Outcome.REPEATED
    with pytest.raises(InvalidArgument):
        purge_expired_tokens(engine, batch=0)


def test_purge_in_the_callers_transaction(engine: Engine) -> None:
    """With a Session the purge joins its transaction: a rollback keeps the rows."""
    _issue(engine, ttl=SHORT)
    _outlive()
    with Session(engine) as s:
        assert purge_expired_tokens(s) == 1
        s.rollback()
    with engine.begin() as conn:
        assert purge_expired_tokens(conn) == 1
    assert purge_expired_tokens(engine) == 0


def test_purge_skips_rows_a_consumer_holds_on_postgresql(pg: Backend) -> None:
    """On PostgreSQL a purge does not wait behind a locked expired row (SKIP LOCKED)."""
    engine = pg.engine
    drop_tables(engine)
    create_tables(engine)
    try:
        held = _issue(engine, ttl=SHORT)
        _issue(engine, ttl=SHORT)
        _outlive()
        with Session(engine) as holder:
            r = consume_token(holder, held, scope="s")
            assert r.outcome is Outcome.REJECTED
            # Lock the expired row as a concurrent writer would.
            holder.execute(select(tokens_table).where(tokens_table.c.token_hash == r.key).with_for_update())
            with engine.connect() as conn:
                conn.execute(text("SET lock_timeout = '2s'"))
                started = time.monotonic()
                assert purge_expired_tokens(conn) == 1
                conn.commit()
            assert time.monotonic() - started < 1.5
        assert purge_expired_tokens(engine) == 1
    finally:
        drop_tables(engine)


def test_purge_statement_text_per_dialect() -> None:
    """Each dialect gets its bounded DELETE: SKIP LOCKED subquery, DELETE ... LIMIT, rowid subquery."""
    pg_sql = str(
        purge_statement(tokens_table, _backend(postgresql.dialect()), 500).compile(
            dialect=postgresql.dialect()
        )
    )
    assert "FOR UPDATE SKIP LOCKED" in pg_sql and "LIMIT" in pg_sql and "token_hash IN" in pg_sql
    my_sql = str(
        purge_statement(tokens_table, _backend(mysql.dialect()), 500).compile(dialect=mysql.dialect())
    )
    assert my_sql.rstrip().endswith("LIMIT 500") and "SELECT" not in my_sql
    lite_sql = str(
        purge_statement(tokens_table, _backend(sqlite.dialect()), 500).compile(dialect=sqlite.dialect())
    )
    assert "rowid IN (SELECT rowid" in lite_sql and "LIMIT" in lite_sql


def purge_statement(table: Any, backend: Any, batch: int) -> Any:
    from stateguard import _kernel

    return _kernel.purge_statement(table, backend, batch)


def _backend(dialect: Any) -> Any:
    from stateguard import _kernel

    return _kernel.backend(dialect)


# --------------------------------------------------------------------------
# SQL: concurrency
# --------------------------------------------------------------------------


def test_16_threads_and_4_processes_consume_one_token_once(
    backend: Backend, engine: Engine, procs: tuple[Any, ProcessPoolExecutor]
) -> None:
    """20 consumers released by one barrier: exactly one APPLIED, every other one REPEATED."""
    manager, pool = procs
    token = _issue(engine)
    barrier = manager.Barrier(20, timeout=120)
    futures = [pool.submit(w.consume_sql, backend.name, backend.url, token, "s", barrier) for _ in range(4)]
    with ThreadPoolExecutor(16) as threads:
        local = [threads.submit(w.consume_sql_with_engine, engine, token, "s", barrier) for _ in range(16)]
        outcomes = Counter(f.result(timeout=180) for f in [*futures, *local])
    assert outcomes == {"APPLIED": 1, "REPEATED": 19}


# --------------------------------------------------------------------------
# Redis
# --------------------------------------------------------------------------


def test_redis_first_consume_applies_then_repeats(redis_client: Any, scope: str) -> None:
    """In Redis a token is APPLIED once and REPEATED after; the tombstone keeps the TTL."""
    tokens = RedisTokens(redis_client)
    token = tokens.issue(scope=scope, ttl=timedelta(seconds=30))
    key = RedisTokens.key(scope, token)
    assert token not in key and 0 < redis_client.pttl(key) <= 30_000
    assert tokens.consume(token, scope=scope).outcome is Outcome.APPLIED
    ttl_after = redis_client.pttl(key)
    assert 0 < ttl_after <= 30_000
    again = tokens.consume(token, scope=scope)
    assert again.outcome is Outcome.REPEATED and again.key == hashlib.sha256(token.encode()).hexdigest()
    assert 0 < redis_client.pttl(key) <= ttl_after


def test_redis_unknown_other_scope_and_expired_are_not_found(redis_client: Any, scope: str) -> None:
    """Redis says NOT_FOUND for a forged token, another scope, and (unavoidably) an expired token."""
    tokens = RedisTokens(redis_client)
    token = tokens.issue(scope=scope, ttl=timedelta(seconds=30))
    assert tokens.consume("forged", scope=scope).outcome is Outcome.NOT_FOUND
    assert tokens.consume(token, scope=f"{scope}-other").outcome is Outcome.NOT_FOUND
    short = tokens.issue(scope=scope, ttl=timedelta(milliseconds=100))
    time.sleep(0.3)
    expired = tokens.consume(short, scope=scope)
    assert expired.outcome is Outcome.NOT_FOUND
    with pytest.raises(NotFound):
        expired.raise_for_outcome()
    assert tokens.consume(token, scope=scope).outcome is Outcome.APPLIED


@pytest.mark.hostile
def test_redis_bad_input_is_typed(redis_client: Any, scope: str) -> None:
    """Bad tokens, scopes, ttls and clients raise InvalidArgument without touching Redis."""
    tokens = RedisTokens(redis_client)
    for bad in (None, "", "x" * 256, "a\x00b"):
        with pytest.raises(InvalidArgument):
            tokens.consume(bad, scope=scope)  # type: ignore[arg-type]
    for ttl in (timedelta(0), 5):
        with pytest.raises(InvalidArgument):
            tokens.issue(scope=scope, ttl=ttl)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        tokens.issue(scope="", ttl=MINUTE)
    with pytest.raises(InvalidArgument):
        RedisTokens(None)
    assert list(redis_client.scan_iter(match=f"stateguard:token:{scope}:*")) == []


def test_redis_16_threads_and_4_processes_consume_one_token_once(
    redis_client: Any, scope: str, procs: tuple[Any, ProcessPoolExecutor]
) -> None:
    """20 Redis consumers released by one barrier: exactly one APPLIED, every other one REPEATED."""
    manager, pool = procs
    token = RedisTokens(redis_client).issue(scope=scope, ttl=MINUTE)
    barrier = manager.Barrier(20, timeout=120)
    futures = [pool.submit(w.consume_redis, REDIS_URL, token, scope, barrier) for _ in range(4)]
    with ThreadPoolExecutor(16) as threads:
        local = [threads.submit(w.consume_redis, REDIS_URL, token, scope, barrier) for _ in range(16)]
        outcomes = Counter(f.result(timeout=180) for f in [*futures, *local])
    assert outcomes == {"APPLIED": 1, "REPEATED": 19}


def test_redis_consume_is_one_script_call(redis_client: Any, scope: str) -> None:
    """Consuming sends one EVALSHA (no GET then DEL) once the script is cached."""
    tokens = RedisTokens(redis_client)
    token = tokens.issue(scope=scope, ttl=MINUTE)
    tokens.consume("warm-up", scope=scope)
    sent: list[str] = []
    original = redis_client.execute_command
    lock = threading.Lock()

    def spy(*args: Any, **kwargs: Any) -> Any:
        with lock:
            sent.append(str(args[0]).upper())
        return original(*args, **kwargs)

    redis_client.execute_command = spy
    try:
        assert tokens.consume(token, scope=scope).applied
    finally:
        del redis_client.execute_command
    assert sent == ["EVALSHA"]
