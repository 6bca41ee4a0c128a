"""``python -m bench compare``: two runs' results side by side, from real ``bench run`` output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.__main__ import main
from bench.compare import compare, measures


def _run(tmp_path: Path, name: str) -> Path:
    """A real quick run of the single-transition scenario on a private SQLite file."""
    out = tmp_path / f"{name}.json"
    db = f"sqlite:///{tmp_path / name}.db"
    assert main(["run", "--db", db, "--quick", "--only", "single", "--json", str(out)]) == 0
    return out


def test_two_runs_compare_every_target_and_ratio_side_by_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every target note and every x_ column of the run is a row with both sides' values."""
    before, after = _run(tmp_path, "before"), _run(tmp_path, "after")
    capsys.readouterr()
    assert main(["compare", "--before", str(before), "--after", str(after), "--labels", "old", "new"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "| table | measure | old | new |"
    data = json.loads(after.read_text())
    found = measures(data)
    targets = [k for k in found if k[1].startswith("target")]
    ratios = [k for k in found if k[1].endswith(": x_core")]
    assert targets and len(ratios) == len(data["tables"][0]["rows"])
    for key in targets + ratios:
        before_value = measures(json.loads(before.read_text()))[key]
        assert f"| {key[0]} | {key[1]} | {before_value} | {found[key]} |" in table


def test_a_measure_only_one_side_has_shows_a_dash(tmp_path: Path) -> None:
    """A scenario (or target) that one tree lacks is '-' on that side, not dropped."""

    def results(variant: str, note: str) -> Path:
        path = tmp_path / f"{variant}.json"
        table = {"title": "9. t (sqlite)", "rows": [{"variant": variant, "x_core": 1.5}], "notes": [note]}
        path.write_text(json.dumps({"meta": {}, "tables": [table]}))
        return path

    out = compare([results("old", "target a <= 1x: 0.9x, met")], [results("new", "target b: 2x")])
    assert "| 9. t | old: x_core | 1.5 | - |" in out
    assert "| 9. t | new: x_core | - | 1.5 |" in out
    assert "| 9. t | target a <= 1x | 0.9x, met | - |" in out
    assert "| 9. t | target b | - | 2x |" in out
