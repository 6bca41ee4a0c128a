"""RabbitMQ and NATS JetStream for the sink tests: private exchanges, queues and streams, deleted afterwards.

The brokers run on every machine of the project (RabbitMQ 127.0.0.1:5672 guest/guest, NATS with
JetStream 127.0.0.1:4222); one that cannot be reached skips its tests on a laptop and fails them
under ``CI=true`` (``conftest.unavailable``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, select

from stateguard import PublishFailed, Relay
from stateguard.tables import outbox

from ...conftest import unavailable

RABBITMQ_URL = os.environ.get("STATEGUARD_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
NATS_URL = os.environ.get("STATEGUARD_NATS_URL", "nats://127.0.0.1:4222")
RABBITMQ_PORT = 5672
NATS_PORT = 4222


def via(url: str, port: int, proxy_port: int) -> str:
    """``url`` with its port replaced by the fault proxy's."""
    return url.replace(f":{port}", f":{proxy_port}", 1)


# -- running a relay to the end ----------------------------------------------


def outbox_rows(engine: Engine) -> dict[int, Any]:
    """Every outbox row by id."""
    with engine.connect() as conn:
        return {r.id: r for r in conn.execute(select(outbox))}


def drain_relay(relay: Relay) -> int:
    """Run the relay until a cycle publishes nothing; how many it published."""
    total = 0
    while (published := relay.run_once()) > 0:
        total += published
    return total


def publish_all(relay: Relay, engine: Engine) -> None:
    """Run the relay until every event is marked published (a batch the sink refused comes again)."""
    deadline = time.monotonic() + 60
    while any(r.published_ms is None for r in outbox_rows(engine).values()):
        assert time.monotonic() < deadline, "the relay did not publish every event within 60 s"
        with contextlib.suppress(PublishFailed):
            if relay.run_once() == 0:
                time.sleep(0.1)


# -- RabbitMQ --------------------------------------------------------------


@dataclass
class Delivered:
    """One message read back from a queue."""

    routing_key: str
    properties: Any
    body: bytes

    @property
    def payload(self) -> Any:
        return json.loads(self.body)


class Rabbit:
    """A private topic exchange with a queue bound to every routing key (``#``), on a pika channel."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        tag = uuid.uuid4().hex[:10]
        self.exchange = f"sgtest-{tag}"
        self.queue = f"sgtest-{tag}-q"
        self.unbound_exchange = f"sgtest-{tag}-unbound"
        channel.exchange_declare(self.exchange, "topic")
        channel.exchange_declare(self.unbound_exchange, "topic")
        channel.queue_declare(self.queue, durable=True)
        channel.queue_bind(self.queue, self.exchange, "#")

    def drain(self) -> list[Delivered]:
        """Every message in the queue, in queue order (acknowledged: the queue is empty afterwards)."""
        got = []
        while True:
            method, properties, body = self.channel.basic_get(self.queue, auto_ack=True)
            if method is None:
                return got
            got.append(Delivered(method.routing_key, properties, body))

    def delete(self) -> None:
        self.channel.queue_delete(self.queue)
        self.channel.exchange_delete(self.exchange)
        self.channel.exchange_delete(self.unbound_exchange)


@contextmanager
def rabbit() -> Iterator[Rabbit]:
    """A :class:`Rabbit`, deleted afterwards."""
    import pika

    try:
        connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))
    except Exception as error:  # AMQPConnectionError, OSError
        unavailable(f"RabbitMQ at {RABBITMQ_URL}", error)
    try:
        box = Rabbit(connection.channel())
        try:
            yield box
        finally:
            box.delete()
    finally:
        connection.close()


# -- NATS JetStream ----------------------------------------------------------


class Stream:
    """A private JetStream stream taking the subjects ``<name>.>``; read with :meth:`messages`."""

    def __init__(self, name: str, duplicate_window: float) -> None:
        self.name = name
        self.duplicate_window = duplicate_window
        self.subject = f"{name}.events"

    def topic(self, suffix: str = "paid") -> str:
        """An outbox topic that is a subject of this stream."""
        return f"{self.name}.{suffix}"

    def messages(self) -> list[Any]:
        """Every stored message, in stream order (``.headers``, ``.data``, ``.subject``, ``.seq``)."""

        async def read() -> list[Any]:
            import nats

            client = await nats.connect(NATS_URL)
            try:
                js = client.jetstream()
                info = await js.stream_info(self.name)
                first, last = info.state.first_seq, info.state.last_seq
                if info.state.messages == 0:
                    return []
                return [await js.get_msg(self.name, seq) for seq in range(first, last + 1)]
            finally:
                await client.close()

        return asyncio.run(read())


async def _add_stream(name: str, duplicate_window: float) -> None:
    import nats
    from nats.js.api import StreamConfig

    client = await nats.connect(NATS_URL, connect_timeout=3, max_reconnect_attempts=0)
    try:
        await client.jetstream().add_stream(
            StreamConfig(name=name, subjects=[f"{name}.>"], duplicate_window=duplicate_window)
        )
    finally:
        await client.close()


async def _delete_stream(name: str) -> None:
    import nats

    client = await nats.connect(NATS_URL)
    try:
        await client.jetstream().delete_stream(name)
    finally:
        await client.close()


@contextmanager
def stream(duplicate_window: float = 60.0) -> Iterator[Stream]:
    """A private stream with this duplicate window (seconds), deleted afterwards."""
    name = f"SGTEST{uuid.uuid4().hex[:10]}"
    try:
        asyncio.run(_add_stream(name, duplicate_window))
    except Exception as error:  # NoServersError, OSError, no JetStream
        unavailable(f"NATS JetStream at {NATS_URL}", error)
    try:
        yield Stream(name, duplicate_window)
    finally:
        asyncio.run(_delete_stream(name))
