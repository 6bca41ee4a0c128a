"""Idempotency keys and scopes at their length limits, in any Unicode, are distinct records."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import (
    Engine,
    select,
)
from sqlalchemy.orm import Session

from stateguard import (
    InvalidArgument,
    idempotent,
)
from stateguard.tables import MAX_KEY, MAX_SCOPE, idempotency_keys
from tests._support.idem_claims import (
    _runs,
    _unit,
    ca_md,
)
from tests.conftest import Backend


@pytest.fixture
def eng(engine: Engine, backend: Backend) -> Iterator[Engine]:
    """stateguard's tables (conftest ``engine``) and ``ca_work`` on each backend, dropped afterwards."""
    backend.create(ca_md)
    yield engine


# --------------------------------------------------------------------------- 5. keys at their limits


@pytest.mark.limits
def test_max_length_unicode_keys_and_scopes_are_distinct_records(eng: Engine) -> None:
    """Keys of 255 and scopes of 200 characters (4-byte emoji too), and near-twins of them (last
    character, case, trailing space, NFC vs NFD) are distinct keys: each runs once and replays its
    own response; one character more is refused with nothing written."""
    scope_a = "s" * (MAX_SCOPE - 1) + "😀"
    scope_b = "s" * (MAX_SCOPE - 1) + "😁"
    keys = [
        "😀" * MAX_KEY,
        "😀" * (MAX_KEY - 1) + "😁",
        "a" * MAX_KEY,
        "A" + "a" * (MAX_KEY - 1),
        "a" * (MAX_KEY - 1) + " ",
        "caf\u00e9",
        "cafe\u0301",
    ]
    pairs = [(scope, key) for scope in (scope_a, scope_b) for key in keys]
    for i, (scope, key) in enumerate(pairs):
        assert _unit(eng, scope, key, f"r{i}", label=f"m{i}") == ("ran", {"by": f"r{i}"}), i
    for i, (scope, key) in enumerate(pairs):
        assert _unit(eng, scope, key, "again", label=f"m{i}") == ("replayed", {"by": f"r{i}"}), i
        assert _runs(eng, f"m{i}") == [f"r{i}"]
    for scope, key in ((scope_a, "😀" * (MAX_KEY + 1)), (scope_a + "x", "k")):
        with Session(eng) as s, s.begin(), pytest.raises(InvalidArgument):
            with idempotent(s, scope=scope, key=key):
                pytest.fail("an oversize key must not run")
    t = idempotency_keys
    with eng.connect() as c:
        stored = {tuple(r) for r in c.execute(select(t.c.scope, t.c.idem_key))}
    assert stored == set(pairs)
