"""A NATS JetStream pull consumer that applies each outbox event once: :class:`NATSConsumer` (nats-py).

Each message is handled in one transaction with
:func:`~stateguard.consume_once` keyed by its ``Nats-Msg-Id`` header (the
outbox event id, after the sink's ``msg_id_prefix``, that
:class:`~stateguard.outbox.sinks.NATSSink` sets), committed, and only then
acknowledged (``ack_sync``: the server confirmed it).  A message whose
handler failed is ``nak``-ed for JetStream to deliver again (after
``retry_delay``); after ``max_deliveries`` deliveries (JetStream's
``num_delivered``) it is published to ``dead_letter_subject`` when one is
given and terminated (``term``: no more redeliveries; JetStream sends its
``MSG_TERMINATED`` advisory).  The durable consumer is created with
``max_deliver`` one above ``max_deliveries``, so a message that keeps
crashing the process is dead-lettered on its last delivery without running.
nats-py (the ``stateguard[nats]`` extra) is imported only by this module;
it is asyncio only, so :meth:`NATSConsumer.run` runs an event loop in the
calling thread and each handler in a worker thread.  See
``docs/how-to/consumers.md``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import random
import threading
from datetime import timedelta
from typing import Any, Final
from urllib.parse import unquote

from ..exceptions import ConfigurationError, InvalidArgument
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

__all__ = ["NATSConsumer"]


#: Headers added to a dead-lettered copy: how often it was delivered, its stream and sequence (its
#: ``Nats-Msg-Id`` moves to ``Stateguard-Msg-Id``).
DEAD_HEADERS: Final = ("Stateguard-Deliveries", "Stateguard-Stream", "Stateguard-Stream-Seq")
#: What nats-py puts for header bytes that are not UTF-8 (it decodes with ``errors="replace"``).
REPLACED: Final = "\ufffd"


def _seconds(value: Any, what: str) -> float:
    if not isinstance(value, timedelta) or value <= timedelta(0):
        raise InvalidArgument(f"{what} must be a positive datetime.timedelta, got {value!r}")
    return value.total_seconds()


async def _pause(stop: threading.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less when ``stop`` is set meanwhile (a backoff reaches 30 s: stop() must
    not wait that long)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not stop.is_set() and (left := deadline - loop.time()) > 0:
        await asyncio.sleep(min(left, 0.1))


async def _unless_stopped(stop: threading.Event, task: asyncio.Future[Any]) -> bool:
    """Wait for ``task``; ``False`` (and ``task`` cancelled) if ``stop`` is set first.

    nats-py's first connect retries for several seconds while the server is down; stop() must not
    wait for that.  The task's own error, if it fails first, is raised.
    """
    while not stop.is_set():
        done, _ = await asyncio.wait({task}, timeout=0.1)
        if done:
            task.result()
            return True
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    return False


class NATSConsumer:
    """Pull messages from a JetStream durable consumer; run ``handler(session, message)`` once per event.

    ::

        def bill(session: Session, message: Message) -> None:
            session.add(Invoice(order_id=message.payload["order"]))

        consumer = NATSConsumer(
            engine, bill, "nats://127.0.0.1:4222", stream="ORDERS", durable="billing",
            dead_letter_subject="dead.billing",
        )
        sys.exit(consumer.serve())            # until SIGTERM: finishes the message in hand, exits 0

    Several processes with one ``durable`` share its messages (JetStream
    keeps no order among them).  The durable consumer is created when it
    does not exist (explicit acks, ``ack_wait``, ``max_deliver``,
    ``filter_subject``); an existing one keeps its own settings.  While the
    handler runs and while the database is unreachable (waited out on the
    message in hand, not counted against it) the consumer tells JetStream
    the message is in progress, so ``ack_wait`` does not expire under it.

    :param bind: a synchronous Engine, or a sessionmaker.
    :param handler: ``handler(session, message)`` with a :class:`Message`
        (``id`` = ``Nats-Msg-Id``, ``topic`` and ``key`` from the headers
        ``Outbox-Topic`` and ``Outbox-Key``).
    :param servers: a NATS URL or a list of them.
    :param consumer: the name :func:`~stateguard.consume_once` records the
        ids under (default: ``durable``).
    :param dead_letter_subject: where a message goes after ``max_deliveries``
        (a subject of some stream, so it is kept); None: terminated only.
    :param retry_delay: how long JetStream waits before delivering a failed message again.
    :param poll: how long one fetch waits (also how soon :meth:`stop` is noticed while idle).
    :raises InvalidArgument: a bad URL, name, count or duration.
    """

    def __init__(
        self,
        bind: Any,
        handler: Any,
        servers: str | list[str],
        *,
        stream: str,
        durable: str,
        consumer: str | None = None,
        subject: str | None = None,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        dead_letter_subject: str | None = None,
        ack_wait: timedelta = timedelta(seconds=30),
        retry_delay: timedelta = timedelta(seconds=1),
        batch: int = 1,
        poll: timedelta = timedelta(seconds=1),
    ) -> None:
        self.durable = check_name(durable, "durable", 255)
        self._handling = Handling(bind, handler, durable if consumer is None else consumer, "NATSConsumer")
        urls = [servers] if isinstance(servers, str) else list(servers)
        if not urls or not all(isinstance(u, str) and u.startswith(("nats://", "tls://")) for u in urls):
            raise InvalidArgument(
                f"servers must be a NATS URL or a list of them (nats://host:4222), got {servers!r}"
            )
        self.servers = urls
        self.stream = check_name(stream, "stream", 255)
        self.subject = None if subject is None else check_name(subject, "subject", 255)
        self.max_deliveries = check_deliveries(max_deliveries)
        self.dead_letter_subject = (
            None
            if dead_letter_subject is None
            else check_name(dead_letter_subject, "dead_letter_subject", 255)
        )
        self.ack_wait = _seconds(ack_wait, "ack_wait")
        self.retry_delay = _seconds(retry_delay, "retry_delay")
        self.poll = _seconds(poll, "poll")
        if type(batch) is not int or not 1 <= batch <= 1000:
            raise InvalidArgument(f"batch must be an int from 1 to 1000, got {batch!r}")
        self.batch = batch
        try:
            import nats  # noqa: F401
        except ImportError as error:
            raise ImportError(
                "NATSConsumer needs the nats-py package: pip install 'stateguard[nats]'"
            ) from error
        #: How many messages this consumer acknowledged (handled now or before) and dead-lettered.
        self.handled = 0
        self.dead_lettered = 0
        self._connected = False

    @property
    def consumer(self) -> str:
        """The name :func:`~stateguard.consume_once` records the message ids under."""
        return self._handling.consumer

    def run(self, stop_event: threading.Event | None = None) -> None:
        """Fetch and handle messages until ``stop_event`` is set (or :meth:`stop` is called).

        Runs its own event loop in this thread (``asyncio.run``): call it
        outside one.  A lost connection is logged and made again.  The
        message in hand is committed and acknowledged before it returns::

            stop = threading.Event()
            threading.Thread(target=consumer.run, args=(stop,)).start()
            ...
            stop.set()

        :raises ConfigurationError: the stream does not exist.
        """
        if stop_event is not None:
            self._handling.stop_event = stop_event
        asyncio.run(self._main(self._handling.stop_event))

    def serve(self) -> int:
        """:meth:`run` until SIGTERM or SIGINT, then return 0 (``sys.exit(consumer.serve())``).

        Call it from the main thread.
        """
        return _serve(self.run, self._handling.stop_event)

    def stop(self) -> None:
        """Ask :meth:`run` to return after the message in hand (from any thread or a signal handler)."""
        self._handling.stop_event.set()

    # -- the loop ------------------------------------------------------------

    async def _main(self, stop: threading.Event) -> None:
        pause = 0.05
        while not stop.is_set():
            self._connected = False
            try:
                await self._consume(stop)
                pause = 0.05
            except ConfigurationError:
                raise
            except Exception as error:  # nats-py's connection and timeout errors, OSError
                if self._connected:  # this connection worked: a new outage, whose backoff starts afresh
                    pause = 0.05
                log.warning(
                    "consumer %r: NATS at %s: %s: %s; connecting again in %.2f s",
                    self.consumer,
                    self.servers[0],
                    type(error).__name__,
                    error,
                    pause,
                )
                await _pause(stop, pause * random.uniform(0.5, 1.0))  # jitter, not security
                pause = min(pause * 2, MAX_BACKOFF)

    async def _consume(self, stop: threading.Event) -> None:
        from nats.aio.client import Client
        from nats.errors import TimeoutError as NatsTimeout
        from nats.js.api import AckPolicy, ConsumerConfig
        from nats.js.errors import NotFoundError

        async def on_error(error: Exception) -> None:
            log.warning("consumer %r: NATS: %s: %s", self.consumer, type(error).__name__, error)

        client = Client()
        connecting = asyncio.ensure_future(
            client.connect(self.servers, connect_timeout=5, max_reconnect_attempts=3, error_cb=on_error)
        )
        if not await _unless_stopped(stop, connecting):
            with contextlib.suppress(Exception):  # never connected: nothing to flush
                await asyncio.wait_for(client.close(), 2)
            return
        try:
            js = client.jetstream()
            config = ConsumerConfig(
                durable_name=self.durable,
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=self.ack_wait,
                max_deliver=self.max_deliveries + 1,
            )
            try:
                subscription = await js.pull_subscribe(
                    self.subject or "", durable=self.durable, stream=self.stream, config=config
                )
            except NotFoundError as error:
                raise ConfigurationError(
                    f"NATS JetStream at {self.servers[0]} has no stream {self.stream!r} ({error}): "
                    "create it before the consumer starts"
                ) from error
            self._connected = True
            while not stop.is_set():
                try:
                    messages = await subscription.fetch(self.batch, timeout=self.poll)
                except (TimeoutError, NatsTimeout):
                    continue
                for index, raw in enumerate(messages):
                    if stop.is_set():
                        for rest in messages[index:]:
                            await rest.nak()  # not started: delivered again at once, to anyone
                        break
                    await self._handle(js, raw)
        finally:
            # Not drain(): it waits on the pull subscription's pending fetch. The acks went out with
            # ack_sync; flush sends the naks still buffered.
            with contextlib.suppress(Exception):  # a broken connection: nothing left to flush
                await client.flush(timeout=2)
            await client.close()

    async def _handle(self, js: Any, raw: Any) -> None:
        headers = raw.headers or {}
        deliveries = int(raw.metadata.num_delivered)
        topic, key = headers.get("Outbox-Topic"), headers.get("Outbox-Key")
        message = Message(
            id=headers.get("Nats-Msg-Id", ""),
            body=raw.data,
            topic=unquote(topic) if topic is not None else raw.subject,
            key=unquote(key) if key is not None else None,
            deliveries=deliveries,
            raw=raw,
        )
        if deliveries > self.max_deliveries:
            await self._dead_letter(js, raw, message, "delivered more often than max_deliveries")
            return
        if REPLACED in message.id and not await self._id_is_utf8(js, raw):
            # nats-py decodes header values with replacement: b"\xff" and b"\xfe" would both read
            # "\ufffd" and the second would pass for a repeat of the first, its effect lost.
            await self._dead_letter(js, raw, message, "its id is not UTF-8 text")
            return
        loop = asyncio.get_running_loop()

        def keep_alive() -> None:
            asyncio.run_coroutine_threadsafe(raw.in_progress(), loop)

        working = asyncio.create_task(self._tell_in_progress(raw))
        try:
            verdict = await asyncio.to_thread(self._handling.handle, message, keep_alive)
        finally:
            working.cancel()
        if verdict is Verdict.DONE:
            await raw.ack_sync()
            self.handled += 1
        elif verdict is Verdict.STOPPED:
            await raw.nak()
        elif verdict is Verdict.UNUSABLE:
            await self._dead_letter(js, raw, message, "its id cannot be recorded")
        elif deliveries >= self.max_deliveries:
            await self._dead_letter(js, raw, message, "the handler failed")
        else:
            await raw.nak(delay=self.retry_delay)

    async def _id_is_utf8(self, js: Any, raw: Any) -> bool:
        """Whether the ``Nats-Msg-Id`` the stream stored is UTF-8 (read back as sent: nats-py's decoded
        headers cannot tell a U+FFFD that was sent from bytes it replaced)."""
        from nats.js.errors import NotFoundError

        try:
            stored = await js.get_msg(self.stream, raw.metadata.sequence.stream)
        except NotFoundError:  # gone from the stream (max_age, purged): its id cannot be read as sent
            return False
        block = base64.b64decode(stored.hdrs or b"")
        for line in block.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip() == b"Nats-Msg-Id":
                try:
                    value.strip().decode("utf-8")
                except UnicodeDecodeError:
                    return False
                return True
        return False

    async def _tell_in_progress(self, raw: Any) -> None:
        """While the handler runs, reset JetStream's ack timer every third of ``ack_wait``."""
        while True:
            await asyncio.sleep(self.ack_wait / 3)
            await raw.in_progress()

    async def _dead_letter(self, js: Any, raw: Any, message: Message, why: str) -> None:
        if self.dead_letter_subject is not None:
            headers = dict(raw.headers or {})
            seq = str(raw.metadata.sequence.stream)
            headers["Stateguard-Msg-Id"] = headers.pop("Nats-Msg-Id", "")
            headers.update(zip(DEAD_HEADERS, (str(message.deliveries), self.stream, seq), strict=True))
            # An id of its own (the original's would be dropped as its duplicate), the same if this
            # process dies before term() and the message is dead-lettered again.
            headers["Nats-Msg-Id"] = f"stateguard-dead:{self.stream}:{seq}"
            await js.publish(self.dead_letter_subject, raw.data, headers=headers)
        await raw.term()
        self.dead_lettered += 1
        log.error(
            "consumer %r: message %r (stream %s seq %d) terminated after %d deliveries%s: %s",
            self.consumer,
            message.id,
            self.stream,
            raw.metadata.sequence.stream,
            message.deliveries,
            f", copied to {self.dead_letter_subject!r}" if self.dead_letter_subject else "",
            why,
        )

    def __repr__(self) -> str:
        return f"NATSConsumer({self.servers!r}, stream={self.stream!r}, durable={self.durable!r})"
