"""What one idempotent() call sends, per backend, and that the fewer statements still decide
every case: a twin in flight, another payload, a dead claim, a block that fails.

Same-transaction mode sends no SAVEPOINT for the claim (its INSERT cannot abort the transaction); the
block gets one only when it sends a statement, so its writes still roll back when it raises.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Literal

import pytest
from sqlalchemy import (
    Column,
    Connection,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    event,
    func,
    insert,
    select,
    text,
)
from sqlalchemy.orm import Session, registry

from stateguard import (
    IdempotencyKeyReused,
    RequestInProgress,
    idempotent,
)
from stateguard.tables import idempotency_keys
from tests.conftest import Backend, capable, count_statements

business = MetaData()
orders = Table(
    "idem_stmt_orders",
    business,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("ref", String(50), nullable=False),
)


class Order:
    """``orders`` as an ORM class, for blocks that leave changes to the Session's flush."""

    id: int
    ref: str

    def __init__(self, ref: str) -> None:
        self.ref = ref


registry().map_imperatively(Order, orders)

_DAY_MS = 86_400_000


pytestmark = pytest.mark.tables(business)


def _verbs(statements: list[str]) -> list[str]:
    """First word of each statement sent to the driver (BEGIN left out: the driver's own business)."""
    return [s.split()[0].upper() for s in statements if s.split()[0].upper() != "BEGIN"]


def _claim_verb(backend: Backend) -> str:
    return "WITH" if capable(backend, "writable_cte") else "INSERT"


def _orders(engine: Engine, ref: str) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(select(func.count()).select_from(orders).where(orders.c.ref == ref)).scalar_one()
        )


def _record(engine: Engine, key: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(
            select(idempotency_keys).where(
                idempotency_keys.c.scope == "s", idempotency_keys.c.idem_key == key
            )
        ).first()


def _put_record(engine: Engine, key: str, **values: Any) -> None:
    """A record as another worker left it (times on this machine's clock, which the database shares)."""
    now = int(time.time() * 1000)
    row = {
        "scope": "s",
        "idem_key": key,
        "status": "in_progress",
        "fingerprint": None,
        "owner": "dead-worker",
        "attempt": 1,
        "locked_until_ms": now + _DAY_MS,
        "expires_ms": now + _DAY_MS,
        "created_ms": now,
        "updated_ms": now,
        **values,
    }
    with engine.begin() as conn:
        conn.execute(insert(idempotency_keys).values(row))


def _call(engine: Engine, key: str, body: Any = None, *, write: bool = False) -> tuple[bool, Any, list[str]]:
    """One same-transaction call in its own committed transaction: (replayed, response or call, verbs)."""
    with Session(engine) as session, session.begin():
        # This session's connection only: a twin in another thread runs statements too.
        with (
            _statements_of(session.connection()) as seen,
            idempotent(session, scope="s", key=key, fingerprint=body) as call,
        ):
            if call.replayed:
                result: Any = call.response
            else:
                if write:
                    session.execute(insert(orders).values(ref=key))
                result = call.complete({"key": key, "attempt": call.attempt})
            replayed = call.replayed
    return replayed, result, _verbs(seen)


@contextlib.contextmanager
def _statements_of(conn: Connection) -> Iterator[list[str]]:
    """The statements ``conn`` sends while active."""
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    event.listen(conn, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(conn, "before_cursor_execute", record)


def test_first_call_is_two_statements_and_a_replay_one_on_postgresql(
    backend: Backend, engine: Engine
) -> None:
    """First call: claim + complete, no SAVEPOINT; replay: 1 statement on PostgreSQL, 2 elsewhere."""
    replayed, first, verbs = _call(engine, "k", {"a": 1})
    assert not replayed and verbs == [_claim_verb(backend), "UPDATE"]
    replayed, again, verbs = _call(engine, "k", {"a": 1})
    assert replayed and again == first
    assert verbs == (["WITH"] if capable(backend, "writable_cte") else ["INSERT", "SELECT"])


@pytest.mark.rollback
def test_a_block_that_writes_gets_one_savepoint_around_its_statements(
    backend: Backend, engine: Engine
) -> None:
    """SAVEPOINT goes out just before the block's first statement, RELEASE at the end."""
    replayed, _, verbs = _call(engine, "w", write=True)
    assert not replayed
    assert verbs == [_claim_verb(backend), "SAVEPOINT", "INSERT", "UPDATE", "RELEASE"]
    assert _orders(engine, "w") == 1


@pytest.mark.rollback
@pytest.mark.parametrize("change", ["added", "modified", "deleted"])
def test_orm_changes_the_block_left_unflushed_are_flushed_inside_its_savepoint(
    backend: Backend, engine: Engine, change: str
) -> None:
    """A block that only touched ORM objects sent nothing, yet its changes belong to it: the end of
    the block flushes them inside the savepoint (SAVEPOINT, the write, RELEASE), not later outside it."""
    with Session(engine) as session, session.begin():
        existing = Order("existing")
        session.add(existing)
        session.flush()
        existing_id = existing.id
    with Session(engine) as session, session.begin():
        order = session.get(Order, existing_id)
        assert order is not None
        with (
            _statements_of(session.connection()) as seen,
            idempotent(session, scope="s", key=change) as call,
        ):
            if change == "added":
                session.add(Order(change))
            elif change == "modified":
                order.ref = change
            else:
                session.delete(order)
            call.complete("done")
        verbs = _verbs(seen)
    write = {"added": "INSERT", "modified": "UPDATE", "deleted": "DELETE"}[change]
    assert verbs == [_claim_verb(backend), "UPDATE", "SAVEPOINT", write, "RELEASE"]
    assert _orders(engine, change) == (0 if change == "deleted" else 1)
    assert _orders(engine, "existing") == (1 if change == "added" else 0)


@pytest.mark.rollback
@pytest.mark.parametrize("end", ["release", "rollback to"])
def test_a_savepoint_the_block_sends_itself_nests_inside_the_blocks_own(engine: Engine, end: str) -> None:
    """The block's first statement is the application's own ``SAVEPOINT mine``: the block's savepoint
    goes out before it, so ``RELEASE``/``ROLLBACK TO SAVEPOINT mine`` leave the block's savepoint in
    place, and the block's write still rolls back when it raises and the caller commits anyway."""
    with Session(engine) as session, session.begin():
        conn = session.connection()
        with pytest.raises(RuntimeError), idempotent(session, scope="s", key="own-savepoint") as call:
            conn.exec_driver_sql("SAVEPOINT mine")
            conn.execute(insert(orders).values(ref="inside-mine"))
            conn.exec_driver_sql(f"{end.upper()} SAVEPOINT mine")
            conn.execute(insert(orders).values(ref="after-mine"))
            call.complete("done")
            raise RuntimeError("declined")
        session.execute(insert(orders).values(ref="caller"))
    assert _orders(engine, "inside-mine") == 0 and _orders(engine, "after-mine") == 0
    assert _orders(engine, "caller") == 1
    assert _record(engine, "own-savepoint") is None


@pytest.mark.rollback
def test_a_block_that_sent_nothing_leaves_no_savepoint_behind(engine: Engine) -> None:
    """Its savepoint is closed, not left open: the session's own nesting and ORM state are as before."""
    ended: list[Any] = []
    with Session(engine) as session, session.begin():
        event.listen(session, "after_transaction_end", lambda _s, tx: ended.append(tx))
        with idempotent(session, scope="s", key="quiet") as call:
            assert session.get_nested_transaction() is not None
            call.complete("done")
        assert session.get_nested_transaction() is None
        assert [tx.nested for tx in ended] == [True]
        with session.begin_nested():
            session.add(Order("after"))
    assert _orders(engine, "after") == 1
    assert _record(engine, "quiet").status == "completed"


@pytest.mark.rollback
@pytest.mark.parametrize("how", ["session", "captured connection", "driver sql"])
def test_a_failed_block_rolls_back_its_writes_however_it_sent_them(engine: Engine, how: str) -> None:
    """Writes through the Session, a Connection fetched before the call, or exec_driver_sql all roll back."""
    with Session(engine) as session, session.begin():
        conn = session.connection()
        session.execute(insert(orders).values(ref="before"))
        with pytest.raises(RuntimeError), idempotent(session, scope="s", key="k") as call:
            assert not call.replayed
            if how == "session":
                session.execute(insert(orders).values(ref="inside"))
            elif how == "captured connection":
                conn.execute(insert(orders).values(ref="inside"))
            else:
                conn.exec_driver_sql(f"INSERT INTO {orders.name} (ref) VALUES ('inside')")
            call.complete("done")
            raise RuntimeError("declined")
    assert _orders(engine, "before") == 1 and _orders(engine, "inside") == 0
    assert _record(engine, "k") is None
    replayed, _, _ = _call(engine, "k")
    assert not replayed


def test_a_failed_block_that_sent_nothing_deletes_its_claim(backend: Backend, engine: Engine) -> None:
    """No savepoint was needed: the new record is deleted, the caller's transaction commits its own work."""
    with Session(engine) as session, session.begin():
        session.execute(insert(orders).values(ref="before"))
        with count_statements(engine) as seen, pytest.raises(ValueError):
            with idempotent(session, scope="s", key="k"):
                raise ValueError("bad input")
    assert _verbs(seen.statements) == [_claim_verb(backend), "DELETE"]
    assert _orders(engine, "before") == 1 and _record(engine, "k") is None


def test_another_payload_is_still_refused_in_one_statement_on_postgresql(
    backend: Backend, engine: Engine
) -> None:
    """The record the claim returns decides: IdempotencyKeyReused, nothing written."""
    _call(engine, "k", {"amount": 1})
    with Session(engine) as session, session.begin():
        session.connection()
        with count_statements(engine) as seen, pytest.raises(IdempotencyKeyReused):
            with idempotent(session, scope="s", key="k", fingerprint={"amount": 2}):
                raise AssertionError("the block must not run")
    assert _verbs(seen.statements) == (["WITH"] if capable(backend, "writable_cte") else ["INSERT", "SELECT"])
    assert _record(engine, "k").response == '{"key":"k","attempt":1}'


def test_a_live_claim_of_another_worker_is_still_in_progress(backend: Backend, engine: Engine) -> None:
    """A committed claim with a live lease (a separate-mode worker) is RequestInProgress."""
    _put_record(engine, "busy")
    with Session(engine) as session, session.begin(), pytest.raises(RequestInProgress) as caught:
        with idempotent(session, scope="s", key="busy"):
            raise AssertionError("the block must not run")
    assert caught.value.retry_after is not None and caught.value.retry_after.total_seconds() > 3600
    assert _record(engine, "busy").owner == "dead-worker"


@pytest.mark.rollback
def test_a_dead_claim_is_taken_over_inside_the_savepoint(backend: Backend, engine: Engine) -> None:
    """An expired lease is taken over (SAVEPOINT first); a takeover that fails gives the record back."""
    past = int(time.time() * 1000) - 1000
    _put_record(engine, "dead", locked_until_ms=past)
    with Session(engine) as session, session.begin():
        with pytest.raises(RuntimeError), idempotent(session, scope="s", key="dead") as call:
            assert call.taken_over and call.attempt == 2
            raise RuntimeError("the retry failed too")
    row = _record(engine, "dead")
    assert row.owner == "dead-worker" and row.attempt == 1 and row.status == "in_progress"
    with Session(engine) as session, session.begin():
        session.connection()
        with count_statements(engine) as seen, idempotent(session, scope="s", key="dead") as call:
            assert call.taken_over and call.attempt == 2
            call.complete("recovered")
    read = [] if capable(backend, "writable_cte") else ["SELECT"]
    assert _verbs(seen.statements) == [
        _claim_verb(backend),
        *read,
        "SAVEPOINT",
        "UPDATE",
        "UPDATE",
        "RELEASE",
    ]
    row = _record(engine, "dead")
    assert row.status == "completed" and row.attempt == 2 and row.response == '"recovered"'


def test_an_expired_record_is_a_new_request(engine: Engine) -> None:
    """A completed record past its ttl is reclaimed: the block runs again."""
    past = int(time.time() * 1000) - 1000
    _put_record(engine, "old", status="completed", locked_until_ms=None, expires_ms=past, response='"stale"')
    replayed, result, _ = _call(engine, "old", write=True)
    assert not replayed and result == {"key": "old", "attempt": 1}
    assert _orders(engine, "old") == 1


def test_a_twin_waiting_on_the_claim_replays_once_it_commits(backend: Backend, engine: Engine) -> None:
    """Two same-transaction calls at once: the second waits for the first's row, then replays.

    On PostgreSQL the second's one statement cannot see the row it waited for (its snapshot is older):
    it reads again (WITH, SELECT) and replays; it never runs the block.
    """
    claimed = threading.Event()
    release = threading.Event()
    results: dict[str, Any] = {}

    def first() -> None:
        with Session(engine) as session, session.begin():
            with idempotent(session, scope="s", key="twin", fingerprint=1) as call:
                assert not call.replayed
                session.execute(insert(orders).values(ref="twin"))
                claimed.set()
                release.wait(10)
                call.complete("first")

    def second() -> None:
        claimed.wait(10)
        results["replayed"], results["response"], results["verbs"] = _call(engine, "twin", 1)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    claimed.wait(10)
    _wait_until_blocked(backend, engine)
    release.set()
    for t in threads:
        t.join(30)
    assert results["replayed"] is True and results["response"] == "first"
    assert _orders(engine, "twin") == 1
    if capable(backend, "writable_cte"):
        assert results["verbs"] == ["WITH", "SELECT"]


def _wait_until_blocked(backend: Backend, engine: Engine) -> None:
    """Until the second call waits for the first's lock (PostgreSQL: seen in pg_locks), else a pause."""
    if backend.name != "postgresql":
        time.sleep(0.5)
        return
    deadline = time.monotonic() + 10
    with engine.connect() as conn:
        while time.monotonic() < deadline:
            if conn.execute(text("SELECT count(*) FROM pg_locks WHERE NOT granted")).scalar_one():
                return
            conn.rollback()
            time.sleep(0.01)
    raise AssertionError("the second call never waited for the first")


def test_a_fresh_claim_keeps_its_expiry_when_completed_in_the_same_transaction(engine: Engine) -> None:
    """Same transaction, a record the call inserted: completing it leaves expires_ms (indexed, for
    purging) as the claim set it, the claim's time plus ttl, so the UPDATE changes no indexed
    column (PostgreSQL updates the row in place).  Separate mode, whose completion may come long
    after its claim committed, still keeps the key ttl from the completion."""
    ttl = timedelta(hours=2)
    with Session(engine) as session, session.begin():
        with idempotent(session, scope="s", key="same", ttl=ttl) as call:
            time.sleep(0.05)  # the completion's clock is well past the claim's
            call.complete({"ok": True})
    same = _record(engine, "same")
    assert same.status == "completed"
    assert same.updated_ms - same.created_ms >= 40, same
    assert same.expires_ms == same.created_ms + 2 * 3_600_000, same
    with Session(engine) as session:
        with idempotent(session, scope="s", key="separate", ttl=ttl, mode="separate") as call:
            time.sleep(0.05)
            call.complete({"ok": True})
    separate = _record(engine, "separate")
    assert separate.updated_ms - separate.created_ms >= 40, separate
    assert separate.expires_ms == separate.updated_ms + 2 * 3_600_000, separate
    # A takeover's completion (a record another worker claimed) counts from the completion too.
    _put_record(engine, "taken", locked_until_ms=0, created_ms=0, expires_ms=int(time.time() * 1000) + 5000)
    with Session(engine) as session, session.begin():
        with idempotent(session, scope="s", key="taken", ttl=ttl) as call:
            assert call.taken_over
            call.complete({"ok": True})
    taken = _record(engine, "taken")
    assert taken.expires_ms == taken.updated_ms + 2 * 3_600_000, taken


@pytest.mark.parametrize("how", ["durability_local", "large_response"])
def test_a_completion_that_checks_first_still_opens_no_savepoint(
    backend: Backend, engine: Engine, how: str
) -> None:
    """A completion that asks about durability or checks a large response's size (MariaDB's
    ``max_allowed_packet``) sends what it asks outside the block's savepoint: a block that sends
    nothing still gets no SAVEPOINT, and the replay returns the stored response."""
    response = {"text": "x" * 20_000} if how == "large_response" else {"ok": 1}
    durability: Literal["local"] | None = "local" if how == "durability_local" else None
    with Session(engine) as session, session.begin():
        with (
            _statements_of(session.connection()) as seen,
            idempotent(session, scope="s", key=how) as call,
        ):
            call.complete(response, durability=durability)
        verbs = _verbs(seen)
    assert "SAVEPOINT" not in verbs and verbs[0] == _claim_verb(backend) and verbs[-1] == "UPDATE", verbs
    replayed, again, _ = _call(engine, how)
    assert replayed and again == response
