"""Striped counters on PostgreSQL at REPEATABLE READ: storms end with typed, retryable errors only,
and a serialization failure is a SerializationConflict."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from stateguard import (
    Outcome,
    SerializationConflict,
    StripedCounter,
    create_tables,
    drop_tables,
)
from tests._support.striped_storms import (
    STRIPES,
    Stats,
    assert_invariant,
    new_item,
    run_threads,
)

# ---------------------------------------------------------------- PostgreSQL: no locks for INSUFFICIENT


@pytest.fixture
def pg_engine(pg: Any) -> Any:
    drop_tables(pg.engine)
    create_tables(pg.engine)
    yield pg.engine
    drop_tables(pg.engine)


# ---------------------------------------------------------------- PostgreSQL at REPEATABLE READ


def test_pg_repeatable_read_storm_only_typed_errors(pg_engine: Engine) -> None:
    rr = pg_engine.execution_options(isolation_level="REPEATABLE READ")
    counter = StripedCounter("rr", stripes=4)
    start = 300
    new_item(pg_engine, counter, "a", start)
    stats = Stats()
    raw: list[str] = []

    def op_unit(op: Callable[[Session], Any]) -> Any:
        for attempt in range(60):
            with Session(rr) as s:
                s.begin()
                try:
                    r = op(s)
                except SerializationConflict as error:
                    stats.add(type(error).__name__)
                    s.rollback()
                    time.sleep(random.uniform(0, 0.005 * (attempt + 1)))
                    continue
                except DBAPIError as error:  # a raw driver error escaped a stateguard call
                    raw.append(repr(error))
                    raise
                s.commit()
                return r
        raise AssertionError(f"gave up: {stats.retryable}")

    def worker(i: int) -> list[tuple[str, int, Any]]:
        rng = random.Random(1200 + i)
        out = []
        for j in range(10):
            by = rng.choice([1, 2, 5, 30, 90])
            if rng.random() < 0.2:
                out.append(("inc", by, op_unit(lambda s, by=by: counter.increment(s, "a", by=by))))
            elif rng.random() < 0.15:
                out.append(
                    ("re", 0, op_unit(lambda s: counter.restripe(s, "a", stripes=rng.choice([2, 4, 6]))))
                )
            else:
                ref = f"rr-{i}-{j}"
                r = op_unit(lambda s, by=by, ref=ref: counter.decrement(s, "a", by=by, ref=ref))
                out.append(("dec", by, r))
                if r.outcome is Outcome.APPLIED and rng.random() < 0.4:
                    rel = op_unit(lambda s, ref=ref: counter.release(s, ref))
                    assert rel.outcome is Outcome.APPLIED, rel
                    out.append(("inc", by, rel))
                    again = op_unit(lambda s, ref=ref: counter.release(s, ref))
                    assert again.outcome is Outcome.REPEATED, again
        return out

    results = [x for w in run_threads(12, worker) for x in w]
    assert not raw, raw
    total = start
    for kind, by, r in results:
        if kind == "re":
            continue
        if r.outcome is Outcome.APPLIED:
            total += by if kind == "inc" else -by
        else:
            assert kind == "dec" and r.outcome is Outcome.INSUFFICIENT and r.value < by, (kind, by, r)
    assert_invariant(pg_engine, counter, "a", total)
    for name in stats.retryable:
        assert name in ("SerializationConflict", "DeadlockDetected")


def test_pg_repeatable_read_serialization_failure_is_typed(pg_engine: Engine) -> None:
    """An RR snapshot taken before another transaction changed the stripes: typed error, never raw."""
    rr = pg_engine.execution_options(isolation_level="REPEATABLE READ")
    counter = StripedCounter("rr2", stripes=2)
    new_item(pg_engine, counter, "a", 20)
    outcomes: list[Any] = []
    for by in (1, 10, 15):
        with Session(rr) as s:
            s.begin()
            assert counter.total(s, "a") is not None  # snapshot taken
            # another transaction changes every stripe and commits
            with Session(pg_engine) as other, other.begin():
                other.execute(text(f"UPDATE {STRIPES} SET amount = amount + 1 WHERE counter = 'rr2'"))
            try:
                outcomes.append(counter.decrement(s, "a", by=by))
                s.commit()
            except SerializationConflict as error:
                assert error.retryable
                outcomes.append(type(error).__name__)
                s.rollback()
    assert all(o == "SerializationConflict" or isinstance(o, str) for o in outcomes), outcomes
    # every attempt saw a changed row: all of them must be typed conflicts
    assert outcomes == ["SerializationConflict"] * 3, outcomes
    assert_invariant(pg_engine, counter, "a", 26)
