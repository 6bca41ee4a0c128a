"""``stateguard graph``: the declared graph as Mermaid, DOT, SVG or PNG, through ``main(argv)``
and once as a real subprocess."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from stateguard.tooling.demo import DemoOrder
from stateguard.tooling.graph import GRAPHVIZ_HINT, graphviz_available, render_graph
from tests.conftest import unavailable
from tests.tooling._helpers import DEMO, MULTI, ROOT, run, write_module


def test_readme_shows_the_current_demo_graph(capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI page's Mermaid block is exactly what `stateguard graph <the demo's Order>` prints now."""
    readme = (ROOT / "docs" / "reference" / "cli.md").read_text()
    match = re.search(
        r"<!-- stateguard graph stateguard\.tooling\.demo:DemoOrder -->\n```mermaid\n(.*?)```",
        readme,
        re.DOTALL,
    )
    assert match is not None, "docs/reference/cli.md lacks the marked mermaid block"
    code, out, _ = run(["graph", DEMO, "--format", "mermaid"], capsys)
    assert code == 0
    assert match.group(1) == out


def test_mermaid_comes_from_transitions_and_lists_every_edge(capsys: pytest.CaptureFixture[str]) -> None:
    """The default is transitions' Mermaid state diagram, every state drawn alike, every edge labelled."""
    code, out, err = run(["graph", DEMO], capsys)
    assert (code, err) == (0, "")
    assert out.startswith("---\nDemoOrder.flow\n---\nstateDiagram-v2\n")
    for edge in (
        "pending --> paid: pay",
        "paid --> shipped: ship",
        "pending --> cancelled: cancel",
        "paid --> cancelled: cancel",
        "[*] --> pending",
    ):
        assert f"  {edge}\n" in out
    assert "s_active" not in out.split("classDef s_previous")[1], "a declaration has no current state"
    assert all(line == line.rstrip() for line in out.splitlines())


def test_dot_text_needs_nothing_extra(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--format dot -o FILE`` writes DOT text with merged labels and the initial arrow."""
    target = tmp_path / "flow.dot"
    code, out, err = run(["graph", DEMO, "--format", "dot", "-o", str(target)], capsys)
    assert (code, out, err) == (0, "", "")
    dot = target.read_text()
    assert dot.startswith('digraph "DemoOrder.flow" {\n') and dot.endswith("}\n")
    assert '  "[*]" -> "pending"\n' in dot
    assert '  "pending" -> "paid" [label="pay"]\n' in dot
    assert '  "paid" -> "cancelled" [label="cancel"]\n' in dot
    assert dot == render_graph(DemoOrder.flow, "dot")


@pytest.mark.parametrize("fmt", ["svg", "png"])
def test_images_need_graphviz_and_say_how_to_install_it(
    fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SVG/PNG are drawn with Graphviz when it is installed; otherwise exit 2 naming the install commands."""
    target = tmp_path / f"flow.{fmt}"
    code, out, err = run(["graph", DEMO, "--format", fmt, "-o", str(target)], capsys)
    if graphviz_available():
        assert code == 0
        data = target.read_bytes()
        assert data.startswith(b"\x89PNG") if fmt == "png" else b"<svg" in data
    else:
        assert code == 2 and out == "" and not target.exists()
        assert err == f"stateguard graph: {GRAPHVIZ_HINT}\n"
        assert "apt install graphviz" in err and "pip install graphviz" in err


def test_machine_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model with several machines needs ``--machine``; an unknown name lists the real ones."""
    module = write_module(tmp_path, monkeypatch, MULTI.format(table=f"jobs_{uuid.uuid4().hex[:6]}"))
    code, out, err = run(["graph", f"{module}:Job"], capsys)
    assert code == 2 and "several machines (run, bill); pick one with --machine" in err
    code, out, err = run(["graph", f"{module}:Job", "--machine", "bill"], capsys)
    assert code == 0 and "open --> invoiced: invoice" in out and "queued" not in out
    code, out, err = run(["graph", f"{module}:Job", "--machine", "nope"], capsys)
    assert code == 2 and "has no StateMachine 'nope'; it has: run, bill" in err


def test_graph_as_a_real_subprocess() -> None:
    """``python -m stateguard graph`` prints the same Mermaid text as ``main()``."""
    done = subprocess.run(
        [sys.executable, "-m", "stateguard", "graph", DEMO],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == render_graph(DemoOrder.flow)


# -- the README's picture -----------------------------------------------------

#: How to regenerate the README's picture and the DOT it is drawn from.
REGENERATE = (
    "python -m stateguard graph stateguard.tooling.demo:DemoOrder --format dot -o docs/order-flow.dot && "
    "python -m stateguard graph stateguard.tooling.demo:DemoOrder --format svg -o docs/order-flow.svg"
)
_GENERATOR = re.compile(r"<!-- Generated by graphviz version ([^\n]*)\n -->\n")


def _svg_content(svg: str) -> list[tuple[str, str]]:
    """What an SVG drawing says, not where: its titles (graph, nodes, edges) and text labels, in order.

    Graphviz versions place boxes a few points apart; the names, edges and
    labels come from the DOT source alone.
    """
    return re.findall(r"<(title|text)\b[^>]*>([^<]*)</\1>", svg)


def _graphviz_required() -> None:
    if not graphviz_available():
        unavailable("graphviz (the dot program and the graphviz package)", RuntimeError(GRAPHVIZ_HINT))


def test_readme_picture_is_current() -> None:
    """docs/order-flow.dot is the demo's DOT now, and docs/order-flow.svg is that DOT drawn by Graphviz.

    The SVG must match a fresh drawing byte for byte when the installed
    Graphviz is the version that drew it (its generator comment), and in
    every title and label (nodes, edges, their labels and order) otherwise.
    """
    dot = (ROOT / "docs" / "order-flow.dot").read_text()
    assert dot == render_graph(DemoOrder.flow, "dot"), f"docs/order-flow.dot is stale; run: {REGENERATE}"
    readme = (ROOT / "README.md").read_text()
    assert "![" in readme and "](docs/order-flow.svg)" in readme, "README does not show the picture"
    _graphviz_required()
    committed = (ROOT / "docs" / "order-flow.svg").read_text()
    fresh = render_graph(DemoOrder.flow, "svg")
    assert isinstance(fresh, bytes)
    drawn = fresh.decode("utf-8")
    committed_version, drawn_version = _GENERATOR.search(committed), _GENERATOR.search(drawn)
    assert committed_version is not None and drawn_version is not None
    content = _svg_content(committed)
    for state in ("pending", "paid", "shipped", "cancelled"):
        assert ("title", state) in content and ("text", state) in content
    assert ("title", "paid&#45;&gt;shipped") in content and ("text", "ship") in content
    assert content == _svg_content(drawn), f"docs/order-flow.svg is stale; run: {REGENERATE}"
    if committed_version.group(1) == drawn_version.group(1):
        assert committed == drawn, f"docs/order-flow.svg is stale; run: {REGENERATE}"


def test_svg_content_tells_pictures_apart() -> None:
    """The comparison the README test relies on sees a changed label or edge (it is not vacuous)."""
    _graphviz_required()
    plain = render_graph(DemoOrder.flow, "svg")
    counted = render_graph(DemoOrder.flow, "svg", counts={"paid": 2})
    assert isinstance(plain, bytes) and isinstance(counted, bytes)
    assert _svg_content(plain.decode()) != _svg_content(counted.decode())
    assert ("text", "paid (2 rows)") in _svg_content(counted.decode())
