"""A handler that catches a database error of its own and returns normally: the consumer must not
acknowledge a message whose transaction the database has already thrown away.

On PostgreSQL a failed statement aborts the transaction and the COMMIT that follows is answered
``ROLLBACK`` without an error: the consume_once record and the handler's writes are gone, yet the
consumer acknowledged the message (its effect is lost).  On MariaDB a deadlock rolls the whole
transaction back and the next statement starts a new one: the handler's later writes commit without
the record, the message is acknowledged, and a duplicate publication applies the effect again.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Column, Engine, Integer, MetaData, Table, insert, text, update
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from stateguard import create_tables, drop_tables
from stateguard.consumers import Message, RedisStreamConsumer

from ..conftest import Backend, backends_with
from ._effects import applied, metadata, record
from ._effects import effects as effects_table

GROUP = "billing"

locks_metadata = MetaData()
handler_locks = Table(
    "swallowed_consumer_locks",
    locks_metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("n", Integer, nullable=False),
)

pytestmark = pytest.mark.parametrize("backend", backends_with("tcp_server"), indirect=True)


@pytest.fixture
def direct(backend: Backend) -> Iterator[Engine]:
    """stateguard's tables, ``consumer_effects`` and two lockable rows on the backend."""
    engine = backend.create(metadata)
    backend.create(locks_metadata)
    drop_tables(engine)
    create_tables(engine)
    with engine.begin() as conn:
        conn.execute(insert(handler_locks), [{"id": 1, "n": 0}, {"id": 2, "n": 0}])
    yield engine
    drop_tables(engine)


def add(client: Any, name: str, entry_id: str) -> None:
    client.xadd(name, {"id": entry_id, "topic": "t", "key": "k", "payload": "{}"})


def settled_once_or_pending(engine: Engine, client: Any, name: str, entry_id: str) -> None:
    """The promise: the effect is in once (and acked), or it is not and the entry is still pending."""
    effects = applied(engine).get(entry_id, 0)
    still_pending = int(client.xpending(name, GROUP)["pending"])
    assert (effects, still_pending) in {(1, 0), (0, 1)}, (effects, still_pending)


def test_a_statement_error_the_handler_swallowed_does_not_ack_a_thrown_away_transaction(
    backend: Backend, direct: Engine, stream: tuple[Any, str]
) -> None:
    """The handler writes its effect, then catches a failing statement (a duplicate insert it means
    to ignore, a division by zero) and returns: the message is acknowledged only if the effect and the
    record committed."""
    client, name = stream
    add(client, name, "e1")

    def handler(session: Session, message: Message) -> None:
        record(session, message)
        with contextlib.suppress(sa_exc.DBAPIError):  # "not important": PostgreSQL aborted it now
            session.execute(text("SELECT 1/0"))

    c = RedisStreamConsumer(
        direct, handler, client, stream=name, group=GROUP, worker="w1", block=timedelta(milliseconds=50)
    )
    c.run_once()
    settled_once_or_pending(direct, client, name, "e1")


@pytest.mark.rollback
def test_a_deadlock_the_handler_swallowed_does_not_commit_its_writes_without_the_record(
    backend: Backend, direct: Engine, stream: tuple[Any, str]
) -> None:
    """The handler's transaction is chosen as a deadlock victim and the handler catches the error and
    writes its effect anyway: on MariaDB that commits without the consume_once record (rolled back with
    the deadlock), so the consumer must not acknowledge it as done."""
    client, name = stream
    add(client, name, "e2")
    first_locked, other_locked = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    victims: list[BaseException] = []

    def other() -> None:
        try:
            with direct.begin() as conn:
                # The bigger transaction: InnoDB rolls back the one that changed fewer rows.
                conn.execute(insert(handler_locks), [{"id": i, "n": 0} for i in range(10, 40)])
                conn.execute(
                    update(handler_locks).where(handler_locks.c.id == 2).values(n=handler_locks.c.n + 1)
                )
                other_locked.set()
                assert first_locked.wait(10)
                # Wait after the handler does: PostgreSQL's victim is the first waiter whose
                # deadlock_timeout runs out (the handler's).
                time.sleep(0.3)
                conn.execute(
                    update(handler_locks).where(handler_locks.c.id == 1).values(n=handler_locks.c.n + 1)
                )
        except sa_exc.DBAPIError:
            pass  # this side may be the victim instead: then the handler's side simply goes on
        except BaseException as error:
            errors.append(error)

    def handler(session: Session, message: Message) -> None:
        session.execute(update(handler_locks).where(handler_locks.c.id == 1).values(n=handler_locks.c.n + 1))
        first_locked.set()
        assert other_locked.wait(10)
        try:
            session.execute(
                update(handler_locks).where(handler_locks.c.id == 2).values(n=handler_locks.c.n + 1)
            )
        except sa_exc.DBAPIError as error:
            victims.append(error)  # the deadlock, swallowed
        record(session, message)

    thread = threading.Thread(target=other)
    thread.start()
    c = RedisStreamConsumer(
        direct, handler, client, stream=name, group=GROUP, worker="w1", block=timedelta(milliseconds=50)
    )
    c.run_once()
    thread.join(15)
    assert not errors
    assert victims, "the handler's transaction was not the deadlock's victim: no test"
    add(client, name, "e2")  # the relay published it twice: the second must be a repeat
    c.run_once()
    c.run_once()
    effects, still_pending = applied(direct).get("e2", 0), int(client.xpending(name, GROUP)["pending"])
    assert effects <= 1 and (effects == 1 or still_pending), (effects, still_pending)


def test_a_celery_task_that_swallowed_a_statement_error_fails_rather_than_succeeding_empty(
    backend: Backend, direct: Engine
) -> None:
    """exactly_once: the body writes its effect and swallows a failing statement; the task must fail
    (Celery redelivers or reports it), not succeed with nothing committed, and its next run applies."""
    celery = pytest.importorskip("celery")
    app = celery.Celery("sgswallowed", broker="memory://", backend="cache+memory://", set_as_current=False)
    from stateguard.consumers import exactly_once

    tries: list[int] = []

    @exactly_once(app, bind=direct)
    def ship(session: Session, order_id: int) -> str:
        tries.append(order_id)
        session.execute(insert(effects_table).values(event_id=f"order-{order_id}", pid=0))
        if len(tries) == 1:
            with contextlib.suppress(sa_exc.DBAPIError):
                session.execute(text("SELECT 1/0"))
        return "shipped"

    first = ship.apply((5,), task_id="t-swallowed-1")
    if backend.name == "postgresql":
        assert first.failed()  # not "shipped" for a COMMIT PostgreSQL turned into a ROLLBACK
    assert applied(direct).get("order-5", 0) == (0 if first.failed() else 1)
    if first.failed():
        assert ship.apply((5,), task_id="t-swallowed-1").get() == "shipped"
    assert applied(direct) == {"order-5": 1}
