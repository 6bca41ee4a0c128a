"""create_tables / drop_tables on every kind of bind: Engine, Connection, and awaited on an AsyncEngine or
AsyncConnection of every async driver."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import Engine, inspect
from sqlalchemy.orm import Session

from stateguard import InvalidArgument, create_tables, drop_tables
from stateguard.tables import metadata
from tests._support.async_helpers import ASYNC_TARGETS, AsyncTarget, target_from

OURS = {t.name for t in metadata.sorted_tables}


@pytest.fixture(params=list(ASYNC_TARGETS))
def target(request: pytest.FixtureRequest) -> AsyncTarget:
    """Each async driver, on the namespace of its backend."""
    return target_from(request)


def _present(engine: Engine) -> set[str]:
    return OURS & set(inspect(engine).get_table_names())


def test_create_and_drop_tables_are_awaited_on_an_async_engine(target: AsyncTarget) -> None:
    """await create_tables(AsyncEngine) creates every stateguard table; await drop_tables drops them."""
    sync = target.backend.engine
    drop_tables(sync)

    async def main() -> None:
        engine = target.engine()
        try:
            await create_tables(engine)
            await create_tables(engine)  # idempotent, as on an Engine
            assert _present(sync) == OURS
            await drop_tables(engine)
            assert _present(sync) == set()
        finally:
            await engine.dispose()

    asyncio.run(main())


def test_create_tables_on_an_async_connection_joins_its_transaction(target: AsyncTarget) -> None:
    """On an AsyncConnection the tables are created in that connection's transaction (committed by it)."""
    sync = target.backend.engine
    drop_tables(sync)

    async def main() -> None:
        engine = target.engine()
        try:
            async with engine.begin() as conn:
                await create_tables(conn)
                assert set(await conn.run_sync(lambda c: inspect(c).get_table_names())) >= OURS
            assert _present(sync) == OURS
            async with engine.connect() as conn:
                await drop_tables(conn)
                await conn.commit()
            assert _present(sync) == set()
        finally:
            await engine.dispose()

    asyncio.run(main())


def test_create_tables_still_takes_an_engine_or_a_connection(target: AsyncTarget) -> None:
    """The synchronous call is unchanged: it runs at once on an Engine or a Connection and returns None."""
    sync = target.backend.engine
    drop_tables(sync)
    assert create_tables(sync) is None
    assert _present(sync) == OURS
    with sync.begin() as conn:
        assert drop_tables(conn) is None
    assert _present(sync) == set()


def test_create_tables_refuses_a_session_with_a_typed_error() -> None:
    """A Session, or anything else, where the bind belongs is an InvalidArgument that says what to pass."""
    with pytest.raises(InvalidArgument, match=r"create_tables\(\) needs an Engine.*session.get_bind\(\)"):
        create_tables(Session())  # type: ignore[call-overload]
    with pytest.raises(InvalidArgument, match=r"drop_tables\(\) needs an Engine.*got str"):
        drop_tables("sqlite:///x.db")  # type: ignore[call-overload]
