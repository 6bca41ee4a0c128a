"""purge_tokens(): bad batches are InvalidArgument, a huge batch is clamped, a rolled-back purge deletes
nothing, purges racing issuers and consumers delete only expired tokens, and a consumed token that
then expires stays REPEATED until purged."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine

from stateguard import (
    InvalidArgument,
    Outcome,
    purge_expired_tokens,
)
from tests._support.token_races import (
    SHORT,
    _consume,
    _issue,
    _run_threads,
    _token_rows,
)
from tests.conftest import Backend


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


# --------------------------------------------------------------------------
# Purge arguments and transactions
# --------------------------------------------------------------------------


@pytest.mark.hostile
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


# Regression: a batch of 2**63 or more (a positive int, the documented contract) escaped as a raw driver
# error: SQLite OverflowError, PostgreSQL DataError "bigint out of range" (aborting a caller's
# transaction), MariaDB ProgrammingError 1064 for 2**70 (a LIMIT literal).  Now clamped to 2**63 - 1.
@pytest.mark.limits
@pytest.mark.parametrize("batch", [2**63 - 1, 2**63, 2**70], ids=["int64-max", "2**63", "2**70"])
def test_huge_purge_batch_is_clamped_and_purges(engine: Engine, backend: Backend, batch: int) -> None:
    expired = _issue(engine, "purge", timedelta(milliseconds=1))
    live = _issue(engine, "purge")
    time.sleep(0.01)
    assert purge_expired_tokens(engine, batch=batch) == 1
    assert _consume(engine, expired, "purge").outcome is Outcome.NOT_FOUND  # purged
    assert _consume(engine, live, "purge").outcome is Outcome.APPLIED


@pytest.mark.rollback
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
