"""A separate-mode heartbeat keeps its lease even when the block holds the pool's last connection.

Regression: with ``heartbeat_every`` each beat took a
connection from the pool; a block whose session held the last one starved
every beat, the lease lapsed while the owner worked, and a retry took the key
over and ran the work a second time.  The heartbeat now checks out its own
connection before the claim: either it has one for the whole block, or
nothing is claimed (the pool's TimeoutError) and the retry runs the work once.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import Engine, exc, text
from sqlalchemy.orm import Session

from stateguard import RequestInProgress, idempotent
from tests.conftest import Backend

LEASE = timedelta(seconds=1)


def _owner(
    engine: Engine, key: str, ran: list[str], errors: list[BaseException], done: threading.Event
) -> None:
    try:
        with Session(engine) as s:
            with idempotent(
                s, scope="pool", key=key, mode="separate", lease=LEASE, heartbeat_every=timedelta(seconds=0.2)
            ) as call:
                s.execute(text("SELECT 1"))  # the block's session now holds a pooled connection
                ran.append("owner")
                time.sleep(2.5)  # well past the lease: only heartbeats keep the key
                s.rollback()
                call.complete({"by": "owner"})
    except BaseException as error:
        errors.append(error)
    finally:
        done.set()


def _poll(backend: Backend, key: str, ran: list[str], done: threading.Event) -> None:
    """Another process's retries, every 0.2 s until the owner is done and once more after: any takeover
    runs the work again."""
    other = backend.new_engine(pool_size=2)
    try:
        last = False
        while not last:
            last = done.is_set()
            with Session(other) as s:
                try:
                    with idempotent(s, scope="pool", key=key, mode="separate", lease=LEASE) as call:
                        if not call.replayed:
                            ran.append("retry")
                            call.complete({"by": "retry"})
                except RequestInProgress:
                    pass
            time.sleep(0.2)
    finally:
        other.dispose()


@pytest.mark.parametrize("pool_size", [1, 2])
def test_work_never_runs_twice_when_the_block_holds_the_pool(
    engine: Engine, backend: Backend, pool_size: int
) -> None:
    """pool_size=1: entering fails before claiming (the heartbeat has no connection); pool_size=2: the
    beats land on their own connection. Either way the work runs once, never concurrently twice."""
    owner_engine = backend.new_engine(pool_size=pool_size, max_overflow=0, pool_timeout=1)
    key = f"k-{pool_size}"
    ran: list[str] = []
    errors: list[BaseException] = []
    done = threading.Event()
    owner = threading.Thread(target=_owner, args=(owner_engine, key, ran, errors, done))
    owner.start()
    time.sleep(0.3)
    _poll(backend, key, ran, done)
    owner.join(30)
    owner_engine.dispose()
    if pool_size == 1:
        assert len(errors) == 1 and isinstance(errors[0], exc.TimeoutError), errors
    else:
        assert errors == []
    assert len(ran) == 1, ran  # the owner's run, or (pool_size=1: nothing was claimed) the retry's
