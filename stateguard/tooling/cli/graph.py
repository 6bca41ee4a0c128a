"""``stateguard graph``: draw a model's declared state graph (Mermaid, DOT, SVG, PNG).

::

    $ stateguard graph myapp.models:Order --format mermaid
    $ stateguard graph myapp.models:Order --format svg -o order.svg
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Final, TextIO

from .. import graph as drawing
from ..terminal import isatty
from .arguments import text_arg
from .common import EXIT_OK, Subparsers, UsageError, add_command
from .targets import import_module, model_machines, split_target

EXIT_CODES: Final = """\
exit codes::

  0  ok: the graph was written
  2  usage error (bad arguments, unimportable module, no such model or machine,
     Graphviz missing, output not writable)
"""


def register(commands: Subparsers) -> argparse.ArgumentParser:
    """Add ``stateguard graph`` to ``commands``: its options, help and exit codes."""
    graph = add_command(
        commands,
        "graph",
        run,
        epilog=EXIT_CODES,
        help="draw a model's declared state graph (Mermaid, DOT, SVG, PNG)",
        description=(
            "Draw the state graph a StateMachine declares: Mermaid through the transitions\n"
            "package's diagram support, DOT text from the same markup; both need nothing extra.\n"
            "SVG and PNG are that DOT drawn by Graphviz (apt install graphviz, and\n"
            "pip install 'stateguard[graphviz]')."
        ),
    )
    graph.add_argument(
        "target", type=text_arg, metavar="MODULE:Model", help="e.g. stateguard.tooling.demo:DemoOrder"
    )
    graph.add_argument(
        "--machine", type=text_arg, metavar="NAME", help="the machine to draw, when the model has several"
    )
    graph.add_argument(
        "--format",
        choices=drawing.GRAPH_FORMATS,
        default="mermaid",
        help="output format (default: mermaid)",
    )
    graph.add_argument(
        "-o", "--output", type=text_arg, metavar="FILE", help="write to FILE instead of standard output"
    )
    return graph


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    module_name, model_name = split_target(args.target, model_required=True)
    if model_name is None:  # pragma: no cover - model_required makes _split_target refuse it
        raise UsageError(f"expected MODULE:Model, got {args.target!r}")
    model, machines = model_machines(import_module(module_name), model_name)
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
        drawn = drawing.render_graph(machine, args.format)
    except drawing.GraphvizMissing as error:
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
