"""A RabbitMQ queue consumer that applies each outbox event once: :class:`RabbitMQConsumer` (pika).

Each message is handled in one transaction with
:func:`~stateguard.consume_once` keyed by its AMQP ``message_id`` (the
outbox event id :class:`~stateguard.outbox.sinks.RabbitMQSink` sets),
committed, and only then acknowledged (``basic.ack``): a consumer killed
before the ack has its message redelivered, and the repeat is acknowledged
without running the handler.  A message whose handler failed is published
again to the back of its queue with the header ``x-stateguard-deliveries``
counting the failures (publisher-confirmed, then the original acked); after
``max_deliveries`` it is rejected without requeue (``basic.nack``), which
hands it to the queue's dead-letter exchange (``x-dead-letter-exchange``).
On a quorum queue RabbitMQ's own ``x-delivery-count`` counts too, crashed
consumers included.  pika (the ``stateguard[rabbitmq]`` extra) is imported
only by this module.  See ``docs/how-to/consumers.md``.
"""

from __future__ import annotations

import random
import threading
from typing import Any, Final

from ..exceptions import InvalidArgument
from ._core import (
    DEFAULT_MAX_DELIVERIES,
    MAX_BACKOFF,
    Handling,
    Message,
    Verdict,
    check_deliveries,
    check_name,
    log,
)
from ._core import serve as _serve

__all__ = ["RabbitMQConsumer"]


#: The header counting a message's failed deliveries (set on the copy published after a failure).
DELIVERIES_HEADER: Final = "x-stateguard-deliveries"
#: The header a quorum queue sets on a redelivered message: deliveries returned to the queue so far.
QUORUM_COUNT_HEADER: Final = "x-delivery-count"


def _shown(url: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    return parts._replace(netloc=f"{parts.username or ''}:***@{parts.netloc.rsplit('@', 1)[1]}").geturl()


def counted_of(properties: Any) -> int:
    """The deliveries before this one that a header counted (ours after a failure, a quorum queue's)."""
    headers = getattr(properties, "headers", None) or {}
    counted = 0
    for name in (DELIVERIES_HEADER, QUORUM_COUNT_HEADER):
        value = headers.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > counted:
            counted = value
    return counted


def deliveries_of(properties: Any, redelivered: bool) -> int:
    """How often this message was delivered, this delivery included (from its headers)."""
    return max(counted_of(properties) + 1, 2 if redelivered else 1)


class RabbitMQConsumer:
    """Consume a RabbitMQ queue with pika; run ``handler(session, message)`` once per event id.

    ::

        def bill(session: Session, message: Message) -> None:
            session.add(Invoice(order_id=message.payload["order"]))

        consumer = RabbitMQConsumer(
            engine, bill, "amqp://guest:guest@127.0.0.1:5672/%2F", queue="billing", consumer="billing"
        )
        sys.exit(consumer.serve())            # until SIGTERM: finishes the message in hand, exits 0

    Declare the queue yourself, durable, with a dead-letter exchange
    (``arguments={"x-dead-letter-exchange": "dead"}``): a message rejected
    after ``max_deliveries`` failures goes there, and a queue without one
    drops it.  ``prefetch`` messages are in flight per consumer (1 keeps a
    killed consumer's redelivery to one message).  Several consumers on one
    queue share it; RabbitMQ then keeps no order among them, and a failed
    message goes to the back of the queue.  The database being unreachable
    is waited out on the message in hand (not counted against it).  A lost
    broker connection is logged and opened again.

    :param bind: a synchronous Engine, or a sessionmaker.
    :param handler: ``handler(session, message)`` with a :class:`Message`
        (``id`` = ``message_id``, ``topic`` = the ``type`` property, ``key``
        = the ``key`` header).
    :param url: an ``amqp://`` or ``amqps://`` URL (pika's URL options apply).
    :param consumer: the name :func:`~stateguard.consume_once` records the
        ids under (default: the queue's name).
    :param poll: seconds between checks for :meth:`stop` while the queue is idle.
    :raises InvalidArgument: a bad URL, queue name or count.
    """

    def __init__(
        self,
        bind: Any,
        handler: Any,
        url: str,
        *,
        queue: str,
        consumer: str | None = None,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        prefetch: int = 1,
        poll: float = 0.5,
    ) -> None:
        self.queue = check_name(queue, "queue", 255)
        self._handling = Handling(bind, handler, queue if consumer is None else consumer, "RabbitMQConsumer")
        if not isinstance(url, str) or not url.startswith(("amqp://", "amqps://")):
            raise InvalidArgument(
                f"RabbitMQConsumer needs an AMQP URL (amqp://user:pass@host:5672/vhost), got {url!r}"
            )
        self.url = url
        self.max_deliveries = check_deliveries(max_deliveries)
        if type(prefetch) is not int or not 1 <= prefetch <= 65535:
            raise InvalidArgument(f"prefetch must be an int from 1 to 65535, got {prefetch!r}")
        self.prefetch = prefetch
        if isinstance(poll, bool) or not isinstance(poll, int | float) or not 0 < poll <= 60:
            raise InvalidArgument(f"poll must be a number of seconds in (0, 60], got {poll!r}")
        self.poll = float(poll)
        try:
            import pika
        except ImportError as error:
            raise ImportError(
                "RabbitMQConsumer needs the pika package: pip install 'stateguard[rabbitmq]'"
            ) from error
        try:
            self._parameters = pika.URLParameters(url)
        except Exception as error:  # pika raises ValueError, KeyError ... for a bad query
            raise InvalidArgument(f"not a usable AMQP URL: {_shown(url)!r} ({error})") from error
        #: How many messages this consumer acknowledged (handled now or before) and dead-lettered.
        self.handled = 0
        self.dead_lettered = 0
        self._connection: Any = None
        self._connected = False

    @property
    def consumer(self) -> str:
        """The name :func:`~stateguard.consume_once` records this queue's message ids under."""
        return self._handling.consumer

    def run(self, stop_event: threading.Event | None = None) -> None:
        """Consume until ``stop_event`` is set (or :meth:`stop` is called), then close the connection.

        The message in hand is committed and acknowledged first; prefetched
        messages not started go back to the queue::

            stop = threading.Event()
            threading.Thread(target=consumer.run, args=(stop,)).start()
            ...
            stop.set()
        """
        from pika.exceptions import AMQPError

        if stop_event is not None:
            self._handling.stop_event = stop_event
        stop = self._handling.stop_event
        pause = 0.05
        while not stop.is_set():
            self._connected = False
            try:
                self._consume(stop)
                pause = 0.05
            except (AMQPError, OSError) as error:
                self._drop()
                if stop.is_set():
                    break
                if self._connected:  # this connection worked: a new outage, whose backoff starts afresh
                    pause = 0.05
                log.warning(
                    "consumer %r: RabbitMQ at %s: %s: %s; connecting again in %.2f s",
                    self.consumer,
                    _shown(self.url),
                    type(error).__name__,
                    error,
                    pause,
                )
                stop.wait(pause * random.uniform(0.5, 1.0))  # jitter, not security
                pause = min(pause * 2, MAX_BACKOFF)
        self._drop()

    def serve(self) -> int:
        """:meth:`run` until SIGTERM or SIGINT, then return 0 (``sys.exit(consumer.serve())``).

        Call it from the main thread.
        """
        return _serve(self.run, self._handling.stop_event)

    def stop(self) -> None:
        """Ask :meth:`run` to return after the message in hand (from any thread or a signal handler)."""
        self._handling.stop_event.set()

    # -- the loop ------------------------------------------------------------

    def _consume(self, stop: threading.Event) -> None:
        import pika

        connection = self._connection = pika.BlockingConnection(self._parameters)
        channel = connection.channel()
        channel.confirm_delivery()  # the copy of a failed message is published confirmed
        channel.basic_qos(prefetch_count=self.prefetch)
        self._connected = True
        for method, properties, body in channel.consume(self.queue, inactivity_timeout=self.poll):
            if method is not None:
                self._handle(channel, method, properties, body)
            if stop.is_set():
                channel.cancel()  # prefetched messages not started go back to the queue
                break

    def _handle(self, channel: Any, method: Any, properties: Any, body: bytes) -> None:
        headers = properties.headers or {}
        deliveries = deliveries_of(properties, bool(method.redelivered))
        key = headers.get("key")
        sent_id = properties.message_id
        message = Message(
            id=sent_id if isinstance(sent_id, str) else "",
            body=body,
            topic=properties.type,
            key=key if isinstance(key, str) else None,
            deliveries=deliveries,
            raw=(method, properties),
        )
        # Counted deliveries only: the redelivered flag alone also marks a message given back
        # unstarted (a stop() with prefetched messages, a connection lost before its handler ran),
        # which must not be dead-lettered without running with max_deliveries=1.
        if counted_of(properties) + 1 > self.max_deliveries:
            self._dead_letter(channel, method, message, "delivered more often than max_deliveries")
            return
        if isinstance(sent_id, bytes):  # pika hands a short string that is not UTF-8 over as bytes
            self._dead_letter(channel, method, message, "its id is not UTF-8 text")
            return
        verdict = self._handling.handle(message, keep_alive=lambda: channel.connection.process_data_events(0))
        if verdict is Verdict.DONE:
            channel.basic_ack(method.delivery_tag)
            self.handled += 1
        elif verdict is Verdict.STOPPED:
            channel.basic_nack(method.delivery_tag, requeue=True)
        elif verdict is Verdict.UNUSABLE:
            self._dead_letter(channel, method, message, "its id cannot be recorded")
        elif deliveries >= self.max_deliveries:
            self._dead_letter(channel, method, message, "the handler failed")
        else:
            self._retry(channel, method, properties, body, deliveries)

    def _retry(self, channel: Any, method: Any, properties: Any, body: bytes, deliveries: int) -> None:
        """Publish the message again with its failures counted, then ack this delivery."""
        from pika import BasicProperties
        from pika.exceptions import NackError, UnroutableError

        headers = dict(properties.headers or {})
        headers[DELIVERIES_HEADER] = deliveries
        copy = BasicProperties(
            content_type=properties.content_type,
            content_encoding=properties.content_encoding,
            delivery_mode=properties.delivery_mode,
            message_id=properties.message_id,
            type=properties.type,
            timestamp=properties.timestamp,
            correlation_id=properties.correlation_id,
            reply_to=properties.reply_to,
            app_id=properties.app_id,
            headers=headers,
        )
        try:
            channel.basic_publish("", self.queue, body, copy, mandatory=True)
        except (NackError, UnroutableError) as error:
            # Not taken again: leave this delivery to RabbitMQ's requeue (counted on a quorum queue only).
            log.warning(
                "consumer %r: could not requeue message %s with its count: %s",
                self.consumer,
                properties.message_id,
                error,
            )
            channel.basic_nack(method.delivery_tag, requeue=True)
            return
        channel.basic_ack(method.delivery_tag)

    def _dead_letter(self, channel: Any, method: Any, message: Message, why: str) -> None:
        channel.basic_nack(method.delivery_tag, requeue=False)
        self.dead_lettered += 1
        log.error(
            "consumer %r: message %r rejected to queue %r's dead-letter exchange after %d deliveries: %s",
            self.consumer,
            message.id or getattr(message.raw[1], "message_id", None),
            self.queue,
            message.deliveries,
            why,
        )

    def _drop(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                if connection.is_open:
                    connection.close()
            except Exception:  # a broken connection: pika may refuse to close it cleanly
                pass

    def __repr__(self) -> str:
        return f"RabbitMQConsumer({_shown(self.url)!r}, queue={self.queue!r})"
