"""``python -m bench.instructions``: the idempotency calls it counts under callgrind run as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.instructions import VARIANTS, main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_variant_runs_its_calls(variant: str) -> None:
    """Every variant makes its calls on the in-memory database and exits 0 (the first call's own
    checks raise if a key replays or a replay runs the work)."""
    assert main([variant, "5"]) == 0


@pytest.mark.parametrize("argv", [[], ["first"], ["nonsense", "5"], ["first", "-1"], ["first", "5", "x"]])
def test_a_wrong_command_line_is_usage_and_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert "usage: python -m bench.instructions" in capsys.readouterr().err


def test_it_runs_as_a_module() -> None:
    """The command the benchmarks page gives, without valgrind."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.instructions", "first", "3"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
