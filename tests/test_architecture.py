"""The house rules of the architecture, checked on the source with ``ast``.

- No import cycle at run time anywhere in ``stateguard/`` (imports under
  ``if TYPE_CHECKING:`` are excepted; a function-level import counts), and
  the kernel imports nothing above it.
- A private name (``_x``, a private module included) is imported only by
  modules of the package that owns it.
- The library never imports ``stateguard.tooling``; optional dependencies are
  imported only by their own integration module.
- No module is longer than about 700 lines (the ones still being split are
  listed with the reason); ``dialect.name`` is read only in ``_kernel/``; no
  listener is registered on a class every engine or session shares.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "stateguard"
ROOT = "stateguard"

#: Optional dependencies and the only stateguard modules allowed to import them.
OPTIONAL = {
    "redis": {
        "stateguard.redis.client",
        "stateguard.redis.fences",
        "stateguard.redis.lock",
        "stateguard.consumers.redis_streams",
    },
    "starlette": {"stateguard.asgi"},
    "kazoo": {"stateguard.zookeeper"},
    "opentelemetry": {"stateguard.otel"},
    "mypy": {"stateguard.mypy"},
    "pika": {"stateguard.outbox.sinks.rabbitmq", "stateguard.consumers.rabbitmq"},
    "aio_pika": {"stateguard.outbox.sinks.rabbitmq"},
    "aiormq": {"stateguard.outbox.sinks.rabbitmq"},
    "nats": {"stateguard.outbox.sinks.nats", "stateguard.consumers.nats"},
    "celery": {"stateguard.consumers.celery", "stateguard.outbox.sinks.celery"},
}


#: About 700 lines: the longest a module of one concern grows to.
MAX_LINES = 725

#: Modules still longer, and why; each entry must still be needed (a split module leaves the list).
LONG_MODULES: dict[str, str] = {}

#: Modules outside the kernel still reading ``dialect.name``, and why.
DIALECT_NAME_READERS: dict[str, str] = {}

#: The stateguard modules the kernel may import: nothing above it.
KERNEL_DEPENDS_ON = {"stateguard.exceptions", "stateguard.engine"}

#: Classes every engine, connection or session of a process shares: no listener may go on them (a
#: mapper-configuration listener runs when a class is mapped, never in a transaction, and may).
SHARED_CLASSES = {"Engine", "Connection", "Session", "sessionmaker", "Pool", "Dialect"}

#: Dialect names: comparing a ``.name`` to one is a dialect check.
DIALECT_NAMES = {"postgresql", "mysql", "mariadb", "sqlite", "cockroachdb", "oracle", "mssql"}


@dataclass(frozen=True)
class Import:
    """One import statement of a stateguard module, resolved to absolute names."""

    importer: str
    module: str
    names: tuple[str, ...]
    line: int


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str, path: Path) -> str:
    """The package a module belongs to (a package's ``__init__`` belongs to the package itself)."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def source_files() -> list[Path]:
    return sorted(
        p for p in PACKAGE_DIR.rglob("*.py") if "migrations" not in p.relative_to(PACKAGE_DIR).parts
    )


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
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
    importer = module_name(path)
    return imports_in(path.read_text(), importer, package_of(importer, path))


def imports_in(source: str, importer: str, package: str) -> list[Import]:
    """The run-time imports of ``source`` (module ``importer`` of ``package``), names made absolute."""
    found: list[Import] = []
    for node in _runtime_nodes(ast.parse(source)):
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
    return [imp for path in source_files() for imp in imports_of(path)]


def known_modules() -> set[str]:
    return {module_name(p) for p in source_files()}


def _ancestor(package: str, module: str) -> bool:
    """Whether ``package`` is ``module`` or a package above it (already being imported when it runs)."""
    return module == package or module.startswith(package + ".")


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
            if step in modules and not _ancestor(step, imp.importer):
                out.add(step)
    return out


def import_graph() -> dict[str, set[str]]:
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


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def owner_of(module: str, name: str, modules: set[str], paths: dict[str, Path]) -> str:
    """The package or module owning private ``name`` imported from ``module``.

    ``from pkg import _mod`` names a private module, owned by ``pkg`` (so
    ``stateguard._kernel`` serves all of stateguard).  ``from mod import _x``
    names a private member of ``mod``: a module of a subpackage shares it
    with its package (``stateguard.machine``); a top-level module keeps it
    to itself.
    """
    if f"{module}.{name}" in modules:
        return module
    path = paths.get(module)
    package = package_of(module, path) if path is not None else module.rpartition(".")[0]
    return module if package == ROOT else package


def private_violations() -> list[str]:
    """Imports of a private name (or private module) owned by a package outside the importer's."""
    modules = known_modules()
    paths = {module_name(p): p for p in source_files()}
    bad: list[str] = []
    for imp in all_imports():
        if not imp.module.startswith("stateguard"):
            continue
        importer_pkg = package_of(imp.importer, paths[imp.importer])
        # A private module anywhere in the dotted path belongs to the package above it.
        parts = imp.module.split(".")
        for i, part in enumerate(parts):
            if _private(part):
                owner = ".".join(parts[:i])
                if not (importer_pkg == owner or importer_pkg.startswith(owner + ".")):
                    bad.append(f"{imp.importer}:{imp.line} imports private module {imp.module}")
                break
        for name in imp.names:
            if not _private(name):
                continue
            owner = owner_of(imp.module, name, modules, paths)
            if not (_ancestor(owner, importer_pkg) or owner == imp.importer):
                bad.append(f"{imp.importer}:{imp.line} imports {name} from {imp.module}")
    return bad


def scope_of(module: str, path: Path) -> str:
    """Where a module's private members may be used: the module itself, or its subpackage."""
    package = package_of(module, path)
    return module if package == ROOT else package


def private_attributes(tree: ast.AST) -> set[str]:
    """Private attributes a module's classes define: methods, class attributes, ``self._x`` and slots."""
    found: set[str] = set()
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        for node in ast.walk(cls):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _private(node.name):
                found.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr):
                found.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
                found.add(node.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _private(node.value):
                found.add(node.value)  # __slots__ entries
    return found


def attribute_reach_ins() -> list[str]:
    """``obj._x`` where ``_x`` belongs to stateguard classes of another module or package."""
    files = source_files()
    trees = {module_name(p): (p, ast.parse(p.read_text(), str(p))) for p in files}
    owners: dict[str, set[str]] = {}
    for module, (path, tree) in trees.items():
        for attr in private_attributes(tree):
            owners.setdefault(attr, set()).add(scope_of(module, path))
    bad: list[str] = []
    for module, (_, tree) in trees.items():
        for node in _runtime_nodes(tree):
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            scopes = owners.get(node.attr)
            if scopes and not any(_ancestor(scope, module) for scope in scopes):
                bad.append(f"{module}:{node.lineno} uses .{node.attr} of {sorted(scopes)}")
    return bad


def test_the_package_has_no_import_cycle() -> None:
    """No chain of run-time imports inside stateguard/ leads back to where it started."""
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_module_imports_a_private_name_of_another_package() -> None:
    """Private names are used only inside the package that owns them."""
    assert private_violations() == []


def test_no_module_reaches_into_private_attributes_of_another() -> None:
    """``obj._x`` of a stateguard class is used only in the module (or subpackage) that defines it."""
    assert attribute_reach_ins() == []


def test_the_library_never_imports_tooling() -> None:
    """Only stateguard.tooling itself and the ``python -m stateguard`` entry point import tooling."""
    offenders = [
        f"{imp.importer}:{imp.line}"
        for imp in all_imports()
        if (imp.module == "stateguard.tooling" or imp.module.startswith("stateguard.tooling."))
        and not imp.importer.startswith("stateguard.tooling")
        and imp.importer != "stateguard.__main__"
    ]
    assert offenders == []


def test_optional_dependencies_are_imported_only_by_their_integration_module() -> None:
    """redis, starlette, kazoo and OpenTelemetry are imported only by the module built on them."""
    offenders = []
    for imp in all_imports():
        top = imp.module.split(".")[0]
        allowed = OPTIONAL.get(top)
        tooling = imp.importer.startswith("stateguard.tooling")
        if allowed is not None and imp.importer not in allowed and not tooling:
            offenders.append(f"{imp.importer}:{imp.line} imports {imp.module}")
    assert offenders == []


def test_every_module_imports_on_its_own() -> None:
    """Each module imports in a fresh interpreter as the first stateguard import (no order dependence)."""
    modules = sorted(m for m in known_modules() if m != "stateguard.__main__")
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    for name in modules:
        done = subprocess.run(
            [sys.executable, "-c", script, name], capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, f"import {name} failed:\n{done.stderr}"


def long_modules() -> dict[str, int]:
    """Modules longer than :data:`MAX_LINES`, with their line counts."""
    lengths = {module_name(p): len(p.read_text().splitlines()) for p in source_files()}
    return {m: n for m, n in lengths.items() if n > MAX_LINES}


def test_no_module_is_longer_than_about_700_lines() -> None:
    """Every module is at most about 700 lines, but the listed ones still being split."""
    long = long_modules()
    assert sorted(set(long) - set(LONG_MODULES)) == []
    # A module that was split leaves the list, so the list says what is left to do.
    assert sorted(set(LONG_MODULES) - set(long)) == []


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
    """Modules outside ``stateguard._kernel`` that read a dialect's name, with the lines."""
    out: dict[str, list[int]] = {}
    for path in source_files():
        module = module_name(path)
        if module == "stateguard._kernel" or module.startswith("stateguard._kernel."):
            continue
        lines = dialect_name_reads(ast.parse(path.read_text(), str(path)))
        if lines:
            out[module] = lines
    return out


def test_dialect_name_is_read_only_in_the_kernel() -> None:
    """Outside ``_kernel/`` a dialect difference is a named Backend field, never ``dialect.name``."""
    readers = dialect_name_readers()
    assert {m: lines for m, lines in readers.items() if m not in DIALECT_NAME_READERS} == {}
    assert sorted(set(DIALECT_NAME_READERS) - set(readers)) == []


def shared_class_listeners(tree: ast.AST) -> list[int]:
    """Lines of ``event.listen(C, ...)`` / ``@event.listens_for(C, ...)`` with ``C`` a shared class."""
    found: list[int] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name not in ("listen", "listens_for"):
            continue
        target = node.args[0]
        target_name = (
            target.attr
            if isinstance(target, ast.Attribute)
            else target.id
            if isinstance(target, ast.Name)
            else ""
        )
        if target_name in SHARED_CLASSES:
            found.append(node.lineno)
    return found


def test_no_listener_on_a_class_every_engine_or_session_shares() -> None:
    """stateguard registers its listeners per engine, dialect or session, never on their classes."""
    offenders = {
        module_name(p): lines
        for p in source_files()
        if (lines := shared_class_listeners(ast.parse(p.read_text(), str(p))))
    }
    assert offenders == {}


def test_the_kernel_imports_nothing_above_it() -> None:
    """``stateguard._kernel`` imports only its own modules, the exceptions and the engine helpers."""
    modules = known_modules()
    offenders = []
    for imp in all_imports():
        if not imp.importer.startswith("stateguard._kernel"):
            continue
        for target in targets(imp, modules):
            if not target.startswith("stateguard._kernel") and target not in KERNEL_DEPENDS_ON:
                offenders.append(f"{imp.importer}:{imp.line} imports {target}")
    assert offenders == []


# -- the checks above must be able to fail -----------------------------------------------


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


def test_the_listener_finder_finds_class_listeners() -> None:
    """A listener on Engine or Session (by name or attribute) counts; one on an engine object does not."""
    source = (
        "event.listen(Engine, 'begin', f)\n"
        "@event.listens_for(orm.Session, 'after_commit')\ndef g(s): pass\n"
        "event.listen(engine, 'begin', f)\n"
        "event.listen(session, 'after_commit', f)\n"
    )
    assert shared_class_listeners(ast.parse(source)) == [1, 2]


# -- the checks above must be able to fail (imports) ---------------------------------------


def test_the_graph_sees_subpackage_inits_and_skips_ancestors() -> None:
    """Importing a.b.c runs a.b's __init__; a module's own ancestors add no edge."""
    modules = {"stateguard", "stateguard.machine", "stateguard.machine.trigger", "stateguard._kernel"}
    deep = Import("stateguard.versioning", "stateguard.machine.trigger", ("Trigger",), 1)
    assert targets(deep, modules) == {"stateguard.machine", "stateguard.machine.trigger"}
    up = Import("stateguard.machine.trigger", "stateguard", ("_kernel",), 1)
    assert targets(up, modules) == {"stateguard._kernel"}


def test_the_cycle_finder_finds_a_cycle() -> None:
    """find_cycle reports a three-module loop and nothing for a tree."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_type_checking_imports_are_ignored_and_function_imports_are_not() -> None:
    """An import under TYPE_CHECKING is not a run-time edge; one inside a function is."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .machine import Trigger\n"
        "else:\n    from .result import Result\n"
        "def f():\n    from ..counters import decrement\n"
    )
    found = {imp.module for imp in imports_in(source, "stateguard.machine.bulk", "stateguard.machine")}
    assert found == {"typing", "stateguard.machine.result", "stateguard.counters"}


def test_private_owners() -> None:
    """A private module belongs to the package above it; a private member to its module's package."""
    modules = {
        "stateguard",
        "stateguard._kernel",
        "stateguard._kernel.purge",
        "stateguard.machine",
        "stateguard.machine.trigger",
    }
    paths = {
        "stateguard": PACKAGE_DIR / "__init__.py",
        "stateguard._kernel": PACKAGE_DIR / "_kernel" / "__init__.py",
        "stateguard._kernel.purge": PACKAGE_DIR / "_kernel" / "purge.py",
        "stateguard.machine": PACKAGE_DIR / "machine" / "__init__.py",
        "stateguard.machine.trigger": PACKAGE_DIR / "machine" / "trigger.py",
    }
    assert owner_of("stateguard", "_kernel", modules, paths) == "stateguard"
    assert owner_of("stateguard.machine.trigger", "_Plan", modules, paths) == "stateguard.machine"
    assert owner_of("stateguard.machine", "_x", modules, paths) == "stateguard.machine"
    assert owner_of("stateguard._kernel.purge", "_purge", modules, paths) == "stateguard._kernel"


@pytest.mark.parametrize("module", ["stateguard"])
def test_the_public_package_imports(module: str) -> None:
    """The public face imports (a smoke check that the graph above describes a working package)."""
    assert importlib.import_module(module).__all__
