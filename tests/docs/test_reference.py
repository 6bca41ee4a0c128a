"""The reference pages that list things list all of them: tables, outcomes, errors, CLI commands."""

from __future__ import annotations

import re
from pathlib import Path

import stateguard
from stateguard import exceptions
from stateguard.tables import metadata

REFERENCE = Path(__file__).resolve().parent.parent.parent / "docs" / "reference"


def _tree() -> dict[str, str]:
    """Class name -> parent name, read from the tree drawn in the exceptions module's docstring."""
    assert exceptions.__doc__ is not None
    parents: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in exceptions.__doc__.splitlines():
        match = re.match(r"^\s{4}(?P<lead>[│ ]*(?:├── |└── )?)(?P<name>[A-Z]\w+)", line)
        if match is None or match["name"] not in exceptions.__all__:
            continue
        depth = len(match["lead"]) // 4
        while stack and stack[-1][0] >= depth:
            stack.pop()
        if stack:
            parents[match["name"]] = stack[-1][1]
        stack.append((depth, match["name"]))
    return parents


def test_the_errors_tree_is_the_class_hierarchy() -> None:
    """Every exported error is in the tree under its real stateguard base class, and nothing else is."""
    tree = _tree()
    expected = {}
    for name in exceptions.__all__:
        cls = getattr(exceptions, name)
        if name == "StateguardError":
            continue
        ours = [b for b in cls.__mro__[1:] if b.__module__ == exceptions.__name__]
        expected[name] = next(b.__name__ for b in ours if not b.__name__.startswith("_"))
    assert tree == expected


def test_the_tables_page_names_every_table() -> None:
    """Each table on stateguard's metadata has a row on the tables page."""
    page = (REFERENCE / "tables.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `(stateguard_\w+)` \|", page, re.MULTILINE))
    assert rows == set(metadata.tables)


def test_the_outcomes_page_names_every_outcome() -> None:
    """Each Outcome member has a row in the outcomes table, and the table has no other row."""
    page = (REFERENCE / "outcomes.md").read_text(encoding="utf-8")
    first_table = page.split("| outcome | meaning |", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \|", first_table, re.MULTILINE)
    assert rows == [o.name for o in stateguard.Outcome]
