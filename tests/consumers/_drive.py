"""Driving a real consumer in the tests: publish to RabbitMQ or JetStream, run a consumer in a thread
until a condition holds, publish a JetStream message with header bytes no client library would send."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import urlsplit

from .._support.brokers import NATS_URL, Queue, Stream


class Runs(Protocol):
    """A RabbitMQConsumer or NATSConsumer: ``run(stop_event)`` until the event is set."""

    def run(self, stop_event: threading.Event | None = None) -> None: ...


def run_until(c: Runs, done: Callable[[], bool], timeout: float = 10, *, waiting_out: bool = False) -> None:
    """Run the consumer in a thread until ``done()`` holds, then stop it; an error ``run()`` raised
    is raised here, and ``done()`` still false at the timeout fails (unless ``waiting_out``)."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            c.run(stop)
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=work)
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline and thread.is_alive():
            time.sleep(0.02)
    finally:
        stop.set()
        thread.join(15)
    assert not thread.is_alive()
    if errors:
        raise errors[0]
    if not waiting_out:
        assert done(), f"not done within {timeout} s"


def run_for(c: Runs, seconds: float) -> None:
    """Run the consumer in a thread for ``seconds`` (whatever it meets meanwhile), then stop it."""
    run_until(c, lambda: False, timeout=seconds, waiting_out=True)


def publish_amqp(
    mq: Queue, message_id: Any, body: bytes = b"{}", headers: dict[str, Any] | None = None
) -> None:
    """One message to the queue's exchange with this ``message_id`` (a str, or None for none)."""
    import pika

    properties = pika.BasicProperties(message_id=message_id, type="t", headers=headers or {"key": "k"})
    mq.channel.basic_publish(mq.exchange, "t", body, properties)


def publish_nats(js: Stream, msg_id: str | None, body: bytes = b"{}", url: str = NATS_URL) -> None:
    """One message to the stream with this ``Nats-Msg-Id`` (None: no id header)."""

    async def send() -> None:
        import nats

        client = await nats.connect(url)
        try:
            headers = {"Outbox-Key": "k%2F1"} | ({"Nats-Msg-Id": msg_id} if msg_id is not None else {})
            await client.jetstream().publish(js.topic(), body, headers=headers)
        finally:
            await client.close()

    asyncio.run(send())


def publish_nats_bytes(js: Stream, header_lines: bytes, body: bytes = b"{}", url: str = NATS_URL) -> None:
    """One message to the stream whose header block is ``header_lines`` as given (``Name: value``
    lines joined by CRLF, any bytes): sent with the wire protocol's HPUB, then confirmed stored."""
    parts = urlsplit(url)
    before = len(js.messages())
    block = b"NATS/1.0\r\n" + header_lines + b"\r\n\r\n"
    with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 4222), timeout=5) as sock:
        reader = sock.makefile("rb")
        assert reader.readline().startswith(b"INFO ")
        sock.sendall(b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"no_responders":true}\r\n')
        subject = js.topic().encode()
        sock.sendall(
            b"HPUB %s %d %d\r\n%s%s\r\nPING\r\n" % (subject, len(block), len(block) + len(body), block, body)
        )
        line = reader.readline()
        assert line == b"PONG\r\n", line
    deadline = time.monotonic() + 5
    while len(js.messages()) == before:
        assert time.monotonic() < deadline, "JetStream did not store the message"
        time.sleep(0.05)
