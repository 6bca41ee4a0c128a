"""``stateguard relay``: publish committed outbox events to Redis, RabbitMQ or NATS until SIGTERM.

::

    $ stateguard relay --db postgresql+psycopg://app@db/app --redis redis://cache:6379/0 --stream orders
    $ stateguard relay --db postgresql+psycopg://app@db/app --sink rabbitmq --url amqp://mq --exchange orders
    $ stateguard relay --db postgresql+psycopg://app@db/app --sink nats --url nats://mq:4222 --stream ORDERS

Every option of the relay lives here: a new one is a change of this file alone.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from datetime import timedelta
from typing import Any, Final, TextIO

from sqlalchemy import exc as sa_exc
from sqlalchemy import select

from ...exceptions import StateguardError
from ...outbox import Relay
from ...tables import outbox
from ..terminal import RelayProgress
from .arguments import positive_int, positive_seconds, stream_length, text_arg
from .common import (
    EXIT_OK,
    EXIT_USAGE,
    Subparsers,
    UsageError,
    add_command,
    first_line,
    open_engine,
    redis_client,
)

EXIT_CODES: Final = """\
exit codes::

  0  ok: stopped by SIGTERM or SIGINT after finishing the batch in hand
  2  usage error (bad arguments, unreachable database or broker, a SQLite file
     that does not exist, the stateguard_outbox table missing, the broker's client
     missing, a RabbitMQ exchange or JetStream stream missing, a --lease longer than
     the stream's duplicate window, or an error the relay cannot retry)
"""

#: The Redis stream ``stateguard relay`` XADDs to without --stream.
DEFAULT_STREAM: Final = "stateguard-outbox"


def register(commands: Subparsers) -> argparse.ArgumentParser:
    """Add ``stateguard relay`` to ``commands``: its options, help and exit codes."""
    relay = add_command(
        commands,
        "relay",
        run,
        epilog=EXIT_CODES,
        help="publish committed outbox events to Redis, RabbitMQ or NATS, until SIGTERM",
        description=(
            "Run a stateguard Relay: claim up to --batch committed, unpublished outbox\n"
            "events, publish them through --sink, mark them published; repeat, waiting\n"
            "--idle seconds when nothing is left.  redis (default): XADD to the Redis\n"
            "stream --stream (fields id, topic, key, payload).  rabbitmq: persistent\n"
            "messages to --exchange with publisher confirms and mandatory routing\n"
            "(message_id = the event id, type = topic, header key).  nats: JetStream\n"
            "messages into the stream --stream (header Nats-Msg-Id = the event id, so\n"
            "JetStream drops a copy inside its duplicate window; --lease must not exceed it).\n"
            "Delivery is at least once: consumers deduplicate by the event id\n"
            "(consume_once).  Run several for throughput or failover; they share the work.\n"
            "Progress (events published, rate) goes to stderr.  SIGTERM or SIGINT stops it\n"
            "after the batch in hand is published and marked (exit 0); a second one stops\n"
            "it at once, and that batch is published again by a relay after its lease."
        ),
    )
    relay.add_argument(
        "--db", type=text_arg, required=True, metavar="URL", help="SQLAlchemy URL of the database"
    )
    relay.add_argument(
        "--sink",
        choices=("redis", "rabbitmq", "nats"),
        default="redis",
        help="where events go (default: redis)",
    )
    relay.add_argument(
        "--url",
        type=text_arg,
        metavar="URL",
        help=(
            "the broker's URL: redis://127.0.0.1:6379/0, amqp://guest:guest@127.0.0.1:5672/%%2F "
            "or nats://127.0.0.1:4222"
        ),
    )
    relay.add_argument(
        "--redis", type=text_arg, metavar="URL", help="--sink redis: the Redis URL (the same as --url)"
    )
    relay.add_argument(
        "--topic",
        type=text_arg,
        action="append",
        metavar="T",
        help="publish only events of this topic (repeatable; default: every topic)",
    )
    relay.add_argument(
        "--stream",
        type=text_arg,
        default=None,
        metavar="NAME",
        help=(
            "--sink redis: the Redis stream to XADD to (default: stateguard-outbox); --sink nats: the "
            "JetStream stream (required; it must exist)"
        ),
    )
    relay.add_argument(
        "--exchange",
        type=text_arg,
        metavar="NAME",
        help="--sink rabbitmq: the exchange (it must exist; default: the default exchange)",
    )
    relay.add_argument(
        "--routing-key",
        type=text_arg,
        metavar="KEY",
        help="--sink rabbitmq: one routing key for every message (default: the event's topic)",
    )
    relay.add_argument(
        "--key-routing",
        action="store_true",
        help="--sink rabbitmq: route each message by its event's key (the topic for an event without one)",
    )
    relay.add_argument(
        "--subject",
        type=text_arg,
        metavar="SUBJECT",
        help="--sink nats: one subject for every message (default: the event's topic)",
    )
    relay.add_argument(
        "--msg-id-prefix",
        type=text_arg,
        metavar="TEXT",
        help="--sink nats: put before the event id in Nats-Msg-Id (for several outboxes in one stream)",
    )
    relay.add_argument(
        "--maxlen",
        type=stream_length,
        default=None,
        metavar="N",
        help="--sink redis: trim the stream to about N entries (default: never trim)",
    )
    relay.add_argument(
        "--batch",
        type=positive_int,
        default=100,
        metavar="N",
        help="events per claim (default: 100, at most 10000)",
    )
    relay.add_argument(
        "--lease",
        type=positive_seconds,
        default=30.0,
        metavar="SECONDS",
        help="how long a claim lasts before another relay may publish its events again (default: 30)",
    )
    relay.add_argument(
        "--idle",
        type=positive_seconds,
        default=1.0,
        metavar="SECONDS",
        help="wait after a round that found nothing to publish (default: 1)",
    )
    return relay


class _CountingRelay(Relay):
    """A :class:`Relay` that adds up what its rounds published, for the progress line."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.published = 0

    def run_once(self) -> int:
        published = super().run_once()
        self.published += published
        return published


#: The options that only one --sink takes: (dest, flag) -> that sink.
_SINK_OPTIONS: dict[tuple[str, str], str] = {
    ("redis", "--redis"): "redis",
    ("maxlen", "--maxlen"): "redis",
    ("exchange", "--exchange"): "rabbitmq",
    ("routing_key", "--routing-key"): "rabbitmq",
    ("key_routing", "--key-routing"): "rabbitmq",
    ("subject", "--subject"): "nats",
    ("msg_id_prefix", "--msg-id-prefix"): "nats",
}


def _check_sink_options(args: argparse.Namespace) -> None:
    """Refuse an option of another sink and a missing URL or stream, before anything is opened."""
    for (dest, flag), sink in _SINK_OPTIONS.items():
        if getattr(args, dest) not in (None, False) and args.sink != sink:
            raise UsageError(f"{flag} is an option of --sink {sink}, not of --sink {args.sink}")
    if args.sink == "redis":
        if args.redis is not None and args.url is not None:
            raise UsageError("give the Redis URL once: --redis URL or --url URL")
        if args.redis is None and args.url is None:
            raise UsageError("the following arguments are required: --redis (or --url) for --sink redis")
        return
    if args.url is None:
        raise UsageError(f"the following arguments are required: --url for --sink {args.sink}")
    if args.sink == "nats" and args.stream is None:
        raise UsageError("the following arguments are required: --stream (JetStream) for --sink nats")
    if args.sink == "rabbitmq" and args.stream is not None:
        raise UsageError("--stream is an option of --sink redis and --sink nats, not of --sink rabbitmq")


def _broker_sink(args: argparse.Namespace) -> tuple[Any, str]:
    """The RabbitMQ or NATS sink the arguments describe (not connected yet), and what it publishes to."""
    lease = timedelta(seconds=args.lease)
    try:
        sink: Any
        if args.sink == "rabbitmq":
            from ...outbox.sinks.rabbitmq import RabbitMQSink

            sink = RabbitMQSink(
                args.url,
                exchange=args.exchange or "",
                routing_key=args.routing_key,
                key_as_routing_key=args.key_routing,
            )
            target = (
                f"the RabbitMQ exchange {args.exchange!r}" if args.exchange else "RabbitMQ's default exchange"
            )
        else:
            from ...outbox.sinks.nats import NATSSink

            sink = NATSSink(
                args.url,
                stream=args.stream,
                lease=lease,
                subject=args.subject,
                msg_id_prefix=args.msg_id_prefix or "",
            )
            target = f"the JetStream stream {args.stream!r}"
    except ImportError as error:
        raise UsageError(f"{error}") from error
    except StateguardError as error:
        raise UsageError(str(error)) from error
    return sink, target


def _connect(sink: Any) -> None:
    """Connect ``sink`` now: an unreachable broker, a missing exchange or stream, or a lease the stream's
    duplicate window does not cover is one line and exit 2, not a relay that retries forever."""
    try:
        sink.connect()
    except StateguardError as error:
        sink.close()
        raise UsageError(str(error)) from error


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from ...outbox.sinks.redis_streams import RedisStreamSink

    if threading.current_thread() is not threading.main_thread():
        raise UsageError("runs only in the main thread (it handles SIGTERM and SIGINT)")
    _check_sink_options(args)
    client: Any = None
    sink: Any = None
    if args.sink != "redis":
        sink, target = _broker_sink(args)  # checks its options before anything is opened
    engine = open_engine(args.db, workers=1, purpose="stateguard relay", create=False)
    try:
        try:
            with engine.connect() as conn:
                conn.execute(select(outbox.c.id).limit(1))
        except sa_exc.SQLAlchemyError as error:
            raise UsageError(
                f"cannot read {outbox.name}: {first_line(error)} "
                "(run `alembic upgrade stateguard@head` or stateguard.create_tables() first?)"
            ) from error
        if args.sink == "redis":
            client = redis_client(args.redis if args.redis is not None else args.url)
            stream = args.stream if args.stream is not None else DEFAULT_STREAM
            target = f"the Redis stream {stream!r}"
        else:
            _connect(sink)
        try:
            if client is not None:
                sink = RedisStreamSink(client, stream=stream, maxlen=args.maxlen)
            relay = _CountingRelay(
                engine, sink, topics=args.topic, batch=args.batch, lease=timedelta(seconds=args.lease)
            )
        except StateguardError as error:
            raise UsageError(str(error)) from error
        return _serve(relay, args, err, target)
    finally:
        if client is not None:
            client.close()
        elif sink is not None:
            sink.close()
        engine.dispose()


def _serve(relay: _CountingRelay, args: argparse.Namespace, err: TextIO, target: str) -> int:
    """Run ``relay`` in a thread until SIGTERM or SIGINT; the main thread draws the progress."""
    stop = threading.Event()
    stopped_by: list[str] = []
    failure: list[BaseException] = []
    previous: dict[int, Any] = {}

    def on_signal(signum: int, frame: Any) -> None:
        stopped_by.append(signal.Signals(signum).name)
        # The relay thread finishes the batch in hand and returns; a second signal acts at once.
        for number, old in previous.items():
            signal.signal(number, old)
        stop.set()

    def work() -> None:
        try:
            relay.run(stop, idle_sleep=args.idle)
        except BaseException as error:  # reported by the main thread
            failure.append(error)

    log = logging.getLogger("stateguard.outbox")
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("stateguard relay: %(message)s"))
    log.addHandler(handler)
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, on_signal)
    progress = RelayProgress(err, target=target)
    try:
        thread = threading.Thread(target=work, name="stateguard-relay", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(progress.interval)
            progress.update(relay.published)
    finally:
        for number, old in previous.items():
            signal.signal(number, old)
        log.removeHandler(handler)
    if failure:
        error = failure[0]
        progress.finish(relay.published, f"failed: {type(error).__name__}: {first_line(error)}")
        return EXIT_USAGE
    progress.finish(relay.published, f"stopped by {stopped_by[0] if stopped_by else 'request'}")
    return EXIT_OK
