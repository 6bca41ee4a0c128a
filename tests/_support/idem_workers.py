"""Workers for tests/test_idempotency_races.py (importable by spawned processes).

A "request" claims an idempotency key, records its side effect in a shared
(manager) list as an outside system would see it, writes one ``payments``
row in the session and completes with a response naming the worker.  The
test then counts executions twice: the side-effect list and the committed
``payments`` rows.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

from sqlalchemy import Column, Integer, MetaData, String, Table, create_engine, insert
from sqlalchemy.orm import Session

from stateguard import RequestInProgress, idempotent

metadata = MetaData()

#: The business table: one row per execution of a request's body that committed.
payments = Table(
    "idem_race_payments",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("idem_key", String(64), nullable=False),
    Column("worker", String(64), nullable=False),
    Column("amount", Integer, nullable=False),
)

SCOPE = "payments:race"
BODY = {"amount": 100, "currency": "EUR"}


def make_engine(name: str, url: str) -> Any:
    kw: dict[str, Any] = {"pool_size": 2}
    if name == "sqlite":
        kw["connect_args"] = {"timeout": 60}
    return create_engine(url, **kw)


def warm_up(engine: Any) -> None:
    """Open (and pool) a connection now rather than inside the race."""
    with engine.connect():
        pass


def request(
    engine: Any,
    key: str,
    mode: str,
    work_s: float,
    barrier: Any,
    ran: Any,
    worker: str,
    lease_s: float = 30.0,
) -> tuple[str, Any]:
    """Send one request for ``key`` after the barrier; ``(outcome, detail)``.

    ``("ran", response)`` when this caller executed the body,
    ``("replayed", response)`` when it got the stored response,
    ``("in_progress", retry_after seconds)`` on RequestInProgress.
    """
    with Session(engine) as session:
        # Connect before the barrier, so the race is the claim's.  Separate mode claims
        # on a connection of its own and needs the session without a transaction.
        if mode == "same_transaction":
            session.connection()
        else:
            warm_up(engine)
        barrier.wait()
        try:
            with idempotent(
                session,
                scope=SCOPE,
                key=key,
                fingerprint=BODY,
                mode=mode,  # type: ignore[arg-type]
                lease=timedelta(seconds=lease_s),
            ) as call:
                if call.replayed:
                    result: tuple[str, Any] = ("replayed", call.response)
                else:
                    ran.append(worker)  # the side effect an outside system would see
                    # The slow outside call, while the twins arrive.  Before the
                    # session's first write: on SQLite an uncommitted write
                    # would hold the database's only write lock for the whole
                    # call and make every twin's claim wait instead of racing.
                    time.sleep(work_s)
                    session.execute(insert(payments).values(idem_key=key, worker=worker, amount=100))
                    response = {
                        "paid_by": worker,
                        "attempt": call.attempt,
                        "taken_over": call.taken_over,
                        "resumed_from": call.checkpoint_name,
                    }
                    result = ("ran", call.complete(response))
        except RequestInProgress as busy:
            return "in_progress", busy.retry_after.total_seconds()
        session.commit()
        return result


def request_in_process(
    name: str, url: str, key: str, mode: str, work_s: float, barrier: Any, ran: Any, worker: str
) -> tuple[str, Any]:
    """:func:`request` on an engine of its own (for spawned processes)."""
    engine = make_engine(name, url)
    try:
        return request(engine, key, mode, work_s, barrier, ran, worker)
    finally:
        engine.dispose()


def crash_mid_work(name: str, url: str, key: str, lease_s: float, ran: Any, working: Any) -> None:
    """Claim ``key`` in separate mode, checkpoint, start writing, signal ``working`` and hang (to be killed).

    The checkpoint commits; the payment row written after it stays
    uncommitted, so a SIGKILL here must leave no payment behind.
    """
    engine = make_engine(name, url)
    with (
        Session(engine) as session,
        idempotent(
            session,
            scope=SCOPE,
            key=key,
            fingerprint=BODY,
            mode="separate",
            lease=timedelta(seconds=lease_s),
        ) as call,
    ):
        ran.append(f"crasher-{os.getpid()}")
        call.checkpoint("charging", {"pid": os.getpid()})
        session.execute(insert(payments).values(idem_key=key, worker="crasher", amount=100))
        working.set()
        time.sleep(600)  # mid-work: the parent kills this process with SIGKILL
        call.complete({"paid_by": "crasher"})  # never reached
