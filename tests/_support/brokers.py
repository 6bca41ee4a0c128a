"""The brokers of the sink and consumer tests: private RabbitMQ exchanges and queues, JetStream streams
and Redis streams, each deleted afterwards.

The brokers run on every machine of the project (RabbitMQ 127.0.0.1:5672 guest/guest, NATS with
JetStream 127.0.0.1:4222, Redis 6379); one that cannot be reached skips its tests on a laptop and
fails them under ``CI=true`` (``tests.conftest.unavailable``).  Used by tests/outbox/sinks/,
tests/consumers/, tests/brokers/ and its worker processes (which is why ``tests.conftest`` is
imported only when a broker is missing).
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

RABBITMQ_URL = os.environ.get("STATEGUARD_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
NATS_URL = os.environ.get("STATEGUARD_NATS_URL", "nats://127.0.0.1:4222")
REDIS_URL = os.environ.get("STATEGUARD_REDIS_URL", "redis://127.0.0.1:6379/0")
RABBITMQ_PORT = 5672
NATS_PORT = 4222


def via(url: str, port: int, proxy_port: int) -> str:
    """``url`` with its port replaced by the fault proxy's."""
    return url.replace(f":{port}", f":{proxy_port}", 1)


def _unavailable(what: str, error: BaseException) -> NoReturn:
    from tests.conftest import unavailable

    unavailable(what, error)
    raise error  # unavailable() skips or fails; this line is for the type checker


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


@dataclass(frozen=True)
class Delivered:
    """One message read back from a queue."""

    routing_key: str
    properties: Any
    body: bytes

    @property
    def payload(self) -> Any:
        return json.loads(self.body)


@dataclass
class Queue:
    """A topic exchange bound (``#``) to a durable queue whose dead letters go to ``dead_queue``; and
    ``unbound_exchange``, a topic exchange no queue is bound to."""

    channel: Any
    exchange: str
    queue: str
    dead_queue: str
    unbound_exchange: str

    def drain(self, queue: str | None = None) -> list[Delivered]:
        """Every message of ``queue`` (default: the main queue) in queue order, acknowledged."""
        got = []
        while True:
            method, properties, body = self.channel.basic_get(queue or self.queue, auto_ack=True)
            if method is None:
                return got
            got.append(Delivered(method.routing_key, properties, body))

    def count(self, queue: str | None = None) -> int:
        """Messages ready in ``queue`` (default: the main queue)."""
        return int(self.channel.queue_declare(queue or self.queue, passive=True).method.message_count)


@contextmanager
def rabbit_queue(*, dead_letters: bool = True, quorum: bool = False) -> Iterator[Queue]:
    """A :class:`Queue` with unique names, deleted afterwards.

    ``dead_letters=False``: the queue is declared without arguments (what a Celery worker declares
    for itself), its dead letters are dropped.  ``quorum=True``: a quorum queue (RabbitMQ counts
    every return to it in the ``x-delivery-count`` header).
    """
    import pika

    try:
        connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))
    except Exception as error:  # AMQPConnectionError, OSError
        _unavailable(f"RabbitMQ at {RABBITMQ_URL}", error)
    tag = uuid.uuid4().hex[:10]
    box = Queue(connection.channel(), f"sgt-{tag}", f"sgt-{tag}-q", f"sgt-{tag}-dead", f"sgt-{tag}-unbound")
    dlx = f"sgt-{tag}-dlx"
    try:
        ch = box.channel
        ch.exchange_declare(box.exchange, "topic")
        ch.exchange_declare(box.unbound_exchange, "topic")
        ch.exchange_declare(dlx, "fanout")
        ch.queue_declare(box.dead_queue, durable=True)
        ch.queue_bind(box.dead_queue, dlx)
        arguments: dict[str, Any] | None = {"x-dead-letter-exchange": dlx} if dead_letters else None
        if quorum:
            arguments = (arguments or {}) | {"x-queue-type": "quorum"}
        ch.queue_declare(box.queue, durable=True, arguments=arguments)
        ch.queue_bind(box.queue, box.exchange, "#")
        yield box
    finally:
        with _closing(connection) as ch:
            for name in (box.queue, box.dead_queue):
                ch.queue_delete(name)
            for name in (box.exchange, box.unbound_exchange, dlx):
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
    """A stream taking ``<name>.>`` and a dead-letter stream taking ``<dead_name>.>``."""

    name: str
    dead_name: str
    duplicate_window: float
    url: str = NATS_URL

    @property
    def subject(self) -> str:
        """A subject of the main stream."""
        return f"{self.name}.events"

    @property
    def dead_subject(self) -> str:
        """A subject of the dead-letter stream."""
        return f"{self.dead_name}.letters"

    def topic(self, suffix: str = "paid") -> str:
        """An outbox topic that is a subject of the stream."""
        return f"{self.name}.{suffix}"

    def messages(self, stream: str | None = None) -> list[Any]:
        """Every stored message of ``stream`` (default: the main one), in stream order
        (``.headers``, ``.data``, ``.subject``, ``.seq``)."""
        return asyncio.run(_read(stream or self.name, self.url))


async def _client(url: str = NATS_URL) -> Any:
    import nats

    return await nats.connect(url, connect_timeout=3, max_reconnect_attempts=0)


async def _read(name: str, url: str) -> list[Any]:
    client = await _client(url)
    try:
        js = client.jetstream()
        info = await js.stream_info(name)
        if info.state.messages == 0:
            return []
        return [await js.get_msg(name, seq) for seq in range(info.state.first_seq, info.state.last_seq + 1)]
    finally:
        await client.close()


async def _add(names: tuple[str, str], duplicate_window: float, url: str) -> None:
    from nats.js.api import StreamConfig

    client = await _client(url)
    try:
        for name in names:
            await client.jetstream().add_stream(
                StreamConfig(name=name, subjects=[f"{name}.>"], duplicate_window=duplicate_window)
            )
    finally:
        await client.close()


async def _delete(names: tuple[str, str], url: str) -> None:
    client = await _client(url)
    try:
        for name in names:
            await client.jetstream().delete_stream(name)
    finally:
        await client.close()


@contextmanager
def nats_stream(duplicate_window: float = 60.0, url: str = NATS_URL) -> Iterator[Stream]:
    """A :class:`Stream` with this duplicate window (seconds) and its dead-letter stream, on the
    server at ``url``; both deleted afterwards."""
    tag = uuid.uuid4().hex[:10].upper()
    names = (f"SGT{tag}", f"SGT{tag}DEAD")
    try:
        asyncio.run(_add(names, duplicate_window, url))
    except Exception as error:  # NoServersError, OSError, no JetStream
        _unavailable(f"NATS JetStream at {url}", error)
    try:
        yield Stream(*names, duplicate_window=duplicate_window, url=url)
    finally:
        asyncio.run(_delete(names, url))


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
    name = f"sgt-{uuid.uuid4().hex[:10]}"
    try:
        yield client, name
    finally:
        client.delete(name, f"{name}:dead")
        client.close()
