"""The relay's statements: the claim locks its heads with SKIP LOCKED where rows lock, and a batch costs
two statements on PostgreSQL."""

from __future__ import annotations

from sqlalchemy import Engine

from stateguard import Relay

from ..conftest import Backend, capable, count_statements
from ._events import Recorder, emit_one


def test_statements_text(backend: Backend, engine: Engine) -> None:
    """The claim locks its heads with SKIP LOCKED where row locks exist."""
    emit_one(engine, "t", {}, key="k")
    with count_statements(engine) as statements:
        Relay(engine, Recorder()).run_once()
    claim = next(s for s in statements.statements if "sg_earlier" in s)
    if capable(backend, "skip_locked"):
        assert "FOR UPDATE SKIP LOCKED" in claim
    else:
        assert "FOR UPDATE" not in claim


def test_a_batch_costs_two_statements_on_postgresql(backend: Backend, engine: Engine) -> None:
    """A cycle with followers sends one claim and one mark on PostgreSQL (the claim used to be three)."""
    for key in ("k", "k", "j", None):
        emit_one(engine, "t", {}, key=key)
    recorder = Recorder()
    with count_statements(engine) as statements:
        assert Relay(engine, recorder).run_once() == 4
    assert [e.key for e in recorder.batches[0]] == ["k", "k", "j", None]
    # SQLite: BEGIN IMMEDIATE before the claim and before the mark; MariaDB: three claim statements
    # and a SET TRANSACTION before the claim and before the mark.
    expected = {"postgresql": 2, "sqlite": 4}.get(backend.name, 6)
    assert len(statements.statements) == expected, statements.statements
