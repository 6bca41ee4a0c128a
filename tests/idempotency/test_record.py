"""What a retry reads of the record is exactly what was stored, whatever the text.

On PostgreSQL the claim hands the existing record back inside its own statement, packed as one JSON
array (``InsertOnce.insert_or_read``): every stored text (response, checkpoint name and data, the
error of a failed request) and every integer must come back unchanged through that packing, as they
do through the plain read the other backends use.  Texts are stored as the serializer returned them,
so an identity serializer puts arbitrary characters in the record: quotes, backslashes, control
characters, U+2028, characters outside the BMP, text that looks like JSON.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import (
    Engine,
    insert,
    update,
)
from sqlalchemy.orm import Session

from stateguard import (
    InvalidArgument,
    RequestFailed,
    idempotent,
    on_idempotency_event,
)
from stateguard.tables import idempotency_keys
from tests._support.idem_claims import (
    Boom,
    _runs,
    _statements_of,
    _verbs,
    ca_md,
    work,
)
from tests.conftest import Backend, capable


class TextAsIs:
    """A serializer that stores a str as it is (so the record holds exactly the test's text)."""

    def dumps(self, value: Any) -> str:
        """``value`` itself; it must be a str."""
        if not isinstance(value, str):
            raise TypeError("TextAsIs stores str only")
        return value

    def loads(self, text: str) -> Any:
        """``text`` itself."""
        return text


#: Any text a database stores: no NUL (PostgreSQL) and no lone surrogates (no UTF-8 for them).
storable = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=300)

_keys = itertools.count()


def _key() -> str:
    return f"record-{next(_keys)}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(response=storable)
@example(response='["not", "the", "record"]')
@example(response='\\"\\\\\n\r\t\x01\x1f\x7f\u2028\u2029')
@example(response="\U0001f600 \uffff \U0010ffff é ß")
@example(response="")
@example(response="null")
def test_a_replay_returns_the_stored_text_exactly(engine: Engine, response: str) -> None:
    key = _key()
    for replay in (False, True):
        with Session(engine) as session, session.begin():
            with idempotent(session, scope="rec", key=key, serializer=TextAsIs()) as call:
                assert call.replayed is replay
                if replay:
                    assert call.response == response
                else:
                    call.complete(response)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.text(
        st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), min_size=1, max_size=100
    ).filter(str.strip),
    data=storable,
)
@example(name="'\"\\", data='{"a": [1, "\\u0000"]}')
def test_a_takeover_reads_the_checkpoint_exactly(engine: Engine, name: str, data: str) -> None:
    """A released claim's checkpoint name and data reach the worker that takes it over unchanged."""
    key = _key()
    with Session(engine) as session:
        with idempotent(session, scope="rec", key=key, mode="separate", serializer=TextAsIs()) as call:
            call.checkpoint(name, data)
            call.release()
    with Session(engine) as session:
        with idempotent(session, scope="rec", key=key, mode="separate", serializer=TextAsIs()) as call:
            assert call.taken_over and call.attempt == 2
            assert call.checkpoint_name == name and call.checkpoint_data == data
            call.complete("done")


@pytest.mark.parametrize("attempt", [1, 2**31 - 1])
def test_a_failed_request_reports_its_stored_error_and_attempt(engine: Engine, attempt: int) -> None:
    """The error text and the attempt count (up to the column's range) come back through the record."""
    key = _key()
    message = 'card declined: "insufficient funds" \\ \u2028 \U0001f4b3'
    with Session(engine) as session:
        with (
            pytest.raises(ValueError),
            idempotent(session, scope="rec", key=key, mode="separate", non_retryable=(ValueError,)),
        ):
            raise ValueError(message)
    with engine.begin() as conn:
        conn.execute(
            update(idempotency_keys).where(idempotency_keys.c.idem_key == key).values(attempt=attempt)
        )
    seen: list[Any] = []
    remove = on_idempotency_event(lambda event: seen.append((event.kind, event.attempt)))
    try:
        with Session(engine) as session, pytest.raises(RequestFailed) as failed:
            with idempotent(session, scope="rec", key=key, mode="separate", ttl=timedelta(hours=1)):
                pass
    finally:
        remove()
    assert failed.value.error == f"ValueError: {message}"
    assert seen == [("failed_replayed", attempt)]


@dataclass(frozen=True)
class Tagged:
    """A serializer that marks what it stores; instances with different tags compare equal."""

    tag: str = field(compare=False)

    def dumps(self, value: Any) -> str:
        """``value`` as ``tag:value``."""
        return f"{self.tag}:{value}"

    def loads(self, text: str) -> Any:
        """The stored text."""
        return text


def test_each_call_stores_through_its_own_serializer(engine: Engine) -> None:
    """The checked options are memoised per policy, but never the serializer: two serializers
    that compare equal (and hash alike) still each store what they make."""
    assert Tagged("a") == Tagged("b") and hash(Tagged("a")) == hash(Tagged("b"))
    for tag in ("a", "b"):
        with Session(engine) as session, session.begin():
            with idempotent(session, scope="rec", key=f"tagged-{tag}", serializer=Tagged(tag)) as call:
                call.complete("x")
        with Session(engine) as session, session.begin():
            with idempotent(session, scope="rec", key=f"tagged-{tag}", serializer=Tagged("z")) as call:
                assert call.replayed and call.response == f"{tag}:x"


@pytest.mark.hostile
@pytest.mark.parametrize(
    "options",
    [
        {"lease": [1]},
        {"mode": ["same_transaction"]},
        {"non_retryable": [ValueError]},
        {"ttl": timedelta(seconds=1), "lease": timedelta(seconds=2)},
        {"heartbeat_every": timedelta(seconds=1)},
    ],
)
def test_bad_options_are_refused_every_time(engine: Engine, options: dict[str, Any]) -> None:
    """Unhashable or invalid options are InvalidArgument on every call, memo or not."""
    for _ in range(2):
        with Session(engine) as session, pytest.raises(InvalidArgument):
            idempotent(session, scope="rec", key="bad", **options)


@pytest.fixture
def eng(engine: Engine, backend: Backend) -> Iterator[Engine]:
    """stateguard's tables (conftest ``engine``) and ``ca_work`` on each backend, dropped afterwards."""
    backend.create(ca_md)
    yield engine


# --------------------------------------------------------------------------- 4. what the JSON carries

_TEXTS: list[Any] = [
    '"',
    "\\",
    '\\"',
    "null",
    "",
    "\\u0000",
    "\\ud83d",
    "\u2028\u2029",
    "é😀\U0010ffff\ufeff",
    "\x01\x1f\x7f\t\r\n",
    "</script><!--",
    '{"by": "someone else"}',
    "[1,",
    "x" * 300_000,
    {"\\": '"', "null": None, "😀": ["\u2028", 2**63 - 1, -(2**63)]},
    2**64 + 1,
    None,
]


class _RawText:
    """A serializer that stores the response text exactly as given (not JSON)."""

    def dumps(self, value: Any) -> str:
        if not isinstance(value, str):
            raise TypeError("text only")
        return value

    def loads(self, text: str) -> Any:
        return text


@pytest.mark.hostile
def test_replays_carry_hostile_text_exactly_through_the_record(eng: Engine, backend: Backend) -> None:
    """Responses with quotes, backslashes, escapes-as-text, "null", unicode and 300 K characters
    come back from a replay exactly (PostgreSQL: a replay is the one WITH statement, so the record
    travelled inside json_build_array); also raw non-JSON text through a custom serializer."""
    raw = _RawText()
    cases: list[tuple[Any, Any]] = [(v, None) for v in _TEXTS]
    cases += [(v, raw) for v in _TEXTS if isinstance(v, str)]
    for i, (value, serializer) in enumerate(cases):
        key = f"t{i}"
        with Session(eng) as s, s.begin(), idempotent(s, scope="ca4", key=key, serializer=serializer) as call:
            assert not call.replayed
            s.execute(insert(work).values(label=key, by="first"))
            call.complete(value)
        with Session(eng) as s, s.begin():
            with (
                _statements_of(s.connection()) as seen,
                idempotent(s, scope="ca4", key=key, serializer=serializer) as call,
            ):
                assert call.replayed, (i, value if not isinstance(value, str) else value[:40])
                got = call.response
        assert type(got) is type(value) and got == value, (i, repr(got)[:80], repr(value)[:80])
        if capable(backend, "writable_cte"):
            assert _verbs(seen) == ["WITH"], seen
        assert _runs(eng, key) == ["first"]


_NAME = 'ph"ase\\1 é😀' + "n" * 80  # 93 characters: the checkpoint name holds 100


def test_checkpoint_and_error_text_survive_the_record_transport(eng: Engine, backend: Backend) -> None:
    """Separate mode: a checkpoint (hostile name and data) is handed to the taker exactly, and a
    non-retryable error's text with quotes, backslashes and unicode is the RequestFailed.error."""
    data = {"\\": ['"', "null", "\\u0041"], "é😀": 2**62, "": None}
    with Session(eng) as s:
        with pytest.raises(Boom), idempotent(s, scope="ca5", key="cp", mode="separate") as call:
            s.execute(insert(work).values(label="cp", by="first"))
            call.checkpoint(_NAME, data)
            raise Boom("retry me")
    with Session(eng) as s, idempotent(s, scope="ca5", key="cp", mode="separate") as call:
        assert not call.replayed and call.taken_over and call.attempt == 2
        assert call.checkpoint_name == _NAME
        assert call.checkpoint_data == data
        call.complete("done")
    assert _runs(eng, "cp") == ["first"]  # the checkpointed phase committed; the taker did not redo it

    message = 'card "declined" \\ é😀 \u2028 null'
    with Session(eng) as s:
        with (
            pytest.raises(Boom),
            idempotent(s, scope="ca5", key="fail", mode="separate", non_retryable=(Boom,)),
        ):
            raise Boom(message)
    with Session(eng) as s:
        with pytest.raises(RequestFailed) as caught, idempotent(s, scope="ca5", key="fail", mode="separate"):
            pytest.fail("a failed-for-good key must not run again")
    assert caught.value.error == f"Boom: {message}"
