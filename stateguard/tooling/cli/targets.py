"""Finding the models and state machines a command names (``MODULE``, ``MODULE:Model``)."""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType
from typing import Any

from ...machine import StateMachine, machines_of
from .common import UsageError, first_line


def import_module(name: str) -> ModuleType:
    """Import ``name`` as ``python -m`` would, from the current folder too, or :class:`UsageError`.

    ::

        import_module("myapp.models")   # the module, or UsageError("cannot import myapp.models: ...")
    """
    if not name or not all(part.isidentifier() for part in name.split(".")):
        raise UsageError(f"not a module name: {name!r} (e.g. myapp.models)")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        # The console script does not put the current folder on the path; `python -m` does.
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except SystemExit as error:  # sys.exit() at import: not the command's own exit code
        raise UsageError(
            f"cannot import {name}: it called sys.exit({error.code!r}) while importing"
        ) from None
    except Exception as error:  # a model module can fail in any way while importing
        raise UsageError(f"cannot import {name}: {type(error).__name__}: {first_line(error)}") from error


def model_machines(module: ModuleType, model_name: str) -> tuple[type[Any], list[StateMachine[Any]]]:
    model = getattr(module, model_name, None)
    if not isinstance(model, type):
        raise UsageError(f"{module.__name__} has no class {model_name!r}")
    machines = [m for m in machines_of(model) if m.model is not None and issubclass(model, m.model)]
    if not machines:
        raise UsageError(f"{module.__name__}.{model_name} declares no StateMachine")
    return model, machines


def split_target(target: str, *, model_required: bool) -> tuple[str, str | None]:
    module, sep, model = target.partition(":")
    if not sep:
        if model_required:
            example = "stateguard.tooling.demo:DemoOrder"
            raise UsageError(f"expected MODULE:Model, got {target!r} (e.g. {example})")
        return module, None
    if not model.isidentifier():
        raise UsageError(f"not a class name: {model!r} in {target!r}")
    return module, model
