"""Guarded updates on what is passed as the session: a sessionmaker or a Connection is a typed error
saying what to pass, a scoped_session gets the sync and the callback, and an aborted PostgreSQL
transaction gives an error, not a wrong outcome."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from stateguard import (
    InvalidArgument,
    StateguardError,
    guarded_update,
)
from tests._support.version_docs import DOC_TABLES, Doc, _Base, _row
from tests.conftest import Backend

pytestmark = DOC_TABLES


# -- wrong session objects -------------------------------------------------------------------------


def test_a_sessionmaker_and_a_connection_are_typed_errors_that_say_what_to_pass(engine: Engine) -> None:
    factory = sessionmaker(engine)
    with pytest.raises(InvalidArgument, match=r"factory\(\)"):
        guarded_update(factory, Doc, 1, {"title": "x"}, expected_version=1)  # type: ignore[arg-type]
    with engine.connect() as conn:
        with pytest.raises(InvalidArgument, match=r"Session\(bind=connection\)"):
            Doc.flow.publish(conn, 1)  # type: ignore[arg-type]
    assert _row(engine, 1)[0::3] == ("draft", 1)


def test_scoped_session_gets_the_sync_and_the_callback(engine: Engine) -> None:
    calls: list[int] = []
    registry = scoped_session(sessionmaker(engine))
    try:
        doc = registry.get(Doc, 1)
        assert doc is not None
        r = Doc.flow.publish(registry, doc)  # type: ignore[arg-type]
        r.on_commit(calls.append, 1)
        assert (doc.status, doc.version) == ("published", 2)
        assert calls == []
        registry.commit()
        assert calls == [1]
    finally:
        registry.remove()
    assert _row(engine, 1)[0::3] == ("published", 2)


@pytest.mark.rollback
@pytest.mark.hostile
def test_postgresql_aborted_transaction_gives_an_error_not_a_wrong_outcome(pg: Backend) -> None:
    eng = pg.create(_Base.metadata)
    with Session(eng) as s, s.begin():
        s.add(Doc(id=1))
    with Session(eng) as s:
        s.begin()
        with pytest.raises(DBAPIError):
            s.execute(text("SELECT 1/0"))
        with pytest.raises((StateguardError, DBAPIError)) as caught:
            guarded_update(s, Doc, 1, {"title": "x"}, expected_version=1)
        assert "abort" in str(caught.value).lower() or "rollback" in str(caught.value).lower()
        s.rollback()
        assert guarded_update(s, Doc, 1, {"title": "y"}, expected_version=1).applied
        s.commit()
    assert _row(eng, 1)[1::2] == ("y", 2)
