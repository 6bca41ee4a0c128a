"""Models and checks of the release tests: stock rows near the integer limits of their columns."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import DeclarativeBase, Session

from tests.counters.test_ranges import _unreleased as _unreleased_in


class AtkBase(DeclarativeBase):
    pass


def _unreleased(engine: Any, ref: str) -> int:
    """How many ledger entries of ``ref`` are not released (read in a new Session)."""
    with Session(engine) as s:
        return _unreleased_in(s, ref)


def _race(jobs: list[Callable[[], Any]]) -> tuple[list[Any], list[BaseException]]:
    """Run ``jobs`` in threads released together by a barrier: what they returned and raised."""
    barrier = threading.Barrier(len(jobs))
    results: list[Any] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(job: Callable[[], Any]) -> None:
        try:
            barrier.wait()
            out = job()
            with lock:
                results.append(out)
        except BaseException as e:
            with lock:
                errors.append(e)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results, errors
