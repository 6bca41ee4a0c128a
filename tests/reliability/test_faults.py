"""Faults injected into real servers while 8 separate processes storm the same rows.

SIGKILLed workers (at a chosen point of a transaction, and at a random moment), connections cut
from the server side (``pg_terminate_backend``, MariaDB ``KILL CONNECTION``) and a PostgreSQL
restart.  Afterwards the survivors have done all the work and the invariants hold exactly:
each transition applied once, no oversell, every ref at most once, and nothing half-written
(every APPLIED change has its side effect row and every side effect row its change).
"""

from __future__ import annotations

import os
import random
import shlex
import shutil
import subprocess
import time

import pytest
from sqlalchemy import create_engine, func, select, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from stateguard.tables import counter_ledger
from tests._support import workers as w
from tests._support.models import Order
from tests._support.processes import worker_context
from tests.conftest import IN_CI, Backend, backends_with
from tests.reliability._storm import (
    COUNTERS,
    TRANSITIONS,
    Control,
    Held,
    Hold,
    Setup,
    Sizes,
    at_effects,
    check_counters,
    check_transitions,
    cut_connections,
    prepare,
    ref_number,
    run_storm,
    wait_for,
)

# --------------------------------------------------------------------------
# SIGKILL
# --------------------------------------------------------------------------


def effects_of(setup: Setup, held: Held) -> list[str]:
    """The workers that own a committed side effect of the held item."""
    order_id = held.key if held.kind == TRANSITIONS else ref_number(held.key)
    with Session(setup.engine) as s:
        rows = s.execute(
            select(w.Effect.worker).where(w.Effect.order_id == order_id, w.Effect.what == held.what)
        ).scalars()
        return list(rows)


def committed_change(setup: Setup, held: Held) -> bool:
    """Whether the held change is visible to another connection, i.e. committed."""
    with Session(setup.engine) as s:
        if held.kind == TRANSITIONS:
            version = s.execute(select(Order.version).where(Order.id == held.key)).scalar_one()
            assert held.version is not None
            return bool(version >= held.version)
        found = s.execute(
            select(func.count()).select_from(counter_ledger).where(counter_ledger.c.ref == held.key)
        ).scalar_one()
        return bool(found)


#: Worker number -> what it starts with and where the test SIGKILLs it.
KILLS = {
    0: (TRANSITIONS, "after_statement"),
    1: (COUNTERS, "after_effect"),
    2: (TRANSITIONS, "after_commit"),
}


def test_sigkilled_workers_roll_back_and_the_others_finish(backend: Backend, sizes: Sizes) -> None:
    """Workers SIGKILLed after their guarded UPDATE, after their side effect and after COMMIT, and
    one at a random moment: uncommitted work vanishes, committed work stays, the rest finish."""
    setup = prepare(backend, sizes)
    items = {TRANSITIONS: iter(setup.keys[:2]), COUNTERS: iter(setup.spare_refs)}
    holds = {i: Hold(kind, next(items[kind]), phase) for i, (kind, phase) in KILLS.items()}
    killed: list[Held] = []
    rnd = random.Random(9)

    def during(ctl: Control) -> None:
        for _ in holds:
            held = ctl.next_held()
            # The victim is frozen inside (or just after) its transaction: what others see of it.
            committed = held.phase == "after_commit"
            assert committed_change(setup, held) is committed, held
            assert effects_of(setup, held) == ([held.worker] if committed else []), held
            ctl.kill(held.worker)
            killed.append(held)
        ctl.free_targets()
        # One more, wherever it is: waiting for a lock, inside a transaction, inside COMMIT.
        victim = rnd.choice(sorted(set(ctl.procs) - ctl.killed))
        at_effects(setup.engine, [len(setup.keys)], lambda: ctl.kill(victim))

    storm = run_storm(setup.specs(holds=holds), during=during, timeout=sizes.timeout)
    assert len(storm.killed) == 4 and len(storm.reports) == 4
    check_transitions(setup.engine, storm, setup.keys, exact=True)
    check_counters(setup.engine, storm, setup.stock, setup.plan, exact=True)
    for held in killed:
        owners = effects_of(setup, held)
        assert len(owners) == 1, (held, owners)
        if held.phase == "after_commit":
            assert owners == [held.worker], held  # committed before the kill: kept
        else:
            assert owners != [held.worker], held  # rolled back by the kill: someone else applied it
    assert storm.untyped_conflicts() == {}, storm.messages()
    storm.check_no_savepoint_regression()


# --------------------------------------------------------------------------
# Connections cut from the server side
# --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", backends_with("tcp_server"), indirect=True)
def test_cut_connections_surface_dbapi_errors_and_retries_finish(backend: Backend, sizes: Sizes) -> None:
    """Connections cut mid-transaction raise a DBAPI error out of stateguard or COMMIT; the workers
    reconnect and run the unit again, and every invariant holds."""
    setup = prepare(backend, sizes)
    holds = {
        0: Hold(TRANSITIONS, setup.keys[0], "before_statement"),
        1: Hold(COUNTERS, setup.spare_refs[0], "after_effect"),
    }
    cuts: list[int] = []

    def during(ctl: Control) -> None:
        for _ in holds:
            held = ctl.next_held()
            assert held.conn_id is not None
            assert cut_connections(backend, [held.conn_id]) == 1, held
            ctl.release(held.worker)
        ctl.free_targets()
        total = len(setup.keys) * 2
        everyone = lambda: cut_connections(  # noqa: E731
            backend, [c for ids in ctl.connections().values() for c in ids]
        )
        cuts.extend(at_effects(setup.engine, [total // 4, total // 2, total * 3 // 4], everyone))

    storm = run_storm(setup.specs(holds=holds), during=during, timeout=sizes.timeout)
    lost = {k: n for k, n in storm.raised().items() if "(connection lost)" in k}
    # The one cut before its guarded statement: stateguard let the driver's error through as is.
    assert any(k.startswith("stateguard ") for k in storm.report("p0").stats.raised if "lost" in k), lost
    # The one cut after its side effect was flushed: COMMIT failed, nothing of it stayed.
    assert any(k.startswith("unit ") for k in storm.report("p1").stats.raised if "lost" in k), lost
    assert min(cuts) >= 1, cuts  # every storm-wide cut caught live connections
    # Two from the held workers, and the storm-wide cuts caught someone inside a transaction.
    assert storm.total("reconnects") >= 3, (storm.total("reconnects"), lost)
    check_transitions(setup.engine, storm, setup.keys, exact=False)
    check_counters(setup.engine, storm, setup.stock, setup.plan, exact=False)
    assert storm.untyped_conflicts() == {}, storm.messages()
    storm.check_no_savepoint_regression()


# --------------------------------------------------------------------------
# PostgreSQL restart
# --------------------------------------------------------------------------

#: Set to "1" to let the restart test run outside CI (it restarts the server under everyone's feet).
ALLOW_RESTART_ENV = "STATEGUARD_ALLOW_PG_RESTART"
#: A command that restarts the server, when pg_ctlcluster cannot be used (e.g. "docker restart pg").
RESTART_CMD_ENV = "STATEGUARD_PG_RESTART_CMD"


def cluster_commands(url: str) -> tuple[list[str], list[str] | None]:
    """(restart, start) commands for the PostgreSQL server at ``url``.

    ``STATEGUARD_PG_RESTART_CMD`` if set; otherwise the local Debian cluster
    listening on the URL's port, found with ``pg_lsclusters``.
    """
    if os.environ.get(RESTART_CMD_ENV):
        return shlex.split(os.environ[RESTART_CMD_ENV]), None
    parsed = make_url(url)
    if parsed.host not in (None, "localhost", "127.0.0.1", "::1"):
        pytest.fail(f"{parsed.host} is not local: set {RESTART_CMD_ENV} to restart it", pytrace=False)
    if shutil.which("pg_lsclusters") is None or shutil.which("pg_ctlcluster") is None:
        pytest.fail(f"no pg_lsclusters/pg_ctlcluster here: set {RESTART_CMD_ENV}", pytrace=False)
    out = subprocess.run(["pg_lsclusters", "--no-header"], capture_output=True, text=True, check=True).stdout
    port = str(parsed.port or 5432)
    found = [line.split()[:2] for line in out.splitlines() if line.split()[2:3] == [port]]
    if len(found) != 1:
        pytest.fail(f"no single local cluster on port {port} ({out!r}): set {RESTART_CMD_ENV}", pytrace=False)
    [(version, cluster)] = found
    base = ["pg_ctlcluster", "--skip-systemctl-redirect", version, cluster]
    return [*base, "restart"], [*base, "start"]


def server_up(url: str) -> bool:
    engine = create_engine(url, poolclass=NullPool, connect_args={"connect_timeout": 2})
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        return True
    except sa_exc.DBAPIError:
        return False
    finally:
        engine.dispose()


def test_postgresql_restart_mid_storm_loses_nothing(pg: Backend, sizes: Sizes) -> None:
    """PostgreSQL restarted while 8 processes storm it: the workers reconnect, run their cut-off
    units again, and every invariant holds."""
    if not (IN_CI or os.environ.get(ALLOW_RESTART_ENV) == "1"):
        pytest.skip(
            f"restarts the PostgreSQL server under everyone using it: set CI=true or {ALLOW_RESTART_ENV}=1"
        )
    restart, start = cluster_commands(pg.url)
    setup = prepare(pg, sizes)
    restarted: list[float] = []

    def restart_server() -> None:
        began = time.monotonic()
        subprocess.run(restart, check=True, capture_output=True, timeout=120)
        wait_for(lambda: server_up(pg.url), "PostgreSQL to accept connections again", timeout=120)
        pg.engine.dispose()  # the test's pooled connections died with the server
        restarted.append(time.monotonic() - began)

    def during(ctl: Control) -> None:
        at_effects(setup.engine, [len(setup.keys)], restart_server)

    try:
        storm = run_storm(setup.specs(), during=during, timeout=sizes.timeout)
    finally:
        # Whatever happened, leave the server running for whatever comes next.
        if not server_up(pg.url) and start is not None:
            subprocess.run(start, capture_output=True, timeout=120)
        wait_for(lambda: server_up(pg.url), "PostgreSQL to be back up", timeout=120)
        pg.engine.dispose()
    assert len(restarted) == 1
    lost = {k: n for k, n in storm.raised().items() if "(connection lost)" in k}
    assert lost and storm.total("reconnects") >= 1, storm.raised()
    check_transitions(setup.engine, storm, setup.keys, exact=False)
    check_counters(setup.engine, storm, setup.stock, setup.plan, exact=False)
    assert storm.untyped_conflicts() == {}, storm.messages()
    storm.check_no_savepoint_regression()


def test_postgresql_restart_mid_striped_storm_sells_each_ref_once(pg: Backend) -> None:
    """PostgreSQL restarted while 8 processes take stock from one striped item with refs (a fifth
    of them redelivered to another process): every ref is taken at most once (a retry whose
    COMMIT reply died with the server answers REPEATED with same_request), the ledger holds
    exactly the refs taken, and the stripes hold the stock minus what they took."""
    if not (IN_CI or os.environ.get(ALLOW_RESTART_ENV) == "1"):
        pytest.skip(
            f"restarts the PostgreSQL server under everyone using it: set CI=true or {ALLOW_RESTART_ENV}=1"
        )
    from collections import Counter
    from concurrent.futures import ProcessPoolExecutor

    from stateguard import create_tables, drop_tables
    from tests._support import striped_workers as sw

    restart, start = cluster_commands(pg.url)
    drop_tables(pg.engine)
    create_tables(pg.engine)
    stock = 600
    with Session(pg.engine) as s, s.begin():
        sw.COUNTER.create(s, sw.ITEM, amount=stock)
    rng = random.Random(15)
    purchases = [(f"r{i}", rng.randint(1, 3)) for i in range(480)]
    plans: list[list[tuple[str, int]]] = [[] for _ in range(8)]
    for i, p in enumerate(purchases):
        plans[i % 8].append(p)
        if rng.random() < 0.2:
            plans[(i + rng.randint(1, 7)) % 8].append(p)

    def taken() -> int:
        try:
            with pg.engine.connect() as conn:
                return int(conn.execute(select(func.count()).select_from(counter_ledger)).scalar_one())
        except sa_exc.DBAPIError:
            return 0

    ctx = worker_context()
    try:
        with ctx.Manager() as manager, ProcessPoolExecutor(8, mp_context=ctx) as pool:
            barrier = manager.Barrier(8)
            futures = [pool.submit(sw.restart_buyer, pg.name, pg.url, i, plans[i], barrier) for i in range(8)]
            wait_for(lambda: taken() >= 40, "the storm to take stock", timeout=120)
            subprocess.run(restart, check=True, capture_output=True, timeout=120)
            wait_for(lambda: server_up(pg.url), "PostgreSQL to accept connections again", timeout=120)
            pg.engine.dispose()
            reports = [f.result(timeout=600) for f in futures]
    finally:
        if not server_up(pg.url) and start is not None:
            subprocess.run(start, capture_output=True, timeout=120)
        wait_for(lambda: server_up(pg.url), "PostgreSQL to be back up", timeout=120)
        pg.engine.dispose()
    applied: Counter[str] = Counter()
    answered_taken: set[str] = set()
    qty_of = dict(purchases)
    for report in reports:
        for ref, _qty, outcome, _same in report["outcomes"]:
            if outcome == "APPLIED":
                applied[ref] += 1
            if outcome in ("APPLIED", "REPEATED"):
                answered_taken.add(ref)
    assert sum(r["counts"].get("reconnects", 0) for r in reports) >= 1, "the restart cut nobody off"
    with Session(pg.engine) as s:
        ledger = {
            ref: int(delta)
            for ref, delta in s.execute(
                select(counter_ledger.c.ref, counter_ledger.c.delta).where(
                    counter_ledger.c.column_name == sw.COUNTER.name
                )
            ).all()
        }
        left = sw.COUNTER.total(s, sw.ITEM)
        amounts = sw.COUNTER.stripe_amounts(s, sw.ITEM)
    # Each ref taken at most once; every ref some process was told is taken (APPLIED, or REPEATED:
    # a redelivery, or a retry whose first COMMIT's reply died with the server) is in the ledger.
    assert max(applied.values()) == 1, applied.most_common(3)
    assert answered_taken == set(ledger)
    assert all(ledger[ref] == -qty_of[ref] for ref in ledger)
    assert left == stock + sum(ledger.values()) and min(amounts) >= 0
    drop_tables(pg.engine)


@pytest.mark.parametrize("mode", ["same_transaction", "separate"])
def test_postgresql_restart_mid_idempotency_storm_runs_each_key_once(pg: Backend, mode: str) -> None:
    """PostgreSQL restarted while 8 processes send the same 60 idempotency keys: claims, blocks and
    COMMITs cut off by the restart are sent again with the same key, and each key ends with exactly
    one committed payment, a completed record, and every caller told the one committed response
    (a retry whose first COMMIT's reply died with the server replays it; in separate mode a claim
    whose owner lost its connection is taken over after its lease)."""
    if not (IN_CI or os.environ.get(ALLOW_RESTART_ENV) == "1"):
        pytest.skip(
            f"restarts the PostgreSQL server under everyone using it: set CI=true or {ALLOW_RESTART_ENV}=1"
        )
    from collections import Counter
    from concurrent.futures import ProcessPoolExecutor

    from stateguard import create_tables, drop_tables
    from stateguard.tables import idempotency_keys
    from tests._support.idem_workers import metadata, payments
    from tests.reliability import _idem_storm

    restart, start = cluster_commands(pg.url)
    engine = pg.create(metadata)
    drop_tables(engine)
    create_tables(engine)
    keys = [f"restart-{i:03d}" for i in range(60)]

    def paid() -> int:
        try:
            with engine.connect() as conn:
                return int(conn.execute(select(func.count()).select_from(payments)).scalar_one())
        except sa_exc.DBAPIError:
            return 0

    ctx = worker_context()
    try:
        with ctx.Manager() as manager, ProcessPoolExecutor(8, mp_context=ctx) as pool:
            barrier = manager.Barrier(8)
            futures = [
                pool.submit(_idem_storm.restart_worker, pg.name, pg.url, keys, seed, mode, 2.0, barrier)
                for seed in range(8)
            ]
            wait_for(lambda: paid() >= 15, "the storm to complete keys", timeout=120)
            subprocess.run(restart, check=True, capture_output=True, timeout=120)
            wait_for(lambda: server_up(pg.url), "PostgreSQL to accept connections again", timeout=120)
            engine.dispose()
            reports = [f.result(timeout=600) for f in futures]
    finally:
        if not server_up(pg.url) and start is not None:
            subprocess.run(start, capture_output=True, timeout=120)
        wait_for(lambda: server_up(pg.url), "PostgreSQL to be back up", timeout=120)
        engine.dispose()
    with engine.connect() as conn:
        rows = conn.execute(select(payments.c.idem_key, payments.c.worker)).all()
        records = conn.execute(
            select(idempotency_keys.c.idem_key, idempotency_keys.c.status, idempotency_keys.c.response).where(
                idempotency_keys.c.scope == _idem_storm.SCOPE
            )
        ).all()
    drop_tables(engine)
    assert sum(r["counts"].get("reconnects", 0) for r in reports) >= 1, "the restart cut nobody off"
    # Exactly one committed execution per key, and the record completed with its response.
    assert Counter(k for k, _ in rows) == Counter(keys), Counter(k for k, _ in rows).most_common(3)
    payer = dict(rows)
    assert sorted(k for k, _, _ in records) == keys
    for key, status, response in records:
        assert status == "completed" and response == f'{{"worker":"{payer[key]}"}}', (key, status, response)
    # Every process got an answer for every key, and it names the one committed execution.
    for report in reports:
        assert sorted(k for k, _ in report["answers"]) == keys
        assert all(worker == payer[key] for key, worker in report["answers"]), report["answers"]
