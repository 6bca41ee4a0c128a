"""A Session with per-model binds (``Session(binds={Base: engine})``) can use every stateguard call.

consume_once, the database tokens, idempotent() and advisory_lock use
stateguard's own tables (or none), which such binds do not name: they called
``session.connection()`` with no mapper and got UnboundExecutionError (issue
15, item 10).  They now use the one engine every bind points to, the same
transaction as the model's writes; binds to several engines must say where
stateguard's tables live (ConfigurationError, or bind them and it works).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import Engine, create_engine, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import (
    ConfigurationError,
    Outcome,
    advisory_lock,
    consume_once,
    consume_token,
    decrement,
    idempotent,
    issue_token,
    row_lock,
)
from stateguard.tables import consumed_messages
from stateguard.tables import metadata as sg_metadata
from tests._support.models import Base, Order
from tests.conftest import Backend, capable


class _Other(DeclarativeBase):
    pass


class Elsewhere(_Other):
    """A model of a second database (an in-memory SQLite engine)."""

    __tablename__ = "binds_elsewhere"
    id: Mapped[int] = mapped_column(primary_key=True)


def _seed(s: Session) -> None:
    s.add(Order(id=1, amount=10))


pytestmark = pytest.mark.tables(Base.metadata, seed=_seed)


def test_every_call_works_through_per_model_binds(engine: Engine, backend: Backend) -> None:
    """Triggers, counters, consume_once, tokens, idempotent() and locks run in one transaction."""
    with Session(binds={Base: engine}) as s, s.begin():
        assert Order.flow.pay(s, 1).outcome is Outcome.APPLIED
        assert decrement(s, Order.amount, 1, by=2).outcome is Outcome.APPLIED
        assert consume_once(s, "billing", "m-1").outcome is Outcome.APPLIED
        assert consume_once(s, "billing", "m-1").outcome is Outcome.REPEATED
        token = issue_token(s, scope="reset", ttl=timedelta(minutes=5))
        assert consume_token(s, token, scope="reset").outcome is Outcome.APPLIED
        with idempotent(s, scope="pay", key="k-1") as call:
            call.complete({"ok": True})
        if capable(backend, "row_locks"):  # SQLite: no row or named locks (sqlite_engine instead)
            assert row_lock(s, Order, 1) is not None
            with advisory_lock(s, "binds-test"):
                pass
    with Session(engine) as s:
        assert s.execute(select(func.count()).select_from(consumed_messages)).scalar_one() == 1
        assert s.get(Order, 1).amount == 8  # type: ignore[union-attr]


def test_separate_mode_idempotent_through_per_model_binds(engine: Engine) -> None:
    """idempotent(mode="separate") claims in its own transaction on the one bound engine."""
    with Session(binds={Base: engine}) as s:
        with idempotent(s, scope="pay", key="k-2", mode="separate") as call:
            call.complete({"ok": True})
        with idempotent(s, scope="pay", key="k-2", mode="separate") as call:
            assert call.replayed and call.response == {"ok": True}


def test_binds_to_several_engines_must_name_stateguards_tables(engine: Engine) -> None:
    """With two engines bound, consume_once is a ConfigurationError until stateguard's tables are bound."""
    other = create_engine("sqlite://")
    _Other.metadata.create_all(other)
    with Session(binds={Base: engine, _Other: other}) as s, s.begin():
        with pytest.raises(ConfigurationError, match=r"stateguard\.tables\.metadata\.sorted_tables"):
            consume_once(s, "billing", "m-2")
    bound = {Base: engine, _Other: other, **dict.fromkeys(sg_metadata.sorted_tables, engine)}
    with Session(binds=bound) as s, s.begin():  # type: ignore[arg-type]
        assert consume_once(s, "billing", "m-2").outcome is Outcome.APPLIED
    other.dispose()
