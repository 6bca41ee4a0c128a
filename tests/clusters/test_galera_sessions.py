"""stateguard on a Galera cluster under what applications do with their own sessions and nodes.

An application that sets ``wsrep_sync_wait`` itself, transactions that read or insert before
stateguard's first call, ORM objects loaded before a conflict and ``on_commit`` effects, odd
isolation levels and engine set-ups, the job-queue recipe with ``skip_locked``, a certification
failure at COMMIT, and a node killed (or frozen) and rejoining mid-storm, writers on every node.
The cluster (the package's, tests/clusters/conftest.py) and the tables are those of ``test_galera.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

import stateguard
from stateguard import NotSupported, advisory_lock, decrement, retry_on_conflict
from stateguard._kernel import classify_db_error

from .._support import galera
from .test_galera import (  # the module's cluster and tables (fixtures re-used, not re-defined)
    _TALLY_LOCK,
    TALLY,
    Account,
    Blocker,
    Effect,
    Order,
    Stock,
    _assert_paid_shipped_and_sold_once,
    _lagging,
    _pay_buy_ship_storm,
    _persist,
    _storm,
    cluster,
    engines,
    galera_tables,
)

__all__ = ["cluster", "engines", "galera_tables"]  # fixtures imported for pytest


def _synced_count(engine: Engine) -> int:
    with engine.connect() as conn:
        conn.exec_driver_sql("SET SESSION wsrep_sync_wait = 1")
        return int(conn.scalar(select(func.count()).select_from(Order)) or 0)


def test_stateguard_inspect_on_a_node_says_it_is_a_galera_node(cluster: galera.GaleraCluster) -> None:
    """`stateguard inspect --db <node>` (the CLI, not the helper) names the server a Galera node of 3."""
    from stateguard.tooling.cli import main

    for url in cluster.urls:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["inspect", "--db", url])
        assert code == 0, out.getvalue()
        assert "Galera cluster node, 3 nodes" in out.getvalue(), out.getvalue()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["inspect", "--db", url, "--json"])
        assert code == 0, out.getvalue()
        assert "Galera cluster node, 3 nodes, causal: wsrep_sync_wait raised to 7" in out.getvalue()


def _lower_the_wait_stateguard_raised(engines: list[Engine], one: Engine) -> int:
    """Orders 1 and 9 pending on every node (and the lag blocker); ``one`` (a pool of one connection
    to node 1) pays order 9, so stateguard raises its connection, then the application's own report
    query lowers the wait there (``SET SESSION wsrep_sync_wait = 0``).  The connection's id."""
    with Session(engines[0]) as s, s.begin():
        s.add(Blocker(id=1))
        s.add_all([Order(id=1), Order(id=9)])
    assert _synced_count(engines[1]) == 2
    with Session(one) as s, s.begin():
        assert Order.flow.pay(s, 9).applied  # stateguard raises this pooled connection
    with Session(one) as s, s.begin():
        s.execute(text("SET SESSION wsrep_sync_wait = 0"))
        s.execute(select(func.count()).select_from(Order)).scalar()
        return int(s.execute(text("SELECT CONNECTION_ID()")).scalar_one())


@pytest.mark.lag
def test_an_application_lowering_wsrep_sync_wait_on_a_connection_stateguard_raised_is_still_exact(
    cluster: galera.GaleraCluster, engines: list[Engine]
) -> None:
    """The app turns the wait off for its own fast reads (``SET SESSION wsrep_sync_wait = 0``) on a
    pooled connection stateguard raised earlier; stateguard's next call there must still wait and
    answer APPLIED on a lagging node, not REJECTED / NOT_FOUND."""
    one = create_engine(cluster.urls[1], pool_size=1, max_overflow=0)
    try:
        _lower_the_wait_stateguard_raised(engines, one)
        with _lagging(engines[1], engines[0]) as release:
            with Session(engines[0]) as s, s.begin():
                assert Order.flow.pay(s, 1).applied
                s.add(Order(id=2, status="paid"))
            timer = threading.Timer(0.5, release)
            timer.start()
            with Session(one) as s, s.begin():
                got = [Order.flow.ship(s, 1).outcome.name, Order.flow.ship(s, 2).outcome.name]
            timer.join()
        assert got == ["APPLIED", "APPLIED"], got
    finally:
        one.dispose()


@pytest.mark.restart
def test_a_dropped_pooled_connection_whose_wait_was_lowered_is_replaced_at_checkout(
    cluster: galera.GaleraCluster, engines: list[Engine]
) -> None:
    """The application lowered the wait on a pooled connection stateguard raised, then the server
    dropped that connection (KILL here; a node restart alike): the checkout that raises the wait
    again fails on it.  The pool must replace it, raised, and the next transaction run as usual:
    not an unwrapped driver error from inside the pool."""
    one = create_engine(cluster.urls[1], pool_size=1, max_overflow=0)
    try:
        dropped = _lower_the_wait_stateguard_raised(engines, one)
        with engines[1].connect() as conn:
            conn.exec_driver_sql(f"KILL {int(dropped)}")
        with Session(one) as s, s.begin():
            assert s.execute(text("SELECT CONNECTION_ID()")).scalar_one() != dropped
            assert s.execute(text("SELECT @@session.wsrep_sync_wait")).scalar_one() == 7
            assert Order.flow.pay(s, 1).applied
    finally:
        one.dispose()


def _paid_elsewhere_while_node_1_lags(engines: list[Engine]) -> Any:
    """Orders 1 and 3 pending everywhere; the context returned makes node 1 lag (it yields
    ``release``)."""
    with Session(engines[0]) as s, s.begin():
        s.add(Blocker(id=1))
        s.add_all([Order(id=1), Order(id=3)])
    assert _synced_count(engines[1]) == 2
    return _lagging(engines[1], engines[0])


def _pay_order_1(engines: list[Engine]) -> None:
    with Session(engines[0]) as s, s.begin():
        assert Order.flow.pay(s, 1).applied


@pytest.mark.lag
@pytest.mark.xfail(
    strict=True,
    reason="MariaDB's causal wait (wsrep_sync_wait) runs only for the first statement of a "
    "transaction (wsrep_sync_wait() skips in_active_multi_stmt_transaction()): on an engine "
    "stateguard has not used yet, the SET its first call sends comes after the application's own "
    "read began the transaction, so the guarded UPDATE does not wait, matches 0 rows on the lagging "
    "copy, and the REJECTED commits (nothing was written, nothing certified)",
)
def test_a_transaction_that_read_before_stateguards_first_call_on_a_lagging_node_is_exact(
    cluster: galera.GaleraCluster, engines: list[Engine]
) -> None:
    """The ORM's everyday shape, on a new engine's first connection to a lagging node: load the
    order, then ship it.  The cluster has it paid, so ship must answer APPLIED (after a wait)."""
    fresh = create_engine(cluster.urls[1], poolclass=NullPool)  # every connection a fresh one
    try:
        with _paid_elsewhere_while_node_1_lags(engines) as release:
            _pay_order_1(engines)
            timer = threading.Timer(0.5, release)
            timer.start()
            with Session(fresh) as s, s.begin():
                order = s.get_one(Order, 1)  # the application's own read begins the transaction
                got = Order.flow.ship(s, order).outcome.name
            timer.join()  # the COMMIT above succeeded: the answer is final
        assert got == "APPLIED", got
    finally:
        fresh.dispose()


@pytest.mark.lag
def test_a_read_first_transaction_on_a_new_connection_of_an_engine_stateguard_used_is_exact(
    cluster: galera.GaleraCluster, engines: list[Engine]
) -> None:
    """The same load-then-ship on a connection the pool has just opened (NullPool: every one new),
    once stateguard has run on the engine: the connection is raised at checkout, so the load that
    begins the transaction waits, and ship answers APPLIED."""
    fresh = create_engine(cluster.urls[1], poolclass=NullPool)
    try:
        lag = _paid_elsewhere_while_node_1_lags(engines)
        with Session(fresh) as s, s.begin():
            assert Order.flow.pay(s, 3).outcome.name == "APPLIED"  # the engine is known now
        with lag as release:
            _pay_order_1(engines)
            timer = threading.Timer(0.5, release)
            timer.start()
            with Session(fresh) as s, s.begin():
                order = s.get_one(Order, 1)  # a new connection: its first statement waits
                got = (order.status, Order.flow.ship(s, order).outcome.name)
            timer.join()
        assert got == ("paid", "APPLIED"), got
    finally:
        fresh.dispose()


@pytest.mark.lag
def test_the_documented_init_command_makes_a_read_first_transaction_exact(
    cluster: galera.GaleraCluster, engines: list[Engine]
) -> None:
    """With the docs' engine set-up (``init_command`` raising ``wsrep_sync_wait``), the load that
    begins the transaction on a fresh connection waits, and ship answers APPLIED."""
    fresh = create_engine(
        cluster.urls[1],
        poolclass=NullPool,
        connect_args={"init_command": "SET SESSION wsrep_sync_wait = 7"},
    )
    try:
        with _paid_elsewhere_while_node_1_lags(engines) as release:
            _pay_order_1(engines)
            timer = threading.Timer(0.5, release)
            timer.start()
            with Session(fresh) as s, s.begin():
                order = s.get_one(Order, 1)
                got = (order.status, Order.flow.ship(s, order).outcome.name)
            timer.join()
        assert got == ("paid", "APPLIED"), got
    finally:
        fresh.dispose()


@pytest.mark.lag
def test_a_loaded_object_on_a_raised_connection_waits_and_is_exact(
    cluster: galera.GaleraCluster, engines: list[Engine]
) -> None:
    """The same load-then-ship on a pooled connection stateguard raised earlier: the load, first in
    its transaction, waits for the node to catch up, and ship answers APPLIED."""
    one = create_engine(cluster.urls[1], pool_size=1, max_overflow=0)
    try:
        lag = _paid_elsewhere_while_node_1_lags(engines)
        with Session(one) as s, s.begin():
            assert Order.flow.pay(s, 3).outcome.name == "APPLIED"  # raises the one connection
        with lag as release:
            _pay_order_1(engines)
            timer = threading.Timer(0.5, release)
            timer.start()
            with Session(one) as s, s.begin():
                order = s.get_one(Order, 1)
                status_loaded = order.status
                got = Order.flow.ship(s, order).outcome.name
            timer.join()
        assert (status_loaded, got) == ("paid", "APPLIED"), (status_loaded, got)
    finally:
        one.dispose()


@pytest.mark.lag
@pytest.mark.xfail(
    strict=True,
    reason="MariaDB waits (wsrep_sync_wait) only at a transaction's first statement: a write the "
    "cluster commits elsewhere after that is not waited for by a later guarded UPDATE in the same "
    "transaction; on a lagging node the 0-row UPDATE reads the old copy and its REJECTED commits. "
    "The docs' 'The UPDATE itself has to wait until the node has applied everything the cluster "
    "committed before it started' holds per transaction, not per statement",
)
def test_a_guarded_write_late_in_a_transaction_waits_for_what_the_cluster_committed_meanwhile(
    cluster: galera.GaleraCluster, engines: list[Engine]
) -> None:
    """On a raised connection, a transaction begins (its first read waits, the node is in sync);
    then node 0 pays order 1 while node 1 lags; ship in the same transaction should wait and APPLY."""
    one = create_engine(cluster.urls[1], pool_size=1, max_overflow=0)
    try:
        with Session(engines[0]) as s, s.begin():
            s.add(Blocker(id=1))
            s.add_all([Order(id=1), Order(id=3)])
        with Session(one) as s, s.begin():
            assert Order.flow.pay(s, 3).outcome.name == "APPLIED"  # raises the one connection
        with Session(one) as s:
            s.begin()
            assert s.scalar(select(func.count()).select_from(Order)) == 2  # waits: node 1 in sync
            with _lagging(engines[1], engines[0]):
                _pay_order_1(engines)
                got = Order.flow.ship(s, 1).outcome.name
                # Committed before node 1 applies the pay (an applier that finds the follow-up
                # read's FOR UPDATE lock still held aborts this transaction instead: 1213).
                s.commit()
        assert got == "APPLIED", got
    finally:
        one.dispose()


def test_a_loser_that_loaded_the_object_and_scheduled_on_commit_runs_the_effect_once(
    engines: list[Engine],
) -> None:
    """Two nodes pay the same loaded order at once, each scheduling an e-mail with on_commit; one
    COMMIT fails (DeadlockDetected); the loser's retry, in the same Session with the same object,
    is REPEATED: one e-mail in all, and the loser's object shows the committed state."""
    with Session(engines[0]) as s, s.begin():
        s.add(Order(id=1))
    assert _synced_count(engines[1]) == 1
    barrier = threading.Barrier(2)
    sent: list[int] = []
    failures: list[type[BaseException] | None] = []
    seen: dict[int, tuple[str, str]] = {}

    def node(n: int) -> None:
        with Session(engines[n]) as s:
            order = s.get_one(Order, 1)  # loaded before the race, outside the unit
            s.commit()
            attempts = itertools.count()

            def unit() -> str:
                with s.begin():
                    r = Order.flow.pay(s, order)
                    r.on_commit(sent.append, n)
                    if next(attempts) == 0:
                        barrier.wait()
                    return r.outcome.name

            def recorded() -> str:
                try:
                    return unit()
                except sa_exc.OperationalError as exc:
                    failures.append(classify_db_error(exc))
                    raise

            outcome = retry_on_conflict(recorded)
            seen[n] = (outcome, order.status)

    threads = [threading.Thread(target=node, args=(n,)) for n in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert failures == [stateguard.DeadlockDetected], failures
    assert sorted(seen.values()) == [("APPLIED", "paid"), ("REPEATED", "paid")], seen
    assert len(sent) == 1, sent


def test_advisory_lock_is_refused_however_the_session_reaches_the_node(
    cluster: galera.GaleraCluster,
) -> None:
    """A Session bound to a Connection already in a transaction, an AUTOCOMMIT engine, a NullPool
    engine, an engine made with execution_options, an AsyncSession: each refuses, holding nothing."""
    url = cluster.urls[2]
    made: list[Engine] = [
        create_engine(url, isolation_level="AUTOCOMMIT"),
        create_engine(url, poolclass=NullPool),
        create_engine(url).execution_options(isolation_level="READ COMMITTED"),  # type: ignore[list-item]
    ]
    try:
        for eng in made:
            with Session(eng) as s:
                with pytest.raises(NotSupported):
                    with advisory_lock(s, "galrev:a"):
                        pytest.fail("the block must not run")
                assert s.execute(text("SELECT IS_USED_LOCK('galrev:a')")).scalar() is None
        plain = create_engine(url)
        try:
            with plain.connect() as conn:
                conn.begin()
                conn.exec_driver_sql("SELECT 1")
                with Session(bind=conn) as s:
                    with pytest.raises(NotSupported):
                        with advisory_lock(s, "galrev:b"):
                            pytest.fail("the block must not run")
                assert conn.exec_driver_sql("SELECT IS_USED_LOCK('galrev:b')").scalar() is None
        finally:
            plain.dispose()
    finally:
        for eng in made:
            eng.dispose()

    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    async def via_async() -> Any:
        aeng = create_async_engine(url.replace("pymysql", "aiomysql"))
        try:
            async with AsyncSession(aeng) as s:
                with pytest.raises(NotSupported):
                    async with advisory_lock(s, "galrev:c"):
                        pytest.fail("the block must not run")
                return (await s.execute(text("SELECT IS_USED_LOCK('galrev:c')"))).scalar()
        finally:
            await aeng.dispose()

    assert asyncio.run(via_async()) is None


@pytest.mark.parametrize("isolation", ["AUTOCOMMIT", "READ COMMITTED", "SERIALIZABLE"])
def test_odd_isolation_levels_on_three_nodes_apply_each_transition_and_unit_once(
    cluster: galera.GaleraCluster, engines: list[Engine], isolation: str
) -> None:
    """6 writers on 3 nodes, engines at an unusual isolation level, race on orders and stock with a
    ref: each transition applied once, stock never oversold, every outcome a documented one."""
    orders, stock = 8, 6
    with Session(engines[0]) as s, s.begin():
        s.add_all([Order(id=i) for i in range(1, orders + 1)])
        s.add(Stock(id=1, amount=stock))
    odd = [create_engine(url, isolation_level=isolation, pool_size=4) for url in cluster.urls]
    outcomes: Counter[str] = Counter()

    def unit_for(kind: str, key: int) -> Callable[[Engine], None]:
        def unit(engine: Engine) -> None:
            with Session(engine) as s:
                if kind == "buy":
                    r = decrement(s, Stock.amount, 1, by=1, ref=f"iso{key}")
                else:
                    r = getattr(Order.flow, kind)(s, key)
                if r.applied:
                    s.add(Effect(kind=kind, item=str(key)))
                s.commit()
                name = r.outcome.name
                if name == "REJECTED":  # pay of an order already shipped: the only legal REJECTED
                    assert (kind, r.state) == ("pay", "shipped"), r
                with _TALLY_LOCK:
                    outcomes[name] += 1

        return unit

    def work(i: int) -> None:
        keys = list(range(1, orders + 1))
        random.Random(i).shuffle(keys)
        for k in keys:
            for kind in ("pay", "buy", "ship"):
                _persist(odd, i % 3, unit_for(kind, k))

    try:
        TALLY.clear()
        errors = _storm(6, work)
        assert errors == [], errors
    finally:
        for eng in odd:
            eng.dispose()
    with Session(engines[0]) as s:
        s.execute(text("SET SESSION wsrep_sync_wait = 1"))
        effects = Counter((kind, item) for kind, item in s.execute(select(Effect.kind, Effect.item)))
        left = s.scalar(select(Stock.amount))
        unshipped = s.scalar(select(func.count()).select_from(Order).where(Order.status != "shipped"))
    assert set(effects.values()) == {1}, [k for k, v in effects.items() if v > 1]
    assert sum(1 for e in effects if e[0] == "pay") == orders
    assert sum(1 for e in effects if e[0] == "ship") == orders
    assert sum(1 for e in effects if e[0] == "buy") == stock and left == 0
    assert unshipped == 0
    assert set(outcomes) <= {"APPLIED", "REPEATED", "REJECTED", "INSUFFICIENT"}, outcomes


@pytest.mark.restart
def test_a_node_killed_and_rejoining_while_writers_storm_stays_exact(
    cluster: galera.GaleraCluster, engines: list[Engine]
) -> None:
    """Node 1 is SIGKILLed mid-storm and restarted while the storm goes on; its writers move away and
    back; version-checked increments and transitions apply once each, on every node afterwards."""
    orders = 12
    with Session(engines[0]) as s, s.begin():
        s.add(Account(id=1, balance=0))
        s.add_all([Order(id=i) for i in range(1, orders + 1)])
    done = itertools.count()
    per_worker = 12

    def add_one(tag: str) -> Callable[[Engine], None]:
        def unit(engine: Engine) -> None:
            while True:
                with Session(engine) as s, s.begin():
                    balance, version = s.execute(select(Account.balance, Account.version)).one()
                    r = stateguard.guarded_update(
                        s, Account, 1, {"balance": balance + 1}, expected_version=version
                    )
                    if r.applied:
                        s.add(Effect(kind="add", item=tag))
                        break
                    assert r.outcome.name == "STALE", r
            next(done)

        return unit

    def fire(kind: str, key: int) -> Callable[[Engine], None]:
        def unit(engine: Engine) -> None:
            with Session(engine) as s, s.begin():
                r = getattr(Order.flow, kind)(s, key)
                legal = ("APPLIED", "REPEATED") if kind == "ship" else ("APPLIED", "REPEATED", "REJECTED")
                assert r.outcome.name in legal and (r.outcome.name != "REJECTED" or r.state == "shipped"), r
                if r.applied:
                    s.add(Effect(kind=kind, item=str(key)))

        return unit

    def work(i: int) -> None:
        keys = list(range(1, orders + 1))
        random.Random(7 + i).shuffle(keys)
        for n in range(per_worker):
            _persist(engines, i % 3, add_one(f"{i}-{n}"))
            k = keys[n % orders]
            _persist(engines, i % 3, fire("pay", k))
            _persist(engines, i % 3, fire("ship", k))
        for k in keys:
            _persist(engines, i % 3, fire("pay", k))
            _persist(engines, i % 3, fire("ship", k))

    problems: list[BaseException] = []

    def killer() -> None:
        try:
            deadline = time.monotonic() + 60
            while next(done) < 20 and time.monotonic() < deadline:
                time.sleep(0.01)
            cluster.kill(1, signal.SIGKILL)
            time.sleep(1.0)
            cluster.restart(1)  # rejoins (IST) while the others keep writing
        except BaseException as exc:
            problems.append(exc)

    TALLY.clear()
    k = threading.Thread(target=killer)
    k.start()
    errors = _storm(6, work)
    k.join(timeout=180)
    assert errors == [] and problems == [], (errors, problems)
    assert TALLY["moved"] > 0, "no writer lost its node"
    for eng in engines:
        eng.dispose()
        with Session(eng) as s:
            s.execute(text("SET SESSION wsrep_sync_wait = 1"))
            effects = Counter((kind, item) for kind, item in s.execute(select(Effect.kind, Effect.item)))
            balance = s.scalar(select(Account.balance))
        assert set(effects.values()) == {1}, [k for k, v in effects.items() if v > 1]
        assert balance == 6 * per_worker == sum(1 for e in effects if e[0] == "add")
        assert sum(1 for e in effects if e[0] == "pay") == orders
        assert sum(1 for e in effects if e[0] == "ship") == orders


def test_the_skip_locked_job_queue_recipe_hands_one_job_to_a_worker_on_each_node(
    engines: list[Engine],
) -> None:
    """row_lock(skip_locked=True), the docs' job queue: a worker on node 0 and one on node 1 both get
    job 1 (the lock is node-local); both mark it done and one COMMIT fails with DeadlockDetected,
    so a job is done once only if its worker writes the job row and has no outside effect first."""
    with Session(engines[0]) as s, s.begin():
        s.add(Account(id=1, balance=0))
    with engines[1].connect() as conn:
        conn.exec_driver_sql("SET SESSION wsrep_sync_wait = 1")
        assert conn.scalar(select(func.count()).select_from(Account)) == 1
    with Session(engines[0]) as a, Session(engines[1]) as b:
        a.begin()
        b.begin()
        got_a = stateguard.row_lock(a, Account, [1], skip_locked=True)
        got_b = stateguard.row_lock(b, Account, [1], skip_locked=True)
        assert [r.id for r in got_a] == [r.id for r in got_b] == [1]  # both "own" the job
        got_a[0].balance += 1
        got_b[0].balance += 1
        a.commit()
        with pytest.raises(sa_exc.OperationalError) as lost:
            b.commit()
        assert classify_db_error(lost.value) is stateguard.DeadlockDetected
        b.rollback()


@pytest.mark.lag
def test_a_transaction_that_begins_with_an_insert_then_a_guarded_write_on_a_lagging_node(
    cluster: galera.GaleraCluster, engines: list[Engine]
) -> None:
    """On a raised connection, the transaction's first statement is the application's INSERT (an
    audit row, flushed by stateguard's call itself): INSERTs do not wait (bit 4), so the guarded
    UPDATE after it runs on the lagging copy; the unit, retried as the docs say, must still end
    with the order shipped once and its answer APPLIED (a wrong REJECTED may not commit)."""
    one = create_engine(cluster.urls[1], pool_size=1, max_overflow=0)
    answers: list[str] = []
    commits: list[object] = []
    try:
        lag = _paid_elsewhere_while_node_1_lags(engines)
        with Session(one) as s, s.begin():
            assert Order.flow.pay(s, 3).outcome.name == "APPLIED"  # raises the one connection
        with lag as release:
            _pay_order_1(engines)
            timer = threading.Timer(0.5, release)
            timer.start()

            def unit() -> None:
                with Session(one) as s:
                    s.begin()
                    s.add(Effect(kind="audit", item="ship-1"))  # flushed first: the first statement
                    answers.append(Order.flow.ship(s, 1).outcome.name)
                    try:
                        s.commit()
                    except sa_exc.OperationalError as exc:
                        commits.append(classify_db_error(exc))
                        raise
                    commits.append("committed")

            retry_on_conflict(unit)
            timer.join()
        assert answers[-1] == "APPLIED", (answers, commits)
        assert commits[-1] == "committed", commits
    finally:
        one.dispose()


@pytest.mark.lag
def test_an_async_application_lowering_wsrep_sync_wait_is_noticed_too(
    cluster: galera.GaleraCluster, engines: list[Engine]
) -> None:
    """The same as the sync case through an AsyncSession (aiomysql): the application's SET of 0 on a
    raised connection is seen, the next guarded call raises it again, waits, and answers APPLIED."""
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    with Session(engines[0]) as s, s.begin():
        s.add(Blocker(id=1))
        s.add_all([Order(id=1), Order(id=9)])
    assert _synced_count(engines[1]) == 2

    async def scenario() -> list[str]:
        one = create_async_engine(cluster.urls[1].replace("pymysql", "aiomysql"), pool_size=1, max_overflow=0)
        try:
            async with AsyncSession(one) as s, s.begin():
                assert (await Order.flow.pay(s, 9)).applied
            async with AsyncSession(one) as s, s.begin():
                await s.execute(text("SET SESSION wsrep_sync_wait = 0"))
            lag = _lagging(engines[1], engines[0])
            with lag as release:
                _pay_order_1(engines)
                loop = asyncio.get_running_loop()
                loop.call_later(0.5, release)
                async with AsyncSession(one) as s, s.begin():
                    got = [(await Order.flow.ship(s, 1)).outcome.name]
                    got.append(str((await s.execute(text("SELECT @@session.wsrep_sync_wait"))).scalar()))
            return got
        finally:
            await one.dispose()

    assert asyncio.run(scenario()) == ["APPLIED", "7"]


@pytest.mark.restart
def test_a_node_frozen_mid_storm_and_resumed_loses_and_doubles_nothing(
    cluster: galera.GaleraCluster, engines: list[Engine]
) -> None:
    """Node 2 is SIGSTOPped mid-storm (the others evict it) and resumed 8 s later (it rejoins):
    writers stuck on it carry on wherever they can; each transition and each ref applies once."""
    orders, stock = 10, 8
    done = itertools.count()
    work = _pay_buy_ship_storm(engines, orders, stock, ref="fz", seed=300, done=done)
    problems: list[BaseException] = []

    def freezer() -> None:
        try:
            deadline = time.monotonic() + 60
            while next(done) < 20 and time.monotonic() < deadline:
                time.sleep(0.01)
            cluster.kill(2, signal.SIGSTOP)
            time.sleep(8.0)
            cluster.kill(2, signal.SIGCONT)
        except BaseException as exc:
            problems.append(exc)

    TALLY.clear()
    f = threading.Thread(target=freezer)
    f.start()
    errors = _storm(6, work)
    f.join(timeout=120)
    assert errors == [] and problems == [], (errors, problems)
    assert TALLY["moved"] > 0, f"no writer was stuck on the frozen node ({TALLY})"
    cluster._wait_ready(cluster.nodes[2], size=3)
    for eng in engines:
        eng.dispose()
        _assert_paid_shipped_and_sold_once(eng, orders, stock)


def test_a_certification_failure_at_commit_is_the_drivers_1213_which_retry_on_conflict_retries(
    engines: list[Engine],
) -> None:
    """The loser's COMMIT raises SQLAlchemy's OperationalError (1213), not stateguard.DeadlockDetected
    (stateguard does not wrap COMMIT); retry_on_conflict retries it, and once out of attempts
    re-raises it as it came, as the retries page says."""
    with Session(engines[0]) as s, s.begin():
        s.add(Order(id=1))
    assert _synced_count(engines[1]) == 1

    with Session(engines[0]) as a, Session(engines[1]) as b:
        a.begin()
        b.begin()
        assert Order.flow.pay(a, 1).applied
        assert Order.flow.pay(b, 1).applied  # node 1's copy still allows it
        a.commit()
        with pytest.raises(sa_exc.OperationalError) as caught:
            retry_on_conflict(b.commit, attempts=1)  # out of attempts at once: raised as it came
        b.rollback()
    lost = caught.value
    assert not isinstance(lost, stateguard.DeadlockDetected)
    assert lost.orig is not None and lost.orig.args[0] == 1213
    assert classify_db_error(lost) is stateguard.DeadlockDetected


def test_a_transaction_brute_force_aborted_mid_savepoint_is_retried_as_a_conflict(
    engines: list[Engine],
) -> None:
    """Node 1's transaction pays order 1 inside the caller's begin_nested() and holds the row; node 0
    commits a write to that row, and node 1's applier aborts the local transaction (a BF abort): the
    next guarded call there fails, leaving the savepoint fails too, and retry_on_conflict reruns the
    unit, which then answers REPEATED (the pay is node 0's)."""
    with Session(engines[0]) as s, s.begin():
        s.add_all([Order(id=1), Order(id=2)])
    assert _synced_count(engines[1]) == 2
    holding = threading.Event()
    written = threading.Event()
    answers: list[list[str]] = []
    raised: list[str] = []

    def unit() -> None:
        with Session(engines[1]) as s, s.begin():
            with s.begin_nested():
                got = [Order.flow.pay(s, 1).outcome.name]
                if not holding.is_set():
                    holding.set()
                    assert written.wait(30)
                    time.sleep(0.5)  # node 1 applies node 0's write: it aborts this transaction
                try:
                    got.append(Order.flow.pay(s, 2).outcome.name)
                except Exception as exc:
                    raised.append(type(exc).__name__)
                    raise
            answers.append(got)

    def other() -> None:
        assert holding.wait(30)
        with Session(engines[0]) as s, s.begin():
            assert Order.flow.pay(s, 1).applied
        written.set()

    t = threading.Thread(target=other)
    t.start()
    retry_on_conflict(unit)
    t.join(timeout=60)
    assert raised, "the local transaction was not aborted"
    assert answers == [["REPEATED", "APPLIED"]], (answers, raised)
