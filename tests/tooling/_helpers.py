"""Helpers shared by the tooling tests: run the command line in-process, write model modules."""

from __future__ import annotations

import io
import textwrap
import uuid
from pathlib import Path

import pytest

from stateguard.tooling import cli

#: The repository (README.md, the folder ``python -m stateguard`` runs from).
ROOT = Path(__file__).resolve().parents[2]

#: The demo's order model, as `stateguard graph` names it.
DEMO = "stateguard.tooling.demo:DemoOrder"

#: A model module with two machines on one model and a model without any.
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


def write_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> str:
    """Write a uniquely named model module importable by name; return that name."""
    name = f"sgmod_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``stateguard ARGV`` in-process: the exit code, stdout and stderr."""
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


class Terminal(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True
