"""Side effects only for the winner, only after the outermost commit: on_commit() and
declared after_commit= callables on every backend, with rollbacks and savepoints."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, String, create_engine, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import Outcome, Result, StateMachine, guarded_update, insert_once, version_column
from tests._support.models import Base, Message, Order
from tests.conftest import Backend

CALLS: list[Any] = []


def _record(result: Result) -> None:
    CALLS.append(("declared", result.key, result.state, result.outcome))


def _record_again(result: Result) -> None:
    CALLS.append(("second", result.key))


class JobBase(DeclarativeBase):
    pass


class Job(JobBase):
    """Declared after_commit callables: one on finish, two on fail; retry has none."""

    __tablename__ = "sg_hook_jobs"
    id: Mapped[int] = mapped_column(primary_key=True)
    state: Mapped[str] = mapped_column(String(10), default="new")
    version: Mapped[int] = version_column()

    flow = StateMachine(
        "state",
        states=["new", "done", "failed"],
        transitions=[
            {"trigger": "finish", "source": "new", "dest": "done", "after_commit": _record},
            {"trigger": "fail", "source": "new", "dest": "failed", "after_commit": [_record, _record_again]},
            {"trigger": "retry", "source": "failed", "dest": "new"},
        ],
    )


@pytest.fixture(autouse=True)
def _clear_calls() -> Iterator[None]:
    CALLS.clear()
    yield
    CALLS.clear()


def _seed(s: Session) -> None:
    s.add_all([Order(id=i) for i in (1, 2, 3)] + [Order(id=4, status="shipped")])
    s.add_all([Job(id=i) for i in (1, 2, 3)])


# Real transactions around savepoints: stateguard.sqlite_engine on SQLite.
pytestmark = pytest.mark.tables(
    Base.metadata, JobBase.metadata, seed=_seed, stateguard=False, sqlite_engine=True
)


def _statuses(engine: Engine) -> dict[int, str]:
    with Session(engine) as s:
        return {k: v for k, v in s.execute(select(Order.id, Order.status))}


# -- on_commit ---------------------------------------------------------------------


def test_on_commit_runs_only_after_the_commit(engine: Engine) -> None:
    """A callback of an APPLIED call has not run before COMMIT and has run, once, right after it."""
    calls: list[Any] = []
    with Session(engine) as s:
        with s.begin():
            r = Order.flow.pay(s, 1)
            r.on_commit(calls.append, "paid")
            s.flush()
            assert calls == []
        assert calls == ["paid"]
        s.commit()  # nothing left to run
    assert calls == ["paid"]


def test_on_commit_passes_positional_and_keyword_arguments(engine: Engine) -> None:
    """on_commit(fn, *args, **kwargs) calls fn with those arguments."""
    seen: list[Any] = []
    with Session(engine) as s, s.begin():
        Order.flow.pay(s, 1).on_commit(lambda *a, **k: seen.append((a, k)), 1, "x", flag=True)
    assert seen == [((1, "x"), {"flag": True})]


def test_callbacks_run_in_scheduling_order(engine: Engine) -> None:
    """Several callbacks of one transaction run in the order they were scheduled."""
    calls: list[int] = []
    with Session(engine) as s, s.begin():
        Order.flow.pay(s, 2).on_commit(calls.append, 2)
        Order.flow.pay(s, 1).on_commit(calls.append, 1)
        Order.flow.pay(s, 3).on_commit(calls.append, 3)
    assert calls == [2, 1, 3]


@pytest.mark.parametrize(
    ("key", "outcome"), [(1, Outcome.REPEATED), (4, Outcome.REJECTED), (404, Outcome.NOT_FOUND)]
)
def test_calls_that_did_not_apply_never_run_callbacks(engine: Engine, key: int, outcome: Outcome) -> None:
    """on_commit of a REPEATED, REJECTED or NOT_FOUND call is a no-op, even after a commit."""
    calls: list[Any] = []
    with Session(engine) as s, s.begin():
        Order.flow.pay(s, 1)
        r = Order.flow.pay(s, key)
        assert r.outcome is outcome
        r.on_commit(calls.append, "never")
    assert calls == []


@pytest.mark.rollback
def test_rollback_drops_callbacks(engine: Engine) -> None:
    """A transaction that rolls back (by exception) runs none of its callbacks, nor does the next commit."""
    calls: list[Any] = []
    with Session(engine) as s:
        with pytest.raises(RuntimeError), s.begin():
            Order.flow.pay(s, 1).on_commit(calls.append, "rolled back")
            raise RuntimeError("boom")
        assert calls == []
        with s.begin():
            r = Order.flow.pay(s, 2)
            r.on_commit(calls.append, "committed")
    assert calls == ["committed"]
    assert _statuses(engine)[1] == "pending"


@pytest.mark.rollback
def test_explicit_rollback_drops_callbacks(engine: Engine) -> None:
    """session.rollback() drops the callbacks of the transaction, a later commit does not revive them."""
    calls: list[Any] = []
    with Session(engine) as s:
        s.begin()
        Order.flow.pay(s, 1).on_commit(calls.append, "dropped")
        s.rollback()
        s.begin()
        s.commit()
    assert calls == []


def test_close_without_commit_drops_callbacks(engine: Engine) -> None:
    """session.close() without a commit drops pending callbacks."""
    calls: list[Any] = []
    s = Session(engine)
    s.begin()
    Order.flow.pay(s, 1).on_commit(calls.append, "closed")
    s.close()
    with s.begin():
        pass
    assert calls == []
    assert _statuses(engine)[1] == "pending"


def test_autobegun_session_runs_callbacks_on_commit(engine: Engine) -> None:
    """Without an explicit begin(), the callback runs at session.commit()."""
    calls: list[Any] = []
    with Session(engine) as s:
        Order.flow.pay(s, 1).on_commit(calls.append, "autobegin")
        assert calls == []
        s.commit()
        assert calls == ["autobegin"]


def test_guarded_update_and_insert_once_results_schedule_too(engine: Engine) -> None:
    """Results of guarded_update and insert_once follow the same rule: only APPLIED, only after commit."""
    calls: list[Any] = []
    with Session(engine) as s, s.begin():
        guarded_update(s, Order, 1, {"note": "x"}, expected_version=1).on_commit(calls.append, "gu")
        guarded_update(s, Order, 1, {"note": "y"}, expected_version=1).on_commit(calls.append, "stale")
        insert_once(s, Message, {"message_id": "m"}).on_commit(calls.append, "io")
        insert_once(s, Message, {"message_id": "m"}).on_commit(calls.append, "dup")
        assert calls == []
    assert calls == ["gu", "io"]


# -- declared after_commit -------------------------------------------------------------


def test_declared_after_commit_gets_the_result_after_commit(engine: Engine) -> None:
    """A transition's after_commit callable receives the APPLIED Result once, after commit."""
    with Session(engine) as s, s.begin():
        Job.flow.finish(s, 1)
        assert CALLS == []
    assert CALLS == [("declared", 1, "done", Outcome.APPLIED)]


def test_declared_after_commit_list_runs_every_callable(engine: Engine) -> None:
    """A list of after_commit callables runs each of them, in order."""
    with Session(engine) as s, s.begin():
        Job.flow.fail(s, 2)
    assert CALLS == [("declared", 2, "failed", Outcome.APPLIED), ("second", 2)]


def test_declared_after_commit_not_for_repeated_or_rejected(engine: Engine) -> None:
    """REPEATED and REJECTED calls of a trigger with after_commit run nothing."""
    with Session(engine) as s, s.begin():
        Job.flow.finish(s, 1)
    CALLS.clear()
    with Session(engine) as s, s.begin():
        assert Job.flow.finish(s, 1).outcome is Outcome.REPEATED
        assert Job.flow.fail(s, 1).outcome is Outcome.REJECTED
        assert Job.flow.retry(s, 1).outcome is Outcome.REJECTED
    assert CALLS == []


@pytest.mark.rollback
def test_declared_after_commit_dropped_on_rollback(engine: Engine) -> None:
    """A rolled-back transaction runs no declared after_commit, and the retry that commits runs it once."""
    with Session(engine) as s:
        with pytest.raises(RuntimeError), s.begin():
            assert Job.flow.finish(s, 3).applied
            raise RuntimeError("boom")
        assert CALLS == []
        with s.begin():
            assert Job.flow.finish(s, 3).applied
    assert CALLS == [("declared", 3, "done", Outcome.APPLIED)]


def test_trigger_without_after_commit_schedules_nothing(engine: Engine) -> None:
    """A transition without after_commit leaves no pending callback on the session."""
    from stateguard import _kernel

    with Session(engine) as s, s.begin():
        Job.flow.fail(s, 1)
        assert _kernel.pending(s) == 2
    with Session(engine) as s, s.begin():
        Job.flow.retry(s, 1)
        assert _kernel.pending(s) == 0
    assert [c[0] for c in CALLS] == ["declared", "second"]


# -- savepoints ------------------------------------------------------------------------


@pytest.mark.rollback
def test_rolled_back_savepoint_drops_its_callbacks_and_keeps_outer_ones(engine: Engine) -> None:
    """Callbacks registered inside a rolled-back begin_nested() are dropped; the outer ones run."""
    calls: list[Any] = []
    with Session(engine) as s, s.begin():
        Order.flow.pay(s, 1).on_commit(calls.append, "outer")
        with s.begin_nested() as sp:
            Order.flow.pay(s, 2).on_commit(calls.append, "inner")
            Job.flow.finish(s, 1)
            sp.rollback()
        Order.flow.pay(s, 3).on_commit(calls.append, "after")
        assert calls == []
    assert calls == ["outer", "after"]
    assert CALLS == []
    assert _statuses(engine) == {1: "paid", 2: "pending", 3: "paid", 4: "shipped"}


@pytest.mark.rollback
def test_savepoint_rolled_back_by_an_exception_drops_its_callbacks(engine: Engine) -> None:
    """An exception leaving begin_nested() rolls the savepoint back with its callbacks."""
    calls: list[Any] = []
    with Session(engine) as s, s.begin():
        try:
            with s.begin_nested():
                Order.flow.pay(s, 2).on_commit(calls.append, "inner")
                raise KeyError("inner failure")
        except KeyError:
            pass
        assert Order.flow.pay(s, 2).applied  # the savepoint's write was undone
    assert calls == []


@pytest.mark.rollback
def test_released_savepoint_keeps_its_callbacks_until_the_outer_commit(engine: Engine) -> None:
    """Callbacks of a released savepoint wait for the outermost commit and then run."""
    calls: list[Any] = []
    with Session(engine) as s, s.begin():
        with s.begin_nested():
            Order.flow.pay(s, 1).on_commit(calls.append, "inner")
            Job.flow.finish(s, 1)
        assert calls == [] and CALLS == []
        Order.flow.pay(s, 2).on_commit(calls.append, "outer")
    assert calls == ["inner", "outer"]
    assert CALLS == [("declared", 1, "done", Outcome.APPLIED)]


@pytest.mark.rollback
def test_released_savepoint_then_outer_rollback_drops_everything(engine: Engine) -> None:
    """A released savepoint's callbacks are still dropped when the outer transaction rolls back."""
    calls: list[Any] = []
    with Session(engine) as s:
        s.begin()
        with s.begin_nested():
            Order.flow.pay(s, 1).on_commit(calls.append, "inner")
        s.rollback()
    assert calls == []
    assert _statuses(engine)[1] == "pending"


@pytest.mark.rollback
def test_nested_savepoints_two_levels(engine: Engine) -> None:
    """A rolled-back inner savepoint inside a released middle one drops only the inner callbacks."""
    calls: list[Any] = []
    with Session(engine) as s, s.begin(), s.begin_nested():
        Order.flow.pay(s, 1).on_commit(calls.append, "middle")
        with s.begin_nested() as inner:
            Order.flow.pay(s, 2).on_commit(calls.append, "inner")
            inner.rollback()
    assert calls == ["middle"]
    assert _statuses(engine)[2] == "pending"


# -- the plain SQLite engine -------------------------------------------------------------


def test_plain_sqlite_engine_never_commits_stateguard_writes_early(sqlite: Backend) -> None:
    """On a plain create_engine('sqlite:///...') stateguard writes stay uncommitted until COMMIT."""
    plain = create_engine(sqlite.url)
    watcher = create_engine(sqlite.url)
    try:
        sqlite.create(Base.metadata)
        with Session(plain) as s, s.begin():
            s.add_all([Order(id=1), Order(id=2, status="paid")])
        calls: list[Any] = []
        with Session(plain) as s:
            s.begin()
            Order.flow.pay(s, 1).on_commit(calls.append, "pay")
            Order.flow.pay(s, 2)  # REPEATED: UPDATE then read
            Order.flow.ship(s, 2)
            guarded_update(s, Order, 1, {"note": "x"}, expected_version=2)
            insert_once(s, Message, {"message_id": "m"})
            insert_once(s, Message, {"message_id": "m"})
            # Another connection still sees the committed state: nothing was committed early.
            with Session(watcher) as w:
                assert {k: v for k, v in w.execute(select(Order.id, Order.status))} == {
                    1: "pending",
                    2: "paid",
                }
                assert w.scalar(select(func.count()).select_from(Message)) == 0
            s.rollback()
        assert calls == []
        with Session(watcher) as w:
            assert {k: v for k, v in w.execute(select(Order.id, Order.status))} == {
                1: "pending",
                2: "paid",
            }
            assert w.scalar(select(func.count()).select_from(Message)) == 0
            assert w.get_one(Order, 1).version == 1
    finally:
        plain.dispose()
        watcher.dispose()
