"""retry_on_conflict() on real conflicts: a deadlock between two threads (also inside one and two
levels of ``begin_nested()``), PostgreSQL serialization failures at REPEATABLE READ and SERIALIZABLE
(also at COMMIT), MariaDB's write skew and SQLite's busy snapshot are retried and apply once; a
STALE result is retried, and retries stop after ``attempts``.  Every test counts how often the unit
ran and checks the database afterwards in a new Session."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, func, select, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

import stateguard
from stateguard import (
    DeadlockDetected,
    guarded_update,
    retry_on_conflict,
)
from tests._support.retry_conflicts import (
    Acct,
    AppError,
    Log,
    balances,
    bump,
    chain,
    log_tags,
    pg_fast_options,
    setup,
)
from tests.conftest import Backend, backends_with


def run_threads(*targets: Callable[[], Any], timeout: float = 30) -> tuple[list[Any], list[BaseException]]:
    """Run targets in threads; return their results and the exceptions they raised (in order)."""
    results: list[Any] = [None] * len(targets)
    errors: list[BaseException | None] = [None] * len(targets)

    def wrap(i: int, target: Callable[[], Any]) -> None:
        try:
            results[i] = target()
        except BaseException as error:  # reported to the test
            errors[i] = error

    threads = [threading.Thread(target=wrap, args=(i, t), daemon=True) for i, t in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return results, errors  # type: ignore[return-value]


def is_deadlock(error: BaseException) -> bool:
    orig = getattr(error, "orig", None)
    if isinstance(error, DeadlockDetected) or getattr(orig, "sqlstate", None) == "40P01":
        return True
    return orig is not None and bool(orig.args) and orig.args[0] == 1213


def deadlock_unit(
    engine: Engine,
    first: int,
    second: int,
    barrier: threading.Barrier,
    calls: list[int],
    tag: str,
    nested: int = 0,
    on_deadlock: Callable[[BaseException], None] | None = None,
) -> Callable[[], int]:
    """A unit that logs a row, then (in ``nested`` savepoints) bumps ``first`` and ``second``;
    on its first call it waits at ``barrier`` between the two bumps."""

    def unit() -> int:
        calls.append(1)
        attempt = len(calls)
        with Session(engine) as s, s.begin():
            s.add(Log(tag=tag))
            s.flush()
            with contextlib.ExitStack() as stack:
                for _ in range(nested):
                    stack.enter_context(s.begin_nested())
                bump(s, first)
                if attempt == 1:
                    barrier.wait(10)
                try:
                    bump(s, second)
                except DBAPIError as error:
                    if on_deadlock is not None and is_deadlock(error):
                        on_deadlock(error)
                    raise
        return attempt

    return unit


def fast_pg_deadlocks(backend: Backend) -> Engine:
    """PostgreSQL waits deadlock_timeout (1 s) before it looks for a deadlock: shorten it."""
    if backend.name != "postgresql":
        return backend.engine
    return backend.new_engine(pool_size=4, connect_args=pg_fast_options(backend))


# ---------------------------------------------------------------- deadlocks


@pytest.mark.parametrize("nested", [0, 1, 2])
@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_real_deadlock_is_retried_once_and_applies_once(backend: Backend, nested: int) -> None:
    """Promise: a deadlock (also inside one or two begin_nested() levels, where MariaDB
    raises 'SAVEPOINT does not exist' on leaving the block) is retried; one effect per unit."""
    setup(backend)
    engine = fast_pg_deadlocks(backend)
    barrier = threading.Barrier(2)
    calls_a: list[int] = []
    calls_b: list[int] = []
    results, errors = run_threads(
        lambda: retry_on_conflict(deadlock_unit(engine, 1, 2, barrier, calls_a, "a", nested), attempts=5),
        lambda: retry_on_conflict(deadlock_unit(engine, 2, 1, barrier, calls_b, "b", nested), attempts=5),
    )
    assert errors == [None, None], errors
    assert sorted([len(calls_a), len(calls_b)]) == [1, 2], (calls_a, calls_b)
    assert sorted(results) == [1, 2]
    assert balances(backend.engine) == {1: 2, 2: 2}
    assert log_tags(backend.engine) == ["a", "b"]
    if engine is not backend.engine:
        engine.dispose()


@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_deadlock_retries_stop_after_attempts(backend: Backend) -> None:
    """Promise: after ``attempts`` calls the last error is raised.  attempts=1: the deadlock
    victim runs once and the deadlock comes out (as the driver's error or DeadlockDetected)."""
    setup(backend)
    engine = fast_pg_deadlocks(backend)
    barrier = threading.Barrier(2)
    calls_a: list[int] = []
    calls_b: list[int] = []
    _results, errors = run_threads(
        lambda: retry_on_conflict(deadlock_unit(engine, 1, 2, barrier, calls_a, "a"), attempts=1),
        lambda: retry_on_conflict(deadlock_unit(engine, 2, 1, barrier, calls_b, "b"), attempts=1),
    )
    assert len(calls_a) == len(calls_b) == 1
    failed = [e for e in errors if e is not None]
    assert len(failed) == 1 and is_deadlock(failed[0]), errors
    assert sorted(balances(backend.engine).values()) == [1, 1]
    assert len(log_tags(backend.engine)) == 1
    if engine is not backend.engine:
        engine.dispose()


@pytest.mark.parametrize("how", ["context", "cause"])
@pytest.mark.parametrize("nested", [0, 1])
@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_app_exception_raised_while_handling_deadlock_is_not_retried(
    backend: Backend, how: str, nested: int
) -> None:
    """Promise: an application's own exception, even one raised while handling a deadlock,
    is raised at once without a retry."""
    setup(backend)
    engine = fast_pg_deadlocks(backend)
    barrier = threading.Barrier(2)
    calls_a: list[int] = []
    calls_b: list[int] = []

    def on_deadlock(error: BaseException) -> None:
        if how == "cause":
            raise AppError("gave up") from error
        raise AppError("gave up")

    _results, errors = run_threads(
        lambda: retry_on_conflict(
            deadlock_unit(engine, 1, 2, barrier, calls_a, "a", nested, on_deadlock), attempts=5
        ),
        lambda: retry_on_conflict(
            deadlock_unit(engine, 2, 1, barrier, calls_b, "b", nested, on_deadlock), attempts=5
        ),
    )
    failed = [e for e in errors if e is not None]
    assert len(failed) == 1, errors
    # With nested=1 on MariaDB, SQLAlchemy's exit of the savepoint block raises 1305 "SAVEPOINT
    # does not exist" while AppError is handled, so a database error (chained to AppError) comes out;
    # it is still not retried.
    assert isinstance(failed[0], AppError) or (
        backend.name == "mariadb" and nested and isinstance(failed[0].__context__, AppError)
    ), chain(failed[0])
    assert len(calls_a) == len(calls_b) == 1, (calls_a, calls_b)
    assert sorted(balances(backend.engine).values()) == [1, 1]
    assert len(log_tags(backend.engine)) == 1
    if engine is not backend.engine:
        engine.dispose()


@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_deadlock_raised_while_handling_app_exception_is_retried(backend: Backend) -> None:
    """A deadlock whose __context__ is an application exception is still a deadlock: retried."""
    setup(backend)
    engine = fast_pg_deadlocks(backend)
    barrier = threading.Barrier(2)
    calls: dict[str, list[int]] = {"a": [], "b": []}

    def unit(tag: str, first: int, second: int) -> Callable[[], int]:
        inner = deadlock_unit(engine, first, second, barrier, calls[tag], tag)

        def wrapped() -> int:
            try:
                raise AppError("handled below")
            except AppError:
                return inner()

        return wrapped

    _results, errors = run_threads(
        lambda: retry_on_conflict(unit("a", 1, 2)), lambda: retry_on_conflict(unit("b", 2, 1))
    )
    assert errors == [None, None], errors
    assert sorted([len(calls["a"]), len(calls["b"])]) == [1, 2]
    assert balances(backend.engine) == {1: 2, 2: 2}
    assert log_tags(backend.engine) == ["a", "b"]
    if engine is not backend.engine:
        engine.dispose()


# ---------------------------------------------------- serialization failures


def test_pg_repeatable_read_serialization_failure_is_retried(pg: Backend) -> None:
    """Promise: SQLSTATE 40001 (raw driver error, outside stateguard calls) is retried; no lost update."""
    setup(pg)
    rr = pg.engine.execution_options(isolation_level="REPEATABLE READ")
    calls: list[int] = []

    def unit() -> int:
        calls.append(1)
        with Session(rr) as s, s.begin():
            seen = s.scalar(select(Acct.balance).where(Acct.id == 1))  # snapshot taken here
            if len(calls) == 1:
                with Session(pg.engine) as other, other.begin():
                    bump(other, 1)  # a concurrent committed write
            s.execute(update(Acct).where(Acct.id == 1).values(balance=seen + 10))
            return seen

    assert retry_on_conflict(unit) == 1
    assert len(calls) == 2
    assert balances(pg.engine)[1] == 11


def test_pg_serializable_failure_at_commit_is_retried(pg: Backend) -> None:
    """Promise: a serialization failure the driver raises at COMMIT is retried (write skew)."""
    setup(pg)
    ser = pg.engine.execution_options(isolation_level="SERIALIZABLE")
    barrier1 = threading.Barrier(2)
    barrier2 = threading.Barrier(2)
    calls: dict[int, list[int]] = {1: [], 2: []}
    phases: list[str] = []

    def unit(mine: int) -> Callable[[], int]:
        def run() -> int:
            calls[mine].append(1)
            first = len(calls[mine]) == 1
            with Session(ser) as s:
                phase = "body"
                try:
                    total = s.scalar(select(func.sum(Acct.balance)))
                    if first:
                        barrier1.wait(10)
                    s.execute(update(Acct).where(Acct.id == mine).values(balance=total + 1))
                    if first:
                        barrier2.wait(10)
                    if mine == 2 and first:
                        time.sleep(0.2)  # 1 commits first: 2 fails at its COMMIT
                    phase = "commit"
                    s.commit()
                except Exception:
                    phases.append(phase)
                    raise
            return total

        return run

    _results, errors = run_threads(lambda: retry_on_conflict(unit(1)), lambda: retry_on_conflict(unit(2)))
    assert errors == [None, None], errors
    assert phases == ["commit"], phases  # the test really exercises a COMMIT-time failure
    assert (len(calls[1]), len(calls[2])) == (1, 2)
    assert balances(pg.engine) == {1: 1, 2: 2}  # serial: 1 then 2


@pytest.mark.clock
def test_mariadb_serializable_write_skew_deadlock_is_retried(mariadb: Backend) -> None:
    """MariaDB SERIALIZABLE reads take shared locks: the write skew becomes a deadlock (1213)."""
    setup(mariadb)
    ser = mariadb.engine.execution_options(isolation_level="SERIALIZABLE")
    barrier = threading.Barrier(2)
    calls: dict[int, list[int]] = {1: [], 2: []}

    def unit(mine: int) -> Callable[[], int]:
        def run() -> int:
            calls[mine].append(1)
            with Session(ser) as s, s.begin():
                total = s.scalar(select(func.sum(Acct.balance)))
                if len(calls[mine]) == 1:
                    barrier.wait(10)
                s.execute(update(Acct).where(Acct.id == mine).values(balance=total + 1))
            return total

        return run

    _results, errors = run_threads(lambda: retry_on_conflict(unit(1)), lambda: retry_on_conflict(unit(2)))
    assert errors == [None, None], errors
    assert sorted([len(calls[1]), len(calls[2])]) == [1, 2]
    assert sorted(balances(mariadb.engine).values()) == [1, 2]


def test_sqlite_busy_snapshot_is_retried(sqlite: Backend) -> None:
    """Promise: SQLite's busy snapshot (read first, another connection wrote, then write) is retried."""
    setup(sqlite)
    engine = stateguard.sqlite_engine(sqlite.url)
    calls: list[int] = []

    def unit() -> int:
        calls.append(1)
        with Session(engine) as s, s.begin():
            seen = s.scalar(select(Acct.balance).where(Acct.id == 1))
            if len(calls) == 1:
                with Session(engine) as other, other.begin():
                    bump(other, 1)
            s.execute(update(Acct).where(Acct.id == 1).values(balance=seen + 10))
            return seen

    try:
        assert retry_on_conflict(unit) == 1
        assert len(calls) == 2
        assert balances(engine)[1] == 11
    finally:
        engine.dispose()


# --------------------------------------------------------------- STALE


def test_stale_result_is_retried_then_applied(backend: Backend) -> None:
    """Promise: a STALE result is retried (a fresh read on the retry), then APPLIED once."""
    setup(backend)
    calls: list[int] = []

    def rename() -> Any:
        calls.append(1)
        with Session(backend.engine) as s, s.begin():
            acct = s.get_one(Acct, 1)
            seen = acct.version
            if len(calls) == 1:
                with Session(backend.engine) as other, other.begin():
                    other.get_one(Acct, 1).note = "other"  # version + 1, committed
            return guarded_update(s, Acct, acct, {"note": "mine"}, expected_version=seen)

    with Session(backend.engine) as s:
        start = s.get_one(Acct, 1).version
    result = retry_on_conflict(rename)
    assert result.applied
    assert len(calls) == 2
    with Session(backend.engine) as s:
        acct = s.get_one(Acct, 1)
        assert (acct.note, acct.version) == ("mine", start + 2)


def test_always_stale_stops_after_attempts(backend: Backend) -> None:
    """Promise: never a loop without end: an always-STALE unit runs exactly ``attempts`` times."""
    setup(backend)
    calls: list[int] = []
    waits: list[float] = []

    def rename() -> Any:
        calls.append(1)
        with Session(backend.engine) as s, s.begin():
            acct = s.get_one(Acct, 1)
            return guarded_update(s, Acct, acct, {"note": "x"}, expected_version=acct.version + 7)

    with Session(backend.engine) as s:
        start = s.get_one(Acct, 1).version
    try:
        outcome: Any = retry_on_conflict(rename, attempts=4, sleep=waits.append)
    except stateguard.StaleVersion as error:
        outcome = error
    assert len(calls) == 4
    assert len(waits) == 3
    if not isinstance(outcome, Exception):
        assert outcome.outcome is stateguard.Outcome.STALE
    with Session(backend.engine) as s:
        assert s.get_one(Acct, 1).version == start
