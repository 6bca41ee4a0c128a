"""What a replay of idempotent() gives back is exactly what the first call stored: responses and
checkpoints in both modes, the stored error of RequestFailed, and fingerprints that differ only
slightly are different requests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from stateguard import (
    IdempotencyKeyReused,
    RequestFailed,
    idempotent,
)
from tests._support.idem_items import Boom, _keys, md
from tests.conftest import Backend


@pytest.fixture
def eng(engine: Engine, backend: Backend) -> Iterator[Engine]:
    backend.create(md)
    yield engine


# --------------------------------------------------------------------------- 1. replay fidelity

WEIRD: list[Any] = [
    '{"a": 1}',
    '"quoted"',
    "back\\slash \\u0041 \\n",
    "line\nbreak\r\n\ttab",
    "sep\u2028para\u2029",
    "emoji 😀👩‍👩‍👧 é",
    "",
    "null",
    "x" * 100_000,
    "😀" * 70_000,  # 280 KB of 4-byte characters: more than a MariaDB TEXT column holds
    2**53 + 1,
    2**63 + 1,
    -(2**63) - 1,
    10**40,
    -0.0,
    0.1,
    1e308,
    None,
    True,
    [1, [2, [3, {"k": [None, "v\u2028", 2**64]}]]],
    {"z": 1, "a": {"\u2028": "\\", "": [], "😀": 2**70}},
]
IDS = [f"v{i}" for i in range(len(WEIRD))]


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and repr(a) == repr(b)


def test_same_transaction_replay_is_exact(eng: Engine) -> None:
    for k, value in zip(IDS, WEIRD, strict=True):
        with Session(eng) as s, s.begin(), idempotent(s, scope="st", key=k, fingerprint=value) as call:
            assert not call.replayed
            call.complete(value)
        with Session(eng) as s, s.begin(), idempotent(s, scope="st", key=k, fingerprint=value) as call:
            assert call.replayed
            assert _same(call.response, value), (k, repr(call.response)[:200], repr(value)[:200])


def test_separate_replay_and_checkpoint_takeover_are_exact(eng: Engine) -> None:
    for k, value in zip(IDS, WEIRD, strict=True):
        with Session(eng) as s, idempotent(s, scope="sep", key=k, fingerprint=value, mode="separate") as call:
            call.checkpoint("step", value)
            call.release("try again")
        with Session(eng) as s, idempotent(s, scope="sep", key=k, fingerprint=value, mode="separate") as call:
            assert call.taken_over and not call.replayed
            assert call.checkpoint_name == "step"
            assert _same(call.checkpoint_data, value), k
            call.complete(value)
        with Session(eng) as s, idempotent(s, scope="sep", key=k, fingerprint=value, mode="separate") as call:
            assert call.replayed
            assert _same(call.response, value), k


MESSAGES = [
    'he said "no"',
    "back\\slash",
    "multi\nline\r\n",
    "sep\u2028x",
    "😀 emoji",
    '{"json": 1}',
    "y" * 1990,
]


def test_request_failed_carries_the_stored_error(eng: Engine) -> None:
    for i, msg in enumerate(MESSAGES):
        with (
            pytest.raises(Boom),
            Session(eng) as s,
            idempotent(s, scope="f", key=f"k{i}", fingerprint=msg, mode="separate", non_retryable=(Boom,)),
        ):
            raise Boom(msg)
        for _ in range(2):
            with pytest.raises(RequestFailed) as caught, Session(eng) as s:
                with idempotent(s, scope="f", key=f"k{i}", fingerprint=msg, mode="separate"):
                    pytest.fail("a failed key ran again")
            assert caught.value.error == f"Boom: {msg}", repr(caught.value.error)[:300]


NEAR_TWINS: list[tuple[Any, Any]] = [
    (2**53, 2**53 + 1),
    (2**63, 2**63 + 1),
    (10**40, 10**40 + 1),
    ({"n": 2**53}, {"n": 2**53 + 1}),
    ("a\u2028", "a\u2029"),
    ("é", "e\u0301"),  # NFC vs NFD: distinct bytes
    (1, 1.0),
    (1, True),
    ("1", 1),
]


def test_near_identical_fingerprints_are_different_requests(eng: Engine) -> None:
    for i, (a, b) in enumerate(NEAR_TWINS):
        for first, second in ((a, b), (b, a)):
            k = f"k{i}-{first is a}"
            with Session(eng) as s, s.begin(), idempotent(s, scope="fp", key=k, fingerprint=first) as call:
                call.complete("first")
            with Session(eng) as s, s.begin(), idempotent(s, scope="fp", key=k, fingerprint=first) as call:
                assert call.replayed and call.response == "first"
            with pytest.raises(IdempotencyKeyReused), Session(eng) as s, s.begin():
                with idempotent(s, scope="fp", key=k, fingerprint=second):
                    pytest.fail(f"{second!r} replayed as {first!r}")


def test_ambiguous_keys_stay_distinct(eng: Engine) -> None:
    keys = ["k", "k ", "K", " k", "ß", "ss", "é", "e\u0301", "😀", "😁", "a\u2028", "a\u2029", "İ", "i"]
    for k in keys:
        with Session(eng) as s, s.begin(), idempotent(s, scope="amb", key=k) as call:
            assert not call.replayed, repr(k)
            call.complete(k)
    for k in keys:
        with Session(eng) as s, s.begin(), idempotent(s, scope="amb", key=k) as call:
            assert call.replayed and call.response == k
    assert sorted(_keys(eng, "amb")) == sorted(keys)


def test_replay_within_the_same_transaction(eng: Engine) -> None:
    with Session(eng) as s, s.begin():
        with idempotent(s, scope="same-tx", key="k", fingerprint={"a": 1, "b": 2}) as call:
            call.complete({"x": 2**64})
        with idempotent(s, scope="same-tx", key="k", fingerprint={"b": 2, "a": 1}) as call:
            assert call.replayed and call.response == {"x": 2**64}
