"""What every broker's consumer shares: the message, the handling once, the retry of a database outage.

A broker module turns its own message into a :class:`Message`, calls
:meth:`Handling.handle` and acknowledges, requeues or dead-letters by the
:class:`Verdict` it gets back.  Nothing here imports a broker client.
"""

from __future__ import annotations

import enum
import json
import logging
import random
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Final, Protocol

from sqlalchemy import Engine, bindparam, select, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from .. import _kernel
from ..exceptions import InvalidArgument, StateguardError, TransactionAborted
from ..inserts import consume_once
from ..observe import failed
from ..tables import MAX_KEY, MAX_SCOPE, consumed_messages


class ConsumerLog:
    """The consumers' logger (``stateguard.consumers``), whose lines cannot change what a consumer does.

    A logging filter or handler that raises (an observer, like an outcome
    listener) would otherwise end the consumer in the middle of a message:
    committed and never acknowledged, or a failure never counted.  Its
    error is logged on ``stateguard.observe`` (if that can be) and dropped,
    as :mod:`stateguard.observe` does with every observer's.
    """

    __slots__ = ("logger",)

    def __init__(self, name: str) -> None:
        self.logger = logging.getLogger(name)

    def _say(self, level: int, msg: str, *args: Any, **kwargs: Any) -> None:
        if not self.logger.isEnabledFor(level):
            return
        try:
            self.logger.log(level, msg, *args, stacklevel=3, **kwargs)
        except Exception:  # a logging filter or handler that raises
            failed(self.logger, "logging a consumer's line")

    def debug(self, msg: str, *args: Any, **kwargs: Any) -> None:
        """``logging.Logger.debug``, never raising."""
        self._say(logging.DEBUG, msg, *args, **kwargs)

    def info(self, msg: str, *args: Any, **kwargs: Any) -> None:
        """``logging.Logger.info``, never raising."""
        self._say(logging.INFO, msg, *args, **kwargs)

    def warning(self, msg: str, *args: Any, **kwargs: Any) -> None:
        """``logging.Logger.warning``, never raising."""
        self._say(logging.WARNING, msg, *args, **kwargs)

    def error(self, msg: str, *args: Any, **kwargs: Any) -> None:
        """``logging.Logger.error``, never raising."""
        self._say(logging.ERROR, msg, *args, **kwargs)


log = ConsumerLog("stateguard.consumers")

#: Deliveries of one message whose handler failed before it goes to the dead letters.
DEFAULT_MAX_DELIVERIES: Final = 5
#: The longest pause between two tries of a message while the database is unreachable (seconds).
MAX_BACKOFF: Final = 30.0


@dataclass(frozen=True, slots=True)
class Message:
    """One broker message as a consumer's handler gets it.

    ``id`` is what :func:`~stateguard.consume_once` records: the outbox event
    id the sinks set (the AMQP ``message_id``, the ``Nats-Msg-Id`` header,
    the stream entry's ``id`` field).  ``topic`` and ``key`` are the event's
    (None when the message does not carry them), ``body`` the raw bytes,
    ``deliveries`` how often the broker delivered it (1 the first time) and
    ``raw`` the broker client's own message object::

        def handle(session: Session, message: Message) -> None:
            session.add(Parcel(order_id=message.payload["order"], event=message.id))
    """

    id: str
    body: bytes
    topic: str | None = None
    key: str | None = None
    deliveries: int = 1
    raw: Any = field(default=None, repr=False, compare=False)

    @property
    def payload(self) -> Any:
        """The body read as JSON (what :func:`~stateguard.emit` stored); ValueError when it is not JSON."""
        return json.loads(self.body)


class Handler(Protocol):
    """The user's function: ``handler(session, message)``, run once per message id, in its transaction."""

    def __call__(self, session: Session, message: Message, /) -> Any: ...


class Verdict(enum.Enum):
    """What a consumer does with a message after :meth:`Handling.handle`."""

    #: Handled now (committed) or before (consume_once said REPEATED): acknowledge it.
    DONE = "done"
    #: The handler raised: the transaction rolled back; requeue it, or dead-letter it after N deliveries.
    FAILED = "failed"
    #: Stopped while waiting for the database to come back: release it untouched.
    STOPPED = "stopped"
    #: Its id cannot be recorded by consume_once (empty, blank, too long, NUL, not text): no
    #: delivery can ever handle it once, so it is dead-lettered at once, the handler not run.
    UNUSABLE = "unusable"


def check_name(value: Any, what: str, limit: int = MAX_SCOPE) -> str:
    """A non-blank str of at most ``limit`` characters, or InvalidArgument."""
    return _kernel.check_text(value, what, limit)


def check_deliveries(value: Any) -> int:
    if type(value) is not int or value < 1:
        raise InvalidArgument(
            f"max_deliveries must be an int >= 1 (deliveries of a failing message before it is "
            f"dead-lettered), got {value!r}"
        )
    return value


def check_seconds(value: Any, what: str) -> float:
    return _kernel.required_seconds(value, what)


def session_factory(bind: Any, who: str) -> Callable[[], Session]:
    """``bind`` (an Engine, or a sessionmaker / function returning a Session) as a Session factory."""
    if isinstance(bind, Engine):
        engine = bind
        return lambda: Session(engine)
    if callable(bind):
        return bind  # type: ignore[no-any-return]
    raise InvalidArgument(
        f"{who} needs a synchronous SQLAlchemy Engine or a sessionmaker, got {bind!r} "
        "(an AsyncEngine has no consumer here: use a sync engine for the consumer process)"
    )


def is_transient(error: BaseException, reachable: Callable[[], bool] | None = None) -> bool:
    """Whether ``error`` says the database is unreachable or busy, not that the message is bad.

    A lost connection (``OperationalError``, ``InterfaceError``) or a
    retryable stateguard error (deadlock, serialization failure) does not
    count against the message: the consumer tries it again where it is.
    ``OperationalError`` is also what drivers raise for a statement's own
    failure (sqlite3's "no such table", PyMySQL's errors it has no class for:
    a trigger's ``SIGNAL``, a CHECK constraint; PostgreSQL's statement
    timeout): one that is neither a lost connection nor a known conflict is
    transient only if ``reachable()`` (a fresh ``SELECT 1``) fails, so a
    handler that always fails that way is counted and dead-lettered instead
    of blocking its worker for good.
    """
    if isinstance(error, StateguardError):
        return error.retryable
    if isinstance(error, sa_exc.InterfaceError) or (
        isinstance(error, sa_exc.DBAPIError) and error.connection_invalidated
    ):
        return True
    if not isinstance(error, sa_exc.OperationalError):
        return False
    if isinstance(error.orig, OSError) or _kernel.classify_db_error(error) is not None:
        return True
    return reachable is None or not reachable()


def reachable(factory: Callable[[], Session]) -> Callable[[], bool]:
    """A check that the database answers a ``SELECT 1`` on a new session of ``factory``."""

    def check() -> bool:
        try:
            with factory() as session:
                session.execute(text("SELECT 1"))
        except Exception:  # unreachable, whatever the driver calls it
            return False
        return True

    return check


_RECORDED: Final = select(consumed_messages.c.consumer).where(
    consumed_messages.c.consumer == bindparam("sg_consumer"),
    consumed_messages.c.message_id == bindparam("sg_message"),
)


def still_recorded(session: Session, consumer: str, message_id: str) -> None:
    """Raise TransactionAborted unless the transaction still holds ``message_id``'s record.

    A handler that catches a database error of its own and returns would
    otherwise have its message acknowledged for a transaction the database
    threw away: PostgreSQL answers the COMMIT of an aborted transaction
    ``ROLLBACK`` without an error (the record and the effect gone, the
    message acknowledged), and MariaDB rolls a deadlock's whole transaction
    back and starts a new one with the next statement (the handler's later
    writes commit without the record, and a redelivery applies them again).
    One primary-key read before the COMMIT: PostgreSQL refuses it (25P02),
    MariaDB no longer finds the row.
    """
    conn = _kernel.own_connection(session, consumed_messages)
    params = {"sg_consumer": consumer, "sg_message": message_id}
    if _kernel.execute(conn, _RECORDED, params).first() is None:
        raise TransactionAborted(
            f"message {message_id!r}: its consume_once record is no longer in the transaction (the "
            "database rolled the transaction back under the handler: a deadlock it caught?); rolled "
            "back, not acknowledged.  Let the handler's database errors propagate, or put a statement "
            "that may fail in session.begin_nested()"
        )


class Handling:
    """The algorithm, once: ``consume_once`` and the handler in one transaction, committed; a verdict."""

    __slots__ = ("consumer", "factory", "handler", "stop_event")

    def __init__(self, bind: Any, handler: Any, consumer: Any, who: str) -> None:
        self.factory = session_factory(bind, who)
        if not callable(handler):
            raise InvalidArgument(
                f"{who} needs a handler function handler(session, message), got {handler!r}"
            )
        self.handler: Handler = handler
        self.consumer = check_name(consumer, "consumer")
        self.stop_event = threading.Event()

    def apply(self, message: Message) -> bool:
        """Run the handler once for ``message.id`` and commit; False when it ran before (REPEATED)."""
        with self.factory() as session, session.begin():
            if not consume_once(session, self.consumer, message.id).applied:
                return False
            self.handler(session, message)
            session.flush()
            still_recorded(session, self.consumer, message.id)
        return True

    def handle(self, message: Message, keep_alive: Callable[[], Any] | None = None) -> Verdict:
        """Apply ``message``; wait out a database outage (calling ``keep_alive`` between tries)."""
        try:
            check_name(message.id, "message id", MAX_KEY)
        except InvalidArgument as error:
            log.error(
                "consumer %r: a message whose id cannot be recorded (%s) cannot be handled once: "
                "dead-lettered",
                self.consumer,
                error,
            )
            return Verdict.UNUSABLE
        pause = 0.05
        while True:
            try:
                applied = self.apply(message)
            except Exception as error:
                if not is_transient(error, reachable(self.factory)):
                    log.warning(
                        "consumer %r: the handler of message %s failed (delivery %d): %s: %s",
                        self.consumer,
                        message.id,
                        message.deliveries,
                        type(error).__name__,
                        error,
                        exc_info=True,
                    )
                    return Verdict.FAILED
                log.warning(
                    "consumer %r: message %s waits for the database (%s: %s); trying again in %.2f s",
                    self.consumer,
                    message.id,
                    type(error).__name__,
                    error,
                    pause,
                )
                if self.stop_event.wait(pause * random.uniform(0.5, 1.0)):  # jitter, not security
                    return Verdict.STOPPED
                pause = min(pause * 2, MAX_BACKOFF)
                if keep_alive is not None:
                    keep_alive()
                continue
            if not applied:
                log.debug(
                    "consumer %r: message %s was handled before: acknowledged", self.consumer, message.id
                )
            return Verdict.DONE


def serve(run: Callable[[threading.Event], Any], stop_event: threading.Event) -> int:
    """Call ``run(stop_event)`` with SIGTERM and SIGINT setting ``stop_event``; return 0.

    Runs only in the main thread (Python delivers signals there).  A second
    signal acts at once: the first one put the previous handlers back.
    """
    if threading.current_thread() is not threading.main_thread():
        raise InvalidArgument(
            "serve() handles SIGTERM and SIGINT: call it from the main thread (or use run())"
        )
    previous: dict[int, Any] = {}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        for number, old in previous.items():
            signal.signal(number, old)
        log.info("%s: finishing the message in hand, then stopping", signal.Signals(signum).name)
        stop_event.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, on_signal)
    try:
        run(stop_event)
    finally:
        for number, old in previous.items():
            signal.signal(number, old)
    return 0
