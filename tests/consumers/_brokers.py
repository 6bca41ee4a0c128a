"""Private broker resources for the consumer tests: a RabbitMQ queue with a dead-letter queue, a
JetStream stream with a dead-letter stream, a Redis stream; each deleted afterwards.

One that cannot be reached skips its tests on a laptop and fails them under ``CI=true``
(``conftest.unavailable``).  Also used by tests/brokers/ and its worker processes.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

RABBITMQ_URL = os.environ.get("STATEGUARD_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
NATS_URL = os.environ.get("STATEGUARD_NATS_URL", "nats://127.0.0.1:4222")
REDIS_URL = os.environ.get("STATEGUARD_REDIS_URL", "redis://127.0.0.1:6379/0")


def _unavailable(what: str, error: BaseException) -> None:
    from ..conftest import unavailable

    unavailable(what, error)


def check_rabbitmq() -> None:
    """Skip (laptop) or fail (CI) unless RabbitMQ answers."""
    import pika

    try:
        pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL)).close()
    except Exception as error:  # AMQPConnectionError, OSError
        _unavailable(f"RabbitMQ at {RABBITMQ_URL}", error)


def check_nats() -> None:
    """Skip (laptop) or fail (CI) unless NATS with JetStream answers."""

    async def probe() -> None:
        client = await _client()
        try:
            await client.jetstream().account_info()
        finally:
            await client.close()

    try:
        asyncio.run(probe())
    except Exception as error:  # NoServersError, OSError, no JetStream
        _unavailable(f"NATS JetStream at {NATS_URL}", error)


# -- RabbitMQ ------------------------------------------------------------------


@dataclass
class Queue:
    """A topic exchange bound (``#``) to a durable queue whose dead letters go to a dead queue."""

    channel: Any
    exchange: str
    queue: str
    dead_queue: str

    def drain(self, queue: str | None = None) -> list[tuple[Any, bytes]]:
        """Every message of ``queue`` (default: the main queue), acknowledged: ``(properties, body)``."""
        got = []
        while True:
            method, properties, body = self.channel.basic_get(queue or self.queue, auto_ack=True)
            if method is None:
                return got
            got.append((properties, body))

    def count(self, queue: str | None = None) -> int:
        """Messages ready in ``queue`` (default: the main queue)."""
        return int(self.channel.queue_declare(queue or self.queue, passive=True).method.message_count)


@contextmanager
def rabbit_queue() -> Iterator[Queue]:
    """A :class:`Queue` with unique names, deleted afterwards."""
    import pika

    try:
        connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))
    except Exception as error:  # AMQPConnectionError, OSError
        _unavailable(f"RabbitMQ at {RABBITMQ_URL}", error)
        raise
    tag = uuid.uuid4().hex[:10]
    box = Queue(connection.channel(), f"sgc-{tag}", f"sgc-{tag}-q", f"sgc-{tag}-dead")
    dlx = f"sgc-{tag}-dlx"
    try:
        ch = box.channel
        ch.exchange_declare(box.exchange, "topic")
        ch.exchange_declare(dlx, "fanout")
        ch.queue_declare(box.dead_queue, durable=True)
        ch.queue_bind(box.dead_queue, dlx)
        ch.queue_declare(box.queue, durable=True, arguments={"x-dead-letter-exchange": dlx})
        ch.queue_bind(box.queue, box.exchange, "#")
        yield box
    finally:
        with _closing(connection) as ch:
            for name in (box.queue, box.dead_queue):
                ch.queue_delete(name)
            for name in (box.exchange, dlx):
                ch.exchange_delete(name)


@contextmanager
def _closing(connection: Any) -> Iterator[Any]:
    import pika

    if not connection.is_open:
        connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))
    try:
        yield connection.channel()
    finally:
        connection.close()


# -- NATS JetStream -----------------------------------------------------------


@dataclass
class Stream:
    """A stream taking ``<name>.>`` and a dead-letter stream taking ``<dead_subject>``."""

    name: str
    dead_name: str

    @property
    def dead_subject(self) -> str:
        return f"{self.dead_name}.letters"

    def topic(self, suffix: str = "paid") -> str:
        """An outbox topic that is a subject of the stream."""
        return f"{self.name}.{suffix}"

    def messages(self, stream: str | None = None) -> list[Any]:
        """Every stored message of ``stream`` (default: the main one), in stream order."""
        return asyncio.run(_read(stream or self.name))


async def _client() -> Any:
    import nats

    return await nats.connect(NATS_URL, connect_timeout=3, max_reconnect_attempts=0)


async def _read(name: str) -> list[Any]:
    client = await _client()
    try:
        js = client.jetstream()
        info = await js.stream_info(name)
        if info.state.messages == 0:
            return []
        return [await js.get_msg(name, seq) for seq in range(info.state.first_seq, info.state.last_seq + 1)]
    finally:
        await client.close()


async def _add(names: tuple[str, str]) -> None:
    from nats.js.api import StreamConfig

    client = await _client()
    try:
        for name in names:
            await client.jetstream().add_stream(
                StreamConfig(name=name, subjects=[f"{name}.>"], duplicate_window=60.0)
            )
    finally:
        await client.close()


async def _delete(names: tuple[str, str]) -> None:
    client = await _client()
    try:
        for name in names:
            await client.jetstream().delete_stream(name)
    finally:
        await client.close()


@contextmanager
def nats_stream() -> Iterator[Stream]:
    """A :class:`Stream` (60 s duplicate window) and its dead-letter stream, deleted afterwards."""
    tag = uuid.uuid4().hex[:10].upper()
    names = (f"SGC{tag}", f"SGC{tag}DEAD")
    try:
        asyncio.run(_add(names))
    except Exception as error:  # NoServersError, OSError, no JetStream
        _unavailable(f"NATS JetStream at {NATS_URL}", error)
        raise
    try:
        yield Stream(*names)
    finally:
        asyncio.run(_delete(names))


# -- Redis Streams ------------------------------------------------------------


@contextmanager
def redis_stream() -> Iterator[tuple[Any, str]]:
    """A redis client and a unique stream name; the stream and its ``:dead`` stream are deleted after."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError as error:
        client.close()
        _unavailable(f"Redis at {REDIS_URL}", error)
        raise
    name = f"sgc-{uuid.uuid4().hex[:10]}"
    try:
        yield client, name
    finally:
        client.delete(name, f"{name}:dead")
        client.close()
