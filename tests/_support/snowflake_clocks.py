"""Clocks a test steps or skews for Snowflake generators, and helpers that collect their ids."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, create_engine, select

from stateguard import (
    Snowflake,
    WorkerIdsExhausted,
)
from stateguard.tables import worker_leases

WAIT = 60
_REAL_TIME_NS = time.time_ns


def _parse(snowflake_id: int) -> tuple[int, int, int]:
    return Snowflake.parse(snowflake_id)


def _rows(engine: Engine, namespace: str) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                select(worker_leases)
                .where(worker_leases.c.namespace == namespace)
                .order_by(worker_leases.c.worker_id)
            )
        )


def _row(engine: Engine, namespace: str, worker_id: int) -> Any:
    return next(r for r in _rows(engine, namespace) if r.worker_id == worker_id)


class SkewedClock:
    """Replaces ``time.time_ns`` and ``time.time`` with the real clock plus ``offset_ns``.

    ``hold(thread_ident)`` makes the next read of the clock by that thread report itself on
    ``reached``, wait for ``release``, and return ``frozen_ns`` (if set) or the time it read first:
    a thread paused (GC, a stopped VM) right after reading the clock.
    """

    def __init__(self) -> None:
        self.offset_ns = 0
        self.frozen_ns: int | None = None
        self.held: int | None = None
        self.reached = threading.Event()
        self.release = threading.Event()
        self.reads_by: dict[int, int] = {}

    def time_ns(self) -> int:
        ident = threading.get_ident()
        self.reads_by[ident] = self.reads_by.get(ident, 0) + 1
        value = _REAL_TIME_NS() + self.offset_ns if self.frozen_ns is None else self.frozen_ns
        if self.held is not None and ident == self.held:
            self.held = None
            self.reached.set()
            assert self.release.wait(WAIT), "the test never released the held thread"
            if self.frozen_ns is not None:
                value = self.frozen_ns
        return value

    def time(self) -> float:
        return self.time_ns() / 1e9


def _run_thread(target: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``target`` in a daemon thread; the dict gets ``result`` or ``error`` and ``ident``."""
    out: dict[str, Any] = {}
    started = threading.Event()

    def body() -> None:
        out["ident"] = threading.get_ident()
        started.set()
        try:
            out["result"] = target()
        except BaseException as error:  # the test inspects it
            out["error"] = error

    t = threading.Thread(target=body, daemon=True)
    t.start()
    assert started.wait(WAIT)
    return t, out


# --------------------------------------------------------------------------
# process workers (module level: the spawned pool imports them)
# --------------------------------------------------------------------------


def _worker_engine(name: str, url: str) -> Engine:
    kw: dict[str, Any] = {"pool_size": 2}
    if name == "sqlite":
        kw["connect_args"] = {"timeout": 60}
    return create_engine(url, **kw)


def _take_over(engine: Engine, namespace: str, worker_id: int, **kw: Any) -> Snowflake:
    """Poll (the documented retry) until a new generator leases ``worker_id``; others are closed again."""
    deadline = time.monotonic() + 20
    while True:
        try:
            ids = Snowflake(engine, namespace=namespace, heartbeat=False, **kw)
        except WorkerIdsExhausted:  # retryable: the dead holder's lease has not expired yet
            pass
        else:
            if ids.worker_id == worker_id:
                return ids
            ids.close()
        assert time.monotonic() < deadline, f"worker id {worker_id} was never freed"
        time.sleep(0.05)  # polling a lease's expiry, not racing
