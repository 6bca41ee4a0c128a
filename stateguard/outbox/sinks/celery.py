"""An outbox sink sending Celery tasks: :class:`CelerySink` (celery).

A relay with a :class:`CelerySink` sends each event
:func:`~stateguard.consumers.enqueue` stored in the caller's transaction as
a Celery task, after COMMIT, with a task id made of the event id
(:data:`TASK_ID_PREFIX` + the id), so the relay's re-publications are the
same task and an :func:`~stateguard.consumers.exactly_once` task applies it
once.  celery (the ``stateguard[celery]`` extra) is never imported here: the
sink only calls the app's ``send_task``.  See ``docs/how-to/consumers.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from ...exceptions import InvalidArgument, PublishFailed

if TYPE_CHECKING:
    from celery import Celery

    from .. import OutboxEvent

__all__ = ["TASK_ID_PREFIX", "CelerySink"]

#: Put before the outbox event id to make the Celery task id of an enqueued call.
TASK_ID_PREFIX: Final = "stateguard-outbox-"


class CelerySink:
    """An outbox :class:`~stateguard.outbox.Sink` sending each event ``enqueue()`` made as a Celery task.

    For example::

        from stateguard.outbox.sinks import CelerySink

        app.conf.broker_transport_options = {"confirm_publish": True}   # wait for the broker's confirm
        Relay(engine, CelerySink(app), topics=[ship.name]).run(stop_event)

    Each event is ``app.send_task(event.topic, args, kwargs,
    task_id=TASK_ID_PREFIX + str(event.id))``: an event the relay publishes
    twice is one task id twice, which an
    :func:`~stateguard.consumers.exactly_once` task applies once.  Give the
    relay ``topics=`` (the task names) so it takes only these events.  With
    RabbitMQ set ``confirm_publish``, so that a send returns once the broker
    has the message.  An event whose payload is not what
    :func:`~stateguard.consumers.enqueue` writes is refused
    (:class:`~stateguard.PublishFailed` naming it): the relay parks it dead
    after ``max_attempts``.  Before 0.3 this class lived in
    ``stateguard.consumers.celery``; that import still works, with a
    DeprecationWarning.

    :param app: the Celery app whose broker the tasks go to.
    :param options: more ``send_task`` options for every task (``queue=``...).
    :raises InvalidArgument: ``app`` has no ``send_task``.
    """

    __slots__ = ("app", "options")

    def __init__(self, app: Celery, **options: Any) -> None:
        if not callable(getattr(app, "send_task", None)):
            raise InvalidArgument(f"CelerySink needs a Celery app, got {app!r}")
        self.app = app
        self.options = options

    def publish(self, events: Sequence[OutboxEvent]) -> None:
        """Send one task per event, in order; raise PublishFailed naming the events not sent."""
        for done, event in enumerate(events):
            payload = event.payload
            if (
                not isinstance(payload, dict)
                or not isinstance(payload.get("args", []), list)
                or not isinstance(payload.get("kwargs", {}), dict)
            ):
                raise PublishFailed(
                    f"outbox event {event.id} (topic {event.topic!r}) is not a task call enqueue() wrote: "
                    f"its payload must be {{'args': [...], 'kwargs': {{...}}}}",
                    event_ids=(event.id,),
                )
            try:
                self.app.send_task(
                    event.topic,
                    args=payload.get("args", []),
                    kwargs=payload.get("kwargs", {}),
                    task_id=f"{TASK_ID_PREFIX}{event.id}",
                    **self.options,
                )
            except Exception as error:  # kombu's OperationalError, a lost connection, a nack
                raise PublishFailed(
                    f"Celery's broker did not take task {event.topic!r} of outbox event {event.id}: "
                    f"{type(error).__name__}: {error}",
                    event_ids=tuple(e.id for e in events[done:]),
                ) from error

    def __repr__(self) -> str:
        return f"CelerySink({getattr(self.app, 'main', self.app)!r})"
