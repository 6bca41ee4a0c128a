"""What stateguard costs an application's own transactions, and the per-engine hooks it uses instead.

stateguard registers nothing on the ``Engine`` or ``Session`` class: its statement hook goes on
an engine's dialect the first time stateguard needs it there, its commit listeners on a session
the first time a callback is scheduled on it.  The call counts are taken with cProfile in fresh
processes (deterministic), over 200 transactions of ``with session.begin(): session.execute(...)``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, Integer, String, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import stateguard
from stateguard import _kernel, create_tables, drop_tables, guarded_update, version_column
from tests.conftest import Backend

_COUNT = textwrap.dedent(
    """
    import cProfile, pstats, sys
    mode, url = sys.argv[1], sys.argv[2]
    from sqlalchemy import Integer, create_engine, select
    from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
    if mode != "plain":
        import stateguard
    engine = create_engine(url)
    if mode == "used":
        class Base(DeclarativeBase):
            pass
        class Item(Base):
            __tablename__ = "items"
            id: Mapped[int] = mapped_column(primary_key=True)
            n: Mapped[int] = mapped_column(Integer)
        Base.metadata.create_all(engine)
        stateguard.create_tables(engine)
        with Session(engine) as s, s.begin():
            s.add(Item(id=1, n=5))
        with Session(engine) as s, s.begin():
            item = s.get(Item, 1)
            with s.begin_nested():
                stateguard.decrement(s, Item.n, item, by=1)
            with stateguard.idempotent(s, scope="count", key="k") as call:
                if not call.replayed:
                    s.execute(select(1))
                    call.complete({"ok": True})
        assert stateguard._kernel.hooked(engine)
    def work():
        for _ in range(200):
            with Session(engine) as s, s.begin():
                s.execute(select(1))
    work()
    profile = cProfile.Profile()
    profile.enable()
    work()
    profile.disable()
    print(pstats.Stats(profile).total_calls)
    """
)


def _calls(mode: str, url: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _COUNT, mode, url], capture_output=True, text=True, check=True, timeout=120
    )
    return int(out.stdout.split()[-1])


def test_importing_stateguard_adds_no_call_to_an_engine_it_never_used(tmp_path: Path) -> None:
    """An application's own transaction makes exactly as many Python calls with stateguard imported."""
    url = f"sqlite:///{tmp_path / 'app.db'}"
    assert _calls("imported", url) == _calls("plain", url)


def test_an_engine_stateguard_used_pays_at_most_five_percent_more(tmp_path: Path) -> None:
    """After guarded writes, savepoints and an idempotent block on it, an app transaction costs <= +5%."""
    url = f"sqlite:///{tmp_path / 'app.db'}"
    plain, used = _calls("plain", url), _calls("used", url)
    assert used <= plain * 1.05, (plain, used)


def test_nothing_is_registered_on_the_engine_or_session_class() -> None:
    """A new engine, its dialect, connections and sessions carry no event listener after import stateguard."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import SessionEvents

    engine = create_engine("sqlite://")
    assert not engine._has_events and not engine.dialect._has_events
    with engine.connect() as conn:
        assert not conn._has_events
    session = Session(engine)
    names = [n for n in dir(SessionEvents) if not n.startswith("_") and n != "dispatch"]
    assert names and not [n for n in names if getattr(session.dispatch, n, None)], "session listeners"
    session.close()
    engine.dispose()


class _Base(DeclarativeBase):
    pass


class Stock(_Base):
    """A row with a version column: an ORM flush of a stale value would be a lost update."""

    __tablename__ = "hook_stock"
    id: Mapped[int] = mapped_column(primary_key=True)
    amount: Mapped[int] = mapped_column(Integer)
    note: Mapped[str | None] = mapped_column(String(20))
    version: Mapped[int] = version_column()


@pytest.fixture
def fresh(backend: Backend) -> Iterator[Engine]:
    """A new engine (so a new dialect, never hooked) on the backend's namespace, with one stock row."""
    backend.create(_Base.metadata)
    engine = backend.new_engine(pool_size=2)
    assert not _kernel.hooked(engine)
    with Session(engine) as s, s.begin():
        s.add(Stock(id=1, amount=5))
    yield engine
    engine.dispose()
    drop_tables(backend.engine)


@pytest.mark.rollback
def test_a_savepoint_opened_before_the_first_guarded_write_expires_what_it_synced(fresh: Engine) -> None:
    """The app's begin_nested() before stateguard ever ran on the engine: rolling it back reloads the row."""
    with Session(fresh) as s, s.begin():
        stock = s.get(Stock, 1)
        assert stock is not None
        outer = s.begin_nested()
        inner = s.begin_nested()
        result = guarded_update(s, Stock, stock, {"amount": 4}, expected_version=stock.version)
        assert result.applied and stock.amount == 4
        inner.rollback()
        assert stock.amount == 5  # reloaded: the row is back to 5
        outer.commit()
    with Session(fresh) as s:
        assert s.scalar(select(Stock.amount).where(Stock.id == 1)) == 5


@pytest.mark.rollback
def test_the_journal_of_an_earlier_transaction_on_a_kept_connection_is_not_replayed(fresh: Engine) -> None:
    """A Connection the application keeps across transactions starts each one with an empty journal."""
    with fresh.connect() as conn:
        with Session(bind=conn) as s:
            stock = s.get(Stock, 1)
            assert stock is not None
            sp = s.begin_nested()
            guarded_update(s, Stock, stock, {"note": "first"}, expected_version=stock.version)
            sp.commit()
            s.commit()
        with Session(bind=conn) as s:
            stock = s.get(Stock, 1)
            assert stock is not None and stock.note == "first"
            sp = s.begin_nested()
            s.execute(select(1))
            sp.rollback()
            # Nothing synced in this transaction's savepoint: the loaded value stays loaded.
            assert "note" in stock.__dict__ and stock.note == "first"
            s.commit()


@pytest.mark.rollback
def test_an_idempotent_block_opens_its_savepoint_before_the_first_statement_on_a_fresh_engine(
    fresh: Engine,
) -> None:
    """On an engine never hooked, a statement in the block still goes inside the block's savepoint."""
    create_tables(fresh)
    try:
        with Session(fresh) as s, s.begin():
            with pytest.raises(RuntimeError):
                with stateguard.idempotent(s, scope="hooks", key="k1"):
                    s.connection().exec_driver_sql("UPDATE hook_stock SET amount = 1 WHERE id = 1")
                    raise RuntimeError("the block fails")
            # The block's savepoint rolled the UPDATE back; the outer transaction goes on.
            assert s.scalar(select(Stock.amount).where(Stock.id == 1)) == 5
    finally:
        drop_tables(fresh)
