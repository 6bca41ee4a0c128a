"""Names that moved to another module in the 0.2 layout, still importable from where they were.

``from stateguard.locks import RedisLock`` keeps working (with a
DeprecationWarning naming the new home); the public way is ``from stateguard
import RedisLock``, which never moved.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping
from typing import Any

__all__ = ["moved"]


def moved(module: str, name: str, table: Mapping[str, str], *, public: str = "stateguard") -> Any:
    """The attribute ``name`` that ``module`` used to define, from its new module in ``table``.

    For a module's ``__getattr__``; an unknown name is the usual AttributeError.
    ``public`` is the package the warning tells users to import it from
    (``stateguard``, or a subpackage for names kept out of the top level
    because they belong to an optional extra).
    """
    target = table.get(name)
    if target is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(
        f"{module}.{name} moved to {target}.{name}; import it from {public} instead",
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(importlib.import_module(target), name)
