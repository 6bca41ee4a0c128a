"""CelerySink: each event enqueue() wrote becomes one Celery task message on the real RabbitMQ, its task id
made of the event id; a payload that is no task call is refused alone; a broker that does not take a task
fails the batch from that event on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from stateguard import CallableSink, InvalidArgument, PublishFailed, Relay, emit
from stateguard.consumers import enqueue
from stateguard.outbox.sinks import CelerySink
from stateguard.outbox.sinks.celery import TASK_ID_PREFIX

from ..._support.brokers import RABBITMQ_URL, Queue

celery = pytest.importorskip("celery")


def celery_app(broker: str = RABBITMQ_URL) -> Any:
    """A Celery app on ``broker`` that waits for RabbitMQ's confirm of each task message."""
    app = celery.Celery("sgsink", broker=broker.replace("%2F", ""), set_as_current=False)
    app.conf.update(
        # max_retries 0: a refused connection fails the send at once (kombu retries it 2 s otherwise).
        broker_transport_options={"confirm_publish": True, "max_retries": 0},
        task_ignore_result=True,
    )
    return app


@pytest.fixture
def app(mq: Queue) -> Iterator[Any]:
    """A Celery app whose tasks go to the private queue (Celery declares an exchange of that name too)."""
    made = celery_app()
    yield made
    mq.channel.exchange_delete(mq.queue)


def claimed(db: Engine) -> list[Any]:
    """Every unpublished event, claimed by a relay (as the sink gets them)."""
    got: list[Any] = []
    Relay(db, CallableSink(got.extend)).run_once()
    return got


def test_each_enqueued_call_is_one_task_message_with_the_event_id_in_its_task_id(
    outbox_db: Engine, mq: Queue, app: Any
) -> None:
    """Two enqueued calls relayed: two task messages in order, each named by the event id, args kept."""
    with Session(outbox_db) as session, session.begin():
        first = enqueue(session, "shop.ship", (7,), {"express": True}, key="order-7")
        second = enqueue(session, "shop.ship", (8,))
    assert Relay(outbox_db, CelerySink(app, queue=mq.queue), topics=["shop.ship"]).run_once() == 2
    got = mq.drain()
    assert [m.properties.headers["id"] for m in got] == [
        f"{TASK_ID_PREFIX}{first}",
        f"{TASK_ID_PREFIX}{second}",
    ]
    assert {m.properties.headers["task"] for m in got} == {"shop.ship"}
    args, kwargs, _ = json.loads(got[0].body)
    assert (args, kwargs) == ([7], {"express": True})


def test_a_payload_that_is_not_a_task_call_is_refused_alone(outbox_db: Engine, mq: Queue, app: Any) -> None:
    """A payload enqueue() did not write is PublishFailed naming only that event; nothing is sent."""
    with Session(outbox_db) as session, session.begin():
        bad = emit(session, "shop.ship", [1, 2])
    with pytest.raises(PublishFailed) as caught:
        CelerySink(app, queue=mq.queue).publish(claimed(outbox_db))
    assert caught.value.event_ids == (bad,)
    assert mq.drain() == []


def test_a_broker_that_takes_nothing_fails_every_event_not_sent(outbox_db: Engine) -> None:
    """No broker at the URL: PublishFailed naming the events from the first one not sent."""
    with Session(outbox_db) as session, session.begin():
        ids = [enqueue(session, "shop.ship", (n,)) for n in range(3)]
    sink = CelerySink(celery_app("amqp://guest:guest@127.0.0.1:1/"), retry=False)
    with pytest.raises(PublishFailed) as caught:
        sink.publish(claimed(outbox_db))
    assert caught.value.event_ids == tuple(ids)


def test_something_that_is_not_a_celery_app_is_refused() -> None:
    """CelerySink(None) is InvalidArgument at construction."""
    with pytest.raises(InvalidArgument, match="Celery app"):
        CelerySink(None)
