"""idempotent() in the caller's transaction: the block runs in a savepoint, so a block that raises
(also a BaseException) leaves nothing even when the caller commits, a block that succeeds commits
its unflushed changes, the ORM state after a failed block is consistent, nested calls and the
caller's own savepoints and unflushed work around the block behave as one unit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, insert, select, update
from sqlalchemy.orm import Session

from stateguard import (
    RequestInProgress,
    idempotent,
)
from tests._support.idem_items import Boom, Item, _keys, _names, items, md
from tests.conftest import Backend


@pytest.fixture
def eng(engine: Engine, backend: Backend) -> Iterator[Engine]:
    backend.create(md)
    yield engine


def _key_runs_fresh(engine: Engine, scope: str, key: str) -> None:
    """The key is free: a call with another fingerprint runs (no replay, no IdempotencyKeyReused)."""
    with (
        Session(engine) as s,
        s.begin(),
        idempotent(s, scope=scope, key=key, fingerprint="other-body") as call,
    ):
        assert not call.replayed
        call.complete("fresh")


# --------------------------------------------------------------------------- 2. savepoint semantics


def _seed(eng: Engine) -> None:
    with Session(eng) as s, s.begin():
        s.add(Item(id=1, name="seed", n=0))


@pytest.mark.rollback
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


@pytest.mark.rollback
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


@pytest.mark.rollback
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


@pytest.mark.rollback
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


@pytest.mark.rollback
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


@pytest.mark.rollback
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


@pytest.mark.rollback
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


@pytest.mark.rollback
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


@pytest.mark.rollback
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


@pytest.mark.rollback
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


# ------------------------------------------------ 2b. the caller's work around the block


@pytest.mark.rollback
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


@pytest.mark.rollback
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


@pytest.mark.rollback
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


@pytest.mark.rollback
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


@pytest.mark.rollback
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


# --------------------------------------------------------------------------- 2c. more edges


@pytest.mark.rollback
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


@pytest.mark.rollback
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


@pytest.mark.rollback
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


@pytest.mark.rollback
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


@pytest.mark.rollback
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


@pytest.mark.rollback
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


@pytest.mark.rollback
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


@pytest.mark.rollback
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
