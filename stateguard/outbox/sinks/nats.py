"""Outbox sinks that publish to NATS JetStream: :class:`AsyncNATSSink` and :class:`NATSSink` (nats-py).

Each event becomes one JetStream message whose header ``Nats-Msg-Id`` is the
event id (after ``msg_id_prefix``), on the event's topic (or a fixed
``subject``), with the data :meth:`~stateguard.OutboxEvent.payload_json` and
the headers ``Outbox-Topic``, ``Outbox-Key``, ``Outbox-Created-Ms`` and
``Content-Type`` (topic and key percent-encoded).  JetStream stores a message
whose id it already holds only once while the first copy is younger than the
stream's ``duplicate_window``, so a batch published again after a lost PubAck
lands once; the sink awaits every PubAck and raises
:class:`~stateguard.PublishFailed` for the first missing or failed one.  Past
the window a copy is stored again, so the sinks take the relay's ``lease``
and refuse (:class:`~stateguard.ConfigurationError` when they connect) one
longer than the window; every message is published with the expected stream,
so it never lands in a stream whose window was not checked.  nats-py is
asyncio only: :class:`NATSSink`, for :class:`~stateguard.Relay`, runs an
:class:`AsyncNATSSink` in an event loop of its own, in a daemon thread.
nats-py (the ``stateguard[nats]`` extra) is imported only by this module.
See ``docs/how-to/outbox.md``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final, TypeVar
from urllib.parse import quote

from ... import _kernel
from ...exceptions import ConfigurationError, InvalidArgument, PublishFailed

if TYPE_CHECKING:
    from nats.js import JetStreamContext

    from .. import OutboxEvent

__all__ = ["AsyncNATSSink", "NATSSink"]

T = TypeVar("T")

#: JetStream's duplicate window when a stream does not set one (seconds).
DEFAULT_DUPLICATE_WINDOW: Final = 120.0
#: The longest stream name JetStream takes; also the limit here for a subject prefix.
MAX_NAME: Final = 255
CONTENT_TYPE: Final = "application/json"


def _check_subject(subject: str, what: str) -> str:
    """A literal NATS subject: dot-separated tokens, none empty, no whitespace, no wildcard."""
    tokens = subject.split(".")
    if not subject or any(not t or t in ("*", ">") for t in tokens) or any(c.isspace() for c in subject):
        raise InvalidArgument(
            f"{what} {subject!r} is not a NATS subject to publish to: dot-separated tokens, "
            "none empty, no whitespace and no * or > wildcard"
        )
    return subject


def _check_stream(stream: Any) -> str:
    if not isinstance(stream, str) or not stream or len(stream) > MAX_NAME:
        raise InvalidArgument(f"stream must be the name of a JetStream stream, got {stream!r}")
    if any(c.isspace() or c in ".*>/\\" for c in stream):
        raise InvalidArgument(f"stream {stream!r}: JetStream stream names hold no whitespace, . * > / or \\")
    return stream


def _servers(servers: Any) -> list[str]:
    urls = [servers] if isinstance(servers, str) else list(servers) if servers is not None else []
    if not urls or not all(
        isinstance(u, str) and u.startswith(("nats://", "tls://", "ws://", "wss://")) for u in urls
    ):
        raise InvalidArgument(
            f"servers must be a NATS URL or a list of them (nats://127.0.0.1:4222), got {servers!r}"
        )
    return urls


#: How often nats-py tries each server again before the client gives up (about a second apart).
_RECONNECTS: Final = 3

log = logging.getLogger("stateguard.outbox")


async def _log_error(error: Exception) -> None:
    """nats-py's connection errors, logged once each without a traceback (they are retried)."""
    log.warning("NATS sink: %s: %s", type(error).__name__, error)


def _acked(future: asyncio.Future[Any]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


def _is_refusal(error: BaseException) -> bool:
    """JetStream answered this message with an error of its own (a 4xx API error: a bad header, a
    full stream with DiscardNew, ...), not that it is unavailable (503) or failing (5xx)."""
    from nats.js.errors import APIError, ServerError, ServiceUnavailableError

    return isinstance(error, APIError) and not isinstance(error, ServerError | ServiceUnavailableError)


class AsyncNATSSink:
    """A :class:`~stateguard.outbox.Sink` publishing to JetStream, for :class:`~stateguard.AsyncRelay`.

    ::

        sink = AsyncNATSSink("nats://127.0.0.1:4222", stream="ORDERS", lease=timedelta(seconds=30))
        relay = AsyncRelay(async_engine, sink, lease=timedelta(seconds=30))   # the same lease
        await relay.run(stop)
        await sink.close()

    The messages of a batch are sent in id order without waiting, then every
    PubAck is awaited (``timeout`` seconds for the lot).  The sink connects on
    the first publish (or :meth:`connect`), in the relay's event loop; nats-py
    reconnects on its own after a lost connection.  See the module docstring
    for the message and for why ``lease`` must not exceed the stream's
    duplicate window.

    :param servers: a NATS URL or a list of them.
    :param stream: the JetStream stream the subjects belong to (it must exist).
    :param lease: the ``lease`` of the relays using this sink.
    :param subject: one subject for every message (default: each event's topic).
    :param msg_id_prefix: put before the event id in ``Nats-Msg-Id``: give each
        outbox table that publishes into one stream its own (their ids overlap).
    :param timeout: seconds to connect, and to wait for a batch's PubAcks.
    :raises InvalidArgument: a bad URL, stream name, subject, lease or timeout.
    """

    def __init__(
        self,
        servers: str | Sequence[str],
        *,
        stream: str,
        lease: timedelta,
        subject: str | None = None,
        msg_id_prefix: str = "",
        timeout: float = 10.0,
    ) -> None:
        self.servers = _servers(servers)
        self.stream = _check_stream(stream)
        self.lease = timedelta(milliseconds=_kernel.duration_ms(lease, "lease"))
        self.subject = (
            None
            if subject is None
            else _check_subject(_kernel.check_text(subject, "subject", MAX_NAME), "subject")
        )
        if not isinstance(msg_id_prefix, str) or any(c in "\r\n" for c in msg_id_prefix):
            raise InvalidArgument(f"msg_id_prefix must be a str without line breaks, got {msg_id_prefix!r}")
        self.msg_id_prefix = msg_id_prefix
        self.timeout = _kernel.required_seconds(timeout, "timeout")
        try:
            import nats  # noqa: F401
        except ImportError as error:
            raise ImportError(
                "NATS sinks need the nats-py package: pip install 'stateguard[nats]'"
            ) from error
        self._client: Any = None
        self._js: JetStreamContext | None = None
        self._lock: asyncio.Lock | None = None
        #: The stream's duplicate window (seconds), read when the sink connected.
        self.duplicate_window: float | None = None

    async def connect(self) -> None:
        """Connect now and check the stream (the first :meth:`publish` does otherwise).

        :raises PublishFailed: no NATS server could be reached.
        :raises ConfigurationError: the stream does not exist, or ``lease``
            is longer than its duplicate window.
        """
        async with self._turn():
            await self._open()

    async def probe(self) -> None:
        """Return when the NATS server answers a PING on the sink's connection (made if need be).

        A relay asks this when the sink refused an event and nothing else
        told whether the broker works (see :class:`~stateguard.Relay`).

        :raises PublishFailed: no NATS server could be reached or it did not answer in ``timeout``.
        :raises ConfigurationError: see :meth:`connect`.
        """
        async with self._turn():
            await self._open()
            try:
                await self._client.flush(self.timeout)
            except Exception as error:  # FlushTimeoutError, ConnectionClosedError ...
                raise PublishFailed(
                    f"NATS at {self.servers} did not answer a PING: {type(error).__name__}: {error}"
                ) from error

    async def publish(self, events: Sequence[OutboxEvent]) -> None:
        """Publish ``events`` in order; return once JetStream acknowledged every message.

        A message JetStream reports as a duplicate (its ``Nats-Msg-Id`` is
        already in the stream) is acknowledged too: it is there.

        :raises PublishFailed: a PubAck failed (a JetStream error for that
            message, or a message larger than the server's max_payload: its
            event in ``refused_ids``) or did not come within ``timeout``.
        :raises ConfigurationError: see :meth:`connect`.
        """
        from nats.errors import MaxPayloadError

        async with self._turn():
            js = await self._open()
            futures: list[asyncio.Future[Any]] = []
            try:
                for event in events:
                    subject = self.subject or _check_subject(event.topic, f"outbox event {event.id}'s topic")
                    headers = {
                        "Nats-Msg-Id": f"{self.msg_id_prefix}{event.id}",
                        "Outbox-Topic": quote(event.topic, safe=""),
                        "Outbox-Created-Ms": str(event.created_ms),
                        "Content-Type": CONTENT_TYPE,
                    }
                    if event.key is not None:
                        headers["Outbox-Key"] = quote(event.key, safe="")
                    futures.append(
                        await js.publish_async(
                            subject,
                            event.payload_json().encode("utf-8"),
                            wait_stall=self.timeout,
                            stream=self.stream,
                            headers=headers,
                        )
                    )
                await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), self.timeout)
            except (InvalidArgument, MaxPayloadError) as error:
                # Refused before it was sent: this event, and nothing about the broker.
                why = (
                    f"{error}: set subject= or relay such topics to another sink (topics=)"
                    if isinstance(error, InvalidArgument)
                    else f"larger than the server's max_payload ({error})"
                )
                refused = events[len(futures)].id
                # The ones already sent may be stored: they come again, and JetStream drops the copies.
                for future in futures:
                    future.cancel()
                raise self._unconfirmed(
                    events, [e.id for e in events], f"event {refused} refused: {why}", (refused,)
                ) from error
            except BaseException as error:
                acked = [_acked(f) for f in futures]
                for future in futures:
                    future.cancel()  # frees nats-py's slot for it; a late PubAck is ignored
                if not isinstance(error, Exception):
                    raise  # a cancellation of the relay
                # The unacknowledged, and those not sent yet: none of them may count as published.
                failed = [e.id for e, ok in zip(events, acked, strict=False) if not ok]
                failed += [e.id for e in events[len(futures) :]]
                raise self._unconfirmed(events, failed, f"{type(error).__name__}: {error}") from error
            failures = [
                (e.id, asyncio.CancelledError() if f.cancelled() else f.exception())
                for e, f in zip(events, futures, strict=True)
            ]
            failed_ids = [(i, x) for i, x in failures if x is not None]
            if failed_ids:
                first = failed_ids[0][1]
                raise self._unconfirmed(
                    events,
                    [i for i, _ in failed_ids],
                    f"{type(first).__name__}: {first}",
                    [i for i, x in failed_ids if _is_refusal(x)],
                ) from first

    async def close(self) -> None:
        """Close the connection (a later :meth:`publish` opens a new one)."""
        async with self._turn():
            client, self._client, self._js = self._client, None, None
            if client is not None and not client.is_closed:
                await client.close()

    async def __aenter__(self) -> AsyncNATSSink:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.servers!r}, stream={self.stream!r})"

    def _unconfirmed(
        self, events: Sequence[OutboxEvent], failed: Sequence[int], why: str, refused: Sequence[int] = ()
    ) -> PublishFailed:
        """The error for a batch whose events ``failed`` (ids) JetStream did not acknowledge, of which
        it refused ``refused`` (the others are unacknowledged or unsent)."""
        return PublishFailed(
            f"JetStream stream {self.stream!r} did not acknowledge outbox event {failed[0]} ({why}); "
            f"{len(failed)} of the batch's {len(events)} events failed: the batch is not published "
            "(JetStream drops the copies it holds when it comes again)",
            event_ids=tuple(failed),
            refused_ids=tuple(refused),
        )

    def _turn(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def _open(self) -> JetStreamContext:
        import nats
        from nats.js.errors import NotFoundError

        if self._js is not None and not self._client.is_closed:
            return self._js
        try:
            client = await nats.connect(
                servers=self.servers,
                connect_timeout=self.timeout,
                # Bounded, also for the first connection (-1 retries it forever): a client that gave
                # up is closed, and the next publish makes a new one.
                max_reconnect_attempts=_RECONNECTS,
                reconnect_time_wait=1,
                error_cb=_log_error,
            )
        except Exception as error:  # NoServersError, OSError, TimeoutError ...
            raise PublishFailed(
                f"cannot connect to NATS at {self.servers}: {type(error).__name__}: {error}"
            ) from error
        try:
            js = client.jetstream(timeout=self.timeout)
            try:
                info = await js.stream_info(self.stream)
            except NotFoundError as error:
                raise ConfigurationError(
                    f"NATS JetStream has no stream {self.stream!r}: create it (with the subjects the "
                    f"relay publishes to and a duplicate_window longer than the relay's lease) first"
                ) from error
            window = float(info.config.duplicate_window or DEFAULT_DUPLICATE_WINDOW)
            lease = self.lease.total_seconds()
            if lease > window:
                raise ConfigurationError(
                    f"the relay's lease ({lease:g} s) is longer than the duplicate_window of the JetStream "
                    f"stream {self.stream!r} ({window:g} s): a batch published again after a relay died "
                    f"would be stored twice; shorten the lease or raise the stream's duplicate_window"
                )
        except BaseException:
            await client.close()
            raise
        self.duplicate_window = window
        self._client, self._js = client, js
        return js


class NATSSink:
    """:class:`AsyncNATSSink` for the synchronous :class:`~stateguard.Relay`: the same messages and checks.

    ::

        with NATSSink("nats://127.0.0.1:4222", stream="ORDERS", lease=timedelta(seconds=30)) as sink:
            sink.connect()                    # optional: refuse a bad stream or lease now
            Relay(engine, sink, lease=timedelta(seconds=30)).run(stop_event)

    nats-py runs only in an event loop: this sink starts one in a daemon
    thread (``stateguard-nats-sink``) on first use, and each :meth:`publish`
    waits there for its batch.  :meth:`close` closes the connection and
    stops the thread.  Relays in several threads may share one sink: their
    batches take turns.  The parameters are :class:`AsyncNATSSink`'s.
    """

    def __init__(
        self,
        servers: str | Sequence[str],
        *,
        stream: str,
        lease: timedelta,
        subject: str | None = None,
        msg_id_prefix: str = "",
        timeout: float = 10.0,
    ) -> None:
        self._sink = AsyncNATSSink(
            servers, stream=stream, lease=lease, subject=subject, msg_id_prefix=msg_id_prefix, timeout=timeout
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    @property
    def stream(self) -> str:
        """The JetStream stream the sink publishes into."""
        return self._sink.stream

    @property
    def duplicate_window(self) -> float | None:
        """The stream's duplicate window in seconds, once connected."""
        return self._sink.duplicate_window

    def connect(self) -> None:
        """Connect now and check the stream; see :meth:`AsyncNATSSink.connect`."""
        self._run(self._sink.connect())

    def probe(self) -> None:
        """Return when the NATS server answers a PING; see :meth:`AsyncNATSSink.probe`."""
        self._run(self._sink.probe())

    def publish(self, events: Sequence[OutboxEvent]) -> None:
        """Publish ``events`` and wait for every PubAck; see :meth:`AsyncNATSSink.publish`."""
        self._run(self._sink.publish(events))

    def close(self) -> None:
        """Close the connection and stop the sink's event loop thread."""
        with self._start_lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._sink.close(), loop).result(self._sink.timeout)
        except Exception:  # closing a broken connection: the thread stops all the same
            pass
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(self._sink.timeout)

    def __enter__(self) -> NATSSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NATSSink({self._sink.servers!r}, stream={self._sink.stream!r})"

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        loop = self._start()
        future = asyncio.run_coroutine_threadsafe(coroutine, loop)
        try:
            # The coroutine bounds itself (connect and PubAck timeouts); the margin covers a slow loop.
            return future.result(3 * self._sink.timeout + 5)
        except concurrent.futures.TimeoutError as error:
            future.cancel()
            raise PublishFailed(
                f"NATS sink: no answer from its event loop within {3 * self._sink.timeout + 5:g} s"
            ) from error

    def _start(self) -> asyncio.AbstractEventLoop:
        with self._start_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=self._serve, args=(loop,), name="stateguard-nats-sink", daemon=True
                )
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    @staticmethod
    def _serve(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            loop.close()
