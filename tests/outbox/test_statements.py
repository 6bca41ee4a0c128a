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


def test_a_batch_costs_two_statements_on_postgresql(backend: Backend, engine: Engine, hold: str) -> None:
    """A cycle with followers sends one claim and one mark on PostgreSQL (the claim used to be three)."""
    for key in ("k", "k", "j", None):
        emit_one(engine, "t", {}, key=key)
    recorder = Recorder()
    with count_statements(engine) as statements:
        assert Relay(engine, recorder, hold=hold).run_once() == 4
    assert [e.key for e in recorder.batches[0]] == ["k", "k", "j", None]
    # SQLite: BEGIN IMMEDIATE before the claim and before the mark; MariaDB: three claim statements
    # and a SET TRANSACTION before the claim and before the mark.
    expected = {"postgresql": 2, "sqlite": 4}.get(backend.name, 6)
    assert len(statements.statements) == expected, statements.statements


def test_a_claim_holding_locks_writes_nothing_and_the_mark_is_the_one_write(
    backend: Backend, engine: Engine
) -> None:
    """hold="locks": the claim is a SELECT ... FOR UPDATE SKIP LOCKED that sets the lease as the
    transaction's idle timeout, and the one UPDATE is the mark (it SETs published_ms)."""
    if backend.name != "postgresql":
        return
    emit_one(engine, "t", {}, key="k")
    with count_statements(engine) as statements:
        assert Relay(engine, Recorder(), hold="locks").run_once() == 1
    claim, mark = statements.statements
    assert claim.startswith("WITH sg_heads AS MATERIALIZED") and "UPDATE stateguard_outbox" not in claim
    # synchronous_commit off, and the idle timeout, for the transaction (set_config(..., true))
    assert "FOR UPDATE SKIP LOCKED" in claim and claim.count("set_config(") == 2
    assert mark.startswith("UPDATE") and "published_ms=" in mark
