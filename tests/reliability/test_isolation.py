"""The transition and counter storms at the isolation levels other than each server's default.

PostgreSQL at REPEATABLE READ and SERIALIZABLE (the latter stands in for CockroachDB- and
YugabyteDB-style engines, where the 40001 retry path is what matters) and MariaDB at READ
COMMITTED and SERIALIZABLE.  The defaults (PostgreSQL READ COMMITTED, MariaDB REPEATABLE READ)
and SQLite's only level (SERIALIZABLE: one writer at a time) are in test_storms.py.

Every unit reads its rows first, as load-then-act code does, so at snapshot levels the guarded
statement meets rows changed since the snapshot: the database aborts it, stateguard raises
SerializationConflict or DeadlockDetected (never a raw driver error), and
``retry_on_conflict`` runs the unit again.  The invariants stay exact.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import Backend, _Namespaces, _only
from tests.reliability._storm import Sizes, check_counters, check_transitions, prepare, run_storm

#: (backend, level as SQLAlchemy takes it, level as the server reports it, a conflict is certain).
LEVELS = [
    ("postgresql", "REPEATABLE READ", "repeatable read", True),
    ("postgresql", "SERIALIZABLE", "serializable", True),
    ("mariadb", "READ COMMITTED", "READ-COMMITTED", False),
    ("mariadb", "SERIALIZABLE", "SERIALIZABLE", True),
]


@pytest.fixture(params=LEVELS, ids=[f"{b}-{level.replace(' ', '_').lower()}" for b, level, _, _ in LEVELS])
def level(
    request: pytest.FixtureRequest, namespaces: _Namespaces
) -> Iterator[tuple[Backend, str, str, bool]]:
    """Each (server, non-default isolation level) in turn."""
    name, level, reported, conflicts = request.param
    for backend in _only(name, namespaces):
        yield backend, level, reported, conflicts


#: What stateguard raises for a serialization failure or a deadlock (as noted by the workers).
TYPED = ("stateguard SerializationConflict", "stateguard DeadlockDetected")


def test_storms_at_non_default_isolation_levels(level: tuple[Backend, str, str, bool], sizes: Sizes) -> None:
    """8 processes run both storms at the level: conflicts come out typed and are retried, each
    transition applies once, nothing is oversold, every ref applies at most once."""
    backend, isolation, reported, certain = level
    setup = prepare(backend, sizes)
    storm = run_storm(setup.specs(isolation=isolation), timeout=sizes.timeout)
    assert {r.stats.isolation for r in storm.reports} == {reported}
    check_transitions(setup.engine, storm, setup.keys, exact=True)
    check_counters(setup.engine, storm, setup.stock, setup.plan, exact=True)
    raised, messages = storm.raised(), storm.messages()
    assert storm.untyped_conflicts() == {}, messages
    assert not any("(connection lost)" in k for k in raised), messages
    if certain:
        # 8 workers on 3 hot rows behind a snapshot read: the retry path must have been taken,
        # and what stateguard raised on the way was typed.
        typed = sum(n for k, n in raised.items() if k in TYPED)
        assert typed >= 1 and storm.total("conflicts") >= typed, messages
    storm.check_no_savepoint_regression()
