"""Models and worker functions for the ZooKeeper lock tests (importable by spawned processes)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from sqlalchemy import BigInteger, Engine, Integer, String, create_engine, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import LockLost, ZooKeeperLock, fence_column, guarded_update, sqlite_engine, version_column


class ZkBase(DeclarativeBase):
    pass


class ZkPayout(ZkBase):
    """A row written under a ZooKeeper lock, fenced by the lock's czxid."""

    __tablename__ = "zk_payouts"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    holder: Mapped[str | None] = mapped_column(String(20))
    version: Mapped[int] = version_column()
    fence: Mapped[int | None] = fence_column()


class ZkTally(ZkBase):
    """The storm's counter: read, then written back + 1 with the holder's fence."""

    __tablename__ = "zk_tally"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    value: Mapped[int] = mapped_column(Integer, default=0)
    version: Mapped[int] = version_column()
    fence: Mapped[int | None] = fence_column()


class ZkLog(ZkBase):
    """One row per accepted increment, inserted in its transaction: ``seq`` is the commit order."""

    __tablename__ = "zk_log"
    seq: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    worker: Mapped[int] = mapped_column(Integer)
    value: Mapped[int] = mapped_column(Integer)
    fence: Mapped[int] = mapped_column(BigInteger)


def engine_for(db: str, url: str) -> Engine:
    if db == "sqlite":
        return sqlite_engine(url, busy_timeout=60)
    return create_engine(url, pool_size=2)


def fenced_write(engine: Engine, holder: str, fence: int) -> str:
    """Write the payout row as ``holder`` with ``fence`` (read fresh: only the fence can refuse it)."""
    with Session(engine) as s, s.begin():
        version = s.get_one(ZkPayout, 1).version
        return guarded_update(
            s, ZkPayout, 1, {"holder": holder}, expected_version=version, fence=fence
        ).outcome.name


def client_for(hosts: str, **kw: Any) -> Any:
    from kazoo.client import KazooClient

    client = KazooClient(hosts=hosts, **kw)
    client.start(timeout=30)
    return client


def storm(worker: int, hosts: str, db: str, url: str, path: str, times: int, barrier: Any) -> dict[str, int]:
    """``times`` lock-protected fenced increments of the tally, each in its own transaction."""
    engine = engine_for(db, url)
    zk = client_for(hosts)
    applied = refused = 0
    try:
        barrier.wait()
        started = time.monotonic()
        for _ in range(times):
            with ZooKeeperLock(zk, path, identifier=f"worker-{worker}", timeout=60) as fence:
                with Session(engine) as s, s.begin():
                    row = s.get_one(ZkTally, 1)
                    value, version = row.value, row.version
                    r = guarded_update(
                        s, ZkTally, 1, {"value": value + 1}, expected_version=version, fence=fence
                    )
                    if r.outcome.name == "APPLIED":
                        s.add(ZkLog(worker=worker, value=value + 1, fence=fence))
                        applied += 1
                    else:
                        refused += 1
    finally:
        zk.stop()
        zk.close()
        engine.dispose()
    return {"applied": applied, "refused": refused, "ms": int((time.monotonic() - started) * 1000)}


def paused_holder(
    hosts: str, db: str, url: str, path: str, shared: Any, have_lock: Any, resumed: Any
) -> dict[str, Any]:
    """Take the lock with a short session, get frozen (SIGSTOP by the test), then write with the old fence.

    After SIGCONT the process writes at once, before kazoo's thread can learn
    that the session expired: only the database's fence check stands
    between this write and the newer holder's.
    """
    zk = client_for(hosts, timeout=1.0)
    engine = engine_for(db, url)
    out: dict[str, Any] = {"pid": os.getpid()}
    try:
        lock = ZooKeeperLock(zk, path, identifier="A")
        fence = lock.acquire(timeout=10)
        out["fence"] = fence
        with Session(engine) as s:
            s.get_one(ZkPayout, 1)  # the pool's connection is open before the pause
        shared["pid"] = os.getpid()
        shared["fence"] = fence
        have_lock.set()
        # The pause: the test freezes this process here (a GC stop, a stalled VM).
        if not resumed.wait(60):  # pragma: no cover
            raise AssertionError("never resumed")
        out["write_after_pause"] = fenced_write(engine, "A", fence)
        deadline = time.monotonic() + 20
        while lock.is_held() and time.monotonic() < deadline:
            time.sleep(0.05)
        out["held_later"] = lock.is_held()
        try:
            fenced_write(engine, "A", lock.fence)
            out["fence_property"] = "returned"
        except LockLost:
            out["fence_property"] = "LockLost"
        try:
            lock.release()
            out["release"] = "released"
        except LockLost:
            out["release"] = "LockLost"
    finally:
        zk.stop()
        zk.close()
        engine.dispose()
    return out


def freeze(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def thaw(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)


def stored(engine: Engine) -> tuple[str | None, int | None]:
    with Session(engine) as s:
        row = s.execute(select(ZkPayout.holder, ZkPayout.fence).where(ZkPayout.id == 1)).one()
        return row.holder, row.fence
