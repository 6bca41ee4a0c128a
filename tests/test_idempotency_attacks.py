"""Hostile review of idempotent(): replay fidelity, same-transaction savepoint semantics, twins.

Written from the README's promises only (section "Idempotency keys")."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, cast

import pytest
from sqlalchemy import Engine, Integer, String, Table, func, insert, select, text, update
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import (
    IdempotencyKeyReused,
    RequestFailed,
    RequestInProgress,
    idempotent,
)
from stateguard.tables import idempotency_keys
from tests.conftest import Backend


def _wait_for_twin(backend: Backend, probe: Engine, out: dict[str, Any]) -> None:
    """Wait (4 s at most) until the twin is seen waiting on the claim; then ``out["overlap"]``."""
    for _ in range(200):
        if backend.name == "sqlite" or _blocked_twin(backend, probe):
            out["overlap"] = True
            return
        threading.Event().wait(0.02)


def _run_both(*workers: Any) -> None:
    """Run the workers in threads at once and wait for them (30 s each at most)."""
    threads = [threading.Thread(target=worker) for worker in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)


class _Base(DeclarativeBase):
    pass


class Item(_Base):
    __tablename__ = "rv_items"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    name: Mapped[str] = mapped_column(String(50))
    n: Mapped[int] = mapped_column(Integer, default=0)


md = _Base.metadata
items = cast(Table, Item.__table__)


@pytest.fixture
def eng(engine: Engine, backend: Backend) -> Iterator[Engine]:
    backend.create(md)
    yield engine


def _names(engine: Engine) -> list[str]:
    with engine.connect() as c:
        return sorted(c.scalars(select(items.c.name)).all())


def _keys(engine: Engine, scope: str) -> list[str]:
    with engine.connect() as c:
        return sorted(
            c.scalars(select(idempotency_keys.c.idem_key).where(idempotency_keys.c.scope == scope)).all()
        )


def _key_runs_fresh(engine: Engine, scope: str, key: str) -> None:
    """The key is free: a call with another fingerprint runs (no replay, no IdempotencyKeyReused)."""
    with (
        Session(engine) as s,
        s.begin(),
        idempotent(s, scope=scope, key=key, fingerprint="other-body") as call,
    ):
        assert not call.replayed
        call.complete("fresh")


class Boom(Exception):
    pass


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


# --------------------------------------------------------------------------- 2. savepoint semantics


def _seed(eng: Engine) -> None:
    with Session(eng) as s, s.begin():
        s.add(Item(id=1, name="seed", n=0))


@pytest.mark.parametrize(
    "how",
    ["add_flush", "add_noflush", "modify_noflush", "modify_flush", "execute", "early_conn", "driver_sql"],
)
def test_a_block_that_raises_leaves_nothing_even_when_the_caller_commits(eng: Engine, how: str) -> None:
    _seed(eng)
    with Session(eng) as s, s.begin():
        seed = s.get_one(Item, 1)
        conn = s.connection()
        try:
            with idempotent(s, scope="sp", key="k", fingerprint="body") as call:
                assert not call.replayed
                if how == "add_flush":
                    s.add(Item(id=2, name="leak"))
                    s.flush()
                elif how == "add_noflush":
                    s.add(Item(id=2, name="leak"))
                elif how == "modify_noflush":
                    seed.name = "leak"
                elif how == "modify_flush":
                    seed.name = "leak"
                    s.flush()
                elif how == "execute":
                    s.execute(insert(items).values(id=2, name="leak", n=0))
                elif how == "early_conn":
                    conn.execute(insert(items).values(id=2, name="leak", n=0))
                elif how == "driver_sql":
                    conn.exec_driver_sql("INSERT INTO rv_items (id, name, n) VALUES (2, 'leak', 0)")
                raise Boom
        except Boom:
            pass
        s.add(Item(id=3, name="after"))  # the caller's own work, committed
    assert _names(eng) == ["after", "seed"]
    assert _keys(eng, "sp") == []
    _key_runs_fresh(eng, "sp", "k")


@pytest.mark.parametrize("how", ["add_noflush", "modify_noflush"])
def test_a_block_that_succeeds_with_unflushed_changes_commits_them(eng: Engine, how: str) -> None:
    _seed(eng)
    with Session(eng) as s, s.begin():
        seed = s.get_one(Item, 1)
        with idempotent(s, scope="ok", key="k", fingerprint="b") as call:
            if how == "add_noflush":
                s.add(Item(id=2, name="new"))
            else:
                seed.name = "changed"
            call.complete({"ok": True})
    assert _names(eng) == (["new", "seed"] if how == "add_noflush" else ["changed"])
    with Session(eng) as s, s.begin(), idempotent(s, scope="ok", key="k", fingerprint="b") as call:
        assert call.replayed and call.response == {"ok": True}


def test_orm_state_after_a_failed_block_is_consistent(eng: Engine) -> None:
    """After the block's rollback, loaded objects must not carry the rolled-back values into the commit."""
    _seed(eng)
    with Session(eng) as s, s.begin():
        seed = s.get_one(Item, 1)
        try:
            with idempotent(s, scope="sp", key="k"):
                seed.n = 41
                s.flush()
                seed.n = 42  # unflushed on top
                raise Boom
        except Boom:
            pass
        assert seed.n == 0, seed.n
    with eng.connect() as c:
        assert c.scalar(select(items.c.n).where(items.c.id == 1)) == 0


@pytest.mark.parametrize("inner_fails", [False, True])
def test_user_begin_nested_inside_the_block(eng: Engine, inner_fails: bool) -> None:
    with Session(eng) as s, s.begin():
        with idempotent(s, scope="n", key="k") as call:
            s.add(Item(id=1, name="outer"))
            try:
                with s.begin_nested():
                    s.add(Item(id=2, name="inner"))
                    s.flush()
                    if inner_fails:
                        raise Boom
            except Boom:
                pass
            call.complete("done")
    assert _names(eng) == (["outer"] if inner_fails else ["inner", "outer"])
    assert _keys(eng, "n") == ["k"]


def test_user_begin_nested_inside_a_failing_block(eng: Engine) -> None:
    with Session(eng) as s, s.begin():
        try:
            with idempotent(s, scope="n", key="k"):
                with s.begin_nested():
                    s.add(Item(id=2, name="inner"))
                raise Boom
        except Boom:
            pass
        s.add(Item(id=3, name="after"))
    assert _names(eng) == ["after"]
    _key_runs_fresh(eng, "n", "k")


def test_nested_calls_inner_fails_outer_completes(eng: Engine) -> None:
    with Session(eng) as s, s.begin():
        with idempotent(s, scope="o", key="outer", fingerprint="x") as outer:
            s.add(Item(id=1, name="outer"))
            try:
                with idempotent(s, scope="i", key="inner", fingerprint="x") as inner:
                    assert not inner.replayed
                    s.add(Item(id=2, name="inner"))
                    raise Boom
            except Boom:
                pass
            outer.complete("o")
    assert _names(eng) == ["outer"]
    assert _keys(eng, "o") == ["outer"]
    assert _keys(eng, "i") == []
    _key_runs_fresh(eng, "i", "inner")


def test_nested_calls_outer_fails_after_inner_completed(eng: Engine) -> None:
    with Session(eng) as s, s.begin():
        try:
            with idempotent(s, scope="o", key="outer"):
                s.add(Item(id=1, name="outer"))
                with idempotent(s, scope="i", key="inner") as inner:
                    s.add(Item(id=2, name="inner"))
                    inner.complete("i")
                raise Boom
        except Boom:
            pass
    assert _names(eng) == []
    assert _keys(eng, "o") == [] and _keys(eng, "i") == []
    _key_runs_fresh(eng, "o", "outer")
    _key_runs_fresh(eng, "i", "inner")


def test_nested_calls_same_key_inside_its_own_block(eng: Engine) -> None:
    """Re-entering the same key inside its own block must not run the work twice."""
    ran = []
    with Session(eng) as s, s.begin():
        with idempotent(s, scope="same", key="k", fingerprint="b") as outer:
            ran.append("outer")
            try:
                with idempotent(s, scope="same", key="k", fingerprint="b") as inner:
                    if not inner.replayed:
                        ran.append("inner")
                        inner.complete("inner")
            except RequestInProgress:
                pass
            outer.complete("outer")
    assert ran == ["outer"]


@pytest.mark.parametrize("flush_first", [False, True])
def test_call_inside_a_user_savepoint_that_is_rolled_back(eng: Engine, flush_first: bool) -> None:
    with Session(eng) as s, s.begin():
        keep = Item(id=1, name="keep")
        s.add(keep)
        if flush_first:
            s.flush()
        sp = s.begin_nested()
        with idempotent(s, scope="u", key="k", fingerprint="b") as call:
            s.add(Item(id=2, name="gone"))
            s.flush()
            keep.n = 7
            s.flush()
            call.complete("done")
        sp.rollback()
        assert keep.n == 0 and keep in s
    assert _names(eng) == ["keep"]
    with eng.connect() as c:
        assert c.scalar(select(items.c.n).where(items.c.id == 1)) == 0
    assert _keys(eng, "u") == []
    _key_runs_fresh(eng, "u", "k")


def test_taken_over_record_failing_in_same_transaction_keeps_its_checkpoint(eng: Engine) -> None:
    """A separate-mode record released with a checkpoint, then taken over in same_transaction mode whose
    block fails: the record must go back as it was (still takeable, checkpoint kept)."""
    with Session(eng) as s, idempotent(s, scope="t", key="k", mode="separate") as call:
        call.checkpoint("half", {"id": 2**63 + 5})
        call.release("later")
    with Session(eng) as s, s.begin():
        try:
            with idempotent(s, scope="t", key="k") as call:
                assert call.taken_over and call.checkpoint_data == {"id": 2**63 + 5}
                s.add(Item(id=1, name="leak"))
                raise Boom
        except Boom:
            pass
    assert _names(eng) == []
    with Session(eng) as s, idempotent(s, scope="t", key="k", mode="separate") as call:
        assert call.taken_over and call.checkpoint_name == "half"
        assert call.checkpoint_data == {"id": 2**63 + 5}
        call.complete("ok")


# --------------------------------------------------------------------------- 3. twins


def _blocked_twin(backend: Backend, probe: Engine) -> bool:
    """Is some other transaction waiting on a lock right now?"""
    with probe.connect() as c:
        if backend.name == "postgresql":
            return bool(c.scalar(text("SELECT count(*) FROM pg_locks WHERE NOT granted")))
        if backend.name == "mariadb":
            return bool(
                c.scalar(
                    text(
                        "SELECT count(*) FROM information_schema.processlist WHERE id <> CONNECTION_ID()"
                        " AND command = 'Query' AND info IS NOT NULL"
                    )
                )
            )
    return True


@pytest.mark.parametrize("mode", ["same_transaction", "separate"])
def test_two_threads_same_key_run_the_work_once(eng: Engine, backend: Backend, mode: str) -> None:
    probe = backend.new_engine(pool_size=1, max_overflow=0)
    barrier = threading.Barrier(2)
    twin_done = threading.Event()
    results: list[Any] = []
    errors: list[BaseException] = []
    ran = []
    overlapped: list[bool] = []

    def worker(i: int) -> None:
        try:
            barrier.wait(10)
            with Session(eng) as s:
                ctx = s.begin() if mode == "same_transaction" else None
                if ctx:
                    ctx.__enter__()
                try:
                    with idempotent(s, scope="twin", key="k", fingerprint="b", mode=mode) as call:  # type: ignore[arg-type]
                        if call.replayed:
                            results.append(("replayed", call.response))
                        else:
                            ran.append(i)
                            # hold the claim until the twin has bumped into it
                            for _ in range(200):
                                if twin_done.is_set() or (
                                    mode == "same_transaction" and _blocked_twin(backend, probe)
                                ):
                                    overlapped.append(True)
                                    break
                                twin_done.wait(0.02)
                            s.add(Item(id=100 + i, name=f"w{i}"))
                            s.flush()
                            results.append(("ran", call.complete(f"by {i}")))
                    if ctx:
                        ctx.__exit__(None, None, None)
                except BaseException:
                    if ctx:
                        ctx.__exit__(None, None, None)
                    raise
        except RequestInProgress as e:
            results.append(("in_progress", e.retry_after))
        except BaseException as e:
            errors.append(e)
        finally:
            if not ran or ran[0] != i:
                twin_done.set()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    probe.dispose()
    assert not errors, errors
    assert len(ran) == 1, ran
    assert overlapped, ("the twin never met the claim", results)
    kinds = sorted(r[0] for r in results)
    assert kinds in (["ran", "replayed"], ["in_progress", "ran"]), results
    if mode == "same_transaction":
        assert kinds == ["ran", "replayed"], results
    for r in results:
        if r[0] == "replayed":
            assert r[1] == f"by {ran[0]}"
    with eng.connect() as c:
        assert c.scalar(select(func.count()).select_from(items)) == 1


# ------------------------------------------------ 2b. the caller's work around the block


@pytest.mark.parametrize("how", ["add", "modify", "modify_same_attr"])
def test_callers_unflushed_work_before_the_call_survives_a_failing_block(eng: Engine, how: str) -> None:
    """Pending changes made *before* idempotent() are the caller's, not the block's: a failing block
    must not roll them back (a lazily sent savepoint must not swallow the autoflush of earlier work)."""
    _seed(eng)
    with Session(eng) as s, s.begin():
        seed = s.get_one(Item, 1)
        if how == "add":
            s.add(Item(id=5, name="before"))
        elif how == "modify":
            seed.name = "before"
        else:
            seed.n = 5
        try:
            with idempotent(s, scope="pre", key="k") as call:
                assert not call.replayed
                if how == "modify_same_attr":
                    seed.n = 6
                s.execute(insert(items).values(id=9, name="leak", n=0))  # autoflushes first
                raise Boom
        except Boom:
            pass
    with eng.connect() as c:
        rows = {r.id: (r.name, r.n) for r in c.execute(select(items))}
    expected = {
        "add": {1: ("seed", 0), 5: ("before", 0)},
        "modify": {1: ("before", 0)},
        "modify_same_attr": {1: ("seed", 5)},
    }[how]
    assert rows == expected
    assert _keys(eng, "pre") == []


def test_block_with_a_database_error_inside_is_recoverable(eng: Engine) -> None:
    """A duplicate key inside the block (PostgreSQL aborts the transaction): the savepoint rollback
    makes the transaction usable again, the caller commits its own work, the key is free."""
    _seed(eng)
    from sqlalchemy.exc import IntegrityError

    with Session(eng) as s, s.begin():
        try:
            with idempotent(s, scope="dberr", key="k"):
                s.execute(insert(items).values(id=1, name="dup", n=0))
        except IntegrityError:
            pass
        s.add(Item(id=2, name="after"))
    assert _names(eng) == ["after", "seed"]
    _key_runs_fresh(eng, "dberr", "k")


def test_raise_after_complete_stores_nothing(eng: Engine) -> None:
    with Session(eng) as s, s.begin():
        try:
            with idempotent(s, scope="rc", key="k", fingerprint="b") as call:
                s.add(Item(id=1, name="leak"))
                call.complete("stored?")
                raise Boom
        except Boom:
            pass
    assert _names(eng) == [] and _keys(eng, "rc") == []
    _key_runs_fresh(eng, "rc", "k")


def test_retry_in_the_same_transaction_after_a_failed_block_runs(eng: Engine) -> None:
    ran = 0
    with Session(eng) as s, s.begin():
        for attempt in range(2):
            try:
                with idempotent(s, scope="again", key="k", fingerprint="b") as call:
                    assert not call.replayed
                    ran += 1
                    s.add(Item(id=10 + attempt, name=f"a{attempt}"))
                    s.flush()
                    if attempt == 0:
                        raise Boom
                    call.complete("second")
            except Boom:
                pass
    assert ran == 2
    assert _names(eng) == ["a1"]
    with Session(eng) as s, s.begin(), idempotent(s, scope="again", key="k", fingerprint="b") as call:
        assert call.replayed and call.response == "second"


def test_reclaim_in_the_same_transaction_after_user_savepoint_rollback(eng: Engine) -> None:
    with Session(eng) as s, s.begin():
        sp = s.begin_nested()
        with idempotent(s, scope="re", key="k", fingerprint="b") as call:
            s.add(Item(id=1, name="gone"))
            call.complete("first")
        sp.rollback()
        with idempotent(s, scope="re", key="k", fingerprint="b") as call:
            assert not call.replayed, "replayed a response whose savepoint was rolled back"
            s.add(Item(id=2, name="kept"))
            call.complete("second")
    assert _names(eng) == ["kept"]
    with Session(eng) as s, s.begin(), idempotent(s, scope="re", key="k", fingerprint="b") as call:
        assert call.replayed and call.response == "second"


def test_a_waiting_twin_runs_when_the_first_block_fails_and_its_caller_commits(
    eng: Engine, backend: Backend
) -> None:
    probe = backend.new_engine(pool_size=1, max_overflow=0)
    claimed = threading.Event()
    out: dict[str, Any] = {}

    def first() -> None:
        try:
            with Session(eng) as s, s.begin():
                try:
                    with idempotent(s, scope="tw", key="k", fingerprint="b"):
                        s.add(Item(id=1, name="first-leak"))
                        s.flush()
                        claimed.set()
                        _wait_for_twin(backend, probe, out)
                        raise Boom
                except Boom:
                    pass
                s.add(Item(id=3, name="first-other"))
            out["first"] = "ok"
        except BaseException as e:
            out["first"] = e

    def twin() -> None:
        claimed.wait(10)
        try:
            with Session(eng) as s, s.begin(), idempotent(s, scope="tw", key="k", fingerprint="b") as call:
                if call.replayed:
                    out["twin"] = ("replayed", call.response)
                else:
                    s.add(Item(id=2, name="twin"))
                    out["twin"] = ("ran", call.complete("twin"))
        except BaseException as e:
            out["twin"] = e

    _run_both(first, twin)
    probe.dispose()
    assert out["first"] == "ok"
    assert out.get("overlap"), "the twin never waited on the claim"
    assert out["twin"] == ("ran", "twin"), out["twin"]
    assert _names(eng) == ["first-other", "twin"]


# --------------------------------------------------------------------------- 2c. more edges


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, GeneratorExit])
def test_base_exceptions_also_roll_the_block_back(eng: Engine, exc: type[BaseException]) -> None:
    with Session(eng) as s, s.begin():
        try:
            with idempotent(s, scope="be", key="k", fingerprint="b"):
                s.add(Item(id=1, name="leak"))
                s.flush()
                raise exc()
        except exc:
            pass
        s.add(Item(id=2, name="after"))
    assert _names(eng) == ["after"]
    assert _keys(eng, "be") == []
    _key_runs_fresh(eng, "be", "k")


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_base_exceptions_release_a_separate_key(eng: Engine, exc: type[BaseException]) -> None:
    with pytest.raises(exc), Session(eng) as s, idempotent(s, scope="bs", key="k", mode="separate"):
        s.add(Item(id=1, name="leak"))
        s.flush()
        raise exc()
    assert _names(eng) == []
    with Session(eng) as s, idempotent(s, scope="bs", key="k", mode="separate") as call:
        assert not call.replayed
        call.complete("ok")


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


def test_failing_outer_block_keeps_an_inner_replayed_record(eng: Engine) -> None:
    with Session(eng) as s, s.begin(), idempotent(s, scope="i", key="inner") as call:
        call.complete("old")
    with Session(eng) as s, s.begin():
        try:
            with idempotent(s, scope="o", key="outer"):
                with idempotent(s, scope="i", key="inner") as inner:
                    assert inner.replayed and inner.response == "old"
                raise Boom
        except Boom:
            pass
    with Session(eng) as s, s.begin(), idempotent(s, scope="i", key="inner") as call:
        assert call.replayed and call.response == "old"


def test_orm_objects_of_a_failed_block_are_gone_from_the_session(eng: Engine) -> None:
    with Session(eng) as s, s.begin():
        flushed, pending = Item(id=1, name="f"), Item(id=2, name="p")
        try:
            with idempotent(s, scope="gone", key="k"):
                s.add(flushed)
                s.flush()
                s.add(pending)
                raise Boom
        except Boom:
            pass
        assert flushed not in s and pending not in s
        assert s.get(Item, 1) is None and s.get(Item, 2) is None
    assert _names(eng) == []


def test_same_transaction_gets_in_progress_for_a_live_separate_claim(eng: Engine) -> None:
    with Session(eng) as s1, idempotent(s1, scope="mix", key="k", mode="separate") as first:
        with pytest.raises(RequestInProgress) as caught, Session(eng) as s2, s2.begin():
            with idempotent(s2, scope="mix", key="k"):
                pytest.fail("ran while a live claim holds the key")
        assert caught.value.retry_after is not None
        first.complete({"n": 2**63 + 1})
    with Session(eng) as s, s.begin(), idempotent(s, scope="mix", key="k") as call:
        assert call.replayed and call.response == {"n": 2**63 + 1}


@pytest.mark.parametrize("how", ["delete_noflush", "delete_flush", "orm_update_sync", "merge_noflush"])
def test_more_orm_writes_of_a_failed_block_roll_back(eng: Engine, how: str) -> None:
    _seed(eng)
    with Session(eng) as s, s.begin():
        seed = s.get_one(Item, 1)
        try:
            with idempotent(s, scope="orm", key="k"):
                if how == "delete_noflush":
                    s.delete(seed)
                elif how == "delete_flush":
                    s.delete(seed)
                    s.flush()
                elif how == "orm_update_sync":
                    s.execute(update(Item).where(Item.id == 1).values(name="leak", n=9))
                    assert seed.name == "leak"
                else:
                    s.merge(Item(id=1, name="leak", n=9))
                raise Boom
        except Boom:
            pass
        assert seed in s
        assert (seed.name, seed.n) == ("seed", 0)
        seed.n = 1  # the caller's own change after the failure
    with eng.connect() as c:
        assert [tuple(r) for r in c.execute(select(items.c.id, items.c.name, items.c.n))] == [(1, "seed", 1)]
    _key_runs_fresh(eng, "orm", "k")


def test_a_session_on_the_same_connection_is_covered(eng: Engine) -> None:
    with Session(eng) as s, s.begin():
        other = Session(bind=s.connection())
        try:
            with idempotent(s, scope="oc", key="k"):
                other.add(Item(id=1, name="leak"))
                other.flush()
                raise Boom
        except Boom:
            pass
        other.close()
        s.add(Item(id=2, name="after"))
    assert _names(eng) == ["after"]
    _key_runs_fresh(eng, "oc", "k")


def test_separate_mode_edges(eng: Engine) -> None:
    # release(forget=True) frees the key for another body
    with Session(eng) as s, idempotent(s, scope="se", key="k", fingerprint="a", mode="separate") as call:
        call.checkpoint("x", {"n": 2**63})
        call.release("refused", forget=True)
    with Session(eng) as s, idempotent(s, scope="se", key="k", fingerprint="b", mode="separate") as call:
        assert not call.replayed and not call.taken_over and call.checkpoint_name is None
        call.complete("b")
    # a non-retryable error whose text has NUL / lone surrogate is stored escaped, not left in progress
    with pytest.raises(Boom), Session(eng) as s:
        with idempotent(s, scope="se", key="nul", mode="separate", non_retryable=(Boom,)):
            raise Boom("a\x00b\ud800c")
    with pytest.raises(RequestFailed) as caught, Session(eng) as s:
        with idempotent(s, scope="se", key="nul", mode="separate"):
            pytest.fail("ran")
    error = caught.value.error
    assert error is not None and error.startswith("Boom: a") and "\x00" not in error


def test_separate_failure_rolls_back_uncheckpointed_writes_and_keeps_checkpointed_ones(eng: Engine) -> None:
    with pytest.raises(Boom), Session(eng) as s:
        with idempotent(s, scope="sf", key="k", mode="separate") as call:
            s.add(Item(id=1, name="phase1"))
            call.checkpoint("p1", {"s": 'é\u2028😀\\"', "n": -(2**63) - 1})
            s.add(Item(id=2, name="leak"))
            s.flush()
            raise Boom
    assert _names(eng) == ["phase1"]
    with Session(eng) as s, idempotent(s, scope="sf", key="k", mode="separate") as call:
        assert call.taken_over and call.attempt == 2
        assert call.checkpoint_data == {"s": 'é\u2028😀\\"', "n": -(2**63) - 1}
        call.complete("ok")


@pytest.mark.parametrize("mode", ["same_transaction", "separate"])
@pytest.mark.parametrize("slack", [1, 64, 400, 2000])
def test_mariadb_responses_at_the_packet_limit_store_or_refuse_cleanly(
    mariadb: Backend, mode: str, slack: int
) -> None:
    """Just under max_allowed_packet: the text fits, the statement around it may not.  Either it is
    stored and replays, or InvalidArgument leaves the call open; never a dropped connection."""
    from stateguard import InvalidArgument, create_tables, drop_tables

    eng = mariadb.engine
    drop_tables(eng)
    create_tables(eng)

    with eng.connect() as c:
        limit = int(c.scalar(text("SELECT @@max_allowed_packet")))
    big = "x" * (limit - slack - 2)  # its JSON text is limit - slack bytes
    stored: Any = None
    with Session(eng) as s:
        tx = s.begin() if mode == "same_transaction" else None
        with idempotent(s, scope="pk", key="k", mode=mode) as call:  # type: ignore[arg-type]
            try:
                stored = call.complete(big)
            except InvalidArgument:
                stored = call.complete("small")
        if tx:
            tx.commit()
    with Session(eng) as s, idempotent(s, scope="pk", key="k", mode="separate") as call:
        assert call.replayed
        assert call.response == stored
    drop_tables(eng)


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_twin_at_stricter_isolation_never_runs_twice_nor_replays_garbage(
    eng: Engine, backend: Backend, isolation: str
) -> None:
    """The twin waits on the claim, at REPEATABLE READ / SERIALIZABLE: it may replay or get a retryable
    conflict, and a retry replays; it must never run the work nor return a wrong response."""
    from stateguard import DeadlockDetected, SerializationConflict

    if backend.name == "sqlite":
        iso_eng = backend.new_engine(pool_size=2, max_overflow=0)  # SQLite is serializable already
    else:
        iso_eng = backend.new_engine(pool_size=2, max_overflow=0, isolation_level=isolation)
    _ = eng
    probe = backend.new_engine(pool_size=1, max_overflow=0)
    claimed = threading.Event()
    out: dict[str, Any] = {}
    ran: list[str] = []

    def first() -> None:
        try:
            with Session(eng) as s, s.begin(), idempotent(s, scope="iso", key="k", fingerprint="b") as call:
                ran.append("first")
                s.add(Item(id=1, name="first"))
                s.flush()
                claimed.set()
                _wait_for_twin(backend, probe, out)
                call.complete({"by": "first", "n": 2**63 + 7})
            out["first"] = "ok"
        except BaseException as e:
            out["first"] = e
            claimed.set()

    def twin() -> None:
        claimed.wait(10)
        try:
            with Session(iso_eng) as s, s.begin():
                s.execute(
                    select(func.count()).select_from(items)
                )  # take the snapshot before the first commits
                with idempotent(s, scope="iso", key="k", fingerprint="b") as call:
                    if call.replayed:
                        out["twin"] = ("replayed", call.response)
                    else:
                        ran.append("twin")
                        out["twin"] = ("ran", call.complete("twin"))
        except (DeadlockDetected, SerializationConflict, RequestInProgress) as e:
            out["twin"] = ("retryable", type(e).__name__)
        except BaseException as e:
            out["twin"] = e

    _run_both(first, twin)
    probe.dispose()
    try:
        assert out["first"] == "ok", out
        assert out.get("overlap"), "the twin never waited on the claim"
        assert ran == ["first"], (ran, out)
        assert out["twin"][0] in ("replayed", "retryable"), out["twin"]
        if out["twin"][0] == "replayed":
            assert out["twin"][1] == {"by": "first", "n": 2**63 + 7}, out["twin"]
        with Session(iso_eng) as s, s.begin(), idempotent(s, scope="iso", key="k", fingerprint="b") as call:
            assert call.replayed and call.response == {"by": "first", "n": 2**63 + 7}
    finally:
        iso_eng.dispose()


def test_unclosed_user_savepoint_inside_a_failing_block(eng: Engine) -> None:
    with Session(eng) as s, s.begin():
        try:
            with idempotent(s, scope="uc", key="k"):
                s.begin_nested()  # never closed by the block
                s.add(Item(id=1, name="leak"))
                s.flush()
                raise Boom
        except Boom:
            pass
        s.add(Item(id=2, name="after"))
    assert _names(eng) == ["after"]
    _key_runs_fresh(eng, "uc", "k")


@pytest.mark.parametrize("fail", [False, True])
def test_autobegun_session_without_begin(eng: Engine, fail: bool) -> None:
    with Session(eng) as s:
        try:
            with idempotent(s, scope="ab", key="k", fingerprint="b") as call:
                s.add(Item(id=1, name="block"))
                if fail:
                    raise Boom
                call.complete("done")
        except Boom:
            pass
        s.add(Item(id=2, name="after"))
        s.commit()
    assert _names(eng) == (["after"] if fail else ["after", "block"])
    assert _keys(eng, "ab") == ([] if fail else ["k"])


def test_objects_loaded_inside_a_failed_block_reload(eng: Engine) -> None:
    _seed(eng)
    with Session(eng) as s, s.begin():
        try:
            with idempotent(s, scope="li", key="k"):
                seed = s.get_one(Item, 1)
                seed.name, seed.n = "leak", 3
                s.flush()
                raise Boom
        except Boom:
            pass
        again = s.get_one(Item, 1)
        assert (again.name, again.n) == ("seed", 0)
        again.n += 1
    with eng.connect() as c:
        assert [tuple(r) for r in c.execute(select(items.c.name, items.c.n))] == [("seed", 1)]
