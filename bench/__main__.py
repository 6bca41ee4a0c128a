"""``python -m bench run [--db URL ...] [--quick] [--only NAME ...] [--json PATH]``

Prints one table per scenario and database and writes them as JSON.  Every
comparison runs in the same process, on the same database, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import sqlalchemy

from . import scenarios
from .scenarios import Table

DEFAULT_DBS = [
    "sqlite:///bench-stateguard.db",
    "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "mysql+pymysql://root@127.0.0.1:3306/test",
]

SIZES = {
    # name: (full, quick)
    "single": ({"n": 3000}, {"n": 20}),
    "contention": ({"orders": 300, "workers": 8}, {"orders": 20, "workers": 3}),
    "flash": ({"stock": 500, "buyers": 8, "per_buyer": 100}, {"stock": 10, "buyers": 3, "per_buyer": 5}),
    "load": ({"n": 5000, "repeat": 15}, {"n": 100, "repeat": 2}),
    "bulk": ({"n": 10000}, {"n": 50}),
    "scale": ({"sizes": [1000, 100_000, 1_000_000], "calls": 500}, {"sizes": [100, 1000], "calls": 10}),
}

RUNNERS: dict[str, Any] = {
    "single": scenarios.single_transition,
    "contention": scenarios.contention,
    "flash": scenarios.flash_sale,
    "load": scenarios.load_cost,
    "bulk": scenarios.bulk,
    "scale": scenarios.scale,
}


def render(table: Table) -> str:
    if not table.rows:
        return f"{table.title}\n  (no rows)\n"
    cols = list(table.rows[0])
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in table.rows)) for c in cols}
    lines = [table.title, "  " + "  ".join(c.ljust(widths[c]) for c in cols)]
    for r in table.rows:
        lines.append("  " + "  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols))
    lines += [f"  note: {n}" for n in table.notes]
    return "\n".join(lines) + "\n"


def run(dbs: list[str], only: list[str] | None, quick: bool, out: Any = sys.stdout) -> list[Table]:
    tables: list[Table] = []
    for url in dbs:
        for name, runner in RUNNERS.items():
            if only and name not in only:
                continue
            if name == "bulk" and not quick and not url.startswith("postgresql"):
                continue  # the bulk target is stated for PostgreSQL
            if name == "scale" and not quick and not url.startswith("postgresql"):
                continue
            kwargs = SIZES[name][1 if quick else 0]
            t0 = time.perf_counter()
            table = runner(url, **kwargs)
            table.notes.append(f"took {time.perf_counter() - t0:.1f}s")
            tables.append(table)
            print(render(table), file=out, flush=True)
    return tables


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the scenarios")
    r.add_argument(
        "--db", action="append", help="database URL (repeatable); default: SQLite, PostgreSQL, MariaDB"
    )
    r.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    r.add_argument("--only", action="append", choices=sorted(RUNNERS), help="run only these scenarios")
    r.add_argument("--json", default="bench/results/latest.json", help="where to write the results")
    args = parser.parse_args(argv)
    tables = run(args.db or DEFAULT_DBS, args.only, args.quick)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "python": platform.python_version(),
        "sqlalchemy": sqlalchemy.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
        "command": "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    path.write_text(json.dumps({"meta": meta, "tables": [asdict(t) for t in tables]}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
