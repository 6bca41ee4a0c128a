"""Workers for tests/test_concurrency.py, importable by spawned child processes.

Every worker runs a list of units of work, each in its own transaction, and
returns plain tuples (picklable) describing what each call reported.  A child
process builds its own engine from the backend's URL (:func:`process_main`);
threads share the test's engine.  A worker records every APPLIED call in the
:class:`Effect` table *inside the same transaction* as the transition, so a
rolled-back transition leaves no effect and a double application leaves two.
"""

from __future__ import annotations

import random
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

from sqlalchemy import Engine, Integer, String, create_engine, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import Outcome, Result, SerializationConflict, guarded_update
from tests._support.models import Order

T = TypeVar("T")

#: Seconds a worker waits at a barrier before giving up (a dead peer must not hang the suite).
BARRIER_TIMEOUT = 60.0


class EffectBase(DeclarativeBase):
    pass


class Effect(EffectBase):
    """One row per side effect a worker ran, written in the transition's own transaction.

    Unlike the shared ``SideEffect`` it keeps the version the transition
    produced, so the applied transitions of one row can be put back in order
    and replayed against the graph.  There is deliberately no unique key: a
    double application must show up as two rows, not as an IntegrityError.
    """

    __tablename__ = "cc_effects"
    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[int] = mapped_column(Integer, index=True)
    what: Mapped[str] = mapped_column(String(20))
    worker: Mapped[str] = mapped_column(String(40))
    version: Mapped[int | None] = mapped_column(Integer)


class Call(NamedTuple):
    """What one call reported (outcome, state and version as the result carried them)."""

    worker: str
    key: int
    trigger: str
    outcome: str
    state: str | None
    version: int | None
    expected_version: int | None
    round: int = 0


class Report(NamedTuple):
    """A worker's calls plus how many times a unit of work hit a retryable conflict."""

    calls: list[Call]
    conflicts: int


def make_engine(name: str, url: str) -> Engine:
    """An engine of this process's own (children never inherit the parent's connections)."""
    kw: dict[str, Any] = {"pool_size": 2, "max_overflow": 2}
    if name == "sqlite":
        # A plain engine with the driver's default transaction handling and a
        # busy timeout, as the issue requires stateguard to be correct there.
        kw["connect_args"] = {"timeout": 60}
    return create_engine(url, **kw)


def retry_conflicts(fn: Callable[[], T], attempts: int = 60) -> tuple[T, int]:
    """Run ``fn`` (a whole unit of work) again on a retryable conflict; return (result, conflicts).

    STALE results are *not* retried: they are the answer the version storms
    are about.  Anything that is not a stateguard conflict escapes and fails
    the test (a raw driver error would mean stateguard let one through).
    """
    conflicts = 0
    while True:
        try:
            return fn(), conflicts
        except SerializationConflict:
            conflicts += 1
            if conflicts >= attempts:
                raise
            time.sleep(random.uniform(0, 0.002 * min(conflicts, 10)))


def _call(worker: str, trigger: str, r: Result, rnd: int = 0) -> Call:
    state = r.state.name if hasattr(r.state, "name") else r.state
    return Call(worker, r.key, trigger, r.outcome.name, state, r.version, r.expected_version, rnd)


def _record(session: Session, worker: str, trigger: str, r: Result) -> None:
    if r.applied:
        session.add(Effect(order_id=r.key, what=trigger, worker=worker, version=r.version))


def fire_storm(
    engine: Engine,
    worker: str,
    barrier: Any,
    seed: int,
    plan: Sequence[tuple[int, str, int | None]],
) -> Report:
    """Wait for every worker, then fire each ``(key, trigger, expected_version)`` of ``plan``.

    The plan is shuffled with ``seed`` so workers hit the rows in different
    orders; each call and its side effect commit together.
    """
    steps = list(plan)
    random.Random(seed).shuffle(steps)
    calls: list[Call] = []
    conflicts = 0
    barrier.wait(BARRIER_TIMEOUT)
    for key, trigger, expected in steps:

        def unit(key: int = key, trigger: str = trigger, expected: int | None = expected) -> Result:
            with Session(engine) as s, s.begin():
                r = Order.flow.fire(s, trigger, key, expected_version=expected)
                _record(s, worker, trigger, r)
                return r

        r, c = retry_conflicts(unit)
        conflicts += c
        calls.append(_call(worker, trigger, r))
    return Report(calls, conflicts)


def read_versions(engine: Engine, keys: Sequence[int]) -> dict[int, int]:
    """The committed version of each row, read in one short transaction."""
    with Session(engine) as s:
        rows = s.execute(select(Order.id, Order.version).where(Order.id.in_(list(keys)))).all()
    return {k: v for k, v in rows}


def version_storm(
    engine: Engine,
    worker: str,
    barrier: Any,
    seed: int,
    keys: Sequence[int],
    rounds: int,
) -> Report:
    """Per round: everyone reads the rows' versions, then everyone writes with what it read.

    Two barrier waits per round: after the first, nobody is writing (so all
    read the same versions); after the second, everyone writes at once.
    """
    rnd = random.Random(seed)
    calls: list[Call] = []
    conflicts = 0
    for round_ in range(rounds):
        barrier.wait(BARRIER_TIMEOUT)
        versions = read_versions(engine, keys)
        order = list(keys)
        rnd.shuffle(order)
        barrier.wait(BARRIER_TIMEOUT)
        for key in order:

            def unit(
                key: int = key, note: str = f"{worker}/{round_}", expected: int = versions[key]
            ) -> Result:
                with Session(engine) as s, s.begin():
                    r = guarded_update(s, Order, key, {"note": note}, expected_version=expected)
                    _record(s, worker, "note", r)
                    return r

            r, c = retry_conflicts(unit)
            conflicts += c
            calls.append(_call(worker, "note", r, round_))
    return Report(calls, conflicts)


def mixed_storm(
    engine: Engine,
    worker: str,
    barrier: Any,
    seed: int,
    keys: Sequence[int],
    steps: int,
) -> Report:
    """Random pay / ship / cancel at the shared rows, each with its side effect."""
    rnd = random.Random(seed)
    plan = [(rnd.choice(keys), rnd.choice(["pay", "ship", "cancel"]), None) for _ in range(steps)]
    return fire_storm(engine, worker, barrier, seed, plan)


WORKERS: dict[str, Callable[..., Report]] = {
    "fire": fire_storm,
    "version": version_storm,
    "mixed": mixed_storm,
}


def process_main(
    kind: str, name: str, url: str, worker: str, barrier: Any, queue: Any, seed: int, args: tuple[Any, ...]
) -> None:
    """Entry point of a child process: own engine, run the worker, send the report (or the error)."""
    engine = make_engine(name, url)
    try:
        report = WORKERS[kind](engine, worker, barrier, seed, *args)
        queue.put((worker, None, report))
    except BaseException:
        barrier.abort()  # release the others instead of letting them wait for a dead peer
        queue.put((worker, traceback.format_exc(), None))
    finally:
        engine.dispose()


def outcomes(calls: Sequence[Call]) -> dict[str, int]:
    """How many calls ended with each outcome name."""
    found = {o.name: 0 for o in Outcome}
    for c in calls:
        found[c.outcome] += 1
    return {k: v for k, v in found.items() if v}
