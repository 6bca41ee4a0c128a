"""Behind a real PgBouncer in transaction pooling: every call the
README says works behind it does, with psycopg 3 and ``prepare_threshold=None``, also
under a storm of 8 threads on the same rows; and the README's advice is needed: psycopg's
automatic prepared statements break behind PgBouncer 1.18 without it.

The PgBouncer is started by the tests on a private port (tests/_support/pgbouncer.py). Missing
pgbouncer skips loudly on a laptop and fails under CI=true (.ci/run installs it).
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, String, create_engine, func, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import (
    CallableSink,
    LockNotAcquired,
    OutboxEvent,
    Outcome,
    RedisLock,
    Relay,
    Snowflake,
    StateMachine,
    advisory_lock,
    consume_once,
    consume_token,
    create_tables,
    decrement,
    drop_tables,
    emit,
    guarded_update,
    idempotent,
    insert_once,
    issue_token,
    release,
    reserve,
    retry_on_conflict,
    row_lock,
    version_column,
)
from stateguard.tables import outbox
from tests._support.models import Base, Invoice, Message, Order
from tests._support.pgbouncer import PgBouncer, pgbouncer_binary
from tests._support.stock_workers import Stock, StockBase
from tests.conftest import Backend, _Namespaces, unavailable

psycopg = pytest.importorskip("psycopg")

#: What the README tells users to pass behind PgBouncer in transaction pooling.
CONNECT_ARGS = {"prepare_threshold": None}


@pytest.fixture(scope="module")
def bouncer(namespaces: _Namespaces) -> Iterator[PgBouncer]:
    """A PgBouncer (transaction pooling) in front of this run's PostgreSQL schema."""
    url = make_url(namespaces.url("postgresql"))  # skips / fails when PostgreSQL is down
    if pgbouncer_binary() is None:
        unavailable(
            "pgbouncer", FileNotFoundError("pgbouncer is not installed (apt-get install -y pgbouncer)")
        )
    options = str(url.query.get("options", ""))
    search_path = options.split("search_path=", 1)[1] if "search_path=" in options else None
    with PgBouncer(
        server_host=url.host or "127.0.0.1",
        server_port=url.port or 5432,
        dbname=url.database or "test",
        user=url.username or "postgres",
        search_path=search_path,
        pool_size=12,
    ) as running:
        yield running


@pytest.fixture
def bounced(pg: Backend, bouncer: PgBouncer) -> Iterator[Engine]:
    """The test models and stateguard's tables, and an engine that reaches them through PgBouncer."""
    direct = pg.create(Base.metadata, StockBase.metadata)
    drop_tables(direct)
    create_tables(direct)
    engine = create_engine(bouncer.url(), connect_args=CONNECT_ARGS, pool_size=10, max_overflow=4)
    try:
        yield engine
    finally:
        engine.dispose()
        drop_tables(direct)


def _seed(engine: Engine, *rows: Any) -> None:
    with Session(engine) as s, s.begin():
        s.add_all(rows)


def _get(engine: Engine, model: type[Any], key: Any) -> Any:
    with Session(engine) as s:
        return s.get_one(model, key)


def test_the_fixture_really_goes_through_pgbouncer(bounced: Engine, bouncer: PgBouncer) -> None:
    """The engine talks to PgBouncer's port, and the run's schema is on every server connection."""
    assert bounced.url.port == bouncer.port
    with Session(bounced) as s:
        assert s.execute(select(func.current_setting("search_path"))).scalar_one() == bouncer.search_path
    assert "pool_mode = transaction" in (bouncer.dir / "pgbouncer.ini").read_text()


def test_one_client_connection_runs_on_several_server_connections(bounced: Engine) -> None:
    """Transaction pooling for real, not only in the ini file: once a client's transaction ends, another
    client can get the server connection it used, and the first client's next transaction runs on
    another one (impossible in session pooling, where a server connection stays with its client)."""
    pid = select(func.pg_backend_pid())
    with bounced.connect() as first, bounced.connect() as second:
        for _ in range(20):
            with first.begin():
                used = first.execute(pid).scalar_one()
            with second.begin():
                if second.execute(pid).scalar_one() != used:
                    continue
                # `second` holds the server connection `first` used, inside a transaction.
                with first.begin():
                    assert first.execute(pid).scalar_one() != used
                return
    pytest.fail("no other client ever got the server connection a client had used: not transaction pooling")


def test_triggers_single_many_where(bounced: Engine) -> None:
    """Single, many() and where() triggers give exact outcomes behind PgBouncer."""
    _seed(bounced, *(Order(id=i) for i in range(1, 11)))
    with Session(bounced) as s, s.begin():
        assert Order.flow.pay(s, 1).applied
        assert Order.flow.pay(s, 1).outcome is Outcome.REPEATED
        assert Order.flow.ship(s, 2).outcome is Outcome.REJECTED
        assert Order.flow.pay(s, 99).outcome is Outcome.NOT_FOUND
    with Session(bounced) as s, s.begin():
        results = Order.flow.pay.many(s, [1, 2, 3, 99])
    assert {k: r.outcome for k, r in results.items()} == {
        1: Outcome.REPEATED,
        2: Outcome.APPLIED,
        3: Outcome.APPLIED,
        99: Outcome.NOT_FOUND,
    }
    with Session(bounced) as s, s.begin():
        swept = Order.flow.pay.where(s, Order.id > 5, limit=3)
    assert sorted(swept) == [6, 7, 8]
    with Session(bounced) as s:
        paid = s.scalars(select(Order.id).where(Order.status == "paid").order_by(Order.id)).all()
    assert paid == [1, 2, 3, 6, 7, 8]


def test_history_and_request_id(bounced: Engine) -> None:
    """A request_id's repeat is found in the history behind PgBouncer (same_request)."""
    _seed(bounced, Invoice(id=1, status="sent"))
    with Session(bounced) as s, s.begin():
        assert Invoice.flow.pay(s, 1, request_id="r-1").applied
    with Session(bounced) as s, s.begin():
        again = Invoice.flow.pay(s, 1, request_id="r-1")
    assert (again.outcome, again.same_request) == (Outcome.REPEATED, True)


def test_guarded_update_with_version(bounced: Engine) -> None:
    """guarded_update applies with the right version and is STALE with an old one."""
    _seed(bounced, Order(id=1))
    with Session(bounced) as s, s.begin():
        version = s.get_one(Order, 1).version
        assert guarded_update(s, Order, 1, {"note": "gift"}, expected_version=version).applied
    with Session(bounced) as s, s.begin():
        stale = guarded_update(s, Order, 1, {"note": "late"}, expected_version=version)
    assert stale.outcome is Outcome.STALE
    assert _get(bounced, Order, 1).note == "gift"


def test_counters_with_ref(bounced: Engine) -> None:
    """decrement and reserve with a ref apply once, release gives back once, INSUFFICIENT changes nothing."""
    _seed(bounced, Stock(id=1, amount=5), Stock(id=2, amount=5))
    with Session(bounced) as s, s.begin():
        assert decrement(s, Stock.amount, 1, by=2, ref="o-1").applied
        assert decrement(s, Stock.amount, 1, by=2, ref="o-1").outcome is Outcome.REPEATED
        assert reserve(s, Stock.amount, {1: 1, 2: 3}, ref="o-2").applied
        assert reserve(s, Stock.amount, {1: 1, 2: 3}, ref="o-2").outcome is Outcome.REPEATED
        assert reserve(s, Stock.amount, {1: 1, 2: 9}, ref="o-3").outcome is Outcome.INSUFFICIENT
    assert (_get(bounced, Stock, 1).amount, _get(bounced, Stock, 2).amount) == (2, 2)
    with Session(bounced) as s, s.begin():
        assert release(s, Stock.amount, "o-2").applied
        assert release(s, Stock.amount, "o-2").outcome is Outcome.REPEATED
    assert (_get(bounced, Stock, 1).amount, _get(bounced, Stock, 2).amount) == (3, 5)


def test_insert_once_and_consume_once(bounced: Engine) -> None:
    """insert_once and consume_once are APPLIED once, then REPEATED, with the transaction usable."""
    with Session(bounced) as s, s.begin():
        assert insert_once(s, Message, {"message_id": "m-1"}).applied
        assert insert_once(s, Message, {"message_id": "m-1"}).outcome is Outcome.REPEATED
        assert consume_once(s, "billing", "m-1").applied
        assert consume_once(s, "billing", "m-1").outcome is Outcome.REPEATED
        assert s.scalar(select(func.count()).select_from(Message)) == 1


@pytest.mark.parametrize("mode", ["same_transaction", "separate"])
def test_idempotent_block(bounced: Engine, mode: Any) -> None:
    """idempotent() runs the block once and replays the stored response, in both modes."""
    runs = 0
    for _ in range(3):
        with Session(bounced) as s, idempotent(s, scope="pgb", key="k-1", mode=mode) as call:
            if call.replayed:
                assert call.response == {"n": 1}
                continue
            runs += 1
            call.complete({"n": runs})
            if mode == "same_transaction":
                s.commit()
    assert runs == 1


def test_tokens(bounced: Engine) -> None:
    """A token issued behind PgBouncer is consumed once."""
    with Session(bounced) as s, s.begin():
        token = issue_token(s, scope="pgb", ttl=timedelta(minutes=5))
    outcomes = []
    for _ in range(2):
        with Session(bounced) as s, s.begin():
            outcomes.append(consume_token(s, token, scope="pgb").outcome)
    assert outcomes == [Outcome.APPLIED, Outcome.REPEATED]


def test_row_lock_excludes_another_client(bounced: Engine) -> None:
    """A row locked by one client's transaction is LockNotAcquired with nowait for another."""
    _seed(bounced, Order(id=1))
    with Session(bounced) as holder, holder.begin():
        assert row_lock(holder, Order, 1) is not None
        with Session(bounced) as other, other.begin(), pytest.raises(LockNotAcquired):
            row_lock(other, Order, 1, nowait=True)
    with Session(bounced) as other, other.begin():
        assert row_lock(other, Order, 1, nowait=True) is not None


def test_advisory_lock_is_transaction_level_and_works(bounced: Engine) -> None:
    """advisory_lock (pg_advisory_xact_lock) excludes another client until the holder commits."""
    with Session(bounced) as holder:
        with advisory_lock(holder, "pgb:nightly"):
            with Session(bounced) as other, pytest.raises(LockNotAcquired):
                with advisory_lock(other, "pgb:nightly", timeout=0):
                    pytest.fail("the lock is held")
            holder.commit()
    with Session(bounced) as other, advisory_lock(other, "pgb:nightly", timeout=0):
        other.commit()


def test_storm_of_8_threads_on_the_same_rows(bounced: Engine) -> None:
    """8 threads take stock (ref'd decrement), pay or cancel the same orders: each once, no oversell."""
    orders, threads = 60, 8
    _seed(bounced, *(Order(id=i) for i in range(1, orders + 1)), Stock(id=1, amount=orders // 2))
    barrier = threading.Barrier(threads)
    applied: list[tuple[str, int]] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        barrier.wait()
        keys = list(range(1, orders + 1))
        random.Random(n).shuffle(keys)  # each thread in its own order
        for i in keys:

            def unit(i: int = i) -> list[tuple[str, int]]:
                done = []
                with Session(bounced) as s, s.begin():
                    took = decrement(s, Stock.amount, 1, ref=f"order-{i}")
                    if took.applied:
                        done.append(("took", i))
                        if Order.flow.pay(s, i).applied:
                            done.append(("pay", i))
                    elif took.outcome is Outcome.INSUFFICIENT and Order.flow.cancel(s, i).applied:
                        done.append(("cancel", i))
                return done

            got = retry_on_conflict(unit, attempts=20)
            with lock:
                applied.extend(got)

    with ThreadPoolExecutor(threads) as pool:
        for future in [pool.submit(worker, n) for n in range(threads)]:
            future.result()
    took = sorted(i for what, i in applied if what == "took")
    paid = sorted(i for what, i in applied if what == "pay")
    cancelled = sorted(i for what, i in applied if what == "cancel")
    assert len(took) == len(set(took)) == orders // 2
    assert paid == took
    assert len(cancelled) == len(set(cancelled))
    assert sorted(paid + cancelled) == list(range(1, orders + 1))
    assert _get(bounced, Stock, 1).amount == 0
    with Session(bounced) as s:
        states = {row.id: row.status for row in s.execute(select(Order.id, Order.status))}
    assert {i for i, st in states.items() if st == "paid"} == set(paid)
    assert {i for i, st in states.items() if st == "cancelled"} == set(cancelled)


def test_psycopg_prepared_statements_break_without_the_readme_advice(bouncer: PgBouncer) -> None:
    """psycopg's auto-prepared statements fail behind transaction pooling; prepare_threshold=None works."""
    query = "SELECT %s::int"
    with (
        psycopg.connect(bouncer.conninfo(), autocommit=True) as client,
        psycopg.connect(bouncer.conninfo()) as other,
    ):
        for i in range(8):  # past psycopg's prepare_threshold (5): the query is now prepared
            client.execute(query, [i])
        other.execute("SELECT 1")  # holds that server connection in an open transaction
        with pytest.raises(psycopg.errors.InvalidSqlStatementName):
            client.execute(query, [99])  # another server connection never saw the PREPARE
        other.rollback()
    with (
        psycopg.connect(bouncer.conninfo(), autocommit=True, **CONNECT_ARGS) as client,
        psycopg.connect(bouncer.conninfo()) as other,
    ):
        for i in range(8):
            client.execute(query, [i])
        other.execute("SELECT 1")
        assert client.execute(query, [99]).fetchone() == (99,)
        other.rollback()


# --------------------------------------------------------------------------
# the outbox, fences and ids behind PgBouncer
# --------------------------------------------------------------------------


class EventBase(DeclarativeBase):
    pass


class Shipment(EventBase):
    """events=True with a version column: 'pay' has one source (PostgreSQL's one-statement CTE), 'void'
    two."""

    __tablename__ = "pgb_shipments"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    status: Mapped[str] = mapped_column(String(20), default="new")
    version: Mapped[int] = version_column()

    flow = StateMachine(
        "status",
        states=["new", "paid", "void"],
        transitions=[["pay", "new", "paid"], ["void", ["new", "paid"], "void"]],
        events=True,
    )


@pytest.fixture
def bounced_events(pg: Backend, bounced: Engine) -> Engine:
    """``bounced`` with the events=True model's table as well."""
    pg.create(EventBase.metadata)
    return bounced


def _unpublished(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.scalar(select(func.count()).select_from(outbox).where(outbox.c.published_ms.is_(None))) or 0
        )


def _outbox_rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(outbox).order_by(outbox.c.id)))


@pytest.mark.rollback
def test_emit_and_transition_events_commit_or_roll_back_with_the_transaction(bounced_events: Engine) -> None:
    """emit() and events=True write into the caller's transaction through PgBouncer: one event per
    APPLIED transition (single call, two sources, many()), none for REPEATED, none after a rollback."""
    engine = bounced_events
    _seed(engine, *(Shipment(id=i) for i in range(1, 6)))
    with Session(engine) as s:
        s.begin()
        emit(s, "rolled.back", {"n": 0})
        assert Shipment.flow.pay(s, 1).applied
        s.rollback()
    assert _outbox_rows(engine) == []
    with Session(engine) as s, s.begin():
        first = emit(s, "order.note", {"n": 1}, key="k-1")
        assert Shipment.flow.pay(s, 1).applied
        assert Shipment.flow.pay(s, 1).outcome is Outcome.REPEATED
        assert Shipment.flow.void(s, 2).applied
        results = Shipment.flow.pay.many(s, [1, 3, 4])
        assert {k: r.outcome for k, r in results.items()} == {
            1: Outcome.REPEATED,
            3: Outcome.APPLIED,
            4: Outcome.APPLIED,
        }
    rows = _outbox_rows(engine)
    assert rows[0].id == first and json.loads(rows[0].payload) == {"n": 1}
    events = [(json.loads(r.payload)["trigger"], json.loads(r.payload)["key"]) for r in rows[1:]]
    assert sorted(events) == sorted([("pay", 1), ("void", 2), ("pay", 3), ("pay", 4)])


def test_relays_in_threads_publish_every_event_once_in_key_order(bounced_events: Engine) -> None:
    """Four relays (threads) through PgBouncer share 400 events of 8 keys: each published once, each
    key's events in id order (SKIP LOCKED claims and their marks run on pooled server connections)."""
    engine = bounced_events
    with Session(engine) as s, s.begin():
        for n in range(400):
            emit(s, "pgb.storm", {"n": n}, key=f"key-{n % 8}")
    published: list[OutboxEvent] = []
    lock = threading.Lock()

    def sink(events: Any) -> None:
        with lock:
            published.extend(events)

    barrier = threading.Barrier(4)

    def relay(_: int) -> int:
        # A relay's 0 means "nothing claimable now" (other relays may hold every key), not "done": each
        # relay runs until the outbox itself has nothing unpublished.
        r = Relay(engine, CallableSink(sink), batch=20)
        barrier.wait()
        total, deadline = 0, time.monotonic() + 60
        while _unpublished(engine):
            assert time.monotonic() < deadline, f"{_unpublished(engine)} events unpublished after 60 s"
            if (n := r.run_once()) == 0:
                time.sleep(0.01)
            total += n
        return total

    with ThreadPoolExecutor(4) as pool:
        totals = list(pool.map(relay, range(4)))
    assert sum(totals) == 400
    ids = [e.id for e in published]
    assert len(ids) == len(set(ids)) == 400
    for k in range(8):
        mine = [e.id for e in published if e.key == f"key-{k}"]
        assert mine == sorted(mine) and len(mine) == 50
    assert all(r.published_ms is not None for r in _outbox_rows(engine))


def test_redis_lock_database_fences_and_snowflake_ids(bounced_events: Engine, redis_client: Any) -> None:
    """RedisLock(fences=engine) takes its fences from the database through PgBouncer (strictly
    growing), and a Snowflake leases its worker id and issues increasing ids there."""
    engine = bounced_events
    name = f"pgb-fence-{uuid.uuid4().hex}"
    fences = []
    for _ in range(5):
        with RedisLock(redis_client, name, ttl=timedelta(seconds=10), fences=engine) as fence:
            fences.append(fence)
    assert fences == sorted(set(fences)) and len(fences) == 5
    with Snowflake(engine, namespace="pgb") as ids:
        issued = [ids.next_id() for _ in range(1000)]
    assert issued == sorted(set(issued))


@pytest.mark.restart
def test_relays_ride_out_pgbouncer_restarts_mid_storm(
    bounced_events: Engine, bouncer: PgBouncer, caplog: pytest.LogCaptureFixture
) -> None:
    """Three relays (Relay.run in threads) publish 600 events of 8 keys through PgBouncer while it is
    killed and started again twice: claims, publishes and marks are cut at every stage (a batch
    published whose mark never arrived is published again after its lease).  At least once: every
    event reaches the sink and ends marked; per key the first publications keep id order; and the
    relays keep running without help (their errors are logged, the dead pooled connections replaced)."""
    engine = bounced_events
    total, keys = 600, 8
    with Session(engine) as s, s.begin():
        for n in range(total):
            emit(s, "pgb.restart", {"n": n}, key=f"key-{n % keys}")
    published: list[OutboxEvent] = []
    lock = threading.Lock()
    first_batch = threading.Event()

    def sink(events: Any) -> None:
        with lock:
            published.extend(events)
            seen = len(published)
        if seen:
            first_batch.set()

    stop = threading.Event()
    relays = [Relay(engine, CallableSink(sink), batch=10, lease=timedelta(seconds=2)) for _ in range(3)]
    threads = [threading.Thread(target=r.run, args=(stop,), kwargs={"idle_sleep": 0.05}) for r in relays]
    for t in threads:
        t.start()

    def unpublished() -> int:
        with engine.connect() as conn:
            return int(conn.scalar(select(func.count()).where(outbox.c.published_ms.is_(None))) or 0)

    restarts_at: list[int] = []
    try:
        assert first_batch.wait(30), "no relay published anything"
        for _ in range(2):
            with lock:
                restarts_at.append(len(published))
            bouncer.restart()
            # Let the relays get going again (and publish more) before the next cut.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                with lock:
                    if len(published) >= restarts_at[-1] + 60:
                        break
                time.sleep(0.02)
        deadline = time.monotonic() + 60
        left = -1
        while time.monotonic() < deadline:
            try:
                left = unpublished()
            except Exception:  # the pool's connection from before a restart, replaced next time
                continue
            if left == 0:
                break
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert left == 0, f"{left} events never marked published after the restarts"
    assert restarts_at[-1] < total, f"a restart came after the storm was over: {restarts_at}"
    cut = [r for r in caplog.records if r.name == "stateguard.outbox" and "not published" in r.getMessage()]
    assert cut, "no relay noticed a restart: the test cut nothing"
    with lock:
        ids = [e.id for e in published]
    rows = _outbox_rows(engine)
    assert set(ids) == {r.id for r in rows} and len(rows) == total
    first_seen: dict[int, OutboxEvent] = {}
    for e in published:
        first_seen.setdefault(e.id, e)
    for k in range(keys):
        firsts = [e.id for e in first_seen.values() if e.key == f"key-{k}"]
        assert firsts == sorted(firsts) and len(firsts) == total // keys
