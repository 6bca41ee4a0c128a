"""``stateguard demo --html FILE``: the demo's results as one self-contained HTML page.

No script, no external stylesheet, font or image: the charts are CSS bars
(one per variant, side by side), so the page renders the same offline, from a
CI artifact or an e-mail attachment::

    from stateguard.tooling.report import write_html

    write_html(run_demo(engine), "report.html")
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .demo.results import DemoReport, SchemeRow

__all__ = ["render_html", "write_html"]

#: The numbers charted per scheme, in order: (title, attribute of SchemeRow).
_METRICS = (
    ("damage", "damage_total"),
    ("APPLIED", "applied"),
    ("REPEATED", "repeated"),
    ("REJECTED", "rejected"),
    ("retried", "retried"),
    ("side effects", "side_effects"),
)

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 90em; color: #1d1d1f;
       padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 2em; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { padding: .25em .6em; border-bottom: 1px solid #ddd; text-align: right; white-space: nowrap; }
th:first-child, td:first-child, td.text, th.text { text-align: left; }
td.damage { white-space: normal; min-width: 16em; text-align: left; }
.scroll { overflow-x: auto; }
td.damage.bad { color: #b00020; font-weight: 600; } td.damage.good { color: #1b7f3b; font-weight: 600; }
.legend span { display: inline-block; margin-right: 1.5em; }
.swatch { display: inline-block; width: .9em; height: .9em; margin-right: .3em; vertical-align: -1px; }
.hand-written { background: #d9534f; } .stateguard { background: #2e8b57; }
.chart { display: grid; grid-template-columns: 9em 1fr; gap: .15em .8em; align-items: center;
         margin: .6em 0; }
.metric { grid-row: span 2; font-weight: 600; }
.track { background: #f1f1f1; height: 1.15em; position: relative; }
.bar { height: 100%; min-width: 1px; }
.value { position: absolute; left: .4em; top: 0; font-size: .8em; line-height: 1.45em; color: #000; }
ul.notes { color: #444; }
"""


def _bar(row: SchemeRow, metric: str, attribute: str, scale: int) -> str:
    value = int(getattr(row, attribute))
    width = 100.0 * value / scale if scale else 0.0
    return (
        f'<div class="track" data-scheme="{html.escape(row.scheme)}" data-code="{row.code}" '
        f'data-metric="{html.escape(metric)}" data-value="{value}">'
        f'<div class="bar {row.code}" style="width: {width:.1f}%"></div>'
        f'<span class="value">{row.code}: {value}</span></div>'
    )


def _damage_cell(row: SchemeRow) -> str:
    from .demo.render import damage_text

    cls = "bad" if row.damage_total else "good"
    return (
        f'<td class="text damage {cls}" data-damage="{row.damage_total}">{html.escape(damage_text(row))}</td>'
    )


def render_html(report: DemoReport) -> str:
    """The report as one HTML page (a string): the table, a bar chart per scheme, the explanations."""
    from .demo.render import COLUMNS, explanations

    esc = html.escape
    schemes: list[str] = []
    for row in report.rows:
        if row.scheme not in schemes:
            schemes.append(row.scheme)
    head = COLUMNS[:-1]  # the damage column comes with its own class
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>stateguard demo report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>stateguard demo: hand-written code vs stateguard on the same storm</h1>",
        f"<p>{report.orders} orders per scheme and variant, {report.workers} workers, seed {report.seed}, "
        + (
            f"in the {esc(report.namespace)}"
            if report.namespace.startswith("SQLite")
            else f"on <code>{esc(report.url)}</code>"
            + (f", in the {esc(report.namespace)}" if report.namespace else "")
        )
        + f"; finished in {report.elapsed:.1f}s.</p>",
        '<p class="verdict" id="verdict">'
        + (
            "stateguard held every invariant."
            if report.ok
            else "<strong>INVARIANT VIOLATED</strong> in a stateguard row: see the problems below."
        )
        + f" The hand-written code did damage in {sum(1 for r in report.rows if r.naive and r.damage_total)}"
        + f" of {sum(1 for r in report.rows if r.naive)} schemes on the same storms.</p>",
        '<div class="scroll"><table id="results"><thead><tr>'
        + "".join(f"<th{' class=text' if h in ('scheme', 'code') else ''}>{esc(h)}</th>" for h in head)
        + '<th class="text">damage (measured in the database)</th></tr></thead><tbody>',
    ]
    for row in report.rows:
        cells = [
            f'<td class="text">{esc(row.scheme)}</td>',
            f'<td class="text"><span class="swatch {row.code}"></span>{esc(row.code)}</td>',
            *(
                f"<td>{getattr(row, a)}</td>"
                for a in ("attempts", "applied", "repeated", "rejected", "retried", "side_effects")
            ),
            f"<td>{'ok' if row.held else 'VIOLATED'}</td>",
            _damage_cell(row),
        ]
        out.append(f'<tr data-scheme="{esc(row.scheme)}" data-code="{row.code}">{"".join(cells)}</tr>')
    out.append("</tbody></table></div>")
    out.append(
        '<p class="legend"><span><span class="swatch hand-written"></span>hand-written</span>'
        '<span><span class="swatch stateguard"></span>stateguard</span></p>'
    )
    for scheme in schemes:
        rows = [r for r in report.rows if r.scheme == scheme]
        out.append(f'<h2 id="{esc(scheme.replace(" ", "-"))}">{esc(scheme)}</h2>')
        out.append("<p>" + "<br>".join(f"{esc(r.code)}: {esc(r.how)}" for r in rows) + "</p>")
        out.append('<div class="chart">')
        for metric, attribute in _METRICS:
            scale = max(int(getattr(r, attribute)) for r in rows)
            out.append(f'<div class="metric" style="grid-row: span {len(rows)}">{esc(metric)}</div>')
            out.extend(_bar(r, metric, attribute, scale) for r in rows)
        out.append("</div>")
        damaged = [r for r in rows if r.damage]
        if damaged:
            out.append(
                "<p>"
                + "<br>".join(
                    f"damage, {esc(r.code)}: " + esc(", ".join(f"{n} {kind}" for kind, n in r.damage.items()))
                    for r in damaged
                )
                + "</p>"
            )
    out.append('<h2>What the numbers mean</h2><ul class="notes">')
    out.extend(f"<li>{esc(line)}</li>" for line in [*explanations(report), *report.notes])
    out.append("</ul>")
    problems = [p for r in report.rows if not r.naive for p in r.problems]
    if problems:
        out.append('<h2>Problems</h2><ul class="problems">')
        out.extend(f"<li>{esc(p)}</li>" for p in problems)
        out.append("</ul>")
    if report.afterwards:
        out.append(f"<p><small>{esc(report.afterwards)}</small></p>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def write_html(report: DemoReport, path: str | Path) -> Path:
    """Write :func:`render_html` of ``report`` to ``path`` (UTF-8) and return the path::

    write_html(report, "report.html")
    """
    target = Path(path)
    target.write_text(render_html(report), encoding="utf-8")
    return target
