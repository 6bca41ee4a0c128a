"""``stateguard inspect``: count rows per state and find stuck work in a live database (read only).

::

    $ stateguard inspect --db postgresql+psycopg://app@db/app --models myapp.models:Base --json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Final, TextIO

from sqlalchemy import exc as sa_exc

from ...machine import StateMachine, machines_of
from ...schema import machines_in_module
from ...tables import counter_ledger, transition_log
from .. import graph as drawing
from .. import inspection
from ..terminal import use_color
from .arguments import positive_int, positive_seconds, text_arg
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
from .targets import import_module, split_target

EXIT_CODES: Final = """\
exit codes::

  0  ok: nothing stuck
  1  stuck work was found: idempotency keys in progress past their lease, or outbox
     events unpublished for --stale seconds or longer
  2  usage error (bad arguments, unimportable --models, no such model or row key for
     --row, unreachable database, a SQLite file that does not exist, a database error
     while reading, Graphviz missing for svg/png, output not writable)
"""


def register(commands: Subparsers) -> argparse.ArgumentParser:
    """Add ``stateguard inspect`` to ``commands``: its options, help and exit codes."""
    inspect = add_command(
        commands,
        "inspect",
        run,
        epilog=EXIT_CODES,
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
        "--db", type=text_arg, required=True, metavar="URL", help="SQLAlchemy URL of the database"
    )
    inspect.add_argument(
        "--models",
        type=text_arg,
        metavar="MODULE[:Base]",
        help=(
            "the models to count: a module (every model it holds), MODULE:Base (every model "
            "of a declarative Base) or MODULE:Model"
        ),
    )
    inspect.add_argument(
        "--format",
        choices=("text", *drawing.GRAPH_FORMATS),
        default="text",
        help=(
            "text: counts as a table (default); mermaid, dot: also the graph with the counts; "
            "svg, png: the graph drawn by Graphviz into --output DIR"
        ),
    )
    inspect.add_argument(
        "-o",
        "--output",
        type=text_arg,
        metavar="DIR",
        help="write each machine's graph to DIR/<Model>.<machine>.<mmd|dot|svg|png>",
    )
    inspect.add_argument(
        "--row",
        type=text_arg,
        metavar="Model:KEY",
        help="one row's states and history, e.g. Order:42 (a composite key as JSON: 'Line:[1, \"a\"]')",
    )
    inspect.add_argument(
        "--ref", type=text_arg, metavar="REF", help="the counter ledger entries written under REF"
    )
    inspect.add_argument(
        "--stale",
        type=positive_seconds,
        default=inspection.DEFAULT_STALE_MS / 1000,
        metavar="SECONDS",
        help="an unpublished outbox event this old is stuck (default: 300)",
    )
    inspect.add_argument(
        "--limit",
        type=positive_int,
        default=inspection.DEFAULT_LIMIT,
        metavar="N",
        help=f"stuck keys and leases listed (default: {inspection.DEFAULT_LIMIT})",
    )
    inspect.add_argument("--json", action="store_true", help="print a machine-readable report")
    return inspect


def _inspect_machines(target: str) -> list[StateMachine[Any]]:
    """The machines ``--models`` names: a module's, a declarative Base's models', or one model's."""
    module_name, name = split_target(target, model_required=False)
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
    report: inspection.Inspection, machines: list[StateMachine[Any]], args: argparse.Namespace
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
        drawn = drawing.render_graph(machine, args.format, counts=counts.states)
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


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
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
            row_key = inspection.parse_row_key(row_model, key_text)
        except inspection.RowKeyError as error:
            raise UsageError(str(error)) from error
        except RecursionError:  # json.loads of a key nested a thousand deep
            raise UsageError(
                f"--row {model_name}:KEY is nested too deeply: a composite key is a flat JSON list, "
                f"e.g. --row '{model_name}:[1, \"a\"]'"
            ) from None
    if args.format in ("svg", "png"):
        if not drawing.graphviz_available():
            raise UsageError(drawing.GRAPHVIZ_HINT)
        if args.output is None:
            raise UsageError(
                f"--format {args.format} writes one file per machine: name a folder with --output DIR"
            )
    engine = open_engine(args.db, workers=1, purpose="stateguard inspect", create=False)
    progress = inspection.ScanProgress(err, enabled=not args.json)
    try:
        with engine.connect() as conn:
            report = inspection.inspect_database(
                conn,
                machines,
                limit=args.limit,
                stale_ms=round(args.stale * 1000),
                progress=progress,
                database=safe_url(engine.url),
            )
            if args.ref is not None:
                if counter_ledger.name in report.tables_present:
                    report.ledger = {**inspection.ledger_of(conn, args.ref), "table_missing": False}
                else:
                    report.ledger = {"ref": args.ref, "entries": [], "table_missing": True}
        if row_model is not None:
            report.row = inspection.row_report(
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
        err.write(f"stateguard inspect: database error: {first_line(error)}\n")
        return EXIT_USAGE
    finally:
        engine.dispose()
    if args.format != "text":
        _draw_counts(report, machines, args)
    if args.json:
        out.write(json.dumps(report.as_dict(), indent=2) + "\n")
    else:
        out.write(inspection.render_text(report, color=use_color(out)))
    out.flush()
    return EXIT_PROBLEMS if report.stuck else EXIT_OK
