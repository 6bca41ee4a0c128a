"""Twin calls of one idempotency key from two threads: the work runs once in both modes, a waiting
twin runs when the first block fails and its caller commits, and a twin at a stricter isolation
level never runs twice nor replays garbage."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, func, select, text
from sqlalchemy.orm import Session

from stateguard import (
    RequestInProgress,
    idempotent,
)
from tests._support.idem_items import Boom, Item, _names, items, md
from tests.conftest import Backend, capable


def _wait_for_twin(backend: Backend, probe: Engine, out: dict[str, Any]) -> None:
    """Wait (4 s at most) until the twin is seen waiting on the claim; then ``out["overlap"]``."""
    for _ in range(200):
        if backend.name == "sqlite" or _blocked_twin(backend, probe):
            out["overlap"] = True
            return
        threading.Event().wait(0.02)


def _run_both(*workers: Any) -> None:
    """Run the workers in threads at once and wait for them (30 s each at most)."""
    threads = [threading.Thread(target=worker) for worker in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)


@pytest.fixture
def eng(engine: Engine, backend: Backend) -> Iterator[Engine]:
    backend.create(md)
    yield engine


# --------------------------------------------------------------------------- 3. twins


def _blocked_twin(backend: Backend, probe: Engine) -> bool:
    """Is some other transaction waiting on a lock right now?"""
    with probe.connect() as c:
        if backend.name == "postgresql":
            return bool(c.scalar(text("SELECT count(*) FROM pg_locks WHERE NOT granted")))
        if backend.name == "mariadb":
            return bool(
                c.scalar(
                    text(
                        "SELECT count(*) FROM information_schema.processlist WHERE id <> CONNECTION_ID()"
                        " AND command = 'Query' AND info IS NOT NULL"
                    )
                )
            )
    return True


@pytest.mark.parametrize("mode", ["same_transaction", "separate"])
def test_two_threads_same_key_run_the_work_once(eng: Engine, backend: Backend, mode: str) -> None:
    probe = backend.new_engine(pool_size=1, max_overflow=0)
    barrier = threading.Barrier(2)
    twin_done = threading.Event()
    results: list[Any] = []
    errors: list[BaseException] = []
    ran = []
    overlapped: list[bool] = []

    def worker(i: int) -> None:
        try:
            barrier.wait(10)
            with Session(eng) as s:
                ctx = s.begin() if mode == "same_transaction" else None
                if ctx:
                    ctx.__enter__()
                try:
                    with idempotent(s, scope="twin", key="k", fingerprint="b", mode=mode) as call:  # type: ignore[arg-type]
                        if call.replayed:
                            results.append(("replayed", call.response))
                        else:
                            ran.append(i)
                            # hold the claim until the twin has bumped into it
                            for _ in range(200):
                                if twin_done.is_set() or (
                                    mode == "same_transaction" and _blocked_twin(backend, probe)
                                ):
                                    overlapped.append(True)
                                    break
                                twin_done.wait(0.02)
                            s.add(Item(id=100 + i, name=f"w{i}"))
                            s.flush()
                            results.append(("ran", call.complete(f"by {i}")))
                    if ctx:
                        ctx.__exit__(None, None, None)
                except BaseException:
                    if ctx:
                        ctx.__exit__(None, None, None)
                    raise
        except RequestInProgress as e:
            results.append(("in_progress", e.retry_after))
        except BaseException as e:
            errors.append(e)
        finally:
            if not ran or ran[0] != i:
                twin_done.set()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    probe.dispose()
    assert not errors, errors
    assert len(ran) == 1, ran
    assert overlapped, ("the twin never met the claim", results)
    kinds = sorted(r[0] for r in results)
    assert kinds in (["ran", "replayed"], ["in_progress", "ran"]), results
    if mode == "same_transaction":
        assert kinds == ["ran", "replayed"], results
    for r in results:
        if r[0] == "replayed":
            assert r[1] == f"by {ran[0]}"
    with eng.connect() as c:
        assert c.scalar(select(func.count()).select_from(items)) == 1


def test_a_waiting_twin_runs_when_the_first_block_fails_and_its_caller_commits(
    eng: Engine, backend: Backend
) -> None:
    probe = backend.new_engine(pool_size=1, max_overflow=0)
    claimed = threading.Event()
    out: dict[str, Any] = {}

    def first() -> None:
        try:
            with Session(eng) as s, s.begin():
                try:
                    with idempotent(s, scope="tw", key="k", fingerprint="b"):
                        s.add(Item(id=1, name="first-leak"))
                        s.flush()
                        claimed.set()
                        _wait_for_twin(backend, probe, out)
                        raise Boom
                except Boom:
                    pass
                s.add(Item(id=3, name="first-other"))
            out["first"] = "ok"
        except BaseException as e:
            out["first"] = e

    def twin() -> None:
        claimed.wait(10)
        try:
            with Session(eng) as s, s.begin(), idempotent(s, scope="tw", key="k", fingerprint="b") as call:
                if call.replayed:
                    out["twin"] = ("replayed", call.response)
                else:
                    s.add(Item(id=2, name="twin"))
                    out["twin"] = ("ran", call.complete("twin"))
        except BaseException as e:
            out["twin"] = e

    _run_both(first, twin)
    probe.dispose()
    assert out["first"] == "ok"
    assert out.get("overlap"), "the twin never waited on the claim"
    assert out["twin"] == ("ran", "twin"), out["twin"]
    assert _names(eng) == ["first-other", "twin"]


@pytest.mark.hostile
@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_twin_at_stricter_isolation_never_runs_twice_nor_replays_garbage(
    eng: Engine, backend: Backend, isolation: str
) -> None:
    """The twin waits on the claim, at REPEATABLE READ / SERIALIZABLE: it may replay or get a retryable
    conflict, and a retry replays; it must never run the work nor return a wrong response."""
    from stateguard import DeadlockDetected, SerializationConflict

    if not capable(backend, "isolation_levels"):
        iso_eng = backend.new_engine(pool_size=2, max_overflow=0)  # SQLite is serializable already
    else:
        iso_eng = backend.new_engine(pool_size=2, max_overflow=0, isolation_level=isolation)
    _ = eng
    probe = backend.new_engine(pool_size=1, max_overflow=0)
    claimed = threading.Event()
    out: dict[str, Any] = {}
    ran: list[str] = []

    def first() -> None:
        try:
            with Session(eng) as s, s.begin(), idempotent(s, scope="iso", key="k", fingerprint="b") as call:
                ran.append("first")
                s.add(Item(id=1, name="first"))
                s.flush()
                claimed.set()
                _wait_for_twin(backend, probe, out)
                call.complete({"by": "first", "n": 2**63 + 7})
            out["first"] = "ok"
        except BaseException as e:
            out["first"] = e
            claimed.set()

    def twin() -> None:
        claimed.wait(10)
        try:
            with Session(iso_eng) as s, s.begin():
                s.execute(
                    select(func.count()).select_from(items)
                )  # take the snapshot before the first commits
                with idempotent(s, scope="iso", key="k", fingerprint="b") as call:
                    if call.replayed:
                        out["twin"] = ("replayed", call.response)
                    else:
                        ran.append("twin")
                        out["twin"] = ("ran", call.complete("twin"))
        except (DeadlockDetected, SerializationConflict, RequestInProgress) as e:
            out["twin"] = ("retryable", type(e).__name__)
        except BaseException as e:
            out["twin"] = e

    _run_both(first, twin)
    probe.dispose()
    try:
        assert out["first"] == "ok", out
        assert out.get("overlap"), "the twin never waited on the claim"
        assert ran == ["first"], (ran, out)
        assert out["twin"][0] in ("replayed", "retryable"), out["twin"]
        if out["twin"][0] == "replayed":
            assert out["twin"][1] == {"by": "first", "n": 2**63 + 7}, out["twin"]
        with Session(iso_eng) as s, s.begin(), idempotent(s, scope="iso", key="k", fingerprint="b") as call:
            assert call.replayed and call.response == {"by": "first", "n": 2**63 + 7}
    finally:
        iso_eng.dispose()
