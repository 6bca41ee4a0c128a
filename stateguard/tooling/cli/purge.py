"""``stateguard purge``: delete expired keys and tokens and old published outbox events, in batches.

::

    $ stateguard purge --db postgresql+psycopg://app@db/app --batch 1000
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta
from typing import Any, Final, TextIO

from sqlalchemy import exc as sa_exc

from ...exceptions import StateguardError
from ...idempotency import purge_expired as _purge_keys
from ...inserts import purge_consumed as _purge_consumed
from ...outbox import purge_published as _purge_outbox
from ...tokens import purge_expired_tokens as _purge_tokens
from .arguments import hours, nonnegative_seconds, positive_int, text_arg
from .common import EXIT_OK, EXIT_USAGE, Subparsers, add_command, first_line, open_engine

EXIT_CODES: Final = """\
exit codes::

  0  ok: expired rows deleted (or none were left)
  2  usage error (bad arguments, unreachable database, a SQLite file that does
     not exist, stateguard's tables missing, a database error)
"""


def register(commands: Subparsers) -> argparse.ArgumentParser:
    """Add ``stateguard purge`` to ``commands``: its options, help and exit codes."""
    purge = add_command(
        commands,
        "purge",
        run,
        epilog=EXIT_CODES,
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
        "--db", type=text_arg, required=True, metavar="URL", help="SQLAlchemy URL of the database"
    )
    purge.add_argument(
        "--batch", type=positive_int, default=1000, metavar="N", help="rows per batch (default: 1000)"
    )
    purge.add_argument(
        "--pause",
        type=nonnegative_seconds,
        default=0.05,
        metavar="SECONDS",
        help="pause between batches (default: 0.05)",
    )
    purge.add_argument(
        "--max-batches",
        type=positive_int,
        default=None,
        metavar="N",
        help="stop after N batches per table (default: until none is left)",
    )
    purge.add_argument(
        "--outbox-retention",
        type=hours,
        default=168.0,
        metavar="HOURS",
        help="keep published outbox events this long, for audits and late replays (default: 168, a week)",
    )
    purge.add_argument(
        "--consumed-retention",
        type=hours,
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
    return purge


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


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
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
                    err.write(f"stateguard purge: {label}: database error: {first_line(error)}\n")
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
