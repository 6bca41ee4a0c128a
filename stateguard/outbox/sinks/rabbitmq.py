"""Outbox sinks publishing to RabbitMQ: :class:`RabbitMQSink` (pika), :class:`AsyncRabbitMQSink` (aio-pika).

Each event becomes one persistent message (``delivery_mode=2``) published
with ``mandatory=True`` on a channel in publisher-confirm mode; the batch
counts as published only once the broker confirmed every message of it.  An
unroutable message (``basic.return``), a ``basic.nack`` or a connection lost
before the confirmation raise :class:`~stateguard.PublishFailed`, so the
relay publishes the events again, and a queue may hold a message twice with
one ``message_id``: consumers deduplicate on it (``consume_once``).  The
message carries its event: ``message_id`` (the event id), ``type`` (the
topic), ``content_type`` ``application/json`` (the body is
:meth:`~stateguard.OutboxEvent.payload_json`), ``timestamp`` and the headers
``key`` and ``created_ms``.  The routing key is the topic, a fixed
``routing_key``, or the event's key with ``key_as_routing_key=True``.  The
sinks never declare exchanges, queues or bindings; a missing exchange is a
:class:`~stateguard.ConfigurationError` when the sink connects.  pika and
aio-pika (the ``stateguard[rabbitmq]`` extra) are imported only by this
module.  See ``docs/how-to/outbox.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import parse_qs, urlsplit

from ...exceptions import ConfigurationError, InvalidArgument, PublishFailed

if TYPE_CHECKING:
    from .. import OutboxEvent

__all__ = ["AsyncRabbitMQSink", "RabbitMQSink"]

#: The longest exchange name, routing key or ``type`` AMQP carries (a short string: 255 UTF-8 bytes).
MAX_SHORT_STRING: Final = 255
#: The ``delivery_mode`` of a persistent message: written to disk by a durable queue.
PERSISTENT: Final = 2
CONTENT_TYPE: Final = "application/json"


def _short_string(value: Any, what: str, *, blank: bool) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be a str, got {type(value).__name__}")
    if not blank and not value:
        raise InvalidArgument(f"{what} must not be empty")
    if len(value.encode("utf-8", "surrogatepass")) > MAX_SHORT_STRING:
        raise InvalidArgument(
            f"{what} is longer than {MAX_SHORT_STRING} UTF-8 bytes (AMQP's limit): {value!r}"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(f"{what} is not valid UTF-8 (a lone surrogate): {value!r}") from None
    return value


def _check_url(url: Any, sink: str) -> str:
    if not isinstance(url, str) or urlsplit(url).scheme not in ("amqp", "amqps"):
        raise InvalidArgument(f"{sink} needs an AMQP URL (amqp://user:password@host:5672/vhost), got {url!r}")
    return url


def _shown_url(url: str) -> str:
    """``url`` with its password hidden, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=f"{parts.username or ''}:***@{host}").geturl()


class _TooLong(Exception):
    """An event's topic or routing key does not fit AMQP's short string: a refusal of that event."""


class _Options:
    """What both faces share: where to publish, how an event becomes a message, the errors they raise."""

    def __init__(
        self, url: Any, sink: str, exchange: Any, routing_key: Any, key_as_routing_key: Any, timeout: Any
    ) -> None:
        self.url = _check_url(url, sink)
        self.sink = sink
        self.exchange = _short_string(exchange, "exchange", blank=True)
        if routing_key is not None:
            routing_key = _short_string(routing_key, "routing_key", blank=True)
            if key_as_routing_key:
                raise InvalidArgument("pass routing_key or key_as_routing_key=True, not both")
        self.routing_key: str | None = routing_key
        self.key_as_routing_key = bool(key_as_routing_key)
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout < float("inf")
        ):
            raise InvalidArgument(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.timeout = float(timeout)

    def route(self, event: OutboxEvent) -> str:
        """The routing key of ``event``; :class:`_TooLong` when it does not fit AMQP's 255 bytes."""
        if self.routing_key is not None:
            return self.routing_key
        key = event.key if self.key_as_routing_key and event.key is not None else event.topic
        if len(key.encode("utf-8")) > MAX_SHORT_STRING:
            raise _TooLong(
                f"its routing key {key[:40]!r}... is longer than {MAX_SHORT_STRING} UTF-8 bytes "
                f"(AMQP's limit): pass routing_key="
            )
        return key

    def message(self, event: OutboxEvent) -> tuple[bytes, dict[str, Any], str]:
        """``(body, properties, routing key)`` of ``event``'s message, the properties as keywords of
        pika's ``BasicProperties`` and aio-pika's ``Message`` alike; :class:`_TooLong` for a topic or
        routing key AMQP cannot carry."""
        if len(event.topic.encode("utf-8")) > MAX_SHORT_STRING:
            raise _TooLong(
                f"its topic is longer than {MAX_SHORT_STRING} UTF-8 bytes, what AMQP's type property "
                f"holds: relay such topics to another sink (topics=)"
            )
        headers: dict[str, Any] = {"created_ms": event.created_ms}
        if event.key is not None:
            headers["key"] = event.key
        properties = {
            "content_type": CONTENT_TYPE,
            "delivery_mode": PERSISTENT,
            "message_id": str(event.id),
            "type": event.topic,
            "timestamp": event.created_ms // 1000,
            "headers": headers,
        }
        return event.payload_json().encode("utf-8"), properties, self.route(event)

    def unconfirmed(
        self, events: Sequence[OutboxEvent], failed: Sequence[int], why: str, refused: Sequence[int] = ()
    ) -> PublishFailed:
        """The error for a batch whose events ``failed`` (ids) the broker did not confirm, of which it
        refused ``refused`` outright (the others are unconfirmed or unsent)."""
        return PublishFailed(
            f"RabbitMQ at {_shown_url(self.url)} (exchange {self.exchange!r}) did not confirm "
            f"outbox event {failed[0]} ({why}); {len(failed)} of the batch's {len(events)} events "
            f"failed: the batch is not published",
            event_ids=tuple(failed),
            refused_ids=tuple(refused),
        )

    def too_long(self, events: Sequence[OutboxEvent], done: int, error: _TooLong) -> PublishFailed:
        """The error for ``events[done]``, which no AMQP message can carry (the later ones are unsent)."""
        return self.unconfirmed(
            events, _from(events, done), f"refused before sending: {error}", (events[done].id,)
        )

    def unreachable(self, error: BaseException) -> PublishFailed:
        return PublishFailed(
            f"cannot connect to RabbitMQ at {_shown_url(self.url)}: {type(error).__name__}: {error}"
        )

    def no_channel(self, error: BaseException) -> PublishFailed:
        return PublishFailed(f"cannot open a channel on RabbitMQ at {_shown_url(self.url)}: {error}")

    def missing_exchange(self, error: BaseException) -> ConfigurationError:
        return ConfigurationError(
            f"RabbitMQ at {_shown_url(self.url)} has no exchange {self.exchange!r} ({error}): "
            f"declare it (and bind a queue to it) before the relay publishes"
        )


class _Face:
    """What :class:`RabbitMQSink` and :class:`AsyncRabbitMQSink` share beside their client."""

    _options: _Options

    @property
    def exchange(self) -> str:
        """The exchange messages are published to."""
        return self._options.exchange

    def __repr__(self) -> str:
        return f"{self._options.sink}({_shown_url(self._options.url)!r}, exchange={self._options.exchange!r})"


class RabbitMQSink(_Face):
    """A :class:`~stateguard.outbox.Sink` publishing to RabbitMQ with pika, for :class:`~stateguard.Relay`.

    ::

        sink = RabbitMQSink("amqp://guest:guest@127.0.0.1:5672/%2F", exchange="orders")
        sink.connect()                       # optional: fail now on a bad URL or a missing exchange
        relay = Relay(engine, sink)
        relay.run(stop_event)
        sink.close()

    See the module docstring for the message's properties.  The sink opens
    its connection on the first :meth:`publish` (or :meth:`connect`) and
    opens it again after it was lost.  Each message waits for its
    confirmation before the next is sent (pika's blocking channel): about
    one network round trip per event; :class:`AsyncRabbitMQSink` pipelines
    them.  Relays in several threads may share one sink: their batches take
    turns.  A broker that stops answering is noticed by AMQP heartbeats
    (``?heartbeat=10`` in the URL; the broker proposes 60 s); the URL's
    other pika options (``connection_attempts``, ``blocked_connection_timeout``
    ...) apply too.

    :param url: an ``amqp://`` or ``amqps://`` URL (the vhost ``/`` is ``%2F``).
    :param exchange: the exchange to publish to; ``""``, the default
        exchange, routes to the queue named by the routing key.
    :param routing_key: one routing key for every message (default: the topic).
    :param key_as_routing_key: route each message by its event's key.
    :param timeout: seconds to connect (socket and AMQP handshake).
    :raises InvalidArgument: a URL that is not ``amqp://``, an exchange or
        routing key longer than 255 UTF-8 bytes, both ``routing_key`` and
        ``key_as_routing_key``, a timeout that is not a positive number.
    """

    def __init__(
        self,
        url: str,
        *,
        exchange: str = "",
        routing_key: str | None = None,
        key_as_routing_key: bool = False,
        timeout: float = 10.0,
    ) -> None:
        self._options = _Options(url, "RabbitMQSink", exchange, routing_key, key_as_routing_key, timeout)
        try:
            import pika
        except ImportError as error:
            raise ImportError(
                "RabbitMQSink needs the pika package: pip install 'stateguard[rabbitmq]'"
            ) from error
        try:
            self._parameters = pika.URLParameters(url)
        except Exception as error:  # pika raises ValueError, KeyError ... for a bad query
            raise InvalidArgument(f"not a usable AMQP URL: {_shown_url(url)!r} ({error})") from error
        query = parse_qs(urlsplit(url).query)
        if "socket_timeout" not in query:
            self._parameters.socket_timeout = self._options.timeout
        if "stack_timeout" not in query:
            self._parameters.stack_timeout = self._options.timeout
        if "blocked_connection_timeout" not in query:
            # A broker under a memory or disk alarm blocks publishers: give up on the batch (retried).
            self._parameters.blocked_connection_timeout = 60.0
        self._connection: Any = None
        self._channel: Any = None
        self._lock = threading.Lock()

    def connect(self) -> None:
        """Open the connection now (it is opened by the first :meth:`publish` otherwise).

        :raises PublishFailed: the broker cannot be reached or refused the login.
        :raises ConfigurationError: the exchange does not exist.
        """
        with self._lock:
            self._open()

    def probe(self) -> None:
        """Return when the broker answers on the sink's connection (a new one if it was lost).

        A relay asks this when the sink refused an event and nothing else
        told whether the broker works (see :class:`~stateguard.Relay`).

        :raises PublishFailed: the broker cannot be reached.
        :raises ConfigurationError: the exchange does not exist.
        """
        with self._lock:
            self._open()

    def publish(self, events: Sequence[OutboxEvent]) -> None:
        """Publish ``events`` in order; return once the broker confirmed every message.

        :raises PublishFailed: a message was unroutable or nacked (its event
            in ``refused_ids``), or the connection was lost (the relay
            publishes the batch again).
        :raises ConfigurationError: the exchange does not exist.
        """
        from pika import BasicProperties
        from pika.exceptions import AMQPError, ChannelClosedByBroker, NackError, UnroutableError

        options = self._options
        with self._lock:
            channel = self._open()
            for done, event in enumerate(events):
                try:
                    body, properties, route = options.message(event)
                except _TooLong as error:
                    raise options.too_long(events, done, error) from None
                failed = _from(events, done)
                try:
                    channel.basic_publish(
                        options.exchange, route, body, BasicProperties(**properties), mandatory=True
                    )
                except UnroutableError as error:
                    raise options.unconfirmed(
                        events, failed, "unroutable: no queue is bound for it", failed[:1]
                    ) from error
                except NackError as error:
                    raise options.unconfirmed(events, failed, "the broker nacked it", failed[:1]) from error
                except (AMQPError, OSError) as error:
                    self._drop()
                    if _is_not_found(error):
                        raise options.missing_exchange(error) from error
                    # 406 PRECONDITION_FAILED on the publish: this message (its size, a header) is refused.
                    precondition = isinstance(error, ChannelClosedByBroker) and _code(error) == 406
                    refused = failed[:1] if precondition else []
                    raise options.unconfirmed(
                        events, failed, f"{type(error).__name__}: {error}", refused
                    ) from error

    def close(self) -> None:
        """Close the connection (a later :meth:`publish` opens a new one)."""
        with self._lock:
            connection, self._connection, self._channel = self._connection, None, None
            if connection is not None and connection.is_open:
                try:
                    connection.close()
                except Exception:  # already closed by the broker: nothing left to close
                    self._drop_socket(connection)

    def __enter__(self) -> RabbitMQSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> Any:  # a pika channel: pika ships no types
        """The channel, in confirm mode; a new connection if there is none or it was lost."""
        import pika
        from pika.exceptions import AMQPError

        if self._channel is not None:
            try:
                # Reads what arrived while the relay was idle: a connection the broker closed (or
                # one whose heartbeats were missed) shows here, before a batch is sent on it.
                self._connection.process_data_events(0)
                if self._channel.is_open:
                    return self._channel
            except (AMQPError, OSError):
                pass
            self._drop()
        options = self._options
        try:
            connection = pika.BlockingConnection(self._parameters)
        except (AMQPError, OSError) as error:
            raise options.unreachable(error) from error
        try:
            channel = connection.channel()
            if options.exchange:
                channel.exchange_declare(options.exchange, passive=True)
            channel.confirm_delivery()
        except (AMQPError, OSError) as error:
            self._drop_socket(connection)
            if _is_not_found(error):
                raise options.missing_exchange(error) from error
            raise options.no_channel(error) from error
        self._connection, self._channel = connection, channel
        return channel

    def _drop(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None:
            self._drop_socket(connection)

    @staticmethod
    def _drop_socket(connection: Any) -> None:
        try:
            if connection.is_open:
                connection.close()
        except Exception:  # a broken connection: pika may refuse to close it cleanly
            pass


def _from(events: Sequence[OutboxEvent], done: int) -> list[int]:
    """The ids of ``events[done:]``: the one that failed and those not sent after it."""
    return [e.id for e in events[done:]]


def _code(error: BaseException) -> Any:
    """The AMQP reply code a channel or connection was closed with (pika: the first argument)."""
    args: tuple[Any, ...] = tuple(getattr(error, "args", ()))
    return args[0] if args else None


def _is_not_found(error: BaseException) -> bool:
    """The broker closed the channel with 404 NOT_FOUND (no such exchange)."""
    return bool(_code(error) == 404)


class AsyncRabbitMQSink(_Face):
    """:class:`RabbitMQSink` on aio-pika, for :class:`~stateguard.AsyncRelay`: the same messages, awaited.

    ::

        sink = AsyncRabbitMQSink("amqp://guest:guest@127.0.0.1:5672/%2F", exchange="orders")
        relay = AsyncRelay(async_engine, sink)
        await relay.run(stop)
        await sink.close()

    A batch's messages are written in id order on one channel without
    waiting for each confirmation; :meth:`publish` returns once all of them
    are confirmed, or raises :class:`~stateguard.PublishFailed` for the
    first that is not (unroutable, nacked, not confirmed within
    ``timeout`` seconds, connection lost).  The connection is opened in the
    relay's event loop on the first publish, and again after it was lost.

    :raises InvalidArgument: as :class:`RabbitMQSink`.
    """

    def __init__(
        self,
        url: str,
        *,
        exchange: str = "",
        routing_key: str | None = None,
        key_as_routing_key: bool = False,
        timeout: float = 30.0,
    ) -> None:
        self._options = _Options(url, "AsyncRabbitMQSink", exchange, routing_key, key_as_routing_key, timeout)
        try:
            import aio_pika  # noqa: F401
        except ImportError as error:
            raise ImportError(
                "AsyncRabbitMQSink needs the aio-pika package: pip install 'stateguard[rabbitmq]'"
            ) from error
        self._connection: Any = None
        self._exchange: Any = None
        self._lock: asyncio.Lock | None = None

    async def connect(self) -> None:
        """Open the connection now; see :meth:`RabbitMQSink.connect`."""
        async with self._turn():
            await self._open()

    async def probe(self) -> None:
        """Return when the broker answers; see :meth:`RabbitMQSink.probe`."""
        async with self._turn():
            await self._open()

    async def publish(self, events: Sequence[OutboxEvent]) -> None:
        """Publish ``events`` in order; return once the broker confirmed every message.

        :raises PublishFailed: see the class docstring (the relay publishes the batch again).
        :raises ConfigurationError: the exchange does not exist.
        """
        import aio_pika
        from aio_pika.exceptions import DeliveryError, PublishError

        options = self._options
        async with self._turn():
            exchange = await self._open()
            messages = []
            for event in events:
                try:
                    body, properties, route = options.message(event)
                except _TooLong as error:
                    # Nothing of the batch was sent yet.
                    raise options.unconfirmed(
                        events, _from(events, 0), f"event {event.id} refused: {error}", (event.id,)
                    ) from None
                messages.append((aio_pika.Message(body, **properties), route))
            # gather starts the publishes in list order, and each takes the channel's lock (FIFO)
            # before it awaits anything: the frames go out in id order, the confirmations are awaited
            # together.
            results = await asyncio.gather(
                *(
                    exchange.publish(message, key, mandatory=True, timeout=options.timeout)
                    for message, key in messages
                ),
                return_exceptions=True,
            )
            failed = [(e.id, r) for e, r in zip(events, results, strict=True) if isinstance(r, BaseException)]
            if not failed:
                return
            first = failed[0][1]
            if any(isinstance(r, asyncio.CancelledError) for _, r in failed):
                raise asyncio.CancelledError()
            if isinstance(first, PublishError):
                why = "unroutable: no queue is bound for it"
            elif isinstance(first, DeliveryError):
                why = "the broker nacked it"
            else:
                why = f"{type(first).__name__}: {first}"
            refused = [i for i, r in failed if isinstance(r, PublishError | DeliveryError)]
            if len(refused) < len(failed):
                await self._drop()  # a lost connection or channel, a timeout: start afresh
            raise options.unconfirmed(events, [i for i, _ in failed], why, refused) from first

    async def close(self) -> None:
        """Close the connection (a later :meth:`publish` opens a new one)."""
        async with self._turn():
            await self._drop()

    async def __aenter__(self) -> AsyncRabbitMQSink:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _turn(self) -> asyncio.Lock:
        # Made on first use, inside the relay's event loop.
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    # Any: an aio_pika Exchange; its abstract type (AbstractExchange) lacks the .channel read below.
    async def _open(self) -> Any:
        import aio_pika
        from aio_pika.exceptions import ChannelNotFoundEntity

        if (
            self._exchange is not None
            and not self._connection.is_closed
            and not self._exchange.channel.is_closed
        ):
            return self._exchange
        await self._drop()
        options = self._options
        try:
            connection = await aio_pika.connect(options.url, timeout=options.timeout)
        except Exception as error:  # OSError, AMQPConnectionError, TimeoutError, a refused login ...
            raise options.unreachable(error) from error
        try:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            if options.exchange:
                exchange = await channel.get_exchange(options.exchange, ensure=True)
            else:
                exchange = channel.default_exchange
        except ChannelNotFoundEntity as error:
            await connection.close()
            raise options.missing_exchange(error) from error
        except Exception as error:
            await connection.close()
            raise options.no_channel(error) from error
        self._connection, self._exchange = connection, exchange
        return exchange

    async def _drop(self) -> None:
        connection, self._connection, self._exchange = self._connection, None, None
        if connection is not None and not connection.is_closed:
            with contextlib.suppress(Exception):  # a broken connection: nothing more to close
                await connection.close()
