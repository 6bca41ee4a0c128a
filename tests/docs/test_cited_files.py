"""The docs, the README and the package's own comments cite only files the repository holds.

A test file moved to its feature's folder, or a module split into a package, leaves every
sentence that named the old path pointing at nothing; a reader (or a maintainer running the
command it shows) finds no such file.  The benchmarks page is a log of past measurements: its
entries name files as they were at the commit they cite, so it is not held to today's tree.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: A repository path of a source, test or example file: what a reader can open or run.
CITED = re.compile(
    r"(?:(?<=\.\./)|(?<![\w/.-]))(?:tests|stateguard|examples|bench)/[\w/.-]*\w\.(?:py|md|toml)\b"
)
#: Pages whose entries are history, naming files as of the commit each entry cites.
HISTORY = {Path("docs/development/benchmarks.md")}


def _texts() -> list[Path]:
    pages = [p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts]
    return [ROOT / "README.md", *pages, *(ROOT / "stateguard").rglob("*.py")]


def _missing(root: Path, paths: list[Path]) -> dict[str, list[str]]:
    """Per file of ``paths`` (under ``root``), the repository paths it cites that ``root`` lacks."""
    missing: dict[str, list[str]] = {}
    for path in paths:
        relative = path.relative_to(root)
        if relative in HISTORY:
            continue
        for cited in sorted(set(CITED.findall(path.read_text(encoding="utf-8")))):
            # A page's ``../../examples/x.py`` names the same file as the bare path from the root.
            if not (root / cited).exists():
                missing.setdefault(str(relative), []).append(cited)
    return missing


def test_every_cited_file_exists() -> None:
    """Each path like ``tests/redis/test_failover.py`` in the README, a docs page or a module exists."""
    assert _missing(ROOT, _texts()) == {}


def test_a_stale_path_is_reported(tmp_path: Path) -> None:
    """The check itself finds a path that is not there (and not one that is)."""
    (tmp_path / "tests" / "docs").mkdir(parents=True)
    (tmp_path / "tests" / "docs" / "test_here.py").write_text("", encoding="utf-8")
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "see tests/docs/test_here.py, ../../tests/docs/test_here.py, tests/test_gone.py, "
        "../../examples/gone.py and /elsewhere/tests/not_ours.py\n",
        encoding="utf-8",
    )
    assert _missing(tmp_path, [page]) == {"docs/page.md": ["examples/gone.py", "tests/test_gone.py"]}
