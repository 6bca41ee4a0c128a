"""``stateguard check``: checks of declarations and of live databases, through ``main(argv)``
and once as a real subprocess."""

from __future__ import annotations

import importlib
import json
import os
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
from tests.conftest import Backend, capable
from tests.tooling._helpers import Terminal, run, write_module

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


def test_check_colours_only_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a terminal problems are red and warnings yellow; NO_COLOR turns that off."""
    module = write_module(tmp_path, monkeypatch, FLAWED.format(tag=uuid.uuid4().hex[:6]))
    monkeypatch.delenv("NO_COLOR", raising=False)
    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert cli.main(["check", module]) == 1
    painted = terminal.getvalue()
    assert "\x1b[31mproblem " in painted and "\x1b[33mwarning " in painted
    monkeypatch.setenv("NO_COLOR", "1")
    plain = Terminal()
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
    if capable(backend, "legal_edges"):
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
