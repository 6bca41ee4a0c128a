"""Hostile values at idempotent(), on every SQL backend and in both modes.

NUL characters (PostgreSQL refuses them in text), lone surrogates (no UTF-8
for them), NaN and infinity, nesting too deep for JSON, over-long release
reasons and responses larger than the server accepts (MariaDB's
``max_allowed_packet``): each is InvalidArgument before any statement, the
database keeps what it had, the transaction stays usable and the key is not
stuck in progress.  Exception messages are stored sanitised, so a block that
raises one never leaves its key in progress for a whole lease.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, select, text
from sqlalchemy.orm import Session

from stateguard import (
    InvalidArgument,
    RequestFailed,
    create_tables,
    drop_tables,
    idempotent,
)
from stateguard.idempotency import fingerprint_of
from stateguard.tables import idempotency_keys
from tests._support.idem_items import md
from tests.conftest import Backend

MODES = pytest.mark.parametrize("mode", ["same_transaction", "separate"])


def _deep(depth: int = 100_000) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


class NulSerializer:
    """A serializer whose text holds a NUL (JSON never does: it escapes it)."""

    def dumps(self, value: Any) -> str:
        """The value's repr with a NUL in it."""
        return f"{value!r}\x00"

    def loads(self, text: str) -> Any:
        """The text itself."""
        return text


#: name -> (value to store, serializer or None for JSON)
HOSTILE: dict[str, tuple[Any, Any]] = {
    "nan": ({"amount": float("nan")}, None),
    "infinity": ([float("-inf")], None),
    "too-deep": (_deep(), None),
    "lone-surrogate": ({"name": "a\udc80b"}, None),
    "lone-surrogate-key": ({"\ud800": 1}, None),
    "nul-from-serializer": ("x", NulSerializer()),
}


def _row(engine: Engine, key: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(select(idempotency_keys).where(idempotency_keys.c.idem_key == key)).first()


def _free(engine: Engine, key: str, mode: str) -> None:
    """The key was left free: a retry runs at once (a new claim, or a takeover of a released one)."""
    row = _row(engine, key)
    if mode == "same_transaction":
        assert row is None, "the savepoint with the claim must be rolled back"
    else:
        assert row is not None and row.status == "in_progress" and row.locked_until_ms == 0
    with Session(engine) as session:
        with idempotent(session, scope="hostile", key=key, mode=mode) as call:
            assert not call.replayed
            call.complete("retried")
        session.commit()
    assert _row(engine, key).response == '"retried"'


def _usable(session: Session) -> None:
    """The session's transaction still runs statements and commits."""
    assert session.execute(text("SELECT 1")).scalar_one() == 1
    session.commit()


def _refused(
    engine: Engine, key: str, mode: str, work: Callable[[Any], object], serializer: Any = None
) -> None:
    """Run ``work(call)`` in a claim of ``key``; it must raise InvalidArgument, leaving things as promised."""
    with Session(engine) as session:
        with pytest.raises(InvalidArgument):
            with idempotent(session, scope="hostile", key=key, mode=mode, serializer=serializer) as call:
                work(call)
        _usable(session)
    _free(engine, key, mode)


@pytest.mark.hostile
@MODES
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_response_is_refused_and_the_key_is_free(engine: Engine, mode: str, case: str) -> None:
    """complete() with a value no database stores is InvalidArgument; nothing stored, the key free."""
    value, serializer = HOSTILE[case]
    _refused(engine, case, mode, lambda call: call.complete(value), serializer)


@pytest.mark.hostile
@MODES
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_checkpoint_data_is_refused_and_the_key_is_free(engine: Engine, mode: str, case: str) -> None:
    """checkpoint() with data no database stores is InvalidArgument; nothing stored, the key free."""
    value, serializer = HOSTILE[case]
    _refused(engine, case, mode, lambda call: call.checkpoint("phase", value), serializer)


@pytest.mark.hostile
@MODES
def test_a_refused_response_leaves_the_call_open_for_a_good_one(engine: Engine, mode: str) -> None:
    """After complete() refused a value, the same call completes with another and it is replayed."""
    with Session(engine) as session:
        with idempotent(session, scope="hostile", key="again", mode=mode) as call:
            with pytest.raises(InvalidArgument):
                call.complete({"x": float("nan")})
            call.complete({"x": None})
        session.commit()
    with Session(engine) as session, idempotent(session, scope="hostile", key="again", mode=mode) as call:
        assert call.replayed and call.response == {"x": None}


@pytest.mark.hostile
@MODES
@pytest.mark.parametrize(
    "reason",
    ["nul\x00inside", "lone \udc80 surrogate", "x" * 70_000, 42],
    ids=["nul", "surrogate", "long", "int"],
)
def test_a_hostile_release_reason_is_refused_and_the_key_is_free(
    engine: Engine, mode: str, reason: Any
) -> None:
    """release() with a reason no database stores (or 70,000 characters, or not a str) is InvalidArgument."""
    _refused(engine, "release", mode, lambda call: call.release(reason))


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("where", "value"),
    [
        ("key", "k\x00"),
        ("key", "k\udc80"),
        ("scope", "s\x00"),
        ("scope", "s\ud800"),
        ("fingerprint", _deep()),
        ("fingerprint", {"amount": float("nan")}),
        ("fingerprint", {"name": "\udc80"}),
    ],
)
@MODES
def test_hostile_keys_scopes_and_fingerprints_are_refused_before_any_statement(
    engine: Engine, mode: str, where: str, value: Any
) -> None:
    """A key or scope with NUL or a lone surrogate, or an unusable fingerprint, is refused by idempotent()."""
    options = {"scope": "hostile", "key": "k", "fingerprint": None, **{where: value}}
    with Session(engine) as session:
        with pytest.raises(InvalidArgument):
            idempotent(session, mode=mode, **options)
        assert not session.in_transaction()
    with engine.connect() as conn:
        assert conn.execute(select(idempotency_keys)).first() is None


@pytest.mark.hostile
def test_fingerprint_refusals_are_value_errors() -> None:
    """fingerprint_of's refusals are InvalidArgument, a ValueError (the middleware then compares bytes)."""
    for value in ({"name": "\udc80"}, _deep(), float("nan")):
        with pytest.raises(InvalidArgument) as caught:
            fingerprint_of(value)
        assert isinstance(caught.value, ValueError)


class BrokenStr(Exception):
    """An exception whose message cannot even be read."""

    def __str__(self) -> str:
        raise RuntimeError("no message")


@pytest.mark.hostile
@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("nul\x00inside"),
        RuntimeError("lone \udc80 surrogate"),
        RuntimeError("x" * 100_000),
        BrokenStr(),
    ],
    ids=["nul", "surrogate", "long", "broken-str"],
)
def test_an_exception_message_no_database_stores_still_releases_the_key(
    engine: Engine, error: Exception
) -> None:
    """Separate mode: the block's exception propagates as it was and the key is released, not stuck."""
    with Session(engine) as session:
        with pytest.raises(type(error)) as caught:
            with idempotent(session, scope="hostile", key="raised", mode="separate"):
                raise error
        assert caught.value is error
    row = _row(engine, "raised")
    assert row.status == "in_progress" and row.locked_until_ms == 0
    assert row.error.startswith(type(error).__name__) and "\x00" not in row.error and len(row.error) <= 2000
    with (
        Session(engine) as session,
        idempotent(session, scope="hostile", key="raised", mode="separate") as call,
    ):
        assert call.taken_over and call.attempt == 2
        call.complete("second try")


@pytest.mark.hostile
def test_a_non_retryable_exception_with_a_nul_is_stored_readable(engine: Engine) -> None:
    """Failed for good with a NUL in its message: the retry gets RequestFailed with the escaped text."""
    with Session(engine) as session, pytest.raises(ValueError):
        with idempotent(session, scope="hostile", key="failed", mode="separate", non_retryable=(ValueError,)):
            raise ValueError("card\x00declined \udc80")
    with Session(engine) as session, pytest.raises(RequestFailed) as caught:
        with idempotent(session, scope="hostile", key="failed", mode="separate"):
            pytest.fail("a failed key must not run again")
    assert caught.value.error == "ValueError: card\\x00declined \\udc80"


# --------------------------------------------------------------------------
# Responses larger than the server accepts (MariaDB's max_allowed_packet)
# --------------------------------------------------------------------------


def _packet(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT @@max_allowed_packet")).scalar_one())


@pytest.mark.hostile
@pytest.mark.limits
@MODES
@pytest.mark.parametrize("shape", ["plain", "escaped"])
def test_a_response_over_the_packet_limit_is_refused_on_mariadb(
    mariadb: Backend, mode: str, shape: str
) -> None:
    """A response the server would refuse (raw 1153, dropped connection) is InvalidArgument; key free.

    MariaDB only: the other backends' statement limits are above what a stored value may hold.
    """
    engine = mariadb.engine
    drop_tables(engine)
    create_tables(engine)
    packet = _packet(engine)
    if packet > 64 * 1024 * 1024:
        pytest.skip(f"max_allowed_packet is {packet}: too large to exceed in a test")
    # "escaped": JSON writes each quote as \" and the driver escapes both characters again,
    # so the text fits the packet as counted by len() but not as sent.
    big = "x" * packet if shape == "plain" else '"' * (packet // 3)
    _refused(engine, f"big-{shape}", mode, lambda call: call.complete(big))


@pytest.mark.hostile
@MODES
def test_a_large_response_under_the_limit_is_stored_and_replayed(
    backend: Backend, engine: Engine, mode: str
) -> None:
    """A response just under the server's limit (8 MiB elsewhere) is stored and replayed whole."""
    size = _packet(engine) - 64 * 1024 if backend.name == "mariadb" else 8 * 1024 * 1024
    big = "y" * size
    for replay in (False, True):
        with Session(engine) as session:
            with idempotent(session, scope="hostile", key="large", mode=mode) as call:
                assert call.replayed is replay
                if replay:
                    assert call.response == big
                else:
                    call.complete(big)
            session.commit()


@pytest.fixture
def eng(engine: Engine, backend: Backend) -> Iterator[Engine]:
    backend.create(md)
    yield engine


@pytest.mark.hostile
@pytest.mark.limits
@pytest.mark.parametrize("mode", ["same_transaction", "separate"])
@pytest.mark.parametrize("slack", [1, 64, 400, 2000])
def test_mariadb_responses_at_the_packet_limit_store_or_refuse_cleanly(
    mariadb: Backend, mode: str, slack: int
) -> None:
    """Just under max_allowed_packet: the text fits, the statement around it may not.  Either it is
    stored and replays, or InvalidArgument leaves the call open; never a dropped connection."""
    from stateguard import InvalidArgument, create_tables, drop_tables

    eng = mariadb.engine
    drop_tables(eng)
    create_tables(eng)

    with eng.connect() as c:
        limit = int(c.scalar(text("SELECT @@max_allowed_packet")))
    big = "x" * (limit - slack - 2)  # its JSON text is limit - slack bytes
    stored: Any = None
    with Session(eng) as s:
        tx = s.begin() if mode == "same_transaction" else None
        with idempotent(s, scope="pk", key="k", mode=mode) as call:  # type: ignore[arg-type]
            try:
                stored = call.complete(big)
            except InvalidArgument:
                stored = call.complete("small")
        if tx:
            tx.commit()
    with Session(eng) as s, idempotent(s, scope="pk", key="k", mode="separate") as call:
        assert call.replayed
        assert call.response == stored
    drop_tables(eng)
