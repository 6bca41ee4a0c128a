"""``stateguard graph`` and ``stateguard check``: diagrams of the declared graph, and checks of
declarations and live databases, through ``main(argv)`` and once as real subprocesses."""

from __future__ import annotations

import importlib
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from stateguard.tooling import cli
from stateguard.tooling.demo import DemoOrder
from stateguard.tooling.graph import GRAPHVIZ_HINT, graphviz_available, render_graph

from .conftest import Backend

ROOT = Path(__file__).resolve().parent.parent

#: The demo's order model, as `stateguard graph` names it.
DEMO = "stateguard.tooling.demo:DemoOrder"


def write_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> str:
    """Write a uniquely named model module importable by name; return that name."""
    name = f"sgmod_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


MULTI = """
from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from stateguard import StateMachine


class Base(DeclarativeBase):
    pass


class Job(Base):
    __tablename__ = "{table}"
    id: Mapped[int] = mapped_column(primary_key=True)
    phase: Mapped[str] = mapped_column(String(20), default="queued")
    billing: Mapped[str] = mapped_column(String(20), default="open")

    run = StateMachine("phase", states=["queued", "running", "done"],
                       transitions=[["start", "queued", "running"], ["finish", "running", "done"]])
    bill = StateMachine("billing", states=["open", "invoiced"], transitions=[["invoice", "open", "invoiced"]])


class Plain(Base):
    __tablename__ = "{table}_plain"
    id: Mapped[int] = mapped_column(primary_key=True)
"""


# --------------------------------------------------------------------------
# graph
# --------------------------------------------------------------------------


def test_readme_shows_the_current_demo_graph(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's Mermaid block is exactly what `stateguard graph <the demo's Order>` prints now."""
    readme = (ROOT / "README.md").read_text()
    match = re.search(
        r"<!-- stateguard graph stateguard\.tooling\.demo:DemoOrder -->\n```mermaid\n(.*?)```",
        readme,
        re.DOTALL,
    )
    assert match is not None, "README lacks the marked mermaid block"
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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["graph", "stateguard.tooling.demo"], "expected MODULE:Model"),
        (["graph", "no_such_module_sg:Order"], "cannot import no_such_module_sg: ModuleNotFoundError"),
        (["graph", "stateguard.tooling.demo:Nope"], "stateguard.tooling.demo has no class 'Nope'"),
        (["graph", "stateguard.tooling.demo:DemoSideEffect"], "declares no StateMachine"),
        (["graph", DEMO, "--format", "gif"], "invalid choice: 'gif'"),
        (["graph", "bad name:Order"], "not a module name"),
        (["check", "no_such_module_sg"], "cannot import no_such_module_sg"),
        (["check", "stateguard.result"], "no StateMachine found in stateguard.result"),
        (["check", "stateguard.tooling.demo", "--db", "nonsense://x"], "unknown database URL scheme"),
        (["check", "stateguard.tooling.demo", "--db", "sqlite://"], "stateguard check needs a SQLite file"),
    ],
)
def test_usage_errors_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Bad targets, formats and URLs return 2 with one line saying what is wrong."""
    code, out, err = run(argv, capsys)
    assert code == 2 and out == ""
    assert message in err


@pytest.mark.parametrize("command", ["graph", "check"])
def test_help_documents_exit_codes(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--help`` of graph and check prints usage and the exit codes, and returns 0."""
    code, out, _ = run([command, "--help"], capsys)
    assert code == 0
    assert out.startswith(f"usage: stateguard {command}")
    assert "exit codes:" in out and "2  usage error" in out


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


# --------------------------------------------------------------------------
# check: declarations
# --------------------------------------------------------------------------

FLAWED = """
from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from stateguard import StateMachine


class Base(DeclarativeBase):
    pass


class Flawed(Base):
    __tablename__ = "flawed_{tag}"
    __stateguard_final__ = {{"flow": ["ghost"]}}
    id: Mapped[int] = mapped_column(primary_key=True)
    step: Mapped[str] = mapped_column(String(20), default="start")

    flow = StateMachine(
        "step",
        states=["start", "middle", "done", "orphan"],
        transitions=[
            ["go", "start", "middle"],
            ["back", "middle", "start"],
            ["finish", "middle", "done"],
            ["revive", "orphan", "start"],
        ],
    )


class Sound(Base):
    __tablename__ = "sound_{tag}"
    __stateguard_final__ = ("done",)
    id: Mapped[int] = mapped_column(primary_key=True)
    step: Mapped[str] = mapped_column(String(20), default="start")

    flow = StateMachine("step", states=["start", "done"], transitions=[["finish", "start", "done"]])
"""


def test_check_finds_flaws_in_declarations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Unreachable states, triggers that never fire, unknown finals are problems (exit 1); dead ends warn."""
    module = write_module(tmp_path, monkeypatch, FLAWED.format(tag=uuid.uuid4().hex[:6]))
    code, out, err = run(["check", module, "--json"], capsys)
    assert (code, err) == (1, "")
    report = json.loads(out)
    assert report["ok"] is False and report["database"] is None
    assert (report["problems"], report["warnings"]) == (3, 1)
    flawed, sound = report["machines"]
    assert (flawed["model"], flawed["machine"], flawed["column"]) == ("Flawed", "flow", "step")
    found = {(f["level"], f["code"], f.get("state") or f.get("trigger")) for f in flawed["findings"]}
    assert found == {
        ("problem", "unreachable_state", "orphan"),
        ("problem", "trigger_never_fires", "revive"),
        ("problem", "unknown_final", "ghost"),
        ("warning", "no_way_out", "done"),
    }
    assert sound["findings"] == []

    code, out, _ = run(["check", f"{module}:Sound"], capsys)
    assert code == 0
    assert "Sound.flow (sound_" in out and ".step): ok" in out and "0 problems, 0 warnings" in out
    assert "\x1b[" not in out, "no colour when stdout is not a terminal"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_check_colours_only_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a terminal problems are red and warnings yellow; NO_COLOR turns that off."""
    module = write_module(tmp_path, monkeypatch, FLAWED.format(tag=uuid.uuid4().hex[:6]))
    monkeypatch.delenv("NO_COLOR", raising=False)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert cli.main(["check", module]) == 1
    painted = terminal.getvalue()
    assert "\x1b[31mproblem " in painted and "\x1b[33mwarning " in painted
    monkeypatch.setenv("NO_COLOR", "1")
    plain = _Terminal()
    monkeypatch.setattr(sys, "stdout", plain)
    assert cli.main(["check", module]) == 1
    assert "\x1b[" not in plain.getvalue() and "problem  unreachable_state" in plain.getvalue()


# --------------------------------------------------------------------------
# check --db: the live database against the declarations
# --------------------------------------------------------------------------

PARCELS = """
from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from stateguard import StateMachine, version_column


class Base(DeclarativeBase):
    pass


class Parcel(Base):
    __tablename__ = "{table}"
    __stateguard_final__ = {finals!r}
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    stage: Mapped[str] = mapped_column(String(20), default="new")
{version}
    flow = StateMachine("stage", states={states!r}, transitions={transitions!r}, legal_edges={legal!r})
"""


def parcels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, table: str, **kw: Any) -> str:
    kw.setdefault("states", ["new", "packed", "sent", "lost"])
    kw.setdefault("finals", ("sent", "lost"))
    kw.setdefault(
        "transitions", [["pack", "new", "packed"], ["send", "packed", "sent"], ["lose", "packed", "lost"]]
    )
    kw.setdefault("legal", False)
    kw["version"] = "    version: Mapped[int] = version_column()" if kw.pop("versioned", False) else ""
    return write_module(tmp_path, monkeypatch, PARCELS.format(table=table, **kw))


def test_check_compares_the_live_database(
    backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A current schema passes; a model dropping a held state, adding versions and legal edges fails."""
    table = f"sgc_{uuid.uuid4().hex[:8]}"
    v1 = parcels(tmp_path, monkeypatch, table)
    backend.create(importlib.import_module(v1).Base.metadata)
    with backend.engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {table} (id, stage) VALUES (1, 'new'), (2, 'lost'), (3, 'lost')"))

    code, out, err = run(["check", v1, "--db", backend.url, "--json"], capsys)
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert report["ok"] is True and report["machines"][0]["findings"] == []
    assert report["database"] == make_url(backend.url).render_as_string(hide_password=True)

    v2 = parcels(
        tmp_path,
        monkeypatch,
        table,
        states=["new", "packed", "sent"],
        finals=("sent",),
        transitions=[["pack", "new", "packed"], ["send", "packed", "sent"]],
        versioned=True,
        legal=True,
    )
    code, out, err = run(["check", v2, "--db", backend.url, "--json"], capsys)
    assert (code, err) == (1, "")
    findings = {f["code"]: f for f in json.loads(out)["machines"][0]["findings"]}
    assert findings["undeclared_rows"]["rows"] == 2 and findings["undeclared_rows"]["state"] == "lost"
    assert findings["undeclared_rows"]["level"] == "problem"
    assert "still allows ['lost']" in findings["outdated_check_constraint"]["message"]
    assert findings["missing_version_column"]["level"] == "problem"
    if backend.name == "postgresql":
        assert findings["missing_legal_edges"]["level"] == "problem"
        expected = {
            "undeclared_rows",
            "outdated_check_constraint",
            "missing_version_column",
            "missing_legal_edges",
        }
    else:
        assert findings["legal_edges_unsupported"]["level"] == "warning"
        expected = {
            "undeclared_rows",
            "outdated_check_constraint",
            "missing_version_column",
            "legal_edges_unsupported",
        }
    assert set(findings) == expected

    code, out, _ = run(["check", v2, "--db", backend.url], capsys)
    assert code == 1
    assert "problem  undeclared_rows: 2 row(s) hold 'lost', which Parcel.flow does not declare" in out

    missing = parcels(tmp_path, monkeypatch, f"{table}_absent")
    code, out, _ = run(["check", missing, "--db", backend.url, "--json"], capsys)
    assert code == 1
    assert [f["code"] for f in json.loads(out)["machines"][0]["findings"]] == ["missing_table"]


def test_check_sees_a_missing_constraint_and_a_current_trigger(
    pg: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dropped CHECK constraint is reported; a legal-edges trigger made by create_all counts as current."""
    table = f"sgc_{uuid.uuid4().hex[:8]}"
    module = parcels(tmp_path, monkeypatch, table, legal=True)
    pg.create(importlib.import_module(module).Base.metadata)
    code, out, _ = run(["check", module, "--db", pg.url, "--json"], capsys)
    assert code == 0, out
    with pg.engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {table} DROP CONSTRAINT ck_{table}_stage_states"))
        conn.execute(text(f"DROP TRIGGER sg_{table}_stage_edges ON {table}"))
    code, out, _ = run(["check", module, "--db", pg.url, "--json"], capsys)
    assert code == 1
    codes = sorted(f["code"] for f in json.loads(out)["machines"][0]["findings"])
    assert codes == ["missing_check_constraint", "missing_legal_edges"]


def test_check_as_a_real_subprocess(backend: Backend, tmp_path: Path) -> None:
    """The installed ``stateguard`` script imports from the current folder; problems exit 1 with JSON."""
    tag = uuid.uuid4().hex[:6]
    name = f"sgmod_{tag}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(FLAWED.format(tag=tag)))
    script = Path(sys.executable).parent / "stateguard"
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "stateguard"]
    env = {**os.environ, "NO_COLOR": "1"}
    done = subprocess.run(
        [*argv, "check", name, "--db", backend.url, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    codes = {f["code"] for m in report["machines"] for f in m["findings"]}
    assert {"unreachable_state", "trigger_never_fires", "missing_table"} <= codes
