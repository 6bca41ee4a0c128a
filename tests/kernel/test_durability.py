"""``durability=`` on the guarded writes that guard money, on every backend without a standby.

SQLite and MariaDB refuse ``"replicated"`` with NotSupported (no COMMIT there waits for a
standby), this machine's PostgreSQL with ConfigurationError (no ``synchronous_standby_names``),
each before the call writes anything; ``"local"`` and ``None`` change nothing, down to the
statements sent.  What a synchronous standby does: tests/clusters/test_postgresql_replication.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import stateguard
from stateguard import (
    ConfigurationError,
    InvalidArgument,
    NotSupported,
    Outcome,
    _kernel,
    consume_token,
    decrement,
    emit,
    idempotent,
    increment,
    issue_token,
    release,
    reserve,
    set_durability,
)
from tests.conftest import Backend, count_statements, unavailable


class Base(DeclarativeBase):
    pass


class Stock(Base):
    __tablename__ = "dur_stock"
    id: Mapped[int] = mapped_column(primary_key=True)
    amount: Mapped[int] = mapped_column(default=0)


def _seed(session: Session) -> None:
    session.add(Stock(id=1, amount=10))


pytestmark = pytest.mark.tables(Base.metadata, seed=_seed)


@pytest.fixture
def token(engine: Engine) -> str:
    with Session(engine) as s, s.begin():
        return issue_token(s, scope="pay", ttl=timedelta(hours=1))


def _refusal(backend: Backend) -> type[Exception]:
    """What ``durability="replicated"`` raises here: no standby can confirm a COMMIT on SQLite or
    MariaDB; this machine's PostgreSQL can, but has no synchronous standby configured."""
    return ConfigurationError if backend.name == "postgresql" else NotSupported


@pytest.fixture
def no_standby(backend: Backend, engine: Engine) -> Iterator[None]:
    """Skip on a PostgreSQL that has a synchronous standby (these tests expect none)."""
    if backend.name == "postgresql":
        with engine.connect() as conn:
            if conn.execute(text("SHOW synchronous_standby_names")).scalar_one():
                pytest.skip("this PostgreSQL has synchronous_standby_names set")
    yield


def _written(engine: Engine) -> tuple[int, int, int, int]:
    """(tokens consumed, outbox events, stock amount, idempotency records)."""
    with engine.connect() as conn:
        return (
            conn.execute(
                text("SELECT count(*) FROM stateguard_tokens WHERE consumed_ms IS NOT NULL")
            ).scalar_one(),
            conn.execute(text("SELECT count(*) FROM stateguard_outbox")).scalar_one(),
            conn.execute(text("SELECT amount FROM dur_stock WHERE id = 1")).scalar_one(),
            conn.execute(
                text("SELECT count(*) FROM stateguard_idempotency_keys WHERE status = 'completed'")
            ).scalar_one(),
        )


CALLS: dict[str, Callable[[Session, str, Any], Any]] = {
    "consume_token": lambda s, token, d: consume_token(s, token, scope="pay", durability=d),
    "emit": lambda s, token, d: emit(s, "paid", {"n": 1}, key="o-1", durability=d),
    "decrement": lambda s, token, d: decrement(s, Stock.amount, 1, by=2, ref="o-1", durability=d),
    "increment": lambda s, token, d: increment(s, Stock.amount, 1, by=2, ref="o-2", durability=d),
    "reserve": lambda s, token, d: reserve(s, Stock.amount, {1: 3}, ref="o-3", durability=d),
    "release": lambda s, token, d: release(s, Stock.amount, "o-4", durability=d),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_replicated_is_refused_with_a_typed_error_before_the_call_writes(
    backend: Backend, engine: Engine, token: str, no_standby: None, call: str
) -> None:
    """Every durable call raises NotSupported (SQLite, MariaDB) or ConfigurationError (PostgreSQL)."""
    before = _written(engine)
    with Session(engine) as s:
        with pytest.raises(_refusal(backend), match="durability='replicated'"):
            CALLS[call](s, token, "replicated")
        s.commit()  # whatever the session holds is committed: the call left nothing in it
    assert _written(engine) == before


def test_a_durable_completion_is_refused_and_the_call_stays_open(
    backend: Backend, engine: Engine, no_standby: None
) -> None:
    """complete(durability="replicated") raises the typed error; the call completes afterwards without it."""
    with Session(engine) as s:
        with idempotent(s, scope="charges", key="k1") as call:
            with pytest.raises(_refusal(backend)):
                call.complete({"ok": 1}, durability="replicated")
            call.complete({"ok": 2}, durability="local")
        s.commit()
    with Session(engine) as s:
        with idempotent(s, scope="charges", key="k1") as call:
            assert call.replayed and call.response == {"ok": 2}
        s.commit()


def test_set_durability_refuses_replicated_where_no_standby_can_confirm_a_commit(
    backend: Backend, engine: Engine, token: str, no_standby: None
) -> None:
    """set_durability(engine, "replicated"): NotSupported on SQLite/MariaDB; on PostgreSQL calls refuse."""
    if backend.name != "postgresql":
        with pytest.raises(NotSupported, match="has no such COMMIT"):
            set_durability(engine, "replicated")
        assert id(engine.dialect) not in _kernel.DURABLE
        return
    set_durability(engine, "replicated", timeout=timedelta(seconds=5))
    try:
        with Session(engine) as s, s.begin():
            with pytest.raises(ConfigurationError):
                consume_token(s, token, scope="pay")
            # The engine's default guards counters with a ref only, and "local" opts a call out.
            assert increment(s, Stock.amount, 1, by=1).outcome is Outcome.APPLIED
            assert consume_token(s, token, scope="pay", durability="local").applied
    finally:
        set_durability(engine, None)
    assert id(engine.dialect) not in _kernel.DURABLE


def test_bad_levels_and_timeouts_are_invalid_arguments(engine: Engine, token: str) -> None:
    """An unknown level or a non-positive timeout is InvalidArgument; nothing is consumed."""
    with pytest.raises(InvalidArgument):
        set_durability(engine, "remote_apply")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        set_durability(engine, None, timeout=timedelta(0))
    with pytest.raises(InvalidArgument):
        set_durability(engine, None, timeout=5)  # type: ignore[arg-type]
    with Session(engine) as s:
        with pytest.raises(InvalidArgument, match="durability must be"):
            consume_token(s, token, scope="pay", durability="sync")  # type: ignore[arg-type]
        s.commit()
    assert _written(engine)[0] == 0
    assert id(engine.dialect) not in _kernel.DURABLE


@pytest.mark.parametrize("call", sorted(CALLS))
def test_calls_that_do_not_ask_send_the_same_statements_and_hook_nothing(
    engine: Engine, token: str, call: str
) -> None:
    """durability=None and "local" send exactly what the call always sent, and watch no commit."""
    sent: list[list[str]] = []
    for durability in (None, "local"):
        with Session(engine) as s:
            s.connection()  # BEGIN (and SQLite's) outside the count
            with count_statements(engine) as counted:
                CALLS[call](s, token, durability)
            sent.append(counted.statements)
            assert _kernel.pending(s) == 0
            assert "_stateguard_commit_watches" not in s.__dict__
            s.rollback()
    assert sent[0] == sent[1]
    assert not any("synchronous_commit" in sql for sql in sent[0])


def test_the_public_function_is_exported() -> None:
    """stateguard.set_durability is the public name, documented."""
    assert stateguard.set_durability is set_durability
    assert set_durability.__doc__ and "ReplicationTimeout" in set_durability.__doc__


@pytest.mark.parametrize("driver", ["psycopg", "asyncpg"])
def test_an_async_session_gets_the_same_refusals(driver: str) -> None:
    """AsyncSession: async psycopg gets the server's answer (ConfigurationError), asyncpg NotSupported."""
    import asyncio

    from sqlalchemy.engine import make_url
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from tests.conftest import PG_URL

    url = make_url(PG_URL).set(drivername=f"postgresql+{driver}")
    expected = ConfigurationError if driver == "psycopg" else NotSupported

    async def run() -> None:
        engine = create_async_engine(url)
        try:
            async with AsyncSession(engine) as s:
                if (await s.execute(text("SHOW synchronous_standby_names"))).scalar_one():
                    pytest.skip("this PostgreSQL has synchronous_standby_names set")
                # Refused before the INSERT: no table is needed for the answer.
                with pytest.raises(expected, match="durability='replicated'"):
                    await emit(s, "paid", {"n": 1}, durability="replicated")
                await s.rollback()
        finally:
            await engine.dispose()

    try:
        asyncio.run(run())
    except OSError as error:  # pragma: no cover - a laptop without the server: skipped loudly, CI fails
        unavailable("postgresql", error)
