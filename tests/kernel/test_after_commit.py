"""After-commit callbacks of guarded writes: a commit with a savepoint still open runs a callback once,
later transactions of the same session do not rerun it, a commit that fails runs none, a failing
callback does not stop the others, and a callback scheduled in a rolled-back savepoint never runs."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from stateguard import (
    guarded_update,
)
from tests._support.version_docs import DOC_TABLES, Doc, _Base, _declared_calls, _row
from tests.conftest import Backend

pytestmark = DOC_TABLES


# -- after-commit callbacks ------------------------------------------------------------------------


@pytest.mark.rollback
def test_session_commit_with_a_savepoint_still_open_runs_its_callback_once(engine: Engine) -> None:
    calls: list[str] = []
    with Session(engine) as s:
        s.begin()
        s.begin_nested()
        r = guarded_update(s, Doc, 1, {"title": "sp"}, expected_version=1)
        r.on_commit(calls.append, "sp")
        s.begin_nested()
        Doc.flow.publish(s, 2).on_commit(calls.append, "inner")
        s.commit()  # commits the root with both savepoints still open
        assert sorted(calls) == ["inner", "sp"]
        assert len(_declared_calls) == 1
    assert _row(engine, 1)[1] == "sp"
    assert _row(engine, 2)[0] == "published"


def test_callbacks_run_once_across_later_transactions_of_the_same_session(engine: Engine) -> None:
    calls: list[int] = []
    with Session(engine) as s:
        with s.begin():
            guarded_update(s, Doc, 1, {"title": "a"}, expected_version=1).on_commit(calls.append, 1)
        with s.begin():
            guarded_update(s, Doc, 1, {"title": "b"}, expected_version=2).on_commit(calls.append, 2)
        with pytest.raises(RuntimeError), s.begin():
            guarded_update(s, Doc, 1, {"title": "c"}, expected_version=3).on_commit(calls.append, 3)
            raise RuntimeError
        with s.begin():
            pass
    assert calls == [1, 2]
    assert _row(engine, 1)[1::2] == ("b", 3)


def test_a_commit_that_fails_at_commit_time_runs_no_callback(pg: Backend) -> None:
    eng = pg.create(_Base.metadata)
    with eng.begin() as conn:
        conn.execute(
            text(
                "CREATE TABLE sg_va_child (id integer PRIMARY KEY, doc_id integer NOT NULL "
                "REFERENCES sg_va_doc (id) DEFERRABLE INITIALLY DEFERRED)"
            )
        )
    try:
        _commit_fails(eng)
    finally:
        with eng.begin() as conn:
            conn.execute(text("DROP TABLE sg_va_child"))


def _commit_fails(eng: Engine) -> None:
    with Session(eng) as s, s.begin():
        s.add(Doc(id=1))
    _declared_calls.clear()
    calls: list[int] = []
    with Session(eng) as s:
        s.begin()
        r = Doc.flow.publish(s, 1)
        r.on_commit(calls.append, 1)
        s.execute(text("INSERT INTO sg_va_child (id, doc_id) VALUES (1, 999)"))  # refused only by COMMIT
        with pytest.raises(IntegrityError):
            s.commit()
        s.rollback()
        assert (calls, _declared_calls) == ([], [])
        with s.begin():
            pass
    assert (calls, _declared_calls) == ([], [])
    assert _row(eng, 1)[0::3] == ("draft", 1)


@pytest.mark.failing_observer
def test_a_failing_callback_does_not_stop_the_others_and_the_commit_stands(engine: Engine) -> None:
    calls: list[int] = []

    def bad() -> None:
        raise ValueError("callback failed")

    with Session(engine) as s:
        with pytest.raises(ValueError, match="callback failed"):
            with s.begin():
                guarded_update(s, Doc, 1, {"title": "kept"}, expected_version=1).on_commit(bad)
                Doc.flow.publish(s, 2).on_commit(calls.append, 2)
        assert calls == [2]
        with s.begin():
            assert guarded_update(s, Doc, 1, {"note": "usable"}, expected_version=2).applied
    assert _row(engine, 1)[1:4] == ("kept", "usable", 3)
    assert len(_declared_calls) == 1


@pytest.mark.rollback
def test_callback_scheduled_in_savepoint_rolled_back_after_a_retry_inside_it(engine: Engine) -> None:
    calls: list[str] = []
    with Session(engine) as s, s.begin():
        for attempt in ("first", "second"):
            sp = s.begin_nested()
            doc = s.get_one(Doc, 1)
            r = guarded_update(s, Doc, doc, {"title": attempt}, expected_version=doc.version)
            r.on_commit(calls.append, attempt)
            if attempt == "first":
                sp.rollback()
            else:
                sp.commit()
        assert calls == []
    assert calls == ["second"]
    assert _row(engine, 1)[1::2] == ("second", 2)
