"""``python -m bench run [--db URL ...] [--quick] [--only SCENARIO ...] [--json PATH]``

Prints one table per scenario and database and writes them, with the machine
and server versions, as JSON.  Every comparison runs in the same process, on
the same database, in the same run.  ``python -m bench report [PATH]`` turns
a JSON file into the Markdown of docs/development/benchmarks.md (``--plots DIR``: and PNG charts);
``python -m bench compare --before A.json ... --after B.json ...`` puts two trees' results side by
side (:mod:`bench.compare`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import sqlalchemy

from . import idempotency, locks, observe, relay, scenarios, striped
from .models import Table, make_engine, server_version

DEFAULT_DBS = [
    "sqlite:///bench-stateguard.db",
    "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "mysql+pymysql://root@127.0.0.1:3306/test",
]
DEFAULT_JSON = "bench/results/latest.json"

#: name: (full sizes, --quick sizes)
SIZES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "single": ({"n": 1500}, {"n": 20}),
    "contention": ({"orders": 300, "workers": 8}, {"orders": 20, "workers": 3}),
    "flash": (
        {"stock": 250, "buyers": 8, "per_buyer": 50, "rounds": 3},
        {"stock": 10, "buyers": 3, "per_buyer": 5, "rounds": 1},
    ),
    "idempotency": (
        {"sizes": [1000, 1_000_000], "calls": 2000, "breakdown": False},
        {"sizes": [1000, 10_000], "calls": 10, "breakdown": False},
    ),
    "load": ({"n": 5000, "repeat": 25}, {"n": 100, "repeat": 2}),
    "bulk": ({"n": 10000}, {"n": 50}),
    "scale": ({"sizes": [1000, 100_000, 1_000_000], "calls": 300}, {"sizes": [100, 1000], "calls": 10}),
    "relay": (
        {"events": 20_000, "rounds": 4, "batches": [100, 500], "holds": [None]},
        {"events": 200, "rounds": 1, "batches": [100, 500], "holds": [None]},
    ),
    "events": ({"n": 1000}, {"n": 10}),
    "latency": ({"rate": 1000, "seconds": 10, "producers": 2}, {"rate": 100, "seconds": 1, "producers": 2}),
    "locks": ({"workers": 8, "ops": 50, "rounds": 3}, {"workers": 2, "ops": 3, "rounds": 1}),
    "observe": ({"n": 1500}, {"n": 20}),
    "striped": (
        {"buyers": 8, "per_buyer": 250, "rounds": 5, "stripes": 8},
        {"buyers": 3, "per_buyer": 5, "rounds": 1, "stripes": 4},
    ),
}

RUNNERS: dict[str, Any] = {
    "single": scenarios.single_transition,
    "contention": scenarios.contention,
    "flash": scenarios.flash_sale,
    "idempotency": idempotency.idempotency_keys_scenario,
    "load": scenarios.load_cost,
    "bulk": scenarios.bulk,
    "scale": scenarios.scale,
    "relay": relay.relay_scenario,
    "events": relay.events_cost,
    "latency": relay.latency_scenario,
    "locks": locks.lock_comparison,
    "observe": observe.observe_cost,
    "striped": striped.striped_flash_sale,
}

#: Full runs of these scenarios only on these dialects (the issue states their targets there).
ONLY_ON = {"bulk": ("postgresql",), "locks": ("postgresql",)}


def render(table: Table) -> str:
    """A table as aligned plain text."""
    if not table.rows:
        return f"{table.title}\n  (no rows)\n"
    cols = list(table.rows[0])
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in table.rows)) for c in cols}
    lines = [table.title, "  " + "  ".join(c.ljust(widths[c]) for c in cols)]
    for r in table.rows:
        lines.append("  " + "  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols))
    lines += [f"  note: {n}" for n in table.notes]
    return "\n".join(lines) + "\n"


def markdown(data: dict[str, Any], images: dict[str, str] | None = None) -> str:
    """A results file (as written by ``run``) as Markdown; ``images``: {table title: PNG link}."""
    meta = data["meta"]
    out = [
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}; load average at start {meta.get('load_start', '?')}, "
        f"at end {meta.get('load_end', '?')}  ",
        f"Python {meta['python']}, SQLAlchemy {meta['sqlalchemy']}, drivers {meta.get('drivers', '?')}  ",
        "Servers: " + "; ".join(f"{v}" for v in meta.get("servers", {}).values()),
        "",
    ]
    for t in data["tables"]:
        out.append(f"#### {t['title']}")
        out.append("")
        if images and t["title"] in images:
            out += [f"![{t['title']}]({images[t['title']]})", ""]
        if t["rows"]:
            cols = list(t["rows"][0])
            out.append("| " + " | ".join(cols) + " |")
            out.append("|" + "|".join("---" for _ in cols) + "|")
            for r in t["rows"]:
                out.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
        out.append("")
        out += [f"- {n}" for n in t["notes"]]
        out.append("")
    return "\n".join(out)


def report(path: Path, plots: Path | None, relative_to: Path, out: Any = sys.stdout) -> int:
    """Print ``path`` as Markdown; with ``plots``, write its PNG charts there and link them."""
    data = json.loads(path.read_text())
    images: dict[str, str] = {}
    if plots:
        from .plots import PlotsUnavailable, write_plots

        try:
            written = write_plots(data, plots)
        except PlotsUnavailable as error:
            print(f"bench report: {error}", file=sys.stderr)
            return 2
        images = {title: os.path.relpath(png, relative_to) for title, png in written.items()}
        print(f"wrote {len(written)} charts to {plots}", file=sys.stderr)
    print(markdown(data, images), file=out)
    return 0


def overrides(pairs: list[str], only: list[str] | None, quick: bool) -> dict[str, Any]:
    """``--set name=value`` pairs as keyword arguments (``value`` is JSON: ``calls=3000``,
    ``sizes=[1000]``); each name must be a size of every scenario run (see :data:`SIZES`)."""
    chosen = [name for name in RUNNERS if not only or name in only]
    found: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set takes name=value, got {pair!r}")
        missing = [c for c in chosen if name not in SIZES[c][1 if quick else 0]]
        if missing:
            raise SystemExit(
                f"--set {name}: not a size of {', '.join(missing)} (pick the scenario with --only)"
            )
        try:
            found[name] = json.loads(value)
        except json.JSONDecodeError as error:
            raise SystemExit(f"--set {name}: the value must be JSON ({error})") from None
    return found


def run(
    dbs: list[str],
    only: list[str] | None,
    quick: bool,
    out: Any = sys.stdout,
    sizes: dict[str, Any] | None = None,
) -> list[Table]:
    """Run the scenarios on every database in turn; print each table as it is done.

    ``sizes`` replace the scenarios' own (``--set``).
    """
    tables: list[Table] = []
    for url in dbs:
        dialect = sqlalchemy.make_url(url).get_backend_name()
        for name, runner in RUNNERS.items():
            if only and name not in only:
                continue
            if not quick and name in ONLY_ON and dialect not in ONLY_ON[name]:
                continue
            kwargs = {**SIZES[name][1 if quick else 0], **(sizes or {})}
            t0 = time.perf_counter()
            table = runner(url, **kwargs)
            table.notes.append(f"took {time.perf_counter() - t0:.1f}s")
            tables.append(table)
            print(render(table), file=out, flush=True)
    return tables


def _machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _drivers() -> str:
    import importlib.metadata as md

    found = []
    for dist in ("psycopg", "PyMySQL"):
        with contextlib.suppress(md.PackageNotFoundError):
            found.append(f"{dist} {md.version(dist)}")
    return ", ".join(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the scenarios")
    r.add_argument(
        "--db", action="append", help="database URL (repeatable); default: SQLite, PostgreSQL, MariaDB"
    )
    r.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run, seconds)")
    r.add_argument(
        "--only", action="append", choices=sorted(RUNNERS), help="run only this scenario (repeatable)"
    )
    r.add_argument(
        "--json", default=DEFAULT_JSON, help=f"where to write the results (default {DEFAULT_JSON})"
    )
    r.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="replace one size of the scenarios run, e.g. --only idempotency --set calls=3000 "
        "--set 'sizes=[1000]' (repeatable)",
    )
    rep = sub.add_parser("report", help="print a results file as Markdown")
    rep.add_argument("path", nargs="?", default=DEFAULT_JSON)
    rep.add_argument(
        "--plots", metavar="DIR", help="also write one PNG chart per table to DIR (needs matplotlib)"
    )
    rep.add_argument(
        "--relative-to",
        metavar="DIR",
        default=".",
        help="link the charts in the Markdown relative to DIR, where it will live (default: here)",
    )
    cmp = sub.add_parser("compare", help="two trees' results side by side, as one Markdown table")
    cmp.add_argument("--before", nargs="+", required=True, type=Path, metavar="JSON")
    cmp.add_argument("--after", nargs="+", required=True, type=Path, metavar="JSON")
    cmp.add_argument(
        "--labels",
        nargs=2,
        default=("before", "after"),
        metavar=("BEFORE", "AFTER"),
        help="the two columns' headings (default: before after)",
    )
    args = parser.parse_args(argv)
    if args.command == "compare":
        from .compare import compare

        print(compare(args.before, args.after, tuple(args.labels)))
        return 0
    if args.command == "report":
        return report(Path(args.path), args.plots and Path(args.plots), Path(args.relative_to))
    sizes = overrides(args.set, args.only, args.quick)
    dbs = args.db or DEFAULT_DBS
    servers = {}
    for url in dbs:
        engine = make_engine(url)
        try:
            servers[url] = server_version(engine)
        finally:
            engine.dispose()
    meta = {
        "python": platform.python_version(),
        "sqlalchemy": sqlalchemy.__version__,
        "drivers": _drivers(),
        "machine": _machine(),
        "servers": servers,
        "load_start": _load(),
        "command": "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print(f"{meta['machine']}; Python {meta['python']}, SQLAlchemy {meta['sqlalchemy']}", flush=True)
    tables = run(dbs, args.only, args.quick, sizes=sizes)
    meta["load_end"] = _load()
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "tables": [asdict(t) for t in tables]}, indent=2, default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
