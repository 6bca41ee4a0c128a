"""Celery tasks applied once per key (:func:`exactly_once`), sent through the outbox (:func:`enqueue`).

:func:`exactly_once` makes a Celery task of a function ``fn(session, *args,
**kwargs)``: its body runs in one transaction with
:func:`~stateguard.consume_once` keyed by the task id (or ``key(*args,
**kwargs)``), and commits before Celery acknowledges the message
(``acks_late=True``, ``reject_on_worker_lost=True``), so a delivery that
comes again (a worker killed mid-task, a visibility timeout, a retry, a
``delay()`` made twice with one key) is acknowledged without running the
body again.  :func:`enqueue` stores the call as an outbox event in the
caller's transaction, and a relay with a
:class:`~stateguard.outbox.sinks.CelerySink` (module
``stateguard.outbox.sinks.celery``; importing it from here still works, with
a DeprecationWarning) sends it after COMMIT, with a task id made of the
event id, so the relay's re-publications are the same task.  celery (the
``stateguard[celery]`` extra) is referred to only by this module and the
sink's.  See ``docs/how-to/consumers.md``.
"""

from __future__ import annotations

import functools
import inspect
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy.orm import Session

from .. import _compat
from ..exceptions import InvalidArgument
from ..inserts import consume_once
from ..outbox import emit
from ._core import MAX_BACKOFF, check_name, is_transient, reachable, session_factory, still_recorded

if TYPE_CHECKING:
    from celery import Celery, Task

__all__ = ["enqueue", "exactly_once"]

#: Names this module defined before the sink moved to the outbox's sinks, and where they live now.
_MOVED: Final = {
    "CelerySink": "stateguard.outbox.sinks.celery",
    "TASK_ID_PREFIX": "stateguard.outbox.sinks.celery",
}


def exactly_once(
    app: Celery,
    *,
    bind: Any,
    key: Callable[..., str] | None = None,
    consumer: str | None = None,
    **task_options: Any,
) -> Callable[[Callable[..., Any]], Task]:
    """A decorator making ``fn(session, *args, **kwargs)`` a Celery task that applies once per key.

    ::

        app = Celery("shop", broker="amqp://guest:guest@127.0.0.1:5672//")

        @exactly_once(app, bind=engine, key=lambda order_id: f"ship-{order_id}")
        def ship(session: Session, order_id: int) -> None:
            session.add(Parcel(order_id=order_id))   # commits with the consume_once record

        ship.delay(7)                                # callers pass the arguments after session

    The task is ``app.task(acks_late=True, reject_on_worker_lost=True,
    **task_options)`` (your options win); its body runs in a transaction
    of its own with :func:`~stateguard.consume_once` ``(consumer,
    message id)``, where ``consumer`` defaults to the task's name and the
    message id is ``key(*args, **kwargs)``, or the task id without ``key``
    (then two ``delay()`` calls are two tasks: give each call its
    ``task_id`` or a ``key``).  The first run returns the body's value; a
    repeat returns None without running it.  An error of the body rolls
    back and fails the task as Celery does (``autoretry_for``,
    ``self.retry`` and the task's ack options apply; a retry has the same
    task id, so it is still one effect); a database that is unreachable is
    retried by Celery (``retry``, countdown doubling to 30 s) whatever the
    options.

    :param bind: a synchronous Engine, or a sessionmaker.
    :raises InvalidArgument: ``fn`` takes no session parameter, or a bad
        ``consumer`` or ``key``.
    """
    factory = session_factory(bind, "exactly_once")
    if key is not None and not callable(key):
        raise InvalidArgument(f"key must be a function of the task's arguments returning a str, got {key!r}")
    if consumer is not None:
        check_name(consumer, "consumer")

    def decorate(fn: Callable[..., Any]) -> Task:
        signature = inspect.signature(fn)
        parameters = list(signature.parameters.values())
        if not parameters or parameters[0].kind not in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            raise InvalidArgument(
                f"{fn.__qualname__} must take the session as its first parameter: "
                f"def {fn.__name__}(session, ...)"
            )

        @functools.wraps(fn)
        def run(task: Any, *args: Any, **kwargs: Any) -> Any:
            message_id = task.request.id if key is None else key(*args, **kwargs)
            if not isinstance(message_id, str):
                raise InvalidArgument(f"{task.name}: key() must return a str, got {message_id!r}")
            try:
                with factory() as session, session.begin():
                    name = consumer or task.name
                    if not consume_once(session, name, message_id).applied:
                        return None
                    result = fn(session, *args, **kwargs)
                    session.flush()
                    still_recorded(session, name, message_id)  # not a COMMIT of a thrown-away transaction
                    return result
            except Exception as error:
                if not is_transient(error, reachable(factory)):
                    raise
                countdown = min(2.0 ** (task.request.retries or 0), MAX_BACKOFF)
                raise task.retry(
                    exc=error, countdown=countdown * random.uniform(0.5, 1.0), max_retries=None
                ) from error

        # Celery checks the caller's arguments against this: the task's own, then fn's without the session.
        run.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[inspect.Parameter("task", inspect.Parameter.POSITIONAL_ONLY), *parameters[1:]]
        )
        options = {"acks_late": True, "reject_on_worker_lost": True, **task_options, "bind": True}
        return app.task(**options)(run)

    return decorate


def enqueue(
    session: Session,
    task: Any,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    key: str | None = None,
) -> int:
    """Store a call of ``task`` as an outbox event in the session's transaction; return the event id.

    The task is sent by a relay with a
    :class:`~stateguard.outbox.sinks.CelerySink` once the
    transaction commits, never if it rolls back, and even if the process
    dies right after COMMIT (where Celery's ``delay_on_commit`` loses it)::

        with Session(engine) as session, session.begin():
            Order.flow.pay(session, 7)
            enqueue(session, ship, (7,), key="order-7")      # sent after COMMIT

        Relay(engine, CelerySink(app), topics=[ship.name]).run(stop_event)

    The event's topic is the task's name, its payload ``{"args": [...],
    "kwargs": {...}}`` (JSON values), its ``key`` the relay's order key.

    :raises InvalidArgument: arguments that are not JSON, a blank name; nothing was written.
    """
    name = task if isinstance(task, str) else getattr(task, "name", None)
    if not isinstance(name, str):
        raise InvalidArgument(f"enqueue needs a Celery task or a task name, got {task!r}")
    payload = {"args": list(args), "kwargs": dict(kwargs or {})}
    return emit(session, name, payload, key=key)


def __getattr__(name: str) -> Any:
    return _compat.moved(__name__, name, _MOVED, public="stateguard.outbox.sinks")
