"""Multi-process storms at each backend's default isolation level: 8 spawned processes, each with
its own engine, fire at the same rows in their own random order; the invariants are checked
exactly, from the database and from every worker's report.

Isolation levels other than the default are in test_isolation.py; faults in test_faults.py.
"""

from __future__ import annotations

from tests.conftest import Backend
from tests.reliability._storm import Sizes, check_counters, check_transitions, prepare, run_storm

#: What each backend runs at unless told otherwise (as the workers read it back).
DEFAULT_LEVEL = {"sqlite": None, "postgresql": "read committed", "mariadb": "REPEATABLE-READ"}


def test_storm_applies_each_transition_once_and_never_oversells(backend: Backend, sizes: Sizes) -> None:
    """8 processes fire pay, [cancel,] ship at every order and send every purchase (decrement or
    reserve with a ref) of an oversubscribed plan on 3 hot rows: each transition applies once with
    one side effect, no oversell, no lost update, each ref applied at most once, all-or-nothing."""
    setup = prepare(backend, sizes)
    storm = run_storm(setup.specs(), timeout=sizes.timeout)
    assert {r.stats.isolation for r in storm.reports} == {DEFAULT_LEVEL[backend.name]}
    check_transitions(setup.engine, storm, setup.keys, exact=True)
    check_counters(setup.engine, storm, setup.stock, setup.plan, exact=True)
    assert storm.untyped_conflicts() == {}, storm.messages()
    assert not any("(connection lost)" in k for k in storm.raised()), storm.messages()
    storm.check_no_savepoint_regression()


# The idempotency-key storm ("no key executed twice") is in test_idempotency_storm.py.
