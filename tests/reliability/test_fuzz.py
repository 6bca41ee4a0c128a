"""Hypothesis-driven fuzz of concurrent calls: a few threads run random programs of pay, cancel,
ship and decrement (with and without refs) at the same few rows, and the database must end
exactly where a pure model, replayed from the APPLIED results alone, says it must.

Hypothesis picks the programs (and small pauses that shift the interleavings); the threads
and the database pick the interleaving.  The check holds for any interleaving:

* orders: the APPLIED transitions of a row, sorted by the version each produced, are versions
  2, 3, ... without a gap or a twin, and replay from ``pending`` along the declared graph to
  the row's state and version; every call that did not apply reports a (state, version) the
  row really had on that path, from which its trigger is not allowed, REPEATED exactly when
  that state is the trigger's destination;
* stock: the final quantity is the initial one minus the APPLIED amounts, never below zero;
  the ledger holds exactly the refs that APPLIED, once each; REPEATED only for a ref that
  applied; INSUFFICIENT only for an amount the final stock cannot cover (stock only goes
  down, so short once means short at the end).

tests/test_property.py checks single calls against the model step by step, one thread at a time.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, defaultdict
from typing import Any, NamedTuple

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete, insert, select
from sqlalchemy.orm import Session

from stateguard import Result, decrement, retry_on_conflict
from stateguard.tables import counter_ledger
from stateguard.tables import metadata as stateguard_metadata
from tests._support.counter_workers import Bin, CounterBase
from tests._support.models import Base, Order
from tests.conftest import Backend
from tests.reliability._storm import Sizes

# The declared graph, restated (the model must not read stateguard's copy).
SOURCES = {"pay": {"pending"}, "ship": {"paid"}, "cancel": {"pending", "paid"}}
DEST = {"pay": "paid", "ship": "shipped", "cancel": "cancelled"}

KEYS = (1, 2, 3)
STOCK = {1: 7, 2: 4}


class Op(NamedTuple):
    what: str  # a trigger, or "decrement"
    key: int  # an order, or a bin
    amount: int = 0
    ref: str | None = None
    pause: bool = False  # sleep a moment before the call, to shift the interleaving


class Call(NamedTuple):
    op: Op
    outcome: str
    state: Any
    version: int | None


@st.composite
def programs(draw: st.DrawFn) -> list[list[Op]]:
    """2-4 threads' lists of calls; refs are drawn from a shared pool, so threads send the same ones."""
    refs = draw(
        st.lists(st.tuples(st.sampled_from(sorted(STOCK)), st.integers(1, 3)), min_size=1, max_size=5)
    )
    pool = {f"r{i}": spec for i, spec in enumerate(refs)}
    transition = st.builds(
        lambda trigger, key, pause: Op(trigger, key, pause=pause),
        st.sampled_from(sorted(DEST)),
        st.sampled_from(KEYS),
        st.booleans(),
    )
    with_ref = st.builds(
        lambda ref, pause: Op("decrement", *pool[ref], ref=ref, pause=pause),
        st.sampled_from(sorted(pool)),
        st.booleans(),
    )
    without_ref = st.builds(
        lambda key, amount, pause: Op("decrement", key, amount, pause=pause),
        st.sampled_from(sorted(STOCK)),
        st.integers(1, 3),
        st.booleans(),
    )
    op = st.one_of(transition, with_ref, without_ref)
    return draw(st.lists(st.lists(op, min_size=1, max_size=10), min_size=2, max_size=4))


def reset(backend: Backend) -> None:
    with Session(backend.engine) as s, s.begin():
        s.execute(delete(counter_ledger))
        s.execute(delete(Order))
        s.execute(delete(Bin))
        s.execute(insert(Order), [{"id": k, "status": "pending"} for k in KEYS])
        s.execute(insert(Bin), [{"id": k, "qty": q} for k, q in STOCK.items()])


def call(backend: Backend, op: Op) -> Call:
    """One op in its own transaction, retried on conflicts as an application would."""

    def unit() -> Result:
        with Session(backend.engine) as s, s.begin():
            if op.what == "decrement":
                return decrement(s, Bin.qty, op.key, by=op.amount, ref=op.ref)
            return Order.flow.fire(s, op.what, op.key)

    r = retry_on_conflict(unit, attempts=200, backoff=0.001, max_backoff=0.02)
    return Call(op, r.outcome.name, r.state, r.version)


def run(backend: Backend, program: list[list[Op]]) -> list[Call]:
    """Every thread's program at once (released by one barrier); every call's result."""
    barrier = threading.Barrier(len(program))
    calls: list[Call] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def thread(ops: list[Op]) -> None:
        try:
            barrier.wait(30)
            for op in ops:
                if op.pause:
                    time.sleep(random.uniform(0, 0.003))
                c = call(backend, op)
                with lock:
                    calls.append(c)
        except BaseException as error:  # re-raised in the test's thread below
            barrier.abort()
            errors.append(error)

    threads = [threading.Thread(target=thread, args=(ops,)) for ops in program]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]
    assert len(calls) == sum(map(len, program))
    return calls


def check_orders(backend: Backend, calls: list[Call]) -> None:
    with Session(backend.engine) as s:
        rows = {k: (st_, v) for k, st_, v in s.execute(select(Order.id, Order.status, Order.version))}
    for key in KEYS:
        fired = [c for c in calls if c.op.what != "decrement" and c.op.key == key]
        applied = sorted((c for c in fired if c.outcome == "APPLIED"), key=lambda c: c.version or 0)
        assert [c.version for c in applied] == list(range(2, len(applied) + 2)), applied
        path = {1: "pending"}  # version -> the state the row had at that version
        for version, c in enumerate(applied, start=2):
            assert path[version - 1] in SOURCES[c.op.what], ("applied from a state that forbids it", c)
            assert c.state == DEST[c.op.what], c
            path[version] = c.state
        assert rows[key] == (path[len(path)], len(path)), (key, rows[key], path)
        for c in fired:
            if c.outcome == "APPLIED":
                continue
            assert c.version in path and path[c.version] == c.state, ("a state the row never had", c, path)
            assert c.state not in SOURCES[c.op.what], ("not applied although allowed", c)
            want = "REPEATED" if c.state == DEST[c.op.what] else "REJECTED"
            assert c.outcome == want, c


def check_stock(backend: Backend, calls: list[Call]) -> None:
    with Session(backend.engine) as s:
        qty = dict(s.execute(select(Bin.id, Bin.qty)).all())
        ledger = Counter(s.execute(select(counter_ledger.c.ref)).scalars())
    sold: Counter[int] = Counter()
    applied_refs: Counter[str] = Counter()
    outcomes: dict[str | None, set[str]] = defaultdict(set)
    for c in calls:
        if c.op.what != "decrement":
            continue
        outcomes[c.op.ref].add(c.outcome)
        if c.outcome == "APPLIED":
            sold[c.op.key] += c.op.amount
            if c.op.ref is not None:
                applied_refs[c.op.ref] += 1
        else:
            assert c.outcome in ("REPEATED", "INSUFFICIENT"), c
    assert qty == {k: q - sold[k] for k, q in STOCK.items()}, ("lost or doubled update", qty, dict(sold))
    assert min(qty.values()) >= 0, ("oversold", qty)
    assert max(applied_refs.values(), default=1) == 1, ("a ref applied twice", applied_refs)
    assert ledger == applied_refs, ("the ledger is not the applied refs", ledger, applied_refs)
    for c in calls:
        if c.outcome == "REPEATED" and c.op.what == "decrement":
            assert c.op.ref in applied_refs, ("REPEATED for a ref that never applied", c)
        if c.outcome == "INSUFFICIENT":
            assert qty[c.op.key] < c.op.amount, ("INSUFFICIENT although the stock covers it", c, qty)
    assert "REPEATED" not in outcomes[None], "a decrement without a ref cannot be REPEATED"


def test_random_concurrent_programs_end_where_the_applied_results_say(backend: Backend, sizes: Sizes) -> None:
    """Random programs from 2-4 threads: the rows and the ledger equal the model replayed from the
    APPLIED results, and every other result is one the model allows."""
    backend.create(Base.metadata, CounterBase.metadata, stateguard_metadata)

    @settings(
        max_examples=60 * sizes.factor,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        database=None,
    )
    @given(program=programs())
    def fuzz(program: list[list[Op]]) -> None:
        reset(backend)
        calls = run(backend, program)
        check_orders(backend, calls)
        check_stock(backend, calls)

    fuzz()
