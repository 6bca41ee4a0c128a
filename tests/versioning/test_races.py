"""Version columns under real races (threads released by a barrier): two sessions with the same
expected version have one winner, workers retrying at SERIALIZABLE or through retry_on_conflict end
with exactly n increments, and racing triggers from one source publish once."""

from __future__ import annotations

import threading
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from stateguard import (
    guarded_update,
    retry_on_conflict,
)
from tests._support.version_docs import DOC_TABLES, Doc, _declared_calls, _race, _row
from tests.conftest import Backend

pytestmark = DOC_TABLES


def test_serializable_workers_retrying_end_with_exactly_n(engine: Engine, backend: Backend) -> None:
    """At SERIALIZABLE the losers get serialization failures (PostgreSQL 40001): retried, never lost."""
    workers, each = 5, 4
    eng = backend.new_engine(pool_size=workers + 2, isolation_level="SERIALIZABLE")
    barrier = threading.Barrier(workers)
    errors: list[BaseException] = []

    def unit() -> Any:
        with Session(eng) as s, s.begin():
            doc = s.get_one(Doc, 2)
            return guarded_update(s, Doc, doc, {"hits": doc.hits + 1}, expected_version=doc.version)

    def run() -> None:
        try:
            barrier.wait(30)
            for _ in range(each):
                r = retry_on_conflict(unit, attempts=300, backoff=0.001, max_backoff=0.02)
                assert r.applied, r
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    eng.dispose()
    assert errors == []
    row = _row(engine, 2)
    assert (row.hits, row.version) == (workers * each, 1 + workers * each)


def test_two_sessions_with_the_same_expected_version_exactly_one_wins(
    engine: Engine, backend: Backend
) -> None:
    def body(eng: Engine, barrier: threading.Barrier, i: int) -> Any:
        with Session(eng) as s, s.begin():
            doc = s.get_one(Doc, 1)  # the snapshot (MariaDB REPEATABLE READ) starts before the race
            barrier.wait(30)
            r = guarded_update(s, Doc, doc, {"note": f"w{i}"}, expected_version=doc.version)
            return r.outcome, r.version

    for _ in range(3):
        with engine.begin() as conn:
            version = conn.execute(select(Doc.version).where(Doc.id == 1)).scalar_one()
        results = _race(backend, 2, body)
        assert not [r for r in results if isinstance(r, BaseException)], results
        outcomes = sorted(r[0].name for r in results)
        assert outcomes == ["APPLIED", "STALE"], results
        assert {r[1] for r in results} == {version + 1}, f"STALE must report the winner's version: {results}"
        assert _row(engine, 1)[3] == version + 1


def test_many_workers_incrementing_through_retries_end_with_exactly_n(
    engine: Engine, backend: Backend
) -> None:
    workers, each = 6, 5

    def unit(eng: Engine) -> Any:
        with Session(eng) as s, s.begin():
            doc = s.get_one(Doc, 2)
            return guarded_update(s, Doc, doc, {"hits": doc.hits + 1}, expected_version=doc.version)

    def body(eng: Engine, barrier: threading.Barrier, i: int) -> int:
        barrier.wait(30)
        done = 0
        for _ in range(each):
            r = retry_on_conflict(lambda: unit(eng), attempts=200, backoff=0.001, max_backoff=0.02)
            assert r.applied, r
            done += 1
        return done

    results = _race(backend, workers, body)
    assert results == [each] * workers, results
    row = _row(engine, 2)
    assert (row.hits, row.version) == (workers * each, 1 + workers * each)


def test_racing_triggers_from_one_source_only_one_publishes(engine: Engine, backend: Backend) -> None:
    def body(eng: Engine, barrier: threading.Barrier, i: int) -> Any:
        calls: list[int] = []
        with Session(eng) as s, s.begin():
            s.get_one(Doc, 2)
            barrier.wait(30)
            r = Doc.flow.publish(s, 2)
            r.on_commit(calls.append, i)
        return r.outcome, calls

    results = _race(backend, 4, body)
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert sorted(r[0].name for r in results) == ["APPLIED", "REPEATED", "REPEATED", "REPEATED"]
    assert sum(len(r[1]) for r in results) == 1
    assert len(_declared_calls) == 1 and _declared_calls[0].applied
