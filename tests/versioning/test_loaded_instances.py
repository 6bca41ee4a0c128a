"""Loaded instances after guarded updates of a versioned model: every kind of rollback (outer, a
savepoint left by an exception, a flush error, nested levels) puts the title and version back, a
STALE result does not sync the instance, instances of other sessions and detached ones are left
alone, and AsyncSession savepoints behave the same."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.orm.exc import StaleDataError

from stateguard import (
    Outcome,
    StateguardError,
    guarded_update,
)
from tests._support.version_docs import DOC_TABLES, Doc, _Base, _race, _row
from tests.conftest import Backend, backends_with

pytestmark = DOC_TABLES


# -- loaded objects and rollbacks -------------------------------------------------------------


@pytest.mark.rollback
def test_outer_rollback_after_guarded_update_reloads_title_and_version(engine: Engine) -> None:
    with Session(engine) as s:
        s.begin()
        doc = s.get_one(Doc, 1)
        assert guarded_update(s, Doc, doc, {"title": "new"}, expected_version=1).applied
        assert (doc.title, doc.version) == ("new", 2)
        s.rollback()
        assert (doc.title, doc.version) == ("orig", 1)
        doc.note = "orm after rollback"
        s.commit()
    assert _row(engine, 1) == ("draft", "orig", "orm after rollback", 2, 0)


@pytest.mark.rollback
def test_savepoint_left_by_an_exception_undoes_a_trigger_on_the_loaded_instance(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        doc = s.get_one(Doc, 1)
        with pytest.raises(RuntimeError):
            with s.begin_nested():
                assert Doc.flow.publish(s, doc).applied
                assert (doc.status, doc.version) == ("published", 2)
                raise RuntimeError("boom")
        assert (doc.status, doc.version) == ("draft", 1)
        doc.note = "flushed"
    assert _row(engine, 1) == ("draft", "orig", "flushed", 2, 0)


@pytest.mark.rollback
def test_a_flush_error_inside_the_savepoint_undoes_the_guarded_write_on_the_instance(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        doc = s.get_one(Doc, 1)
        with pytest.raises(IntegrityError):
            with s.begin_nested():
                assert guarded_update(s, Doc, doc, {"title": "lost"}, expected_version=1).applied
                s.add(Doc(id=2))  # duplicate key: the flush fails inside the savepoint
                s.flush()
        assert (doc.title, doc.version) == ("orig", 1)
        doc.note = "after flush error"
    assert _row(engine, 1) == ("draft", "orig", "after flush error", 2, 0)


@pytest.mark.rollback
def test_inner_savepoint_rolled_back_outer_released_keeps_only_the_outer_write(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        doc = s.get_one(Doc, 1)
        with s.begin_nested():
            assert guarded_update(s, Doc, doc, {"title": "outer"}, expected_version=1).applied
            inner = s.begin_nested()
            assert Doc.flow.publish(s, doc).applied
            assert guarded_update(s, Doc, doc, {"note": "inner"}, expected_version=3).applied
            assert (doc.status, doc.version) == ("published", 4)
            inner.rollback()
            assert (doc.title, doc.status, doc.note, doc.version) == ("outer", "draft", None, 2)
        doc.hits = 7
    assert _row(engine, 1) == ("draft", "outer", None, 3, 7)


@pytest.mark.rollback
def test_three_levels_middle_rolled_back_after_inner_released(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        doc = s.get_one(Doc, 1)
        a = s.begin_nested()
        assert guarded_update(s, Doc, 1, {"title": "a"}, expected_version=1).applied
        b = s.begin_nested()
        c = s.begin_nested()
        assert guarded_update(s, Doc, 1, {"note": "c"}, expected_version=2).applied
        c.commit()
        assert (doc.title, doc.note, doc.version) == ("a", "c", 3)
        b.rollback()
        assert (doc.title, doc.note, doc.version) == ("a", None, 2)
        a.commit()
        doc.hits = 1
    assert _row(engine, 1) == ("draft", "a", None, 3, 1)


@pytest.mark.rollback
@pytest.mark.parametrize("backend", backends_with("savepoint_releases_locks"), indirect=True)
def test_rolled_back_savepoint_then_another_session_commits_then_flush_is_stale(engine: Engine) -> None:
    """After a savepoint rollback the instance holds the pre-write version; a concurrent commit must
    still make the stale object's flush fail (no lost update through a version the sync left behind)."""
    with Session(engine) as s:
        s.begin()
        doc = s.get_one(Doc, 1)
        with pytest.raises(RuntimeError), s.begin_nested():
            assert guarded_update(s, Doc, doc, {"title": "sp"}, expected_version=1).applied
            raise RuntimeError
        assert doc.version == 1  # reloaded inside this transaction
        with Session(engine) as other, other.begin():
            assert guarded_update(other, Doc, 1, {"note": "other"}, expected_version=1).applied
        doc.title = "mine"
        with pytest.raises(StaleDataError):
            s.flush()
        s.rollback()
    assert _row(engine, 1) == ("draft", "orig", "other", 2, 0)


@pytest.mark.rollback
def test_stale_result_does_not_sync_the_instance_so_its_flush_still_fails(engine: Engine) -> None:
    with Session(engine) as s:
        s.begin()
        doc = s.get_one(Doc, 1)
        with Session(engine) as other, other.begin():
            assert Doc.flow.publish(other, 1).applied
        r = guarded_update(s, Doc, doc, {"title": "late"}, expected_version=doc.version)
        assert r.outcome is Outcome.STALE
        assert r.version == 2, f"STALE must report the version found in the row, got {r.version}"
        assert doc.version == 1
        doc.note = "lost update?"
        with pytest.raises(StaleDataError):
            s.flush()
        s.rollback()
    assert _row(engine, 1) == ("published", "orig", None, 2, 0)


@pytest.mark.rollback
def test_trigger_by_key_syncs_the_identity_map_instance_and_a_rollback_reverts_it(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        doc = s.get_one(Doc, 1)
        sp = s.begin_nested()
        assert Doc.flow.archive(s, 1).state == "archived"
        assert (doc.status, doc.version) == ("archived", 2)
        sp.rollback()
        assert (doc.status, doc.version) == ("draft", 1)
        assert Doc.flow.publish(s, doc).applied
    assert _row(engine, 1)[0::3] == ("published", 2)


@pytest.mark.rollback
def test_an_instance_of_another_session_is_not_left_showing_a_rolled_back_state(engine: Engine) -> None:
    """An instance of session A passed to a trigger run in session B only names the row: B's rollback
    cannot expire it, so it is not synced (found: it kept showing "published"/2 over a draft/1 row)."""
    with Session(engine) as a:
        doc = a.get_one(Doc, 1)
        with Session(engine) as b:
            b.begin()
            r = Doc.flow.publish(b, doc)
            assert r.applied
            b.rollback()
        assert _row(engine, 1)[0::3] == ("draft", 1)
        assert (doc.status, doc.version) == ("draft", 1)


@pytest.mark.rollback
def test_a_detached_instance_is_not_left_showing_a_rolled_back_version(engine: Engine) -> None:
    """The same with a detached instance (found: after the writer's rollback it said version 2 and title
    "new" while the row held 1 and "orig")."""
    with Session(engine) as a:
        doc = a.get_one(Doc, 1)
    with Session(engine) as b:
        b.begin()
        assert guarded_update(b, Doc, doc, {"title": "new"}, expected_version=1).applied
        b.rollback()
    assert _row(engine, 1)[1::2] == ("orig", 1)
    assert (doc.title, doc.version) == ("orig", 1)


@pytest.mark.rollback
def test_orm_flush_racing_a_guarded_update_on_the_same_version_one_wins(
    engine: Engine, backend: Backend
) -> None:
    def body(eng: Engine, barrier: threading.Barrier, i: int) -> Any:
        with Session(eng) as s, s.begin():
            doc = s.get_one(Doc, 1)
            barrier.wait(30)
            try:
                if i == 0:
                    doc.note = "orm"
                    s.flush()
                    return "APPLIED"
                return guarded_update(s, Doc, doc, {"title": "sg"}, expected_version=doc.version).outcome.name
            except StaleDataError:
                return "STALE"
            except StateguardError as error:  # SQLite: the second writer's busy snapshot
                assert error.retryable, error
                return "CONFLICT"

    for _ in range(3):
        before = _row(engine, 1)
        results = _race(backend, 2, body)
        assert not [r for r in results if isinstance(r, BaseException)], results
        assert results.count("APPLIED") == 1 and set(results) <= {"APPLIED", "STALE", "CONFLICT"}, results
        after = _row(engine, 1)
        assert after.version == before.version + 1
        assert (after.note == "orm") != (after.title == "sg" and before.title != "sg"), (before, after)
        with engine.begin() as conn:
            conn.execute(Doc.__table__.update().where(Doc.id == 1).values(note=None, title="orig"))


@pytest.mark.rollback
def test_async_session_savepoint_rollback_reverts_the_loaded_instance(sqlite: Backend) -> None:
    import asyncio

    from sqlalchemy.ext.asyncio import AsyncSession

    from stateguard import async_sqlite_engine

    sqlite.create(_Base.metadata)
    with Session(sqlite.engine) as s, s.begin():
        s.add(Doc(id=1, title="orig"))
    url = sqlite.url.replace("sqlite://", "sqlite+aiosqlite://")
    calls: list[int] = []

    async def main() -> tuple[Any, ...]:
        aeng = async_sqlite_engine(url)
        try:
            async with AsyncSession(aeng) as s, s.begin():
                doc = await s.get_one(Doc, 1)
                sp = await s.begin_nested()
                r = await guarded_update(s, Doc, doc, {"title": "async"}, expected_version=1)
                r.on_commit(calls.append, 1)
                assert doc.version == 2
                await sp.rollback()
                await s.refresh(doc)
                seen = (doc.title, doc.version)
                r2 = await Doc.flow.publish(s, doc)
                r2.on_commit(calls.append, 2)
            return (*seen, r2.version)
        finally:
            await aeng.dispose()

    assert asyncio.run(main()) == ("orig", 1, 2)
    assert calls == [2]
    assert _row(sqlite.engine, 1)[0:2] == ("published", "orig")


@pytest.mark.rollback
def test_async_guarded_update_syncs_the_version_and_expires_the_values(sqlite: Backend) -> None:
    """Under AsyncSession the loaded instance's version is synced (readable without I/O), and the columns
    ``values=`` set are expired, as the README says: they reload with ``await session.refresh()`` (a plain
    attribute access would be a lazy load, which AsyncSession refuses)."""
    import asyncio

    from sqlalchemy import inspect
    from sqlalchemy.ext.asyncio import AsyncSession

    from stateguard import async_sqlite_engine

    sqlite.create(_Base.metadata)
    with Session(sqlite.engine) as s, s.begin():
        s.add(Doc(id=1, title="orig"))
    url = sqlite.url.replace("sqlite://", "sqlite+aiosqlite://")

    async def main() -> Any:
        aeng = async_sqlite_engine(url)
        try:
            async with AsyncSession(aeng) as s, s.begin():
                doc = await s.get_one(Doc, 1)
                await guarded_update(s, Doc, doc, {"title": "async"}, expected_version=1)
                expired = set(inspect(doc).expired_attributes)
                version = doc.version
                await s.refresh(doc, ["title"])
                return expired, version, doc.title
        finally:
            await aeng.dispose()

    expired, version, title = asyncio.run(main())
    assert "title" in expired and "version" not in expired
    assert (version, title) == (2, "async")
