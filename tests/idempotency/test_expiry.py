"""Expired idempotency claims: purges racing claims of an expired key run the work once, a reclaim
refuses the old request and replays the new, a completion committing while the claim waits is
never run again, and the longest ttl claims and replays."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import (
    Engine,
    event,
    insert,
)
from sqlalchemy.orm import Session

from stateguard import (
    IdempotencyKeyReused,
    RequestInProgress,
    idempotent,
)
from stateguard.idempotency import purge_expired
from stateguard.tables import idempotency_keys
from tests._support.idem_claims import (
    _DAY_MS,
    _await_waiters,
    _held_claim,
    _pid,
    _record,
    _retrying,
    _runs,
    _unit,
    ca_md,
    work,
)
from tests.conftest import Backend, capable


@pytest.fixture
def eng(engine: Engine, backend: Backend) -> Iterator[Engine]:
    """stateguard's tables (conftest ``engine``) and ``ca_work`` on each backend, dropped afterwards."""
    backend.create(ca_md)
    yield engine


def _put_record(engine: Engine, scope: str, key: str, **values: Any) -> None:
    """A record as another worker left it."""
    now = int(time.time() * 1000)
    row = {
        "scope": scope,
        "idem_key": key,
        "status": "completed",
        "fingerprint": None,
        "owner": "old-owner",
        "attempt": 1,
        "locked_until_ms": None,
        "expires_ms": now + _DAY_MS,
        "created_ms": now,
        "updated_ms": now,
        "response": None,
        **values,
    }
    with engine.begin() as conn:
        conn.execute(insert(idempotency_keys).values(row))


# --------------------------------------------------------------------------- 6. expiry races


@pytest.mark.parametrize("round_", range(4))
def test_purge_racing_claims_of_an_expired_key_runs_the_work_once(
    eng: Engine, backend: Backend, round_: int
) -> None:
    """An expired completed record (same fingerprint!) is purged while 6 claimers of its key race:
    whether they reclaim it or insert after the purge, the work runs once, the others replay the
    NEW response, the old response is never replayed."""
    key = f"exp{round_}"
    _put_record(eng, "ca6", key, fingerprint=None, response='{"by":"old"}', expires_ms=1, created_ms=1)
    n = 6
    barrier = threading.Barrier(n + 1)
    retried: list[str] = []
    purged: list[int] = []

    def purger() -> None:
        barrier.wait(10)
        for _ in range(3):
            purged.append(_retrying(lambda: purge_expired(eng), retried))

    def claimer(i: int) -> tuple[str, Any]:
        barrier.wait(10)
        if i % 2:
            time.sleep(0.002 * i)
        return _retrying(lambda: _unit(eng, "ca6", key, f"c{i}", label=key, fingerprint=None), retried)

    with ThreadPoolExecutor(n + 1) as pool:
        purging = pool.submit(purger)
        answers = [f.result(timeout=90) for f in [pool.submit(claimer, i) for i in range(n)]]
        purging.result(timeout=90)
    runs = _runs(eng, key)
    assert len(runs) == 1, (runs, answers)
    winner = runs[0]
    assert sorted(answers, key=lambda a: a[0]) == [("ran", {"by": winner})] + [
        ("replayed", {"by": winner})
    ] * (n - 1), answers
    assert sum(purged) <= 1, purged
    record = _record(eng, "ca6", key)
    assert record.status == "completed" and record.response == f'{{"by":"{winner}"}}'
    assert record.owner != "old-owner" and record.attempt == 1 and record.expires_ms > 1
    if not capable(backend, "duplicate_inserts_deadlock"):
        assert retried == [], retried


def test_reclaim_of_an_expired_key_refuses_the_old_request_and_replays_the_new(
    eng: Engine, backend: Backend
) -> None:
    """An expired record of request "old" is reclaimed by request "new", which holds its claim until
    two twins wait on it: the twin with the old body gets IdempotencyKeyReused (PostgreSQL: its
    statement still sees the expired old version), the twin with the new body replays; nobody
    replays the old response, the work runs once."""
    from stateguard.idempotency import fingerprint_of

    _put_record(
        eng,
        "ca7",
        "k",
        fingerprint=fingerprint_of("old"),
        response='{"by":"old"}',
        expires_ms=1,
        created_ms=1,
    )
    probe = backend.new_engine(pool_size=1, max_overflow=0)
    claimed = threading.Event()
    out: dict[str, Any] = {}
    retried: list[str] = []

    def reclaimer() -> None:
        with _held_claim(eng, "ca7", "k", "new", fingerprint="new") as (s, pid):
            claimed.set()
            out["waited"] = _await_waiters(backend, probe, pid, 2)
            s.commit()

    def twin(body: str) -> None:
        assert claimed.wait(10)

        def unit() -> Any:
            try:
                return _unit(eng, "ca7", "k", f"twin-{body}", label="k", fingerprint=body)
            except IdempotencyKeyReused:
                return ("reused", None)

        out[body] = _retrying(unit, retried)

    try:
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(reclaimer), pool.submit(twin, "old"), pool.submit(twin, "new")]
            for f in futures:
                f.result(timeout=60)
    finally:
        probe.dispose()
    assert out.get("waited"), "the twins never waited on the reclaim"
    assert out["old"] == ("reused", None), out
    assert out["new"] == ("replayed", {"by": "new"}), out
    assert _runs(eng, "k") == ["new"]
    record = _record(eng, "ca7", "k")
    assert (record.status, record.response, record.attempt) == ("completed", '{"by":"new"}', 1)
    assert record.fingerprint == fingerprint_of("new")


def test_a_completion_committing_while_the_claim_waits_is_never_run_again(
    eng: Engine, backend: Backend
) -> None:
    """A separate-mode owner's complete() has sent its UPDATE and commits only once a
    same-transaction claim of the key waits on it.  The claim may replay or say RequestInProgress
    (PostgreSQL: its statement sees the in-progress version it started with); it never runs the
    work, and its retry replays."""
    probe = backend.new_engine(pool_size=1, max_overflow=0)
    updated = threading.Event()
    out: dict[str, Any] = {}

    def owner() -> None:
        with Session(eng) as s:
            with idempotent(s, scope="ca8", key="k", mode="separate") as call:
                s.execute(insert(work).values(label="k", by="owner"))
                pid = _pid(s)

                def hold(_session: Session) -> None:
                    updated.set()
                    out["waited"] = _await_waiters(backend, probe, pid, 1)

                event.listen(s, "before_commit", hold, once=True)
                call.complete({"by": "owner"})

    def twin() -> None:
        assert updated.wait(10)
        try:
            out["twin"] = _unit(eng, "ca8", "k", "twin", label="k", fingerprint=None)
        except RequestInProgress as error:
            out["twin"] = ("in_progress", error.retry_after > timedelta(0))

    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(owner), pool.submit(twin)]
            for f in futures:
                f.result(timeout=60)
    finally:
        probe.dispose()
    assert out.get("waited"), "the claim never waited on the completion"
    assert out["twin"] in (("replayed", {"by": "owner"}), ("in_progress", True)), out
    assert _unit(eng, "ca8", "k", "retry", label="k", fingerprint=None) == ("replayed", {"by": "owner"})
    assert _runs(eng, "k") == ["owner"]


# --------------------------------------------------------------------------- 9. the longest ttl


@pytest.mark.limits
@pytest.mark.parametrize("days", [10**8, timedelta.max.days])
def test_the_longest_ttl_claims_and_replays(eng: Engine, days: int) -> None:
    """``ttl`` is any positive timedelta and the claim computes ``db_now + ttl`` inside its statement.
    ``timedelta.max`` is 8.64e16 ms, so the sum fits a BIGINT: the key is claimed, stored with that
    expiry (carried back exactly through the record), and replayed; the caller's own earlier write
    in the same transaction commits with it."""
    ttl = timedelta(days=days)
    with Session(eng) as s, s.begin():
        s.execute(insert(work).values(label="before", by="caller"))
        with idempotent(s, scope="ca12", key="k", ttl=ttl, lease=timedelta(seconds=30)) as call:
            assert not call.replayed
            s.execute(insert(work).values(label="k", by="first"))
            call.complete({"by": "first"})
    assert _runs(eng, "before") == ["caller"]
    record = _record(eng, "ca12", "k")
    ttl_ms = days * _DAY_MS
    assert ttl_ms < record.expires_ms < ttl_ms + 10 * 365 * _DAY_MS * 100, record.expires_ms
    assert _unit(eng, "ca12", "k", "again", label="k") == ("replayed", {"by": "first"})
    assert _runs(eng, "k") == ["first"]
