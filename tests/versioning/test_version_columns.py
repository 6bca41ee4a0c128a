"""Version columns, guarded_update and retry_on_conflict on every backend."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine, Integer, func, insert, inspect
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session
from sqlalchemy.orm.exc import StaleDataError

from stateguard import (
    ConfigurationError,
    DeadlockDetected,
    InvalidArgument,
    LockNotAcquired,
    NotFound,
    Outcome,
    Result,
    SerializationConflict,
    StaleVersion,
    TransitionRejected,
    guarded_update,
    retry_on_conflict,
)
from tests._support.models import Base, Order, Shipment, Ticket
from tests.conftest import count_statements


def _seed(s: Session) -> None:
    s.add_all([Order(id=1), Order(id=2, status="paid")])
    s.add(Shipment(warehouse="north", number=7))


pytestmark = pytest.mark.tables(Base.metadata, seed=_seed, stateguard=False)


def _db(engine: Engine, key: Any) -> Any:
    with Session(engine) as s:
        return s.get_one(Order, key)


# -- version_column ------------------------------------------------------------------


@pytest.mark.hostile
def test_version_column_is_an_integer_not_null_with_server_default_zero() -> None:
    """version_column() declares INTEGER NOT NULL DEFAULT 0 on the table."""
    col = Order.__table__.c.version
    assert isinstance(col.type, Integer)
    assert col.nullable is False
    assert col.server_default is not None and str(col.server_default.arg) == "0"


def test_version_column_is_the_mappers_version_id_col() -> None:
    """version_column() is wired as SQLAlchemy's version_id_col, on every model using it."""
    assert Order.__mapper__.version_id_col is Order.__table__.c.version
    assert Shipment.__mapper__.version_id_col is Shipment.__table__.c.version
    assert Ticket.__mapper__.version_id_col is None


@pytest.mark.hostile
def test_version_column_in_the_database_is_not_null_with_default_zero(engine: Engine) -> None:
    """The created column is NOT NULL and a row inserted without the ORM starts at version 0."""
    columns = {c["name"]: c for c in inspect(engine).get_columns("orders")}
    assert columns["version"]["nullable"] is False
    assert "0" in str(columns["version"]["default"])
    with engine.begin() as conn:
        conn.execute(insert(Order).values(id=50, status="pending"))
    assert _db(engine, 50).version == 0


def test_orm_inserts_start_at_one_and_orm_updates_increment(engine: Engine) -> None:
    """Rows inserted through the ORM start at version 1; an ORM update makes it 2."""
    with Session(engine) as s, s.begin():
        order = s.get_one(Order, 1)
        assert order.version == 1
        order.note = "orm"
    assert _db(engine, 1).version == 2


def test_orm_flush_with_a_stale_version_raises_stale_data_error(engine: Engine) -> None:
    """Another session's transition makes this session's ORM flush of the same row raise StaleDataError."""
    with Session(engine) as stale:
        stale.begin()
        order = stale.get_one(Order, 1)
        with Session(engine) as other, other.begin():
            assert Order.flow.pay(other, 1).applied
        order.note = "lost update?"
        with pytest.raises(StaleDataError):
            stale.flush()
        stale.rollback()
    row = _db(engine, 1)
    assert (row.status, row.note, row.version) == ("paid", None, 2)


def test_orm_flush_and_stateguard_increment_the_same_column(engine: Engine) -> None:
    """An ORM update, a transition and a guarded_update each add one to the same version."""
    with Session(engine) as s, s.begin():
        order = s.get_one(Order, 1)
        order.note = "a"
        s.flush()
        assert order.version == 2
        assert Order.flow.pay(s, order).version == 3
        assert guarded_update(s, Order, order, {"note": "b"}, expected_version=3).version == 4
        order.amount = 5
    assert _db(engine, 1).version == 5


def test_stale_version_is_catchable_as_stale_data_error(engine: Engine) -> None:
    """StaleVersion from raise_for_outcome is caught by an existing `except StaleDataError` handler."""
    with Session(engine) as s, s.begin():
        r = guarded_update(s, Order, 1, {"note": "x"}, expected_version=9)
        try:
            r.raise_for_outcome()
        except StaleDataError as error:
            assert isinstance(error, StaleVersion)
            assert (error.expected_version, error.version, error.key) == (9, 1, 1)
        else:  # pragma: no cover - the assertion is the test
            pytest.fail("StaleVersion was not raised")


# -- guarded_update --------------------------------------------------------------------


def test_guarded_update_applies_with_the_expected_version(engine: Engine) -> None:
    """guarded_update with the current version is APPLIED, reports version + 1 and writes the values."""
    with Session(engine) as s, s.begin():
        r = guarded_update(s, Order, 1, {"note": "gift", "amount": 3}, expected_version=1)
    assert (r.outcome, r.version, r.expected_version, r.key, r.model) == (Outcome.APPLIED, 2, 1, 1, Order)
    assert r.trigger is None and r.applied
    row = _db(engine, 1)
    assert (row.note, row.amount, row.version, row.status) == ("gift", 3, 2, "pending")


def test_guarded_update_is_one_statement_when_it_applies(engine: Engine) -> None:
    """An applying guarded_update sends exactly one statement."""
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as c:
            assert guarded_update(s, Order, 1, {"note": "x"}, expected_version=1).applied
        assert len(c) == 1, c.statements


def test_guarded_update_is_stale_with_another_version(engine: Engine) -> None:
    """guarded_update with an old version is STALE with the version found, and writes nothing."""
    with Session(engine) as s, s.begin():
        guarded_update(s, Order, 1, {"note": "first"}, expected_version=1)
        r = guarded_update(s, Order, 1, {"note": "second"}, expected_version=1)
    assert (r.outcome, r.version, r.expected_version, r.applied) == (Outcome.STALE, 2, 1, False)
    with pytest.raises(StaleVersion) as info:
        r.raise_for_outcome()
    assert "expected version 1" in str(info.value) and "version 2" in str(info.value)
    assert info.value.trigger is None and "Order" in str(info.value)
    row = _db(engine, 1)
    assert (row.note, row.version) == ("first", 2)


def test_guarded_update_is_not_found_for_a_missing_row(engine: Engine) -> None:
    """guarded_update on a missing key is NOT_FOUND; raise_for_outcome raises NotFound."""
    with Session(engine) as s, s.begin():
        r = guarded_update(s, Order, 99, {"note": "x"}, expected_version=1)
    assert (r.outcome, r.version, r.key) == (Outcome.NOT_FOUND, None, 99)
    with pytest.raises(NotFound):
        r.raise_for_outcome()


def test_guarded_update_sees_another_sessions_commit(engine: Engine) -> None:
    """A version read before another session committed is STALE afterwards (a lost update is refused)."""
    with Session(engine) as s, s.begin():
        order = s.get_one(Order, 1)
        read_version = order.version
        with Session(engine) as other, other.begin():
            assert guarded_update(other, Order, 1, {"note": "other"}, expected_version=read_version).applied
        r = guarded_update(s, Order, 1, {"note": "mine"}, expected_version=read_version)
        assert (r.outcome, r.version) == (Outcome.STALE, read_version + 1)
    assert _db(engine, 1).note == "other"


def test_guarded_update_on_an_instance_syncs_its_version(engine: Engine) -> None:
    """guarded_update on a loaded instance leaves the new version on it; a later flush passes."""
    with Session(engine) as s, s.begin():
        order = s.get_one(Order, 1)
        r = guarded_update(s, Order, order, {"note": "x"}, expected_version=order.version)
        assert order.version == r.version == 2
        assert order.note == "x"
        order.amount = 9
        s.flush()
    row = _db(engine, 1)
    assert (row.note, row.amount, row.version) == ("x", 9, 3)


def test_guarded_update_accepts_sql_expressions(engine: Engine) -> None:
    """values may be SQL expressions over the row (amount + 10)."""
    with Session(engine) as s, s.begin():
        assert guarded_update(s, Order, 1, {"amount": Order.amount + 10}, expected_version=1).applied
        assert guarded_update(s, Order, 1, {"paid_at": func.now()}, expected_version=2).applied
    row = _db(engine, 1)
    assert (row.amount, row.version) == (10, 3) and row.paid_at is not None


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"version": 40}, "version column"),
        ({"status": "shipped"}, "state column"),
        ({"id": 77}, "primary key"),
        ({"nope": 1}, "no mapped column attribute 'nope'"),
        ({}, "at least one value"),
    ],
)
def test_guarded_update_refuses_forbidden_values(engine: Engine, values: Any, needle: str) -> None:
    """Setting the version, state or key column (or nothing) is InvalidArgument and the row is unchanged."""
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as c, pytest.raises(InvalidArgument) as info:
            guarded_update(s, Order, 1, values, expected_version=1)
        assert len(c) == 0, c.statements
    assert needle in str(info.value)
    row = _db(engine, 1)
    assert (row.id, row.status, row.version) == (1, "pending", 1)


@pytest.mark.parametrize("expected", ["1", 1.0, None, True])
def test_guarded_update_needs_an_int_expected_version(engine: Engine, expected: Any) -> None:
    """A non-int expected_version is InvalidArgument and nothing is written."""
    with Session(engine) as s, s.begin(), pytest.raises(InvalidArgument):
        guarded_update(s, Order, 1, {"note": "x"}, expected_version=expected)
    assert (_db(engine, 1).note, _db(engine, 1).version) == (None, 1)


def test_guarded_update_needs_a_version_column(engine: Engine) -> None:
    """guarded_update on a model without a version column is a ConfigurationError."""
    with Session(engine) as s, s.begin(), pytest.raises(ConfigurationError, match="version column"):
        guarded_update(s, Ticket, 1, {"priority": 3}, expected_version=0)


# -- retry_on_conflict -------------------------------------------------------------------


def _stale() -> Result:
    return Result(Outcome.STALE, model=Order, key=1, version=2, expected_version=1)


def test_retry_on_conflict_retries_stale_results_until_applied() -> None:
    """STALE results are retried; the first non-STALE result is returned after one sleep per retry."""
    sleeps: list[float] = []
    results = iter([_stale(), _stale(), Result(Outcome.APPLIED, model=Order, key=1)])
    calls: list[int] = []

    def fn() -> Result:
        calls.append(1)
        return next(results)

    r = retry_on_conflict(fn, sleep=sleeps.append)
    assert r.applied and len(calls) == 3 and len(sleeps) == 2


def test_retry_on_conflict_returns_the_last_stale_result_after_the_attempts() -> None:
    """After `attempts` STALE results the last one is returned, fn called exactly `attempts` times."""
    sleeps: list[float] = []
    produced: list[Result] = []

    def fn() -> Result:
        produced.append(_stale())
        return produced[-1]

    r = retry_on_conflict(fn, attempts=4, sleep=sleeps.append)
    assert len(produced) == 4 and r is produced[-1] and r.outcome is Outcome.STALE
    assert len(sleeps) == 3


@pytest.mark.parametrize("outcome", [Outcome.REPEATED, Outcome.REJECTED, Outcome.NOT_FOUND])
def test_retry_on_conflict_does_not_retry_other_outcomes(outcome: Outcome) -> None:
    """REPEATED, REJECTED and NOT_FOUND results are returned at once."""
    calls: list[int] = []

    def fn() -> Result:
        calls.append(1)
        return Result(outcome, model=Order, key=1)

    assert retry_on_conflict(fn, sleep=lambda _: None).outcome is outcome
    assert calls == [1]


@pytest.mark.parametrize("error", [SerializationConflict, DeadlockDetected, LockNotAcquired])
def test_retry_on_conflict_retries_retryable_errors(error: type[Exception]) -> None:
    """SerializationConflict, DeadlockDetected and LockNotAcquired are retried, then the result returned."""
    calls: list[int] = []

    def fn() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise error("conflict")
        return "done"

    assert retry_on_conflict(fn, sleep=lambda _: None) == "done"
    assert len(calls) == 3


def test_retry_on_conflict_reraises_after_the_last_attempt() -> None:
    """A conflict on every attempt is re-raised after exactly `attempts` calls."""
    calls: list[int] = []

    def fn() -> None:
        calls.append(1)
        raise SerializationConflict(f"conflict {len(calls)}")

    with pytest.raises(SerializationConflict, match="conflict 3"):
        retry_on_conflict(fn, attempts=3, sleep=lambda _: None)
    assert len(calls) == 3


def test_retry_on_conflict_retries_raised_stale_version() -> None:
    """A StaleVersion raised by raise_for_outcome() inside fn is retried too."""
    calls: list[int] = []

    def fn() -> Result:
        calls.append(1)
        if len(calls) == 1:
            _stale().raise_for_outcome()
        return Result(Outcome.APPLIED, model=Order, key=1)

    assert retry_on_conflict(fn, sleep=lambda _: None).applied and len(calls) == 2


@pytest.mark.parametrize(
    "error", [TransitionRejected(Result(Outcome.REJECTED, model=Order, key=1)), ValueError("bug")]
)
def test_retry_on_conflict_does_not_retry_other_errors(error: Exception) -> None:
    """A business error or a bug is raised on the first attempt, without sleeping."""
    calls: list[int] = []
    sleeps: list[float] = []

    def fn() -> None:
        calls.append(1)
        raise error

    with pytest.raises(type(error)):
        retry_on_conflict(fn, sleep=sleeps.append)
    assert calls == [1] and sleeps == []


def test_retry_on_conflict_can_leave_lock_errors_alone() -> None:
    """With lock_not_acquired=False a LockNotAcquired is raised at once."""
    calls: list[int] = []

    def fn() -> None:
        calls.append(1)
        raise LockNotAcquired("held")

    with pytest.raises(LockNotAcquired):
        retry_on_conflict(fn, lock_not_acquired=False, sleep=lambda _: None)
    assert calls == [1]


def test_retry_on_conflict_backoff_is_jittered_and_bounded() -> None:
    """Each wait is between 0 and min(max_backoff, backoff * 2**(n-1))."""
    sleeps: list[float] = []
    retry_on_conflict(_stale, attempts=6, backoff=0.1, max_backoff=0.3, sleep=sleeps.append)
    bounds = [0.1, 0.2, 0.3, 0.3, 0.3]
    assert len(sleeps) == 5
    assert all(0 <= s <= b for s, b in zip(sleeps, bounds, strict=True)), sleeps


def test_retry_on_conflict_rejects_zero_attempts() -> None:
    """attempts must be at least 1."""
    with pytest.raises(ValueError):
        retry_on_conflict(_stale, attempts=0)


def test_retry_on_conflict_does_not_retry_unrelated_driver_errors() -> None:
    """A driver error that is not a conflict (a plain OperationalError) is not retried."""
    calls: list[int] = []

    def fn() -> None:
        calls.append(1)
        raise OperationalError("SELECT 1", {}, Exception("disk on fire"))

    with pytest.raises(OperationalError):
        retry_on_conflict(fn, sleep=lambda _: None)
    assert calls == [1]


def test_retry_on_conflict_reruns_a_read_modify_write_unit(engine: Engine) -> None:
    """A unit of work that lost a race to another writer is STALE once, then applies on the retry."""
    attempts: list[Result] = []

    def rename() -> Result:
        with Session(engine) as s, s.begin():
            order = s.get_one(Order, 1)
            if not attempts:
                # Someone else writes between our read and our write.
                with Session(engine) as other, other.begin():
                    guarded_update(other, Order, 1, {"amount": 5}, expected_version=order.version)
            r = guarded_update(s, Order, order, {"note": "renamed"}, expected_version=order.version)
            attempts.append(r)
            return r

    r = retry_on_conflict(rename, sleep=lambda _: None)
    assert [a.outcome for a in attempts] == [Outcome.STALE, Outcome.APPLIED]
    assert r is attempts[-1] and r.version == 3
    row = _db(engine, 1)
    assert (row.note, row.amount, row.version) == ("renamed", 5, 3)


def test_version_is_never_reused(engine: Engine) -> None:
    """A note changed away and back gets a new version each time, so an old read stays STALE (no ABA)."""
    with Session(engine) as s, s.begin():
        old = s.get_one(Order, 1).version
        assert guarded_update(s, Order, 1, {"note": "b"}, expected_version=old).applied
        assert guarded_update(s, Order, 1, {"note": None}, expected_version=old + 1).applied
        r = guarded_update(s, Order, 1, {"note": "lost"}, expected_version=old)
        assert (r.outcome, r.version) == (Outcome.STALE, old + 2)
    row = _db(engine, 1)
    assert (row.note, row.version) == (None, 3)
