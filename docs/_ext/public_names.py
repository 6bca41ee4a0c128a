"""Resolve a reference to any public path of an object to the path the reference documents it under.

stateguard re-exports its public names: ``stateguard.Sink`` is ``stateguard.outbox.Sink`` is
``stateguard.outbox.events.Sink``.  The API pages document each object once, under the path users
import it from (``stateguard.Sink``), and autodoc records the defining module's path as its
canonical name.  Docstrings and signatures may name any of the other paths; this extension
imports the referenced path and, when it is the same Python object as a documented one, links
there.  A reference to something that is not documented stays unresolved, so the nitpicky build
still reports it.
"""

from __future__ import annotations

import importlib
from typing import Any

from docutils import nodes
from sphinx.addnodes import pending_xref
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment

_MISSING = object()
_KINDS = ("class", "exception", "function", "method", "property", "data")


def _lookup(path: str) -> Any:
    """The object at a dotted ``path`` (a module, or attributes of one), or ``_MISSING``."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name, _MISSING)
            if obj is _MISSING:
                return _MISSING
        return obj
    return _MISSING


def _documented(env: BuildEnvironment) -> dict[int, tuple[str, str]]:
    """id(object) -> (documented name, object type) for every documented class and function."""
    cache: dict[int, tuple[str, str]] | None = getattr(env, "_sg_documented", None)
    if cache is None:
        cache = {}
        for name, entry in env.get_domain("py").objects.items():
            if entry.aliased or entry.objtype not in _KINDS:
                continue
            obj = _lookup(name)
            if obj is not _MISSING:
                cache.setdefault(id(obj), (name, entry.objtype))
        env._sg_documented = cache  # type: ignore[attr-defined]
    return cache


def _resolve(
    app: Sphinx, env: BuildEnvironment, node: pending_xref, contnode: nodes.TextElement
) -> nodes.reference | None:
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "").lstrip("~")
    if not target.startswith("stateguard"):
        module = node.get("py:module") or ""
        if not module.startswith("stateguard") or "." in target:
            return None
        target = f"{module}.{target}"  # an unqualified name in a stateguard docstring or signature
    domain = env.get_domain("py")
    obj = _lookup(target)
    found = None
    if obj is not _MISSING and not isinstance(obj, (int, str, float, bytes, type(None))):
        found = _documented(env).get(id(obj))
    if found is None:
        # A docstring naming a sibling of its own module (``:func:`advisory_key```) while the
        # object is documented under another path: the one documented object of that name.
        short = target.rpartition(".")[2]
        same = [n for n, e in domain.objects.items() if not e.aliased and n.rpartition(".")[2] == short]
        if len(same) != 1:
            return None
        found = (same[0], "")
    name, _ = found
    resolved = domain.resolve_xref(env, node["refdoc"], app.builder, "obj", name, node, contnode)
    return resolved  # type: ignore[return-value]


def _reset(app: Sphinx, env: BuildEnvironment, *args: Any) -> None:
    if hasattr(env, "_sg_documented"):
        del env._sg_documented


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("missing-reference", _resolve)
    app.connect("env-updated", _reset)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
