"""idempotent() at stricter isolation levels: a claim whose snapshot predates the committed record
never runs, and a REPEATABLE READ twin waiting on the claim gets a typed outcome."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from sqlalchemy import (
    Column,
    Engine,
    Integer,
    Table,
    func,
    insert,
    select,
)
from sqlalchemy.orm import Session

from stateguard import (
    SerializationConflict,
    idempotent,
)
from tests._support.idem_claims import (
    _await_waiters,
    _pid,
    _retrying,
    _runs,
    _unit,
    ca_md,
    work,
)
from tests.conftest import Backend, capable

#: Read to take a transaction's snapshot without locking anything the other requests write
#: (MariaDB at SERIALIZABLE turns a plain SELECT into a locking read).
snap_table = Table("ca_snap", ca_md, Column("id", Integer, primary_key=True))


@pytest.fixture
def eng(engine: Engine, backend: Backend) -> Iterator[Engine]:
    """stateguard's tables (conftest ``engine``) and ``ca_work`` on each backend, dropped afterwards."""
    backend.create(ca_md)
    yield engine


# --------------------------------------------------------------------------- 7. isolation


def _iso_engine(backend: Backend, isolation: str) -> Engine:
    if not capable(backend, "isolation_levels"):
        return backend.new_engine(pool_size=2, max_overflow=0)  # SQLite is serializable already
    return backend.new_engine(pool_size=2, max_overflow=0, isolation_level=isolation)


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_a_claim_whose_snapshot_predates_the_committed_record_never_runs(
    eng: Engine, backend: Backend, isolation: str
) -> None:
    """No threads: transaction A takes its snapshot, request B runs and commits, then A claims the
    same key.  PostgreSQL: the typed SerializationConflict (README), and the retry replays;
    MariaDB (locking read) and SQLite: a replay.  The work never runs twice."""
    iso = _iso_engine(backend, isolation)
    try:
        with Session(iso) as s:
            s.begin()
            assert s.scalar(select(func.count()).select_from(snap_table)) == 0  # the snapshot
            assert _unit(eng, "ca9", "k", "b", label="k") == ("ran", {"by": "b"})
            if capable(backend, "snapshot_conflicts"):
                with (
                    pytest.raises(SerializationConflict),
                    idempotent(s, scope="ca9", key="k", fingerprint="body"),
                ):
                    pytest.fail("a stale snapshot must not run the work")
            else:
                with idempotent(s, scope="ca9", key="k", fingerprint="body") as call:
                    assert call.replayed and call.response == {"by": "b"}
            s.rollback()
        retried: list[str] = []
        assert _retrying(lambda: _unit(iso, "ca9", "k", "retry", label="k"), retried) == (
            "replayed",
            {"by": "b"},
        )
        assert retried == []
    finally:
        iso.dispose()
    assert _runs(eng, "k") == ["b"]


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_a_repeatable_read_twin_waiting_on_the_claim(eng: Engine, backend: Backend, outcome: str) -> None:
    """The twin runs at REPEATABLE READ with its snapshot taken before it waits on the claim.  First
    commits: PostgreSQL raises the typed SerializationConflict (the retry replays), the others replay.
    First rolls back: the twin claims and runs the work, once."""
    iso = _iso_engine(backend, "REPEATABLE READ")
    probe = backend.new_engine(pool_size=1, max_overflow=0)
    claimed = threading.Event()
    snap = threading.Event()
    out: dict[str, Any] = {}

    def first() -> None:
        with Session(eng) as s:
            s.begin()
            pid = _pid(s)
            assert snap.wait(10)
            with idempotent(s, scope="ca10", key="k", fingerprint="b") as call:
                s.execute(insert(work).values(label="k", by="first"))
                call.complete({"by": "first"})
            claimed.set()
            out["waited"] = _await_waiters(backend, probe, pid, 1)
            if outcome == "commit":
                s.commit()
            else:
                s.rollback()

    def twin() -> None:
        with Session(iso) as s:
            s.begin()
            s.scalar(select(func.count()).select_from(snap_table))  # the snapshot, before the claim exists
            snap.set()
            assert claimed.wait(10)
            try:
                with idempotent(s, scope="ca10", key="k", fingerprint="b") as call:
                    if call.replayed:
                        out["twin"] = ("replayed", call.response)
                    else:
                        s.execute(insert(work).values(label="k", by="twin"))
                        out["twin"] = ("ran", call.complete({"by": "twin"}))
            except SerializationConflict as error:
                out["twin"] = ("conflict", type(error).__name__)
                s.rollback()
                return
            s.commit()

    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(first), pool.submit(twin)]
            for f in futures:
                f.result(timeout=60)
        retried: list[str] = []
        again = _retrying(lambda: _unit(iso, "ca10", "k", "retry", label="k", fingerprint="b"), retried)
    finally:
        iso.dispose()
        probe.dispose()
    assert out.get("waited"), "the twin never waited on the claim"
    if outcome == "commit":
        expected = (
            ("conflict", "SerializationConflict")
            if capable(backend, "snapshot_conflicts")
            else ("replayed", {"by": "first"})
        )
        assert out["twin"] == expected, out
        assert again == ("replayed", {"by": "first"})
        assert _runs(eng, "k") == ["first"]
    else:
        assert out["twin"] == ("ran", {"by": "twin"}), out
        assert again == ("replayed", {"by": "twin"})
        assert _runs(eng, "k") == ["twin"]
    assert retried == []
