"""Import a file of examples/ as a module, so tests can drive what a page shows (the same code)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples"


def load_example(name: str) -> ModuleType:
    """The module of ``examples/<name>`` (e.g. ``"tutorial/async_fastapi.py"``), imported once."""
    module_name = "examples_" + name.removesuffix(".py").replace("/", "_")
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / name)
    assert spec is not None and spec.loader is not None, f"no example {name}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
