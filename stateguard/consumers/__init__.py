"""Consumers that apply each broker message once: the other half of the outbox's exactly-once effects.

Every consumer here runs your ``handler(session, message)`` in one
transaction with :func:`~stateguard.consume_once` keyed by the event id the
outbox sinks set, commits, and only then acknowledges; a repeat is
acknowledged without running the handler, a failure rolls back and is
delivered again, and after ``max_deliveries`` it goes to the broker's dead
letters.  ``import stateguard.consumers`` imports no broker client; a name
below is imported from its module the first time it is used::

    from stateguard.consumers import RedisStreamConsumer       # pip install 'stateguard[redis]'
    RedisStreamConsumer(engine, handle, redis.Redis(), stream="orders", group="billing",
                        worker="billing-1").serve()

- :class:`RedisStreamConsumer`: a Redis stream read as one worker of a
  consumer group (module ``redis_streams``, extra ``redis``);
- :class:`RabbitMQConsumer`: a RabbitMQ queue (``rabbitmq``, pika);
- :class:`NATSConsumer`: a JetStream durable pull consumer (``nats``, nats-py);
- :func:`exactly_once`: a Celery task applied once per key; :func:`enqueue`:
  a Celery task sent through the outbox by a relay with
  :class:`~stateguard.outbox.sinks.CelerySink` (``celery``, celery).

:class:`Message` is what a handler gets.  See ``docs/how-to/consumers.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .. import _compat
from ._core import DEFAULT_MAX_DELIVERIES as DEFAULT_MAX_DELIVERIES
from ._core import Handler, Message

if TYPE_CHECKING:
    from .celery import enqueue, exactly_once
    from .nats import NATSConsumer
    from .rabbitmq import RabbitMQConsumer
    from .redis_streams import RedisStreamConsumer

__all__ = [
    "Handler",
    "Message",
    "NATSConsumer",
    "RabbitMQConsumer",
    "RedisStreamConsumer",
    "enqueue",
    "exactly_once",
]

#: Which module defines each name (imported on first use: each needs its own client).
_MODULES = {
    "enqueue": "celery",
    "exactly_once": "celery",
    "NATSConsumer": "nats",
    "RabbitMQConsumer": "rabbitmq",
    "RedisStreamConsumer": "redis_streams",
}


#: Names this package exported before they moved to the outbox's sinks, and where they live now.
_MOVED = {"CelerySink": "stateguard.outbox.sinks.celery"}


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        return _compat.moved(__name__, name, _MOVED, public="stateguard.outbox.sinks")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
