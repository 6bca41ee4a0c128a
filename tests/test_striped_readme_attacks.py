"""A production user's attacks on the README's "### Striped counters" promises.

Only what the README says is attacked: never oversold, never a lost unit, every ref applied at
most once, items as str keys of up to 200 characters compared as given, the BIGINT guard, and
"With plentiful stock there are none [deadlocks]".  Every storm re-reads the database in a new
Session and checks exact totals.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, bindparam, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from stateguard import (
    InvalidArgument,
    Outcome,
    RefConflict,
    SerializationConflict,
    StripedCounter,
    async_sqlite_engine,
    create_tables,
    drop_tables,
)
from stateguard.striped import stripe_ids
from tests.conftest import count_statements
from tests.test_striped_attacks import STRIPES, Stats, run_threads
from tests.test_striped_attacks import unit as _unit

MAX = 2**63 - 1
LEDGER = "stateguard_counter_ledger"


# ---------------------------------------------------------------- helpers


def unit(engine: Engine, op: Callable[[Session], Any], stats: Stats, attempts: int = 60) -> Any:
    """``op`` in its own transaction; typed retryable errors are counted and retried (up to 60 times)."""
    return _unit(engine, op, stats, attempts)


def totals(engine: Engine, counter: StripedCounter, items: list[str]) -> dict[str, int | None]:
    with Session(engine) as s:
        return {i: counter.total(s, i) for i in items}


def check_item(engine: Engine, counter: StripedCounter, item: str, expected: int) -> list[int]:
    with Session(engine) as s:
        total, amounts = counter.total(s, item), counter.stripe_amounts(s, item)
    assert all(a >= 0 for a in amounts), amounts
    assert sum(amounts) == total == expected, (item, total, expected, amounts)
    return amounts


def stored(engine: Engine, counter: str) -> list[tuple[int, int]]:
    """``(stripe, stripes)`` of the counter's rows in stripe order, its restripe gates left out."""
    sql = f"SELECT stripe, stripes FROM {STRIPES} WHERE counter = :c AND stripe >= 0 ORDER BY stripe"
    with Session(engine) as s:
        return [(int(r[0]), int(r[1])) for r in s.execute(text(sql), {"c": counter})]


def ledger(engine: Engine, counter: StripedCounter) -> list[tuple[Any, ...]]:
    with Session(engine) as s:
        rows = s.execute(
            text(f"SELECT ref, row_key, delta, released_at FROM {LEDGER} WHERE column_name = :c"),
            {"c": counter.name},
        ).all()
    return [tuple(r) for r in rows]


@pytest.fixture(params=["postgresql", "mariadb"])
def server(request: pytest.FixtureRequest, namespaces: Any) -> Iterator[Any]:
    from tests.conftest import _only

    for b in _only(request.param, namespaces):
        drop_tables(b.engine)
        create_tables(b.engine)
        yield b
        drop_tables(b.engine)


# ---------------------------------------------------------------- item keys


ODD_ITEMS = [
    "A",
    "a",
    "x",
    "x ",
    " x",
    "x\t",
    unicodedata.normalize("NFC", "café"),
    unicodedata.normalize("NFD", "café"),
    "ß",
    "ss",
    "İ",
    "i̇",
    "\U0001f600" * 200,
    "z" * 199 + " ",
    "z" * 200,
    "emoji-\U0001f6d2-\u202e-rtl",
]


def test_odd_item_keys_are_separate_items_with_refs(engine: Engine) -> None:
    """Keys are compared as given: "A"/"a", "x"/"x ", NFC/NFD, 200 emoji are distinct items, each
    with its own total, its own ledger entry under one shared ref, and released exactly."""
    c = StripedCounter("odd", stripes=3)
    assert len(set(ODD_ITEMS)) == len(ODD_ITEMS)
    with Session(engine) as s, s.begin():
        for n, item in enumerate(ODD_ITEMS):
            assert c.create(s, item, amount=100 + n).outcome is Outcome.APPLIED
    with Session(engine) as s, s.begin():
        for n, item in enumerate(ODD_ITEMS):
            r = c.decrement(s, item, by=n + 1, ref="order-odd")
            assert r.outcome is Outcome.APPLIED, (item, r)
        for n, item in enumerate(ODD_ITEMS):
            with pytest.raises(RefConflict):
                with s.begin_nested():
                    c.decrement(s, item, by=n + 2, ref="order-odd")
            assert c.decrement(s, item, by=n + 1, ref="order-odd").outcome is Outcome.REPEATED
    got = totals(engine, c, ODD_ITEMS)
    assert got == {item: 100 + n - (n + 1) for n, item in enumerate(ODD_ITEMS)}
    with Session(engine) as s, s.begin():
        r = c.release(s, "order-odd")
        assert r.outcome is Outcome.APPLIED
        assert r.value == {item: n + 1 for n, item in enumerate(ODD_ITEMS)}
        assert c.release(s, "order-odd").outcome is Outcome.REPEATED
    assert totals(engine, c, ODD_ITEMS) == {item: 100 + n for n, item in enumerate(ODD_ITEMS)}


def test_odd_keys_created_concurrently_never_merge(backend: Any, engine: Engine) -> None:
    """16 threads create keys that a case- or pad-insensitive collation would merge: all APPLIED."""
    c = StripedCounter("oddc", stripes=2)
    items = ["K", "k", "K ", "k ", "K  ", "k\u00a0", "K\u200b", "\uff2b"] * 2
    results = run_threads(16, lambda i: unit(engine, lambda s: c.create(s, items[i], amount=i + 1), Stats()))
    outcomes = Counter(r.outcome for r in results)
    assert outcomes == {Outcome.APPLIED: 8, Outcome.REPEATED: 8}
    got = totals(engine, c, items[:8])
    for i, item in enumerate(items[:8]):
        assert got[item] in (i + 1, i + 9), (item, got)


# README: items are "str keys of up to 200 characters" with "the same ref ledger": an item whose
# JSON outgrows the ledger's 255-character row_key is stored there as given.
def test_an_item_of_200_characters_needing_json_escapes_works_with_a_ref(engine: Engine) -> None:
    """200 characters of quotes, backslashes or control characters take a ref'd decrement like any item."""
    c = StripedCounter("esc", stripes=2)
    items = ['"' * 200, "\\" * 200, "\x01" * 200, "C:\\stock\\" + "x" * 100 + '"' * 91]
    with Session(engine) as s, s.begin():
        for item in items:
            assert len(item) <= 200
            assert c.create(s, item, amount=10).outcome is Outcome.APPLIED
    with Session(engine) as s, s.begin():
        for item in items:
            assert c.decrement(s, item, by=1, ref="o-esc").outcome is Outcome.APPLIED
    assert set(totals(engine, c, items).values()) == {9}


# ---------------------------------------------------------------- hostile input


HOSTILE: list[tuple[str, Callable[[StripedCounter, Any], Any]]] = [
    ("nul item", lambda c, s: c.decrement(s, "sku\x00", by=1)),
    ("surrogate item", lambda c, s: c.increment(s, "sku\udfff", by=1)),
    ("201 emoji", lambda c, s: c.create(s, "\U0001f600" * 201, amount=1)),
    ("bytes item", lambda c, s: c.decrement(s, b"sku", by=1)),
    ("None item", lambda c, s: c.total(s, None)),
    ("blank item", lambda c, s: c.stripe_amounts(s, " \t\n")),
    ("negative by", lambda c, s: c.decrement(s, "sku", by=-1)),
    ("huge by", lambda c, s: c.decrement(s, "sku", by=2**63)),
    ("huge increment", lambda c, s: c.increment(s, "sku", by=2**64)),
    ("bool by", lambda c, s: c.increment(s, "sku", by=True)),
    ("str by", lambda c, s: c.increment(s, "sku", by="1")),
    ("huge amount", lambda c, s: c.create(s, "new", amount=2**63)),
    ("bool stripes", lambda c, s: c.restripe(s, "sku", stripes=True)),
    ("int ref", lambda c, s: c.decrement(s, "sku", by=1, ref=42)),
    ("nul ref", lambda c, s: c.decrement(s, "sku", by=1, ref="r\x00")),
    ("surrogate ref", lambda c, s: c.release(s, "\ud800")),
    ("blank ref", lambda c, s: c.release(s, "")),
    ("list basket", lambda c, s: c.reserve(s, [("sku", 1)], ref="r")),
    ("zero in basket", lambda c, s: c.reserve(s, {"sku": 1, "other": 0}, ref="r")),
    ("bad key in basket", lambda c, s: c.reserve(s, {"sku": 1, 5: 1}, ref="r")),
    ("float in basket", lambda c, s: c.reserve(s, {"sku": 1.5}, ref="r")),
    (
        "huge basket bad tail",
        lambda c, s: c.reserve(s, {**{f"i{n}": 1 for n in range(500)}, "x": -1}, ref="r"),
    ),
]


@pytest.mark.parametrize("call", [c for _, c in HOSTILE], ids=[n for n, _ in HOSTILE])
def test_hostile_input_is_invalid_argument_and_sends_nothing(engine: Engine, call: Any) -> None:
    c = StripedCounter("hostile", stripes=3)
    with Session(engine) as s, s.begin():
        c.create(s, "sku", amount=7)
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as counted, pytest.raises(InvalidArgument):
            call(c, s)
        assert len(counted) == 0
        # the transaction goes on
        assert c.decrement(s, "sku", by=1).outcome is Outcome.APPLIED
    check_item(engine, c, "sku", 6)
    assert ledger(engine, c) == []


def test_an_async_engine_or_sessionmaker_where_a_session_belongs(engine: Engine) -> None:
    from sqlalchemy.orm import sessionmaker

    c = StripedCounter("wrongobj", stripes=2)
    with Session(engine) as s, s.begin():
        c.create(s, "sku", amount=4)
    factory = sessionmaker(engine)
    with count_statements(engine) as counted:
        for wrong in (factory, engine, "session", 0):
            with pytest.raises(InvalidArgument):
                c.decrement(wrong, "sku", by=1)
            with pytest.raises(InvalidArgument):
                c.reserve(wrong, {"sku": 1}, ref="r")
    assert len(counted) == 0
    check_item(engine, c, "sku", 4)


# ---------------------------------------------------------------- BIGINT limits


def test_bigint_limits_exact_totals_and_usable_transaction(engine: Engine) -> None:
    c = StripedCounter("big", stripes=2)
    with Session(engine) as s, s.begin():
        assert c.create(s, "b", amount=MAX).outcome is Outcome.APPLIED
        assert c.stripe_amounts(s, "b") == [2**62, 2**62 - 1]
        assert c.increment(s, "b", by=2**62, ref="d1").outcome is Outcome.APPLIED  # fills stripe 1
        assert c.increment(s, "b", by=2**62 - 1).outcome is Outcome.APPLIED  # fills stripe 0
        assert c.stripe_amounts(s, "b") == [MAX, MAX]
        assert c.total(s, "b") == 2 * MAX
        for ref in ("over-1", "over-2"):
            with pytest.raises(InvalidArgument, match="BIGINT"):
                c.increment(s, "b", by=1, ref=ref)
        # nothing changed, no ledger row stayed, the transaction goes on
        assert c.total(s, "b") == 2 * MAX
        with pytest.raises(InvalidArgument, match="2"):
            c.restripe(s, "b", stripes=1)
        assert c.stripe_amounts(s, "b") == [MAX, MAX]
        assert c.restripe(s, "b", stripes=3).value == 2 * MAX
        assert sum(c.stripe_amounts(s, "b")) == 2 * MAX
        # larger than any stripe: taken from several
        assert c.decrement(s, "b", by=MAX, ref="big-order").outcome is Outcome.APPLIED
        assert c.total(s, "b") == MAX
    assert sorted(r[0] for r in ledger(engine, c)) == ["big-order", "d1"]
    with Session(engine) as s, s.begin():
        # the refused refs apply later: they left no trace
        assert c.increment(s, "b", by=1, ref="over-1").outcome is Outcome.APPLIED
        assert c.decrement(s, "b", by=MAX, ref="big-2").outcome is Outcome.APPLIED
        short = c.decrement(s, "b", by=2)
        assert short.outcome is Outcome.INSUFFICIENT and short.value == 1
        assert c.release(s, "big-order").outcome is Outcome.APPLIED
        assert c.total(s, "b") == MAX + 1
        with pytest.raises(InvalidArgument, match="at least 2 stripes"):
            c.restripe(s, "b", stripes=1)
    with Session(engine) as s:
        assert c.total(s, "b") == MAX + 1
        assert len(c.stripe_amounts(s, "b")) == 3
    assert sorted(r[0] for r in ledger(engine, c)) == ["big-2", "big-order", "d1", "over-1"]


def test_restripe_past_bigint_names_the_smallest_count(engine: Engine) -> None:
    c = StripedCounter("big2", stripes=5)
    with Session(engine) as s, s.begin():
        c.create(s, "b", amount=MAX)
        for _ in range(4):
            c.increment(s, "b", by=MAX // 2)
        total = MAX + 4 * (MAX // 2)
        assert c.total(s, "b") == total
        need = -(-total // MAX)
        assert need == 3
        for k in (1, 2):
            with pytest.raises(InvalidArgument, match=f"at least {need} stripes"):
                c.restripe(s, "b", stripes=k)
        assert c.restripe(s, "b", stripes=need).value == total
    check_item(engine, c, "b", total)


# ---------------------------------------------------------------- create, refs, savepoints


def test_two_counter_objects_same_name_different_default_stripes(engine: Engine) -> None:
    """16 threads create one item through objects of 8 and of 2 default stripes: one APPLIED, the
    item's amount is the winner's, and the other object then decrements across all its stripes."""
    c8, c2 = StripedCounter("twin", stripes=8), StripedCounter("twin", stripes=2)

    def create(i: int) -> tuple[int, Outcome]:
        counter, amount = (c8, 80) if i % 2 else (c2, 20)
        return amount, unit(engine, lambda s: counter.create(s, "t", amount=amount), Stats()).outcome

    results = run_threads(16, create)
    winners = [a for a, o in results if o is Outcome.APPLIED]
    assert len(winners) == 1 and Counter(o for _, o in results)[Outcome.REPEATED] == 15
    amounts = check_item(engine, c8, "t", winners[0])
    assert len(amounts) == (8 if winners[0] == 80 else 2)
    with Session(engine) as s, s.begin():
        other = c2 if winners[0] == 80 else c8
        assert other.decrement(s, "t", by=winners[0] - 1).outcome is Outcome.APPLIED
        short = other.decrement(s, "t", by=2)
        assert short.outcome is Outcome.INSUFFICIENT and short.value == 1
    check_item(engine, c8, "t", 1)


def test_refs_reused_across_items_and_counters(engine: Engine) -> None:
    stock, coupons = StripedCounter("stock-r", stripes=4), StripedCounter("coupon-r", stripes=4)
    with Session(engine) as s, s.begin():
        for c in (stock, coupons):
            for item in ("a", "b", "c"):
                c.create(s, item, amount=50)
    with Session(engine) as s, s.begin():
        assert stock.decrement(s, "a", by=2, ref="R").outcome is Outcome.APPLIED
        assert stock.decrement(s, "b", by=3, ref="R").outcome is Outcome.APPLIED
        assert coupons.decrement(s, "a", by=5, ref="R").outcome is Outcome.APPLIED
        assert coupons.increment(s, "c", by=7, ref="R").outcome is Outcome.APPLIED
    # a reserve under the used ref naming a used item and a new one: RefConflict, the caller commits
    with Session(engine) as s, s.begin():
        with pytest.raises(RefConflict):
            stock.reserve(s, {"a": 2, "c": 1}, ref="R")
        with pytest.raises(RefConflict):
            stock.reserve(s, {"a": 2, "b": 3, "c": 1}, ref="R")
        with pytest.raises(RefConflict):
            stock.reserve(s, {"a": 2}, ref="R")
        assert stock.reserve(s, {"a": 2, "b": 3}, ref="R").outcome is Outcome.REPEATED
    assert totals(engine, stock, ["a", "b", "c"]) == {"a": 48, "b": 47, "c": 50}
    with Session(engine) as s, s.begin():
        r = stock.release(s, "R")
        assert r.outcome is Outcome.APPLIED and r.value == {"a": 2, "b": 3}
        assert stock.release(s, "R").outcome is Outcome.REPEATED
        # released refs stay used: the same reservation again changes nothing
        assert stock.reserve(s, {"a": 2, "b": 3}, ref="R").outcome is Outcome.REPEATED
        assert stock.decrement(s, "a", by=2, ref="R").outcome is Outcome.REPEATED
    assert totals(engine, stock, ["a", "b", "c"]) == {"a": 50, "b": 50, "c": 50}
    assert totals(engine, coupons, ["a", "b", "c"]) == {"a": 45, "b": 50, "c": 57}
    with Session(engine) as s, s.begin():
        r = coupons.release(s, "R")
        assert r.outcome is Outcome.APPLIED and r.value == {"a": 5, "c": -7}
    assert totals(engine, coupons, ["a", "b", "c"]) == {"a": 50, "b": 50, "c": 50}


def test_savepoints_rolled_back_after_the_calls(engine: Engine) -> None:
    """Whatever ran in a SAVEPOINT rolled back afterwards left no trace: its refs apply again,
    a restripe rolled back leaves the old stripes, and later big decrements still see them all."""
    c = StripedCounter("sp", stripes=8)
    with Session(engine) as s, s.begin():
        c.create(s, "a", amount=80)
        c.create(s, "b", amount=80)
    with Session(engine) as s, s.begin():
        sp = s.begin_nested()
        c.decrement(s, "a", by=5, ref="o1")
        c.reserve(s, {"a": 1, "b": 2}, ref="o2")
        c.restripe(s, "a", stripes=3)
        c.increment(s, "b", by=9, ref="d1")
        sp.rollback()
        sp = s.begin_nested()
        c.restripe(s, "b", stripes=5)
        sp.rollback()
        assert len(c.stripe_amounts(s, "a")) == 8 and len(c.stripe_amounts(s, "b")) == 8
        assert c.decrement(s, "a", by=5, ref="o1").outcome is Outcome.APPLIED
        assert c.reserve(s, {"a": 1, "b": 2}, ref="o2").outcome is Outcome.APPLIED
        sp = s.begin_nested()
        assert c.release(s, "o2").outcome is Outcome.APPLIED
        sp.rollback()
        # bigger than any stripe: needs every stripe the rolled-back restripes dropped
        assert c.decrement(s, "a", by=70).outcome is Outcome.APPLIED
        assert c.decrement(s, "b", by=78).outcome is Outcome.APPLIED
    assert totals(engine, c, ["a", "b"]) == {"a": 4, "b": 0}
    with Session(engine) as s, s.begin():
        assert c.release(s, "o2").outcome is Outcome.APPLIED
        assert c.release(s, "o2").outcome is Outcome.REPEATED
        assert c.increment(s, "b", by=9, ref="d1").outcome is Outcome.APPLIED
    assert totals(engine, c, ["a", "b"]) == {"a": 5, "b": 11}
    assert sorted(r[0] for r in ledger(engine, c)) == ["d1", "o1", "o2", "o2"]


def test_huge_basket_short_last_item_undoes_everything(engine: Engine) -> None:
    c = StripedCounter("basket", stripes=2)
    items = [f"sku-{n:04d}" for n in range(300)]
    with Session(engine) as s, s.begin():
        for item in items:
            c.create(s, item, amount=3)
    basket = dict.fromkeys(reversed(items), 2)
    basket["sku-0299"] = 4
    with Session(engine) as s, s.begin():
        r = c.reserve(s, basket, ref="huge")
        assert r.outcome is Outcome.INSUFFICIENT and r.key == "sku-0299" and r.value == 3
    assert set(totals(engine, c, items).values()) == {3}
    assert ledger(engine, c) == []
    with Session(engine) as s, s.begin():
        c.increment(s, "sku-0299", by=1)
        assert c.reserve(s, basket, ref="huge").outcome is Outcome.APPLIED
        assert c.reserve(s, basket, ref="huge").outcome is Outcome.REPEATED
    got = totals(engine, c, items)
    assert got["sku-0299"] == 0 and {got[i] for i in items[:-1]} == {1}


# ---------------------------------------------------------------- storms


def test_neighbouring_items_plentiful_stock_mixed_calls_no_deadlock(backend: Any, engine: Engine) -> None:
    """16 threads, 12 items whose keys sort next to each other, fewer stripes than buyers, one call
    per transaction (reserve baskets, ref'd decrements, releases, increments): exact totals, every
    ref at most once, and no deadlock (plentiful stock)."""
    c = StripedCounter("near", stripes=4)
    items = [f"n-{n:02d}" for n in range(12)] + ["n-00 ", "N-00"]
    start = 100_000
    with Session(engine) as s, s.begin():
        for item in items:
            c.create(s, item, amount=start)
    stats = Stats()
    per_thread = 12 if backend.name == "sqlite" else 25

    def worker(i: int) -> dict[str, int]:
        rng = random.Random(i)
        net: Counter[str] = Counter()
        mine: list[tuple[str, dict[str, int]]] = []
        for k in range(per_thread):
            ref = f"w{i}-{k}"
            roll = rng.random()
            if roll < 0.4:
                basket = {it: rng.randint(1, 3) for it in rng.sample(items, rng.randint(2, 5))}
                r = unit(engine, lambda s, b=basket, ref=ref: c.reserve(s, b, ref=ref), stats)
                assert r.outcome is Outcome.APPLIED
                for it, by in basket.items():
                    net[it] -= by
                mine.append((ref, {it: -by for it, by in basket.items()}))
            elif roll < 0.65:
                it, by = rng.choice(items), rng.randint(1, 4)
                r = unit(engine, lambda s, it=it, by=by, ref=ref: c.decrement(s, it, by=by, ref=ref), stats)
                assert r.outcome is Outcome.APPLIED
                net[it] -= by
                mine.append((ref, {it: -by}))
            elif roll < 0.8:
                it, by = rng.choice(items), rng.randint(1, 4)
                r = unit(engine, lambda s, it=it, by=by, ref=ref: c.increment(s, it, by=by, ref=ref), stats)
                assert r.outcome is Outcome.APPLIED
                net[it] += by
                mine.append((ref, {it: by}))
            elif mine:
                old, deltas = mine.pop(rng.randrange(len(mine)))
                r = unit(engine, lambda s, old=old: c.release(s, old), stats)
                assert r.outcome is Outcome.APPLIED, r
                assert r.value == {it: -d for it, d in deltas.items()}
                for it, d in deltas.items():
                    net[it] -= d
                r = unit(engine, lambda s, old=old: c.release(s, old), stats)
                assert r.outcome is Outcome.REPEATED
        return dict(net)

    nets = run_threads(16, worker, timeout=80)
    expected = Counter({it: start for it in items})
    for n in nets:
        expected.update(n)
    for item in items:
        check_item(engine, c, item, expected[item])
    if backend.name != "sqlite":
        assert stats.retryable["DeadlockDetected"] == 0, stats.retryable


def _restripe_storm(engine: Engine, counts: list[int]) -> tuple[Stats, Stats, Counter[str]]:
    c = StripedCounter("rs", stripes=8)
    items = [f"r-{n}" for n in range(4)]
    with Session(engine) as s, s.begin():
        for item in items:
            c.create(s, item, amount=100_000)
    buyers, restripers = Stats(), Stats()
    taken: Counter[str] = Counter()
    lock = threading.Lock()

    def work(i: int) -> None:
        rng = random.Random(i)
        if i < 2:
            for k in range(40):
                item, n = items[(k + i) % 4], counts[(k + i) % len(counts)]
                r = unit(engine, lambda s, item=item, n=n: c.restripe(s, item, stripes=n), restripers)
                assert r.outcome is Outcome.APPLIED
            return
        for k in range(40):
            item, by = rng.choice(items), rng.randint(1, 3)
            ref = f"b{i}-{k}"
            if k % 5 == 4:
                basket = {item: by, items[(items.index(item) + 1) % 4]: 1}
                r = unit(engine, lambda s, b=basket, ref=ref: c.reserve(s, b, ref=ref), buyers)
                assert r.outcome is Outcome.APPLIED
                with lock:
                    taken.update(basket)
            else:
                r = unit(
                    engine, lambda s, it=item, by=by, ref=ref: c.decrement(s, it, by=by, ref=ref), buyers
                )
                assert r.outcome is Outcome.APPLIED
                with lock:
                    taken[item] += by

    run_threads(12, work, timeout=80)
    for item in items:
        check_item(engine, c, item, 100_000 - taken[item])
    return buyers, restripers, taken


def test_restripe_between_nested_counts_plentiful_stock(server: Any) -> None:
    """Restripes between 4 and 8 stripes (whose stripe ids are a subset of each other's) racing
    ref'd decrements and reserves: exact, and no deadlock with plentiful stock."""
    buyers, restripers, _ = _restripe_storm(server.engine, [4, 8])
    assert buyers.retryable["DeadlockDetected"] == 0, buyers.retryable
    assert restripers.retryable["DeadlockDetected"] == 0, restripers.retryable


# README: "With plentiful stock there are none [deadlocks]", restripes included.  Restripes to stripe
# counts whose ids differ (3, 8, 5, 16, 2) racing one-call decrements and reserves of plentiful stock
# (100000 units, by <= 3).  MariaDB used to deadlock 20-60 times per run: a decrement that named a
# stripe the item no longer had, or whose wait ended on a stripe a restripe deleted, keeps an InnoDB
# lock there (a gap lock, or the deleted row's) until it commits, and the restripe inserted its new
# stripes there while holding the stripes that decrement waited for.  A restripe now queues at its
# gate and inserts before it locks any stripe; its DELETEs go one key at a time (a DELETE ... IN
# (...) ran as a scan and locked a neighbouring item's rows).
def test_restripe_to_other_counts_plentiful_stock_no_deadlock(server: Any) -> None:
    """Restripes to counts with other stripe ids (3, 8, 5, 16, 2) racing ref'd decrements and
    reserves of plentiful stock: exact, and no deadlock on either side."""
    buyers, restripers, _ = _restripe_storm(server.engine, [3, 8, 5, 16, 2])
    assert buyers.retryable["DeadlockDetected"] == 0, buyers.retryable
    assert restripers.retryable["DeadlockDetected"] == 0, restripers.retryable


# Restripes of one item queue at its gate (an INSERT and DELETE of a key no stripe has): on MariaDB
# a plain INSERT's duplicate check waits for a shared lock, so when the holder committed two queued
# restripes both got it and then each waited for the other to take the exclusive one (a deadlock).
def test_restripes_queued_behind_an_open_restripe_all_apply(server: Any) -> None:
    """Three restripes (5, 16, 2) queue behind an open restripe 8 -> 3: once it commits all three
    apply in turn, with no deadlock, and the item ends with exactly the stripes its count names."""
    c = StripedCounter("queue", stripes=8)
    with Session(server.engine) as s, s.begin():
        c.create(s, "q", amount=8000)
    holder_ready, go = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def holder() -> None:
        try:
            with Session(server.engine) as s, s.begin():
                assert c.restripe(s, "q", stripes=3).outcome is Outcome.APPLIED
                holder_ready.set()
                assert go.wait(30)
        except BaseException as error:
            errors.append(error)
            holder_ready.set()

    h = threading.Thread(target=holder, daemon=True)
    h.start()
    assert holder_ready.wait(15) and not errors
    outcomes: list[Any] = [None] * 3
    ids: list[int] = []

    def restriper(i: int) -> None:
        try:
            with Session(server.engine) as s, s.begin():
                ids.append(_connection_id(s, server))
                outcomes[i] = c.restripe(s, "q", stripes=[5, 16, 2][i]).outcome
        except SerializationConflict as error:
            outcomes[i] = type(error).__name__

    queued = [threading.Thread(target=restriper, args=(i,), daemon=True) for i in range(3)]
    for t in queued:
        t.start()
    deadline = time.monotonic() + 15
    while _lock_waiters(server, ids, "INSERT ") < 3 and time.monotonic() < deadline:
        time.sleep(0.01)  # polling a condition, not hoping for a race
    assert _lock_waiters(server, ids, "INSERT ") == 3, ("restripes never queued at the gate", outcomes)
    go.set()
    h.join(30)
    for t in queued:
        t.join(30)
    assert not errors, errors
    assert outcomes == [Outcome.APPLIED] * 3, outcomes
    amounts = check_item(server.engine, c, "q", 8000)
    assert len(amounts) in (5, 16, 2), amounts
    assert stored(server.engine, "queue") == [(stripe, len(amounts)) for stripe in stripe_ids(len(amounts))]


# README: a decrement about to wait for a busy stripe takes the restripe gate shared without waiting
# first.  The stripe it waits for is picked from its snapshot, which may be older than the last
# restripe: it can be one that a restripe under way is inserting again, while the decrement holds a
# lock where that restripe inserts next (a stripe the item did not have, named by an earlier
# lookup).  Waiting for it was a deadlock (MariaDB); with the gate held, it waits for stripe 0.
def test_decrement_waiting_on_a_stripe_a_restripe_is_inserting_again(server: Any) -> None:
    """A decrement whose snapshot shows 16 stripes, of which only stripe 131072 holds ``by``,
    holding a lock on stripe 786432 (gone since a restripe 16 -> 3): a restripe 3 -> 16 inserts
    131072 and waits at 786432; the decrement then does not wait for 131072 but for stripe 0, and
    both apply once stripe 0's holder lets go."""
    eng = server.engine
    c = StripedCounter("again", stripes=16)
    with Session(eng) as s, s.begin():
        c.create(s, "a", amount=1600)  # 100 a stripe
        s.execute(text(f"UPDATE {STRIPES} SET amount = 1000 WHERE counter = 'again' AND stripe = 131072"))
    late = Session(eng)
    late.begin()
    assert c.total(late, "a") == 2500  # the snapshot: 16 stripes, 131072 the only one with 500
    with Session(eng) as s, s.begin():
        assert c.restripe(s, "a", stripes=3).value == 2500
    one = f"SELECT amount FROM {STRIPES} WHERE counter = 'again' AND item = 'a' AND stripe = :s FOR UPDATE"
    late.execute(text(one), {"s": 786432}).all()  # the lock a stale lookup leaves
    holder = Session(eng)
    holder.begin()
    for stripe in stripe_ids(3):
        holder.execute(text(one), {"s": stripe}).all()  # every stripe busy: no fast path
    outcomes: dict[str, Any] = {}
    ids: list[int] = []

    def restriper() -> None:
        try:
            with Session(eng) as s, s.begin():
                ids.append(_connection_id(s, server))
                outcomes["restripe"] = c.restripe(s, "a", stripes=16).outcome
        except SerializationConflict as error:
            outcomes["restripe"] = type(error).__name__

    def buyer() -> None:
        try:
            ids.append(_connection_id(late, server))
            outcomes["decrement"] = c.decrement(late, "a", by=500).outcome
            late.commit()
        except SerializationConflict as error:
            outcomes["decrement"] = type(error).__name__
            late.rollback()

    threads = [threading.Thread(target=restriper, daemon=True)]
    threads[0].start()
    deadline = time.monotonic() + 15
    while _lock_waiters(server, ids, "") < 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # polling a condition, not hoping for a race
    assert _lock_waiters(server, ids, "") == 1, ("the restripe never waited", outcomes)
    threads.append(threading.Thread(target=buyer, daemon=True))
    threads[1].start()
    while _lock_waiters(server, ids, "") < 2 and not outcomes and time.monotonic() < deadline:
        time.sleep(0.01)
    holder.rollback()
    for t in threads:
        t.join(30)
    late.close()
    holder.close()
    assert outcomes == {"restripe": Outcome.APPLIED, "decrement": Outcome.APPLIED}, outcomes
    amounts = check_item(eng, c, "a", 2000)
    assert len(amounts) == 16, amounts


# A restripe plans its new stripes from a read without locks.  In a transaction whose snapshot is
# older than another restripe's commit (MariaDB, REPEATABLE READ) that read shows the old stripes:
# some ids it inserts may be taken (its INSERT fails with a duplicate key, and is left out), others
# are missing; what it finds once it holds the stripes decides.
@pytest.mark.parametrize(("first", "then"), [(3, 5), (3, 6), (16, 2), (2, 16)])
def test_restripe_in_a_transaction_whose_snapshot_predates_another_restripe(
    server: Any, first: int, then: int
) -> None:
    """A transaction reads the item, another restripes it 8 -> ``first`` and commits, then the first
    restripes it to ``then``: APPLIED with the whole total, exactly the stripes ``then`` names."""
    c = StripedCounter("stale", stripes=8)
    with Session(server.engine) as s, s.begin():
        c.create(s, "s", amount=1001)
    with Session(server.engine) as late, late.begin():
        assert c.total(late, "s") == 1001  # the snapshot (InnoDB: this transaction's first read)
        with Session(server.engine) as s, s.begin():
            assert c.restripe(s, "s", stripes=first).value == 1001
        r = c.restripe(late, "s", stripes=then)
        assert (r.outcome, r.value) == (Outcome.APPLIED, 1001)
    amounts = check_item(server.engine, c, "s", 1001)
    assert len(amounts) == then and max(amounts) - min(amounts) <= 1, amounts
    assert stored(server.engine, "stale") == [(stripe, then) for stripe in stripe_ids(then)]
    with Session(server.engine) as s, s.begin():
        assert c.decrement(s, "s", by=1001).outcome is Outcome.APPLIED  # every stripe is reachable


def test_restripe_storm_exact_on_every_backend(backend: Any, engine: Engine) -> None:
    """Whatever the deadlocks, nothing is lost or oversold and every ref applies once."""
    _, _, taken = _restripe_storm(engine, [3, 8, 5, 1, 16, 2])
    refs = ledger(engine, StripedCounter("rs"))
    assert len({(r[0], r[1]) for r in refs}) == len(refs)
    assert sum(-int(r[2]) for r in refs) == sum(taken.values())


# README: with plentiful stock there are no deadlocks between calls of one item or reserve() baskets
# (items taken in sorted order); separate calls taking items in opposite orders can deadlock, as
# with any row locks, when an item has no other free stripe (always with stripes=1).
def test_reserve_takes_items_in_sorted_order_whatever_the_mapping_order(server: Any) -> None:
    """A transaction holding x (1 stripe) and then taking y, and a reserve of {y, x} started in
    between: the reserve waits for x holding nothing, so both apply (a reserve taking y first
    would hold it while it waits for x: a deadlock)."""
    c = StripedCounter("opp", stripes=1)
    with Session(server.engine) as s, s.begin():
        c.create(s, "x", amount=1000)
        c.create(s, "y", amount=1000)
    holding_x, go = threading.Event(), threading.Event()
    ids: list[int] = []

    def in_order() -> Outcome:
        with Session(server.engine) as s, s.begin():
            assert c.decrement(s, "x", by=1).outcome is Outcome.APPLIED
            holding_x.set()
            assert go.wait(15)
            return c.decrement(s, "y", by=1).outcome

    def basket() -> Outcome:
        assert holding_x.wait(15)
        with Session(server.engine) as s, s.begin():
            ids.append(_connection_id(s, server))
            return c.reserve(s, {"y": 1, "x": 1}, ref="opp-basket").outcome

    def waits_then_go(i: int) -> Outcome:
        if i == 0:
            return in_order()
        if i == 1:
            return basket()
        deadline = time.monotonic() + 15
        while _lock_waiters(server, ids) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # polling a condition: the reserve waits for x
        assert _lock_waiters(server, ids) == 1, "the reserve never waited for x"
        go.set()
        return Outcome.APPLIED

    assert run_threads(3, waits_then_go) == [Outcome.APPLIED] * 3
    assert totals(server.engine, c, ["x", "y"]) == {"x": 998, "y": 998}


def test_reserves_of_two_one_stripe_items_in_random_orders_never_deadlock(server: Any) -> None:
    """12 threads reserve {x, y} (1 stripe each, plentiful stock) with the mapping in random orders,
    20 times each: no deadlock, exact totals."""
    c = StripedCounter("opp2", stripes=1)
    with Session(server.engine) as s, s.begin():
        c.create(s, "x", amount=10_000)
        c.create(s, "y", amount=10_000)
    stats = Stats()

    def worker(i: int) -> None:
        rng = random.Random(i)
        for k in range(20):
            basket = {"x": 1, "y": 2} if rng.random() < 0.5 else {"y": 2, "x": 1}
            r = unit(server.engine, lambda s, b=basket, k=k: c.reserve(s, b, ref=f"o{i}-{k}"), stats)
            assert r.outcome is Outcome.APPLIED

    run_threads(12, worker)
    assert stats.retryable["DeadlockDetected"] == 0, stats.retryable
    assert totals(server.engine, c, ["x", "y"]) == {"x": 10_000 - 240, "y": 10_000 - 480}


def test_separate_calls_in_opposite_orders_deadlock_as_the_readme_says(server: Any) -> None:
    """Two transactions decrementing 1-stripe items x and y in separate calls in opposite orders:
    each holds the only row the other needs, so one gets the retryable DeadlockDetected (as a
    plain UPDATE counter would) and the other applies; totals stay exact."""
    c = StripedCounter("opp3", stripes=1)
    with Session(server.engine) as s, s.begin():
        c.create(s, "x", amount=1000)
        c.create(s, "y", amount=1000)
    first_done = threading.Barrier(2)

    def worker(i: int) -> str:
        order = ("x", "y") if i == 0 else ("y", "x")
        try:
            with Session(server.engine) as s, s.begin():
                c.decrement(s, order[0], by=1)
                first_done.wait(15)
                return c.decrement(s, order[1], by=1).outcome.name
        except SerializationConflict as error:
            assert error.retryable
            return type(error).__name__

    assert sorted(run_threads(2, worker)) == ["APPLIED", "DeadlockDetected"]
    assert totals(server.engine, c, ["x", "y"]) == {"x": 999, "y": 999}


# ---------------------------------------------------------------- processes with other beliefs


def _belief_worker(url: str, name: str, role: str, seed: int, barrier: Any) -> tuple[int, int]:
    from tests.conftest import make_engine

    eng = make_engine(name, url, pool_size=2)
    c = StripedCounter("belief", stripes=8)
    rng = random.Random(seed)
    stats = Stats()
    taken = 0
    try:
        barrier.wait(30)
        for k in range(40):
            if role == "restripe":
                n = [3, 8, 1, 5, 16, 2][k % 6]
                unit(eng, lambda s, n=n: c.restripe(s, "p", stripes=n), stats)
            else:
                by = rng.choice([1, 2, 3, 40, 150])
                ref = f"{seed}-{k}"
                r = unit(eng, lambda s, by=by, ref=ref: c.decrement(s, "p", by=by, ref=ref), stats)
                assert r.outcome in (Outcome.APPLIED, Outcome.INSUFFICIENT), r
                if r.outcome is Outcome.APPLIED:
                    taken += by
                else:
                    assert r.value < by
    finally:
        eng.dispose()
    return taken, stats.retryable["DeadlockDetected"]


def test_processes_with_different_stripe_beliefs_stay_exact(server: Any, procs: Any) -> None:
    """One process restripes (3, 8, 1, 5, 16, 2) while three others, each believing its own stripe
    count, decrement with refs, some bigger than any stripe: nothing lost, nothing oversold."""
    manager, pool = procs
    c = StripedCounter("belief", stripes=8)
    start = 4000
    with Session(server.engine) as s, s.begin():
        c.create(s, "p", amount=start)
    barrier = manager.Barrier(4)
    roles = ["restripe", "buy", "buy", "buy"]
    futures = [
        pool.submit(_belief_worker, server.url, server.name, role, k, barrier) for k, role in enumerate(roles)
    ]
    results = [f.result(timeout=80) for f in futures]
    taken = sum(t for t, _ in results)
    check_item(server.engine, c, "p", start - taken)
    refs = ledger(server.engine, c)
    assert sum(-int(r[2]) for r in refs) == taken
    assert len({r[0] for r in refs}) == len(refs)


# ---------------------------------------------------------------- async


def _async_engine(backend: Any) -> Any:
    if backend.name == "sqlite":
        return async_sqlite_engine(backend.url.replace("sqlite://", "sqlite+aiosqlite://", 1))
    if backend.name == "mariadb":
        return create_async_engine(backend.url.replace("mysql+pymysql", "mysql+aiomysql", 1), pool_size=20)
    return create_async_engine(backend.url, pool_size=20)


def test_async_sessions_reserve_release_restripe(backend: Any, engine: Engine) -> None:
    c = StripedCounter("async-r", stripes=4)
    with Session(engine) as s, s.begin():
        c.create(s, "a", amount=500)
        c.create(s, "b", amount=500)

    async def one(aeng: Any, k: int) -> tuple[str, int]:
        for attempt in range(60):
            try:
                async with AsyncSession(aeng) as s, s.begin():
                    if k % 10 == 9:
                        n = [1, 3, 8][k % 3]
                        assert (await c.restripe(s, "a", stripes=n)).outcome is Outcome.APPLIED
                        return "restripe", 0
                    r = await c.reserve(s, {"b": 1, "a": 2}, ref=f"ar-{k}")
                    assert r.outcome is Outcome.APPLIED
                    assert (await c.reserve(s, {"a": 2, "b": 1}, ref=f"ar-{k}")).outcome is Outcome.REPEATED
                    if k % 3 == 0:
                        rel = await c.release(s, f"ar-{k}")
                        assert rel.outcome is Outcome.APPLIED and rel.value == {"a": 2, "b": 1}
                        return "released", 0
                    return "kept", 1
            except SerializationConflict:
                await asyncio.sleep(random.uniform(0, 0.005 * (attempt + 1)))
        raise AssertionError("gave up")

    async def main() -> list[tuple[str, int]]:
        aeng = _async_engine(backend)
        try:
            return await asyncio.gather(*(one(aeng, k) for k in range(40)))
        finally:
            await aeng.dispose()

    results = asyncio.run(main())
    kept = sum(n for _, n in results)
    assert Counter(kind for kind, _ in results)["restripe"] == 4
    check_item(engine, c, "a", 500 - 2 * kept)
    check_item(engine, c, "b", 500 - kept)
    refs = ledger(engine, c)
    assert len(refs) == 2 * 36
    assert sum(1 for r in refs if r[3] is not None) == 2 * (36 - kept)


def _connection_id(session: Session, backend: Any) -> int:
    fn = "pg_backend_pid()" if backend.name == "postgresql" else "CONNECTION_ID()"
    return int(session.execute(text(f"SELECT {fn}")).scalar_one())


def _lock_waiters(backend: Any, ids: list[int], statement: str = "UPDATE ") -> int:
    """How many of the connections ``ids`` wait for a lock (other tests' waiters do not count).

    MariaDB: a statement on the stripes starting with ``statement`` (an UPDATE; a restripe's
    INSERT; ``""``: any) running for over 300 ms (the holder keeps what they need).  Not
    information_schema.innodb_trx: its cache is capped in size and leaves transactions out while
    other tests on the server hold many locks.
    """
    if not ids:
        return 0
    sql = (
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid IN :ids"
        if backend.name == "postgresql"
        else "SELECT count(*) FROM information_schema.processlist WHERE id IN :ids AND command = 'Query'"
        f" AND time_ms > 300 AND info LIKE '{statement}%stateguard_counter_stripes %'"
    )
    stmt = text(sql).bindparams(bindparam("ids", expanding=True))
    with backend.engine.connect() as conn:
        return int(conn.execute(stmt, {"ids": ids}).scalar_one())


# README: "With plentiful stock there are none [deadlocks]", "restripe locks every stripe and keeps
# the total exactly, under concurrent decrements": one-call decrements queued behind an open
# restripe 8 -> 3 all apply once it commits (MariaDB: a decrement whose wait ended on a stripe the
# restripe deleted keeps that deleted row's lock; the sweep after it names only the stripes the
# count on stripe 0 names, never the deleted ones another buyer holds).
def test_decrements_waiting_behind_a_restripe_plentiful_stock(server: Any) -> None:
    """Four ref'd decrements of 1 unit wait behind an open restripe 8 -> 3 (8000 in stock): all
    APPLIED after it commits, no deadlock, exact total."""
    c = StripedCounter("behind", stripes=8)
    with Session(server.engine) as s, s.begin():
        c.create(s, "w", amount=8000)
    holder_ready, go = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def restriper() -> None:
        try:
            with Session(server.engine) as s, s.begin():
                assert c.restripe(s, "w", stripes=3).outcome is Outcome.APPLIED
                holder_ready.set()
                assert go.wait(30)
        except BaseException as error:
            errors.append(error)
            holder_ready.set()

    h = threading.Thread(target=restriper, daemon=True)
    h.start()
    assert holder_ready.wait(15) and not errors
    outcomes: list[Any] = [None] * 4

    ids: list[int] = []

    def buyer(i: int) -> None:
        try:
            with Session(server.engine) as s, s.begin():
                ids.append(_connection_id(s, server))
                outcomes[i] = c.decrement(s, "w", by=1, ref=f"wb-{i}").outcome
        except SerializationConflict as error:
            outcomes[i] = type(error).__name__

    buyers = [threading.Thread(target=buyer, args=(i,), daemon=True) for i in range(4)]
    for t in buyers:
        t.start()
    deadline = time.monotonic() + 15
    while _lock_waiters(server, ids) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)  # polling a condition, not hoping for a race
    assert _lock_waiters(server, ids) == 4, ("buyers never queued behind the restripe", outcomes)
    go.set()
    h.join(30)
    for t in buyers:
        t.join(30)
    assert not errors, errors
    assert outcomes == [Outcome.APPLIED] * 4, outcomes
    check_item(server.engine, c, "w", 7996)
