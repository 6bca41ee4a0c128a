"""Workers of the create_tables() race (importable by spawned child processes)."""

from __future__ import annotations

import asyncio
import traceback
from typing import Any

from sqlalchemy import Engine, create_engine, make_url, select
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from stateguard import create_tables


def sync_engine(name: str, url: str) -> Engine:
    """A small engine of this worker's own (SQLite waits up to a minute for the write lock)."""
    connect_args = {"timeout": 60} if name == "sqlite" else {}
    return create_engine(url, pool_size=1, max_overflow=0, connect_args=connect_args)


def async_engine(name: str, url: str) -> AsyncEngine:
    """The async twin of :func:`sync_engine`: aiosqlite, asyncpg (schema in server_settings), aiomysql."""
    parsed = make_url(url)
    if name == "sqlite":
        return create_async_engine(parsed.set(drivername="sqlite+aiosqlite"), connect_args={"timeout": 60})
    if name == "mariadb":
        return create_async_engine(parsed.set(drivername="mysql+aiomysql"))
    schema = str(parsed.query["options"]).removeprefix("-csearch_path=")
    bare = parsed.set(drivername="postgresql+asyncpg").difference_update_query(["options"])
    return create_async_engine(bare, connect_args={"server_settings": {"search_path": schema}})


def create(name: str, url: str, mode: str, barrier: Any) -> str | None:
    """Connect, wait at ``barrier`` with the others, call create_tables(); ``None`` or the traceback.

    ``mode``: ``sync`` (an Engine), ``connection`` (a Connection in a transaction), ``async`` (an
    AsyncEngine).
    """
    try:
        if mode in ("sync", "connection"):
            engine = sync_engine(name, url)
            try:
                with engine.connect() as conn:  # connected before the barrier: the calls start together
                    conn.execute(select(1))
                barrier.wait()
                if mode == "sync":
                    create_tables(engine)
                else:  # in the caller's transaction, committed by it
                    with engine.begin() as conn:
                        create_tables(conn)
            finally:
                engine.dispose()
        else:
            asyncio.run(_create_async(name, url, barrier))
    except BaseException:
        barrier.abort()  # a dead peer must not leave the others waiting
        return traceback.format_exc()
    return None


async def _create_async(name: str, url: str, barrier: Any) -> None:
    engine = async_engine(name, url)
    try:
        async with engine.connect() as conn:
            await conn.execute(select(1))
        barrier.wait()  # one task per event loop: blocking here stalls nobody
        await create_tables(engine)
    finally:
        await engine.dispose()
