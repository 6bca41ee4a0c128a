"""``stateguard check``: validate a module's state machines, and compare a live database.

::

    $ stateguard check myapp.models --db postgresql+psycopg://app@db/app --json
"""

from __future__ import annotations

import argparse
import json
from typing import Final, TextIO

from sqlalchemy import exc as sa_exc

from ...schema import machines_in_module
from .. import check as checks
from ..terminal import use_color
from .arguments import text_arg
from .common import (
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    Subparsers,
    UsageError,
    add_command,
    first_line,
    open_engine,
    safe_url,
)
from .targets import import_module, model_machines, split_target

EXIT_CODES: Final = """\
exit codes::

  0  ok: no problems (warnings allowed)
  1  problems were found
  2  usage error (bad arguments, unimportable module, unreachable database,
     a SQLite file that does not exist, a database error while reading)
"""


def register(commands: Subparsers) -> argparse.ArgumentParser:
    """Add ``stateguard check`` to ``commands``: its options, help and exit codes."""
    check = add_command(
        commands,
        "check",
        run,
        epilog=EXIT_CODES,
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
        "target", type=text_arg, metavar="MODULE", help="e.g. myapp.models (or myapp.models:Order)"
    )
    check.add_argument("--db", type=text_arg, metavar="URL", help="SQLAlchemy URL of a database to compare")
    check.add_argument("--json", action="store_true", help="print a machine-readable report")
    return check


_COLORS = {checks.PROBLEM: "\x1b[31m", checks.WARNING: "\x1b[33m", "ok": "\x1b[32m"}


def _paint(text: str, level: str, color: bool) -> str:
    return f"{_COLORS[level]}{text}\x1b[0m" if color else text


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    module_name, model_name = split_target(args.target, model_required=False)
    module = import_module(module_name)
    if model_name is not None:
        machines = model_machines(module, model_name)[1]
    else:
        machines = machines_in_module(module)
        if not machines:
            raise UsageError(f"no StateMachine found in {module_name}")
    findings: dict[int, list[checks.Finding]] = {id(m): checks.check_declaration(m) for m in machines}
    database: str | None = None
    if args.db is not None:
        engine = open_engine(args.db, workers=1, purpose="stateguard check", create=False)
        database = safe_url(engine.url)
        try:
            with engine.connect() as conn:
                for m in machines:
                    findings[id(m)] += checks.check_database(conn, m)
        except sa_exc.SQLAlchemyError as error:
            # The comparison could not run: not "problems found" (exit 1).
            err.write(f"stateguard check: database error: {first_line(error)}\n")
            return EXIT_USAGE
        finally:
            engine.dispose()
    every = [f for m in machines for f in findings[id(m)]]
    problems = sum(f.level == checks.PROBLEM for f in every)
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
    lines.append(_paint(summary, checks.PROBLEM if problems else "ok", color))
    out.write("\n".join(lines) + "\n")
    out.flush()
    return EXIT_PROBLEMS if problems else EXIT_OK
