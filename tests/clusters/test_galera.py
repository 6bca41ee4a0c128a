"""stateguard on a 3-node MariaDB Galera cluster started by the tests, writers spread over every node.

On Galera a write is certified cluster-wide only at COMMIT: the same conditional UPDATE (or the
same primary key) on two nodes succeeds on both, and one COMMIT fails with 1213, which stateguard
classifies as the retryable DeadlockDetected.  The storms here retry exactly what the docs say is
retryable (``retry_on_conflict``) and move to another node when theirs is gone, and check that
nothing was applied twice, oversold or lost.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from sqlalchemy import Engine, Integer, String, Table, create_engine, event, func, select, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import stateguard
from stateguard import (
    DeadlockDetected,
    NotSupported,
    RequestInProgress,
    StateMachine,
    advisory_lock,
    create_tables,
    decrement,
    idempotent,
    insert_once,
    retry_on_conflict,
    version_column,
)
from stateguard._kernel import classify_db_error, is_galera
from stateguard._kernel.execute import CAUSAL_MARK
from stateguard.tooling.inspection import describe_server

from .._support import galera
from .._support.faultproxy import COMMIT, FaultProxy
from ..conftest import MYSQL_URL, unavailable

T = TypeVar("T")
LEASE = datetime.timedelta(seconds=3)


class Base(DeclarativeBase):
    pass


class Order(Base):
    """An order moved pending -> paid -> shipped by many writers at once."""

    __tablename__ = "gal_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    note: Mapped[str] = mapped_column(String(40), default="")
    version: Mapped[int] = version_column()

    flow = StateMachine(
        "status",
        states=["pending", "paid", "shipped"],
        transitions=[["pay", "pending", "paid"], ["ship", "paid", "shipped"]],
    )


class Stock(Base):
    """Stock that must never go below zero."""

    __tablename__ = "gal_stock"
    id: Mapped[int] = mapped_column(primary_key=True)
    amount: Mapped[int] = mapped_column(Integer)


class Message(Base):
    """A message id processed at most once (insert_once)."""

    __tablename__ = "gal_messages"
    message_id: Mapped[str] = mapped_column(String(40), primary_key=True)


class Blocker(Base):
    """A row whose writeset a node is made to apply late (``LOCK TABLES`` there): the writesets
    after it wait in the node's apply queue, so the node lags the cluster."""

    __tablename__ = "gal_blocker"
    id: Mapped[int] = mapped_column(primary_key=True)
    n: Mapped[int] = mapped_column(Integer, default=0)


class Effect(Base):
    """One row per side effect, written in the transaction of the change that caused it."""

    __tablename__ = "gal_effects"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(40))
    item: Mapped[str] = mapped_column(String(60))


@pytest.fixture
def cluster(galera_cluster: galera.GaleraCluster) -> galera.GaleraCluster:
    """The package's 3-node cluster (tests/clusters/conftest.py, shared with test_galera_sessions.py),
    every node running and synced again: a test before may have killed or frozen one and failed
    before bringing it back."""
    galera_cluster.heal()
    return galera_cluster


def _all_tables() -> list[Table]:
    return [*Base.metadata.sorted_tables, *stateguard.tables.metadata.sorted_tables]


@pytest.fixture(scope="module")
def galera_tables(galera_cluster: galera.GaleraCluster) -> Iterator[None]:
    """This module's tables and stateguard's, made afresh on node 0 (Galera replicates the DDL) as
    the module begins and dropped after it; each test empties them (``engines``)."""
    made = create_engine(galera_cluster.urls[0])
    try:
        Base.metadata.drop_all(made)
        Base.metadata.create_all(made)
        stateguard.drop_tables(made)
        create_tables(made)
    finally:
        made.dispose()
    yield
    galera_cluster.heal()
    cleanup = create_engine(galera_cluster.urls[0])
    Base.metadata.drop_all(cleanup)
    stateguard.drop_tables(cleanup)
    cleanup.dispose()


@pytest.fixture
def engines(cluster: galera.GaleraCluster, galera_tables: None) -> Iterator[list[Engine]]:
    """One engine per node, every table empty: deleted from on node 0 in one transaction (a
    writeset, where dropping and creating them was some 40 DDL statements, each a cluster-wide
    total-order operation), and each node waited on until it has applied it."""
    made = [create_engine(url, pool_size=12, max_overflow=4, pool_pre_ping=True) for url in cluster.urls]
    with made[0].begin() as conn:
        for table in reversed(_all_tables()):
            conn.execute(table.delete())
    for eng in made:
        # Writesets are applied on the other nodes after node 0 answers: wait on each node until
        # it has applied everything node 0 committed.
        with eng.connect() as conn:
            conn.exec_driver_sql("SET SESSION wsrep_sync_wait = 15")
            for table in _all_tables():
                assert conn.scalar(select(func.count()).select_from(table)) == 0, table.name
            conn.exec_driver_sql("SET SESSION wsrep_sync_wait = 0")
    yield made
    for eng in made:
        eng.dispose()


#: How often units ran again (a conflict retried) and moved to another node (theirs was gone).
TALLY: Counter[str] = Counter()
_TALLY_LOCK = threading.Lock()


def _persist(engines: list[Engine], start: int, unit: Callable[[Engine], T]) -> T:
    """Run ``unit`` on node ``start`` with retry_on_conflict; on a node that is gone, the next node."""
    tries = itertools.count()

    def once(engine: Engine) -> T:
        if next(tries):
            with _TALLY_LOCK:
                TALLY["retried"] += 1
        return unit(engine)

    for attempt in itertools.count():
        engine = engines[(start + attempt) % len(engines)]
        try:
            result: T = retry_on_conflict(
                lambda engine=engine: once(engine),  # type: ignore[misc]
                attempts=40,
                backoff=0.005,
                max_backoff=0.2,
            )
            return result
        except RequestInProgress:
            # Another writer holds the key (separate mode): the docs say retry after its lease.
            with _TALLY_LOCK:
                TALLY["in_progress"] += 1
            time.sleep(0.05)
        except (sa_exc.OperationalError, sa_exc.InterfaceError) as exc:
            if classify_db_error(exc) is not None or attempt > 600:
                raise
            with _TALLY_LOCK:
                TALLY["moved"] += 1
            time.sleep(0.05)  # the node is down or restarting: the unit runs again elsewhere
    raise AssertionError("unreachable")


def _storm(workers: int, work: Callable[[int], None]) -> list[BaseException]:
    barrier = threading.Barrier(workers)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            work(i)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return errors


def _pay_buy_ship_storm(
    engines: list[Engine], orders: int, stock: int, *, ref: str, seed: int, done: Iterator[int]
) -> Callable[[int], None]:
    """Orders 1..``orders`` pending and ``stock`` units made; the work of one storm writer: pay, buy
    (a decrement with ref ``<ref><key>``) and ship each order in its own shuffled order, each unit
    recording its effect in its transaction and counting itself on ``done`` (a killer's cue)."""
    with Session(engines[0]) as s, s.begin():
        s.add_all([Order(id=i) for i in range(1, orders + 1)])  # id 0 would mean 'next auto value'
        s.add(Stock(id=1, amount=stock))

    def unit_for(kind: str, key: int) -> Callable[[Engine], None]:
        def unit(engine: Engine) -> None:
            with Session(engine) as s, s.begin():
                if kind == "buy":
                    applied = decrement(s, Stock.amount, 1, by=1, ref=f"{ref}{key}").applied
                else:
                    applied = getattr(Order.flow, kind)(s, key).applied
                if applied:
                    s.add(Effect(kind=kind, item=str(key)))
            next(done)

        return unit

    def work(i: int) -> None:
        keys = list(range(1, orders + 1))
        random.Random(seed + i).shuffle(keys)
        for k in keys:
            for kind in ("pay", "buy", "ship"):
                _persist(engines, i % 3, unit_for(kind, k))

    return work


def _assert_paid_shipped_and_sold_once(engine: Engine, orders: int, stock: int) -> None:
    """Read on ``engine``'s node once in sync: every order paid and shipped once, ``stock`` sold once each."""
    with Session(engine) as s:
        s.execute(text("SET SESSION wsrep_sync_wait = 1"))
        effects = Counter((kind, item) for kind, item in s.execute(select(Effect.kind, Effect.item)))
        left = s.scalar(select(Stock.amount))
    assert set(effects.values()) == {1}, [k for k, v in effects.items() if v > 1]
    assert sum(1 for e in effects if e[0] == "pay") == orders
    assert sum(1 for e in effects if e[0] == "ship") == orders
    assert sum(1 for e in effects if e[0] == "buy") == stock and left == 0


def test_every_node_is_recognised_as_galera_and_a_single_server_is_not(engines: list[Engine]) -> None:
    """is_galera is true on each node, `stateguard inspect` says so, and the plain MariaDB is not Galera."""
    for eng in engines:
        with eng.connect() as conn:
            assert is_galera(conn)
            assert describe_server(conn) == (
                "mysql (Galera cluster node, 3 nodes, causal: wsrep_sync_wait raised to 7)"
            )
    single = create_engine(MYSQL_URL)
    try:
        with single.connect() as conn:
            assert not is_galera(conn) and describe_server(conn) == "mysql"
    except sa_exc.OperationalError as exc:
        unavailable("MariaDB", exc)
    finally:
        single.dispose()


def test_advisory_lock_is_refused_on_galera_and_takes_no_lock(engines: list[Engine]) -> None:
    """GET_LOCK is local to a node: advisory_lock raises NotSupported naming what to use; no lock is held."""
    with Session(engines[1]) as s:
        with pytest.raises(NotSupported, match=r"row_lock.*ZooKeeperLock.*RedisLock"):
            with advisory_lock(s, "gal:nightly"):
                pytest.fail("the block must not run")
        held = s.execute(text("SELECT IS_USED_LOCK('gal:nightly')")).scalar()
        assert held is None


def test_the_same_transition_on_two_nodes_fails_one_commit_with_a_retryable_deadlock(
    engines: list[Engine],
) -> None:
    """Both nodes see APPLIED; one COMMIT fails with 1213 (DeadlockDetected); its retry sees REPEATED."""
    with Session(engines[0]) as s, s.begin():
        s.add(Order(id=1))
    barrier = threading.Barrier(2)
    outcomes: dict[int, Any] = {}

    def pay(node: int) -> None:
        with Session(engines[node]) as s:
            s.begin()
            outcomes[node] = Order.flow.pay(s, 1).outcome.name
            barrier.wait()
            try:
                s.commit()
            except sa_exc.OperationalError as exc:
                outcomes[node] = classify_db_error(exc)
                s.rollback()

    threads = [threading.Thread(target=pay, args=(n,)) for n in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(map(str, outcomes.values())) == sorted(["APPLIED", str(DeadlockDetected)]), outcomes

    def again(engine: Engine) -> str:
        with Session(engine) as s, s.begin():
            return str(Order.flow.pay(s, 1).outcome.name)

    assert retry_on_conflict(lambda: again(engines[2])) == "REPEATED"


@contextlib.contextmanager
def _lagging(engine: Engine, primary: Engine) -> Iterator[Callable[[], None]]:
    """Make ``engine``'s node lag: it holds ``LOCK TABLES gal_blocker WRITE`` while ``primary``'s
    node commits to gal_blocker, so that writeset and every later one wait in its apply queue
    until the yielded ``release()`` (or the block's end) unlocks the table."""
    holder = engine.connect()
    holder.exec_driver_sql("LOCK TABLES gal_blocker WRITE")
    with Session(primary) as s, s.begin():
        s.execute(text("UPDATE gal_blocker SET n = n + 1 WHERE id = 1"))
    released = threading.Event()

    def release() -> None:
        if not released.is_set():
            released.set()
            holder.exec_driver_sql("UNLOCK TABLES")
            holder.close()

    try:
        yield release
    finally:
        release()


@pytest.mark.lag
def test_a_lagging_node_classifies_a_zero_row_write_exactly_because_its_writes_wait(
    cluster: galera.GaleraCluster, engines: list[Engine]
) -> None:
    """On a node that has not applied node 0's commits, a 0-row write would read REJECTED / NOT_FOUND /
    STALE for changes the cluster has made; stateguard's wsrep_sync_wait makes it wait and APPLY."""
    with Session(engines[0]) as s, s.begin():
        s.add(Blocker(id=1))
        s.add_all([Order(id=1), Order(id=3)])
    # Node 1 has the rows (it was synced before the lag starts).
    with engines[1].connect() as conn:
        conn.exec_driver_sql("SET SESSION wsrep_sync_wait = 1")
        assert conn.scalar(select(func.count()).select_from(Order)) == 2

    def made_elsewhere(s: Session) -> int:
        """On node 0: order 1 paid, order 2 created paid, order 3 paid (its new version returned)."""
        assert Order.flow.pay(s, 1).applied
        s.add(Order(id=2, status="paid"))
        r = Order.flow.pay(s, 3)
        assert r.applied and r.version is not None
        return r.version

    def on_lagging(s: Session, version: int) -> list[str]:
        return [
            Order.flow.ship(s, 1).outcome.name,  # paid on node 0: ship is allowed
            Order.flow.ship(s, 2).outcome.name,  # created on node 0
            stateguard.guarded_update(s, Order, 3, {"note": "gift"}, expected_version=version).outcome.name,
        ]

    # Without the wait (a connection stateguard believes it has raised, left at 0): misclassified.
    plain = create_engine(cluster.urls[1])
    try:
        with _lagging(engines[1], engines[0]):
            with Session(engines[0]) as s, s.begin():
                version = made_elsewhere(s)
            with Session(plain) as s, s.begin():
                conn = s.connection()
                conn.exec_driver_sql("SET SESSION wsrep_sync_wait = 0")
                conn.connection.info[CAUSAL_MARK] = True
                wrong = on_lagging(s, version)
        assert wrong == ["REJECTED", "NOT_FOUND", "STALE"], wrong
    finally:
        plain.dispose()

    # The same, with stateguard's own set-up: each write waits for node 1 to catch up, then applies.
    with Session(engines[0]) as s, s.begin():
        s.execute(Order.__table__.delete())
        s.add_all([Order(id=1), Order(id=3)])
    with engines[1].connect() as conn:
        conn.exec_driver_sql("SET SESSION wsrep_sync_wait = 1")
        assert conn.scalar(select(func.count()).select_from(Order)) == 2
    with _lagging(engines[1], engines[0]) as release:
        with Session(engines[0]) as s, s.begin():
            version = made_elsewhere(s)
        timer = threading.Timer(0.5, release)
        timer.start()
        started = time.monotonic()
        with Session(engines[1]) as s, s.begin():
            right = on_lagging(s, version)
            waited = time.monotonic() - started
            assert s.connection().exec_driver_sql("SELECT @@session.wsrep_sync_wait").scalar() == 7
        timer.join()
    assert right == ["APPLIED", "APPLIED", "APPLIED"], right
    assert waited >= 0.4, f"the writes did not wait for the node to catch up ({waited:.2f}s)"


def test_a_storm_over_three_nodes_applies_everything_exactly_once(engines: list[Engine]) -> None:
    """9 writers, 3 per node, race on the same orders, stock, messages and keys: no double, no oversell."""
    orders, stock, purchases, messages = 12, 10, 30, 15
    with Session(engines[0]) as s, s.begin():
        s.add_all([Order(id=i) for i in range(1, orders + 1)])  # id 0 would mean 'next auto value'
        s.add(Stock(id=1, amount=stock))

    def fire(trigger: str, key: int) -> Callable[[Engine], None]:
        def unit(engine: Engine) -> None:
            with Session(engine) as s, s.begin():
                r = getattr(Order.flow, trigger)(s, key)
                if r.applied:
                    s.add(Effect(kind=trigger, item=str(key)))
                time.sleep(0.003)  # the application's own work: the window another node writes in

        return unit

    def buy(ref: str) -> Callable[[Engine], None]:
        def unit(engine: Engine) -> None:
            with Session(engine) as s, s.begin():
                if decrement(s, Stock.amount, 1, by=1, ref=ref).applied:
                    s.add(Effect(kind="buy", item=ref))
                time.sleep(0.003)

        return unit

    def handle(message_id: str) -> Callable[[Engine], None]:
        def unit(engine: Engine) -> None:
            with Session(engine) as s, s.begin():
                if insert_once(s, Message, {"message_id": message_id}).applied:
                    s.add(Effect(kind="message", item=message_id))

        return unit

    def charge(key: str, mode: str) -> Callable[[Engine], None]:
        def unit(engine: Engine) -> None:
            with Session(engine) as s:
                # separate mode commits the claim and the completion itself (no begin() around it).
                with idempotent(s, scope=f"gal:{mode}", key=key, mode=mode, lease=LEASE) as call:  # type: ignore[arg-type]
                    if not call.replayed:
                        s.add(Effect(kind=f"charge-{mode}", item=key))
                        call.complete({"charged": key})
                s.commit()

        return unit

    units: list[Callable[[Engine], None]] = []
    units += [fire(t, k) for k in range(1, orders + 1) for t in ("pay", "ship")]
    units += [buy(f"p{i}") for i in range(purchases)]
    units += [handle(f"m{i}") for i in range(messages)]
    units += [charge(f"k{i}", mode) for i in range(8) for mode in ("same_transaction", "separate")]

    def work(i: int) -> None:
        rng = random.Random(i)
        mine = units[:]
        rng.shuffle(mine)
        for unit in mine:
            _persist(engines, i % 3, unit)
        for k in range(1, orders + 1):  # every order ends shipped whatever the interleaving was
            _persist(engines, i % 3, fire("pay", k))
            _persist(engines, i % 3, fire("ship", k))

    TALLY.clear()
    errors = _storm(9, work)
    assert errors == []
    assert TALLY["retried"] > 0, f"no conflict happened: the storm did not race ({TALLY})"
    with Session(engines[2]) as s:
        s.execute(text("SET SESSION wsrep_sync_wait = 1"))
        effects = Counter((kind, item) for kind, item in s.execute(select(Effect.kind, Effect.item)))
        assert {v for v in effects.values()} == {1}, [k for k, v in effects.items() if v > 1]
        assert sum(1 for k in effects if k[0] == "pay") == orders
        assert sum(1 for k in effects if k[0] == "ship") == orders
        assert s.scalar(select(func.count()).select_from(Order).where(Order.status != "shipped")) == 0
        sold = sum(1 for k in effects if k[0] == "buy")
        assert sold == stock and s.scalar(select(Stock.amount)) == 0
        assert sum(1 for k in effects if k[0] == "message") == messages
        assert sum(1 for k in effects if k[0] == "charge-same_transaction") == 8
        assert sum(1 for k in effects if k[0] == "charge-separate") == 8


@pytest.mark.restart
def test_a_node_killed_mid_storm_loses_and_doubles_nothing(
    cluster: galera.GaleraCluster, engines: list[Engine]
) -> None:
    """Node 2 is SIGKILLed while 9 writers storm; its writers move on; each change applies once."""
    orders, stock = 20, 15
    done = itertools.count()
    work = _pay_buy_ship_storm(engines, orders, stock, ref="r", seed=100, done=done)
    killer_errors: list[BaseException] = []

    def killer() -> None:
        try:
            deadline = time.monotonic() + 60
            while next(done) < 40 and time.monotonic() < deadline:
                time.sleep(0.01)
            cluster.kill(2, signal.SIGKILL)
        except BaseException as exc:
            killer_errors.append(exc)

    TALLY.clear()
    k = threading.Thread(target=killer)
    k.start()
    errors = _storm(9, work)
    k.join(timeout=120)
    assert errors == [] and killer_errors == []
    assert cluster.nodes[2].process is not None and cluster.nodes[2].process.poll() is not None, "not killed"
    assert TALLY["moved"] > 0, "no writer lost its node"
    _assert_paid_shipped_and_sold_once(engines[0], orders, stock)
    engines[2].dispose()
    cluster.restart(2)
    with Session(engines[2]) as s:
        s.execute(text("SET SESSION wsrep_sync_wait = 1"))
        assert s.scalar(select(func.count()).select_from(Effect)) == 2 * orders + stock


# --------------------------------------------------------------------------
# Storms of the other schemes, writers on all three nodes
# --------------------------------------------------------------------------


class Account(Base):
    """A balance changed by read-version-then-guarded_update (optimistic lock)."""

    __tablename__ = "gal_accounts"
    id: Mapped[int] = mapped_column(primary_key=True)
    balance: Mapped[int] = mapped_column(Integer, default=0)
    version: Mapped[int] = version_column()


def _effects(engine: Engine) -> Counter[tuple[str, str]]:
    with Session(engine) as s:
        s.execute(text("SET SESSION wsrep_sync_wait = 1"))
        return Counter((kind, item) for kind, item in s.execute(select(Effect.kind, Effect.item)))


def test_guarded_update_storm_over_three_nodes_loses_no_update(engines: list[Engine]) -> None:
    """9 writers add 1 to one balance 15 times each by version: 135 applied, balance 135, version +135."""
    with Session(engines[0]) as s, s.begin():
        s.add(Account(id=1, balance=0))
        s.flush()
        start = s.scalar(select(Account.version))
    per_worker = 15

    def add_one(tag: str) -> Callable[[Engine], None]:
        def unit(engine: Engine) -> None:
            while True:  # STALE: someone wrote first; read again (the docs' optimistic loop)
                with Session(engine) as s, s.begin():
                    balance, version = s.execute(select(Account.balance, Account.version)).one()
                    r = stateguard.guarded_update(
                        s, Account, 1, {"balance": balance + 1}, expected_version=version
                    )
                    if r.applied:
                        s.add(Effect(kind="add", item=tag))
                        return
                    assert r.outcome.name == "STALE", r
                    with _TALLY_LOCK:
                        TALLY["stale"] += 1

        return unit

    def work(i: int) -> None:
        for n in range(per_worker):
            _persist(engines, i % 3, add_one(f"{i}-{n}"))

    TALLY.clear()
    errors = _storm(9, work)
    assert errors == []
    with Session(engines[1]) as s:
        s.execute(text("SET SESSION wsrep_sync_wait = 1"))
        balance, version = s.execute(select(Account.balance, Account.version)).one()
    effects = _effects(engines[1])
    assert set(effects.values()) == {1} and len(effects) == 9 * per_worker
    assert balance == 9 * per_worker and start is not None and version == start + 9 * per_worker
    assert TALLY["retried"] + TALLY["stale"] > 0, f"no conflict happened ({TALLY})"


def test_striped_counter_storm_over_three_nodes_never_oversells(engines: list[Engine]) -> None:
    """40 units over 4 stripes, 60 refs each bought by 2 twins on different nodes: 40 sold once each."""
    stock = stateguard.StripedCounter("gal-stock", stripes=4)
    with Session(engines[0]) as s, s.begin():
        assert stock.create(s, "sku", amount=40).applied
    refs = [f"o{n}" for n in range(60)]

    def buy(ref: str) -> Callable[[Engine], str]:
        def unit(engine: Engine) -> str:
            with Session(engine) as s, s.begin():
                r = stock.decrement(s, "sku", by=1, ref=ref)
                if r.applied:
                    s.add(Effect(kind="buy", item=ref))
                return r.outcome.name

        return unit

    outcomes: Counter[str] = Counter()

    def work(i: int) -> None:
        mine = [ref for n, ref in enumerate(refs) if n % 3 == i % 3]  # each ref: 2 of the 6 writers
        random.Random(i).shuffle(mine)
        for ref in mine:
            got = _persist(engines, i % 3, buy(ref))
            with _TALLY_LOCK:
                outcomes[got] += 1

    TALLY.clear()
    errors = _storm(6, work)
    assert errors == []
    effects = _effects(engines[2])
    with Session(engines[2]) as s:
        s.execute(text("SET SESSION wsrep_sync_wait = 1"))
        left = stock.total(s, "sku")
    assert set(effects.values()) == {1} and len(effects) == 40, effects
    assert left == 0 and outcomes["APPLIED"] == 40, (left, outcomes)
    assert outcomes["APPLIED"] + outcomes["REPEATED"] + outcomes["INSUFFICIENT"] == 120, outcomes


def test_consume_once_and_tokens_storm_over_three_nodes_apply_each_once(engines: list[Engine]) -> None:
    """30 messages redelivered to 3 nodes, 20 tokens spent by 9 writers: each handled once, no NOT_FOUND."""
    with Session(engines[0]) as s, s.begin():
        tokens = [
            stateguard.issue_token(s, scope="gal-confirm", ttl=datetime.timedelta(minutes=5))
            for _ in range(20)
        ]
    messages = [f"msg-{n}" for n in range(30)]

    def handle(message_id: str) -> Callable[[Engine], str]:
        def unit(engine: Engine) -> str:
            with Session(engine) as s, s.begin():
                r = stateguard.consume_once(s, "gal-billing", message_id)
                if r.applied:
                    s.add(Effect(kind="message", item=message_id))
                return r.outcome.name

        return unit

    def spend(n: int, token: str) -> Callable[[Engine], str]:
        def unit(engine: Engine) -> str:
            with Session(engine) as s, s.begin():
                r = stateguard.consume_token(s, token, scope="gal-confirm")
                if r.applied:
                    s.add(Effect(kind="token", item=str(n)))
                return r.outcome.name

        return unit

    outcomes: Counter[str] = Counter()

    def work(i: int) -> None:
        units = [handle(m) for m in messages] + [spend(n, t) for n, t in enumerate(tokens)]
        random.Random(i).shuffle(units)
        for unit in units:
            got = _persist(engines, i % 3, unit)
            with _TALLY_LOCK:
                outcomes[got] += 1

    TALLY.clear()
    errors = _storm(9, work)
    assert errors == []
    effects = _effects(engines[1])
    assert set(effects.values()) == {1}, [k for k, v in effects.items() if v > 1]
    assert sum(1 for k in effects if k[0] == "message") == 30
    assert sum(1 for k in effects if k[0] == "token") == 20
    assert outcomes == {"APPLIED": 50, "REPEATED": 8 * 50}, outcomes


def test_emit_and_relays_on_three_nodes_publish_each_event_once_in_key_order(engines: list[Engine]) -> None:
    """6 writers emit 20 events each while a relay per node publishes: each once, a writer's in order."""
    published: list[stateguard.OutboxEvent] = []
    lock = threading.Lock()

    def sink(events: Any) -> None:
        with lock:
            published.extend(events)

    relays = [stateguard.Relay(eng, stateguard.CallableSink(sink), batch=7) for eng in engines]
    per_writer = 20
    stop = threading.Event()

    def emit_one(writer: int, n: int) -> Callable[[Engine], None]:
        def unit(engine: Engine) -> None:
            with Session(engine) as s, s.begin():
                stateguard.emit(s, "gal.topic", {"writer": writer, "n": n}, key=f"w{writer}")

        return unit

    def relay_loop(node: int) -> None:
        while not stop.is_set():
            try:
                if relays[node].run_once() == 0:
                    time.sleep(0.005)
            except stateguard.SerializationConflict:
                with _TALLY_LOCK:
                    TALLY["relay_conflict"] += 1

    def work(i: int) -> None:
        if i >= 6:
            relay_loop(i - 6)
            return
        for n in range(per_writer):
            _persist(engines, i % 3, emit_one(i, n))

    TALLY.clear()
    stopper = threading.Thread(target=_stop_when, args=(stop, lambda: len(published) >= 6 * per_writer))
    stopper.start()
    errors = _storm(9, work)
    stopper.join(timeout=120)
    assert errors == []
    ids = Counter(e.id for e in published)
    assert len(ids) == 6 * per_writer and set(ids.values()) == {1}, [i for i, c in ids.items() if c > 1]
    for writer in range(6):
        ns = [e.payload["n"] for e in published if e.key == f"w{writer}"]
        assert ns == list(range(per_writer)), (writer, ns)


def _stop_when(stop: threading.Event, done: Callable[[], bool], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)  # a relay still publishing a duplicate would show it now
    stop.set()


def test_snowflakes_on_three_nodes_hold_distinct_workers_and_issue_unique_ids(engines: list[Engine]) -> None:
    """6 generators (2 per node) created at once lease 6 distinct worker ids; 18 threads' ids are unique."""
    made: list[stateguard.Snowflake] = []
    made_lock = threading.Lock()

    def create(i: int) -> None:
        gen = _persist(
            engines, i % 3, lambda engine: stateguard.Snowflake(engine, namespace="gal", heartbeat=False)
        )
        with made_lock:
            made.append(gen)

    TALLY.clear()
    assert _storm(6, create) == []
    try:
        assert len({g.worker_id for g in made}) == 6, sorted(g.worker_id for g in made)
        ids: list[int] = []

        def draw(i: int) -> None:
            mine = [made[i % 6].next_id() for _ in range(2000)]
            with made_lock:
                ids.extend(mine)

        assert _storm(18, draw) == []
        assert len(ids) == len(set(ids)) == 36000
    finally:
        for g in made:
            g.close()


def test_row_lock_excludes_on_one_node_and_across_nodes_the_loser_fails_at_commit(
    engines: list[Engine],
) -> None:
    """row_lock holds a twin on the same node (NOWAIT: LockNotAcquired); a twin on another node gets the
    lock at once, and when both write the row, the second COMMIT fails with a retryable DeadlockDetected."""
    with Session(engines[0]) as s, s.begin():
        s.add(Account(id=1, balance=0))
    # One node: the row lock excludes.
    with Session(engines[0]) as a, a.begin():
        assert stateguard.row_lock(a, Account, 1) is not None
        with Session(engines[0]) as b, b.begin():
            with pytest.raises(stateguard.LockNotAcquired):
                stateguard.row_lock(b, Account, 1, nowait=True)
    # Two nodes: both hold "the" lock at once; certification decides at COMMIT.
    with Session(engines[0]) as a, Session(engines[1]) as b:
        a.begin()
        b.begin()
        first = stateguard.row_lock(a, Account, 1)
        second = stateguard.row_lock(b, Account, 1, nowait=True)  # not refused: the lock is node-local
        assert first is not None and second is not None and first.balance == second.balance == 0
        first.balance += 1
        second.balance += 1
        b.flush()  # node 1's UPDATE runs; node 0 knows nothing of it yet
        a.commit()
        with pytest.raises(sa_exc.OperationalError) as lost:
            b.commit()
        assert classify_db_error(lost.value) is DeadlockDetected
        b.rollback()

    # Read-modify-write under row_lock from 6 writers on 3 nodes, retried as the docs say: none lost.
    def add_one(engine: Engine) -> None:
        with Session(engine) as s, s.begin():
            account = stateguard.row_lock(s, Account, 1)
            assert account is not None
            account.balance += 1

    TALLY.clear()
    errors = _storm(6, lambda i: [_persist(engines, i % 3, add_one) for _ in range(10)])
    assert errors == []
    with Session(engines[2]) as s:
        s.execute(text("SET SESSION wsrep_sync_wait = 1"))
        assert s.scalar(select(Account.balance)) == 1 + 60
    assert TALLY["retried"] > 0, f"no writer lost at COMMIT ({TALLY})"


@pytest.mark.lost_reply
@pytest.mark.parametrize("retry_on", [1, 2], ids=["same-node", "other-node"])
def test_a_lost_commit_reply_on_a_node_is_recognised_as_a_repeat_on_retry(
    cluster: galera.GaleraCluster, engines: list[Engine], retry_on: int
) -> None:
    """A decrement with ref whose COMMIT reached node 1 but whose reply was cut is REPEATED with
    same_request when retried (on node 1 or on node 2, where a client that lost its node goes)."""
    with Session(engines[0]) as s, s.begin():
        s.add(Stock(id=1, amount=5))
    node = cluster.nodes[1]
    with FaultProxy("127.0.0.1", node.port) as proxy:
        proxied = create_engine(f"mysql+pymysql://root@{proxy.host}:{proxy.port}/test")
        try:
            with Session(proxied) as s:
                assert decrement(s, Stock.amount, 1, by=2, ref="order-7").applied
                proxy.cut_after_next_request(COMMIT["mariadb"])
                with pytest.raises(sa_exc.DBAPIError):
                    s.commit()
            assert proxy.wait_cut() and proxy.cuts == 1
        finally:
            proxied.dispose()

    def again(engine: Engine) -> Any:
        with Session(engine) as s, s.begin():
            return decrement(s, Stock.amount, 1, by=2, ref="order-7")

    r = retry_on_conflict(lambda: again(engines[retry_on]))
    assert (r.outcome.name, r.same_request) == ("REPEATED", True)
    with Session(engines[0]) as s:
        s.execute(text("SET SESSION wsrep_sync_wait = 1"))
        assert s.scalar(select(Stock.amount)) == 3  # taken once


def test_wsrep_sync_wait_is_raised_once_per_connection_keeping_the_applications_bits(
    cluster: galera.GaleraCluster, engines: list[Engine]
) -> None:
    """The SET is sent on a connection's first stateguard call only, ORs in 7 (the app's 8 stays); once
    the engine is known to be a Galera node, a connection the pool replaced (or one whose setting the
    application lowered) is raised at its checkout, before anything runs on it; never on a MariaDB
    that is not a Galera node."""
    with Session(engines[0]) as s, s.begin():
        s.add_all([Order(id=1), Order(id=2)])
    sent: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("SET SESSION wsrep_sync_wait = @@session.wsrep_sync_wait |"):
            sent.append(statement)

    def pay(engine: Engine, key: int) -> tuple[str, int]:
        with Session(engine) as s, s.begin():
            outcome = Order.flow.pay(s, key).outcome.name
            return outcome, s.connection().exec_driver_sql("SELECT @@session.wsrep_sync_wait").scalar_one()

    one = create_engine(cluster.urls[2], pool_size=1, max_overflow=0)
    event.listen(one, "before_cursor_execute", record)
    try:
        with one.connect() as conn:
            conn.exec_driver_sql("SET SESSION wsrep_sync_wait = 8")  # the application's own setting
        assert pay(one, 1) == ("APPLIED", 15) and len(sent) == 1
        assert pay(one, 1) == ("REPEATED", 15) and len(sent) == 1  # the same pooled connection: not again
        with one.connect() as conn:
            conn.invalidate()  # the pool opens a new connection, at the server's default (0)
        with one.connect() as conn:  # raised as the pool handed it out, no stateguard call on it
            assert conn.exec_driver_sql("SELECT @@session.wsrep_sync_wait").scalar_one() == 7
        assert pay(one, 2) == ("APPLIED", 7) and len(sent) == 1  # the call had nothing left to send
        with one.connect() as conn:
            conn.exec_driver_sql("SET SESSION wsrep_sync_wait = 0")  # the application lowers it
        with one.connect() as conn:
            assert conn.exec_driver_sql("SELECT @@session.wsrep_sync_wait").scalar_one() == 7
    finally:
        one.dispose()

    single = create_engine(MYSQL_URL)
    event.listen(single, "before_cursor_execute", record)
    try:
        Base.metadata.create_all(single, tables=[Order.__table__])
        with Session(single) as s, s.begin():
            s.add(Order(id=1))
        with Session(single) as s, s.begin():
            assert Order.flow.pay(s, 1).applied
        assert len(sent) == 1, sent  # none on a MariaDB that is not a Galera node
    except sa_exc.OperationalError as exc:
        unavailable("MariaDB", exc)
    finally:
        with contextlib.suppress(sa_exc.OperationalError):
            Base.metadata.drop_all(single, tables=[Order.__table__])
        single.dispose()
