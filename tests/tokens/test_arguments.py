"""Values given to the one-time token calls: hostile scopes and request ids are typed and send nothing,
lengths count characters, bad and extreme ttls, exact comparison of scope and token, and wrong
session objects, on every backend."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from stateguard import (
    InvalidArgument,
    Outcome,
    consume_once,
    consume_token,
    issue_token,
    purge_expired_tokens,
)
from stateguard.tables import consumed_messages
from tests._support.token_races import (
    HOUR,
    SHORT,
    _consume,
    _issue,
    _token_rows,
)
from tests.conftest import Backend, count_statements

# --------------------------------------------------------------------------
# One-time tokens: hostile values, ttl and clock
# --------------------------------------------------------------------------

HOSTILE = [
    pytest.param("a\x00b", id="nul"),
    pytest.param("tok\ud800", id="lone-surrogate"),
    pytest.param(b"bytes-token", id="bytes"),
    pytest.param(None, id="none"),
    pytest.param(12345, id="int"),
    pytest.param("", id="empty"),
    pytest.param(" \t\n", id="blank"),
    pytest.param("x" * 256, id="256-chars"),
]


@pytest.mark.hostile
@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_token_scope_and_request_id_are_typed_send_nothing_and_keep_the_transaction(
    engine: Engine, value: Any
) -> None:
    """Each hostile value as the token, the scope and the request_id is an InvalidArgument before any
    statement; the caller's transaction (PostgreSQL aborts on a failed statement) stays usable."""
    token = _issue(engine, "hostile")
    with Session(engine) as session, session.begin():
        session.connection()
        with count_statements(engine) as sent:
            with pytest.raises(InvalidArgument):
                consume_token(session, value, scope="hostile")
            with pytest.raises(InvalidArgument):
                consume_token(session, token, scope=value)
            if value is not None:  # None is "no request id"
                with pytest.raises(InvalidArgument):
                    consume_token(session, token, scope="hostile", request_id=value)
            with pytest.raises(InvalidArgument):
                issue_token(session, scope=value, ttl=HOUR)
            with pytest.raises(InvalidArgument):
                consume_once(session, value, "m")
            with pytest.raises(InvalidArgument):
                consume_once(session, "c", value)
        assert len(sent) == 0, sent.statements
        assert consume_token(session, token, scope="hostile").outcome is Outcome.APPLIED
        assert consume_once(session, "c", "m").applied


@pytest.mark.hostile
@pytest.mark.limits
def test_values_at_the_length_limits_are_characters_not_bytes(engine: Engine, backend: Backend) -> None:
    """Limits count characters: a 200-emoji scope, a 255-emoji message id and a 200-emoji request id
    work (4 UTF-8 bytes each on MariaDB's utf8mb4); one more character is InvalidArgument; keys that
    differ only in their last 4-byte character stay distinct (nothing truncated)."""
    scope = "\U0001f600" * 200
    token = _issue(engine, scope)
    rid = "\u00e9" * 199 + "\U0001f4b3"
    first = _consume(engine, token, scope, request_id=rid)
    assert first.outcome is Outcome.APPLIED
    again = _consume(engine, token, scope, request_id=rid)
    assert (again.outcome, again.same_request) == (Outcome.REPEATED, True)
    assert _consume(engine, "\U0001f600" * 255, scope).outcome is Outcome.NOT_FOUND
    with Session(engine) as session, session.begin():
        with pytest.raises(InvalidArgument):
            issue_token(session, scope=scope + "x", ttl=HOUR)
        with pytest.raises(InvalidArgument):
            consume_token(session, "\U0001f600" * 256, scope=scope)
        with pytest.raises(InvalidArgument):
            consume_token(session, token, scope=scope, request_id=rid + "x")
        consumer = "\u4e2d" * 200
        m1, m2 = "m" * 254 + "\U0001f600", "m" * 254 + "\U0001f601"
        assert consume_once(session, consumer, m1).applied
        assert consume_once(session, consumer, m2).applied
        assert consume_once(session, consumer, m1).outcome is Outcome.REPEATED
        with pytest.raises(InvalidArgument):
            consume_once(session, consumer + "x", m1)
        with pytest.raises(InvalidArgument):
            consume_once(session, consumer, m1 + "x")
    with engine.connect() as conn:
        stored = set(conn.execute(select(consumed_messages.c.message_id)).scalars())
    assert stored == {m1, m2}


@pytest.mark.hostile
@pytest.mark.parametrize(
    "ttl",
    [timedelta(0), timedelta(seconds=-1), timedelta(microseconds=999), 60, 1.5, None, "1h"],
    ids=["zero", "negative", "sub-ms", "int", "float", "none", "str"],
)
def test_bad_ttls_are_typed_and_write_nothing(engine: Engine, ttl: Any) -> None:
    with Session(engine) as session, session.begin():
        with pytest.raises(InvalidArgument):
            issue_token(session, scope="ttl", ttl=ttl)
    assert _token_rows(engine) == 0


@pytest.mark.hostile
@pytest.mark.limits
def test_extreme_ttls_one_ms_and_timedelta_max(engine: Engine, backend: Backend) -> None:
    """ttl=1 ms expires (REJECTED, then purged); ttl=timedelta.max (~2.7 million years) is live,
    consumable once, and never purged."""
    tiny = _issue(engine, "ttl", timedelta(milliseconds=1))
    huge = _issue(engine, "ttl", timedelta.max)
    time.sleep(0.05)
    assert _consume(engine, tiny, "ttl").outcome is Outcome.REJECTED
    assert purge_expired_tokens(engine) == 1
    assert _consume(engine, tiny, "ttl").outcome is Outcome.NOT_FOUND
    assert _consume(engine, huge, "ttl").outcome is Outcome.APPLIED
    assert purge_expired_tokens(engine) == 0
    assert _consume(engine, huge, "ttl").outcome is Outcome.REPEATED


@pytest.fixture
def skewed_clock(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """Skew the application process's wall clock (time.time and time.time_ns) by some seconds."""
    real_time, real_ns = time.time, time.time_ns

    def skew(seconds: float) -> None:
        monkeypatch.setattr(time, "time", lambda: real_time() + seconds)
        monkeypatch.setattr(time, "time_ns", lambda: real_ns() + int(seconds * 1e9))

    return skew


@pytest.mark.hostile
@pytest.mark.clock
@pytest.mark.parametrize("hours", [-6, 6, 24 * 365])
def test_expiry_is_judged_on_the_database_clock_whatever_the_app_clock(
    engine: Engine, backend: Backend, skewed_clock: Callable[[float], None], hours: int
) -> None:
    """With the application's wall clock hours off in either direction: a 1-hour token is live, a
    short one expires after its real ttl, and a purge removes only the expired one."""
    skewed_clock(hours * 3600)
    live = _issue(engine, "skew")
    short = _issue(engine, "skew", SHORT)
    assert _consume(engine, live, "skew").outcome is Outcome.APPLIED
    skewed_clock(-hours * 3600)
    time.sleep(SHORT.total_seconds() * 2)
    assert _consume(engine, short, "skew").outcome is Outcome.REJECTED
    assert purge_expired_tokens(engine) == 1
    assert _consume(engine, live, "skew").outcome is Outcome.REPEATED


@pytest.mark.hostile
def test_request_id_tells_the_same_request_apart(engine: Engine) -> None:
    """A retry with the consuming request id is REPEATED with same_request=True (a UUID equals its
    text); any other id, or none, is REPEATED with same_request=False."""
    rid = uuid.uuid4()
    token = _issue(engine, "rid")
    assert _consume(engine, token, "rid", request_id=rid).outcome is Outcome.APPLIED
    for other, same in [(rid, True), (str(rid), True), (str(uuid.uuid4()), False), (None, False)]:
        result = _consume(engine, token, "rid", request_id=other)
        assert (result.outcome, result.same_request) == (Outcome.REPEATED, same), other


@pytest.mark.hostile
def test_scope_and_token_compare_exactly(engine: Engine, backend: Backend) -> None:
    """MariaDB's default collations fold case and pad spaces: a token of scope "Pay:1" must be
    NOT_FOUND in "pay:1", "Pay:1 " and "Pay:1\\t", and the token's own case and trailing space matter."""
    token = _issue(engine, "Pay:1")
    for scope in ["pay:1", "Pay:1 ", "PAY:1", "Pay:1\t", "\uff30ay:1"]:
        assert _consume(engine, token, scope).outcome is Outcome.NOT_FOUND, repr(scope)
    for variant in [token.swapcase(), token + " ", " " + token]:
        assert _consume(engine, variant, "Pay:1").outcome is Outcome.NOT_FOUND, repr(variant)
    assert _consume(engine, token, "Pay:1").outcome is Outcome.APPLIED


@pytest.mark.hostile
def test_wrong_session_objects_are_invalid_argument_and_scoped_session_works(engine: Engine) -> None:
    """Errors: an Engine, a Connection or a sessionmaker where a Session is expected is InvalidArgument;
    a scoped_session is used through its current session."""
    factory = sessionmaker(engine)
    with engine.connect() as conn:
        for wrong in (engine, conn, factory):
            with pytest.raises(InvalidArgument):
                issue_token(wrong, scope="s", ttl=HOUR)
            with pytest.raises(InvalidArgument):
                consume_token(wrong, "t", scope="s")
            with pytest.raises(InvalidArgument):
                consume_once(wrong, "c", "m")
    scoped = scoped_session(factory)
    try:
        token = issue_token(scoped, scope="s", ttl=HOUR)
        scoped.commit()
        assert consume_token(scoped, token, scope="s").applied
        assert consume_once(scoped, "c", "m").applied
        scoped.commit()
    finally:
        scoped.remove()
    assert _consume(engine, token, "s").outcome is Outcome.REPEATED
