"""``stateguard demo``: fire duplicate and concurrent requests at a database and check the invariants.

::

    $ stateguard demo --db postgresql+psycopg://postgres@127.0.0.1:5432/test --html demo.html

The demo's models are imported only when this command runs, so every other
command's process stays free of them.
"""

from __future__ import annotations

import argparse
from typing import Any, Final, TextIO

from sqlalchemy import exc as sa_exc

from ...exceptions import StateguardError
from ..terminal import StderrProgress, use_color
from .arguments import order_count, text_arg, worker_count
from .common import (
    DEFAULT_DB,
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    Subparsers,
    UsageError,
    add_command,
    database_url,
    first_line,
    open_engine,
    plain_url,
    redis_client,
)

EXIT_CODES: Final = """\
exit codes::

  0  ok: every invariant of stateguard's rows held (the hand-written rows' damage is expected)
  1  an invariant was violated in a stateguard row, a hand-written row raised an unexpected
     error, or the database failed during the run
  2  usage error (bad arguments, unreachable database, missing driver, a --schema namespace
     that exists and was not made by the demo)
"""


def register(commands: Subparsers) -> argparse.ArgumentParser:
    """Add ``stateguard demo`` to ``commands``: its options, help and exit codes."""
    demo = add_command(
        commands,
        "demo",
        run,
        epilog=EXIT_CODES,
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
        type=text_arg,
        default=DEFAULT_DB,
        metavar="URL",
        help=(
            f"SQLAlchemy database URL (default: {DEFAULT_DB}, a file in the current folder; "
            "e.g. postgresql+psycopg://postgres@127.0.0.1:5432/test or "
            "mysql+pymysql://root@127.0.0.1:3306/test)"
        ),
    )
    demo.add_argument(
        "--workers", type=worker_count, default=8, metavar="N", help="worker threads (default: 8)"
    )
    demo.add_argument(
        "--orders",
        type=order_count,
        default=120,
        metavar="N",
        help="orders per scheme and variant (default: 120)",
    )
    demo.add_argument(
        "--seed", type=int, default=None, metavar="N", help="seed of the request plan (default: random)"
    )
    demo.add_argument(
        "--schema",
        type=text_arg,
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
        type=text_arg,
        default=None,
        metavar="FILE",
        help="also write the results as one self-contained HTML page with charts",
    )
    demo.add_argument(
        "--redis",
        type=text_arg,
        default=None,
        metavar="URL",
        help=(
            "run the outbox pipeline through a Redis stream at URL (a fresh stream, deleted "
            "after the run) instead of in-process queues (default: no Redis needed)"
        ),
    )
    return demo


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    # Only this command imports the demo: its mapped models (DemoBase, DemoOrder ...)
    # stay out of every other command's process.
    from ..demo import open_namespace, render, run_demo

    url = database_url(args.db)
    if url.get_backend_name() == "sqlite" and (url.database or "") in ("", ":memory:"):
        raise UsageError(f"the demo needs a SQLite file, e.g. {DEFAULT_DB}")
    client: Any = None
    if args.redis is not None:
        client = redis_client(args.redis)
    try:
        try:
            workers = args.workers
            namespace = open_namespace(url, args.schema, lambda u: open_engine(plain_url(u), workers=workers))
        except StateguardError as error:
            raise UsageError(str(error)) from error
        except sa_exc.SQLAlchemyError as error:
            message = f"cannot create the demo's namespace {args.schema!r}: {first_line(error)}"
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
            err.write(f"stateguard demo: database error: {first_line(error)}\n")
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
        from ..report import write_html

        try:
            write_html(report, args.html)
        except OSError as error:
            err.write(f"stateguard demo: cannot write {args.html}: {error}\n")
            return EXIT_USAGE
    out.write(render(report, color=use_color(out)) + "\n")
    out.flush()
    return EXIT_OK if report.ok else EXIT_PROBLEMS
