"""Row locks, advisory locks and Redis locks with fencing tokens (stateguard.locks)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, select, text
from sqlalchemy.orm import Session

from stateguard import (
    DeadlockDetected,
    InvalidArgument,
    LockLost,
    LockNotAcquired,
    NotSupported,
    RedisLock,
    _kernel,
    advisory_lock,
    retry_on_conflict,
    row_lock,
    sqlite_engine,
)
from stateguard.locks import advisory_key, mysql_lock_name
from tests._support import lock_workers as w
from tests._support.lock_workers import Job, JobTake, LockBase, Payout, Tally
from tests._support.models import Base, Shipment
from tests._support.processes import worker_context
from tests.conftest import REDIS_URL, Backend, backends_with, capable, count_statements

# --------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------


# The lock tables on each backend; on SQLite through ``sqlite_engine`` (BEGIN IMMEDIATE).
pytestmark = pytest.mark.tables(LockBase.metadata, stateguard=False, sqlite_engine={"busy_timeout": 60})


@pytest.fixture
def redis_prefix(redis_client: Any) -> Iterator[str]:
    """A lock-name prefix unique to the test; its keys are deleted afterwards."""
    prefix = f"sgt-{uuid.uuid4().hex[:12]}"
    yield prefix
    keys = list(redis_client.scan_iter(match=f"stateguard:lock:{{{prefix}*"))
    if keys:
        redis_client.delete(*keys)


@pytest.fixture(scope="module")
def procs() -> Iterator[tuple[Any, ProcessPoolExecutor]]:
    """Eight separate worker processes and a manager for barriers/events, shared by the module."""
    ctx = worker_context()
    with ctx.Manager() as manager, ProcessPoolExecutor(8, mp_context=ctx) as pool:
        yield manager, pool


def _tallies(engine: Engine, ids: list[int], value: int = 0) -> None:
    with Session(engine) as s, s.begin():
        s.add_all([Tally(id=i, value=value) for i in ids])


def _value(engine: Engine, id_: int = 1) -> int:
    with Session(engine) as s:
        return s.scalars(select(Tally.value).where(Tally.id == id_)).one()


# --------------------------------------------------------------------------
# Eight processes, one counter: no lost update
# --------------------------------------------------------------------------

N_PROCS = 8
TIMES = 8


def _increments(
    procs: tuple[Any, ProcessPoolExecutor],
    db: str,
    url: str,
    mode: str,
    *,
    lock_name: str = "",
    redis_url: str | None = None,
    pause: float = 0.002,
) -> None:
    manager, pool = procs
    barrier = manager.Barrier(N_PROCS, timeout=120)
    futures = [
        pool.submit(w.increment, db, url, mode, TIMES, barrier, lock_name, redis_url, pause)
        for _ in range(N_PROCS)
    ]
    assert [f.result(timeout=180) for f in futures] == [TIMES] * N_PROCS


def test_racy_increments_lose_updates_without_a_lock(
    pg: Backend, procs: tuple[Any, ProcessPoolExecutor]
) -> None:
    """Without a lock, 8 processes running read-pause-write lose increments (so the lock tests can fail)."""
    engine = pg.create(LockBase.metadata)
    _tallies(engine, [1])
    _increments(procs, "postgresql", pg.url, "none", pause=0.005)
    assert _value(engine) < N_PROCS * TIMES


def test_8_processes_under_row_lock_lose_no_increment(
    backend: Backend, engine: Engine, procs: tuple[Any, ProcessPoolExecutor]
) -> None:
    """8 processes doing read-pause-write under row_lock end with every increment counted."""
    _tallies(engine, [1])
    _increments(procs, backend.name, backend.url, "row_lock")
    assert _value(engine) == N_PROCS * TIMES


@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_8_processes_under_advisory_lock_lose_no_increment(
    backend: Backend, engine: Engine, procs: tuple[Any, ProcessPoolExecutor]
) -> None:
    """8 processes doing read-pause-write under advisory_lock end with every increment counted."""
    _tallies(engine, [1])
    name = f"sgt:tally:{uuid.uuid4().hex}"
    _increments(procs, backend.name, backend.url, "advisory", lock_name=name)
    assert _value(engine) == N_PROCS * TIMES


def test_8_processes_under_redis_lock_lose_no_increment(
    pg: Backend, redis_prefix: str, procs: tuple[Any, ProcessPoolExecutor]
) -> None:
    """8 processes doing read-pause-write on PostgreSQL under a RedisLock end with every increment counted."""
    engine = pg.create(LockBase.metadata)
    _tallies(engine, [1])
    _increments(procs, "postgresql", pg.url, "redis", lock_name=f"{redis_prefix}:tally", redis_url=REDIS_URL)
    assert _value(engine) == N_PROCS * TIMES


# --------------------------------------------------------------------------
# Fencing: a paused holder whose lock expired
# --------------------------------------------------------------------------


def test_paused_holder_past_its_ttl_is_fenced_out_and_loses_its_lock(
    backend: Backend,
    engine: Engine,
    redis_prefix: str,
    redis_client: Any,
    procs: tuple[Any, ProcessPoolExecutor],
) -> None:
    """A holder paused past its TTL gets STALE (old fence) and LockLost; the new holder's write stays."""
    with Session(engine) as s, s.begin():
        s.add(Payout(id=1, holder=None))
    manager, pool = procs
    have_lock, b_wrote, a_done = manager.Event(), manager.Event(), manager.Event()
    name = f"{redis_prefix}:payout"
    a = pool.submit(
        w.paused_holder, backend.name, backend.url, REDIS_URL, name, 0.5, have_lock, b_wrote, a_done
    )
    b = pool.submit(w.next_holder, backend.name, backend.url, REDIS_URL, name, have_lock, b_wrote, a_done)
    first, second = a.result(timeout=60), b.result(timeout=60)

    assert second["waited"] > 0.2  # B really had to wait for A's lock to expire
    assert second["fence"] > first["fence"]
    assert second["outcome"] == "APPLIED"
    assert first["owned_after_pause"] is False
    # A read the row fresh, so its version check passed: only the fence refused it.
    assert first["outcome"] == "STALE"
    assert first["version"] == first["expected"]
    assert first["lock_lost"] is True
    assert second["owned_after_a_exit"] is True  # A's exit did not delete B's lock
    assert second["free_after_exit"] is True
    with Session(engine) as s:
        row = s.get_one(Payout, 1)
        assert (row.holder, row.fence) == ("B", second["fence"])
    assert int(redis_client.get(f"stateguard:lock:{{{name}}}:fence")) == second["fence"]


# --------------------------------------------------------------------------
# row_lock
# --------------------------------------------------------------------------


def test_row_lock_returns_the_locked_row_refreshed(engine: Engine) -> None:
    """row_lock returns the session's own instance, refreshed from the locked row, or None when missing."""
    _tallies(engine, [1, 2])
    with Session(engine, expire_on_commit=False) as s:
        with s.begin():
            loaded = s.get_one(Tally, 1)
        with engine.begin() as other:
            other.execute(text("UPDATE lock_tally SET value = 42 WHERE id = 1"))
        with s.begin():
            assert loaded.value == 0  # stale in memory
            locked = row_lock(s, Tally, 1)
            assert locked is loaded
            assert locked.value == 42
            assert row_lock(s, Tally, 99) is None
            assert row_lock(s, Tally, loaded) is loaded


def test_row_lock_of_a_list_is_one_ordered_statement(backend: Backend, engine: Engine) -> None:
    """A list is locked by one SELECT ... ORDER BY pk FOR UPDATE, returned in key order minus missing rows."""
    _tallies(engine, [1, 2, 3])
    with Session(engine) as s, s.begin():
        # Begin first (sqlite_engine: BEGIN IMMEDIATE at the first row_lock): one statement is counted.
        row_lock(s, Tally, 1)
        with count_statements(engine) as stmts:
            rows = row_lock(s, Tally, [3, 99, 1, 2, 3])
        assert [r.id for r in rows] == [1, 2, 3]
        assert len(stmts) == 1
        sql = " ".join(stmts.statements[0].split())
        assert "ORDER BY lock_tally.id" in sql
        if capable(backend, "row_locks"):
            assert sql.endswith("FOR UPDATE")
        assert row_lock(s, Tally, []) == []


def test_row_lock_with_composite_keys(backend: Backend, engine: Engine) -> None:
    """Composite keys are given as tuples and locked in (warehouse, number) order."""
    backend.create(Base.metadata)
    with Session(engine) as s, s.begin():
        s.add_all([Shipment(warehouse=w, number=n) for w, n in [("b", 1), ("a", 2), ("a", 1)]])
    with Session(engine) as s, s.begin():
        rows = row_lock(s, Shipment, [("b", 1), ("a", 2), ("c", 9), ("a", 1)])
        assert [(r.warehouse, r.number) for r in rows] == [("a", 1), ("a", 2), ("b", 1)]
        assert row_lock(s, Shipment, ("a", 2)) is rows[1]
        with pytest.raises(InvalidArgument, match="2 column"):
            row_lock(s, Shipment, ("a",))


@pytest.mark.parametrize(
    ("option", "clause"), [("nowait", "FOR UPDATE NOWAIT"), ("skip_locked", "FOR UPDATE SKIP LOCKED")]
)
@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_row_lock_options_reach_the_sql(backend: Backend, engine: Engine, option: str, clause: str) -> None:
    """nowait and skip_locked become NOWAIT / SKIP LOCKED in the statement; where a failed statement
    aborts the transaction (PostgreSQL), nowait locks with SKIP LOCKED instead (and looks after)."""
    _tallies(engine, [1])
    if option == "nowait" and _kernel.backend(engine.dialect).errors_abort_transaction:
        clause = "FOR UPDATE SKIP LOCKED"
    with Session(engine) as s, s.begin():
        row_lock(s, Tally, 1)  # the engine's first call (a MariaDB engine asks once about Galera)
        with count_statements(engine) as stmts:
            row_lock(s, Tally, 1, **{option: True})
        assert len(stmts.statements) == 1, stmts.statements  # a free row: one statement
        assert " ".join(stmts.statements[-1].split()).endswith(clause)


def _hold(engine: Engine, ids: list[int]) -> tuple[Session, Any]:
    """A second transaction holding row locks on ``ids`` (close the session to release)."""
    holder = Session(engine)
    tx = holder.begin()
    assert [t.id for t in row_lock(holder, Tally, ids)] == ids
    return holder, tx


@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_nowait_on_a_held_row_fails_at_once(backend: Backend, engine: Engine) -> None:
    """With the row held elsewhere, nowait raises LockNotAcquired at once; without it the call would wait."""
    _tallies(engine, [1, 2])
    holder, _ = _hold(engine, [1])
    try:
        with Session(engine) as s:
            with s.begin():
                assert row_lock(s, Tally, 2, nowait=True).id == 2  # a free row is fine
                started = time.monotonic()
                with pytest.raises(LockNotAcquired) as caught:
                    row_lock(s, Tally, 1, nowait=True)
                assert time.monotonic() - started < 0.5
                assert caught.value.retryable is True
                s.rollback()
            # Control: without nowait the same call waits (here until a short lock timeout).
            with s.begin():
                if backend.name == "postgresql":
                    s.execute(text("SET LOCAL lock_timeout = '300ms'"))
                    minimum = 0.25
                else:
                    s.execute(text("SET SESSION innodb_lock_wait_timeout = 1"))
                    minimum = 0.9
                started = time.monotonic()
                with pytest.raises(LockNotAcquired):
                    row_lock(s, Tally, 1)
                assert time.monotonic() - started >= minimum
                s.rollback()
    finally:
        holder.close()


@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_nowait_refused_leaves_the_transaction_usable_and_missing_rows_missing(engine: Engine) -> None:
    """After LockNotAcquired from nowait the transaction goes on (on PostgreSQL too, where NOWAIT's
    own error would have aborted it): its other locks and writes stay; a missing row is None, not
    LockNotAcquired; a list with a held row is refused, one with a missing row returns the others."""
    _tallies(engine, [1, 2, 3, 4])
    holder, _ = _hold(engine, [1])
    try:
        with Session(engine) as s, s.begin():
            free = row_lock(s, Tally, 2, nowait=True)
            free.value = 7
            with pytest.raises(LockNotAcquired, match="another transaction") as caught:
                row_lock(s, Tally, 1, nowait=True)
            assert caught.value.retryable is True
            with pytest.raises(LockNotAcquired):
                row_lock(s, Tally, [3, 1], nowait=True)
            assert row_lock(s, Tally, 99, nowait=True) is None
            assert [t.id for t in row_lock(s, Tally, [4, 99, 3], nowait=True)] == [3, 4]
            s.flush()  # the transaction still takes statements
        with Session(engine) as check:
            assert check.get(Tally, 2).value == 7  # committed with the transaction
    finally:
        holder.close()
    with Session(engine) as s, s.begin():  # the rows the refused calls locked were freed with it
        assert [t.id for t in row_lock(s, Tally, [1, 2, 3, 4], nowait=True)] == [1, 2, 3, 4]


@pytest.mark.parametrize("backend", backends_with("skip_locked"), indirect=True)
def test_skip_locked_returns_only_the_free_rows(engine: Engine) -> None:
    """skip_locked leaves out rows another transaction holds: a list loses them, a single target is None."""
    _tallies(engine, [1, 2, 3])
    holder, _ = _hold(engine, [2])
    try:
        with Session(engine) as s, s.begin():
            assert [t.id for t in row_lock(s, Tally, [3, 2, 1], skip_locked=True)] == [1, 3]
            assert row_lock(s, Tally, 2, skip_locked=True) is None
    finally:
        holder.close()


@pytest.mark.parametrize("backend", backends_with("skip_locked"), indirect=True)
def test_skip_locked_job_queue_gives_every_job_to_exactly_one_worker(engine: Engine) -> None:
    """6 competing workers take up to 5 jobs at a time with skip_locked: no job taken twice, all taken."""
    n_jobs, n_workers, chunk = 60, 6, 5
    with Session(engine) as s, s.begin():
        s.add_all([Job(id=i) for i in range(1, n_jobs + 1)])
    barrier = threading.Barrier(n_workers, timeout=60)

    def worker(name: str) -> int:
        taken = 0
        barrier.wait()
        while True:
            with Session(engine) as s, s.begin():
                # Loads the instances (stale by the time they are locked: row_lock must refresh them).
                pending = s.scalars(
                    select(Job).where(Job.done.is_(False)).order_by(Job.id).limit(chunk)
                ).all()
                if not pending:
                    return taken
                for job in row_lock(s, Job, pending, skip_locked=True):
                    if job.done:
                        continue  # finished by a worker that committed after our read
                    job.done = True
                    s.add(JobTake(job_id=job.id, worker=name))
                    taken += 1
                time.sleep(0.003)

    with ThreadPoolExecutor(n_workers) as pool:
        taken = [f.result(timeout=120) for f in [pool.submit(worker, f"w{i}") for i in range(n_workers)]]
    with Session(engine) as s:
        takes = Counter(s.scalars(select(JobTake.job_id)))
        workers = set(s.scalars(select(JobTake.worker)))
    assert sum(taken) == n_jobs
    assert takes == {i: 1 for i in range(1, n_jobs + 1)}
    assert len(workers) > 1  # the workers really competed


def _opposite_order_storm(server: Backend, engine: Engine, *, ordered: bool) -> tuple[int, list[int]]:
    """8 threads, half locking rows 1..4 and half 4..1, 4 rounds, each unit retried on conflicts."""
    n, rounds, rows = 8, 4, [1, 2, 3, 4]
    barrier = threading.Barrier(n, timeout=60)
    deadlocks: list[DeadlockDetected] = []

    def unit(order: list[int]) -> None:
        try:
            with Session(engine) as s, s.begin():
                if server.name == "postgresql":
                    # PostgreSQL looks for deadlocks only after this wait (default 1s).
                    s.execute(text("SET LOCAL deadlock_timeout = '50ms'"))
                # ordered: one row_lock of the whole list (it locks in primary-key order); not:
                # one row_lock per row in the caller's order, the way naive code locks.
                tallies = row_lock(s, Tally, order) if ordered else [row_lock(s, Tally, k) for k in order]
                for tally in tallies:
                    tally.value += 1
                time.sleep(0.002)
        except DeadlockDetected as error:
            deadlocks.append(error)
            raise

    def worker(i: int) -> None:
        order = rows if i % 2 == 0 else rows[::-1]
        for _ in range(rounds):
            barrier.wait()
            retry_on_conflict(lambda o=order: unit(o), attempts=50, backoff=0.005, max_backoff=0.05)

    with ThreadPoolExecutor(n) as pool:
        for f in [pool.submit(worker, i) for i in range(n)]:
            f.result(timeout=120)
    return len(deadlocks), [_value(engine, i) for i in rows]


@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_opposite_order_multi_row_locks_never_deadlock(backend: Backend, engine: Engine) -> None:
    """8 threads locking the same rows in opposite orders never deadlock: row_lock sorts by primary key."""
    _tallies(engine, [1, 2, 3, 4])
    deadlocks, values = _opposite_order_storm(backend, engine, ordered=True)
    assert deadlocks == 0
    assert values == [32] * 4


@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_unordered_locks_deadlock_and_retry_on_conflict_recovers(backend: Backend, engine: Engine) -> None:
    """Locking row by row in caller order deadlocks; retry_on_conflict reruns each unit until it lands."""
    _tallies(engine, [1, 2, 3, 4])
    deadlocks, values = _opposite_order_storm(backend, engine, ordered=False)
    assert deadlocks > 0
    assert values == [32] * 4


@pytest.mark.hostile
def test_row_lock_rejects_bad_input(backend: Backend, engine: Engine) -> None:
    """A wrong key type, another model's instance or nowait with skip_locked raise InvalidArgument."""
    _tallies(engine, [1])
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument, match="Tally"):
            row_lock(s, Tally, "1")
        with pytest.raises(InvalidArgument):
            row_lock(s, Tally, True)
        with pytest.raises(InvalidArgument, match="Job instance"):
            row_lock(s, Tally, Job(id=1))
        with pytest.raises(InvalidArgument):
            row_lock(s, Tally, [1, "2"])
        with pytest.raises(InvalidArgument, match="nowait and skip_locked"):
            row_lock(s, Tally, 1, nowait=True, skip_locked=True)
        assert row_lock(s, Tally, 1).value == 0


@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_row_lock_of_is_postgresql_only(backend: Backend, engine: Engine) -> None:
    """of= becomes FOR UPDATE OF on PostgreSQL and raises NotSupported on MariaDB instead of being dropped."""
    _tallies(engine, [1])
    with Session(engine) as s, s.begin():
        if backend.name == "mariadb":
            with pytest.raises(NotSupported, match="FOR UPDATE OF"):
                row_lock(s, Tally, 1, of=Tally)
            return
        with count_statements(engine) as stmts:
            assert row_lock(s, Tally, 1, of=Tally).id == 1
        assert stmts.statements[-1].endswith("FOR UPDATE OF lock_tally")


def test_row_lock_on_sqlite_needs_begin_immediate(sqlite: Backend) -> None:
    """On a plain SQLite engine, or one beginning DEFERRED, row_lock raises NotSupported."""
    engine = sqlite.create(LockBase.metadata)
    _tallies(engine, [1])
    deferred = sqlite_engine(sqlite.url, begin="deferred")
    try:
        for eng in (engine, deferred):
            with Session(eng) as s, s.begin(), pytest.raises(NotSupported, match=r"sqlite_engine"):
                row_lock(s, Tally, 1)
    finally:
        deferred.dispose()


def test_sqlite_row_lock_holds_the_database_write_lock(sqlite: Backend) -> None:
    """Under sqlite_engine, a transaction that called row_lock holds the write lock: other writers wait."""
    sqlite.create(LockBase.metadata)
    engine = sqlite_engine(sqlite.url)
    _tallies(engine, [1])
    impatient = create_engine(sqlite.url, connect_args={"timeout": 0.1}, isolation_level="AUTOCOMMIT")
    try:
        with Session(engine) as s, s.begin():
            assert row_lock(s, Tally, 1, nowait=True).value == 0
            with impatient.connect() as other, pytest.raises(Exception, match="locked"):
                other.execute(text("UPDATE lock_tally SET value = 5"))
        with impatient.connect() as other:
            other.execute(text("UPDATE lock_tally SET value = 5"))
        assert _value(engine) == 5
    finally:
        impatient.dispose()
        engine.dispose()


# --------------------------------------------------------------------------
# advisory_lock
# --------------------------------------------------------------------------


def test_advisory_key_is_a_pinned_signed_64_bit_hash() -> None:
    """The PostgreSQL key is the first 8 bytes of SHA-256, big-endian and signed, and never changes."""
    assert advisory_key("nightly-settlement") == -943890472460227087  # 0xf2e6a09dc221edf1 - 2**64
    assert advisory_key("billing:settle") != advisory_key("billing:settle2")
    for name in ("a", "é", "x" * 1000):
        assert -(2**63) <= advisory_key(name) < 2**63


def test_long_mysql_lock_names_are_shortened_deterministically() -> None:
    """Names over 64 characters become a 64-character prefix+hash; shorter ones stay as they are."""
    short = "n" * 64
    assert mysql_lock_name(short) == short
    a, b = "p" * 40 + "a" * 60, "p" * 40 + "b" * 60
    assert len(mysql_lock_name(a)) == 64
    assert mysql_lock_name(a) == mysql_lock_name(a)
    assert mysql_lock_name(a) != mysql_lock_name(b)
    assert mysql_lock_name(a).startswith("p" * 31 + "~")


def _is_free(server: Backend, name: str) -> bool:
    """Ask a brand-new connection (its own engine) whether the named lock is free."""
    probe = server.new_engine(pool_size=1, max_overflow=0)
    try:
        with probe.connect() as conn:
            if server.name == "postgresql":
                key = advisory_key(name)
                got = conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar()
                if got:
                    conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                return bool(got)
            return bool(conn.execute(text("SELECT IS_FREE_LOCK(:n)"), {"n": mysql_lock_name(name)}).scalar())
    finally:
        probe.dispose()


def _held_by_pooled_connection(server: Backend, engine: Engine, name: str) -> bool:
    """Whether the (only) pooled connection of ``engine`` still holds the lock."""
    with engine.connect() as conn:
        if server.name == "postgresql":
            found = conn.execute(
                text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()")
            ).scalar()
            return bool(found)
        used = conn.execute(text("SELECT IS_USED_LOCK(:n) = CONNECTION_ID()"), {"n": mysql_lock_name(name)})
        return bool(used.scalar())


@pytest.mark.parametrize("ending", ["commit inside", "exit then commit", "exception"])
@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_advisory_lock_never_leaks_into_the_pool(backend: Backend, ending: str) -> None:
    """The lock is held in the block and free, also on the reused pooled connection, once the session ends."""
    engine = backend.new_engine(pool_size=1, max_overflow=0)
    name = f"sgt:leak:{uuid.uuid4().hex}"
    try:
        with Session(engine) as s:
            try:
                with advisory_lock(s, name):
                    assert not _is_free(backend, name)
                    if ending == "commit inside":
                        s.commit()
                        assert _is_free(backend, name)  # released with the transaction/connection
                    if ending == "exception":
                        raise KeyError("boom")
            except KeyError:
                pass
            if backend.name == "mariadb":
                assert _is_free(backend, name)  # GET_LOCK is released on exit, before the commit
            s.commit()
        assert _is_free(backend, name)
        assert not _held_by_pooled_connection(backend, engine, name)
    finally:
        engine.dispose()


@pytest.mark.cancel
@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_advisory_lock_timeout_gives_up_and_leaves_the_transaction_usable(
    backend: Backend, engine: Engine
) -> None:
    """A held lock makes timeout=0.3 raise LockNotAcquired after ~0.3s; the waiter's transaction lives on."""
    name = f"sgt:timeout:{uuid.uuid4().hex}"
    with (
        Session(engine) as holder,
        advisory_lock(holder, name),
        Session(engine) as s,
        s.begin(),
    ):
        started = time.monotonic()
        with pytest.raises(LockNotAcquired) as caught, advisory_lock(s, name, timeout=timedelta(seconds=0.3)):
            pass  # pragma: no cover
        assert 0.25 <= time.monotonic() - started < 2
        assert caught.value.retryable is True
        with pytest.raises(LockNotAcquired), advisory_lock(s, name, timeout=0):
            pass  # pragma: no cover
        assert s.execute(text("SELECT 1")).scalar() == 1  # not aborted (PostgreSQL polls)


@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_advisory_lock_waits_for_the_holder(backend: Backend, engine: Engine) -> None:
    """Without a timeout the waiter blocks until the holder's transaction ends, then gets the lock."""
    name = f"sgt:wait:{uuid.uuid4().hex}"
    holding, waited = threading.Event(), []

    def hold() -> None:
        with Session(engine) as s, advisory_lock(s, name):
            holding.set()
            time.sleep(0.4)
            s.commit()

    thread = threading.Thread(target=hold)
    thread.start()
    assert holding.wait(10)
    with Session(engine) as s, s.begin():
        started = time.monotonic()
        with advisory_lock(s, name):
            waited.append(time.monotonic() - started)
    thread.join()
    assert waited[0] >= 0.25


def test_pg_shared_advisory_locks_coexist_and_exclude_exclusive(pg: Backend) -> None:
    """Two shared holders coexist; an exclusive request fails while they hold the lock."""
    name = f"sgt:shared:{uuid.uuid4().hex}"
    engine = pg.engine
    with Session(engine) as a, Session(engine) as b, Session(engine) as c:
        with (
            advisory_lock(a, name, shared=True),
            advisory_lock(b, name, shared=True, timeout=0),
            c.begin(),
            pytest.raises(LockNotAcquired),
            advisory_lock(c, name, timeout=0),
        ):
            pass  # pragma: no cover
        a.commit()
        b.commit()
        with c.begin(), advisory_lock(c, name, timeout=0):
            pass


def test_pg_advisory_lock_refuses_autocommit(pg: Backend) -> None:
    """In AUTOCOMMIT a transaction-level advisory lock would end with its statement: NotSupported."""
    engine = pg.engine.execution_options(isolation_level="AUTOCOMMIT")
    with Session(engine) as s, pytest.raises(NotSupported, match="AUTOCOMMIT"), advisory_lock(s, "sgt:ac"):
        pass  # pragma: no cover


def test_mariadb_long_names_and_no_shared_mode(mariadb: Backend) -> None:
    """Long names that share 64 characters are distinct locks; shared=True is NotSupported on MariaDB."""
    engine = mariadb.engine
    prefix = f"sgt:long:{uuid.uuid4().hex}:" + "x" * 60
    with Session(engine) as a, Session(engine) as b:
        with advisory_lock(a, prefix + "one"), advisory_lock(b, prefix + "two", timeout=0):
            assert not _is_free(mariadb, prefix + "one")
            with pytest.raises(LockNotAcquired), advisory_lock(b, prefix + "one", timeout=0):
                pass  # pragma: no cover
        assert _is_free(mariadb, prefix + "one")
        with pytest.raises(NotSupported, match="shared"), advisory_lock(a, prefix, shared=True):
            pass  # pragma: no cover


@pytest.mark.hostile
def test_advisory_lock_on_sqlite_and_bad_arguments(sqlite: Backend) -> None:
    """SQLite has no named locks (NotSupported); an empty name or a negative timeout is InvalidArgument."""
    with Session(sqlite.engine) as s:
        with pytest.raises(NotSupported, match="sqlite"), advisory_lock(s, "x"):
            pass  # pragma: no cover
        with pytest.raises(InvalidArgument), advisory_lock(s, ""):
            pass  # pragma: no cover
        with pytest.raises(InvalidArgument), advisory_lock(s, "x", timeout=-1):
            pass  # pragma: no cover


# --------------------------------------------------------------------------
# RedisLock
# --------------------------------------------------------------------------


def test_fence_grows_with_every_acquisition_and_keys_share_a_slot(
    redis_client: Any, redis_prefix: str
) -> None:
    """Each acquisition returns a bigger fence; lock and fence keys share a cluster slot; the TTL is set."""
    from redis.crc import key_slot

    name = f"{redis_prefix}:grow"
    lock = RedisLock(redis_client, name, ttl=timedelta(seconds=5))
    fences = []
    for _ in range(3):
        with lock as fence:
            fences.append(fence)
            assert lock.fence == fence
            assert 0 < redis_client.pttl(lock.key) <= 5000
            assert lock.owned() and lock.locked()
        assert not lock.locked()
    other = RedisLock(redis_client, name, ttl=1)
    with other as fence:
        fences.append(fence)
    assert fences == sorted(set(fences)), fences  # strictly increasing (seeded from the server clock)
    assert int(redis_client.get(lock.fence_key)) == fences[-1]
    assert lock.key == f"stateguard:lock:{{{name}}}"
    assert key_slot(lock.key.encode()) == key_slot(lock.fence_key.encode())


def test_failed_acquisition_times_out_without_consuming_a_fence(redis_client: Any, redis_prefix: str) -> None:
    """While the lock is held, another acquirer gets LockNotAcquired after blocking_timeout, and no fence."""
    name = f"{redis_prefix}:busy"
    with RedisLock(redis_client, name, ttl=5) as fence:
        waiter = RedisLock(redis_client, name, ttl=5, blocking_timeout=0.3, sleep=0.01)
        started = time.monotonic()
        with pytest.raises(LockNotAcquired) as caught, waiter:
            pass  # pragma: no cover
        assert 0.2 <= time.monotonic() - started < 1.5
        assert caught.value.retryable is True
        with pytest.raises(LockNotAcquired):
            waiter.acquire(blocking_timeout=0)
        assert int(redis_client.get(waiter.fence_key)) == fence
        assert waiter.fence is None


def test_expired_lock_release_leaves_the_new_holders_lock(redis_client: Any, redis_prefix: str) -> None:
    """A holder whose TTL passed gets LockLost on exit and does not delete the lock the next holder took."""
    name = f"{redis_prefix}:expired"
    first = RedisLock(redis_client, name, ttl=0.1)
    second = RedisLock(redis_client, name, ttl=5, blocking_timeout=2, sleep=0.01)
    with pytest.raises(LockLost, match="expired"), first as old:
        time.sleep(0.25)
        new = second.acquire()
        assert new > old
    token = redis_client.get(second.key)
    assert second.owned()
    assert redis_client.get(second.key) == token
    second.release()
    assert not second.locked()


def test_an_error_in_the_block_wins_over_lock_lost(redis_client: Any, redis_prefix: str) -> None:
    """When the block raises after the lock expired, the block's own error propagates, not LockLost."""
    lock = RedisLock(redis_client, f"{redis_prefix}:err", ttl=0.05)
    with pytest.raises(KeyError), lock:
        time.sleep(0.1)
        raise KeyError("the real problem")


def test_extend_adds_time_and_fails_once_lost(redis_client: Any, redis_prefix: str) -> None:
    """extend() adds to the TTL while held, raises LockLost once the lock expired, and keeps the fence."""
    lock = RedisLock(redis_client, f"{redis_prefix}:extend", ttl=0.2)
    with pytest.raises(LockLost), lock as fence:
        lock.extend(timedelta(seconds=5))
        assert redis_client.pttl(lock.key) > 4000
        assert lock.fence == fence
        lock.extend(0.05, replace_ttl=True)
        time.sleep(0.1)
        with pytest.raises(LockLost):
            lock.extend(1)
    with pytest.raises(InvalidArgument):
        lock.release()  # not held any more


def test_redis_lock_validates_its_arguments(redis_client: Any) -> None:
    """ttl is required and positive; names must be non-empty strings."""
    with pytest.raises(TypeError):
        RedisLock(redis_client, "x")  # type: ignore[call-arg]
    for ttl in (0, -1, "5", True):
        with pytest.raises(InvalidArgument):
            RedisLock(redis_client, "x", ttl=ttl)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        RedisLock(redis_client, "", ttl=1)
    with pytest.raises(InvalidArgument):
        RedisLock(redis_client, "x", ttl=1, blocking_timeout=-1)


def test_redis_lock_refuses_missing_or_infinite_durations_without_assert(
    redis_client: Any, redis_prefix: str
) -> None:
    """ttl=None, ttl=inf and extend(None) are InvalidArgument, also under ``python -O`` (no assert)."""
    for ttl in (None, float("inf"), float("nan")):
        with pytest.raises(InvalidArgument):
            RedisLock(redis_client, "x", ttl=ttl)  # type: ignore[arg-type]
    lock = RedisLock(redis_client, f"{redis_prefix}:durations", ttl=5)
    with lock:
        for additional in (None, float("inf")):
            with pytest.raises(InvalidArgument):
                lock.extend(additional)  # type: ignore[arg-type]
    code = (
        "import redis, stateguard\n"
        "try:\n"
        "    stateguard.RedisLock(redis.Redis(), 'x', ttl=None)\n"
        "except stateguard.InvalidArgument:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('ttl=None was accepted under -O')\n"
    )
    subprocess.run([sys.executable, "-O", "-c", code], check=True, timeout=60)


def test_redis_lock_without_redis_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without redis-py installed, RedisLock raises ImportError naming the stateguard[redis] extra."""
    monkeypatch.setitem(sys.modules, "redis", None)
    monkeypatch.setitem(sys.modules, "redis.lock", None)
    with pytest.raises(ImportError, match=r"stateguard\[redis\]"):
        RedisLock(object(), "x", ttl=1)


def test_importing_stateguard_does_not_import_redis() -> None:
    """The package works without redis-py: importing it does not import redis."""
    code = "import sys, stateguard; assert 'redis' not in sys.modules, 'redis was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
