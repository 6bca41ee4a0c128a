"""Leases and expiries are decided on the database's clock, on every SQL backend.

The application clock stateguard could read (``_kernel.now_ms``, and a
Snowflake's injected ``_clock``) is skewed by hours both ways; claims, tokens,
purges and worker-id leases must come out exactly as with a correct clock.
Expiries are reached with short leases and real waiting: the database's clock
is never moved.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from stateguard import (
    Outcome,
    RequestInProgress,
    Snowflake,
    _kernel,
    consume_token,
    idempotent,
    issue_token,
    purge_expired,
    purge_expired_tokens,
)
from stateguard.tables import idempotency_keys, tokens
from tests._support.id_workers import VirtualClock

HOURS = 3 * 3_600_000
SHORT = timedelta(milliseconds=300)
LONG = timedelta(seconds=30)


def _outlive(span: timedelta) -> None:
    """Sleep until a lease or ttl of ``span`` started before this call has ended on the database's clock."""
    time.sleep(span.total_seconds() + 0.1)


class AppClock:
    """The application's clock as stateguard could read it, skewed by ``offset_ms``."""

    def __init__(self, real: Callable[[], int]) -> None:
        self.real = real
        self.offset_ms = 0

    def __call__(self) -> int:
        return self.real() + self.offset_ms


@pytest.fixture
def app_clock(monkeypatch: pytest.MonkeyPatch) -> AppClock:
    """Replace the kernel's application clock with one the test skews."""
    clock = AppClock(_kernel.now_ms)
    monkeypatch.setattr(_kernel, "now_ms", clock)
    return clock


SKEWS = pytest.mark.parametrize("skew", [HOURS, -HOURS], ids=["ahead", "behind"])


def _claim(engine: Engine, key: str, lease: timedelta) -> Any:
    """A separate-mode claim whose worker then dies (never leaves the block); its call."""
    manager = idempotent(Session(engine), scope="clock", key=key, mode="separate", lease=lease)
    return manager.__enter__()


def _try(engine: Engine, key: str) -> Any:
    """Enter a separate-mode call for ``key`` and complete it; the call (RequestInProgress propagates)."""
    with Session(engine) as session, idempotent(session, scope="clock", key=key, mode="separate") as call:
        if not call.replayed:
            call.complete("done")
        return call


# --------------------------------------------------------------------------
# Idempotency keys
# --------------------------------------------------------------------------


@pytest.mark.clock
@SKEWS
def test_a_live_claim_is_not_taken_over_by_a_server_with_a_skewed_clock(
    engine: Engine, app_clock: AppClock, skew: int
) -> None:
    """A claim made with a correct clock stays in progress for a server whose clock is hours off, and back."""
    _claim(engine, "first", LONG)
    app_clock.offset_ms = skew
    with pytest.raises(RequestInProgress) as caught:
        _try(engine, "first")
    assert timedelta(seconds=25) < caught.value.retry_after <= LONG
    _claim(engine, "second", LONG)  # claimed by the skewed server
    app_clock.offset_ms = 0
    with pytest.raises(RequestInProgress) as caught:
        _try(engine, "second")
    assert timedelta(seconds=25) < caught.value.retry_after <= LONG


@pytest.mark.clock
@SKEWS
def test_an_expired_claim_is_taken_over_whatever_the_clocks_say(
    engine: Engine, app_clock: AppClock, skew: int
) -> None:
    """A dead worker's lease ends after ``lease`` of real time, whether its clock or the taker's is off."""
    app_clock.offset_ms = skew
    _claim(engine, "first", SHORT)
    app_clock.offset_ms = 0
    _claim(engine, "second", SHORT)
    app_clock.offset_ms = -skew
    _outlive(SHORT)
    for key in ("first", "second"):
        call = _try(engine, key)
        assert call.taken_over and call.attempt == 2


@pytest.mark.clock
@SKEWS
def test_heartbeats_and_completions_store_the_database_clock(
    engine: Engine, app_clock: AppClock, skew: int
) -> None:
    """A heartbeat from a skewed server extends the lease by ``lease``; a completed key lives ``ttl``."""
    lease = timedelta(seconds=2)
    call = _claim(engine, "beating", lease)
    app_clock.offset_ms = skew
    call.heartbeat()
    app_clock.offset_ms = 0
    with pytest.raises(RequestInProgress) as caught:
        _try(engine, "beating")
    assert timedelta(seconds=1) < caught.value.retry_after <= lease
    app_clock.offset_ms = skew
    with (
        Session(engine) as session,
        idempotent(session, scope="clock", key="done", ttl=timedelta(hours=1)) as c,
    ):
        c.complete("stored")
        session.commit()
    app_clock.offset_ms = -skew
    assert _try(engine, "done").replayed
    with engine.connect() as conn:
        row = conn.execute(
            select(idempotency_keys.c.expires_ms, idempotency_keys.c.created_ms).where(
                idempotency_keys.c.idem_key == "done"
            )
        ).one()
    assert abs(row.expires_ms - row.created_ms - 3_600_000) < 60_000


@pytest.mark.clock
@SKEWS
def test_purge_keeps_live_keys_and_removes_expired_ones(
    engine: Engine, app_clock: AppClock, skew: int
) -> None:
    """A purge run by a server whose clock is hours off deletes exactly the keys expired on the database."""
    for key, ttl in (("live", timedelta(hours=1)), ("old", SHORT)):
        with (
            Session(engine) as session,
            idempotent(session, scope="clock", key=key, lease=SHORT, ttl=ttl) as c,
        ):
            c.complete(key)
            session.commit()
    _outlive(SHORT)
    app_clock.offset_ms = skew
    assert purge_expired(engine) == 1
    with engine.connect() as conn:
        assert conn.execute(select(idempotency_keys.c.idem_key)).scalars().all() == ["live"]


# --------------------------------------------------------------------------
# One-time tokens
# --------------------------------------------------------------------------


def _issue(engine: Engine, ttl: timedelta) -> str:
    with Session(engine) as session, session.begin():
        return issue_token(session, scope="clock", ttl=ttl)


def _consume(engine: Engine, token: str) -> Outcome:
    with Session(engine) as session, session.begin():
        return consume_token(session, token, scope="clock").outcome


@pytest.mark.clock
@SKEWS
def test_a_live_token_is_not_expired_by_a_skewed_clock(
    engine: Engine, app_clock: AppClock, skew: int
) -> None:
    """Tokens issued and consumed by servers whose clocks disagree by hours are live for their ttl."""
    issued_right = _issue(engine, timedelta(hours=1))
    app_clock.offset_ms = skew
    issued_skewed = _issue(engine, timedelta(hours=1))
    assert _consume(engine, issued_right) is Outcome.APPLIED
    app_clock.offset_ms = 0
    assert _consume(engine, issued_skewed) is Outcome.APPLIED


@pytest.mark.clock
@SKEWS
def test_an_expired_token_is_expired_whatever_the_clocks_say(
    engine: Engine, app_clock: AppClock, skew: int
) -> None:
    """A token is REJECTED after its ttl of real time, whether the issuer's clock or the consumer's is off."""
    app_clock.offset_ms = skew
    by_skewed = _issue(engine, SHORT)
    app_clock.offset_ms = 0
    by_right = _issue(engine, SHORT)
    _outlive(SHORT)
    assert _consume(engine, by_skewed) is Outcome.REJECTED
    app_clock.offset_ms = -skew
    assert _consume(engine, by_right) is Outcome.REJECTED
    live = _issue(engine, timedelta(hours=1))
    app_clock.offset_ms = skew
    assert purge_expired_tokens(engine) == 2
    with engine.connect() as conn:
        assert len(conn.execute(select(tokens.c.token_hash)).all()) == 1
    assert _consume(engine, live) is Outcome.APPLIED


# --------------------------------------------------------------------------
# Snowflake worker-id leases
# --------------------------------------------------------------------------


@pytest.fixture
def generators() -> Iterator[list[Snowflake]]:
    """Snowflakes the test makes; closed afterwards."""
    made: list[Snowflake] = []
    yield made
    for ids in made:
        ids.close()


@pytest.mark.clock
@SKEWS
def test_a_live_worker_id_is_not_taken_by_a_host_with_a_skewed_clock(
    engine: Engine, generators: list[Snowflake], skew: int
) -> None:
    """A worker id leased by a host with a correct clock stays its own for a host hours off, and back."""
    right, skewed = VirtualClock(), VirtualClock(skew)
    lease = timedelta(seconds=30)
    generators.append(Snowflake(engine, namespace="a", lease=lease, heartbeat=False, _clock=right))
    generators.append(Snowflake(engine, namespace="a", lease=lease, heartbeat=False, _clock=skewed))
    generators.append(Snowflake(engine, namespace="b", lease=lease, heartbeat=False, _clock=skewed))
    generators.append(Snowflake(engine, namespace="b", lease=lease, heartbeat=False, _clock=right))
    assert [ids.worker_id for ids in generators] == [0, 1, 0, 1]


@pytest.mark.clock
@SKEWS
def test_an_expired_worker_id_is_taken_whatever_the_clocks_say(
    engine: Engine, generators: list[Snowflake], skew: int
) -> None:
    """A dead generator's worker id is free after its lease of real time; the taker's ids still grow."""
    lease = timedelta(seconds=1)
    # The clock that is off is the dead holder's when it runs ahead, the taker's when it runs behind.
    dead_clock, taker_clock = VirtualClock(max(skew, 0)), VirtualClock(min(skew, 0))
    dead = Snowflake(engine, lease=lease, heartbeat=False, _clock=dead_clock)
    last = dead.next_id()
    _outlive(lease)  # the generator dies without close(): its lease runs out
    # When the dead holder's clock ran hours ahead, the taker must wait hours of its own clock
    # before its ids pass the dead one's.  It naps at most 50 ms between looks at the clock, so a
    # virtual sleep of exactly what is asked takes 200,000 naps and renews its lease every 7 of them
    # (20 s of COMMITs); a sleep may return late, and this one oversleeps to 30 s of virtual time.
    taker = Snowflake(
        engine,
        lease=lease,
        heartbeat=False,
        _clock=taker_clock,
        _sleep=lambda seconds: taker_clock.sleep(max(seconds, 30.0)),
    )
    generators.append(taker)
    assert taker.worker_id == dead.worker_id == 0
    assert taker.next_id() > last


# --------------------------------------------------------------------------
# Long transactions: the statement's time, not the transaction's start
# --------------------------------------------------------------------------


@pytest.mark.clock
def test_a_token_issued_late_in_a_long_transaction_gets_its_whole_ttl(engine: Engine) -> None:
    """A token issued 1.2 s into a transaction with ttl=1 s is live right after it (not so with now())."""
    with Session(engine) as session, session.begin():
        session.execute(select(tokens.c.token_hash)).all()  # the transaction has begun
        time.sleep(1.2)
        token = issue_token(session, scope="clock", ttl=timedelta(seconds=1))
    assert _consume(engine, token) is Outcome.APPLIED
