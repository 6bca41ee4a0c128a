"""The ``stateguard`` command's parser as the CLI reference page renders it.

sphinx-argparse reads texts as reStructuredText, but the command's epilogs (the exit codes)
are laid out for a terminal by ``RawDescriptionHelpFormatter``.  This builds the real parser
with ``stateguard.tooling.cli.build_parser()`` and hands each preformatted text over as a
literal block, so the page shows exactly what ``--help`` prints.
"""

from __future__ import annotations

import argparse
import textwrap

from stateguard.tooling.cli import build_parser


def _literal(text: str | None) -> str | None:
    if text is None or "\n " not in text:
        return text
    return "::\n\n" + textwrap.indent(text, "    ")


def _walk(parser: argparse.ArgumentParser) -> None:
    if issubclass(parser.formatter_class, argparse.RawDescriptionHelpFormatter):
        parser.description = _literal(parser.description)
        parser.epilog = _literal(parser.epilog)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _walk(sub)


def parser() -> argparse.ArgumentParser:
    """``stateguard``'s parser, its preformatted texts as literal blocks."""
    built = build_parser()
    _walk(built)
    return built
