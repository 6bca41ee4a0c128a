"""Serialization failures and deadlocks become retryable stateguard errors, never raw
driver errors, and retry_on_conflict re-runs the whole unit of work."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

import stateguard
from stateguard import (
    DeadlockDetected,
    Outcome,
    Result,
    SerializationConflict,
    StateguardError,
    exceptions,
    guarded_update,
    insert_once,
    retry_on_conflict,
)
from tests._support.models import Base, Message, Order
from tests.conftest import Backend, backends_with


def _seed(backend: Backend, *orders: Order) -> Engine:
    engine = backend.create(Base.metadata)
    with Session(engine) as s, s.begin():
        s.add_all(list(orders) or [Order(id=1)])
    return engine


def _sqlstate(error: BaseException) -> Any:
    cause = error.__cause__
    assert isinstance(cause, DBAPIError), repr(cause)
    return getattr(cause.orig, "sqlstate", None)


# -- PostgreSQL at REPEATABLE READ and SERIALIZABLE ----------------------------------------

LEVELS = ["REPEATABLE READ", "SERIALIZABLE"]


@pytest.mark.lost_reply
@pytest.mark.parametrize("level", LEVELS)
def test_postgresql_lost_race_raises_serialization_conflict(pg: Backend, level: str) -> None:
    """T1 reads, T2 pays and commits, T1 pays: SerializationConflict, retryable, driver error chained."""
    engine = _seed(pg)
    strict = pg.new_engine(isolation_level=level)
    try:
        with Session(strict) as t1:
            t1.begin()
            assert t1.execute(select(Order.status).where(Order.id == 1)).scalar_one() == "pending"
            with Session(engine) as t2, t2.begin():
                assert Order.flow.pay(t2, 1).applied
            with pytest.raises(SerializationConflict) as info:
                Order.flow.pay(t1, 1)
            error = info.value
            assert error.retryable is True and isinstance(error, StateguardError)
            assert not isinstance(error, DeadlockDetected)
            assert _sqlstate(error) == "40001"
            assert "retry_on_conflict" in str(error)
            t1.rollback()
            # A new transaction on the same session sees the winner's commit.
            with t1.begin():
                again = Order.flow.pay(t1, 1)
            assert (again.outcome, again.version) == (Outcome.REPEATED, 2)
    finally:
        strict.dispose()


@pytest.mark.parametrize("level", LEVELS)
def test_postgresql_retry_on_conflict_reruns_the_unit_of_work(pg: Backend, level: str) -> None:
    """A unit of work that loses the race on its first attempt is re-run in a new transaction: REPEATED."""
    engine = _seed(pg)
    strict = pg.new_engine(isolation_level=level)
    attempts: list[Any] = []

    def unit() -> Result:
        with Session(strict) as s, s.begin():
            s.execute(select(Order.status).where(Order.id == 1)).all()  # the snapshot is taken here
            if not attempts:
                with Session(engine) as other, other.begin():
                    Order.flow.pay(other, 1)
            try:
                r = Order.flow.pay(s, 1)
            except SerializationConflict as error:
                attempts.append(error)
                raise
            attempts.append(r)
            return r

    try:
        r = retry_on_conflict(unit, sleep=lambda _: None)
    finally:
        strict.dispose()
    assert isinstance(attempts[0], SerializationConflict)
    assert attempts[1] is r and (r.outcome, r.state, r.version) == (Outcome.REPEATED, "paid", 2)
    assert len(attempts) == 2


def _pay(s: Session) -> Any:
    return Order.flow.pay(s, 1)


def _guarded(s: Session) -> Any:
    return guarded_update(s, Order, 1, {"note": "mine"}, expected_version=1)


def _insert(s: Session) -> Any:
    return insert_once(s, Message, {"message_id": "m-1"})


@pytest.mark.parametrize(
    "operation", [_pay, _guarded, _insert], ids=["trigger", "guarded_update", "insert_once"]
)
def test_postgresql_every_guarded_write_maps_serialization_failures(
    pg: Backend, operation: Callable[[Session], Any]
) -> None:
    """At REPEATABLE READ a trigger, guarded_update or insert_once losing a race is SerializationConflict."""
    engine = _seed(pg)
    strict = pg.new_engine(isolation_level="REPEATABLE READ")
    try:
        with Session(strict) as t1:
            t1.begin()
            t1.execute(select(Order.id)).all()
            with Session(engine) as t2, t2.begin():
                assert operation(t2).applied
            with pytest.raises(SerializationConflict) as info:
                operation(t1)
            assert _sqlstate(info.value) == "40001"
            t1.rollback()
            with t1.begin():
                assert operation(t1).outcome in (Outcome.REPEATED, Outcome.STALE)
    finally:
        strict.dispose()


def test_postgresql_serializable_failure_at_commit_is_retried(pg: Backend) -> None:
    """A write-skew that SERIALIZABLE aborts (at a write or at COMMIT) is retried by retry_on_conflict."""
    engine = _seed(pg, Order(id=1, amount=5), Order(id=2, amount=5))
    strict = pg.new_engine(isolation_level="SERIALIZABLE")
    failures: list[BaseException] = []
    done: list[Result] = []

    def unit() -> Result:
        with Session(strict) as s:
            try:
                with s.begin():
                    total = sum(s.scalars(select(Order.amount)))
                    if not failures and not done:
                        # The other transaction also reads both rows, writes row 2 and commits first.
                        with Session(strict) as other, other.begin():
                            other_total = sum(other.scalars(select(Order.amount)))
                            guarded_update(other, Order, 2, {"amount": other_total - 10}, expected_version=1)
                    r = guarded_update(s, Order, 1, {"amount": total - 10}, expected_version=1)
            except Exception as error:
                failures.append(error)
                raise
            done.append(r)
            return r

    try:
        r = retry_on_conflict(unit, sleep=lambda _: None)
    finally:
        strict.dispose()
    assert len(failures) == 1, failures
    failure = failures[0]
    if isinstance(failure, SerializationConflict):
        assert _sqlstate(failure) == "40001"
    else:  # raised by COMMIT, outside stateguard: the driver error itself
        assert isinstance(failure, DBAPIError) and getattr(failure.orig, "sqlstate", None) == "40001"
    # The retry reads the committed row 2 (amount 0) and, with version 1 still on row 1, applies.
    assert r.applied and done == [r]
    with Session(engine) as s:
        assert (s.get_one(Order, 1).amount, s.get_one(Order, 2).amount) == (-5, 0)


# -- deadlocks ----------------------------------------------------------------------------


def _deadlock(backend: Backend) -> tuple[list[BaseException], dict[str, list[Outcome]]]:
    """Two threads pay rows 1 and 2 in opposite order behind a barrier."""
    engine = _seed(backend, Order(id=1), Order(id=2))
    barrier = threading.Barrier(2, timeout=30)
    errors: list[BaseException] = []
    outcomes: dict[str, list[Outcome]] = {}

    def worker(name: str, first: int, second: int) -> None:
        try:
            with Session(engine) as s, s.begin():
                got = [Order.flow.pay(s, first).outcome]
                barrier.wait()
                got.append(Order.flow.pay(s, second).outcome)
            outcomes[name] = got
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=worker, args=a) for a in (("a", 1, 2), ("b", 2, 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads)
    return errors, outcomes


def test_postgresql_deadlock_becomes_deadlock_detected(pg: Backend) -> None:
    """PostgreSQL's 40P01 between opposite-order transactions is DeadlockDetected for one of them."""
    errors, outcomes = _deadlock(pg)
    assert len(errors) == 1 and isinstance(errors[0], DeadlockDetected), errors
    assert errors[0].retryable and isinstance(errors[0], SerializationConflict)
    assert _sqlstate(errors[0]) == "40P01"
    assert list(outcomes.values()) == [[Outcome.APPLIED, Outcome.APPLIED]]


def test_mariadb_deadlock_becomes_deadlock_detected(mariadb: Backend) -> None:
    """MariaDB's 1213 between opposite-order transactions is DeadlockDetected for one of them."""
    errors, outcomes = _deadlock(mariadb)
    assert len(errors) == 1 and isinstance(errors[0], DeadlockDetected), errors
    assert errors[0].retryable
    cause = errors[0].__cause__
    assert isinstance(cause, DBAPIError) and cause.orig.args[0] == 1213  # type: ignore[union-attr]
    assert list(outcomes.values()) == [[Outcome.APPLIED, Outcome.APPLIED]]


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "in-callers-savepoint"])
@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_deadlock_victim_retried_ends_repeated(backend: Backend, nested: bool) -> None:
    """With retry_on_conflict around each unit, the victim re-runs and sees REPEATED: one APPLIED per row.

    ``in-callers-savepoint``: the second payment runs inside the caller's own ``with
    session.begin_nested():`` block.  On MariaDB the deadlock rolls the whole transaction back, so
    leaving that block sends ROLLBACK TO SAVEPOINT for a savepoint that no longer exists and
    SQLAlchemy raises the driver's 1305 with the DeadlockDetected as its ``__context__``:
    retry_on_conflict still re-runs the unit (it gave up before).  PostgreSQL raises
    DeadlockDetected itself."""
    engine = _seed(backend, Order(id=1), Order(id=2))
    barrier = threading.Barrier(2, timeout=30)
    final: dict[str, list[Outcome]] = {}
    failures: list[BaseException] = []
    errors: list[BaseException] = []

    def worker(name: str, first: int, second: int) -> None:
        tries: list[int] = []

        def unit() -> list[Outcome]:
            tries.append(1)
            try:
                with Session(engine) as s, s.begin():
                    got = [Order.flow.pay(s, first).outcome]
                    if len(tries) == 1:
                        barrier.wait()
                    with s.begin_nested() if nested else contextlib.nullcontext():
                        got.append(Order.flow.pay(s, second).outcome)
                    return got
            except Exception as error:
                failures.append(error)
                raise

        try:
            final[name] = retry_on_conflict(unit, attempts=10, backoff=0.05)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=worker, args=a) for a in (("a", 1, 2), ("b", 2, 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert errors == []
    # At least the first round deadlocks; a retry may race the survivor for a row and deadlock again.
    assert failures, "the first round should deadlock"
    for failure in failures:
        chain: list[BaseException] = []
        link: BaseException | None = failure
        while link is not None:
            chain.append(link)
            link = link.__context__
        assert any(isinstance(e, DeadlockDetected) for e in chain), failures
    if not nested:
        assert all(isinstance(f, DeadlockDetected) for f in failures), failures
    elif backend.name == "mariadb":
        assert any(isinstance(f, DBAPIError) for f in failures), failures
    counted = Counter(o for got in final.values() for o in got)
    assert counted == Counter({Outcome.APPLIED: 2, Outcome.REPEATED: 2})
    with Session(engine) as s:
        assert {o.status for o in s.scalars(select(Order))} == {"paid"}


def _raised(make: Callable[[], BaseException], context: BaseException) -> BaseException:
    """``make()`` raised while ``context`` was being handled (so ``context`` is its ``__context__``)."""
    try:
        try:
            raise context
        except BaseException:
            raise make()  # noqa: B904 - the context is the point
    except BaseException as error:
        return error


def _driver_error(message: str) -> DBAPIError:
    return DBAPIError(message, {}, Exception(message))


@pytest.mark.parametrize(
    ("error", "retried"),
    [
        (
            lambda: _raised(
                lambda: _driver_error("SAVEPOINT sa_savepoint_1 does not exist"), DeadlockDetected("x")
            ),
            True,
        ),
        (lambda: _raised(lambda: ValueError("the application's own answer"), DeadlockDetected("x")), False),
        (
            lambda: _raised(
                lambda: _driver_error("SAVEPOINT sa_savepoint_1 does not exist"), ValueError("x")
            ),
            False,
        ),
        (lambda: _driver_error("no context at all"), False),
    ],
    ids=["db-error-hiding-a-deadlock", "app-error-from-a-deadlock", "db-error-from-an-app-error", "db-error"],
)
def test_what_retry_on_conflict_follows_back_to_a_conflict(
    error: Callable[[], BaseException], retried: bool
) -> None:
    """Only a database error raised while a conflict was being handled is retried as that conflict;
    an application error raised from one is the application's answer."""
    calls: list[int] = []

    def unit() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise error()
        return "second"

    if retried:
        assert retry_on_conflict(unit, sleep=lambda _: None) == "second"
    else:
        with pytest.raises((ValueError, DBAPIError)):
            retry_on_conflict(unit, sleep=lambda _: None)
        assert len(calls) == 1


# -- MariaDB with innodb_snapshot_isolation ---------------------------------------------


def test_mariadb_snapshot_isolation_record_changed_is_a_serialization_conflict(mariadb: Backend) -> None:
    """With innodb_snapshot_isolation=ON, error 1020 (record changed) is a SerializationConflict."""
    engine = _seed(mariadb)
    snap = mariadb.new_engine(pool_size=1, max_overflow=0)
    try:
        with snap.connect() as conn:
            try:
                conn.execute(text("SET SESSION innodb_snapshot_isolation = ON"))
            except DBAPIError as error:  # pragma: no cover - MariaDB before 10.6.18
                pytest.fail(f"this MariaDB has no innodb_snapshot_isolation: {error}")
            conn.rollback()
        with Session(snap) as t1:
            t1.begin()
            t1.execute(text("SET SESSION innodb_snapshot_isolation = ON"))
            t1.execute(select(Order.status).where(Order.id == 1)).all()  # consistent snapshot
            with Session(engine) as t2, t2.begin():
                assert Order.flow.pay(t2, 1).applied
            with pytest.raises(SerializationConflict) as info:
                Order.flow.pay(t1, 1)
            cause = info.value.__cause__
            assert isinstance(cause, DBAPIError) and cause.orig.args[0] == 1020  # type: ignore[union-attr]
            assert info.value.retryable
            t1.rollback()
            with t1.begin():
                assert Order.flow.pay(t1, 1).outcome is Outcome.REPEATED
    finally:
        snap.dispose()


# -- SQLite ------------------------------------------------------------------------------


def test_sqlite_busy_snapshot_is_a_serialization_conflict(sqlite: Backend) -> None:
    """A deferred SQLite reader writing after another connection committed gets SerializationConflict."""
    engine = _seed(sqlite)
    wal = stateguard.sqlite_engine(sqlite.url, begin="deferred", busy_timeout=0.2)
    try:
        with Session(wal) as reader:
            reader.begin()
            assert reader.execute(select(Order.status)).scalars().all() == ["pending"]
            with Session(wal) as writer, writer.begin():
                assert Order.flow.pay(writer, 1).applied
            with pytest.raises(SerializationConflict) as info:
                Order.flow.cancel(reader, 1)
            assert info.value.retryable
            cause = info.value.__cause__
            assert isinstance(cause, DBAPIError)
            assert getattr(cause.orig, "sqlite_errorcode", None) == 517  # SQLITE_BUSY_SNAPSHOT
            reader.rollback()
            with reader.begin():
                assert Order.flow.pay(reader, 1).outcome is Outcome.REPEATED
    finally:
        wal.dispose()
    with Session(engine) as s:
        assert s.get_one(Order, 1).status == "paid"


def test_sqlite_busy_snapshot_unit_of_work_is_retried(sqlite: Backend) -> None:
    """retry_on_conflict re-runs a SQLite unit that hit a busy snapshot; the retry is REPEATED."""
    _seed(sqlite)
    wal = stateguard.sqlite_engine(sqlite.url, begin="deferred", busy_timeout=0.2)
    attempts: list[Any] = []

    def unit() -> Result:
        with Session(wal) as s, s.begin():
            s.execute(select(Order.status)).all()
            if not attempts:
                with Session(wal) as other, other.begin():
                    Order.flow.pay(other, 1)
            try:
                r = Order.flow.pay(s, 1)
            except SerializationConflict as error:
                attempts.append(error)
                raise
            attempts.append(r)
            return r

    try:
        r = retry_on_conflict(unit, sleep=lambda _: None)
    finally:
        wal.dispose()
    assert isinstance(attempts[0], SerializationConflict) and attempts[1] is r
    assert r.outcome is Outcome.REPEATED


def test_plain_sqlite_engine_has_no_stale_snapshot(sqlite: Backend) -> None:
    """On a plain create_engine the same read-then-write sequence is a clean REPEATED, not an error."""
    _seed(sqlite)
    plain = create_engine(sqlite.url)
    try:
        with Session(plain) as reader:
            reader.begin()
            reader.execute(select(Order.status)).all()
            with Session(plain) as writer, writer.begin():
                assert Order.flow.pay(writer, 1).applied
            assert Order.flow.pay(reader, 1).outcome is Outcome.REPEATED
            reader.commit()
    finally:
        plain.dispose()


# -- the retryable attribute ---------------------------------------------------------------


def test_every_stateguard_exception_has_retryable() -> None:
    """Every exported exception class has a bool retryable: True only for conflicts and lock waits."""
    classes = [getattr(exceptions, name) for name in exceptions.__all__]
    assert all(issubclass(c, StateguardError) for c in classes)
    retryable = {c.__name__ for c in classes if c.retryable}
    assert all(isinstance(c.retryable, bool) for c in classes)
    # PublishFailed: a broker that did not take a batch; the relay publishes the events again.
    assert retryable == {
        "SerializationConflict",
        "DeadlockDetected",
        "LockNotAcquired",
        "WorkerIdsExhausted",
        "PublishFailed",
    }


def test_outcome_errors_are_not_retryable_instances() -> None:
    """Instances of outcome errors carry retryable False; conflict instances carry True."""
    r = Result(Outcome.REJECTED, model=Order, key=1, trigger="pay", state="shipped")
    assert stateguard.TransitionRejected(r).retryable is False
    assert stateguard.NotFound(Result(Outcome.NOT_FOUND, model=Order, key=1)).retryable is False
    assert SerializationConflict("x").retryable is True
    assert DeadlockDetected("x").retryable is True
