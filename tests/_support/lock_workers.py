"""Models and worker functions for the lock tests (importable by spawned processes)."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import Boolean, Engine, Integer, String, create_engine, select, update
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import (
    LockLost,
    RedisLock,
    advisory_lock,
    fence_column,
    guarded_update,
    row_lock,
    sqlite_engine,
    version_column,
)


class LockBase(DeclarativeBase):
    pass


class Tally(LockBase):
    """A plain counter row: no version, no guard; only a lock keeps increments apart."""

    __tablename__ = "lock_tally"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    value: Mapped[int] = mapped_column(Integer, default=0)


class Job(LockBase):
    """A job-queue row, taken by one worker."""

    __tablename__ = "lock_jobs"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    done: Mapped[bool] = mapped_column(Boolean, default=False)


class JobTake(LockBase):
    """One row per time a worker took a job (no unique key: doubles must show up)."""

    __tablename__ = "lock_job_takes"
    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(Integer)
    worker: Mapped[str] = mapped_column(String(20))


class Payout(LockBase):
    """A row written under a Redis lock, fenced by the lock's token."""

    __tablename__ = "lock_payouts"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    holder: Mapped[str | None] = mapped_column(String(20))
    version: Mapped[int] = version_column()
    fence: Mapped[int | None] = fence_column()


def engine_for(db: str, url: str) -> Engine:
    """SQLite gets stateguard's engine (BEGIN IMMEDIATE: row_lock works there)."""
    if db == "sqlite":
        return sqlite_engine(url, busy_timeout=60)
    return create_engine(url, pool_size=2)


def _read_pause_write(session: Session, pause: float) -> None:
    """The deliberately racy read-modify-write: read, wait, write read + 1."""
    value = session.scalars(select(Tally.value).where(Tally.id == 1)).one()
    time.sleep(pause)
    session.execute(update(Tally).where(Tally.id == 1).values(value=value + 1))


def increment(
    db: str,
    url: str,
    mode: str,
    times: int,
    barrier: Any,
    lock_name: str,
    redis_url: str | None,
    pause: float,
) -> int:
    """Increment the tally ``times`` times, each in its own transaction, under the given lock."""
    engine = engine_for(db, url)
    client: Any = None
    if mode == "redis":
        import redis

        client = redis.Redis.from_url(redis_url or "")
    try:
        barrier.wait()
        for _ in range(times):
            if mode == "none":
                with Session(engine) as s, s.begin():
                    _read_pause_write(s, pause)
            elif mode == "row_lock":
                with Session(engine) as s, s.begin():
                    tally = row_lock(s, Tally, 1)
                    value = tally.value
                    time.sleep(pause)
                    tally.value = value + 1
            elif mode == "advisory":
                with Session(engine) as s, advisory_lock(s, lock_name):
                    _read_pause_write(s, pause)
                    s.commit()  # inside the block: the next holder sees this write
            elif mode == "redis":
                with RedisLock(client, lock_name, ttl=30, sleep=0.002), Session(engine) as s, s.begin():
                    _read_pause_write(s, pause)
            else:  # pragma: no cover
                raise ValueError(mode)
    finally:
        engine.dispose()
        if client is not None:
            client.close()
    return times


def _fenced_write(engine: Engine, holder: str, fence: int) -> dict[str, Any]:
    """Read the row fresh (so the version check passes) and write it with ``fence``."""
    with Session(engine) as s, s.begin():
        version = s.get_one(Payout, 1).version
        r = guarded_update(s, Payout, 1, {"holder": holder}, expected_version=version, fence=fence)
        return {"outcome": r.outcome.name, "expected": version, "version": r.version}


def paused_holder(
    db: str, url: str, redis_url: str, name: str, ttl: float, have_lock: Any, b_wrote: Any, a_done: Any
) -> dict[str, Any]:
    """Take the lock, stall past its TTL while B takes over and writes, then write and exit."""
    import redis

    client = redis.Redis.from_url(redis_url)
    engine = engine_for(db, url)
    out: dict[str, Any] = {"lock_lost": False}
    lock = RedisLock(client, name, ttl=ttl)
    try:
        with lock as fence:
            out["fence"] = fence
            have_lock.set()
            # The pause: a GC stop or a stalled VM would look exactly like this.
            if not b_wrote.wait(30):  # pragma: no cover
                raise AssertionError("the second holder never wrote")
            out["owned_after_pause"] = lock.owned()
            out.update(_fenced_write(engine, "A", fence))
    except LockLost:
        out["lock_lost"] = True
    finally:
        a_done.set()
        engine.dispose()
        client.close()
    return out


def next_holder(
    db: str, url: str, redis_url: str, name: str, have_lock: Any, b_wrote: Any, a_done: Any
) -> dict[str, Any]:
    """Wait for A's lock to expire, take it, write, and keep it until A has tried to write and exit."""
    import redis

    client = redis.Redis.from_url(redis_url)
    engine = engine_for(db, url)
    out: dict[str, Any] = {}
    try:
        if not have_lock.wait(30):  # pragma: no cover
            raise AssertionError("the first holder never got the lock")
        lock = RedisLock(client, name, ttl=30, blocking_timeout=15, sleep=0.01)
        started = time.monotonic()
        with lock as fence:
            out["waited"] = time.monotonic() - started
            out["fence"] = fence
            out.update(_fenced_write(engine, "B", fence))
            b_wrote.set()
            if not a_done.wait(30):  # pragma: no cover
                raise AssertionError("the first holder never finished")
            out["owned_after_a_exit"] = lock.owned()
        out["free_after_exit"] = not lock.locked()
    finally:
        b_wrote.set()
        engine.dispose()
        client.close()
    return out
