"""What the architecture tests read stateguard's source with: its modules, parsed by ``ast``.

The module walker (:func:`source_files`, :func:`module_name`, :func:`package_of`), the
run-time imports of each module resolved to absolute names (:class:`Import`,
:func:`imports_in`; an import under ``if TYPE_CHECKING:`` is not one, a function-level
import is), and the import graph built from them (:func:`targets`,
:func:`import_graph`, :func:`find_cycle`).  The tests of each house rule are in the
``test_*`` modules beside this one.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "stateguard"
ROOT = "stateguard"


@dataclass(frozen=True)
class Import:
    """One import statement of a stateguard module, resolved to absolute names."""

    importer: str
    module: str
    names: tuple[str, ...]
    line: int


def module_name(path: Path) -> str:
    """The dotted name of the stateguard module at ``path`` (a package's ``__init__`` is the package)."""
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str, path: Path) -> str:
    """The package a module belongs to (a package's ``__init__`` belongs to the package itself)."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def source_files(*, migrations: bool = False) -> list[Path]:
    """Every module of stateguard/, the alembic revisions under migrations/ only with ``migrations``
    (they are loaded by alembic from their files, not imported as modules of the package)."""
    return sorted(
        p
        for p in PACKAGE_DIR.rglob("*.py")
        if migrations or "migrations" not in p.relative_to(PACKAGE_DIR).parts
    )


@functools.cache
def parse(path: Path) -> ast.Module:
    """The syntax tree of the module at ``path`` (parsed once a test run; nothing may change it)."""
    return ast.parse(path.read_text(), str(path))


def is_private(name: str) -> bool:
    """Whether ``name`` is private (``_x``; a dunder is not)."""
    return name.startswith("_") and not name.startswith("__")


def is_ancestor(package: str, module: str) -> bool:
    """Whether ``package`` is ``module`` or a package above it (already being imported when it runs)."""
    return module == package or module.startswith(package + ".")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node except those inside ``if TYPE_CHECKING:`` blocks (their ``else`` runs)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def imports_of(path: Path) -> list[Import]:
    """The run-time imports of the module at ``path``."""
    importer = module_name(path)
    return _imports_in_tree(parse(path), importer, package_of(importer, path))


def imports_in(source: str, importer: str, package: str) -> list[Import]:
    """The run-time imports of ``source`` (module ``importer`` of ``package``), names made absolute."""
    return _imports_in_tree(ast.parse(source), importer, package)


def _imports_in_tree(tree: ast.AST, importer: str, package: str) -> list[Import]:
    found: list[Import] = []
    for node in runtime_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(importer, alias.name, (), node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level > 1:
                    base = base[: -(node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.append(Import(importer, module, tuple(a.name for a in node.names), node.lineno))
    return found


def all_imports() -> list[Import]:
    """The run-time imports of every stateguard module."""
    return [imp for path in source_files() for imp in imports_of(path)]


def known_modules() -> set[str]:
    """The dotted names of every stateguard module."""
    return {module_name(p) for p in source_files()}


def targets(imp: Import, modules: set[str]) -> set[str]:
    """The stateguard modules an import runs: the module, any submodule named, and their packages.

    Packages above the importer are already being imported when it runs,
    so they add no edge.
    """
    named = {imp.module} | {f"{imp.module}.{name}" for name in imp.names}
    out: set[str] = set()
    for module in named & modules:
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            step = ".".join(parts[:i])
            if step in modules and not is_ancestor(step, imp.importer):
                out.add(step)
    return out


def import_graph() -> dict[str, set[str]]:
    """Each stateguard module and the stateguard modules its run-time imports run."""
    modules = known_modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for imp in all_imports():
        graph[imp.importer] |= targets(imp, modules) - {imp.importer}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path (first node repeated at the end), or ``None``."""
    white, grey, black = 0, 1, 2
    color = dict.fromkeys(graph, white)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        color[node] = grey
        stack.append(node)
        for nxt in sorted(graph[node]):
            if color.get(nxt, black) == grey:
                return [*stack[stack.index(nxt) :], nxt]
            if color.get(nxt) == white:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        color[node] = black
        return None

    for start in sorted(graph):
        if color[start] == white:
            cycle = visit(start)
            if cycle:
                return cycle
    return None
