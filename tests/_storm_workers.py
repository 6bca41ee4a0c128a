"""Worker functions for the multi-process storms (imported by spawned processes)."""

from __future__ import annotations

import random
from typing import Any

from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from stateguard import Outcome, guarded_update, retry_on_conflict

from .models import Order, SideEffect


def _engine(name: str, url: str) -> Any:
    kw: dict[str, Any] = {"pool_size": 2}
    if name == "sqlite":
        kw["connect_args"] = {"timeout": 60}
    return create_engine(url, **kw)


def fire_storm(
    name: str, url: str, trigger: str, keys: list[int], worker: str, barrier: Any, seed: int
) -> dict[str, int]:
    """Fire ``trigger`` at every key (shuffled); a side effect per APPLIED, in the same transaction."""
    engine = _engine(name, url)
    counts = {o.name: 0 for o in Outcome}
    order = list(keys)
    random.Random(seed).shuffle(order)
    try:
        barrier.wait()
        for key in order:

            def unit(key: int = key) -> Any:
                with Session(engine) as s, s.begin():
                    r = Order.flow.fire(s, trigger, key)
                    if r.applied:
                        s.add(SideEffect(order_id=key, what=trigger, worker=worker))
                    return r

            counts[retry_on_conflict(unit, attempts=30, backoff=0.002).outcome.name] += 1
    finally:
        engine.dispose()
    return counts


def version_storm(
    name: str, url: str, keys: list[int], worker: str, barrier: Any, seed: int
) -> dict[str, int]:
    """Read each row's version, wait for everyone, then guarded_update with it: one winner per version."""
    engine = _engine(name, url)
    counts = {o.name: 0 for o in Outcome}
    try:
        with Session(engine) as s:
            versions = {k: s.get_one(Order, k).version for k in keys}
        barrier.wait()
        order = list(keys)
        random.Random(seed).shuffle(order)
        for key in order:

            def unit(key: int = key) -> Any:
                with Session(engine) as s, s.begin():
                    r = guarded_update(s, Order, key, {"note": worker}, expected_version=versions[key])
                    if r.applied:
                        s.add(SideEffect(order_id=key, what="note", worker=worker))
                    return r

            # Retry only real conflicts (deadlocks, busy): STALE is the expected answer here.
            from stateguard import SerializationConflict

            for _ in range(30):
                try:
                    r = unit()
                    break
                except SerializationConflict:
                    continue
            counts[r.outcome.name] += 1
    finally:
        engine.dispose()
    return counts
