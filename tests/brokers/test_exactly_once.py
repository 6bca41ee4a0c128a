"""Every committed event's effect happens exactly once through each broker, with real processes:
3 producers, 2 relays, 3 consumers (Celery: 2 workers, acks_late, prefetch 1), relays SIGKILLed
between publish and mark, consumers SIGKILLed inside a handler's transaction, then restarted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, select

from stateguard import create_tables, drop_tables
from stateguard.tables import outbox

from .._support import brokers as _brokers
from ..conftest import Backend
from ..consumers._effects import effects, metadata

ROOT = Path(__file__).resolve().parent.parent.parent
KILL_ROUNDS = 3
PRODUCERS = 3
#: How long the whole pipeline may take to apply every committed event after the producers finished.
SETTLE = 40.0


class Cluster:
    """The test's processes, by name; each logs to ``<name>.log`` (see ``_roles``)."""

    def __init__(self, broker: str, tmp: Path, db_url: str, target: str) -> None:
        self.broker, self.tmp = broker, tmp
        self.env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            SG_DB_URL=db_url,
            SG_TARGET=target,
        )
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.killed: list[str] = []
        self.generation: Counter[str] = Counter()

    def start(self, role: str, name: str, **extra: str) -> None:
        self.generation[name] += 1
        incarnation = f"{name}.{self.generation[name]}"
        env = dict(self.env, SG_LOG=str(self.tmp / f"{incarnation}.log"), SG_NAME=incarnation, **extra)
        with open(self.tmp / f"{incarnation}.err", "wb") as err:  # the child keeps its own copy
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "tests.brokers._roles", role, self.broker],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )

    def lines(self, name: str, word: str) -> list[str]:
        """The ``word`` lines of the current incarnation of ``name``."""
        path = self.tmp / f"{name}.{self.generation[name]}.log"
        if not path.exists():
            return []
        return [ln.split(" ", 1)[1] for ln in path.read_text().splitlines() if ln.startswith(word + " ")]

    def all_lines(self, word: str) -> list[str]:
        return [
            ln.split(" ", 1)[1]
            for path in self.tmp.glob("*.log")
            for ln in path.read_text().splitlines()
            if ln.startswith(word + " ")
        ]

    def kill_when(self, names: list[str], word: str, timeout: float = 60) -> str:
        """SIGKILL the first of ``names`` that logs a new ``word`` line; return what the line said."""
        seen = {n: len(self.lines(n, word)) for n in names}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for n in names:
                got = self.lines(n, word)
                if len(got) > seen[n]:
                    self.procs[n].send_signal(signal.SIGKILL)
                    self.procs[n].wait(10)
                    self.killed.append(n)
                    return got[-1]
            time.sleep(0.005)
        raise AssertionError(f"none of {names} logged {word!r} within {timeout} s: {self.errors()}")

    def wait_ready(self, names: list[str], timeout: float = 90) -> None:
        """Wait until each of ``names`` (its current incarnation) logged ``ready``: started, imported."""
        deadline = time.monotonic() + timeout
        while not all(self.lines(n, "ready") for n in names):
            assert time.monotonic() < deadline, f"not ready within {timeout} s: {names}; {self.errors()}"
            assert all(self.procs[n].poll() is None for n in names), f"a process died: {self.errors()}"
            time.sleep(0.02)

    def errors(self) -> str:
        return "\n".join(
            f"{p.name}: {p.read_text()[-800:]}" for p in self.tmp.glob("*.err") if p.stat().st_size
        )

    def stop_all(self) -> dict[str, int | None]:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        return codes


@pytest.fixture
def pg_db(pg: Backend) -> Iterator[Engine]:
    """PostgreSQL with stateguard's tables and the effects table."""
    drop_tables(pg.engine)
    create_tables(pg.engine)
    pg.create(metadata)
    yield pg.engine
    drop_tables(pg.engine)


def _target(broker: str, stack: ExitStack) -> tuple[str, Any]:
    if broker == "redis":
        client, name = stack.enter_context(_brokers.redis_stream())
        return name, (client, name)
    if broker == "nats":
        js = stack.enter_context(_brokers.nats_stream())
        return js.name, js
    mq = stack.enter_context(_brokers.rabbit_queue())
    if broker == "celery":
        pytest.importorskip("celery")
        # Celery declares its own queue and exchange named after the queue; delete them after.
        stack.callback(lambda: (mq.channel.queue_delete(mq.queue + "-celery"), None))
        stack.callback(lambda: mq.channel.exchange_delete(mq.queue + "-celery"))
        return mq.queue + "-celery", mq
    return mq.queue, mq


@pytest.mark.restart
@pytest.mark.parametrize("broker", ["redis", "rabbitmq", "nats", "celery"])
def test_every_committed_event_is_applied_exactly_once(
    broker: str, pg_db: Engine, pg: Backend, tmp_path: Path
) -> None:
    """Under relay and consumer SIGKILLs the effects are exactly the committed events, each once."""
    with ExitStack() as stack:
        target, handle = _target(broker, stack)
        cluster = Cluster(broker, tmp_path, pg.url, target)
        stack.callback(cluster.stop_all)
        consumers = (
            ["worker-a", "worker-b"] if broker == "celery" else ["consumer-a", "consumer-b", "consumer-c"]
        )
        role = "worker" if broker == "celery" else "consumer"
        for name in consumers:
            cluster.start(role, name)
        for name in ("relay-a", "relay-b"):
            cluster.start("relay", name)
        cluster.wait_ready([*consumers, "relay-a", "relay-b"])
        for p in range(PRODUCERS):
            cluster.start("producer", f"producer-{p}", SG_PRODUCER=str(p))

        killed_mid_handler: list[str] = []
        for _ in range(KILL_ROUNDS):
            cluster.kill_when(["relay-a", "relay-b"], "published")
            cluster.start("relay", cluster.killed[-1])
            killed_mid_handler.append(cluster.kill_when(consumers, "slow"))
            cluster.start(role, cluster.killed[-1])
        for p in range(PRODUCERS):
            cluster.procs[f"producer-{p}"].send_signal(signal.SIGTERM)
        for p in range(PRODUCERS):
            assert cluster.procs[f"producer-{p}"].wait(60) == 0, cluster.errors()

        # Restarted processes install their SIGTERM handler before the graceful stop below.
        cluster.wait_ready([*consumers, "relay-a", "relay-b"])
        committed = _committed(pg_db)
        assert len(committed) >= 20, "the producers committed too little to test anything"
        deadline = time.monotonic() + SETTLE
        while set(_applied(pg_db)) != set(committed) and time.monotonic() < deadline:
            time.sleep(0.1)
        codes = cluster.stop_all()
        _assert_broker_order(broker, handle, _committed(pg_db))

    applied = _applied(pg_db)
    assert set(applied) == set(committed), (
        f"missing {sorted(set(committed) - set(applied))[:10]}; {cluster.errors()}"
    )
    assert [i for i, n in applied.items() if n > 1] == [], "an effect applied twice"
    # The kills hit inside a handler's transaction: those events were started again and applied once.
    starts = Counter(cluster.all_lines("start"))
    assert all(starts[i] >= 2 and applied[i] == 1 for i in killed_mid_handler), (killed_mid_handler, starts)
    survivors = {n: c for n, c in codes.items() if not n.startswith("producer")}
    assert survivors == dict.fromkeys(survivors, 0), f"a graceful stop did not exit 0: {codes}"


def _committed(db: Engine) -> dict[str, tuple[str, int]]:
    """Committed event id -> (key, per-key seq)."""
    with db.connect() as conn:
        rows = conn.execute(select(outbox.c.id, outbox.c.key, outbox.c.payload)).all()
    return {str(r.id): (r.key, _seq(json.loads(r.payload))) for r in rows}


def _seq(payload: Any) -> int:
    return int(payload["seq"] if "seq" in payload else payload["args"][0])


def _applied(db: Engine) -> Counter[str]:
    with db.connect() as conn:
        return Counter(conn.execute(select(effects.c.event_id)).scalars())


def _assert_broker_order(broker: str, handle: Any, committed: dict[str, tuple[str, int]]) -> None:
    """Where the broker keeps one order (a Redis stream, a JetStream stream), each key's events are in it
    in their order; RabbitMQ with competing consumers and Celery keep none to check."""
    if broker == "redis":
        client, name = handle
        ids = [fields[b"id"].decode() for _, fields in client.xrange(name)]
    elif broker == "nats":
        ids = [m.headers["Nats-Msg-Id"] for m in handle.messages()]
        assert len(ids) == len(set(ids)) == len(committed), "JetStream stored a re-publication twice"
    else:
        return
    assert set(ids) == set(committed), "the stream does not hold every committed event"
    first: dict[str, int] = {}
    for i in ids:
        first.setdefault(i, len(first))
    per_key: dict[str, list[int]] = defaultdict(list)
    for i in sorted(first, key=first.__getitem__):
        key, seq = committed[i]
        per_key[key].append(seq)
    assert all(seqs == sorted(seqs) for seqs in per_key.values()), per_key
