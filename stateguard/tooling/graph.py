"""Diagrams of declared state machines: mermaid and dot text, SVG/PNG through Graphviz.

Used by ``stateguard graph`` and ``stateguard inspect`` (which writes each
state's row count into its box)::

    print(render_graph(Order.flow))                              # mermaid
    svg = render_graph(Order.flow, "svg")                         # needs Graphviz
    print(render_graph(Order.flow, counts={"paid": 12}))          # "paid (12 rows)"

SVG and PNG are the DOT text of :func:`render_graph` drawn by Graphviz's
``dot`` (through the ``graphviz`` package), so a picture and the DOT it was
made from always agree.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final, Literal

from ..machine import StateMachine

__all__ = [
    "GRAPHVIZ_HINT",
    "GRAPH_FORMATS",
    "GraphvizMissing",
    "graphviz_available",
    "render_graph",
    "rows_label",
]

# --------------------------------------------------------------------------
# Diagrams
# --------------------------------------------------------------------------

#: What ``stateguard graph --format`` accepts.
GRAPH_FORMATS: Final = ("mermaid", "dot", "svg", "png")

GRAPHVIZ_HINT: Final = (
    "SVG and PNG need Graphviz: install the dot program (apt install graphviz, or brew install graphviz) "
    "and its Python package (pip install graphviz); mermaid and dot text need nothing extra"
)


class GraphvizMissing(RuntimeError):
    """SVG/PNG were asked for but Graphviz (the ``dot`` program or the ``graphviz`` package) is missing.

    Its message is :data:`GRAPHVIZ_HINT`, which says how to install both::

        try:
            svg = render_graph(Order.flow, "svg")
        except GraphvizMissing as error:
            print(error)
    """


def _graph_spec(machine: StateMachine[Any]) -> dict[str, Any]:
    name = machine.codec.name
    transitions = [
        {"trigger": trigger.name, "source": [name(s) for s in edge.sources], "dest": name(edge.dest)}
        for trigger in machine.triggers.values()
        for edge in trigger.edges
    ]
    model = machine.model.__name__ if machine.model is not None else "?"
    return {
        "states": [name(s) for s in machine.states],
        "transitions": transitions,
        "initial": machine.graph.initial,
        "auto_transitions": False,
        "title": f"{model}.{machine.name}",
    }


def _graph_machine(machine: StateMachine[Any], engine: Literal["mermaid", "graphviz"]) -> Any:
    from transitions.extensions import GraphMachine

    graph = GraphMachine(graph_engine=engine, **_graph_spec(machine))
    # A declaration has no current state: draw every state alike instead of
    # highlighting the initial one as "active".
    graph.model_graphs[id(graph)].reset_styling()
    return graph


def _dot_id(text_: str) -> str:
    return '"' + text_.replace("\\", "\\\\").replace('"', '\\"') + '"'


def rows_label(name: str, count: int) -> str:
    """A state's name with its row count, as drawn by ``stateguard inspect``.

    ::

        rows_label("paid", 12)   # 'paid (12 rows)'
    """
    return f"{name} ({count} row{'' if count == 1 else 's'})"


def _mermaid_counts(source: str, counts: Mapping[str, int]) -> str:
    # transitions declares each state as `state "<name>" as <id>`: the label is what is drawn.
    lines = []
    for line in (raw.rstrip() for raw in source.splitlines()):
        match = re.fullmatch(r'(\s*)state "([^"]*)" as (\S+)', line)
        if match is not None and match.group(2) in counts:
            indent, name, ident = match.groups()
            line = f'{indent}state "{rows_label(name, counts[name])}" as {ident}'
        lines.append(line)
    return "\n".join(lines) + "\n"


def _dot_source(machine: StateMachine[Any], counts: Mapping[str, int] | None = None) -> str:
    # transitions renders DOT only through the graphviz package, so DOT text
    # is written here from the same markup its engines draw from (states,
    # transitions with merged labels, the initial state), in its style.
    from transitions.extensions.markup import MarkupMachine

    spec = _graph_spec(machine)
    markup = MarkupMachine(
        states=spec["states"],
        transitions=spec["transitions"],
        initial=spec["initial"],
        auto_transitions=False,
    ).markup
    title = spec["title"]
    lines = [
        f"digraph {_dot_id(title)} {{",
        f"  graph [label={_dot_id(title)} rankdir=LR]",
        '  node [shape=rectangle style="rounded,filled" fillcolor=white color=black]',
        "  edge [color=black]",
        '  "[*]" [shape=point label="" width=0.15]',
    ]
    for state in markup["states"]:
        name = state["name"]
        if counts is not None and name in counts:
            lines.append(f"  {_dot_id(name)} [label={_dot_id(rows_label(name, counts[name]))}]")
        else:
            lines.append(f"  {_dot_id(name)}")
    labels: dict[tuple[str, str], list[str]] = {}
    for t in markup["transitions"]:
        labels.setdefault((t["source"], t["dest"]), []).append(t["trigger"])
    lines.append(f'  "[*]" -> {_dot_id(spec["initial"])}')
    lines += [
        f"  {_dot_id(src)} -> {_dot_id(dst)} [label={_dot_id(' | '.join(names))}]"
        for (src, dst), names in labels.items()
    ]
    lines.append("}")
    return "\n".join(lines) + "\n"


def graphviz_available() -> bool:
    """Whether SVG/PNG can be drawn: the ``graphviz`` package imports and ``dot`` is on the PATH.

    ::

        if not graphviz_available():
            print(GRAPHVIZ_HINT)
    """
    import importlib.util
    import shutil

    return importlib.util.find_spec("graphviz") is not None and shutil.which("dot") is not None


def render_graph(
    machine: StateMachine[Any], fmt: str = "mermaid", *, counts: Mapping[str, int] | None = None
) -> str | bytes:
    """The declared graph as Mermaid or DOT text, or SVG/PNG bytes.

    Mermaid comes from ``transitions``' mermaid engine; DOT text is written
    from ``transitions``' markup of the same machine, so both need nothing
    extra; SVG/PNG are that DOT text drawn by Graphviz
    (:class:`GraphvizMissing` without it).  ``counts`` (state name -> rows)
    labels each counted state ``name (N rows)``::

        print(render_graph(Order.flow))            # stateDiagram-v2 ...
        Path("flow.svg").write_bytes(render_graph(Order.flow, "svg"))
        render_graph(Order.flow, "dot", counts={"paid": 12})   # ... "paid" [label="paid (12 rows)"]
    """
    if fmt == "mermaid":
        source = str(_graph_machine(machine, "mermaid").get_graph().source)
        if counts:
            return _mermaid_counts(source, counts)
        return "\n".join(line.rstrip() for line in source.splitlines()) + "\n"
    if fmt == "dot":
        return _dot_source(machine, counts)
    if fmt in ("svg", "png"):
        if not graphviz_available():
            raise GraphvizMissing(GRAPHVIZ_HINT)
        import graphviz

        return bytes(graphviz.Source(_dot_source(machine, counts)).pipe(format=fmt))
    raise ValueError(f"unknown graph format {fmt!r}; choose one of {', '.join(GRAPH_FORMATS)}")
