"""8 separate processes send every one of 60 idempotency keys, each in its own random order, all at once:
no key's body runs twice, every caller gets the executing worker's response."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ProcessPoolExecutor

from sqlalchemy import select

from stateguard import create_tables, drop_tables
from tests._support.idem_workers import metadata, payments
from tests._support.processes import worker_context
from tests.conftest import Backend
from tests.reliability import _idem_storm

PROCESSES = 8
KEYS = 60


def test_idempotency_key_storm_executes_each_key_once(backend: Backend) -> None:
    """8 processes x 60 shared keys: exactly one execution and one payment row per key, all replies agree."""
    engine = backend.create(metadata)
    drop_tables(engine)
    create_tables(engine)
    keys = [f"storm-{i:03d}" for i in range(KEYS)]
    ctx = worker_context()
    try:
        with ctx.Manager() as manager, ProcessPoolExecutor(PROCESSES, mp_context=ctx) as pool:
            barrier = manager.Barrier(PROCESSES)
            futures = [
                pool.submit(_idem_storm.storm_worker, backend.name, backend.url, keys, seed, barrier)
                for seed in range(PROCESSES)
            ]
            results = [f.result(timeout=240) for f in futures]
        with engine.connect() as conn:
            rows = conn.execute(select(payments.c.idem_key, payments.c.worker)).all()
    finally:
        drop_tables(engine)
    executed = Counter(key for r in results for key, ran, _ in r if ran)
    assert sorted(executed) == keys and set(executed.values()) == {1}, executed
    assert sorted(k for k, _ in rows) == keys  # one committed payment per key
    by_key = {k: w for k, w in rows}
    for r in results:
        assert len(r) == KEYS
        for key, _, worker in r:
            assert worker == by_key[key], (key, worker, by_key[key])
    assert sum(not ran for r in results for _, ran, _ in r) == KEYS * (PROCESSES - 1)
