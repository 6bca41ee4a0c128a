"""A private name stays in its own module or package.

A private name (``_x``, a private module included) is imported only by modules of
the package that owns it, and a private attribute of a stateguard class
(``obj._x``) is used only in the module, or the subpackage, that defines it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.architecture._source import (
    PACKAGE_DIR,
    ROOT,
    all_imports,
    is_ancestor,
    is_private,
    known_modules,
    module_name,
    package_of,
    parse,
    runtime_nodes,
    source_files,
)


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
            if is_private(part):
                owner = ".".join(parts[:i])
                if not (importer_pkg == owner or importer_pkg.startswith(owner + ".")):
                    bad.append(f"{imp.importer}:{imp.line} imports private module {imp.module}")
                break
        for name in imp.names:
            if not is_private(name):
                continue
            owner = owner_of(imp.module, name, modules, paths)
            if not (is_ancestor(owner, importer_pkg) or owner == imp.importer):
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
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and is_private(node.name):
                found.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if is_private(node.attr):
                    found.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and is_private(node.id):
                found.add(node.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and is_private(node.value):
                found.add(node.value)  # __slots__ entries
    return found


def attribute_reach_ins() -> list[str]:
    """``obj._x`` where ``_x`` belongs to stateguard classes of another module or package."""
    trees = {module_name(p): (p, parse(p)) for p in source_files()}
    owners: dict[str, set[str]] = {}
    for module, (path, tree) in trees.items():
        for attr in private_attributes(tree):
            owners.setdefault(attr, set()).add(scope_of(module, path))
    bad: list[str] = []
    for module, (_, tree) in trees.items():
        for node in runtime_nodes(tree):
            if not isinstance(node, ast.Attribute) or not is_private(node.attr):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            scopes = owners.get(node.attr)
            if scopes and not any(is_ancestor(scope, module) for scope in scopes):
                bad.append(f"{module}:{node.lineno} uses .{node.attr} of {sorted(scopes)}")
    return bad


def test_no_module_imports_a_private_name_of_another_package() -> None:
    """Private names are used only inside the package that owns them."""
    assert private_violations() == []


def test_no_module_reaches_into_private_attributes_of_another() -> None:
    """``obj._x`` of a stateguard class is used only in the module (or subpackage) that defines it."""
    assert attribute_reach_ins() == []


# -- the checks above must be able to fail -------------------------------------------------


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
