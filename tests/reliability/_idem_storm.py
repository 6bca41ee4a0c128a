"""Worker of the idempotency-key storm (importable by spawned processes)."""

from __future__ import annotations

import os
import random
from typing import Any

from sqlalchemy import create_engine, insert
from sqlalchemy.orm import Session

from stateguard import idempotent, retry_on_conflict

from .._idem_workers import BODY, payments

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
