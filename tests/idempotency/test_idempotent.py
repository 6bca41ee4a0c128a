"""Idempotency keys (stateguard.idempotency) on every SQL backend: outcomes, modes, leases,
statement counts, bad input.  Races, crashes and purge under load are in test_idempotency_races.py."""

from __future__ import annotations

import decimal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, func, insert, select
from sqlalchemy.orm import DeclarativeBase, Session

from stateguard import (
    IdempotencyEvent,
    IdempotencyKeyReused,
    InvalidArgument,
    LeaseLost,
    Outcome,
    RequestFailed,
    RequestInProgress,
    StateguardError,
    consume_once,
    idempotent,
    idempotent_function,
    on_idempotency_event,
    purge_expired,
)
from stateguard import idempotency as idem
from stateguard.tables import consumed_messages, idempotency_keys
from tests.conftest import Backend, capable, count_statements

SECOND = timedelta(seconds=1)

business = MetaData()
payments = Table(
    "idem_payments",
    business,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("ref", String(50), nullable=False),
)


class _Base(DeclarativeBase):
    pass


class Payment(_Base):
    """The ORM view of the business table."""

    __table__ = payments


def _outlive(lease: timedelta) -> None:
    """Sleep until a lease or ttl of ``lease`` taken before this call has ended on the database's clock."""
    time.sleep(lease.total_seconds() + 0.05)


pytestmark = pytest.mark.tables(business)


@pytest.fixture
def events() -> Iterator[Counter[str]]:
    """Count idempotency events by kind while the test runs."""
    counts: Counter[str] = Counter()
    remove = on_idempotency_event(lambda e: counts.update([e.kind]))
    yield counts
    remove()


def _pay(
    session: Session, key: str, body: Any, *, scope: str = "payments", **options: Any
) -> tuple[bool, Any]:
    """The README's create_payment: insert a payment once per key; (replayed, response)."""
    with idempotent(session, scope=scope, key=key, fingerprint=body, **options) as call:
        if call.replayed:
            return True, call.response
        new_id = session.connection().execute(insert(payments).values(ref=key)).inserted_primary_key
        assert new_id is not None
        return False, call.complete({"payment_id": new_id[0], "amount": body["amount"]})


def _payments(engine: Engine, ref: str | None = None) -> int:
    with engine.connect() as conn:
        stmt = select(func.count()).select_from(payments)
        if ref is not None:
            stmt = stmt.where(payments.c.ref == ref)
        return int(conn.execute(stmt).scalar_one())


def _record(engine: Engine, key: str, scope: str = "payments") -> Any:
    with engine.connect() as conn:
        return conn.execute(
            select(idempotency_keys).where(
                idempotency_keys.c.scope == scope, idempotency_keys.c.idem_key == key
            )
        ).first()


# --------------------------------------------------------------------------
# Same-transaction mode
# --------------------------------------------------------------------------


def test_first_call_runs_and_a_retry_replays_the_stored_response(
    engine: Engine, events: Counter[str]
) -> None:
    """The first call runs the block; the retry gets the stored response and runs nothing."""
    with Session(engine) as session, session.begin():
        first = _pay(session, "k-1", {"amount": 100})
    with Session(engine) as session, session.begin():
        second = _pay(session, "k-1", {"amount": 100})
    assert first[0] is False and second[0] is True
    assert second[1] == first[1] == {"payment_id": first[1]["payment_id"], "amount": 100}
    assert _payments(engine) == 1
    assert events["claimed"] == 1 and events["completed"] == 1 and events["replayed"] == 1
    row = _record(engine, "k-1")
    assert row.status == "completed" and row.attempt == 1 and row.locked_until_ms is None
    assert row.fingerprint == idem.fingerprint_of({"amount": 100})


def test_fingerprint_is_canonical_and_a_different_request_is_rejected(engine: Engine) -> None:
    """Key order does not change a fingerprint; another payload under the same key raises, writes nothing."""
    with Session(engine) as session, session.begin():
        _pay(session, "k-1", {"amount": 100, "currency": "EUR"})
    with Session(engine) as session, session.begin():
        assert _pay(session, "k-1", {"currency": "EUR", "amount": 100})[0] is True
    with Session(engine) as session, session.begin(), pytest.raises(IdempotencyKeyReused) as caught:
        _pay(session, "k-1", {"amount": 999, "currency": "EUR"})
    assert caught.value.key == "k-1" and caught.value.scope == "payments"
    assert "different request" in str(caught.value)
    assert _payments(engine) == 1
    assert _record(engine, "k-1").fingerprint == idem.fingerprint_of({"currency": "EUR", "amount": 100})


def test_bytes_and_json_fingerprints_never_collide() -> None:
    """Bytes are hashed apart from JSON values, and only a hash is kept."""
    assert idem.fingerprint_of(b'"x"') != idem.fingerprint_of("x")
    assert idem.fingerprint_of(b"abc") == idem.fingerprint_of(bytearray(b"abc"))
    assert idem.fingerprint_of(None) is None
    digest = idem.fingerprint_of({"card": "4242424242424242"})
    assert digest is not None and len(digest) == 64 and "4242" not in digest


@pytest.mark.rollback
def test_the_block_raising_rolls_back_its_writes_and_frees_the_key(
    engine: Engine, events: Counter[str]
) -> None:
    """An exception in the block rolls back the claim and the block's writes, even if the caller commits."""
    with Session(engine) as session, session.begin():
        session.connection().execute(insert(payments).values(ref="before"))
        with pytest.raises(RuntimeError), idempotent(session, scope="payments", key="k-1") as call:
            assert not call.replayed
            session.connection().execute(insert(payments).values(ref="inside"))
            raise RuntimeError("card declined")
        # the caller swallowed the error and commits its own earlier work
    assert _payments(engine, "before") == 1 and _payments(engine, "inside") == 0
    assert _record(engine, "k-1") is None
    assert events["released"] == 1
    with Session(engine) as session, session.begin():
        assert _pay(session, "k-1", {"amount": 5})[0] is False
    assert _payments(engine, "k-1") == 1


@pytest.mark.rollback
def test_orm_writes_of_a_failed_block_are_rolled_back_too(engine: Engine) -> None:
    """Pending ORM objects flushed inside a failed block disappear with its savepoint."""
    with Session(engine) as session:
        with pytest.raises(ValueError), idempotent(session, scope="payments", key="k-orm"):
            session.add(Payment(ref="orm"))  # type: ignore[call-arg]
            session.flush()
            raise ValueError("boom")
        session.commit()
    assert _payments(engine, "orm") == 0 and _record(engine, "k-orm") is None


@pytest.mark.hostile
def test_exit_without_complete_stores_a_null_response(engine: Engine) -> None:
    """A block that finishes without complete() is completed with response None, and replays None."""
    with Session(engine) as session, session.begin(), idempotent(session, scope="s", key="k") as call:
        assert not call.replayed
    with Session(engine) as session, session.begin(), idempotent(session, scope="s", key="k") as call:
        assert call.replayed and call.response is None


def test_statement_counts_first_call_and_replay(backend: Backend, engine: Engine) -> None:
    """First call: the claim and the completing UPDATE; replay: one statement on PostgreSQL (the
    claim returns the record: WITH ... INSERT), an INSERT attempt and a SELECT elsewhere; no
    SAVEPOINT for a block that sends nothing (tests/idempotency/test_statements.py pins more)."""
    pg = capable(backend, "writable_cte")
    for expected in (["WITH" if pg else "INSERT", "UPDATE"], ["WITH"] if pg else ["INSERT", "SELECT"]):
        with Session(engine) as session, session.begin():
            session.connection()
            with count_statements(engine) as seen:
                with idempotent(session, scope="s", key="k", fingerprint={"a": 1}) as call:
                    if not call.replayed:
                        call.complete({"ok": True})
        verbs = [s.split()[0].upper() for s in seen.statements]
        assert [v for v in verbs if v not in ("SAVEPOINT", "RELEASE", "BEGIN")] == expected, seen.statements
        assert verbs.count("SAVEPOINT") == 0


def test_scopes_separate_identical_keys(engine: Engine) -> None:
    """The same key in two scopes is two requests."""
    with Session(engine) as session, session.begin():
        a = _pay(session, "k", {"amount": 1}, scope="client-a")
        b = _pay(session, "k", {"amount": 2}, scope="client-b")
    assert a[0] is False and b[0] is False and a[1] != b[1]


def test_keys_compare_byte_exact(engine: Engine) -> None:
    """Keys differing in case or trailing spaces are different keys on every backend."""
    keys = ["order-ABC", "order-abc", "order-ABC ", "ordér-ABC"]
    with Session(engine) as session, session.begin():
        results = [_pay(session, k, {"amount": 1}) for k in keys]
    assert [r[0] for r in results] == [False] * 4
    assert _payments(engine) == 4
    for k in keys:
        assert _record(engine, k).idem_key == k


def test_responses_round_trip_through_json_and_a_custom_serializer(engine: Engine) -> None:
    """Replays get the JSON round trip by default, or what a custom serializer restores."""

    class DecimalSerializer:
        def dumps(self, value: Any) -> str:
            return str(value)

        def loads(self, text: str) -> Any:
            return decimal.Decimal(text)

    with Session(engine) as session, session.begin():
        with idempotent(session, scope="s", key="json") as call:
            call.complete({"items": (1, 2), "text": "naïve ✓"})
        with idempotent(session, scope="s", key="dec", serializer=DecimalSerializer()) as call:
            call.complete(decimal.Decimal("10.50"))
    with Session(engine) as session, session.begin():
        with idempotent(session, scope="s", key="json") as call:
            assert call.response == {"items": [1, 2], "text": "naïve ✓"}
        with idempotent(session, scope="s", key="dec", serializer=DecimalSerializer()) as call:
            assert call.response == decimal.Decimal("10.50")


def test_an_unserialisable_response_raises_and_frees_the_key(engine: Engine) -> None:
    """complete() with a value JSON cannot store raises InvalidArgument before writing; the key stays free."""
    with Session(engine) as session, session.begin():
        with (
            pytest.raises(InvalidArgument, match="cannot be stored"),
            idempotent(session, scope="s", key="k") as call,
        ):
            call.complete({"when": object()})
    assert _record(engine, "k") is None


def test_finished_calls_refuse_more_writes(engine: Engine) -> None:
    """A replayed or completed call cannot be completed (again)."""
    with Session(engine) as session, session.begin():
        with idempotent(session, scope="s", key="k") as call:
            call.complete(1)
            with pytest.raises(InvalidArgument, match="already completed"):
                call.complete(2)
        with idempotent(session, scope="s", key="k") as call:
            with pytest.raises(InvalidArgument, match="replayed"):
                call.complete(3)
    with Session(engine) as session:
        manager = idempotent(session, scope="s", key="other")
        with manager:
            pass
        with pytest.raises(InvalidArgument, match="only once"), manager:
            pass
        session.commit()


@pytest.mark.rollback
def test_release_in_same_transaction_mode_rolls_back_the_block(engine: Engine) -> None:
    """release() gives the key back and undoes the block's writes, as an exception would."""
    with Session(engine) as session, session.begin():
        with idempotent(session, scope="s", key="k") as call:
            session.connection().execute(insert(payments).values(ref="released"))
            call.release("not now")
    assert _record(engine, "k", "s") is None and _payments(engine, "released") == 0


def test_expired_keys_are_claimed_anew_and_purged_in_batches(engine: Engine) -> None:
    """After ttl a key is a new request (attempt 1, any fingerprint); purge deletes at most batch rows."""
    short = timedelta(milliseconds=300)
    with Session(engine) as session, session.begin():
        for i in range(5):
            _pay(session, f"k-{i}", {"amount": i}, lease=short, ttl=short)
    with Session(engine) as session, session.begin():
        assert _pay(session, "k-0", {"amount": 0})[0] is True
    _outlive(short)
    with Session(engine) as session, session.begin():
        replayed, response = _pay(session, "k-0", {"amount": 77}, lease=short, ttl=short)
    assert replayed is False and response["amount"] == 77
    assert _record(engine, "k-0").attempt == 1
    assert purge_expired(engine, batch=3) == 3
    assert purge_expired(engine, batch=3) == 1
    assert purge_expired(engine, batch=3) == 0
    assert _record(engine, "k-0") is not None
    _outlive(short)
    with Session(engine) as session:
        assert purge_expired(session) == 1
        session.rollback()
    assert _record(engine, "k-0") is not None


# --------------------------------------------------------------------------
# Separate mode
# --------------------------------------------------------------------------


def test_separate_mode_commits_the_claim_at_once(engine: Engine, events: Counter[str]) -> None:
    """The claim is visible to others before the work ends; a twin gets RequestInProgress with retry_after."""
    with Session(engine) as session:
        with idempotent(session, scope="s", key="k", mode="separate", lease=30 * SECOND) as call:
            row = _record(engine, "k", "s")
            assert row.status == "in_progress" and row.owner is not None
            with Session(engine) as twin, pytest.raises(RequestInProgress) as caught:
                with idempotent(twin, scope="s", key="k", mode="separate"):
                    pytest.fail("the twin must not run")
            assert timedelta(seconds=25) < caught.value.retry_after <= timedelta(seconds=30)
            session.connection().execute(insert(payments).values(ref="sep"))
            call.complete({"done": True})
    assert _payments(engine, "sep") == 1
    assert _record(engine, "k", "s").status == "completed"
    assert events["in_progress"] == 1


def test_separate_mode_exception_releases_and_the_retry_resumes_from_the_checkpoint(engine: Engine) -> None:
    """A failure rolls back the phase and releases the key; the retry takes over with the checkpoint."""
    with Session(engine) as session:
        with pytest.raises(ConnectionError), idempotent(session, scope="s", key="k", mode="separate") as call:
            session.connection().execute(insert(payments).values(ref="phase-1"))
            call.checkpoint("charged", {"charge_id": "ch_1"})
            session.connection().execute(insert(payments).values(ref="phase-2"))
            raise ConnectionError("shipping API down")
    assert _payments(engine, "phase-1") == 1 and _payments(engine, "phase-2") == 0
    row = _record(engine, "k", "s")
    assert row.status == "in_progress" and row.locked_until_ms == 0 and "shipping API down" in row.error
    with Session(engine) as session, idempotent(session, scope="s", key="k", mode="separate") as call:
        assert call.taken_over and call.attempt == 2
        assert call.checkpoint_name == "charged" and call.checkpoint_data == {"charge_id": "ch_1"}
        call.complete("shipped")
    with Session(engine) as session, idempotent(session, scope="s", key="k", mode="separate") as call:
        assert call.replayed and call.response == "shipped" and call.attempt == 2


def test_separate_mode_refuses_a_session_with_an_open_transaction(engine: Engine) -> None:
    """Separate mode commits the session, so it refuses to start inside someone else's transaction."""
    with Session(engine) as session, session.begin():
        session.connection().execute(insert(payments).values(ref="pending"))
        with pytest.raises(InvalidArgument, match="no transaction open"):
            with idempotent(session, scope="s", key="k", mode="separate"):
                pytest.fail("must not run")
    assert _record(engine, "k", "s") is None and _payments(engine, "pending") == 1


def test_non_retryable_errors_mark_the_key_failed_for_good(engine: Engine) -> None:
    """An exception listed in non_retryable keeps the key failed: retries get RequestFailed."""

    class CardDeclined(Exception):
        pass

    with Session(engine) as session, pytest.raises(CardDeclined):
        with idempotent(session, scope="s", key="k", mode="separate", non_retryable=(CardDeclined,)):
            raise CardDeclined("insufficient funds")
    with Session(engine) as session, pytest.raises(RequestFailed) as caught:
        with idempotent(session, scope="s", key="k", mode="separate"):
            pytest.fail("must not run again")
    assert caught.value.error is not None and "insufficient funds" in caught.value.error
    assert isinstance(caught.value, StateguardError)


def test_a_dead_workers_lease_is_taken_over_after_it_expires(engine: Engine) -> None:
    """While the lease lives a retry is told to wait; after it, the retry takes over (attempt 2)."""
    lease = timedelta(milliseconds=800)
    with Session(engine) as dead:
        manager = idempotent(dead, scope="s", key="k", mode="separate", lease=lease)
        manager.__enter__()  # the worker dies here: it never exits
        with Session(engine) as retry, pytest.raises(RequestInProgress):
            with idempotent(retry, scope="s", key="k", mode="separate"):
                pass
        _outlive(lease)
        with Session(engine) as retry, idempotent(retry, scope="s", key="k", mode="separate") as call:
            assert call.taken_over and call.attempt == 2
            call.complete("second")


def test_a_stale_worker_never_overwrites_or_frees_the_new_owners_record(engine: Engine) -> None:
    """The Powertools bug: a late exception or completion of a taken-over worker changes nothing."""
    side_effects: list[str] = []
    lease = timedelta(milliseconds=300)
    with Session(engine) as a_session:
        a_manager = idempotent(a_session, scope="s", key="k", mode="separate", lease=lease)
        a_call = a_manager.__enter__()
        side_effects.append("A")
        _outlive(lease)  # A pauses past its lease
        with (
            Session(engine) as b_session,
            idempotent(b_session, scope="s", key="k", mode="separate") as b_call,
        ):
            assert b_call.taken_over
            side_effects.append("B")
            b_call.complete("B's response")
        with pytest.raises(LeaseLost):
            a_call.complete("A's response")
        # A's late exception path: its release must not touch B's record either.
        error = RuntimeError("A failed late")
        a_manager.__exit__(RuntimeError, error, None)
    for _ in range(2):
        with (
            Session(engine) as c_session,
            idempotent(c_session, scope="s", key="k", mode="separate") as c_call,
        ):
            if not c_call.replayed:
                side_effects.append("C")
            assert c_call.response == "B's response"
    assert side_effects == ["A", "B"]
    row = _record(engine, "k", "s")
    assert row.status == "completed" and row.attempt == 2


def test_a_stale_workers_exception_carries_a_note_about_the_takeover(engine: Engine) -> None:
    """When the release finds the key taken over, the original exception propagates with a note."""
    lease = timedelta(milliseconds=300)
    with Session(engine) as a_session, pytest.raises(KeyError) as caught:
        with idempotent(a_session, scope="s", key="k", mode="separate", lease=lease):
            _outlive(lease)
            with (
                Session(engine) as b_session,
                idempotent(b_session, scope="s", key="k", mode="separate") as b,
            ):
                b.complete("B")
            raise KeyError("late")
    assert any("taken over" in note for note in getattr(caught.value, "__notes__", []))
    assert _record(engine, "k", "s").response == '"B"'


def test_heartbeats_keep_a_long_claim_alive(engine: Engine) -> None:
    """heartbeat() extends the lease; once taken over, heartbeat() raises LeaseLost."""
    lease = timedelta(seconds=1)
    with Session(engine) as session:
        manager = idempotent(session, scope="s", key="k", mode="separate", lease=lease)
        call = manager.__enter__()
        for _ in range(3):
            time.sleep(0.5)
            call.heartbeat()
        with Session(engine) as twin, pytest.raises(RequestInProgress):
            with idempotent(twin, scope="s", key="k", mode="separate"):
                pass
        _outlive(lease)
        with Session(engine) as taker, idempotent(taker, scope="s", key="k", mode="separate") as taken:
            taken.complete(1)
        with pytest.raises(LeaseLost):
            call.heartbeat()


def test_background_heartbeat_outlives_the_lease(engine: Engine) -> None:
    """heartbeat_every keeps a claim alive past its lease in real time, and stops at completion."""
    lease = timedelta(milliseconds=600)
    with Session(engine) as session:
        with idempotent(
            session,
            scope="s",
            key="k",
            mode="separate",
            lease=lease,
            heartbeat_every=timedelta(milliseconds=100),
        ) as call:
            time.sleep(1.2)
            with Session(engine) as twin, pytest.raises(RequestInProgress):
                with idempotent(twin, scope="s", key="k", mode="separate"):
                    pass
            call.complete("slow but done")
    assert _record(engine, "k", "s").status == "completed"
    assert not any(t.name.startswith("stateguard-heartbeat") for t in threading.enumerate())


def test_a_concurrent_twin_in_same_transaction_mode_waits_then_replays(engine: Engine) -> None:
    """A twin's claim waits on the first transaction, then replays its committed response."""
    inside, results = threading.Event(), []

    def twin() -> None:
        inside.wait(10)
        with Session(engine) as session, session.begin():
            results.append(_pay(session, "k", {"amount": 1}))

    thread = threading.Thread(target=twin)
    thread.start()
    with Session(engine) as session, session.begin():
        first = _pay(session, "k", {"amount": 1})
        inside.set()
        time.sleep(0.3)  # the twin is now blocked on the unique index (or the SQLite write lock)
    thread.join(30)
    assert results == [(True, first[1])]
    assert _payments(engine) == 1


# --------------------------------------------------------------------------
# Decorator, consumers, events
# --------------------------------------------------------------------------


def test_idempotent_function_stores_and_replays_the_return_value(engine: Engine) -> None:
    """The decorated function runs once per key; replays return its stored result."""
    calls: list[str] = []

    @idempotent_function(
        scope=lambda session, refund_id, amount: f"refunds:{refund_id[:2]}",
        key=lambda session, refund_id, amount: refund_id,
        fingerprint=lambda session, refund_id, amount: {"amount": amount},
    )
    def refund(session: Session, refund_id: str, amount: int) -> dict[str, int]:
        calls.append(refund_id)
        return {"refunded": amount}

    with Session(engine) as session, session.begin():
        assert refund(session, "r-1", 30) == {"refunded": 30}
        assert refund(session, "r-1", 30) == {"refunded": 30}
        with pytest.raises(IdempotencyKeyReused):
            refund(session, "r-1", 31)
    assert calls == ["r-1"]
    with pytest.raises(InvalidArgument, match="first positional argument"):
        refund("not a session", "r-2", 1)  # type: ignore[arg-type]


@pytest.mark.rollback
def test_consume_once_applies_once_and_rolls_back_with_the_handler(engine: Engine) -> None:
    """consume_once is APPLIED then REPEATED; a rolled-back handler leaves the message unconsumed."""
    with Session(engine) as session:
        assert consume_once(session, "billing", "m-1").outcome is Outcome.APPLIED
        session.rollback()
    with Session(engine) as session, session.begin():
        first = consume_once(session, "billing", "m-1")
        again = consume_once(session, "billing", "m-1")
        other = consume_once(session, "shipping", "m-1")
    assert (first.outcome, again.outcome, other.outcome) == (
        Outcome.APPLIED,
        Outcome.REPEATED,
        Outcome.APPLIED,
    )
    assert first.key == ("billing", "m-1")
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(consumed_messages)).scalar_one() == 2


def test_listeners_see_every_outcome_and_a_failing_listener_breaks_nothing(engine: Engine) -> None:
    """Listeners get typed events; one that raises is logged and the call goes on."""
    seen: list[IdempotencyEvent] = []

    def broken(event: IdempotencyEvent) -> None:
        raise RuntimeError("metrics backend down")

    removers = [on_idempotency_event(seen.append), on_idempotency_event(broken)]
    try:
        with Session(engine) as session, session.begin():
            _pay(session, "k", {"amount": 1})
            _pay(session, "k", {"amount": 1})
            with pytest.raises(IdempotencyKeyReused):
                _pay(session, "k", {"amount": 2})
    finally:
        for remove in removers:
            remove()
    assert [e.kind for e in seen] == ["claimed", "completed", "replayed", "key_reused"]
    assert {(e.scope, e.key, e.mode) for e in seen} == {("payments", "k", "same_transaction")}


# --------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"key": ""}, "must not be blank"),
        ({"key": "   "}, "must not be blank"),
        ({"key": "x" * 256}, "the limit is 255"),
        ({"key": 42}, "must be a str"),
        ({"key": "a\x00b"}, "NUL"),
        ({"scope": "s" * 201}, "the limit is 200"),
        ({"lease": 5}, "timedelta"),
        ({"lease": timedelta(0)}, "at least 1 millisecond"),
        ({"ttl": SECOND, "lease": 2 * SECOND}, "must not be shorter than lease"),
        ({"mode": "eventually"}, "mode must be"),
        ({"heartbeat_every": SECOND}, "needs mode='separate'"),
        ({"mode": "separate", "heartbeat_every": 90 * SECOND}, "shorter than lease"),
        ({"non_retryable": (ValueError,)}, "needs mode='separate'"),
        ({"mode": "separate", "non_retryable": ("ValueError",)}, "exception classes"),
        ({"fingerprint": {"t": object()}}, "JSON-serialisable"),
        ({"fingerprint": {"x": float("nan")}}, "JSON-serialisable"),
    ],
)
def test_bad_arguments_raise_before_anything_is_written(
    engine: Engine, kwargs: dict[str, Any], message: str
) -> None:
    """Each bad argument is a typed InvalidArgument naming the problem; the keys table stays empty."""
    options: dict[str, Any] = {"scope": "s", "key": "k", **kwargs}
    with Session(engine) as session, pytest.raises(InvalidArgument, match=message):
        idempotent(session, **options)
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(idempotency_keys)).scalar_one() == 0


def test_consume_once_and_purge_validate_their_input(engine: Engine) -> None:
    """Blank ids and non-positive batches are InvalidArgument."""
    with Session(engine) as session:
        with pytest.raises(InvalidArgument):
            consume_once(session, "billing", "")
        with pytest.raises(InvalidArgument):
            consume_once(session, "", "m")
    for batch in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgument):
            purge_expired(engine, batch=batch)  # type: ignore[arg-type]


def test_options_left_at_their_defaults_are_the_checked_defaults() -> None:
    """A call that passes no option gets the same options as one that spells the defaults out
    (equal but not identical timedeltas); any other value is still checked."""
    from stateguard.idempotency.options import DEFAULT_LEASE, DEFAULT_TTL, IdempotencyOptions, options_of

    defaults = IdempotencyOptions()
    implicit = options_of(DEFAULT_LEASE, DEFAULT_TTL, "same_transaction", None, None, ())
    spelled = options_of(timedelta(seconds=60), timedelta(hours=24), "same_transaction", None, None, ())
    assert implicit == spelled == defaults
    assert (implicit.lease_ms, implicit.ttl_ms, implicit.heartbeat_seconds) == (60_000, 86_400_000, None)
    assert options_of(DEFAULT_LEASE, DEFAULT_TTL, "separate", None, None, ()).mode == "separate"
    with pytest.raises(InvalidArgument):
        options_of(DEFAULT_LEASE, DEFAULT_TTL, "same_transaction", None, None, [ValueError])
    with pytest.raises(InvalidArgument):
        options_of(DEFAULT_LEASE, DEFAULT_TTL, "same-transaction", None, None, ())
