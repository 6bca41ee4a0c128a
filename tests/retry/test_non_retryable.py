"""What retry_on_conflict() never retries: a real duplicate's IntegrityError, bad input, application
errors (also one caused by a retryable stateguard error), and ``attempts=1``."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from stateguard import (
    DeadlockDetected,
    InvalidArgument,
    LockNotAcquired,
    SerializationConflict,
    guarded_update,
    retry_on_conflict,
)
from tests._support.retry_conflicts import (
    Acct,
    AppError,
    Log,
    balances,
    bump,
    hold_row,
    log_tags,
    nowait_unit,
    setup,
)
from tests.conftest import Backend

# ------------------------------------------------------------ non-retryable


def test_integrity_error_of_real_duplicate_is_not_retried(backend: Backend) -> None:
    engine = setup(backend)
    calls: list[int] = []

    def unit() -> None:
        calls.append(1)
        with Session(engine) as s, s.begin():
            s.add(Log(tag="dup"))
            s.flush()
            s.add(Acct(id=1, balance=99))

    with pytest.raises(IntegrityError):
        retry_on_conflict(unit, attempts=5)
    assert len(calls) == 1
    assert balances(engine) == {1: 0, 2: 0} and log_tags(engine) == []


@pytest.mark.hostile
def test_bad_input_and_app_errors_are_not_retried(backend: Backend) -> None:
    engine = setup(backend)
    calls: list[int] = []

    def bad_input() -> Any:
        calls.append(1)
        with Session(engine) as s, s.begin():
            return guarded_update(s, Acct, 2**31, {"note": "x"}, expected_version=0)

    with pytest.raises(InvalidArgument):
        retry_on_conflict(bad_input)
    assert len(calls) == 1

    calls.clear()

    def app_error() -> None:
        calls.append(1)
        with Session(engine) as s, s.begin():
            bump(s, 1)
            raise AppError("no")

    with pytest.raises(AppError):
        retry_on_conflict(app_error)
    assert len(calls) == 1
    assert balances(engine) == {1: 0, 2: 0}


def test_app_exception_caused_by_retryable_stateguard_error_is_not_retried(pg: Backend) -> None:
    """An application's own exception raised while handling LockNotAcquired is raised at once."""
    engine = setup(pg)
    release = hold_row(engine)
    calls: list[int] = []
    inner = nowait_unit(engine, calls)

    def unit() -> None:
        try:
            inner()
        except LockNotAcquired:
            raise AppError("busy") from None

    try:
        with pytest.raises(AppError):
            retry_on_conflict(unit, attempts=5)
    finally:
        release()
    assert len(calls) == 1


def test_attempts_one_and_stateguard_retryable_flag(pg: Backend) -> None:
    """attempts=1 calls once; the raised errors are the documented retryable classes."""
    engine = setup(pg)
    release = hold_row(engine)
    calls: list[int] = []
    try:
        with pytest.raises(LockNotAcquired) as info:
            retry_on_conflict(nowait_unit(engine, calls), attempts=1)
    finally:
        release()
    assert len(calls) == 1
    assert info.value.retryable is True
    assert issubclass(DeadlockDetected, SerializationConflict)
