"""The versioned ``Doc`` model of the version-column tests, the ``tables`` marker that creates its
tables, and helpers that read its rows."""

from __future__ import annotations

import threading
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Engine, Integer, Numeric, SmallInteger, String, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import StateMachine, version_column
from tests.conftest import Backend


class _Base(DeclarativeBase):
    pass


_declared_calls: list[Any] = []


class Doc(_Base):
    __tablename__ = "sg_va_doc"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(12), default="draft")
    title: Mapped[str | None] = mapped_column(String(8))
    note: Mapped[str | None] = mapped_column(String(60))
    price: Mapped[Decimal | None] = mapped_column(Numeric(6, 2))
    small: Mapped[int | None] = mapped_column(SmallInteger)
    hits: Mapped[int] = mapped_column(Integer, default=0)
    version: Mapped[int] = version_column()

    flow = StateMachine(
        "status",
        states=["draft", "published", "archived"],
        transitions=[
            {
                "trigger": "publish",
                "source": "draft",
                "dest": "published",
                "after_commit": _declared_calls.append,
            },
            {"trigger": "archive", "source": ["draft", "published"], "dest": "archived"},
        ],
    )


def _seed(s: Session) -> None:
    s.add_all([Doc(id=1, title="orig"), Doc(id=2, title="two")])
    _declared_calls.clear()


# The tables of a module on the shared ``engine`` fixture (tests/conftest.py): Doc and
# stateguard's own, with the rows 1 and 2.
DOC_TABLES = pytest.mark.tables(_Base.metadata, seed=_seed)


def _row(engine: Engine, key: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(
            select(Doc.status, Doc.title, Doc.note, Doc.version, Doc.hits).where(Doc.id == key)
        ).one()


# -- races ---------------------------------------------------------------------------------------


def _race(backend: Backend, workers: int, body: Any) -> list[Any]:
    eng = backend.new_engine(pool_size=workers + 2)
    barrier = threading.Barrier(workers)
    results: list[Any] = [None] * workers

    def run(i: int) -> None:
        try:
            results[i] = body(eng, barrier, i)
        except BaseException as error:  # reported by the assertions
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    eng.dispose()
    return results
