"""idempotent()'s claim: on PostgreSQL one statement reports claimed, the stored record or an
invisible one exactly; a twin waiting on a held claim replays or claims exactly once, and twelve
twins released by a barrier on a held claim run the work once (peers on every backend)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from sqlalchemy import (
    Engine,
    func,
    insert,
    select,
)
from sqlalchemy.orm import Session

from stateguard import (
    create_tables,
    drop_tables,
    idempotent,
)
from stateguard.idempotency.statements import CLAIM as _CLAIM
from stateguard.tables import idempotency_keys
from tests._support.idem_claims import (
    _DAY_MS,
    Boom,
    _await_waiters,
    _claim_verb,
    _held_claim,
    _pid,
    _record,
    _retrying,
    _runs,
    _statements_of,
    _unit,
    _verbs,
    ca_md,
    work,
)
from tests.conftest import Backend, capable


@pytest.fixture
def eng(engine: Engine, backend: Backend) -> Iterator[Engine]:
    """stateguard's tables (conftest ``engine``) and ``ca_work`` on each backend, dropped afterwards."""
    backend.create(ca_md)
    yield engine


@pytest.fixture
def pg_eng(pg: Backend) -> Iterator[Engine]:
    """PostgreSQL only: stateguard's tables and ``ca_work``."""
    eng = pg.engine
    drop_tables(eng)
    create_tables(eng)
    pg.create(ca_md)
    yield eng
    drop_tables(eng)


def _records(engine: Engine, scope: str) -> int:
    t = idempotency_keys
    with engine.connect() as c:
        return int(c.scalar(select(func.count()).select_from(t).where(t.c.scope == scope)) or 0)


# --------------------------------------------------------------------------- 1. the statement itself


def test_pg_claim_statement_reports_claimed_record_and_invisible_exactly(pg: Backend, pg_eng: Engine) -> None:
    """The kernel's three answers, each produced for real: a new key (True, None) with the row
    written; a visible record (False, its 11 values); a twin's row that committed while our INSERT
    waited on it (False, None) with nothing inserted by us; and a twin that rolled back instead
    (True, None): we inserted."""
    t = idempotency_keys
    params = {
        "sg_scope": "ca-kernel",
        "sg_fp": "f" * 64,
        "sg_lease": 60_000,
        "sg_ttl": _DAY_MS,
    }
    with pg_eng.begin() as conn:
        assert _CLAIM.insert_or_read(conn, {**params, "sg_key": "new", "sg_owner": "o1"}) == (True, None)
    assert _record(pg_eng, "ca-kernel", "new").owner == "o1"
    with pg_eng.begin() as conn:
        inserted, values = _CLAIM.insert_or_read(conn, {**params, "sg_key": "new", "sg_owner": "o2"})
    assert inserted is False and values is not None and len(values) == 11
    assert values[:4] == ["in_progress", "f" * 64, "o1", 1]
    assert _record(pg_eng, "ca-kernel", "new").owner == "o1"

    probe = pg.new_engine(pool_size=1, max_overflow=0)
    try:
        for outcome in ("commit", "rollback"):
            key = f"twin-{outcome}"
            holder = pg_eng.connect()
            tx = holder.begin()
            pid = int(holder.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())
            assert _CLAIM.insert_or_read(holder, {**params, "sg_key": key, "sg_owner": "holder"}) == (
                True,
                None,
            )
            answer: dict[str, Any] = {}

            def twin(key: str = key, answer: dict[str, Any] = answer) -> None:
                with pg_eng.begin() as conn:
                    answer["r"] = _CLAIM.insert_or_read(conn, {**params, "sg_key": key, "sg_owner": "twin"})

            thread = threading.Thread(target=twin)
            thread.start()
            waited = _await_waiters(pg, probe, pid, 1)
            if outcome == "commit":
                tx.commit()
            else:
                tx.rollback()
            holder.close()
            thread.join(30)
            assert waited, "the twin never waited on the holder"
            with pg_eng.connect() as c:
                owners = c.scalars(
                    select(t.c.owner).where(t.c.scope == "ca-kernel", t.c.idem_key == key)
                ).all()
            if outcome == "commit":
                assert answer["r"] == (False, None), answer
                assert owners == ["holder"]
            else:
                assert answer["r"] == (True, None), answer
                assert owners == ["twin"]
    finally:
        probe.dispose()


# --------------------------------------------------------------------------- 2. one waiting twin


@pytest.mark.parametrize("outcome", ["commit", "rollback", "block_raises_caller_commits"])
def test_a_twin_waiting_on_the_claim_replays_or_claims_exactly_once(
    eng: Engine, backend: Backend, outcome: str
) -> None:
    """Same-transaction mode: the twin's claim waits on the first's uncommitted claim.  First commits:
    the twin replays (PostgreSQL: through the NULL answer and one read).  First's transaction rolls
    back, or its block raises and the caller commits: the twin claims and runs the work once."""
    probe = backend.new_engine(pool_size=1, max_overflow=0)
    claimed = threading.Event()
    out: dict[str, Any] = {}

    def first() -> None:
        with Session(eng) as s:
            s.begin()
            pid = _pid(s)
            try:
                with idempotent(s, scope="ca2", key="k", fingerprint="b") as call:
                    assert not call.replayed
                    s.execute(insert(work).values(label="k", by="first"))
                    claimed.set()
                    out["waited"] = _await_waiters(backend, probe, pid, 1)
                    if outcome == "block_raises_caller_commits":
                        raise Boom
                    call.complete({"by": "first"})
            except Boom:
                pass
            if outcome == "rollback":
                s.rollback()
            else:
                s.commit()

    def twin() -> None:
        assert claimed.wait(10)
        with Session(eng) as s, s.begin():
            with _statements_of(s.connection()) as seen:
                with idempotent(s, scope="ca2", key="k", fingerprint="b") as call:
                    if call.replayed:
                        out["twin"] = ("replayed", call.response)
                    else:
                        s.execute(insert(work).values(label="k", by="twin"))
                        out["twin"] = ("ran", call.complete({"by": "twin"}))
            out["verbs"] = _verbs(seen)

    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(first), pool.submit(twin)]
            for f in futures:
                f.result(timeout=60)
    finally:
        probe.dispose()
    assert out.get("waited"), "the twin never waited on the claim"
    record = _record(eng, "ca2", "k")
    if outcome == "commit":
        assert out["twin"] == ("replayed", {"by": "first"}), out
        assert _runs(eng, "k") == ["first"]
        assert out["verbs"] == [_claim_verb(backend), "SELECT"], out["verbs"]
        assert record.status == "completed" and record.response == '{"by":"first"}'
    else:
        assert out["twin"] == ("ran", {"by": "twin"}), out
        assert _runs(eng, "k") == ["twin"]
        assert out["verbs"] == [_claim_verb(backend), "SAVEPOINT", "INSERT", "UPDATE", "RELEASE"], out
        assert record.status == "completed" and record.response == '{"by":"twin"}'
        assert record.attempt == 1
    assert _records(eng, "ca2") == 1


# --------------------------------------------------------------------------- 3. twelve twins


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_twelve_twins_released_by_a_barrier_on_a_held_claim(
    eng: Engine, backend: Backend, outcome: str
) -> None:
    """An owner holds a completed-but-uncommitted claim; 12 twins (a barrier) all wait on it.
    Commit: 12 replays of the owner's response.  Rollback: exactly one twin runs the work, the 11
    others replay its response (MariaDB: the documented deadlock victims replay on retry)."""
    n = 12
    probe = backend.new_engine(pool_size=1, max_overflow=0)
    barrier = threading.Barrier(n + 1)
    retried: list[str] = []
    out: dict[str, Any] = {}

    def owner() -> None:
        with _held_claim(eng, "ca3", "k", "owner", fingerprint="b") as (s, pid):
            barrier.wait(10)
            out["waited"] = _await_waiters(backend, probe, pid, n)
            if outcome == "commit":
                s.commit()
            else:
                s.rollback()

    def twin(i: int) -> tuple[str, Any]:
        barrier.wait(10)
        return _retrying(lambda: _unit(eng, "ca3", "k", f"twin-{i}", label="k", fingerprint="b"), retried)

    try:
        with ThreadPoolExecutor(n + 1) as pool:
            owned = pool.submit(owner)
            answers = [f.result(timeout=90) for f in [pool.submit(twin, i) for i in range(n)]]
            owned.result(timeout=90)
    finally:
        probe.dispose()
    assert out.get("waited"), "the twins never all waited on the claim"
    runs = _runs(eng, "k")
    assert len(runs) == 1, runs
    if outcome == "commit":
        assert runs == ["owner"]
        assert answers == [("replayed", {"by": "owner"})] * n
    else:
        winner = runs[0]
        assert winner.startswith("twin-"), runs
        assert sorted(answers, key=lambda a: a[0]) == [("ran", {"by": winner})] + [
            ("replayed", {"by": winner})
        ] * (n - 1)
    if not capable(backend, "duplicate_inserts_deadlock"):
        assert retried == [], retried
    record = _record(eng, "ca3", "k")
    assert record.status == "completed" and record.attempt == 1
    assert _records(eng, "ca3") == 1
