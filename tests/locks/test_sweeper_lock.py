"""The sweeper's lock as the README's "Scheduled sweeper" shows it: ``timeout=0`` gives up at once
and is not retried, the lock is held for the whole sweep, and it never stays behind a failed batch."""

from __future__ import annotations

import time
import uuid

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from stateguard import (
    retry_on_conflict,
)
from tests.conftest import Backend, backends_with, capable

# --------------------------------------------------------------------------
# The sweeper's lock (README "Scheduled sweeper")
# --------------------------------------------------------------------------


@pytest.mark.cancel
def test_sweeper_lock_timeout_zero_gives_up_at_once_and_is_not_retried(backend: Backend) -> None:
    """A second sweeper with timeout=0 gets LockNotAcquired at once (no wait), retry_on_conflict(...,
    lock_not_acquired=False) calls it once; SQLite has no named locks: NotSupported."""
    from stateguard import LockNotAcquired, NotSupported, advisory_lock

    engine = backend.engine
    name = f"cron:sweep-{uuid.uuid4().hex[:8]}"
    if not capable(backend, "row_locks"):
        with Session(engine) as session, session.begin():
            with pytest.raises(NotSupported):
                with advisory_lock(session, name, timeout=0):
                    pass
        return
    calls: list[float] = []

    def second_sweeper() -> None:
        with Session(engine) as session, session.begin():
            calls.append(time.monotonic())
            with advisory_lock(session, name, timeout=0):
                pytest.fail("the second sweeper took a held lock")

    with Session(engine) as holder, holder.begin():
        with advisory_lock(holder, name):
            started = time.monotonic()
            with pytest.raises(LockNotAcquired):
                retry_on_conflict(second_sweeper, lock_not_acquired=False)
            assert len(calls) == 1 and time.monotonic() - started < 2
    with Session(engine) as session, session.begin():
        with advisory_lock(session, name, timeout=0):
            pass  # free again once the holder ended


@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_sweeper_lock_in_the_readme_shape_is_held_as_documented(backend: Backend) -> None:
    """README's sweeper shape, `with session.begin():` around `with advisory_lock(...)`: on PostgreSQL
    the lock is held until the COMMIT; on MariaDB GET_LOCK is released when the block exits (before the
    COMMIT), and a commit inside the block keeps the lock over the commit, as the README says.

    Regression: the README's comment said "held until COMMIT" for both."""
    from stateguard import LockNotAcquired, advisory_lock

    engine = backend.engine
    name = f"cron:sweep-{uuid.uuid4().hex[:8]}"

    def taken_by_another() -> bool:
        with Session(engine) as other, other.begin():
            try:
                with advisory_lock(other, name, timeout=0):
                    return False
            except LockNotAcquired:
                return True

    with Session(engine) as session, session.begin():
        with advisory_lock(session, name, timeout=0):
            session.execute(text("SELECT 1"))
            assert taken_by_another()
        # After the block, before the COMMIT of session.begin():
        assert taken_by_another() is (backend.name == "postgresql")
    assert not taken_by_another()
    with Session(engine) as session:
        with advisory_lock(session, name, timeout=0):
            session.execute(text("SELECT 1"))
            assert taken_by_another()
            session.commit()  # inside the block: held up to the commit on both, released with it
            assert not taken_by_another()
    assert not taken_by_another()


@pytest.mark.parametrize("backend", backends_with("row_locks"), indirect=True)
def test_sweeper_lock_does_not_stay_behind_after_a_failed_batch(backend: Backend) -> None:
    """A batch that raises inside the lock: the lock is free for the next sweeper (never left in a
    pooled connection), on a pool of one connection that is reused at once."""
    from stateguard import advisory_lock

    engine = backend.new_engine(pool_size=1, max_overflow=0)
    other_engine = backend.new_engine(pool_size=1, max_overflow=0)
    name = f"cron:sweep-{uuid.uuid4().hex[:8]}"
    try:
        with pytest.raises(ZeroDivisionError):
            with Session(engine) as session, session.begin():
                with advisory_lock(session, name, timeout=0):
                    _ = 1 / 0
        with Session(other_engine) as session, session.begin():
            with advisory_lock(session, name, timeout=0):
                pass
    finally:
        engine.dispose()
        other_engine.dispose()
