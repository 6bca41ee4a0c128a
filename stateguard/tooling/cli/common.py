"""What every ``stateguard`` command shares: exit codes, the usage error, engines and Redis clients.

A :class:`UsageError` raised anywhere in a command becomes one line on
stderr and exit code 2 (:func:`stateguard.tooling.cli.main`); nothing here
prints.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, TextIO, TypeAlias
from urllib.parse import unquote, urlsplit

from sqlalchemy import Engine, create_engine
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url

from ...engine import sqlite_engine

EXIT_OK: Final = 0
EXIT_PROBLEMS: Final = 1
EXIT_USAGE: Final = 2

DEFAULT_DB: Final = "sqlite:///stateguard-demo.db"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs printed as written, each epilog's ``exit codes::`` as ``exit codes:``.

    The epilogs are reStructuredText too: the documentation's CLI reference (sphinx-argparse,
    which reads them from :func:`~stateguard.tooling.cli.build_parser`) renders the codes after the
    ``::`` and its blank line as a literal block, exactly as ``--help`` lines them up.
    """

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return super()._fill_text(text.replace("::\n\n", ":\n", 1), width, indent)


#: The subcommands of a parser, to which each command module adds its own.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
#: A command: ``run(args, out, err)`` returns the exit code.
Handler = Callable[[argparse.Namespace, TextIO, TextIO], int]


def add_command(
    commands: Subparsers,
    name: str,
    handler: Handler,
    *,
    help: str,
    description: str,
    epilog: str,
) -> argparse.ArgumentParser:
    """A ``stateguard NAME`` command run by ``handler``; its ``--help`` ends with ``epilog``, the
    command's own exit codes::

        parser = add_command(commands, "purge", run, help="...", description="...", epilog=EXIT_CODES)
    """
    command = commands.add_parser(
        name,
        help=help,
        description=description,
        epilog=epilog,
        formatter_class=HelpFormatter,
    )
    command.set_defaults(handler=handler)
    return command


#: Which extra installs the driver a URL names (for the "not installed" hint).
_EXTRAS = {"psycopg": "postgres", "pymysql": "mysql"}


class UsageError(Exception):
    """Reported as one line on stderr, exit code 2."""


def safe_url(url: URL) -> str:
    return url.render_as_string(hide_password=True)


def plain_url(url: URL) -> str:
    return url.render_as_string(hide_password=False)


def first_line(error: BaseException) -> str:
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
        raise UsageError(f"not a database URL: {safe_url(url)}: the port must be from 1 to 65535")
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
        raise UsageError(f"unknown database URL scheme {url.drivername!r} in {safe_url(url)}") from error
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
        raise UsageError(f"cannot use {safe_url(url)}: {first_line(error)}") from error
    try:
        with engine.connect():
            pass
    except (sa_exc.SQLAlchemyError, TypeError, ValueError) as error:
        # PyMySQL raises TypeError for a query argument it does not know, at connect.
        engine.dispose()
        raise UsageError(f"cannot connect to {safe_url(url)}: {first_line(error)}") from error
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
        raise UsageError(
            f"cannot use the SQLite file of {safe_url(url)}: {error.strerror or error}"
        ) from error
    if not exists:
        raise UsageError(
            f"no SQLite database at {where} ({safe_url(url)}); {purpose} does not create one: "
            "check the path (relative paths start at the current folder)"
        )


def safe_redis_url(url: str) -> str:
    """``url`` with its password (if any) shown as ``***``, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:" if parts.username else ":"
    return parts._replace(netloc=f"{user}***@{netloc}").geturl()


def redis_client(url: str) -> Any:
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
            f"not a Redis URL: {safe_redis_url(url)!r} (the database {database!r} is not a number; "
            "e.g. redis://127.0.0.1:6379/0)"
        )
    try:
        # A Redis that stops answering fails the batch (retried) instead of hanging the relay.
        client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=10)
    except ValueError as error:
        raise UsageError(
            f"not a Redis URL: {safe_redis_url(url)!r} ({error}; e.g. redis://127.0.0.1:6379/0)"
        ) from error
    try:
        client.ping()
    except redis.RedisError as error:
        client.close()
        raise UsageError(f"cannot connect to Redis at {safe_redis_url(url)}: {first_line(error)}") from error
    return client
