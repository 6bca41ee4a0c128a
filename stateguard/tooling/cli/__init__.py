"""The ``stateguard`` command line (standard library ``argparse`` only).

::

    $ stateguard demo --db postgresql+psycopg://postgres@127.0.0.1:5432/test
    $ stateguard graph myapp.models:Order --format mermaid
    $ stateguard check myapp.models --db postgresql+psycopg://app@db/app --json
    $ stateguard purge --db postgresql+psycopg://app@db/app --batch 1000
    $ stateguard relay --db postgresql+psycopg://app@db/app --redis redis://cache:6379/0 --stream orders
    $ stateguard outbox requeue --db postgresql+psycopg://app@db/app
    $ stateguard inspect --db postgresql+psycopg://app@db/app --models myapp.models:Base --json

Each command is one module of this package that builds its own parser
(``register(commands)``) and runs it (``run(args, out, err) -> int``);
:func:`build_parser` assembles them in :data:`COMMANDS` order.  Exit codes:
0 ok; 1 only from ``demo`` (an invariant was violated), ``check`` (problems
were found) and ``inspect`` (stuck work was found); 2 usage error (bad
arguments, a database that cannot be reached or does not exist, a missing
driver, missing stateguard tables for ``purge`` and ``relay``, a broker
that cannot be reached or refuses the sink's set-up for ``relay``).  Each
command's ``--help`` lists its own.  :func:`main` takes the arguments and
returns the exit code, so it can be tested without a subprocess.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Final

from ... import __version__
from . import check, demo, graph, inspect, outbox, purge, relay
from .common import (
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    HelpFormatter,
    UsageError,
    database_url,
    first_line,
    open_engine,
)
from .targets import import_module

__all__ = [
    "COMMANDS",
    "EXIT_OK",
    "EXIT_PROBLEMS",
    "EXIT_USAGE",
    "UsageError",
    "build_parser",
    "database_url",
    "import_module",
    "main",
    "open_engine",
]

#: The command modules, in the order ``stateguard --help`` lists them.
COMMANDS: Final[tuple[ModuleType, ...]] = (demo, graph, check, purge, relay, outbox, inspect)

#: The ``exit codes:`` epilog of ``stateguard --help`` (each command's ``--help`` lists its own).
EXIT_CODES: Final = """\
exit codes (each command's --help lists its own)::

  0  ok
  1  demo: an invariant was violated; check: problems were found; inspect: stuck work was found
  2  usage error (bad arguments, unreachable or missing database or Redis, missing driver,
     missing stateguard tables)
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``stateguard`` and its commands, each added by its own module::

    build_parser().parse_args(["purge", "--db", "sqlite:///app.db"]).batch     # 1000
    """
    parser = argparse.ArgumentParser(
        prog="stateguard",
        description="Safe retried, duplicated and concurrent writes for SQLAlchemy.",
        epilog=EXIT_CODES,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"stateguard {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.register(commands)
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
            f"stateguard {args.command}: unexpected {type(error).__name__}: {first_line(error)} "
            "(please report this with the command line)\n"
        )
        return EXIT_USAGE
    return code
