"""Worker functions for the striped-counter storms (importable by spawned processes)."""

from __future__ import annotations

import random
import time
from typing import Any

from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from stateguard import DeadlockDetected, SerializationConflict, StripedCounter

COUNTER = StripedCounter("storm", stripes=8)
ITEM = "hot-item"


def engine(name: str, url: str) -> Any:
    kw: dict[str, Any] = {"pool_size": 2}
    if name == "sqlite":
        kw["connect_args"] = {"timeout": 60}
    return create_engine(url, **kw)


def attempt(eng: Any, fn: Any, counts: dict[str, int]) -> Any:
    """Run ``fn(session)`` in its own transaction, retrying retryable conflicts (counted by kind)."""
    for _ in range(200):
        try:
            with Session(eng) as s, s.begin():
                return fn(s)
        except DeadlockDetected:
            counts["deadlock"] = counts.get("deadlock", 0) + 1
        except SerializationConflict:
            counts["conflict"] = counts.get("conflict", 0) + 1
        time.sleep(random.random() / 100)
    raise AssertionError("gave up after 200 conflicts")


def storm_buyer(
    name: str, url: str, worker: int, attempts: list[tuple[str, int]], barrier: Any
) -> dict[str, Any]:
    """Send every (ref, quantity) purchase, then buy 1 at a time until the item is truly empty.

    Returns ``{"outcomes": [(ref, qty, outcome)], "counts": {...}}``.
    """
    eng = engine(name, url)
    outcomes: list[tuple[str, int, str]] = []
    counts: dict[str, int] = {}
    try:
        barrier.wait()
        for ref, qty in attempts:
            r = attempt(eng, lambda s, ref=ref, qty=qty: COUNTER.decrement(s, ITEM, by=qty, ref=ref), counts)
            outcomes.append((ref, qty, r.outcome.name))
        i = 0
        while True:
            ref = f"tail-{worker}-{i}"
            i += 1
            r = attempt(eng, lambda s, ref=ref: COUNTER.decrement(s, ITEM, by=1, ref=ref), counts)
            outcomes.append((ref, 1, r.outcome.name))
            if r.outcome.name == "INSUFFICIENT":
                break
    finally:
        eng.dispose()
    return {"outcomes": outcomes, "counts": counts}


def mixed_buyer(name: str, url: str, worker: int, sizes: list[int], barrier: Any) -> dict[str, Any]:
    """Decrement by each of ``sizes`` (small ones and ones larger than any stripe), each in its own
    transaction; report (qty, outcome, total seen at INSUFFICIENT) and retry counts."""
    eng = engine(name, url)
    outcomes: list[tuple[int, str, Any]] = []
    counts: dict[str, int] = {}
    try:
        barrier.wait()
        for i, qty in enumerate(sizes):
            ref = f"m-{worker}-{i}"
            r = attempt(eng, lambda s, ref=ref, qty=qty: COUNTER.decrement(s, ITEM, by=qty, ref=ref), counts)
            outcomes.append((qty, r.outcome.name, r.value))
    finally:
        eng.dispose()
    return {"outcomes": outcomes, "counts": counts}


def restriper(name: str, url: str, rounds: int, barrier: Any) -> dict[str, Any]:
    """Restripe the item to a random stripe count ``rounds`` times; report the totals seen."""
    eng = engine(name, url)
    counts: dict[str, int] = {}
    seen: list[int] = []
    try:
        barrier.wait()
        for _ in range(rounds):
            k = random.randint(1, 16)
            r = attempt(eng, lambda s, k=k: COUNTER.restripe(s, ITEM, stripes=k), counts)
            seen.append(r.value)
            time.sleep(0.005)
    finally:
        eng.dispose()
    return {"totals": seen, "counts": counts}


def restart_buyer(
    name: str, url: str, worker: int, plan: list[tuple[str, int]], barrier: Any
) -> dict[str, Any]:
    """Send every (ref, quantity) purchase, riding out a server restart: a unit of work cut off by
    a lost connection is run again with the same ref until it gets an answer.

    Returns ``{"outcomes": [(ref, qty, outcome, same_request)], "counts": {...}}``; a retry whose
    first attempt committed answers REPEATED with ``same_request``.
    """
    from sqlalchemy.exc import DBAPIError

    eng = engine(name, url)
    outcomes: list[tuple[str, int, str, bool]] = []
    counts: dict[str, int] = {}
    try:
        barrier.wait()
        for ref, qty in plan:
            for _ in range(1200):
                try:
                    with Session(eng) as s, s.begin():
                        r = COUNTER.decrement(s, ITEM, by=qty, ref=ref)
                    outcomes.append((ref, qty, r.outcome.name, r.same_request))
                    break
                except (DeadlockDetected, SerializationConflict):
                    counts["conflict"] = counts.get("conflict", 0) + 1
                except DBAPIError:
                    # The server went away (the restart): the pool's connections are dead.
                    counts["reconnects"] = counts.get("reconnects", 0) + 1
                    eng.dispose()
                    time.sleep(0.1)
            else:
                raise AssertionError(f"{ref}: no answer after 1200 tries")
    finally:
        eng.dispose()
    return {"outcomes": outcomes, "counts": counts}


def churn_buyer(name: str, url: str, worker: int, steps: list[int], barrier: Any) -> dict[str, Any]:
    """Run each step in its own transaction: a positive step decrements by it, a negative one
    restocks (increments by its size), so stock hovers near zero.  Reports (step, outcome, value)
    and retry counts."""
    eng = engine(name, url)
    outcomes: list[tuple[int, str, Any]] = []
    counts: dict[str, int] = {}
    try:
        barrier.wait()
        for step in steps:
            if step > 0:
                r = attempt(eng, lambda s, step=step: COUNTER.decrement(s, ITEM, by=step), counts)
            else:
                r = attempt(eng, lambda s, step=step: COUNTER.increment(s, ITEM, by=-step), counts)
            outcomes.append((step, r.outcome.name, r.value))
    finally:
        eng.dispose()
    return {"outcomes": outcomes, "counts": counts}
