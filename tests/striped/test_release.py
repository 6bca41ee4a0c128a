"""``StripedCounter.release()`` racing itself and decrements: a ref is given back exactly once and
the total stays exact."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from sqlalchemy import Engine

from stateguard import (
    Outcome,
    StripedCounter,
)
from tests._support.striped_storms import (
    Stats,
    assert_invariant,
    new_item,
    run_threads,
    unit,
)

# ---------------------------------------------------------------- release racing decrements


def test_release_races_release_and_decrements(backend: Any, engine: Engine) -> None:
    counter = StripedCounter("rel", stripes=4)
    start = 100
    new_item(engine, counter, "a", start)
    stats = Stats()
    refs = {f"r-{k}": 1 + k % 5 for k in range(24)}
    taken = 0
    for ref, by in refs.items():
        r = unit(engine, lambda s, ref=ref, by=by: counter.decrement(s, "a", by=by, ref=ref), stats)
        assert r.outcome is Outcome.APPLIED
        taken += by
    # an increment's ref too: its release takes units back and may find them sold
    r = unit(engine, lambda s: counter.increment(s, "a", by=20, ref="delivery"), stats)
    assert r.outcome is Outcome.APPLIED
    names = list(refs)

    def worker(i: int) -> list[tuple[str, Any]]:
        out = []
        if i < 12:  # two threads per ref, same moment
            for ref in names[(i % 6) * 4 : (i % 6) * 4 + 4]:
                out.append((ref, unit(engine, lambda s, ref=ref: counter.release(s, ref), stats)))
            if i == 0:
                out.append(("delivery", unit(engine, lambda s: counter.release(s, "delivery"), stats)))
            return out
        rng = random.Random(i)
        for _ in range(10):
            by = rng.choice([1, 3, 8, 20])
            out.append((f"dec{by}", unit(engine, lambda s, by=by: counter.decrement(s, "a", by=by), stats)))
        return out

    results = [x for w in run_threads(16, worker) for x in w]
    releases: dict[str, Counter[Outcome]] = {}
    total = start - taken + 20
    for ref, r in results:
        if ref in refs:
            releases.setdefault(ref, Counter())[r.outcome] += 1
            if r.outcome is Outcome.APPLIED:
                total += refs[ref]
        elif ref == "delivery":
            assert r.outcome in (Outcome.APPLIED, Outcome.INSUFFICIENT), r
            if r.outcome is Outcome.APPLIED:
                total -= 20
        elif r.outcome is Outcome.APPLIED:
            total -= int(ref[3:])
        else:
            assert r.outcome is Outcome.INSUFFICIENT and r.value < int(ref[3:]), (ref, r)
    for ref, c in releases.items():
        assert c == {Outcome.APPLIED: 1, Outcome.REPEATED: 1}, (ref, c)
    assert len(releases) == len(refs)
    assert_invariant(engine, counter, "a", total)
