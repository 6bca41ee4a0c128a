"""stateguard's JSON encoders (``_kernel.json_encoder``): the standard library's text and errors, built once.

Stored responses, checkpoint data, outbox payloads, history metadata and
request fingerprints all go through them; a fingerprint that changed its text
would make every stored key look like a reused one (IdempotencyKeyReused).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from stateguard import InvalidArgument, _kernel
from stateguard.idempotency import fingerprint_of

_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)


def _standard(value: Any, *, sort_keys: bool) -> str:
    return json.dumps(value, sort_keys=sort_keys, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


@given(_VALUES)
@example({"b": 1, "a": [1.5, None, True, "\u00e9\U0001f600"]})
@example("\udc80")  # a lone surrogate passes through the encoder as it is
@example({"\x00": "\x00"})
@example(-0.0)
@example(2**64)
def test_same_text_as_the_standard_encoder(value: Any) -> None:
    """Byte for byte the text json.dumps gives with the same options, sorted or not."""
    assert _kernel.json_encoder(sort_keys=True)(value) == _standard(value, sort_keys=True)
    assert _kernel.dumps_json(value) == _standard(value, sort_keys=False)


@given(st.dictionaries(st.text(max_size=8), _SCALARS, max_size=6))
@example({"amount": 100, "currency": "EUR", "customer": "c-1"})
def test_fingerprint_is_sha256_of_the_canonical_text(value: dict[str, Any]) -> None:
    """The stored fingerprint is what earlier releases stored: SHA-256 of ``json:`` + canonical JSON."""
    text = _standard(value, sort_keys=True)
    try:
        expected = hashlib.sha256(b"json:" + text.encode("utf-8")).hexdigest()
    except UnicodeEncodeError:
        with pytest.raises(InvalidArgument):
            fingerprint_of(value)
        return
    assert fingerprint_of(value) == expected


class _Unknown:
    pass


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (float("nan"), ValueError),
        ([1, float("inf")], ValueError),
        ({"when": _Unknown()}, TypeError),
        ({1, 2}, TypeError),
    ],
)
def test_same_errors_as_the_standard_encoder(value: Any, error: type[Exception]) -> None:
    """What JSON cannot carry is refused with the standard encoder's error type and message."""
    for sort_keys in (False, True):
        with pytest.raises(error) as ours:
            _kernel.json_encoder(sort_keys=sort_keys)(value)
        with pytest.raises(error) as theirs:
            _standard(value, sort_keys=sort_keys)
        assert str(ours.value) == str(theirs.value)


def test_a_cycle_is_the_standard_circular_reference_error() -> None:
    """Without the per-call bookkeeping a cycle first runs into RecursionError; the caller still gets
    the standard encoder's ValueError, and the next call encodes normally."""
    loop: list[Any] = [1]
    loop.append(loop)
    cyclic: dict[str, Any] = {"a": {}}
    cyclic["a"]["back"] = cyclic
    for value in (loop, cyclic):
        with pytest.raises(ValueError, match="Circular reference"):
            _kernel.dumps_json(value)
    assert _kernel.dumps_json({"after": [1]}) == '{"after":[1]}'
    with pytest.raises(InvalidArgument):
        fingerprint_of(loop)


def test_too_deep_is_recursion_error_as_before() -> None:
    """A value nested past the interpreter's limit is RecursionError, as from json.dumps."""
    deep: Any = 1
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(RecursionError):
        _kernel.dumps_json(deep)
    with pytest.raises(InvalidArgument, match="nested too deeply"):
        fingerprint_of(deep)
