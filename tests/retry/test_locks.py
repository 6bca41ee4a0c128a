"""retry_on_conflict() and locks: LockNotAcquired is retried up to ``attempts`` (and not when its
retryable flag is off), a lock timeout's raw driver error is retried, and ``max_time`` caps many
attempts and a long backoff."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from stateguard import (
    LockNotAcquired,
    retry_on_conflict,
)
from tests._support.retry_conflicts import (
    Log,
    balances,
    bump,
    hold_row,
    log_tags,
    nowait_unit,
    setup,
)
from tests.conftest import Backend, backends_with

# ---------------------------------------------------------------- deadlocks


@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_lock_not_acquired_retried_up_to_attempts_and_raised(backend: Backend) -> None:
    """Promise: LockNotAcquired is retried; after ``attempts`` calls the last error is raised."""
    engine = setup(backend)
    release = hold_row(engine)
    calls: list[int] = []
    waits: list[float] = []
    try:
        with pytest.raises(LockNotAcquired):
            retry_on_conflict(nowait_unit(engine, calls), attempts=6, backoff=0.001, sleep=waits.append)
    finally:
        release()
    assert len(calls) == 6
    assert len(waits) == 5 and all(0 <= w <= 1.0 for w in waits), waits
    assert balances(engine)[1] == 0 and log_tags(engine) == []


@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_lock_not_acquired_false_is_not_retried(backend: Backend) -> None:
    """Promise: lock_not_acquired=False raises LockNotAcquired after one call."""
    engine = setup(backend)
    release = hold_row(engine)
    calls: list[int] = []
    try:
        with pytest.raises(LockNotAcquired):
            retry_on_conflict(nowait_unit(engine, calls), attempts=6, lock_not_acquired=False)
    finally:
        release()
    assert len(calls) == 1
    assert log_tags(engine) == []


@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_lock_not_acquired_then_free_applies_once(backend: Backend) -> None:
    """A lock held for the first attempts only: the retry gets it and applies exactly once."""
    engine = setup(backend)
    release = hold_row(engine)
    calls: list[int] = []
    inner = nowait_unit(engine, calls)

    def unit() -> None:
        if len(calls) == 2:
            release()
        inner()

    try:
        retry_on_conflict(unit, attempts=5, backoff=0.001)
    finally:
        release()
    assert len(calls) == 3
    assert balances(engine)[1] == 1 and log_tags(engine) == ["nowait"]


@pytest.mark.cancel
@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_lock_timeout_raw_driver_error_is_retried(backend: Backend) -> None:
    """Promise: lock timeouts are recognised by code (PostgreSQL 55P03 lock_timeout, MariaDB 1205)."""
    engine = setup(backend)
    release = hold_row(engine)
    calls: list[int] = []

    def unit() -> None:
        calls.append(1)
        if len(calls) == 3:
            release()
        with Session(engine) as s, s.begin():
            if backend.name == "postgresql":
                s.execute(text("SET LOCAL lock_timeout = '100ms'"))
            else:
                s.execute(text("SET SESSION innodb_lock_wait_timeout = 1"))
            s.add(Log(tag="timeout"))
            s.flush()
            bump(s, 1)

    try:
        retry_on_conflict(unit, attempts=5, backoff=0.001)
    finally:
        release()
        if backend.name == "mariadb":
            with engine.connect() as conn:  # pooled connections: put the default back
                conn.execute(text("SET SESSION innodb_lock_wait_timeout = DEFAULT"))
    assert len(calls) == 3
    assert balances(engine)[1] == 1 and log_tags(engine) == ["timeout"]


def test_max_time_caps_many_attempts(pg: Backend) -> None:
    """Promise: max_time caps the time even when attempts would allow thousands of calls."""
    engine = setup(pg)
    release = hold_row(engine)
    calls: list[int] = []
    started = time.monotonic()
    try:
        with pytest.raises(LockNotAcquired):
            retry_on_conflict(
                nowait_unit(engine, calls), attempts=100_000, backoff=0.02, max_backoff=0.02, max_time=0.5
            )
    finally:
        release()
    elapsed = time.monotonic() - started
    assert 0.3 <= elapsed < 1.2, elapsed
    assert 1 < len(calls) < 100_000


def test_max_time_caps_a_long_backoff(pg: Backend) -> None:
    """Promise: max_time caps the time: a 10 s backoff does not outlast max_time=0.3 s."""
    engine = setup(pg)
    release = hold_row(engine)
    calls: list[int] = []
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        time.sleep(seconds)

    started = time.monotonic()
    try:
        for _ in range(3):  # the jitter is random: try a few times
            with pytest.raises(LockNotAcquired):
                retry_on_conflict(
                    nowait_unit(engine, calls),
                    attempts=50,
                    backoff=10,
                    max_backoff=10,
                    max_time=0.3,
                    sleep=sleep,
                )
    finally:
        release()
    elapsed = time.monotonic() - started
    assert elapsed < 3 * 0.3 + 1.0, (elapsed, waits)
