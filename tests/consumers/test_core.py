"""The handling every consumer shares: consume_once and the handler in one transaction, committed,
then a verdict; repeats skip the handler, failures roll back, database outages are waited out."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest
from sqlalchemy import Engine, select
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session, sessionmaker

from stateguard import DeadlockDetected, InvalidArgument
from stateguard.consumers import Message
from stateguard.consumers._core import Handling, Verdict, is_transient, serve
from stateguard.tables import consumed_messages

from ..conftest import Backend
from ._effects import applied, metadata, record


@pytest.fixture
def any_db(engine: Engine, backend: Backend) -> Engine:
    """Each backend with stateguard's tables and the effects table (the others run on SQLite: ``db``)."""
    backend.create(metadata)
    return engine


def records(engine: Engine) -> list[tuple[str, str]]:
    with engine.connect() as conn:
        return [(r.consumer, r.message_id) for r in conn.execute(select(consumed_messages))]


def test_first_delivery_applies_and_a_repeat_skips_the_handler(any_db: Engine) -> None:
    """The handler's write commits with the consume_once record; the same id again is DONE without a run."""
    calls: list[str] = []

    def handler(session: Session, message: Message) -> None:
        calls.append(message.id)
        record(session, message)

    handling = Handling(any_db, handler, "billing", "test")
    message = Message(id="42", body=b'{"seq": 1}', key="k1")
    assert handling.handle(message) is Verdict.DONE
    assert handling.handle(message) is Verdict.DONE
    assert calls == ["42"]
    assert applied(any_db) == {"42": 1}
    assert records(any_db) == [("billing", "42")]


def test_a_failing_handler_rolls_back_its_write_and_its_record(any_db: Engine) -> None:
    """A handler error is FAILED and leaves nothing; the redelivery then applies once."""
    fail = [False, True]

    def handler(session: Session, message: Message) -> None:
        record(session, message)
        if fail.pop():
            raise ValueError("bad message")

    handling = Handling(any_db, handler, "billing", "test")
    message = Message(id="7", body=b"{}")
    assert handling.handle(message) is Verdict.FAILED
    assert applied(any_db) == {} and records(any_db) == []
    assert handling.handle(message) is Verdict.DONE
    assert applied(any_db) == {"7": 1}


def test_a_database_outage_is_waited_out_on_the_message_in_hand(db: Engine) -> None:
    """OperationalError and retryable stateguard errors are tried again in place, not counted as failures."""
    errors: list[BaseException] = [
        sa_exc.OperationalError("SELECT 1", {}, ConnectionError("server closed the connection")),
        DeadlockDetected("deadlock"),
    ]
    kept_alive: list[int] = []

    def handler(session: Session, message: Message) -> None:
        if errors:
            raise errors.pop(0)
        record(session, message)

    handling = Handling(db, handler, "billing", "test")
    verdict = handling.handle(Message(id="9", body=b"{}"), keep_alive=lambda: kept_alive.append(1))
    assert verdict is Verdict.DONE
    assert applied(db) == {"9": 1}
    assert kept_alive == [1, 1]


def test_stop_during_an_outage_releases_the_message_untouched(db: Engine) -> None:
    """A stop while the database is down ends the wait with STOPPED and no write."""
    handling = Handling(db, lambda s, m: None, "billing", "test")

    def handler(session: Session, message: Message) -> None:
        handling.stop_event.set()
        raise sa_exc.OperationalError("SELECT 1", {}, ConnectionError("down"))

    handling.handler = handler
    assert handling.handle(Message(id="3", body=b"{}")) is Verdict.STOPPED
    assert records(db) == []


@pytest.mark.hostile
@pytest.mark.parametrize("bad", ["", " \t", "x" * 256, "a\x00b", "\ud800"], ids=repr)
def test_a_message_whose_id_cannot_be_recorded_is_unusable_without_running_the_handler(
    db: Engine, bad: str
) -> None:
    """No usable id means no deduplication: UNUSABLE (dead-lettered at once), the handler never runs,
    nothing is written."""
    calls: list[Message] = []
    handling = Handling(db, lambda s, m: calls.append(m), "billing", "test")
    assert handling.handle(Message(id=bad, body=b"{}")) is Verdict.UNUSABLE
    assert calls == [] and records(db) == []
    assert handling.handle(Message(id="x" * 255, body=b"{}")) is Verdict.DONE  # the limit itself is fine


def test_a_sessionmaker_is_accepted_as_the_bind(db: Engine) -> None:
    """A sessionmaker works in place of an Engine (its own Session options apply)."""
    handling = Handling(sessionmaker(db), record, "billing", "test")
    assert handling.handle(Message(id="5", body=b"{}")) is Verdict.DONE
    assert applied(db) == {"5": 1}


def test_bad_arguments_are_refused() -> None:
    """No engine, no handler or a blank consumer name is InvalidArgument at construction."""
    with pytest.raises(InvalidArgument, match="Engine or a sessionmaker"):
        Handling(None, record, "billing", "test")
    with pytest.raises(InvalidArgument, match="handler"):
        Handling(lambda: None, None, "billing", "test")
    with pytest.raises(InvalidArgument, match="consumer"):
        Handling(lambda: None, record, " ", "test")


def test_what_counts_as_transient() -> None:
    """Connection loss and retryable stateguard errors are transient; a handler's own error is not."""
    assert is_transient(sa_exc.OperationalError("x", {}, OSError("gone")))
    assert is_transient(DeadlockDetected("d"))
    assert not is_transient(InvalidArgument("bad"))
    assert not is_transient(sa_exc.IntegrityError("x", {}, Exception("dup")))
    assert not is_transient(ValueError("bad payload"))


def test_message_payload_is_the_json_body() -> None:
    """``payload`` reads the body as JSON; a body that is not JSON raises ValueError (a handler failure)."""
    assert Message(id="1", body='{"a": [1, "ü"]}'.encode()).payload == {"a": [1, "ü"]}
    with pytest.raises(ValueError):
        _ = Message(id="1", body=b"\xff not json").payload


def test_serve_stops_on_sigterm_and_restores_the_handler() -> None:
    """SIGTERM sets the stop event, run returns, serve returns 0 and puts the old handler back."""
    before = signal.getsignal(signal.SIGTERM)
    stop = threading.Event()
    seen: list[bool] = []

    def run(event: threading.Event) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)
        seen.append(event.wait(5))

    assert serve(run, stop) == 0
    assert seen == [True]
    assert signal.getsignal(signal.SIGTERM) is before


def test_serve_refuses_a_thread_other_than_main() -> None:
    """Signals reach only the main thread: serve() from another thread is InvalidArgument."""
    caught: list[BaseException] = []

    def other() -> None:
        try:
            serve(lambda e: None, threading.Event())
        except InvalidArgument as error:
            caught.append(error)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert len(caught) == 1
