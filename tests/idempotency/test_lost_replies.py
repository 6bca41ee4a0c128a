"""idempotent() when the reply to one of its own statements is lost (the connection dies after the
server received the statement): the claim's INSERT (on PostgreSQL the one statement that claims or
reads, whose row count alone says "claimed"), and the completion's UPDATE.  In the caller's
transaction nothing of the call may commit, the block's error is the one the caller sees, and a
retry claims the key afresh and runs the block once.

The fault is real: tests/_support/faultproxy.py forwards the statement to the server and cuts the
connection before its reply.  (A lost COMMIT reply is in tests/reliability/test_lost_commits.py.)
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from stateguard import idempotent
from stateguard.tables import idempotency_keys
from tests._support.faultproxy import FaultProxy, proxied_with_tables
from tests.conftest import Backend, backends_with

pytestmark = [
    pytest.mark.parametrize("backend", backends_with("tcp_server"), indirect=True),
    pytest.mark.lost_reply,
]

#: Bytes only the claim's statement sends (PostgreSQL: inside its CTE; elsewhere the INSERT).
CLAIM = b"INSERT INTO stateguard_idempotency_keys"
#: Bytes only the completion's statement sends.
COMPLETION = b"UPDATE stateguard_idempotency_keys SET status='completed'"


@pytest.fixture
def proxied(backend: Backend) -> Iterator[tuple[Engine, FaultProxy]]:
    """stateguard's tables on ``backend``, and an engine reaching it through a FaultProxy."""
    with proxied_with_tables(backend) as made:
        yield made


def _records(engine: Engine, scope: str) -> int:
    with engine.connect() as conn:
        return conn.scalar(select(func.count()).where(idempotency_keys.c.scope == scope)) or 0


def _retry_runs_once(engine: Engine, scope: str, runs: list[int]) -> None:
    """A new session's call with the same key claims it afresh (attempt 1) and runs the block."""
    with Session(engine) as s, s.begin(), idempotent(s, scope=scope, key="k") as call:
        assert (call.replayed, call.attempt, call.taken_over) == (False, 1, False)
        runs.append(2)
        call.complete({"charged": 1})
    with Session(engine) as s, s.begin(), idempotent(s, scope=scope, key="k") as call:
        assert (call.replayed, call.response) == (True, {"charged": 1})
    assert runs == [2]


def test_a_lost_reply_to_the_claim_runs_no_block_and_commits_nothing(
    proxied: tuple[Engine, FaultProxy],
) -> None:
    """The claim reached the server, its reply did not: the caller gets the driver's error before the
    block, the claim dies with its transaction, and a retry claims the key and runs the block."""
    engine, proxy = proxied
    runs: list[int] = []
    with Session(engine) as s:
        proxy.cut_after_next_request(CLAIM)
        with pytest.raises(DBAPIError), s.begin(), idempotent(s, scope="lost-claim", key="k"):
            runs.append(1)
    assert proxy.wait_cut()
    proxy.disarm()
    assert (runs, _records(engine, "lost-claim")) == ([], 0)
    _retry_runs_once(engine, "lost-claim", runs)


def test_a_lost_reply_to_the_completion_raises_the_drivers_error_and_commits_nothing(
    proxied: tuple[Engine, FaultProxy],
) -> None:
    """complete() reached the server, its reply did not: complete() raises the driver's error (not
    a stateguard error about the failed clean-up), nothing commits, and a retry runs the block."""
    engine, proxy = proxied
    runs: list[int] = []
    with Session(engine) as s:
        with pytest.raises(DBAPIError), s.begin(), idempotent(s, scope="lost-done", key="k") as call:
            runs.append(1)
            proxy.cut_after_next_request(COMPLETION)
            call.complete({"charged": 1})
    assert proxy.wait_cut()
    proxy.disarm()
    assert _records(engine, "lost-done") == 0
    runs.clear()
    _retry_runs_once(engine, "lost-done", runs)
