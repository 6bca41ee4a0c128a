"""Worker of the idempotency-key storm (importable by spawned processes)."""

from __future__ import annotations

import os
import random
import time
from typing import Any

from sqlalchemy import create_engine, insert
from sqlalchemy.orm import Session

from stateguard import idempotent, retry_on_conflict
from tests._support.idem_workers import BODY, payments

SCOPE = "payments:storm"


def storm_worker(
    name: str, url: str, keys: list[str], seed: int, barrier: Any
) -> list[tuple[str, bool, str]]:
    """Send every key once (same-transaction mode) in this worker's own random order.

    Returns ``(key, ran_the_body, worker_named_by_the_response)`` per key.
    """
    kw: dict[str, Any] = {"pool_size": 1, "max_overflow": 0}
    if name == "sqlite":
        kw["connect_args"] = {"timeout": 60}
    engine = create_engine(url, **kw)
    me = f"w{os.getpid()}"
    order = list(keys)
    random.Random(seed).shuffle(order)
    out: list[tuple[str, bool, str]] = []
    try:
        with engine.connect():
            pass
        barrier.wait()
        for key in order:

            def unit(key: str = key) -> tuple[bool, str]:
                with Session(engine) as session, session.begin():
                    with idempotent(session, scope=SCOPE, key=key, fingerprint=BODY) as call:
                        if call.replayed:
                            return False, str(call.response["worker"])
                        session.connection().execute(
                            insert(payments).values(idem_key=key, worker=me, amount=BODY["amount"])
                        )
                        return True, str(call.complete({"worker": me})["worker"])

            ran, worker = retry_on_conflict(unit, attempts=20)
            out.append((key, ran, worker))
    finally:
        engine.dispose()
    return out


def restart_worker(
    name: str, url: str, keys: list[str], seed: int, mode: str, lease_s: float, barrier: Any
) -> dict[str, Any]:
    """Send every key in this worker's own random order, riding out a server restart.

    A request cut off by the lost connection (its claim, its block or its COMMIT) is sent again
    with the same key until it gets an answer; one told RequestInProgress (separate mode: a claim
    whose owner lost its connection before it could release it) waits ``retry_after`` and sends
    again.  Returns ``{"answers": [(key, worker_named_by_the_response)], "ran": [key, ...],
    "counts": {...}}``: ``ran`` lists every execution of a body, committed or not.
    """
    from datetime import timedelta

    from sqlalchemy.exc import DBAPIError

    from stateguard import DeadlockDetected, RequestInProgress, SerializationConflict

    engine = create_engine(url, pool_size=1, max_overflow=0, pool_pre_ping=True)
    me = f"w{os.getpid()}"
    order = list(keys)
    random.Random(seed).shuffle(order)
    answers: list[tuple[str, str]] = []
    ran: list[str] = []
    counts: dict[str, int] = {}

    def count(what: str) -> None:
        counts[what] = counts.get(what, 0) + 1

    def send(key: str) -> str:
        lease = timedelta(seconds=lease_s)
        with Session(engine) as session:
            if mode == "same_transaction":
                session.begin()
            with idempotent(session, scope=SCOPE, key=key, fingerprint=BODY, mode=mode, lease=lease) as call:  # type: ignore[arg-type]
                if call.replayed:
                    worker = str(call.response["worker"])
                else:
                    ran.append(key)
                    session.execute(insert(payments).values(idem_key=key, worker=me, amount=BODY["amount"]))
                    worker = str(call.complete({"worker": me})["worker"])
            session.commit()
        return worker

    try:
        with engine.connect():
            pass
        barrier.wait()
        for key in order:
            for _ in range(2000):
                try:
                    answers.append((key, send(key)))
                    break
                except RequestInProgress as busy:
                    count("in_progress")
                    time.sleep(min(busy.retry_after.total_seconds(), lease_s) + 0.01)
                except (DeadlockDetected, SerializationConflict):
                    count("conflict")
                except DBAPIError:
                    # The server went away (the restart): the pool's connection is dead.
                    count("reconnects")
                    engine.dispose()
                    time.sleep(0.1)
            else:
                raise AssertionError(f"{key}: no answer after 2000 tries")
    finally:
        engine.dispose()
    return {"answers": answers, "ran": ran, "counts": counts}
