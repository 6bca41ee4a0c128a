"""``python -m bench compare --before A.json ... --after B.json ...``: two trees' results side by side.

Each side is one or more files written by ``python -m bench run`` (one per scenario, say, run
alternately from two checkouts).  The output is one Markdown table with a row for every target
note and every ratio, throughput, latency-percentile and correctness column (oversells, double
applications, lost updates, errors) of every table, before | after, in the order of the files.
A measure only one side has shows ``-`` on the other (a scenario or target that did not exist).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["compare", "measures"]

#: Columns that identify a row beyond its variant (the table size, the workers ...).
_ROW_LABELS = ("keys", "rows", "size", "batch", "workers")
#: Correctness columns: compared as they are (they must stay 0 for stateguard).
_COUNTS = ("oversell", "double_applications", "lost_updates", "errors")


def _compared(column: str) -> bool:
    return column.startswith(("x_", "p50", "p95")) or column.endswith(("_x", "_per_s")) or column in _COUNTS


def _table_key(title: str) -> str:
    """A table's title without its parenthesised sizes and backend: the same table in both runs."""
    return re.sub(r"\s*\(.*$", "", title).strip()


def measures(data: dict[str, Any]) -> dict[tuple[str, str], Any]:
    """``{(table, measure): value}`` of one results file, in its order."""
    out: dict[tuple[str, str], Any] = {}
    for table in data["tables"]:
        key = _table_key(table["title"])
        for note in table.get("notes", []):
            if note.startswith("target"):
                name, _, value = note.partition(": ")
                out[key, re.sub(r"^target \(issue \d+\) ", "target ", name)] = value
        for row in table["rows"]:
            extra = " ".join(str(row[f]) for f in _ROW_LABELS if f in row)
            label = f"{row.get('variant', '?')}{' @' + extra if extra else ''}"
            for column, value in row.items():
                if _compared(column):
                    out[key, f"{label}: {column}"] = value
    return out


def _merged(paths: Iterable[Path]) -> dict[tuple[str, str], Any]:
    merged: dict[tuple[str, str], Any] = {}
    for path in paths:
        merged.update(measures(json.loads(path.read_text())))
    return merged


def compare(
    before: Sequence[Path], after: Sequence[Path], labels: tuple[str, str] = ("before", "after")
) -> str:
    """The Markdown table of ``before``'s and ``after``'s measures."""
    a, b = _merged(before), _merged(after)
    lines = [f"| table | measure | {labels[0]} | {labels[1]} |", "|---|---|---|---|"]
    for key in dict.fromkeys([*a, *b]):
        lines.append(f"| {key[0]} | {key[1]} | {a.get(key, '-')} | {b.get(key, '-')} |")
    return "\n".join(lines)
