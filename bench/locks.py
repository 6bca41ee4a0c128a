"""7. Distributed locks protecting the same fenced update.

``workers`` processes each run ``ops`` operations of: acquire the lock, read the
row, write ``value + 1`` with :func:`stateguard.guarded_update` (fenced where the
lock hands out a fence), commit, release.  The variants run one after the other
in a random order per round, on the same row, against PostgreSQL:

* ``advisory_lock``: a PostgreSQL transaction-level advisory lock taken inside
  the transaction that writes (no fence needed: the lock ends with the write);
* ``RedisLock(fences=engine)``: the fence from ``stateguard_fences``;
* ``RedisLock`` (fence from Redis);
* ``ZooKeeperLock``: the fence is the ``czxid`` of the lock's znode (only when a
  ZooKeeper is given with ``--zk`` / ``SG_BENCH_ZK`` or one can be started
  from the Debian ``zookeeperd`` package).

Reported per variant: operations per second, median and p99 of one whole
operation (acquire + write + release), writes refused as STALE, and lost
updates (operations told APPLIED minus what the row gained: must be 0).
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from sqlalchemy import BigInteger, Engine, select, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Mapped, Session, mapped_column

from stateguard import (
    Outcome,
    RedisLock,
    advisory_lock,
    create_tables,
    fence_column,
    guarded_update,
    version_column,
)

from .models import Base, Table, make_engine, median, pct, reset
from .scenarios import _run_workers

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
LOCK_NAME = "sg-bench-lock"


class FencedCounter(Base):
    """One row every lock variant protects."""

    __tablename__ = "sg_bench_fenced"
    id: Mapped[int] = mapped_column(primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    version: Mapped[int] = version_column()
    fence: Mapped[int | None] = fence_column()


def _write(session: Session, fence: int | None) -> Outcome:
    """Read-modify-write of the row: without the lock this loses updates (the version check
    turns them into STALE instead)."""
    value, version = session.execute(
        select(FencedCounter.value, FencedCounter.version).where(FencedCounter.id == 1)
    ).one()
    result = guarded_update(
        session, FencedCounter, 1, {"value": value + 1}, expected_version=version, fence=fence
    )
    return result.outcome


@contextlib.contextmanager
def _lock_for(variant: str, engine: Engine, clients: dict[str, Any], prefix: str) -> Iterator[int | None]:
    if variant.startswith("RedisLock"):
        # redis-py polls a held lock; 1 ms (not its 0.1 s default) so polling does not dominate.
        fences = engine if variant == "RedisLock(fences=engine)" else None
        lock = RedisLock(
            clients["redis"], f"{prefix}{LOCK_NAME}", ttl=timedelta(seconds=30), sleep=0.001, fences=fences
        )
        with lock as fence:
            yield fence
    elif variant == "ZooKeeperLock":
        from stateguard import ZooKeeperLock

        with ZooKeeperLock(clients["zk"], f"/{prefix}{LOCK_NAME}") as fence:
            yield fence
    else:  # pragma: no cover - a typo in VARIANTS
        raise ValueError(variant)


def _ops(
    engine: Engine, barrier: Any, variant: str, ops: int, zk_hosts: str | None, prefix: str
) -> dict[str, Any]:
    """One worker: ``ops`` lock-protected fenced increments."""
    clients: dict[str, Any] = {}
    if variant.startswith("RedisLock"):
        import redis

        clients["redis"] = redis.Redis.from_url(REDIS_URL)
    zk = None
    if variant == "ZooKeeperLock":
        from kazoo.client import KazooClient  # type: ignore[import-untyped]

        zk = KazooClient(hosts=zk_hosts)
        zk.start(timeout=30)
        clients["zk"] = zk
    counts = {"applied": 0, "stale": 0, "errors": 0}
    kinds: set[str] = set()
    latencies: list[float] = []
    barrier.wait()
    start = time.monotonic()
    try:
        for _ in range(ops):
            t0 = time.perf_counter()
            try:
                if variant == "advisory_lock":
                    with Session(engine) as s, s.begin(), advisory_lock(s, f"{prefix}{LOCK_NAME}"):
                        outcome = _write(s, None)
                else:
                    with (
                        _lock_for(variant, engine, clients, prefix) as fence,
                        Session(engine) as s,
                        s.begin(),
                    ):
                        outcome = _write(s, fence)
            except Exception as error:  # counted and reported, never hidden
                counts["errors"] += 1
                kinds.add(type(error).__name__)
                continue
            latencies.append(time.perf_counter() - t0)
            counts["applied" if outcome is Outcome.APPLIED else "stale"] += 1
    finally:
        if zk is not None:
            zk.stop()
            zk.close()
        for client in clients.values():
            if hasattr(client, "close") and client is not zk:
                client.close()
    return {
        "counts": counts,
        "kinds": sorted(kinds),
        "start": start,
        "end": time.monotonic(),
        "latencies": latencies,
    }


@contextlib.contextmanager
def _zookeeper(zk: str | None) -> Iterator[str | None]:
    """The ZooKeeper hosts to use: the given ones, or a private server, or None (variant left out)."""
    zk = zk or os.environ.get("SG_BENCH_ZK")
    if zk:
        yield zk
        return
    try:
        from tests._support.zookeeper_server import ZooKeeperServer, zookeeper_available
    except ImportError:
        yield None
        return
    if not zookeeper_available():
        yield None
        return
    with ZooKeeperServer() as server:
        yield server.hosts


def lock_comparison(url: str, workers: int, ops: int, rounds: int = 1, zk: str | None = None) -> Table:
    """``workers`` processes x ``ops`` lock-protected fenced increments of one row, per lock variant."""
    engine = make_engine(url, pool_size=workers + 2)
    table = Table(
        f"7. locks protecting one fenced update ({engine.dialect.name}): {workers} processes x {ops} ops "
        f"(acquire + read + fenced write + commit + release), {rounds} round(s), variants in random order"
    )
    if engine.dialect.name != "postgresql":
        engine.dispose()
        table.notes.append("runs on PostgreSQL only (the advisory_lock variant is PostgreSQL's)")
        return table
    prefix = f"b{os.getpid()}-"
    rnd = random.Random(workers * 1000 + ops)
    with _zookeeper(zk) as zk_hosts:
        variants = ["advisory_lock", "RedisLock(fences=engine)", "RedisLock (Redis fence)"]
        if zk_hosts is not None:
            variants.append("ZooKeeperLock")
        else:
            table.notes.append("ZooKeeperLock left out: no ZooKeeper (--zk HOST:PORT, or install zookeeperd)")
        create_tables(engine)
        results: dict[str, dict[str, Any]] = {
            v: {"rates": [], "lat": [], "applied": 0, "stale": 0, "errors": 0, "lost": 0, "kinds": set()}
            for v in variants
        }
        try:
            for _ in range(rounds):
                order = list(variants)
                rnd.shuffle(order)
                for variant in order:
                    reset(engine, FencedCounter)
                    with Session(engine) as s, s.begin():
                        s.add(FencedCounter(id=1, value=0))
                    out = _run_workers(
                        url, engine, "processes", _ops, [(variant, ops, zk_hosts, prefix)] * workers
                    )
                    with Session(engine) as s:
                        final = s.scalar(select(FencedCounter.value).where(FencedCounter.id == 1)) or 0
                    r = results[variant]
                    r["rates"].append(workers * ops / out["elapsed"])
                    r["lat"].extend(out["latencies"])
                    r["applied"] += out["counts"].get("applied", 0)
                    r["stale"] += out["counts"].get("stale", 0)
                    r["errors"] += out["counts"].get("errors", 0)
                    r["lost"] += out["counts"].get("applied", 0) - final
                    r["kinds"].update(out["kinds"])
        finally:
            reset(engine)
            # Another run sharing this database may have dropped stateguard's tables meanwhile.
            gone = (sa_exc.ProgrammingError, sa_exc.OperationalError)
            with contextlib.suppress(*gone), engine.begin() as conn:
                conn.execute(text("DELETE FROM stateguard_fences WHERE name LIKE :p"), {"p": f"{prefix}%"})
            engine.dispose()
    base = median(results["advisory_lock"]["rates"])
    for variant in variants:
        r = results[variant]
        lat = r["lat"] or [0.0]
        table.rows.append(
            {
                "variant": variant,
                "ops_per_s": round(median(r["rates"])),
                "x_advisory": round(median(r["rates"]) / base, 2),
                "median_ms": round(median(lat) * 1000, 2),
                "p99_ms": round(pct(lat, 0.99) * 1000, 2),
                "applied": r["applied"],
                "stale": r["stale"],
                "lost_updates": r["lost"],
                "errors": r["errors"],
            }
        )
        if r["kinds"]:
            table.notes.append(f"{variant} errors: {', '.join(sorted(r['kinds']))}")
    lost = sum(results[v]["lost"] for v in variants)
    table.notes.append(
        f"target 0 lost updates for every lock: {lost} lost, {'met' if lost == 0 else '**missed**'}"
    )
    return table
