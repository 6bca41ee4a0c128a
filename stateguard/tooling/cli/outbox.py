"""``stateguard outbox requeue``: give dead outbox events back to the relays.

::

    $ stateguard outbox requeue --db postgresql+psycopg://app@db/app --key order-42
"""

from __future__ import annotations

import argparse
from typing import Final, TextIO

from sqlalchemy import exc as sa_exc

from ...exceptions import StateguardError
from ...outbox import requeue_dead
from .arguments import positive_int, text_arg
from .common import EXIT_OK, HelpFormatter, Subparsers, UsageError, add_command, first_line, open_engine

EXIT_CODES: Final = """\
exit codes::

  0  ok: the dead events asked for were requeued (or none were dead)
  2  usage error (bad arguments, unreachable database, a SQLite file that does
     not exist, the stateguard_outbox table missing or older than this stateguard)
"""


def register(commands: Subparsers) -> argparse.ArgumentParser:
    """Add ``stateguard outbox`` to ``commands``: its options, help and exit codes."""
    outbox_cmd = commands.add_parser(
        "outbox",
        help="manage outbox events: requeue the dead ones",
        description="Manage the transactional outbox's events (see `stateguard outbox requeue --help`).",
        epilog=EXIT_CODES,
        formatter_class=HelpFormatter,
    )
    outbox_commands = outbox_cmd.add_subparsers(dest="outbox_command", metavar="COMMAND", required=True)
    requeue = add_command(
        outbox_commands,
        "requeue",
        run,
        epilog=EXIT_CODES,
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
        "--db", type=text_arg, required=True, metavar="URL", help="SQLAlchemy URL of the database"
    )
    requeue.add_argument(
        "--id",
        dest="ids",
        type=positive_int,
        action="append",
        metavar="N",
        help="requeue only this event id (repeatable; default: every dead event)",
    )
    requeue.add_argument("--key", type=text_arg, metavar="KEY", help="requeue only dead events of this key")
    return outbox_cmd


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    engine = open_engine(args.db, workers=1, purpose="stateguard outbox requeue", create=False)
    try:
        try:
            requeued = requeue_dead(engine, ids=args.ids, key=args.key)
        except (sa_exc.SQLAlchemyError, StateguardError) as error:
            raise UsageError(
                f"cannot requeue dead outbox events: {first_line(error)} "
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
