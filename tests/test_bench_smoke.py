"""A tiny run of every benchmark scenario, so the harness cannot rot (the real runs are on demand)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from bench.__main__ import RUNNERS, main, run

from .conftest import Backend


def test_every_scenario_runs_with_tiny_sizes(backend: Backend) -> None:
    """Each scenario produces a table; stateguard never double-applies or oversells."""
    out = io.StringIO()
    tables = run([backend.url], None, quick=True, out=out)
    assert len(tables) == len(RUNNERS)
    by_title = {t.title.split(" ")[0]: t for t in tables}
    contention = by_title["2."]
    guarded = next(r for r in contention.rows if r["variant"] == "stateguard")
    assert guarded["double_applications"] == 0 and guarded["errors"] == 0
    assert guarded["applied"] == 20
    flash = by_title["3."]
    conditional = next(r for r in flash.rows if r["variant"].startswith("conditional"))
    assert conditional["oversell"] == 0 and conditional["sold"] == 10
    assert "variant" in out.getvalue()


def test_main_writes_json(sqlite: Backend, tmp_path: Path) -> None:
    """`python -m bench run --quick --only load` writes its tables and the machine description as JSON."""
    target = tmp_path / "r.json"
    assert main(["run", "--quick", "--only", "load", "--db", sqlite.url, "--json", str(target)]) == 0
    data = json.loads(target.read_text())
    assert data["meta"]["sqlalchemy"] and data["tables"][0]["rows"]
