"""Helpers of the striped-counter storms: threads released together, retried units of work,
invariant checks, and holders that keep stripes locked (importable by spawned processes)."""

from __future__ import annotations

import random
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from stateguard import (
    Outcome,
    SerializationConflict,
    StripedCounter,
)

STRIPES = "stateguard_counter_stripes"
LEDGER = "stateguard_counter_ledger"


# ---------------------------------------------------------------- helpers


def run_threads(n: int, fn: Callable[[int], Any], timeout: float = 60) -> list[Any]:
    """Run ``fn(i)`` in ``n`` threads started together; re-raise the first worker error."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n
    errors: list[tuple[int, BaseException, str]] = []

    def wrap(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = fn(i)
        except BaseException as error:  # reported to the test below
            errors.append((i, error, traceback.format_exc()))

    threads = [threading.Thread(target=wrap, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [t for t in threads if t.is_alive()]
    assert not alive, f"{len(alive)} workers still running after {timeout}s (hang/deadlock?)"
    if errors:
        i, error, tb = errors[0]
        raise AssertionError(f"{len(errors)} worker(s) failed; worker {i}:\n{tb}") from error
    return results


class Stats:
    """Thread-safe record of retryable errors that reached the caller."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.retryable: Counter[str] = Counter()

    def add(self, name: str) -> None:
        with self.lock:
            self.retryable[name] += 1


def unit(engine: Engine, op: Callable[[Session], Any], stats: Stats, attempts: int = 40) -> Any:
    """Run ``op`` in its own transaction; retry typed retryable stateguard errors only.

    Any other error (a raw driver error from a stateguard call, above all) propagates.
    """
    for attempt in range(attempts):
        with Session(engine) as s:
            try:
                with s.begin():
                    return op(s)
            except SerializationConflict as error:
                assert error.retryable
                stats.add(type(error).__name__)
                time.sleep(random.uniform(0, 0.01 * (attempt + 1)))
    raise AssertionError(f"gave up after {attempts} attempts: {stats.retryable}")


def new_item(
    engine: Engine, counter: StripedCounter, item: str, amount: int, stripes: int | None = None
) -> None:
    with Session(engine) as s, s.begin():
        r = counter.create(s, item, amount=amount, stripes=stripes)
        assert r.outcome is Outcome.APPLIED


def state(engine: Engine, counter: StripedCounter, item: str) -> tuple[int | None, list[int]]:
    with Session(engine) as s:
        return counter.total(s, item), counter.stripe_amounts(s, item)


def assert_invariant(engine: Engine, counter: StripedCounter, item: str, expected: int) -> list[int]:
    total, amounts = state(engine, counter, item)
    assert all(a >= 0 for a in amounts), f"negative stripe: {amounts}"
    assert sum(amounts) == total, (amounts, total)
    assert total == expected, f"total {total} != expected {expected} (stripes {amounts})"
    return amounts


def ledger_refs(engine: Engine, counter: StripedCounter) -> list[tuple[str, str, str, Any]]:
    with Session(engine) as s:
        rows = s.execute(
            text(f"SELECT ref, row_key, delta, released_at FROM {LEDGER} WHERE column_name = :c"),
            {"c": counter.name},
        ).all()
    return [tuple(r) for r in rows]


class Holder:
    """A transaction that holds something open until told to finish."""

    def __init__(self, engine: Engine, action: Callable[[Session], Any], commit: bool = True) -> None:
        self.engine = engine
        self.action = action
        self.commit = commit
        self.held = threading.Event()
        self.go = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with Session(self.engine) as s:
                s.begin()
                self.result = self.action(s)
                self.held.set()
                self.go.wait(30)
                if self.commit:
                    s.commit()
                else:
                    s.rollback()
        except BaseException as error:
            self.error = error
            self.held.set()

    def start(self) -> Holder:
        self.thread.start()
        assert self.held.wait(15), "holder never got its locks"
        assert self.error is None, self.error
        return self

    def finish(self) -> None:
        self.go.set()
        self.thread.join(30)
        assert not self.thread.is_alive()
        assert self.error is None, self.error


class Bg:
    """Run one call in a thread, timing it and keeping its result or error."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.elapsed: float | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            self.result = self.fn()
        except BaseException as error:
            self.error = error
        finally:
            self.elapsed = time.monotonic() - t0
            self.done.set()

    def get(self, timeout: float = 30) -> Any:
        assert self.done.wait(timeout), "call hung"
        if self.error is not None:
            raise self.error
        return self.result
