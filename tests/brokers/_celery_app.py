"""The Celery app of the end-to-end test: one exactly_once task on RabbitMQ, acks_late, prefetch 1.

Its settings come from the environment (``SG_DB_URL``, ``SG_TARGET`` the queue, ``SG_LOG``), so
the workers and relays the test starts share them.
"""

from __future__ import annotations

import os

from celery import Celery
from celery.signals import worker_ready
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from stateguard.consumers import Message, exactly_once

from .._support.brokers import RABBITMQ_URL
from ._roles import Log, handler

QUEUE = os.environ["SG_TARGET"]

app = Celery("sgtest", broker=RABBITMQ_URL.replace("%2F", ""), set_as_current=False)
app.conf.update(
    task_default_queue=QUEUE,
    task_default_exchange=QUEUE,
    task_default_routing_key=QUEUE,
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
    worker_enable_remote_control=False,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    # The sink returns once RabbitMQ confirmed the task message.
    broker_transport_options={"confirm_publish": True},
)


@worker_ready.connect
def _ready(**kw: object) -> None:
    Log().write("ready", os.getpid())


_engine = create_engine(os.environ["SG_DB_URL"], pool_size=2, max_overflow=2)
_handle = handler(Log()) if "SG_LOG" in os.environ else None


@exactly_once(app, bind=_engine, name="sgtest.apply_effect", consumer="e2e")
def apply_effect(session: Session, seq: int) -> None:
    """The effect of one outbox event: the same handler as the broker consumers'."""
    from celery import current_task

    assert _handle is not None
    event_id = current_task.request.id.rsplit("-", 1)[1]
    _handle(session, Message(id=event_id, body=f'{{"seq": {seq}}}'.encode()))
