"""The ``stateguard`` command line (standard library ``argparse`` only).

::

    $ stateguard demo --db postgresql+psycopg://postgres@127.0.0.1:5432/test
    $ stateguard graph myapp.models:Order --format mermaid
    $ stateguard check myapp.models --db postgresql+psycopg://app@db/app --json
    $ stateguard purge --db postgresql+psycopg://app@db/app --batch 1000
    $ stateguard relay --db postgresql+psycopg://app@db/app --redis redis://cache:6379/0 --stream orders
    $ stateguard relay --db postgresql+psycopg://app@db/app --sink rabbitmq --url amqp://mq --exchange orders
    $ stateguard relay --db postgresql+psycopg://app@db/app --sink nats --url nats://mq:4222 --stream ORDERS
    $ stateguard inspect --db postgresql+psycopg://app@db/app --models myapp.models:Base --json

Exit codes: 0 ok; 1 only from ``demo`` (an invariant was violated),
``check`` (problems were found) and ``inspect`` (stuck work was found); 2
usage error (bad arguments, a database that cannot be reached or does not exist, a missing driver, missing
stateguard tables for ``purge`` and ``relay``, a broker (Redis, RabbitMQ,
NATS) that cannot be reached or refuses the sink's set-up for ``relay``).
Each command's ``--help`` lists its own.
:func:`main` takes the arguments and returns the exit code, so it can be
tested without a subprocess.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO, TypeVar
from urllib.parse import unquote, urlsplit

from sqlalchemy import Engine, create_engine, select
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url

from .. import __version__
from ..engine import sqlite_engine
from ..exceptions import StateguardError
from ..idempotency import purge_expired as _purge_keys
from ..inserts import purge_consumed as _purge_consumed
from ..machine import StateMachine, machines_of
from ..outbox import Relay, requeue_dead
from ..outbox import purge_published as _purge_outbox
from ..outbox.sinks.redis_streams import MAX_MAXLEN
from ..schema import machines_in_module
from ..tables import counter_ledger, outbox, transition_log
from ..tokens import purge_expired_tokens as _purge_tokens
from . import check as _check
from . import graph as _graph
from . import inspection as _inspection
from .terminal import RelayProgress, StderrProgress, isatty, use_color

__all__ = ["main"]

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2

DEFAULT_DB = "sqlite:///stateguard-demo.db"
#: The Redis stream ``stateguard relay`` XADDs to without --stream.
DEFAULT_STREAM = "stateguard-outbox"

#: The ``exit codes:`` epilog of ``stateguard --help`` and of each command's ``--help``: its own codes only.
_EXIT_CODES: dict[str, str] = {
    "stateguard": """\
exit codes (each command's --help lists its own):
  0  ok
  1  demo: an invariant was violated; check: problems were found; inspect: stuck work was found
  2  usage error (bad arguments, unreachable or missing database or Redis, missing driver,
     missing stateguard tables)
""",
    "demo": """\
exit codes:
  0  ok: every invariant of stateguard's rows held (the hand-written rows' damage is expected)
  1  an invariant was violated in a stateguard row, a hand-written row raised an unexpected
     error, or the database failed during the run
  2  usage error (bad arguments, unreachable database, missing driver, a --schema namespace
     that exists and was not made by the demo)
""",
    "graph": """\
exit codes:
  0  ok: the graph was written
  2  usage error (bad arguments, unimportable module, no such model or machine,
     Graphviz missing, output not writable)
""",
    "check": """\
exit codes:
  0  ok: no problems (warnings allowed)
  1  problems were found
  2  usage error (bad arguments, unimportable module, unreachable database,
     a SQLite file that does not exist, a database error while reading)
""",
    "purge": """\
exit codes:
  0  ok: expired rows deleted (or none were left)
  2  usage error (bad arguments, unreachable database, a SQLite file that does
     not exist, stateguard's tables missing, a database error)
""",
    "relay": """\
exit codes:
  0  ok: stopped by SIGTERM or SIGINT after finishing the batch in hand
  2  usage error (bad arguments, unreachable database or broker, a SQLite file
     that does not exist, the stateguard_outbox table missing, the broker's client
     missing, a RabbitMQ exchange or JetStream stream missing, a --lease longer than
     the stream's duplicate window, or an error the relay cannot retry)
""",
}

_EXIT_CODES["outbox"] = """\
exit codes:
  0  ok: the dead events asked for were requeued (or none were dead)
  2  usage error (bad arguments, unreachable database, a SQLite file that does
     not exist, the stateguard_outbox table missing or older than this stateguard)
"""
_EXIT_CODES["requeue"] = _EXIT_CODES["outbox"]

_EXIT_CODES["inspect"] = """\
exit codes:
  0  ok: nothing stuck
  1  stuck work was found: idempotency keys in progress past their lease, or outbox
     events unpublished for --stale seconds or longer
  2  usage error (bad arguments, unimportable --models, no such model or row key for
     --row, unreachable database, a SQLite file that does not exist, a database error
     while reading, Graphviz missing for svg/png, output not writable)
"""

#: Which extra installs the driver a URL names (for the "not installed" hint).
_EXTRAS = {"psycopg": "postgres", "pymysql": "mysql"}


class UsageError(Exception):
    """Reported as one line on stderr, exit code 2."""


# --------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------


def _safe(url: URL) -> str:
    return url.render_as_string(hide_password=True)


def _plain(url: URL) -> str:
    return url.render_as_string(hide_password=False)


def _first_line(error: BaseException) -> str:
    orig = getattr(error, "orig", None) or error
    args: tuple[Any, ...] = tuple(getattr(orig, "args", ()))
    if len(args) == 2 and isinstance(args[0], int) and isinstance(args[1], str) and args[1]:
        # PyMySQL's (code, message) pair reads better as "message (code)".
        return f"{args[1].splitlines()[0]} ({args[0]})"
    text = str(orig).strip()
    return text.splitlines()[0].strip() if text else type(orig).__name__


def database_url(db: str) -> URL:
    """``db`` parsed as a SQLAlchemy URL, or :class:`UsageError` saying what is wrong with it.

    A port that is not a number is refused here (SQLAlchemy's ``make_url``
    raises a bare ``ValueError`` for it), and so is one outside 1-65535
    (libpq quietly takes port 0 as its default 5432)::

        database_url("postgresql+psycopg://app@db:5432/app")
    """
    try:
        url = make_url(db)
    except sa_exc.ArgumentError as error:
        raise UsageError(f"not a database URL: {db!r} (e.g. {DEFAULT_DB})") from error
    except ValueError as error:
        raise UsageError(f"not a database URL: {db!r}: the port is not a number ({error})") from error
    if url.port is not None and not 1 <= url.port <= 65535:
        raise UsageError(f"not a database URL: {_safe(url)}: the port must be from 1 to 65535")
    return url


def open_engine(db: str, *, workers: int, purpose: str = "the demo", create: bool = True) -> Engine:
    """An engine for ``db`` that has connected once, or :class:`UsageError` saying why not.

    SQLite URLs go through :func:`stateguard.sqlite_engine` (WAL, busy
    timeout); the pool has room for every worker.  ``purpose`` names the
    command in the messages.  With ``create=False`` (``check``, ``purge``) a
    SQLite file that does not exist is a :class:`UsageError` instead of a new
    empty database (sqlite3 creates the file on connect), and the database's
    journal mode is left as it is::

        open_engine("sqlite:///app.db", workers=1, purpose="stateguard check", create=False)
    """
    url = database_url(db)
    backend = url.get_backend_name()
    pool: dict[str, Any] = {"pool_size": workers, "max_overflow": workers}
    try:
        if backend == "sqlite":
            database = url.database or ""
            if database in ("", ":memory:") or url.query.get("mode") == "memory":
                # Every worker needs its own connection to the same database.
                raise UsageError(f"{purpose} needs a SQLite file, e.g. sqlite:///stateguard-demo.db")
            if not create:
                _sqlite_file_exists(url, database, purpose)
            engine = sqlite_engine(db, wal=create, **pool)
        else:
            connect_args: dict[str, Any] = {}
            timeout_known = url.get_driver_name() in ("psycopg", "psycopg2", "pymysql")
            if timeout_known and "connect_timeout" not in url.query:
                # An unreachable host should fail in seconds, not after the OS's TCP timeout.
                connect_args["connect_timeout"] = 5
            engine = create_engine(url, connect_args=connect_args, **pool)
    except sa_exc.NoSuchModuleError as error:
        raise UsageError(f"unknown database URL scheme {url.drivername!r} in {_safe(url)}") from error
    except ImportError as error:
        driver = url.get_driver_name()
        extra = _EXTRAS.get(driver)
        if extra is not None:
            hint = f"pip install 'stateguard[{extra}]'"
        elif backend == "postgresql":
            hint = "install it, or use postgresql+psycopg:// with pip install 'stateguard[postgres]'"
        elif backend in ("mysql", "mariadb"):
            hint = f"install it, or use {backend}+pymysql:// with pip install 'stateguard[mysql]'"
        else:
            hint = "install it"
        raise UsageError(f"the {driver} driver for {backend} is not installed ({error}); {hint}") from error
    except (TypeError, ValueError) as error:
        # A query argument the dialect cannot convert (sqlite ?timeout=abc, ?check_same_thread=maybe,
        # mysql ?connect_timeout=abc are a ValueError while the engine is made).
        raise UsageError(f"cannot use {_safe(url)}: {_first_line(error)}") from error
    try:
        with engine.connect():
            pass
    except (sa_exc.SQLAlchemyError, TypeError, ValueError) as error:
        # PyMySQL raises TypeError for a query argument it does not know, at connect.
        engine.dispose()
        raise UsageError(f"cannot connect to {_safe(url)}: {_first_line(error)}") from error
    return engine


def _sqlite_file_exists(url: URL, database: str, purpose: str) -> None:
    """:class:`UsageError` unless the SQLite file ``database`` names exists (connecting would create it)."""
    path = database
    if path.startswith("file:") and str(url.query.get("uri", "")).lower() in ("1", "true"):
        # sqlite:///file:app.db?mode=ro&uri=true: an SQLite URI filename.
        path = unquote(urlsplit(path).path)
    try:
        exists = Path(path).is_file()
        where = Path(path).resolve()
    except OSError as error:  # a name too long for the file system, ...
        raise UsageError(f"cannot use the SQLite file of {_safe(url)}: {error.strerror or error}") from error
    if not exists:
        raise UsageError(
            f"no SQLite database at {where} ({_safe(url)}); {purpose} does not create one: "
            "check the path (relative paths start at the current folder)"
        )


# --------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------


# --------------------------------------------------------------------------
# Argument types: every value is checked while parsing, before anything connects
# --------------------------------------------------------------------------

#: The longest ``--pause``, ``--lease``, ``--idle`` and ``--stale`` (seconds), about 31 years.
#: Below every bound these values meet: ``time.sleep`` and threading's waits stop at 2**63 ns
#: of the monotonic clock (about 292 years less the uptime; ``time.sleep(9.3e9)`` is an
#: OverflowError), :class:`~datetime.timedelta` at 999999999 days, the databases' BIGINT
#: milliseconds at 2**63; and ``threading.TIMEOUT_MAX`` where a platform's is smaller.
MAX_SECONDS: float = min(1e9, threading.TIMEOUT_MAX)
#: The longest ``--outbox-retention`` and ``--consumed-retention`` (hours), about 114 years: as
#: milliseconds subtracted from the database's clock it stays far inside a BIGINT and inside
#: :class:`~datetime.timedelta` (``timedelta(hours=1e12)`` is an OverflowError).
MAX_HOURS = 1_000_000
#: Most ``demo --workers`` (each thread holds connections of its own: a server's
#: max_connections refuses far fewer) and ``demo --orders`` (the demo keeps its plan in memory).
MAX_WORKERS = 1000
MAX_ORDERS = 1_000_000
#: The largest ``--batch``, ``--max-batches`` and ``--limit``: a BIGINT, the largest LIMIT
#: every database takes (SQLite's driver raises OverflowError past it).
MAX_COUNT = 2**63 - 1
#: Longest text argument: Linux's MAX_ARG_STRLEN (128 KiB); a longer one never came from a shell.
MAX_TEXT = 131_072

N = TypeVar("N", int, float)


def _shown(text: str, longest: int = 60) -> str:
    """``text`` quoted for a message (its repr: non-UTF-8 bytes escaped), cut to ``longest``."""
    shown = repr(text)
    if len(shown) <= longest:
        return shown
    return f"{shown[: longest - 4]}...{shown[-1]} ({len(text)} characters)"


def _plain_number(value: float) -> str:
    return str(int(value)) if value == int(value) else str(value)


def _number(
    convert: Callable[[str], N], what: str, *, least: N, most: N, unit: str = ""
) -> Callable[[str], N]:
    """An argparse ``type``: ``convert(text)``, refused with a one-line reason outside ``least..most``."""
    bound = f"at least {_plain_number(least)} and at most {_plain_number(most)}{unit}"

    def parse(text: str) -> N:
        try:
            value = convert(text)
        except (ValueError, OverflowError):  # int() of over 4300 digits is a ValueError too
            raise argparse.ArgumentTypeError(f"not {what}: {_shown(text)}") from None
        if not least <= value <= most:  # written so that NaN is refused too
            raise argparse.ArgumentTypeError(f"must be {bound}, got {_shown(text)}")
        return value

    return parse


_positive = _number(int, "a whole number", least=1, most=MAX_COUNT)
_workers = _number(int, "a whole number", least=1, most=MAX_WORKERS)
_orders = _number(int, "a whole number", least=1, most=MAX_ORDERS)
_maxlen = _number(int, "a whole number", least=1, most=MAX_MAXLEN, unit=" (what Redis's XADD MAXLEN takes)")
_nonnegative_float = _number(float, "a number", least=0.0, most=MAX_SECONDS, unit=" (seconds)")
_positive_float = _number(float, "a number", least=0.001, most=MAX_SECONDS, unit=" (seconds)")
_hours = _number(float, "a number", least=0.001, most=float(MAX_HOURS), unit=" (hours)")


def _text(text: str) -> str:
    """An argparse ``type`` for text: refused when not UTF-8, holding a NUL or longer than :data:`MAX_TEXT`.

    Python hands the command line's non-UTF-8 bytes over as lone surrogates
    (``os.fsdecode``): no database or Redis takes them.
    """
    if len(text) > MAX_TEXT:
        raise argparse.ArgumentTypeError(f"longer than {MAX_TEXT} characters: {_shown(text)}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"not valid UTF-8: {_shown(text)}") from None
    if "\x00" in text:
        raise argparse.ArgumentTypeError(f"contains a NUL character: {_shown(text)}")
    return text


def _cmd_demo(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    # Only this command imports the demo: its mapped models (DemoBase, DemoOrder ...)
    # stay out of every other command's process.
    from .demo import open_namespace, render, run_demo

    url = database_url(args.db)
    if url.get_backend_name() == "sqlite" and (url.database or "") in ("", ":memory:"):
        raise UsageError(f"the demo needs a SQLite file, e.g. {DEFAULT_DB}")
    client: Any = None
    if args.redis is not None:
        client = _redis_client(args.redis)
    try:
        try:
            workers = args.workers
            namespace = open_namespace(url, args.schema, lambda u: open_engine(_plain(u), workers=workers))
        except StateguardError as error:
            raise UsageError(str(error)) from error
        except sa_exc.SQLAlchemyError as error:
            message = f"cannot create the demo's namespace {args.schema!r}: {_first_line(error)}"
            raise UsageError(message) from error
        report = None
        try:
            report = run_demo(
                namespace.engine,
                workers=args.workers,
                orders=args.orders,
                seed=args.seed,
                progress=StderrProgress(err),
                redis=client,
            )
        except sa_exc.SQLAlchemyError as error:
            err.write(f"stateguard demo: database error: {_first_line(error)}\n")
        finally:
            if args.keep:
                namespace.close()
                afterwards = f"kept the {namespace.where} for inspection (drop it: {namespace.drop_hint})"
            else:
                namespace.drop()
                afterwards = f"dropped the {namespace.where} and everything in it"
        if report is None:
            return EXIT_PROBLEMS
        report.namespace = namespace.where
        report.afterwards = afterwards
    finally:
        if client is not None:
            client.close()
    if args.html is not None:
        from .report import write_html

        try:
            write_html(report, args.html)
        except OSError as error:
            err.write(f"stateguard demo: cannot write {args.html}: {error}\n")
            return EXIT_USAGE
    out.write(render(report, color=use_color(out)) + "\n")
    out.flush()
    return EXIT_OK if report.ok else EXIT_PROBLEMS


# -- purge ------------------------------------------------------------------

#: What ``stateguard purge`` can clean, and how: (label, function of (engine, args) -> rows deleted).
_PURGERS: dict[str, tuple[str, Any]] = {
    "keys": ("expired idempotency keys", lambda engine, args: _purge_keys(engine, batch=args.batch)),
    "tokens": ("expired one-time tokens", lambda engine, args: _purge_tokens(engine, batch=args.batch)),
    "outbox": (
        "published outbox events",
        lambda engine, args: _purge_outbox(
            engine, older_than=timedelta(hours=args.outbox_retention), batch=args.batch
        ),
    ),
    "consumed": (
        "consumed-message records",
        lambda engine, args: _purge_consumed(
            engine, older_than=timedelta(hours=args.consumed_retention), batch=args.batch
        ),
    ),
}
#: Purged only when asked for: a consumed-message record purged too early lets a redelivery apply again.
_OPT_IN = {"consumed": "consumed_retention"}


def _cmd_purge(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if "consumed" in (args.what or ()) and args.consumed_retention is None:
        err.write(
            "stateguard purge: --only consumed needs --consumed-retention HOURS (longer than any "
            "redelivery can come: a message redelivered after its record is purged is handled again)\n"
        )
        return EXIT_USAGE
    wanted = args.what or sorted(
        w for w in _PURGERS if w not in _OPT_IN or getattr(args, _OPT_IN[w]) is not None
    )
    engine = open_engine(args.db, workers=1, purpose="stateguard purge", create=False)
    try:
        for what in wanted:
            label, purge = _PURGERS[what]
            total = batches = 0
            while True:
                try:
                    deleted = int(purge(engine, args))
                except (sa_exc.SQLAlchemyError, StateguardError) as error:
                    # Missing tables are a setup mistake, not "problems found" (exit 1 is not purge's).
                    err.write(f"stateguard purge: {label}: database error: {_first_line(error)}\n")
                    err.write(
                        "  (run `alembic upgrade stateguard@head` or stateguard.create_tables() first?)\n"
                    )
                    return EXIT_USAGE
                total += deleted
                batches += 1
                if deleted < args.batch or (args.max_batches and batches >= args.max_batches):
                    break
                # Each batch is its own short transaction; the pause lets claims in between.
                time.sleep(args.pause)
            out.write(f"{label}: {total} deleted in {batches} batch{'es' if batches != 1 else ''}\n")
    finally:
        engine.dispose()
    return EXIT_OK


# -- relay ------------------------------------------------------------------


class _CountingRelay(Relay):
    """A :class:`Relay` that adds up what its rounds published, for the progress line."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.published = 0

    def run_once(self) -> int:
        published = super().run_once()
        self.published += published
        return published


def _safe_redis(url: str) -> str:
    """``url`` with its password (if any) shown as ``***``, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:" if parts.username else ":"
    return parts._replace(netloc=f"{user}***@{netloc}").geturl()


def _redis_client(url: str) -> Any:
    """A redis-py client of ``url`` that answered PING, or :class:`UsageError` saying why not."""
    try:
        import redis
    except ImportError as error:
        raise UsageError(f"redis-py is not installed ({error}); pip install 'stateguard[redis]'") from error
    try:
        parts = urlsplit(url)
    except ValueError as error:  # "Invalid IPv6 URL": not shown, it may hold a password
        raise UsageError(f"not a Redis URL ({error}; e.g. redis://127.0.0.1:6379/0)") from error
    database = unquote(parts.path).strip("/") if parts.scheme in ("redis", "rediss") else ""
    if database and not database.isdecimal():
        # redis-py ignores a path that is not a number and connects to database 0.
        raise UsageError(
            f"not a Redis URL: {_safe_redis(url)!r} (the database {database!r} is not a number; "
            "e.g. redis://127.0.0.1:6379/0)"
        )
    try:
        # A Redis that stops answering fails the batch (retried) instead of hanging the relay.
        client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=10)
    except ValueError as error:
        raise UsageError(
            f"not a Redis URL: {_safe_redis(url)!r} ({error}; e.g. redis://127.0.0.1:6379/0)"
        ) from error
    try:
        client.ping()
    except redis.RedisError as error:
        client.close()
        raise UsageError(f"cannot connect to Redis at {_safe_redis(url)}: {_first_line(error)}") from error
    return client


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
            from ..outbox.sinks.rabbitmq import RabbitMQSink

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
            from ..outbox.sinks.nats import NATSSink

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


def _cmd_relay(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from ..outbox.sinks.redis_streams import RedisStreamSink

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
                f"cannot read {outbox.name}: {_first_line(error)} "
                "(run `alembic upgrade stateguard@head` or stateguard.create_tables() first?)"
            ) from error
        if args.sink == "redis":
            client = _redis_client(args.redis if args.redis is not None else args.url)
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
        progress.finish(relay.published, f"failed: {type(error).__name__}: {_first_line(error)}")
        return EXIT_USAGE
    progress.finish(relay.published, f"stopped by {stopped_by[0] if stopped_by else 'request'}")
    return EXIT_OK


# -- outbox requeue ---------------------------------------------------------


def _cmd_outbox_requeue(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    engine = open_engine(args.db, workers=1, purpose="stateguard outbox requeue", create=False)
    try:
        try:
            requeued = requeue_dead(engine, ids=args.ids, key=args.key)
        except (sa_exc.SQLAlchemyError, StateguardError) as error:
            raise UsageError(
                f"cannot requeue dead outbox events: {_first_line(error)} "
                "(run `alembic upgrade stateguard@head` or stateguard.create_tables() first?)"
            ) from error
    finally:
        engine.dispose()
    out.write(
        f"{_plural_events(requeued)} requeued: relays publish {'it' if requeued == 1 else 'them'} next\n"
    )
    return EXIT_OK


def _plural_events(n: int) -> str:
    return f"{n} dead outbox event{'' if n == 1 else 's'}"


# -- graph and check --------------------------------------------------------


def import_module(name: str) -> ModuleType:
    """Import ``name`` as ``python -m`` would, from the current folder too, or :class:`UsageError`.

    ::

        import_module("myapp.models")   # the module, or UsageError("cannot import myapp.models: ...")
    """
    if not name or not all(part.isidentifier() for part in name.split(".")):
        raise UsageError(f"not a module name: {name!r} (e.g. myapp.models)")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        # The console script does not put the current folder on the path; `python -m` does.
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except SystemExit as error:  # sys.exit() at import: not the command's own exit code
        raise UsageError(
            f"cannot import {name}: it called sys.exit({error.code!r}) while importing"
        ) from None
    except Exception as error:  # a model module can fail in any way while importing
        raise UsageError(f"cannot import {name}: {type(error).__name__}: {_first_line(error)}") from error


def _model_machines(module: ModuleType, model_name: str) -> tuple[type[Any], list[StateMachine[Any]]]:
    model = getattr(module, model_name, None)
    if not isinstance(model, type):
        raise UsageError(f"{module.__name__} has no class {model_name!r}")
    machines = [m for m in machines_of(model) if m.model is not None and issubclass(model, m.model)]
    if not machines:
        raise UsageError(f"{module.__name__}.{model_name} declares no StateMachine")
    return model, machines


def _split_target(target: str, *, model_required: bool) -> tuple[str, str | None]:
    module, sep, model = target.partition(":")
    if not sep:
        if model_required:
            example = "stateguard.tooling.demo:DemoOrder"
            raise UsageError(f"expected MODULE:Model, got {target!r} (e.g. {example})")
        return module, None
    if not model.isidentifier():
        raise UsageError(f"not a class name: {model!r} in {target!r}")
    return module, model


def _cmd_graph(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    module_name, model_name = _split_target(args.target, model_required=True)
    if model_name is None:  # pragma: no cover - model_required makes _split_target refuse it
        raise UsageError(f"expected MODULE:Model, got {args.target!r}")
    model, machines = _model_machines(import_module(module_name), model_name)
    if args.machine is not None:
        picked = [m for m in machines if m.name == args.machine]
        if not picked:
            names = ", ".join(m.name for m in machines)
            raise UsageError(f"{model.__name__} has no StateMachine {args.machine!r}; it has: {names}")
        machine = picked[0]
    elif len(machines) > 1:
        names = ", ".join(m.name for m in machines)
        raise UsageError(f"{model.__name__} has several machines ({names}); pick one with --machine")
    else:
        machine = machines[0]
    try:
        drawn = _graph.render_graph(machine, args.format)
    except _graph.GraphvizMissing as error:
        raise UsageError(str(error)) from error
    if args.output is not None:
        path = Path(args.output)
        try:
            if isinstance(drawn, bytes):
                path.write_bytes(drawn)
            else:
                path.write_text(drawn, encoding="utf-8")
        except OSError as error:
            raise UsageError(f"cannot write {args.output}: {error.strerror or error}") from error
        return EXIT_OK
    if isinstance(drawn, bytes):
        if args.format == "svg":
            out.write(drawn.decode("utf-8"))
        else:
            buffer = getattr(out, "buffer", None)
            if buffer is None or isatty(out):
                raise UsageError(f"{args.format.upper()} is binary: write it to a file with -o FILE")
            out.flush()
            buffer.write(drawn)
            buffer.flush()
            return EXIT_OK
    else:
        out.write(drawn)
    out.flush()
    return EXIT_OK


_COLORS = {_check.PROBLEM: "\x1b[31m", _check.WARNING: "\x1b[33m", "ok": "\x1b[32m"}


def _paint(text: str, level: str, color: bool) -> str:
    return f"{_COLORS[level]}{text}\x1b[0m" if color else text


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _cmd_check(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    module_name, model_name = _split_target(args.target, model_required=False)
    module = import_module(module_name)
    if model_name is not None:
        machines = _model_machines(module, model_name)[1]
    else:
        machines = machines_in_module(module)
        if not machines:
            raise UsageError(f"no StateMachine found in {module_name}")
    findings: dict[int, list[_check.Finding]] = {id(m): _check.check_declaration(m) for m in machines}
    database: str | None = None
    if args.db is not None:
        engine = open_engine(args.db, workers=1, purpose="stateguard check", create=False)
        database = _safe(engine.url)
        try:
            with engine.connect() as conn:
                for m in machines:
                    findings[id(m)] += _check.check_database(conn, m)
        except sa_exc.SQLAlchemyError as error:
            # The comparison could not run: not "problems found" (exit 1).
            err.write(f"stateguard check: database error: {_first_line(error)}\n")
            return EXIT_USAGE
        finally:
            engine.dispose()
    every = [f for m in machines for f in findings[id(m)]]
    problems = sum(f.level == _check.PROBLEM for f in every)
    warnings_ = len(every) - problems
    if args.json:
        report = {
            "ok": problems == 0,
            "module": module_name,
            "database": database,
            "problems": problems,
            "warnings": warnings_,
            "machines": [
                {
                    "model": m.model.__name__ if m.model is not None else None,
                    "machine": m.name,
                    "table": m.state_column.table.name,
                    "column": m.state_column.name,
                    "findings": [f.as_dict() for f in findings[id(m)]],
                }
                for m in machines
            ],
        }
        out.write(json.dumps(report, indent=2) + "\n")
        out.flush()
        return EXIT_PROBLEMS if problems else EXIT_OK
    color = use_color(out)
    against = (
        f", database {database}" if database else " (declarations only; add --db URL to compare a database)"
    )
    lines = [f"stateguard check {args.target}: {_plural(len(machines), 'machine')}{against}"]
    for m in machines:
        model = m.model.__name__ if m.model is not None else "?"
        where = f"{model}.{m.name} ({m.state_column.table.name}.{m.state_column.name})"
        found = findings[id(m)]
        if not found:
            lines.append(f"  {where}: {_paint('ok', 'ok', color)}")
            continue
        lines.append(f"  {where}")
        for f in found:
            lines.append(f"    {_paint(f'{f.level:<8}', f.level, color)} {f.code}: {f.message}")
    summary = f"{_plural(problems, 'problem')}, {_plural(warnings_, 'warning')}"
    lines.append(_paint(summary, _check.PROBLEM if problems else "ok", color))
    out.write("\n".join(lines) + "\n")
    out.flush()
    return EXIT_PROBLEMS if problems else EXIT_OK


# -- inspect ----------------------------------------------------------------


def _inspect_machines(target: str) -> list[StateMachine[Any]]:
    """The machines ``--models`` names: a module's, a declarative Base's models', or one model's."""
    module_name, name = _split_target(target, model_required=False)
    module = import_module(module_name)
    if name is None:
        machines = machines_in_module(module)
        if not machines:
            raise UsageError(f"no StateMachine found in {module_name}")
        return machines
    value = getattr(module, name, None)
    registry = getattr(value, "registry", None)
    if not isinstance(value, type) or registry is None:
        raise UsageError(
            f"{module_name}.{name} is not a declarative Base or a mapped model "
            f"(e.g. --models myapp.models:Base, or --models myapp.models)"
        )
    found: list[StateMachine[Any]] = []
    for mapper in sorted(registry.mappers, key=lambda m: (m.class_.__module__, m.class_.__qualname__)):
        cls = mapper.class_
        if issubclass(cls, value):
            found += [m for m in machines_of(cls) if m.model is cls and m not in found]
    if not found:
        raise UsageError(f"no StateMachine among the models of {target}")
    return found


_DRAWING_SUFFIX = {"mermaid": "mmd", "dot": "dot", "svg": "svg", "png": "png"}


def _draw_counts(
    report: _inspection.Inspection, machines: list[StateMachine[Any]], args: argparse.Namespace
) -> None:
    """Each counted machine's graph with its counts: text into the report, or files into ``--output``."""
    folder = Path(args.output) if args.output is not None else None
    if folder is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise UsageError(f"cannot create the folder {args.output}: {error.strerror or error}") from error
    for machine, counts in zip(machines, report.machines, strict=True):
        if counts.table_missing:
            continue
        drawn = _graph.render_graph(machine, args.format, counts=counts.states)
        if folder is None:
            # svg/png need --output (checked before connecting): text here.
            counts.drawing = drawn if isinstance(drawn, str) else drawn.decode("utf-8")
            continue
        path = folder / f"{counts.model}.{counts.machine}.{_DRAWING_SUFFIX[args.format]}"
        try:
            if isinstance(drawn, bytes):
                path.write_bytes(drawn)
            else:
                path.write_text(drawn, encoding="utf-8")
        except OSError as error:
            raise UsageError(f"cannot write {path}: {error.strerror or error}") from error
        counts.file = str(path)


def _cmd_inspect(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    machines = _inspect_machines(args.models) if args.models is not None else []
    row_model: type[Any] | None = None
    row_key: tuple[Any, ...] = ()
    if args.row is not None:
        if args.models is None:
            raise UsageError("--row needs --models (the model and its primary key come from it)")
        model_name, sep, key_text = args.row.partition(":")
        if not sep or not key_text:
            raise UsageError(f"expected --row Model:KEY, got {args.row!r} (e.g. --row Order:42)")
        models = {m.model.__name__: m.model for m in machines if m.model is not None}
        row_model = models.get(model_name)
        if row_model is None:
            raise UsageError(
                f"no model {model_name!r} with a StateMachine in {args.models}; "
                f"it has: {', '.join(sorted(models))}"
            )
        try:
            row_key = _inspection.parse_row_key(row_model, key_text)
        except _inspection.RowKeyError as error:
            raise UsageError(str(error)) from error
        except RecursionError:  # json.loads of a key nested a thousand deep
            raise UsageError(
                f"--row {model_name}:KEY is nested too deeply: a composite key is a flat JSON list, "
                f"e.g. --row '{model_name}:[1, \"a\"]'"
            ) from None
    if args.format in ("svg", "png"):
        if not _graph.graphviz_available():
            raise UsageError(_graph.GRAPHVIZ_HINT)
        if args.output is None:
            raise UsageError(
                f"--format {args.format} writes one file per machine: name a folder with --output DIR"
            )
    engine = open_engine(args.db, workers=1, purpose="stateguard inspect", create=False)
    progress = _inspection.ScanProgress(err, enabled=not args.json)
    try:
        with engine.connect() as conn:
            report = _inspection.inspect_database(
                conn,
                machines,
                limit=args.limit,
                stale_ms=round(args.stale * 1000),
                progress=progress,
                database=_safe(engine.url),
            )
            if args.ref is not None:
                if counter_ledger.name in report.tables_present:
                    report.ledger = {**_inspection.ledger_of(conn, args.ref), "table_missing": False}
                else:
                    report.ledger = {"ref": args.ref, "entries": [], "table_missing": True}
        if row_model is not None:
            report.row = _inspection.row_report(
                engine,
                row_model,
                [m for m in machines if m.model is row_model],
                row_key,
                log_present=transition_log.name in report.tables_present,
            )
    except (sa_exc.SQLAlchemyError, OverflowError) as error:
        # Nothing could be judged: not "stuck work found" (exit 1).  OverflowError: a --row
        # key past SQLite's 64-bit INTEGER, which its driver refuses before the database sees it
        # (PostgreSQL answers "integer out of range", a database error).
        err.write(f"stateguard inspect: database error: {_first_line(error)}\n")
        return EXIT_USAGE
    finally:
        engine.dispose()
    if args.format != "text":
        _draw_counts(report, machines, args)
    if args.json:
        out.write(json.dumps(report.as_dict(), indent=2) + "\n")
    else:
        out.write(_inspection.render_text(report, color=use_color(out)))
    out.flush()
    return EXIT_PROBLEMS if report.stuck else EXIT_OK


Handler = Callable[[argparse.Namespace, TextIO, TextIO], int]


def _command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    handler: Handler,
    *,
    help: str,
    description: str,
) -> argparse.ArgumentParser:
    """A ``stateguard NAME`` command run by ``handler``; its ``--help`` ends with the exit codes."""
    command = commands.add_parser(
        name,
        help=help,
        description=description,
        epilog=_EXIT_CODES[name],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.set_defaults(handler=handler)
    return command


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``stateguard`` and its commands."""
    parser = argparse.ArgumentParser(
        prog="stateguard",
        description="Safe retried, duplicated and concurrent writes for SQLAlchemy.",
        epilog=_EXIT_CODES["stateguard"],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"stateguard {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo = _command(
        commands,
        "demo",
        _cmd_demo,
        help="fire duplicate and concurrent requests at a database and check the invariants",
        description=(
            "Create the demo's own namespace (--schema: a schema, a database or a SQLite\n"
            "file, dropped after the run unless --keep), then fire duplicate and concurrent\n"
            "pay / ship / cancel requests from many worker threads,\n"
            "as retries, redeliveries and double-clicks would, for each scheme: state machine,\n"
            "optimistic version check, insert-once, a flash sale on one hot stock row\n"
            "(guarded decrement with a ref per purchase), an HTTP retry storm through\n"
            "IdempotencyMiddleware (skipped without starlette) and the outbox pipeline\n"
            "(idempotent requests -> transition + emit() -> 2 relays -> an in-process broker\n"
            "that loses acknowledgements -> 3 consumers with consume_once).  Prints one row per\n"
            "scheme and checks that side effects ran exactly once per APPLIED call.  Each scheme\n"
            "runs the same storm twice: the usual hand-written code, then stateguard, and the\n"
            "damage (double charges, oversold units, lost updates, duplicate rows) is counted\n"
            "in the database afterwards."
        ),
    )
    demo.add_argument(
        "--db",
        type=_text,
        default=DEFAULT_DB,
        metavar="URL",
        help=(
            f"SQLAlchemy database URL (default: {DEFAULT_DB}, a file in the current folder; "
            "e.g. postgresql+psycopg://postgres@127.0.0.1:5432/test or "
            "mysql+pymysql://root@127.0.0.1:3306/test)"
        ),
    )
    demo.add_argument("--workers", type=_workers, default=8, metavar="N", help="worker threads (default: 8)")
    demo.add_argument(
        "--orders",
        type=_orders,
        default=120,
        metavar="N",
        help="orders per scheme and variant (default: 120)",
    )
    demo.add_argument(
        "--seed", type=int, default=None, metavar="N", help="seed of the request plan (default: random)"
    )
    demo.add_argument(
        "--schema",
        type=_text,
        default="sg_demo",
        metavar="NAME",
        help=(
            "the demo's own namespace, created for the run and dropped after it: a PostgreSQL schema, "
            "a MariaDB/MySQL database, or on SQLite the file <db stem>.NAME.db next to --db's file "
            "(default: sg_demo); an existing one not made by the demo is refused (exit 2)"
        ),
    )
    demo.add_argument("--keep", action="store_true", help="keep the namespace after the run, for inspection")
    demo.add_argument(
        "--html",
        type=_text,
        default=None,
        metavar="FILE",
        help="also write the results as one self-contained HTML page with charts",
    )
    demo.add_argument(
        "--redis",
        type=_text,
        default=None,
        metavar="URL",
        help=(
            "run the outbox pipeline through a Redis stream at URL (a fresh stream, deleted "
            "after the run) instead of in-process queues (default: no Redis needed)"
        ),
    )
    graph = _command(
        commands,
        "graph",
        _cmd_graph,
        help="draw a model's declared state graph (Mermaid, DOT, SVG, PNG)",
        description=(
            "Draw the state graph a StateMachine declares: Mermaid through the transitions\n"
            "package's diagram support, DOT text from the same markup; both need nothing extra.\n"
            "SVG and PNG are that DOT drawn by Graphviz (apt install graphviz, and\n"
            "pip install 'stateguard[graphviz]')."
        ),
    )
    graph.add_argument(
        "target", type=_text, metavar="MODULE:Model", help="e.g. stateguard.tooling.demo:DemoOrder"
    )
    graph.add_argument(
        "--machine", type=_text, metavar="NAME", help="the machine to draw, when the model has several"
    )
    graph.add_argument(
        "--format",
        choices=_graph.GRAPH_FORMATS,
        default="mermaid",
        help="output format (default: mermaid)",
    )
    graph.add_argument(
        "-o", "--output", type=_text, metavar="FILE", help="write to FILE instead of standard output"
    )
    check = _command(
        commands,
        "check",
        _cmd_check,
        help="validate the state machines of a module, and compare a live database",
        description=(
            "Validate every StateMachine found in MODULE (or only MODULE:Model's):\n"
            "problems are unreachable states and triggers that can never fire; states with\n"
            "no way out are warnings unless listed in the model's __stateguard_final__.\n"
            "With --db, also compare the database: missing tables, columns, CHECK constraints,\n"
            "version columns and legal-edges triggers, and rows holding undeclared states."
        ),
    )
    check.add_argument(
        "target", type=_text, metavar="MODULE", help="e.g. myapp.models (or myapp.models:Order)"
    )
    check.add_argument("--db", type=_text, metavar="URL", help="SQLAlchemy URL of a database to compare")
    check.add_argument("--json", action="store_true", help="print a machine-readable report")
    purge = _command(
        commands,
        "purge",
        _cmd_purge,
        help="delete expired idempotency keys and one-time tokens, and old published outbox events",
        description=(
            "Delete expired rows of stateguard's key tables in batches of --batch rows, each\n"
            "batch its own short transaction, pausing --pause seconds between batches so\n"
            "claims are never held up for long (on PostgreSQL a batch also skips rows a\n"
            "claim holds).  Expired keys are already ignored by claims; purging reclaims space.\n"
            "Outbox events are deleted once published more than --outbox-retention hours ago\n"
            "(unpublished events never are); consume_once() records only with\n"
            "--consumed-retention (a redelivery after its record is gone is handled again).\n"
            "Run it from cron or a scheduler."
        ),
    )
    purge.add_argument(
        "--db", type=_text, required=True, metavar="URL", help="SQLAlchemy URL of the database"
    )
    purge.add_argument(
        "--batch", type=_positive, default=1000, metavar="N", help="rows per batch (default: 1000)"
    )
    purge.add_argument(
        "--pause",
        type=_nonnegative_float,
        default=0.05,
        metavar="SECONDS",
        help="pause between batches (default: 0.05)",
    )
    purge.add_argument(
        "--max-batches",
        type=_positive,
        default=None,
        metavar="N",
        help="stop after N batches per table (default: until none is left)",
    )
    purge.add_argument(
        "--outbox-retention",
        type=_hours,
        default=168.0,
        metavar="HOURS",
        help="keep published outbox events this long, for audits and late replays (default: 168, a week)",
    )
    purge.add_argument(
        "--consumed-retention",
        type=_hours,
        default=None,
        metavar="HOURS",
        help="also delete consume_once() records older than this; longer than any redelivery can come "
        "(default: keep them)",
    )
    purge.add_argument(
        "--only",
        dest="what",
        choices=sorted(_PURGERS),
        action="append",
        help="purge only this table (repeatable; default: keys, outbox and tokens, and consumed with "
        "--consumed-retention)",
    )
    relay = _command(
        commands,
        "relay",
        _cmd_relay,
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
        "--db", type=_text, required=True, metavar="URL", help="SQLAlchemy URL of the database"
    )
    relay.add_argument(
        "--sink",
        choices=("redis", "rabbitmq", "nats"),
        default="redis",
        help="where events go (default: redis)",
    )
    relay.add_argument(
        "--url",
        type=_text,
        metavar="URL",
        help=(
            "the broker's URL: redis://127.0.0.1:6379/0, amqp://guest:guest@127.0.0.1:5672/%%2F "
            "or nats://127.0.0.1:4222"
        ),
    )
    relay.add_argument(
        "--redis", type=_text, metavar="URL", help="--sink redis: the Redis URL (the same as --url)"
    )
    relay.add_argument(
        "--topic",
        type=_text,
        action="append",
        metavar="T",
        help="publish only events of this topic (repeatable; default: every topic)",
    )
    relay.add_argument(
        "--stream",
        type=_text,
        default=None,
        metavar="NAME",
        help=(
            "--sink redis: the Redis stream to XADD to (default: stateguard-outbox); --sink nats: the "
            "JetStream stream (required; it must exist)"
        ),
    )
    relay.add_argument(
        "--exchange",
        type=_text,
        metavar="NAME",
        help="--sink rabbitmq: the exchange (it must exist; default: the default exchange)",
    )
    relay.add_argument(
        "--routing-key",
        type=_text,
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
        type=_text,
        metavar="SUBJECT",
        help="--sink nats: one subject for every message (default: the event's topic)",
    )
    relay.add_argument(
        "--msg-id-prefix",
        type=_text,
        metavar="TEXT",
        help="--sink nats: put before the event id in Nats-Msg-Id (for several outboxes in one stream)",
    )
    relay.add_argument(
        "--maxlen",
        type=_maxlen,
        default=None,
        metavar="N",
        help="--sink redis: trim the stream to about N entries (default: never trim)",
    )
    relay.add_argument(
        "--batch",
        type=_positive,
        default=100,
        metavar="N",
        help="events per claim (default: 100, at most 10000)",
    )
    relay.add_argument(
        "--lease",
        type=_positive_float,
        default=30.0,
        metavar="SECONDS",
        help="how long a claim lasts before another relay may publish its events again (default: 30)",
    )
    relay.add_argument(
        "--idle",
        type=_positive_float,
        default=1.0,
        metavar="SECONDS",
        help="wait after a round that found nothing to publish (default: 1)",
    )
    outbox_cmd = commands.add_parser(
        "outbox",
        help="manage outbox events: requeue the dead ones",
        description="Manage the transactional outbox's events (see `stateguard outbox requeue --help`).",
        epilog=_EXIT_CODES["outbox"],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    outbox_commands = outbox_cmd.add_subparsers(dest="outbox_command", metavar="COMMAND", required=True)
    requeue = _command(
        outbox_commands,
        "requeue",
        _cmd_outbox_requeue,
        help="give dead outbox events back to the relays",
        description=(
            "A relay parks an outbox event dead when its sink refused it max_attempts times\n"
            "(stateguard inspect lists them).  Once the sink takes it again, this makes every\n"
            "dead event (or those of --id / --key) claimable again, its refusals counted from\n"
            "0; a relay publishes it next, in its key's id order.  Published and live events\n"
            "are not touched."
        ),
    )
    requeue.add_argument(
        "--db", type=_text, required=True, metavar="URL", help="SQLAlchemy URL of the database"
    )
    requeue.add_argument(
        "--id",
        dest="ids",
        type=_positive,
        action="append",
        metavar="N",
        help="requeue only this event id (repeatable; default: every dead event)",
    )
    requeue.add_argument("--key", type=_text, metavar="KEY", help="requeue only dead events of this key")
    inspect = _command(
        commands,
        "inspect",
        _cmd_inspect,
        help="count rows per state and find stuck work in a live database",
        description=(
            "Read a live database (never writes).  With --models, the rows in each state of\n"
            "every StateMachine (one GROUP BY per machine), optionally drawn as the state graph\n"
            "with the counts (--format).  From stateguard's own tables, where they exist:\n"
            "idempotency keys in progress past their lease, expired keys and tokens not purged\n"
            "yet, worker-id leases (live / expired), the outbox backlog.  Leases and ages are\n"
            "judged on the database's clock.  --row Model:KEY shows one row's states and\n"
            "transition history, --ref REF the counter ledger entries of one ref."
        ),
    )
    inspect.add_argument(
        "--db", type=_text, required=True, metavar="URL", help="SQLAlchemy URL of the database"
    )
    inspect.add_argument(
        "--models",
        type=_text,
        metavar="MODULE[:Base]",
        help=(
            "the models to count: a module (every model it holds), MODULE:Base (every model "
            "of a declarative Base) or MODULE:Model"
        ),
    )
    inspect.add_argument(
        "--format",
        choices=("text", *_graph.GRAPH_FORMATS),
        default="text",
        help=(
            "text: counts as a table (default); mermaid, dot: also the graph with the counts; "
            "svg, png: the graph drawn by Graphviz into --output DIR"
        ),
    )
    inspect.add_argument(
        "-o",
        "--output",
        type=_text,
        metavar="DIR",
        help="write each machine's graph to DIR/<Model>.<machine>.<mmd|dot|svg|png>",
    )
    inspect.add_argument(
        "--row",
        type=_text,
        metavar="Model:KEY",
        help="one row's states and history, e.g. Order:42 (a composite key as JSON: 'Line:[1, \"a\"]')",
    )
    inspect.add_argument(
        "--ref", type=_text, metavar="REF", help="the counter ledger entries written under REF"
    )
    inspect.add_argument(
        "--stale",
        type=_positive_float,
        default=_inspection.DEFAULT_STALE_MS / 1000,
        metavar="SECONDS",
        help="an unpublished outbox event this old is stuck (default: 300)",
    )
    inspect.add_argument(
        "--limit",
        type=_positive,
        default=_inspection.DEFAULT_LIMIT,
        metavar="N",
        help=f"stuck keys and leases listed (default: {_inspection.DEFAULT_LIMIT})",
    )
    inspect.add_argument("--json", action="store_true", help="print a machine-readable report")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``stateguard`` command line and return its exit code.

    ::

        $ stateguard demo --orders 50
        >>> main(["demo", "--db", "sqlite:///demo.db", "--orders", "50"])
        0
        >>> main(["graph", "stateguard.tooling.demo:DemoOrder", "--format", "dot", "-o", "flow.dot"])
        0
        >>> main(["check", "myapp.models", "--db", "sqlite:///app.db", "--json"])
        1
        >>> main(["purge", "--db", "sqlite:///app.db", "--batch", "500"])
        0
        >>> main(["relay", "--db", "sqlite:///app.db", "--redis", "redis://127.0.0.1:6379/0"])  # to SIGTERM
        0
        >>> main(["inspect", "--db", "sqlite:///app.db", "--models", "myapp.models:Base", "--json"])
        0
    """
    parser = build_parser()
    try:
        args = parser.parse_args(None if argv is None else list(argv))
    except SystemExit as exit_:
        # argparse exits itself for --help (0) and usage errors (2).
        status = exit_.code
        return status if isinstance(status, int) else (EXIT_OK if status is None else EXIT_USAGE)
    out, err = sys.stdout, sys.stderr
    try:
        code = int(args.handler(args, out, err))
    except UsageError as error:
        err.write(f"stateguard {args.command}: {error}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        err.write("\nstateguard: interrupted\n")
        return 130
    except Exception as error:  # a bug of ours: still one line, never a traceback
        err.write(
            f"stateguard {args.command}: unexpected {type(error).__name__}: {_first_line(error)} "
            "(please report this with the command line)\n"
        )
        return EXIT_USAGE
    return code
