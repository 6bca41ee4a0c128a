"""Outbox sinks for message brokers: each in its own module, its client an optional extra.

``import stateguard.outbox.sinks`` imports no broker client; a name below is
imported from its module the first time it is used::

    from stateguard.outbox.sinks import RabbitMQSink            # pip install 'stateguard[rabbitmq]'
    relay = Relay(engine, RabbitMQSink("amqp://guest:guest@127.0.0.1:5672/%2F", exchange="orders"))

============================  ===========================  =======================
sink                          relay                        module (extra)
============================  ===========================  =======================
:class:`RabbitMQSink`         :class:`~stateguard.Relay`   ``rabbitmq`` (pika)
:class:`AsyncRabbitMQSink`    ``AsyncRelay``               ``rabbitmq`` (aio-pika)
:class:`NATSSink`             :class:`~stateguard.Relay`   ``nats`` (nats-py)
:class:`AsyncNATSSink`        ``AsyncRelay``               ``nats`` (nats-py)
:class:`RedisStreamSink`      either (by its client)       ``redis`` (redis-py)
:class:`CelerySink`           :class:`~stateguard.Relay`   ``celery`` (celery)
============================  ===========================  =======================

The RabbitMQ and NATS
sinks raise :class:`~stateguard.PublishFailed` when their broker did not take
the whole batch, so the relay publishes the batch again: delivery is at least
once, and consumers deduplicate by the event id (the AMQP ``message_id``,
the ``Nats-Msg-Id`` header, which JetStream also deduplicates on).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .celery import CelerySink
    from .nats import AsyncNATSSink, NATSSink
    from .rabbitmq import AsyncRabbitMQSink, RabbitMQSink
    from .redis_streams import RedisStreamSink

__all__ = [
    "AsyncNATSSink",
    "AsyncRabbitMQSink",
    "CelerySink",
    "NATSSink",
    "RabbitMQSink",
    "RedisStreamSink",
]

#: Which module defines each sink (imported on first use: each needs its own client).
_MODULES = {
    "AsyncNATSSink": "nats",
    "CelerySink": "celery",
    "NATSSink": "nats",
    "AsyncRabbitMQSink": "rabbitmq",
    "RabbitMQSink": "rabbitmq",
    "RedisStreamSink": "redis_streams",
}


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
