"""Library calls on a database without stateguard's tables raise ConfigurationError with the fix,
not a raw OperationalError / ProgrammingError that says only "no such table"."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, Integer
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import (
    ConfigurationError,
    consume_once,
    consume_token,
    decrement,
    idempotent,
    issue_token,
    purge_expired,
)
from tests._support.models import Base, Invoice, Order


def _seed(s: Session) -> None:
    s.add(Order(id=1, amount=5))
    s.add(Invoice(id=1))


pytestmark = pytest.mark.tables(Base.metadata, seed=_seed, stateguard="dropped")


def _idempotent(s: Session) -> None:
    with idempotent(s, scope="s", key="k") as call:
        call.complete({})


CALLS: dict[str, Callable[[Session], Any]] = {
    "consume_once": lambda s: consume_once(s, "c", "m"),
    "issue_token": lambda s: issue_token(s, scope="s", ttl=timedelta(minutes=1)),
    "consume_token": lambda s: consume_token(s, "t" * 43, scope="s"),
    "idempotent": _idempotent,
    "counter-ref": lambda s: decrement(s, Order.amount, 1, ref="r"),
    "history": lambda s: Invoice.flow.fire(s, "send", 1, request_id="r"),
    "purge": lambda s: purge_expired(s),
}


@pytest.mark.parametrize("call", CALLS.values(), ids=list(CALLS))
def test_missing_stateguard_tables_are_a_configuration_error(
    engine: Engine, call: Callable[[Session], Any]
) -> None:
    """The error names the fix (alembic upgrade stateguard@head or create_tables)."""
    with Session(engine) as s:
        with pytest.raises(ConfigurationError, match="create_tables") as info:
            call(s)
        assert isinstance(info.value.__cause__, DBAPIError)


class _GhostBase(DeclarativeBase):
    pass


class Ghost(_GhostBase):
    """A model whose table is never created."""

    __tablename__ = "missing_tables_ghost"
    id: Mapped[int] = mapped_column(primary_key=True)
    qty: Mapped[int] = mapped_column(Integer, default=0)


def test_a_missing_user_table_stays_the_drivers_error(engine: Engine) -> None:
    """Only stateguard_* tables become ConfigurationError; the user's own missing table is not hidden."""
    with Session(engine) as s:
        with pytest.raises(DBAPIError) as info:
            decrement(s, Ghost.qty, 1)
        assert not isinstance(info.value, ConfigurationError)
