"""PNG charts of a results file: ``python -m bench report [PATH] --plots DIR``.

One PNG per table of the run (one scenario on one database): a row of
horizontal bar panels, one per numeric column, with the variants on the same
axis in every panel, so the numbers per variant stand side by side.  Ratio
columns (``x_...``) get a line at 1.0; stateguard's own variants are drawn in
a colour of their own.  Every chart carries the command, machine and load
average of the run it was drawn from, and says so when that run was
``--quick`` (tiny sizes: a smoke run, not a measurement).

Needs matplotlib (``pip install -e '.[bench]'``); the Markdown report does not.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

#: Colours: stateguard's variants, everything else, and the 1.0 line of ratio panels.
STATEGUARD = "#1f6feb"
OTHER = "#9aa4b2"
ONE = "#d1242f"


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed: ``pip install -e '.[bench]'``."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as error:
        raise PlotsUnavailable(
            "bench report --plots needs matplotlib: pip install -e '.[bench]' (or pip install matplotlib); "
            "the Markdown report works without it"
        ) from error
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def slug(title: str) -> str:
    """A file name for a table title.

    ``"1. single transition, no contention (sqlite, ...)"`` -> ``"1-single-transition-no-contention-sqlite"``.
    """
    head, _, rest = title.partition(" ")
    number = head.rstrip(".")
    words = re.sub(r"\(.*", "", rest).strip()
    dialect = re.search(r"\((\w+)", rest)
    parts = [number, words] + ([dialect.group(1)] if dialect else [])
    text = re.sub(r"[^a-z0-9]+", "-", " ".join(parts).lower()).strip("-")
    return text[:80].rstrip("-")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def columns(rows: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """(label columns, numeric columns) of a table's rows.

    A column is numeric when some row holds a finite number there (a row
    saying ``"n/a (raw)"`` instead gets no bar, only that text); the others
    (variant, workers, ...) label the bars.  A table whose columns are all
    numeric (table size, ...) is labelled by its first column.
    """
    names = list(rows[0])
    numeric = [c for c in names if any(_is_number(r.get(c)) for r in rows)]
    labels = [c for c in names if c not in numeric]
    if not labels:
        labels, numeric = [names[0]], numeric[1:]
    return labels, numeric


def _label(row: dict[str, Any], labels: list[str]) -> str:
    first, *more = (str(row.get(c, "")) for c in labels)
    return first + (f" ({', '.join(more)})" if more else "")


def _caption(meta: dict[str, Any]) -> str:
    command = str(meta.get("command", "?"))
    quick = " [--quick run: tiny sizes, a smoke run, NOT a measurement]" if "--quick" in command else ""
    return (
        f"{command}{quick}\n{meta.get('machine', '?')}; load average {meta.get('load_start', '?')} "
        f"at start, {meta.get('load_end', '?')} at end; SQLAlchemy {meta.get('sqlalchemy', '?')}"
    )


def plot_table(table: dict[str, Any], meta: dict[str, Any], path: Path) -> bool:
    """Draw one table to ``path`` (PNG); False when it has no numeric column to draw."""
    rows: list[dict[str, Any]] = table["rows"]
    if not rows:
        return False
    labels, numeric = columns(rows)
    if not numeric:
        return False
    plt = _pyplot()
    names = [_label(r, labels) for r in rows]
    colours = [STATEGUARD if "stateguard" in n.lower() else OTHER for n in names]
    per_row = min(3, len(numeric))
    panel_rows = math.ceil(len(numeric) / per_row)
    height = max(1.2, 0.32 * len(rows) + 0.9)
    fig_height = height * panel_rows + 1.4
    fig, axes = plt.subplots(
        panel_rows,
        per_row,
        figsize=(4.6 * per_row + 2.6, fig_height),
        squeeze=False,
        sharey=True,
    )
    positions = list(range(len(rows)))
    for index, ax in enumerate(axes.flat):
        if index >= len(numeric):
            ax.set_visible(False)
            continue
        column = numeric[index]
        cells = [r.get(column) for r in rows]
        values = [float(v) if _is_number(v) else 0.0 for v in cells]
        ax.barh(positions, values, color=colours)
        ax.set_title(column, fontsize=9)
        ax.tick_params(labelsize=8)
        if column.startswith("x_"):
            ax.axvline(1.0, color=ONE, linewidth=1)
        top = max(values) if values else 0.0
        for y, value, cell in zip(positions, values, cells, strict=True):
            if not _is_number(cell):
                text = str(cell)
            else:
                text = f"{value:g}" if abs(value) < 1e5 else f"{value:.3g}"
            ax.text(value + top * 0.01, y, text, va="center", fontsize=7)
        ax.set_xlim(0, (top or 1.0) * 1.22)
        ax.set_yticks(positions)
        ax.set_yticklabels(names)
    axes.flat[0].invert_yaxis()  # first row on top (the panels share this axis: invert it once)
    quick = "[--quick smoke run, tiny sizes] " if "--quick" in str(meta.get("command", "")) else ""
    fig.suptitle(quick + table["title"], fontsize=10, wrap=True)
    fig.text(0.01, 0.005, _caption(meta), fontsize=6.5, va="bottom", color="#444444")
    for row_axes in axes:
        row_axes[0].set_ylabel(" / ".join(labels), fontsize=8)
    # Room in inches for the caption below and the title above, whatever the figure's height.
    fig.tight_layout(rect=(0, 0.5 / fig_height, 1, 1 - 0.45 / fig_height))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def file_names(data: dict[str, Any]) -> dict[str, str]:
    """``{table title: PNG file name}`` for the tables of a results file that have numbers to draw."""
    names: dict[str, str] = {}
    for table in data["tables"]:
        if not table["rows"] or not columns(table["rows"])[1]:
            continue
        name = slug(table["title"])
        while f"{name}.png" in names.values():
            name += "-2"
        names[table["title"]] = f"{name}.png"
    return names


def write_plots(data: dict[str, Any], directory: Path, only: set[str] | None = None) -> dict[str, Path]:
    """One PNG per table with numbers in ``directory`` (``only``: these titles): ``{title: path}``."""
    written: dict[str, Path] = {}
    names = file_names(data)
    for table in data["tables"]:
        title = table["title"]
        if title in names and (only is None or title in only):
            path = directory / names[title]
            if plot_table(table, data["meta"], path):
                written[title] = path
    return written
