"""The demo's result table as terminal text, and what its columns mean on this run's database.

:func:`render` draws the table (ANSI colours on request), the explanations
under it (:func:`explanations`) and the verdict; :data:`COLUMNS`,
:func:`damage_text` and :func:`explanations` are shared with the HTML page
(:mod:`stateguard.tooling.report`).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from .results import DemoReport, SchemeRow
from .storm import DemoRun

__all__ = ["COLUMNS", "damage_text", "explanations", "render"]

_GREEN = "\x1b[32m"
_RED = "\x1b[1;31m"
_BOLD = "\x1b[1m"
_DIM = "\x1b[2m"
_RESET = "\x1b[0m"

#: The columns of the results table (the terminal's and the HTML page's).
COLUMNS = (
    "scheme",
    "code",
    "attempts",
    "APPLIED",
    "REPEATED",
    "REJECTED",
    "retried",
    "side effects",
    "invariant",
    "damage (measured in the database afterwards)",
)

_BACKENDS = {"postgresql": "PostgreSQL", "mariadb": "MariaDB/MySQL", "sqlite": "SQLite"}

#: What "retried" counts for the storms of one database unit of work per delivery, by dialect.
_RETRIED = {
    "postgresql": "serialization failures and deadlocks PostgreSQL reported (40001, 40P01)",
    "mariadb": "deadlocks and lock wait timeouts InnoDB reported (1213, 1205)",
    "sqlite": "SQLITE_BUSY, 'database is locked': a transaction whose read went stale before it wrote",
}


def damage_text(row: SchemeRow) -> str:
    """``"12 double charges, 3 lost updates"``, or ``"none"`` when every kind is 0::

    damage_text(row)   # 'none (0 double charges, 0 lost updates)' for a stateguard row
    """
    kinds = ", ".join(f"{n} {kind}" for kind, n in row.damage.items())
    if not row.damage:
        return "-"
    return kinds if row.damage_total else f"none ({kinds})"


def explanations(report: DemoReport) -> list[str]:
    """The lines under the table that say what its numbers mean on this run's database::

    for line in explanations(report):
        print(line)
    """
    here = _RETRIED.get(report.dialect)
    others = [f"{name}: {_RETRIED[key]}" for key, name in _BACKENDS.items() if key != report.dialect]
    naive = [r for r in report.rows if r.naive]
    out = [
        "code: hand-written = the usual code (load, check in Python, save; SELECT then INSERT; "
        "read-modify-write stock; the Idempotency-Key header ignored; a consumer without deduplication), "
        "stateguard = the same requests, delivered the same way, through stateguard",
        "attempts = deliveries (each request 2-4 times); APPLIED = calls that changed something and ran "
        "the side effect; REPEATED = already done (a duplicate answered as such); REJECTED = not allowed "
        "in the row's state any more",
        "retried = deliveries re-run whole by retry_on_conflict because the database refused them"
        + (f"; here ({_BACKENDS.get(report.dialect, report.dialect)}): {here}" if here else "")
        + f"; on {'; on '.join(others)}; the optimistic row adds its STALE re-runs (the version moved "
        "between read and write); the HTTP row counts 409 (in progress) and 503 answers resent",
        "damage = counted with SQL in the tables afterwards (side-effect rows per order and action, the "
        "stock row, row versions, the inbox), never computed from the outcomes; stateguard's rows are "
        "counted the same way",
        "nothing widens the race windows: no sleeps in the hand-written code, which is raced only by the "
        "storm's own twins and redeliveries (the HTTP handler's 10 ms provider call is the same in both "
        "variants)",
    ]
    if report.dialect == "sqlite" and naive:
        out.append(
            "on SQLite the hand-written code runs on a plain create_engine(), as most applications do: "
            "pysqlite begins the transaction at the first write, so the SELECT reads outside it and the "
            "check can be stale; SQLite lets one writer in at a time, which does not help a check made "
            "before the write. stateguard runs on stateguard.sqlite_engine() (real BEGINs); there the "
            "hand-written code would be refused at its first write whenever its read went stale "
            "(SQLITE_BUSY) and would have to be re-run whole"
        )
    return out


def render(report: DemoReport, *, color: bool = False) -> str:
    """The result table as text (ANSI colours only when ``color``)::

    print(render(run_demo(engine), color=sys.stdout.isatty()))
    """

    def paint(text: str, code: str) -> str:
        return f"{code}{text}{_RESET}" if color else text

    cells: list[tuple[str, ...]] = [
        (
            row.scheme,
            row.code,
            str(row.attempts),
            str(row.applied),
            str(row.repeated),
            str(row.rejected),
            str(row.retried),
            str(row.side_effects),
            "ok" if row.held else "VIOLATED",
            damage_text(row),
        )
        for row in report.rows
    ]
    widths = [max(len(c[i]) for c in [COLUMNS, *cells]) for i in range(len(COLUMNS))]

    def line(values: Sequence[str], verdict_code: str | None = None) -> str:
        # scheme and code left, counts right, verdict and damage left; the long
        # damage goes last so it never pushes the numbers apart.
        parts = [values[0].ljust(widths[0]), values[1].ljust(widths[1])]
        parts.extend(v.rjust(w) for v, w in zip(values[2:-2], widths[2:-2], strict=True))
        verdict = values[-2].ljust(widths[-2])
        parts.append(paint(verdict, verdict_code) if verdict_code else verdict)
        parts.append(values[-1])
        return "  ".join(parts).rstrip()

    if report.namespace.startswith("SQLite"):
        where = f"in the {report.namespace}"
    else:
        where = f"on {report.url}" + (f", in the {report.namespace}" if report.namespace else "")
    out = [
        paint(
            f"stateguard demo: {report.orders} orders per scheme and variant, {report.workers} workers, "
            f"seed {report.seed}, {where}",
            _BOLD,
        ),
        "each request is sent 2-4 times: twins at the same instant, redeliveries later; every scheme",
        "runs the same storm twice, through hand-written code and through stateguard; only an APPLIED",
        "call records its side effect (in the same transaction)",
        "",
        paint(line(COLUMNS), _BOLD),
    ]
    for row, values in zip(report.rows, cells, strict=True):
        code = None
        if color:
            code = _GREEN if row.held else (_RED if not row.naive else _BOLD)
        out.append(line(values, code))
    out.append("")
    for text_line in explanations(report):
        out.extend(textwrap.wrap(text_line, 100, subsequent_indent="    ", break_on_hyphens=False))
    for row in report.rows:
        if row.other:
            extra = ", ".join(f"{k} {v}" for k, v in sorted(row.other.items()))
            out.append(f"{DemoRun.key(row.scheme, row.code)}: also {extra}")
    out.extend(f"{row.scheme}: {row.code} = {row.how}" for row in report.rows)
    out.extend(report.notes)
    for row in report.rows:
        if not row.naive:
            out.extend(paint(p, _RED) for p in row.problems)
        elif row.other.get("errors"):
            out.extend(paint(p, _RED) for p in row.problems if p.split(": ", 1)[-1].startswith("unexpected"))
    naive = [r for r in report.rows if r.naive]
    damaged = sum(1 for r in naive if r.damage_total)
    if report.ok:
        verdict = (
            "stateguard: invariant held in every scheme (side effects == APPLIED, at most one per (order, "
            f"trigger), no damage); the hand-written code did damage in {damaged} of {len(naive)} schemes "
            "on the same storms"
        )
    else:
        verdict = "INVARIANT VIOLATED: see the problems above"
    out.append(paint(verdict, _GREEN if report.ok else _RED))
    out.append(paint(f"finished in {report.elapsed:.1f}s; {report.afterwards}".rstrip("; "), _DIM))
    return "\n".join(out)
