"""Scenario 6: outbox relay throughput, from the database to a Redis stream.

Events are written with :func:`stateguard.emit` into a ``stateguard_outbox``
table of the scenario's own (a PostgreSQL schema, a MariaDB database, an
attached SQLite file, reached through ``schema_translate_map``), then
published into a Redis stream by

- stateguard's :class:`~stateguard.outbox.Relay` with
  :class:`~stateguard.RedisStreamSink`, at two batch sizes, and
- a hand-written poll-and-publish loop (the baseline): in one transaction,
  ``SELECT ... WHERE published_ms IS NULL ORDER BY id LIMIT batch FOR UPDATE
  SKIP LOCKED``, XADD the rows in one pipeline, ``UPDATE ... SET
  published_ms`` of their ids, COMMIT.

Each variant publishes fresh events of its own into a stream of its own; the
variants take turns round by round in a random order, so drift on a shared
machine hits them alike.  Only the publishing is timed (the emitting is
timed apart); published rows are deleted between turns, untimed, so every
turn starts from the same table.
"""

from __future__ import annotations

import json
import os
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, String, bindparam, delete, func, select, update
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import Relay, StateMachine, create_tables, emit, version_column
from stateguard.outbox.sinks.redis_streams import RedisStreamSink
from stateguard.tables import outbox

from .idempotency import _namespaces
from .models import STATES, TRANSITIONS, Table, counting, median, pct, worker_processes

REDIS_URL = os.environ.get("STATEGUARD_REDIS_URL", "redis://127.0.0.1:6379/0")
TARGET = 5000.0
#: Events per key: a relay claims a key's events only behind the key's earliest one.
PER_KEY = 5


def _emit(engine: Engine, first: int, n: int) -> float:
    """Emit events ``first .. first + n - 1`` (100 per transaction); the seconds it took."""
    t0 = time.perf_counter()
    for start in range(first, first + n, 100):
        with Session(engine) as s, s.begin():
            for i in range(start, min(start + 100, first + n)):
                emit(
                    s,
                    "order.paid",
                    {"order": i // PER_KEY, "seq": i, "amount": 120, "currency": "EUR"},
                    key=f"order-{i // PER_KEY}",
                )
    return time.perf_counter() - t0


def _analyze(engine: Engine, schema: str) -> None:
    """Refresh the table's planner statistics, as autovacuum would for a table in service."""
    name = engine.dialect.name
    q = engine.dialect.identifier_preparer
    table = f"{q.quote_schema(schema)}.{q.quote(outbox.name)}"
    sql = {"postgresql": f"ANALYZE {table}", "sqlite": f"ANALYZE {table}"}.get(name, f"ANALYZE TABLE {table}")
    with engine.connect() as conn:
        conn.exec_driver_sql(sql).close()
        conn.commit()


def _baseline(engine: Engine, client: Any, stream: str, batch: int) -> Callable[[], int]:
    """The hand-written loop's one batch (statements built once); returns how many it published."""
    o = outbox
    claim = select(o.c.id, o.c.topic, o.c.key, o.c.payload).where(o.c.published_ms.is_(None))
    claim = claim.order_by(o.c.id).limit(batch)
    if engine.dialect.name != "sqlite":
        claim = claim.with_for_update(skip_locked=True)
    mark = (
        update(o)
        .where(o.c.id.in_(bindparam("ids", expanding=True)))
        .values(published_ms=bindparam("now"), claimed_until_ms=None)
    )

    def once() -> int:
        with engine.begin() as conn:
            rows = conn.execute(claim).all()
            if not rows:
                return 0
            pipe = client.pipeline(transaction=False)
            for row in rows:
                fields = {"id": str(row.id), "topic": row.topic, "key": row.key or "", "payload": row.payload}
                pipe.xadd(stream, fields)
            pipe.execute()
            conn.execute(mark, {"ids": [row.id for row in rows], "now": int(time.time() * 1000)})
        return len(rows)

    return once


def _server_cpu(engine: Engine) -> float | None:
    """CPU seconds the PostgreSQL backends of the engine's database have used so far, read from
    ``/proc`` (a server on this machine); None elsewhere.  Unlike wall time, it does not grow when
    other processes share the machine."""
    if engine.dialect.name != "postgresql":
        return None
    with engine.connect() as conn:
        pids = (
            conn.exec_driver_sql("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
            .scalars()
            .all()
        )
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def _check_stream(client: Any, stream: str, expected: int) -> None:
    """Every event once, and each key's events in id order (one relay at a time here)."""
    entries = client.xrange(stream)
    ids = [int(fields[b"id"]) for _, fields in entries]
    # The payload's seq tells events apart: SQLite reuses the ids of the rows deleted between turns.
    seqs = {json.loads(fields[b"payload"])["seq"] for _, fields in entries}
    if len(ids) != expected or len(seqs) != expected:
        raise AssertionError(f"{stream}: {len(ids)} entries ({len(seqs)} distinct), expected {expected}")
    last: dict[bytes, int] = {}
    for (_, fields), event_id in zip(entries, ids, strict=True):
        key = fields[b"key"]
        if last.get(key, -1) > event_id:
            raise AssertionError(f"{stream}: key {key!r} out of order")
        last[key] = event_id


def relay_scenario(
    url: str, events: int, rounds: int, batches: list[int], holds: list[str | None] | None = None
) -> Table:
    """Relay vs hand-written loop, ``events`` per variant in ``rounds`` turns, at each batch size;
    ``holds``: a Relay per ``hold=`` option (None: the relay's default, the one variant by default)."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    client.ping()
    run_id = uuid.uuid4().hex[:12]
    per_round = events // rounds
    streams: list[str] = []
    with _namespaces(url, [0], tag="sgrelay") as (base, schemas):
        engine = base.execution_options(schema_translate_map={None: schemas[0]})
        dialect = base.dialect.name
        try:
            create_tables(engine)
            variants: dict[str, Callable[[], int]] = {}
            kinds = [
                "stateguard Relay" + ("" if hold is None else f" hold={hold}") for hold in holds or [None]
            ]
            for batch in batches:
                for kind in (*kinds, "hand-written loop"):
                    name = f"{kind}, batch {batch}"
                    stream = f"sg-bench-relay-{run_id}-{len(streams)}"
                    streams.append(stream)
                    if kind.startswith("stateguard Relay"):
                        hold = kind.partition("hold=")[2] or None
                        sink = RedisStreamSink(client, stream=stream)
                        variants[name] = Relay(engine, sink, batch=batch, hold=hold).run_once
                    else:
                        variants[name] = _baseline(engine, client, stream, batch)
            stream_of = dict(zip(variants, streams, strict=True))
            wall = {name: 0.0 for name in variants}
            cpu = {name: 0.0 for name in variants}
            rates: dict[str, list[float]] = {name: [] for name in variants}
            stmts = {name: 0 for name in variants}
            cycles = {name: 0 for name in variants}
            server: dict[str, float | None] = {name: 0.0 for name in variants}
            emit_s = 0.0
            rnd = random.Random(events)
            first = 0
            for _ in range(rounds):
                order = list(variants)
                rnd.shuffle(order)
                for name in order:
                    emit_s += _emit(engine, first, per_round)
                    _analyze(base, schemas[0])
                    first += per_round
                    once = variants[name]
                    done = 0
                    s0 = _server_cpu(base)
                    with counting(base) as box:
                        c0, t0 = time.process_time(), time.perf_counter()
                        while True:
                            got = once()
                            cycles[name] += 1
                            if got == 0:
                                break
                            done += got
                        took = time.perf_counter() - t0
                        cpu[name] += time.process_time() - c0
                    s1 = _server_cpu(base)
                    spent = server[name]
                    server[name] = None if spent is None or s0 is None or s1 is None else spent + s1 - s0
                    stmts[name] += box[0]
                    wall[name] += took
                    rates[name].append(done / took)
                    if done != per_round:
                        raise AssertionError(f"{name} published {done} of {per_round} events")
                    with engine.begin() as conn:
                        left = conn.scalar(select(func.count()).where(outbox.c.published_ms.is_(None)))
                        if left:
                            raise AssertionError(f"{name} left {left} events unpublished")
                        conn.execute(delete(outbox))
            for name in variants:
                _check_stream(client, stream_of[name], per_round * rounds)
        finally:
            if streams:
                client.delete(*streams)
            client.close()
    total = per_round * rounds
    table = Table(
        f"6. outbox relay to a Redis stream ({dialect}): {total} events per variant, "
        f"{rounds} rounds, variants in random order each round"
    )
    for name in variants:
        batch = int(name.rsplit(" ", 1)[1])
        rate = total / wall[name]
        base_rate = total / wall[f"hand-written loop, batch {batch}"]
        table.rows.append(
            {
                "variant": name,
                "events_per_s": round(rate),
                "median_round_per_s": round(median(rates[name])),
                "client_cpu_us_per_event": round(cpu[name] / total * 1e6, 1),
                "server_cpu_us_per_event": (
                    "" if (spent := server[name]) is None else round(spent / total * 1e6, 1)
                ),
                "stmts_per_batch": round(stmts[name] / max(1, cycles[name] - rounds), 2),
                "x_baseline": round(rate / base_rate, 3),
            }
        )
    best = max(total / wall[n] for n in variants if n.startswith("stateguard"))
    table.notes += [
        f"target >= {TARGET:.0f} events/s with batching (best stateguard Relay): {best:.0f}/s, "
        + ("met" if best >= TARGET else "MISSED"),
        "x_baseline: events/s over the hand-written loop's at the same batch size "
        "(above 1: stateguard faster)",
        f"events emitted with stateguard.emit, 100 per transaction, {PER_KEY} per key: "
        f"{rounds * len(variants) * per_round / emit_s:.0f} events/s (not part of the relay timing)",
        "stmts_per_batch: statements sent per published batch (BEGIN/COMMIT not counted; SQLite's explicit "
        "BEGIN IMMEDIATE and MariaDB's SET TRANSACTION are), the final empty poll excluded from the divisor",
        "the hand-written loop holds its transaction open while it XADDs and does not keep per-key order "
        "across several relays; stateguard's Relay claims, publishes outside a transaction, then marks",
        "every stream checked: each event exactly once, each key's events in id order",
        "server_cpu_us_per_event: CPU time of the database's PostgreSQL backends (from /proc: a server on "
        "this machine) over the events; with the client's, a cost that other load on the machine does not "
        "inflate as it does events_per_s",
    ]
    return table


# ---------------------------------------------------------------------------
# 6b. one transition with its outbox event vs the same transition without
# ---------------------------------------------------------------------------


class _EventsBase(DeclarativeBase):
    pass


class EventOrder(_EventsBase):
    """GuardedOrder's machine with ``events=True``: each APPLIED call also writes its outbox event."""

    __tablename__ = "sg_bench_event_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    version: Mapped[int] = version_column()

    flow = StateMachine("status", states=STATES, transitions=TRANSITIONS, events=True)


class QuietOrder(_EventsBase):
    """The same machine without events."""

    __tablename__ = "sg_bench_quiet_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    version: Mapped[int] = version_column()

    flow = StateMachine("status", states=STATES, transitions=TRANSITIONS)


def events_cost(url: str, n: int) -> Table:
    """``pay`` on fresh rows, one call per transaction, with and without ``events=True``, interleaved."""
    models = {"events=True (transition + outbox event)": EventOrder, "no events": QuietOrder}
    wall: dict[str, list[float]] = {name: [] for name in models}
    stmts: dict[str, int] = {}
    with _namespaces(url, [0], tag="sgevents") as (base, schemas):
        engine = base.execution_options(schema_translate_map={None: schemas[0]})
        dialect = base.dialect.name
        create_tables(engine)
        _EventsBase.metadata.create_all(engine)
        with Session(engine) as s, s.begin():
            for model in models.values():
                s.add_all([model(id=i) for i in range(1, n + 3)])
        for name, model in models.items():
            # A warm-up call (the engine's first: a MySQL-family engine asks its server once whether
            # it is a Galera node), then the statements of one call.
            with Session(engine) as s, s.begin():
                if not model.flow.pay(s, n + 2).applied:
                    raise AssertionError(f"{name}: not applied")
            with counting(base) as box, Session(engine) as s, s.begin():
                if not model.flow.pay(s, n + 1).applied:
                    raise AssertionError(f"{name}: not applied")
            stmts[name] = box[0]
        rnd = random.Random(n)
        for i in range(1, n + 1):
            order = list(models)
            rnd.shuffle(order)
            for name in order:
                t0 = time.perf_counter()
                with Session(engine) as s, s.begin():
                    if not models[name].flow.pay(s, i).applied:
                        raise AssertionError(f"{name}: not applied")
                wall[name].append(time.perf_counter() - t0)
        with engine.connect() as conn:
            written = conn.scalar(select(func.count()).select_from(outbox))
        if written != n + 2:
            raise AssertionError(f"{written} outbox events for {n + 2} APPLIED calls with events")
    quiet = median(wall["no events"])
    table = Table(
        f"6b. one transition with and without its outbox event ({dialect}), {n} calls each, interleaved"
    )
    for name in models:
        table.rows.append(
            {
                "variant": name,
                "median_us": round(median(wall[name]) * 1e6, 1),
                "p99_us": round(pct(wall[name], 0.99) * 1e6, 1),
                "stmts_per_call": stmts[name],
                "x_no_events": round(median(wall[name]) / quiet, 3),
            }
        )
    table.notes.append(
        "each call: Session, BEGIN, pay on a fresh 'pending' row, COMMIT; statements counted by "
        "before_cursor_execute (PostgreSQL: the UPDATE and the event's INSERT are one statement)"
    )
    return table


# ---------------------------------------------------------------------------
# 6c. commit-to-consumer latency of a running relay with its default settings
# ---------------------------------------------------------------------------


def _relay_process(
    url: str, schema: str, attach: list[tuple[str, str]], stream: str, stop: Any, ready: Any
) -> None:
    """``Relay(engine, RedisStreamSink(...)).run(stop)`` with every default, in a process of its own;
    ``ready`` is set once its first (empty) round ran: imports and connections are behind it."""
    import redis
    from sqlalchemy import event

    from .models import make_engine

    base = make_engine(url)
    if attach:

        @event.listens_for(base, "connect")
        def _attach(dbapi_conn: Any, _record: Any) -> None:
            for name, path in attach:
                dbapi_conn.execute(f"ATTACH DATABASE '{path}' AS {name}")

    engine = base.execution_options(schema_translate_map={None: schema})
    client = redis.Redis.from_url(REDIS_URL)
    try:
        relay = Relay(engine, RedisStreamSink(client, stream=stream))
        relay.run_once()
        ready.set()
        relay.run(stop)
    finally:
        client.close()
        base.dispose()


def latency_scenario(url: str, rate: int, seconds: float, producers: int) -> Table:
    """Events emitted one per transaction at ``rate``/s by ``producers`` threads; a relay process with
    the default settings publishes them to a Redis stream; a consumer XREADs it: commit-to-consumer time."""
    import threading

    import redis

    client = redis.Redis.from_url(REDIS_URL)
    client.ping()
    stream = f"sg-bench-latency-{uuid.uuid4().hex[:12]}"
    committed: dict[int, float] = {}
    received: dict[int, float] = {}
    with _namespaces(url, [0], tag="sglat") as (base, schemas):
        engine = base.execution_options(schema_translate_map={None: schemas[0]})
        dialect = base.dialect.name
        create_tables(engine)
        attach: list[tuple[str, str]] = []
        if dialect == "sqlite":
            stem = str(base.url.database).rsplit(".", 1)[0]
            attach = [(schemas[0], f"{stem}-sglat0.db")]
        ctx = worker_processes()
        stop, ready = ctx.Event(), ctx.Event()
        relay = ctx.Process(target=_relay_process, args=(url, schemas[0], attach, stream, stop, ready))
        relay.start()
        if not ready.wait(120):
            raise AssertionError("the relay process did not start within 120 s")
        done = threading.Event()

        def consume() -> None:
            reader = redis.Redis.from_url(REDIS_URL)
            last = "0-0"
            try:
                while not done.is_set():
                    for _, entries in reader.xread({stream: last}, block=100) or []:
                        now = time.monotonic()
                        for entry_id, fields in entries:
                            received.setdefault(int(fields[b"id"]), now)
                            last = entry_id
            finally:
                reader.close()

        def produce(index: int, n: int, t0: float) -> None:
            for i in range(n):
                due = t0 + (i * producers + index) / rate
                pause = due - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                with Session(engine) as s, s.begin():
                    event_id = emit(s, "order.paid", {"n": i, "p": index}, key=f"order-{index}-{i % 50}")
                committed[event_id] = time.monotonic()

        consumer = threading.Thread(target=consume, daemon=True)
        consumer.start()
        time.sleep(3.0)  # past the poll's backoff: the relay process waits idle, as in production
        per = int(rate * seconds) // producers
        t0 = time.monotonic() + 0.1
        threads = [threading.Thread(target=produce, args=(p, per, t0)) for p in range(producers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        emit_took = time.monotonic() - t0
        deadline = time.monotonic() + 30
        while len(received) < len(committed) and time.monotonic() < deadline:
            time.sleep(0.05)
        done.set()
        consumer.join(5)
        stop.set()
        relay.join(30)
        if relay.is_alive():
            relay.kill()
        client.delete(stream)
        client.close()
    missing = set(committed) - set(received)
    if missing:
        raise AssertionError(f"{len(missing)} committed events never reached the consumer")
    # The first second (a quarter of a shorter run) is the warm-up (connections, prepared
    # statements); a negative gap is a publish that beat the producer's clock read after its
    # COMMIT returned.
    warm = min(committed.values()) + min(1.0, seconds / 4)
    lat = [max(0.0, received[i] - t) for i, t in committed.items() if t >= warm]
    table = Table(
        f"6c. commit-to-consumer latency ({dialect}): {len(committed)} events, one per transaction, "
        f"{producers} producer threads at {rate}/s, a relay process with the default settings"
    )
    table.rows.append(
        {
            "achieved_events_per_s": round(len(committed) / emit_took),
            "p50_ms": round(pct(lat, 0.50) * 1000, 1),
            "p95_ms": round(pct(lat, 0.95) * 1000, 1),
            "p99_ms": round(pct(lat, 0.99) * 1000, 1),
            "max_ms": round(max(lat) * 1000, 1),
        }
    )
    table.notes += [
        "latency: from the producer's COMMIT returning to the consumer's XREAD returning the entry "
        "(Redis stream, XREAD BLOCK), the first second excluded",
        "target on PostgreSQL: p95 <= 50 ms at 1,000 events/s with Relay's defaults (LISTEN/NOTIFY); "
        "MariaDB and SQLite: the adaptive poll",
        "every committed event reached the consumer",
    ]
    return table
