"""exactly_once Celery tasks apply once per key however often they run; enqueue stores a task call that
a relay's CelerySink sends only after COMMIT, with a task id made of the outbox event id (the sink's own
tests: tests/outbox/sinks/test_celery.py)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine, insert
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from stateguard import CallableSink, InvalidArgument, Relay
from stateguard.consumers import enqueue, exactly_once

from ._effects import applied, effects

celery = pytest.importorskip("celery")


@pytest.fixture
def app() -> Any:
    """A Celery app on the in-memory broker (tasks run here with ``apply``, in this process)."""
    return celery.Celery("sgtest", broker="memory://", backend="cache+memory://", set_as_current=False)


def effect(session: Session, event_id: str) -> None:
    session.execute(insert(effects).values(event_id=event_id, pid=0))


def test_one_task_id_runs_the_body_once(app: Any, db: Engine) -> None:
    """The same task id delivered twice: the body runs and commits once; the repeat returns None."""
    calls: list[int] = []

    @exactly_once(app, bind=db)
    def ship(session: Session, order_id: int) -> str:
        calls.append(order_id)
        effect(session, f"order-{order_id}")
        return "shipped"

    assert ship.apply((7,), task_id="t-1").get() == "shipped"
    assert ship.apply((7,), task_id="t-1").get() is None
    assert calls == [7] and applied(db) == {"order-7": 1}


def test_a_key_makes_two_calls_one_effect(app: Any, db: Engine) -> None:
    """With ``key``, two tasks (two ids) for one order apply once: a delay() made twice."""

    @exactly_once(app, bind=db, key=lambda order_id: f"ship-{order_id}")
    def ship(session: Session, order_id: int) -> None:
        effect(session, f"order-{order_id}")

    ship.apply((7,), task_id="a")
    ship.apply((7,), task_id="b")
    ship.apply((8,), task_id="c")
    assert applied(db) == {"order-7": 1, "order-8": 1}


def test_a_failing_body_rolls_back_and_the_retry_applies(app: Any, db: Engine) -> None:
    """A body that raises leaves nothing (not even the consume_once record): the same task id runs again."""
    fail = [True]

    @exactly_once(app, bind=db)
    def ship(session: Session, order_id: int) -> None:
        effect(session, f"order-{order_id}")
        if fail and fail.pop():
            raise RuntimeError("carrier down")

    assert ship.apply((7,), task_id="t").failed()
    assert applied(db) == {}
    assert ship.apply((7,), task_id="t").successful()
    assert applied(db) == {"order-7": 1}


def test_a_database_outage_is_retried_by_celery(app: Any, db: Engine) -> None:
    """An OperationalError makes Celery retry the task (same id); the retry applies once."""
    errors = [sa_exc.OperationalError("x", {}, ConnectionError("server closed the connection"))]

    @exactly_once(app, bind=db)
    def ship(session: Session, order_id: int) -> None:
        if errors:
            raise errors.pop()
        effect(session, f"order-{order_id}")

    ship.apply((7,), task_id="t")
    assert applied(db) == {"order-7": 1}


def test_the_task_acks_late_and_checks_the_callers_arguments(app: Any, db: Engine) -> None:
    """acks_late and reject_on_worker_lost are on (options given win); callers pass args after session."""

    @exactly_once(app, bind=db, name="shop.ship", max_retries=2)
    def ship(session: Session, order_id: int, *, express: bool = False) -> None: ...

    assert (ship.name, ship.acks_late, ship.reject_on_worker_lost, ship.max_retries) == (
        "shop.ship",
        True,
        True,
        2,
    )
    with pytest.raises(TypeError):
        ship.delay()  # order_id missing: refused before anything is sent
    with pytest.raises(TypeError):
        ship.delay(1, 2)

    @exactly_once(app, bind=db, acks_late=False)
    def other(session: Session) -> None: ...

    assert other.acks_late is False


def test_a_function_without_a_session_parameter_is_refused(app: Any, db: Engine) -> None:
    """The body's first parameter is the session: a function without one is InvalidArgument."""
    with pytest.raises(InvalidArgument, match="session"):
        exactly_once(app, bind=db)(lambda: None)
    with pytest.raises(InvalidArgument, match="key"):
        exactly_once(app, bind=db, key="ship")  # type: ignore[arg-type]


def test_an_enqueued_call_is_an_outbox_event_of_the_committed_transaction_only(app: Any, db: Engine) -> None:
    """enqueue() in a committed transaction stores the task call (topic = task name, args, kwargs, key);
    one in a rolled-back transaction stores nothing."""

    @exactly_once(app, bind=db)
    def ship(session: Session, order_id: int, express: bool = False) -> None: ...

    with Session(db) as session, session.begin():
        event_id = enqueue(session, ship, (7,), {"express": True}, key="order-7")
    with Session(db) as session:
        with session.begin():
            enqueue(session, ship, (8,))
            session.rollback()
    got: list[Any] = []
    Relay(db, CallableSink(got.extend), topics=[ship.name]).run_once()
    assert [(e.id, e.topic, e.payload, e.key) for e in got] == [
        (event_id, ship.name, {"args": [7], "kwargs": {"express": True}}, "order-7")
    ]
