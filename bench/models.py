"""The tables every scenario uses, and the small helpers they share.

Every table is prefixed ``sg_bench_``; each scenario drops and creates the
tables it needs and drops them again when it is done.
"""

from __future__ import annotations

import multiprocessing
import sqlite3
import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from multiprocessing.context import BaseContext
from typing import Any

from sqlalchemy import CheckConstraint, Engine, Integer, String, create_engine, event, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.schema import Table as SATable

from stateguard import StateMachine, version_column

STATES = ["pending", "paid", "shipped", "cancelled"]
TRANSITIONS = [
    {"trigger": "pay", "source": "pending", "dest": "paid"},
    {"trigger": "ship", "source": "paid", "dest": "shipped"},
    {"trigger": "cancel", "source": ["pending", "paid"], "dest": "cancelled"},
]


class Base(DeclarativeBase):
    pass


class GuardedOrder(Base):
    """The stateguard model."""

    __tablename__ = "sg_bench_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    version: Mapped[int] = version_column()
    paid_at: Mapped[datetime | None]
    note: Mapped[str | None] = mapped_column(String(50))

    flow = StateMachine("status", states=STATES, transitions=TRANSITIONS)


class PlainOrder(Base):
    """The same table without stateguard (``version_id_col`` set by hand).

    It carries the same CHECK constraint stateguard adds to GuardedOrder, so
    every variant pays the same database-side cost; the constraint's own cost
    is measured separately against BareOrder.
    """

    __tablename__ = "sg_bench_plain_orders"
    __table_args__ = (
        CheckConstraint(f"status IN ({', '.join(repr(x) for x in STATES)})", name="ck_plain_states"),
    )
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    version: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    paid_at: Mapped[datetime | None]
    note: Mapped[str | None] = mapped_column(String(50))

    __mapper_args__ = {"version_id_col": version}


class RacyOrder(Base):
    """PlainOrder's table mapped without a version check: the usual load-check-save code."""

    __table__ = PlainOrder.__table__


class BareOrder(Base):
    """The same columns with no CHECK constraint at all."""

    __tablename__ = "sg_bench_bare_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    version: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    paid_at: Mapped[datetime | None]
    note: Mapped[str | None] = mapped_column(String(50))


class Stock(Base):
    __tablename__ = "sg_bench_stock"
    id: Mapped[int] = mapped_column(primary_key=True)
    amount: Mapped[int] = mapped_column(Integer, nullable=False)
    version: Mapped[int] = mapped_column(Integer, nullable=False, default=0)


class Purchase(Base):
    """One row per purchase a buyer was told succeeded."""

    __tablename__ = "sg_bench_purchases"
    id: Mapped[int] = mapped_column(primary_key=True)
    stock_id: Mapped[int] = mapped_column(Integer)
    buyer: Mapped[str] = mapped_column(String(40))


class Effect(Base):
    """One row per side effect of a payment (an e-mail, a shipment): two for one order is a double."""

    __tablename__ = "sg_bench_effects"
    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[int] = mapped_column(Integer)


_SCALE_MODELS: dict[int, type[Any]] = {}


def scale_model(rows: int) -> type[Any]:
    """A stateguard model of its own table for a table of ``rows`` rows (one class per size)."""
    model = _SCALE_MODELS.get(rows)
    if model is None:
        # type() rather than a class statement in a loop: the declarative
        # registry warns about two classes of the same name.
        model = type(
            f"ScaleOrder{rows}",
            (Base,),
            {
                "__module__": __name__,
                "__tablename__": f"sg_bench_scale_{rows}",
                "__annotations__": {"id": Mapped[int], "status": Mapped[str], "version": Mapped[int]},
                "id": mapped_column(primary_key=True),
                "status": mapped_column(String(20), default="pending"),
                "version": version_column(),
                "flow": StateMachine("status", states=STATES, transitions=TRANSITIONS),
            },
        )
        _SCALE_MODELS[rows] = model
    return model


@dataclass
class Table:
    """One result table: rows of the same keys, and notes printed under it."""

    title: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


#: The modules every bench worker process needs, imported once by the fork server.
_PRELOAD = ["sqlalchemy", "stateguard", "bench.scenarios", "bench.striped", "bench.locks", "bench.relay"]


def worker_processes() -> BaseContext:
    """The multiprocessing context the scenarios start their worker processes with.

    A fork server, not fork: the benchmark's own process holds pooled
    connections and threads that a forked child must not share.  The server
    starts once per run with the bench's modules imported, so each worker is a
    fork of a clean process (milliseconds) instead of a fresh interpreter that
    imports SQLAlchemy and stateguard again (about half a second of CPU each);
    what is timed starts at the workers' barrier either way.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def make_engine(url: str, **kw: Any) -> Engine:
    kw.setdefault("pool_size", 16)
    if url.startswith("sqlite"):
        kw.setdefault("connect_args", {"timeout": 60})
    return create_engine(url, **kw)


def bench_tables() -> list[SATable]:
    return [t for t in Base.metadata.sorted_tables if t.name.startswith("sg_bench_")]


def reset(engine: Engine, *models: type[Any]) -> None:
    """Drop every bench table, then create the tables of ``models``."""
    Base.metadata.drop_all(engine, tables=bench_tables())
    Base.metadata.create_all(engine, tables=[m.__table__ for m in models])


def drop(engine: Engine) -> None:
    Base.metadata.drop_all(engine, tables=bench_tables())


def fill(engine: Engine, table_name: str, rows: int) -> None:
    """Insert ids 1..rows as 'pending' server-side (seconds for 10^6 rows, not minutes)."""
    name = engine.dialect.name
    cols = f"INSERT INTO {table_name} (id, status, version)"
    if name == "postgresql":
        sql = f"{cols} SELECT g, 'pending', 0 FROM generate_series(1, {rows}) AS g"
    elif name in ("mysql", "mariadb"):
        # MariaDB's SEQUENCE engine: seq_1_to_N is a virtual table of 1..N.
        sql = f"{cols} SELECT seq, 'pending', 0 FROM seq_1_to_{rows}"
    else:
        sql = (
            f"WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < {rows}) "
            f"{cols} SELECT x, 'pending', 0 FROM c"
        )
    with engine.begin() as conn:
        conn.execute(text(sql))


def server_version(engine: Engine) -> str:
    name = engine.dialect.name
    if name == "sqlite":
        return f"SQLite {sqlite3.sqlite_version}"
    with engine.connect() as conn:
        if name == "postgresql":
            return "PostgreSQL " + str(conn.scalar(text("SHOW server_version")))
        return str(conn.scalar(text("SELECT VERSION()")))


@contextmanager
def counting(engine: Engine) -> Iterator[list[int]]:
    """Count the statements SQLAlchemy sends (BEGIN and COMMIT are not statements)."""
    box = [0]

    def on(*_: Any) -> None:
        box[0] += 1

    event.listen(engine, "before_cursor_execute", on)
    try:
        yield box
    finally:
        event.remove(engine, "before_cursor_execute", on)


def pct(values: Sequence[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)
