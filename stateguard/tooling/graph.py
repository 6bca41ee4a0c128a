"""Diagrams of declared state machines: mermaid and dot text, SVG/PNG through Graphviz.

Used by ``stateguard graph``::

    print(render_graph(Order.flow))           # mermaid
    svg = render_graph(Order.flow, "svg")      # needs Graphviz
"""

from __future__ import annotations

from typing import Any, Final, Literal

from ..machine import StateMachine

__all__ = ["GRAPHVIZ_HINT", "GRAPH_FORMATS", "GraphvizMissing", "graphviz_available", "render_graph"]

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


def _dot_source(machine: StateMachine[Any]) -> str:
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
    lines += [f"  {_dot_id(state['name'])}" for state in markup["states"]]
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


def render_graph(machine: StateMachine[Any], fmt: str = "mermaid") -> str | bytes:
    """The declared graph as Mermaid or DOT text, or SVG/PNG bytes.

    Mermaid comes from ``transitions``' mermaid engine, SVG/PNG from its
    graphviz engine (:class:`GraphvizMissing` without Graphviz); DOT text is
    written from ``transitions``' markup of the same machine, so it needs
    nothing extra::

        print(render_graph(Order.flow))            # stateDiagram-v2 ...
        Path("flow.svg").write_bytes(render_graph(Order.flow, "svg"))
    """
    if fmt == "mermaid":
        source = str(_graph_machine(machine, "mermaid").get_graph().source)
        return "\n".join(line.rstrip() for line in source.splitlines()) + "\n"
    if fmt == "dot":
        return _dot_source(machine)
    if fmt in ("svg", "png"):
        if not graphviz_available():
            raise GraphvizMissing(GRAPHVIZ_HINT)
        drawn = _graph_machine(machine, "graphviz").get_graph().draw(None, format=fmt, prog="dot")
        return bytes(drawn)
    raise ValueError(f"unknown graph format {fmt!r}; choose one of {', '.join(GRAPH_FORMATS)}")
