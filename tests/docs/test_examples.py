"""Every runnable example of the docs (examples/**/*.py) runs as a reader would run it, and passes.

Pages include these files with ``{literalinclude}``; each is self-contained, asserts its own
outcome and uses a SQLite file in the current folder unless ``DATABASE_URL`` is set.  Each runs
as ``python -W error examples/<path>`` in a fresh folder: on SQLite, and when the file reads
``DATABASE_URL``, also on a private PostgreSQL schema and a private MariaDB database.  A comment
line in the file can say more::

    # docs-test: needs redis            REDIS_URL points at the test server (also zookeeper)
    # docs-test: backends postgresql    run on these databases only (sqlite, postgresql, mariadb)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.docs.test_code_blocks import servers_for

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLES = ROOT / "examples"
_DIRECTIVE = re.compile(r"^#\s*docs-test:\s*(?P<word>\w+)\s+(?P<rest>.+?)\s*$", re.MULTILINE)
_BACKENDS = ("sqlite", "postgresql", "mariadb")
#: One example's run is bounded: an example that hangs fails instead of stalling the suite.
TIMEOUT = 180


@dataclass
class Example:
    """One runnable example file and the databases it runs on."""

    path: Path
    backends: tuple[str, ...] = ("sqlite",)
    needs: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        inside = self.path.is_relative_to(EXAMPLES)
        return self.path.relative_to(EXAMPLES).as_posix() if inside else self.path.name


def read_example(path: Path) -> Example:
    """The example at ``path`` with what its ``# docs-test:`` comments say."""
    source = path.read_text(encoding="utf-8")
    example = Example(path, _BACKENDS if "DATABASE_URL" in source else ("sqlite",))
    for match in _DIRECTIVE.finditer(source):
        words = {w.strip() for w in match["rest"].split(",")}
        if match["word"] == "needs" and words <= {"redis", "zookeeper"}:
            example.needs |= words
        elif match["word"] == "backends" and words <= set(_BACKENDS):
            example.backends = tuple(b for b in _BACKENDS if b in words)
        else:
            raise ValueError(f"examples/{example.name}: unknown docs-test comment {match[0]!r}")
    return example


EXAMPLE_FILES = [read_example(p) for p in sorted(EXAMPLES.rglob("*.py")) if p.name != "__init__.py"]
CASES = [(example, backend) for example in EXAMPLE_FILES for backend in example.backends]


@pytest.mark.parametrize(
    ("example", "backend"), CASES, ids=[f"{example.name}-{backend}" for example, backend in CASES]
)
def test_example_runs_and_passes(
    example: Example, backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example exits 0 (its own asserts hold) on the database, without a warning."""
    needs = set(example.needs) | ({backend} if backend != "sqlite" else set())
    with servers_for(needs, monkeypatch):
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PYTHONPATH=path)
        done = subprocess.run(
            [sys.executable, "-W", "error", str(example.path)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
    assert done.returncode == 0, (
        f"examples/{example.name} on {backend} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    )


def test_every_example_is_on_a_page() -> None:
    """Each example file is included by some page (an example no page shows is dead weight)."""
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    text = "\n".join(p.read_text(encoding="utf-8") for p in pages if "_build" not in p.parts)
    missing = [e.name for e in EXAMPLE_FILES if f"examples/{e.name}" not in text]
    assert missing == []


def test_directives_are_read(tmp_path: Path) -> None:
    """``# docs-test:`` comments choose servers and backends; an unknown one is refused."""
    plain = tmp_path / "plain.py"
    plain.write_text("print('hi')\n")
    assert read_example(plain).backends == ("sqlite",)
    url = tmp_path / "url.py"
    url.write_text("# docs-test: needs redis\nimport os\nos.environ.get('DATABASE_URL')\n")
    assert (read_example(url).backends, read_example(url).needs) == (_BACKENDS, {"redis"})
    only = tmp_path / "only.py"
    only.write_text("# docs-test: backends postgresql\nDATABASE_URL = 1\n")
    assert read_example(only).backends == ("postgresql",)
    bad = tmp_path / "bad.py"
    bad.write_text("# docs-test: needs kafka\n")
    with pytest.raises(ValueError, match="unknown docs-test comment"):
        read_example(bad)
