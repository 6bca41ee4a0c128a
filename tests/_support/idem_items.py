"""The Item model and record probes of the idempotent() block tests (same-transaction and separate mode)."""

from __future__ import annotations

from typing import cast

from sqlalchemy import Engine, Integer, String, Table, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from stateguard.tables import idempotency_keys


class _Base(DeclarativeBase):
    pass


class Item(_Base):
    __tablename__ = "rv_items"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    name: Mapped[str] = mapped_column(String(50))
    n: Mapped[int] = mapped_column(Integer, default=0)


md = _Base.metadata
items = cast(Table, Item.__table__)


def _names(engine: Engine) -> list[str]:
    with engine.connect() as c:
        return sorted(c.scalars(select(items.c.name)).all())


def _keys(engine: Engine, scope: str) -> list[str]:
    with engine.connect() as c:
        return sorted(
            c.scalars(select(idempotency_keys.c.idem_key).where(idempotency_keys.c.scope == scope)).all()
        )


class Boom(Exception):
    pass
