"""``dialect.name`` is read only in ``stateguard/_kernel/``.

Outside the kernel a difference between databases is a named field of the
kernel's ``Backend``.  A read of ``dialect.name``, or a ``.name`` compared to a
dialect's name, anywhere else fails, but in the modules listed in
:data:`DIALECT_NAME_READERS` with the reason (each entry must still be needed).
"""

from __future__ import annotations

import ast

from tests.architecture._source import module_name, parse, source_files

#: Modules outside the kernel still reading ``dialect.name``, and why.
DIALECT_NAME_READERS: dict[str, str] = {}

#: Dialect names: comparing a ``.name`` to one is a dialect check.
DIALECT_NAMES = {"postgresql", "mysql", "mariadb", "sqlite", "cockroachdb", "oracle", "mssql"}


def dialect_name_reads(tree: ast.AST) -> list[int]:
    """Lines of ``<x>.dialect.name`` / ``dialect.name``, and of ``<x>.name`` compared to a dialect name."""
    found: list[int] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "name":
            value = node.value
            if (isinstance(value, ast.Attribute) and value.attr == "dialect") or (
                isinstance(value, ast.Name) and value.id == "dialect"
            ):
                found.append(node.lineno)
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(isinstance(n, ast.Attribute) and n.attr == "name" for n in sides)
            literals = {
                c.value
                for n in sides
                for c in ast.walk(n)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            }
            if named and literals & DIALECT_NAMES:
                found.append(node.lineno)
    return found


def dialect_name_readers() -> dict[str, list[int]]:
    """Modules outside ``stateguard._kernel`` (alembic revisions included) that read a dialect's name."""
    out: dict[str, list[int]] = {}
    for path in source_files(migrations=True):
        module = module_name(path)
        if module == "stateguard._kernel" or module.startswith("stateguard._kernel."):
            continue
        lines = dialect_name_reads(parse(path))
        if lines:
            out[module] = lines
    return out


def test_dialect_name_is_read_only_in_the_kernel() -> None:
    """Outside ``_kernel/`` a dialect difference is a named Backend field, never ``dialect.name``."""
    readers = dialect_name_readers()
    assert {m: lines for m, lines in readers.items() if m not in DIALECT_NAME_READERS} == {}
    assert sorted(set(DIALECT_NAME_READERS) - set(readers)) == []


# -- the check above must be able to fail --------------------------------------------------


def test_the_dialect_name_finder_finds_reads_and_comparisons() -> None:
    """Reads of ``dialect.name`` and ``.name`` compared to a dialect name count; a column's name does not."""
    source = (
        "a = conn.dialect.name\n"
        "b = dialect.name\n"
        "if backend.name in ('mysql', 'mariadb'): pass\n"
        "if column.name == 'id': pass\n"
        "c = backend.name\n"
    )
    assert dialect_name_reads(ast.parse(source)) == [1, 2, 3]
