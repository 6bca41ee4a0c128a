"""Imports run downward, and each module imports on its own.

- No import cycle at run time anywhere in ``stateguard/`` (an import under
  ``if TYPE_CHECKING:`` is excepted; a function-level import counts), and the
  kernel imports nothing above it.
- The library never imports ``stateguard.tooling``; an optional dependency is
  imported only by its own integration module.
- Every module imports as the first stateguard import of a fresh interpreter, so
  no module works only because another was imported before it.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.architecture._source import (
    Import,
    all_imports,
    find_cycle,
    import_graph,
    imports_in,
    known_modules,
    targets,
)

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

#: The stateguard modules the kernel may import: nothing above it.
KERNEL_DEPENDS_ON = {"stateguard.exceptions", "stateguard.engine"}

# Run as ``python -c IMPORT_EACH PACKAGE MODULE...``: prints a JSON object of the modules that failed
# to import, each with its output.  Importing ``PACKAGE.x`` runs ``PACKAGE/__init__.py`` to its end
# before anything of ``x`` (Python imports the parents of a module first), so a fresh interpreter
# importing any module of the package first reaches exactly the state of this process after
# ``__import__(PACKAGE)``; a child forked from here per module then imports the module as a fresh
# interpreter would, without paying for a new interpreter and the package (and SQLAlchemy) each
# time.  Nothing else is imported before the forks (json and traceback only after or in a child).
# Without os.fork each module gets its own interpreter.
IMPORT_EACH = """\
import os, sys

package, modules = sys.argv[1], sys.argv[2:]
failures = {}
if hasattr(os, "fork"):
    __import__(package)
    for name in modules:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            os.dup2(write, 1)
            os.dup2(write, 2)
            code = 0
            try:
                __import__(name)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        os.close(write)
        with os.fdopen(read, errors="replace") as pipe:
            output = pipe.read()
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            failures[name] = output or f"exit status {os.waitstatus_to_exitcode(status)}"
else:
    import subprocess

    for name in modules:
        done = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True)
        if done.returncode != 0:
            failures[name] = done.stderr
import json

print(json.dumps(failures))
"""


def import_failures(package: str, modules: list[str], path: Path | None = None) -> dict[str, str]:
    """The modules of ``package`` that fail to import on their own in a fresh interpreter, with why.

    ``path`` is put first on the interpreter's ``PYTHONPATH``.
    """
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH, package, *modules],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    assert done.returncode == 0, f"import {package} failed:\n{done.stderr}"
    failures: dict[str, str] = json.loads(done.stdout)
    return failures


def test_the_package_has_no_import_cycle() -> None:
    """No chain of run-time imports inside stateguard/ leads back to where it started."""
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


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
    failures = import_failures("stateguard", modules)
    assert not failures, "\n".join(f"import {name} failed:\n{why}" for name, why in failures.items())


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


# -- the checks above must be able to fail -------------------------------------------------


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


def test_a_module_that_imports_only_after_another_fails_on_its_own(tmp_path: Path) -> None:
    """A module that needs another imported first fails, even when that other was imported just before it."""
    package = tmp_path / "orderdep"
    package.mkdir()
    (package / "__init__.py").write_text("registry = {}\n")
    (package / "fills.py").write_text("from orderdep import registry\nregistry['x'] = 1\n")
    (package / "needs.py").write_text("from orderdep import registry\nVALUE = registry['x']\n")
    (package / "fine.py").write_text(
        "import orderdep.fills\nfrom orderdep import registry\nVALUE = registry['x']\n"
    )
    (package / "broken.py").write_text("raise SystemExit(3)\n")
    modules = ["orderdep.fills", "orderdep.needs", "orderdep.fine", "orderdep.broken"]
    failures = import_failures("orderdep", modules, tmp_path)
    assert sorted(failures) == ["orderdep.broken", "orderdep.needs"]
    assert "KeyError: 'x'" in failures["orderdep.needs"]


@pytest.mark.parametrize("module", ["stateguard"])
def test_the_public_package_imports(module: str) -> None:
    """The public face imports (a smoke check that the graph above describes a working package)."""
    assert importlib.import_module(module).__all__
