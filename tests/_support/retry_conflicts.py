"""Real conflicts for the retry_on_conflict tests: a deadlock between two threads, counted units of
work, and the models they write."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, Integer, String, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import (
    row_lock,
    version_column,
)
from tests.conftest import Backend


class RetryBase(DeclarativeBase): ...


class Acct(RetryBase):
    __tablename__ = "rt_acct"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    balance: Mapped[int] = mapped_column(Integer, default=0)
    version: Mapped[int] = version_column()
    note: Mapped[str | None] = mapped_column(String(50))


class Log(RetryBase):
    __tablename__ = "rt_log"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tag: Mapped[str] = mapped_column(String(50))


class AppError(Exception):
    """The application's own exception."""


def setup(backend: Backend, rows: int = 2) -> Engine:
    engine = backend.create(RetryBase.metadata)
    with Session(engine) as s, s.begin():
        s.add_all([Acct(id=i, balance=0) for i in range(1, rows + 1)])
    return engine


def balances(engine: Engine) -> dict[int, int]:
    with Session(engine) as s:
        return {a.id: a.balance for a in s.scalars(select(Acct).order_by(Acct.id))}


def log_tags(engine: Engine) -> list[str]:
    with Session(engine) as s:
        return sorted(s.scalars(select(Log.tag)))


def bump(s: Session, acct_id: int) -> None:
    s.execute(update(Acct).where(Acct.id == acct_id).values(balance=Acct.balance + 1))


def pg_fast_options(backend: Backend) -> dict[str, str]:
    options = make_url(backend.url).query["options"]
    return {"options": f"{options} -cdeadlock_timeout=200ms"}


# ------------------------------------------- locks: attempts, max_time, flag


def hold_row(engine: Engine) -> Callable[[], None]:
    """Lock row 1 in an open transaction; return what releases it."""
    holder = Session(engine)
    holder.begin()
    holder.execute(select(Acct).where(Acct.id == 1).with_for_update())
    return holder.close


def nowait_unit(engine: Engine, calls: list[int]) -> Callable[[], None]:
    def unit() -> None:
        calls.append(1)
        with Session(engine) as s, s.begin():
            s.add(Log(tag="nowait"))
            s.flush()
            row_lock(s, Acct, 1, nowait=True)
            bump(s, 1)

    return unit


def chain(error: Any) -> list[str]:
    """The exception and what it was raised while handling, as short strings."""
    out: list[str] = []
    while isinstance(error, BaseException) and len(out) < 8:
        out.append(f"{type(error).__name__}: {str(error)[:90]}")
        error = error.__cause__ or error.__context__
    return out
