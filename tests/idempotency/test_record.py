"""What a retry reads of the record is exactly what was stored, whatever the text (issue 19).

On PostgreSQL the claim hands the existing record back inside its own statement, packed as one JSON
array (``InsertOnce.insert_or_read``): every stored text (response, checkpoint name and data, the
error of a failed request) and every integer must come back unchanged through that packing, as they
do through the plain read the other backends use.  Texts are stored as the serializer returned them,
so an identity serializer puts arbitrary characters in the record: quotes, backslashes, control
characters, U+2028, characters outside the BMP, text that looks like JSON.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, update
from sqlalchemy.orm import Session

from stateguard import (
    InvalidArgument,
    RequestFailed,
    idempotent,
    on_idempotency_event,
)
from stateguard.tables import idempotency_keys


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
