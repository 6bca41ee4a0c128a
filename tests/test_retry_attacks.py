"""Attacks on what the README promises about ``retry_on_conflict``.

Real conflicts on real servers: deadlocks between two threads (also inside one
and two levels of ``begin_nested()``), PostgreSQL serialization failures at
REPEATABLE READ / SERIALIZABLE (also at COMMIT), SQLite's busy snapshot, lock
timeouts and NOWAIT locks.  Every test counts how often the unit ran and checks
the database afterwards in a new Session.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, Integer, String, func, select, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import stateguard
from stateguard import (
    DeadlockDetected,
    InvalidArgument,
    LockNotAcquired,
    SerializationConflict,
    guarded_update,
    retry_on_conflict,
    row_lock,
    version_column,
)
from tests.conftest import Backend


class Base(DeclarativeBase): ...


class Acct(Base):
    __tablename__ = "rt_acct"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    balance: Mapped[int] = mapped_column(Integer, default=0)
    version: Mapped[int] = version_column()
    note: Mapped[str | None] = mapped_column(String(50))


class Log(Base):
    __tablename__ = "rt_log"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tag: Mapped[str] = mapped_column(String(50))


class AppError(Exception):
    """The application's own exception."""


def setup(backend: Backend, rows: int = 2) -> Engine:
    engine = backend.create(Base.metadata)
    with Session(engine) as s, s.begin():
        s.add_all([Acct(id=i, balance=0) for i in range(1, rows + 1)])
    return engine


def balances(engine: Engine) -> dict[int, int]:
    with Session(engine) as s:
        return {a.id: a.balance for a in s.scalars(select(Acct).order_by(Acct.id))}


def log_tags(engine: Engine) -> list[str]:
    with Session(engine) as s:
        return sorted(s.scalars(select(Log.tag)))


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


def bump(s: Session, acct_id: int) -> None:
    s.execute(update(Acct).where(Acct.id == acct_id).values(balance=Acct.balance + 1))


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


def pg_fast_options(backend: Backend) -> dict[str, str]:
    options = make_url(backend.url).query["options"]
    return {"options": f"{options} -cdeadlock_timeout=200ms"}


# ---------------------------------------------------------------- deadlocks


@pytest.fixture(params=["postgresql", "mariadb"])
def server(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue("pg" if request.param == "postgresql" else "mariadb")


@pytest.mark.parametrize("nested", [0, 1, 2])
def test_real_deadlock_is_retried_once_and_applies_once(server: Backend, nested: int) -> None:
    """Promise: a deadlock (also inside one or two begin_nested() levels, where MariaDB
    raises 'SAVEPOINT does not exist' on leaving the block) is retried; one effect per unit."""
    setup(server)
    engine = fast_pg_deadlocks(server)
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
    assert balances(server.engine) == {1: 2, 2: 2}
    assert log_tags(server.engine) == ["a", "b"]
    if engine is not server.engine:
        engine.dispose()


def test_deadlock_retries_stop_after_attempts(server: Backend) -> None:
    """Promise: after ``attempts`` calls the last error is raised.  attempts=1: the deadlock
    victim runs once and the deadlock comes out (as the driver's error or DeadlockDetected)."""
    setup(server)
    engine = fast_pg_deadlocks(server)
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
    assert sorted(balances(server.engine).values()) == [1, 1]
    assert len(log_tags(server.engine)) == 1
    if engine is not server.engine:
        engine.dispose()


@pytest.mark.parametrize("how", ["context", "cause"])
@pytest.mark.parametrize("nested", [0, 1])
def test_app_exception_raised_while_handling_deadlock_is_not_retried(
    server: Backend, how: str, nested: int
) -> None:
    """Promise: an application's own exception, even one raised while handling a deadlock,
    is raised at once without a retry."""
    setup(server)
    engine = fast_pg_deadlocks(server)
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
        server.name == "mariadb" and nested and isinstance(failed[0].__context__, AppError)
    ), chain(failed[0])
    assert len(calls_a) == len(calls_b) == 1, (calls_a, calls_b)
    assert sorted(balances(server.engine).values()) == [1, 1]
    assert len(log_tags(server.engine)) == 1
    if engine is not server.engine:
        engine.dispose()


def test_deadlock_raised_while_handling_app_exception_is_retried(server: Backend) -> None:
    """A deadlock whose __context__ is an application exception is still a deadlock: retried."""
    setup(server)
    engine = fast_pg_deadlocks(server)
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
    assert balances(server.engine) == {1: 2, 2: 2}
    assert log_tags(server.engine) == ["a", "b"]
    if engine is not server.engine:
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


# ------------------------------------------- locks: attempts, max_time, flag


def hold_row(engine: Engine) -> Callable[[], None]:
    """Lock row 1 in an open transaction; return what releases it."""
    holder = Session(engine)
    holder.begin()
    holder.execute(select(Acct).where(Acct.id == 1).with_for_update())
    return holder.close


def nowait_unit(engine: Engine, calls: list[int]) -> Callable[[], None]:
    def unit() -> None:
        calls.append(1)
        with Session(engine) as s, s.begin():
            s.add(Log(tag="nowait"))
            s.flush()
            row_lock(s, Acct, 1, nowait=True)
            bump(s, 1)

    return unit


def test_lock_not_acquired_retried_up_to_attempts_and_raised(server: Backend) -> None:
    """Promise: LockNotAcquired is retried; after ``attempts`` calls the last error is raised."""
    engine = setup(server)
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


def test_lock_not_acquired_false_is_not_retried(server: Backend) -> None:
    """Promise: lock_not_acquired=False raises LockNotAcquired after one call."""
    engine = setup(server)
    release = hold_row(engine)
    calls: list[int] = []
    try:
        with pytest.raises(LockNotAcquired):
            retry_on_conflict(nowait_unit(engine, calls), attempts=6, lock_not_acquired=False)
    finally:
        release()
    assert len(calls) == 1
    assert log_tags(engine) == []


def test_lock_not_acquired_then_free_applies_once(server: Backend) -> None:
    """A lock held for the first attempts only: the retry gets it and applies exactly once."""
    engine = setup(server)
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


def test_lock_timeout_raw_driver_error_is_retried(server: Backend) -> None:
    """Promise: lock timeouts are recognised by code (PostgreSQL 55P03 lock_timeout, MariaDB 1205)."""
    engine = setup(server)
    release = hold_row(engine)
    calls: list[int] = []

    def unit() -> None:
        calls.append(1)
        if len(calls) == 3:
            release()
        with Session(engine) as s, s.begin():
            if server.name == "postgresql":
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
        if server.name == "mariadb":
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


# ------------------------------------------------------------------ async


def async_url(backend: Backend) -> str:
    if backend.name == "mariadb":
        return backend.url.replace("mysql+pymysql://", "mysql+aiomysql://")
    return backend.url  # psycopg 3 is async too


# On MariaDB (aiomysql) with nested >= 1, leaving the block raises 1305 "SAVEPOINT sa_savepoint_1
# does not exist" while the 1213 deadlock is handled, with aiomysql's own exception between the two
# SQLAlchemy errors in the __context__ chain.  The awaited retry_on_conflict raised it after ONE call
# (the sync form retried); it now follows the chain through the wrapped driver error too.
@pytest.mark.parametrize("nested", [0, 1, 2])
def test_async_deadlock_retried_once(server: Backend, monkeypatch: pytest.MonkeyPatch, nested: int) -> None:
    """Promise: the async form retries a real deadlock (also inside begin_nested()), awaits each
    attempt, never calls time.sleep."""
    setup(server)
    slept: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: (slept.append(s), real_sleep(s)))
    options = {"connect_args": pg_fast_options(server)} if server.name == "postgresql" else {}
    calls: dict[str, list[int]] = {"a": [], "b": []}

    async def main() -> list[Any]:
        engine = create_async_engine(async_url(server), **options)
        barrier = asyncio.Barrier(2)

        def unit(tag: str, first: int, second: int) -> Callable[[], Any]:
            async def run() -> int:
                calls[tag].append(1)
                async with AsyncSession(engine) as s, s.begin():
                    s.add(Log(tag=tag))
                    await s.flush()
                    async with contextlib.AsyncExitStack() as stack:
                        for _ in range(nested):
                            await stack.enter_async_context(s.begin_nested())
                        await s.execute(update(Acct).where(Acct.id == first).values(balance=Acct.balance + 1))
                        if len(calls[tag]) == 1:
                            await asyncio.wait_for(barrier.wait(), 10)
                        await s.execute(
                            update(Acct).where(Acct.id == second).values(balance=Acct.balance + 1)
                        )
                return len(calls[tag])

            return run

        try:
            return await asyncio.wait_for(
                asyncio.gather(
                    retry_on_conflict(unit("a", 1, 2)),
                    retry_on_conflict(lambda: unit("b", 2, 1)()),
                    return_exceptions=True,
                ),
                30,
            )
        finally:
            await engine.dispose()

    results = asyncio.run(main())
    assert not [r for r in results if isinstance(r, BaseException)], (
        results,
        calls,
        [chain(r) for r in results],
    )
    assert sorted(results) == [1, 2], results
    assert sorted([len(calls["a"]), len(calls["b"])]) == [1, 2]
    assert slept == []
    assert balances(server.engine) == {1: 2, 2: 2}
    assert log_tags(server.engine) == ["a", "b"]


def _with_held_row_async(pg: Backend, body: Callable[[Callable[[], Any], list[int]], Any]) -> None:
    """Row 1 held by another transaction; run ``await body(nowait, calls)`` where ``nowait()`` is an
    async unit that tries to lock row 1 with NOWAIT (LockNotAcquired) and appends to ``calls``."""
    engine = setup(pg)
    release = hold_row(engine)
    calls: list[int] = []

    async def main() -> None:
        aengine = create_async_engine(async_url(pg))

        async def nowait() -> None:
            calls.append(1)
            async with AsyncSession(aengine) as s, s.begin():
                await row_lock(s, Acct, 1, nowait=True)

        try:
            await body(nowait, calls)
        finally:
            await aengine.dispose()

    try:
        asyncio.run(main())
    finally:
        release()


def test_async_caps_and_non_retryable(pg: Backend) -> None:
    """Async: attempts cap, lock_not_acquired=False, max_time, app errors raised at once."""

    async def body(nowait: Callable[[], Any], calls: list[int]) -> None:
        async def app_error() -> None:
            calls.append(1)
            try:
                await nowait()
            except LockNotAcquired:
                raise AppError("busy")  # noqa: B904 - raised while handling, on purpose

        with pytest.raises(LockNotAcquired):
            await retry_on_conflict(nowait, attempts=3, backoff=0.001)
        assert len(calls) == 3
        calls.clear()
        with pytest.raises(LockNotAcquired):
            await retry_on_conflict(nowait, attempts=3, lock_not_acquired=False)
        assert len(calls) == 1
        calls.clear()
        with pytest.raises(AppError):
            await retry_on_conflict(app_error, attempts=3)
        assert len(calls) == 2  # app_error once, nowait once
        calls.clear()
        started = time.monotonic()
        with pytest.raises(LockNotAcquired):
            await retry_on_conflict(nowait, attempts=100_000, backoff=5, max_backoff=5, max_time=0.3)
        assert time.monotonic() - started < 1.5

    _with_held_row_async(pg, body)


def test_async_cancel_during_backoff_is_not_swallowed(pg: Backend) -> None:
    """Cancelling the task while it waits between attempts cancels it (no further attempts)."""

    async def body(nowait: Callable[[], Any], calls: list[int]) -> None:
        task = asyncio.ensure_future(retry_on_conflict(nowait, attempts=50, backoff=5, max_backoff=5))
        await asyncio.sleep(0.3)
        task.cancel()
        started = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - started < 1
        n = len(calls)
        await asyncio.sleep(0.2)
        assert len(calls) == n

    _with_held_row_async(pg, body)


def chain(error: Any) -> list[str]:
    """The exception and what it was raised while handling, as short strings."""
    out: list[str] = []
    while isinstance(error, BaseException) and len(out) < 8:
        out.append(f"{type(error).__name__}: {str(error)[:90]}")
        error = error.__cause__ or error.__context__
    return out
