"""Attacks on the promises of version columns, guarded updates, loaded objects and after-commit callbacks.

Each test tries to break one README statement the way production would: rollbacks of every
kind after a guarded write, real races between sessions (threads + a barrier), versions at the
column's limit, hostile values= and wrong session objects.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Engine, Integer, Numeric, SmallInteger, String, func, insert, select, text
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, scoped_session, sessionmaker
from sqlalchemy.orm.exc import StaleDataError

from stateguard import (
    ConfigurationError,
    InvalidArgument,
    Outcome,
    StaleVersion,
    StateguardError,
    StateMachine,
    create_tables,
    drop_tables,
    guarded_update,
    retry_on_conflict,
    version_column,
)
from tests.conftest import Backend


class _Base(DeclarativeBase):
    pass


_declared_calls: list[Any] = []


class Doc(_Base):
    __tablename__ = "sg_va_doc"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(12), default="draft")
    title: Mapped[str | None] = mapped_column(String(8))
    note: Mapped[str | None] = mapped_column(String(60))
    price: Mapped[Decimal | None] = mapped_column(Numeric(6, 2))
    small: Mapped[int | None] = mapped_column(SmallInteger)
    hits: Mapped[int] = mapped_column(Integer, default=0)
    version: Mapped[int] = version_column()

    flow = StateMachine(
        "status",
        states=["draft", "published", "archived"],
        transitions=[
            {
                "trigger": "publish",
                "source": "draft",
                "dest": "published",
                "after_commit": _declared_calls.append,
            },
            {"trigger": "archive", "source": ["draft", "published"], "dest": "archived"},
        ],
    )


def _tables(backend: Backend) -> Iterator[Engine]:
    eng = backend.create(_Base.metadata)
    drop_tables(eng)
    create_tables(eng)
    with Session(eng) as s, s.begin():
        s.add_all([Doc(id=1, title="orig"), Doc(id=2, title="two")])
    _declared_calls.clear()
    yield eng
    drop_tables(eng)


@pytest.fixture
def engine(backend: Backend) -> Iterator[Engine]:
    yield from _tables(backend)


def _row(engine: Engine, key: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(
            select(Doc.status, Doc.title, Doc.note, Doc.version, Doc.hits).where(Doc.id == key)
        ).one()


# -- loaded objects and rollbacks -------------------------------------------------------------


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


@pytest.fixture
def pg_engine(pg: Backend) -> Iterator[Engine]:
    """PostgreSQL only: it releases the row lock of a rolled-back savepoint (MariaDB keeps it, SQLite
    has one writer), so another session can commit while this one goes on."""
    yield from _tables(pg)


def test_rolled_back_savepoint_then_another_session_commits_then_flush_is_stale(pg_engine: Engine) -> None:
    """After a savepoint rollback the instance holds the pre-write version; a concurrent commit must
    still make the stale object's flush fail (no lost update through a version the sync left behind)."""
    engine = pg_engine
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


def test_serializable_workers_retrying_end_with_exactly_n(engine: Engine, backend: Backend) -> None:
    """At SERIALIZABLE the losers get serialization failures (PostgreSQL 40001): retried, never lost."""
    workers, each = 5, 4
    eng = backend.new_engine(pool_size=workers + 2, isolation_level="SERIALIZABLE")
    barrier = threading.Barrier(workers)
    errors: list[BaseException] = []

    def unit() -> Any:
        with Session(eng) as s, s.begin():
            doc = s.get_one(Doc, 2)
            return guarded_update(s, Doc, doc, {"hits": doc.hits + 1}, expected_version=doc.version)

    def run() -> None:
        try:
            barrier.wait(30)
            for _ in range(each):
                r = retry_on_conflict(unit, attempts=300, backoff=0.001, max_backoff=0.02)
                assert r.applied, r
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    eng.dispose()
    assert errors == []
    row = _row(engine, 2)
    assert (row.hits, row.version) == (workers * each, 1 + workers * each)


# -- version at the limit, odd expected versions ------------------------------------------------


def _overflow(backend: Backend, engine: Engine, write: Callable[[Session, int], Any]) -> None:
    """``write`` on a row at version 2**31 - 1: the next version does not fit INTEGER.

    PostgreSQL and MariaDB refuse it, and stateguard says so with a ConfigurationError naming the
    version column and BigInteger; the row is unchanged.  MariaDB's transaction goes on;
    PostgreSQL's is aborted (the message says to roll back).  SQLite's INTEGER holds 64 bits, so
    there the write applies (the README says to widen the column before that matters).

    Found: the raw DataError of the driver came through.
    """
    top = 2**31 - 1
    with engine.begin() as conn:
        conn.execute(insert(Doc).values(id=9, status="draft", version=top, hits=0))
    with Session(engine) as s:
        if backend.name == "sqlite":
            assert write(s, 9).applied
            s.rollback()
        else:
            with pytest.raises(ConfigurationError, match="BigInteger") as caught:
                write(s, 9)
            assert "version column" in str(caught.value) and "Roll the transaction back" in str(caught.value)
            if backend.name == "postgresql":
                s.rollback()
            assert guarded_update(s, Doc, 1, {"title": "still"}, expected_version=1).applied
            s.commit()
            assert _row(engine, 1)[1] == "still"
    assert _row(engine, 9)[0::3] == ("draft", top)


def test_a_version_at_the_integer_maximum_is_a_typed_error(engine: Engine, backend: Backend) -> None:
    """guarded_update on a row whose version is at INTEGER's maximum (see _overflow)."""
    _overflow(
        backend,
        engine,
        lambda s, key: guarded_update(s, Doc, key, {"title": "x"}, expected_version=2**31 - 1),
    )


def test_a_trigger_on_a_row_at_the_integer_maximum_version_is_typed(engine: Engine, backend: Backend) -> None:
    """The same through a trigger (version = version + 1 in the trigger's UPDATE)."""
    _overflow(backend, engine, lambda s, key: Doc.flow.publish(s, key))


@pytest.mark.parametrize("expected", [True, 1.0, Decimal(1), "1", None, 2**31, -(2**31) - 1, 2**63])
def test_odd_expected_versions_are_invalid_and_leave_the_transaction_usable(
    engine: Engine, expected: Any
) -> None:
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            guarded_update(s, Doc, 1, {"title": "x"}, expected_version=expected)
        assert guarded_update(s, Doc, 1, {"title": "ok"}, expected_version=1).applied
    assert _row(engine, 1)[1::2] == ("ok", 2)


@pytest.mark.parametrize("expected", [-1, 0, -(2**31), 2**31 - 1])
def test_in_range_wrong_expected_versions_are_stale_with_the_real_version(
    engine: Engine, expected: int
) -> None:
    with Session(engine) as s, s.begin():
        r = guarded_update(s, Doc, 1, {"title": "x"}, expected_version=expected)
        assert (r.outcome, r.version, r.expected_version) == (Outcome.STALE, 1, expected)
        with pytest.raises(StaleVersion):
            r.raise_for_outcome()
    assert _row(engine, 1)[1::2] == ("orig", 1)


# -- races ---------------------------------------------------------------------------------------


def _race(backend: Backend, workers: int, body: Any) -> list[Any]:
    eng = backend.new_engine(pool_size=workers + 2)
    barrier = threading.Barrier(workers)
    results: list[Any] = [None] * workers

    def run(i: int) -> None:
        try:
            results[i] = body(eng, barrier, i)
        except BaseException as error:  # reported by the assertions
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    eng.dispose()
    return results


def test_two_sessions_with_the_same_expected_version_exactly_one_wins(
    engine: Engine, backend: Backend
) -> None:
    def body(eng: Engine, barrier: threading.Barrier, i: int) -> Any:
        with Session(eng) as s, s.begin():
            doc = s.get_one(Doc, 1)  # the snapshot (MariaDB REPEATABLE READ) starts before the race
            barrier.wait(30)
            r = guarded_update(s, Doc, doc, {"note": f"w{i}"}, expected_version=doc.version)
            return r.outcome, r.version

    for _ in range(3):
        with engine.begin() as conn:
            version = conn.execute(select(Doc.version).where(Doc.id == 1)).scalar_one()
        results = _race(backend, 2, body)
        assert not [r for r in results if isinstance(r, BaseException)], results
        outcomes = sorted(r[0].name for r in results)
        assert outcomes == ["APPLIED", "STALE"], results
        assert {r[1] for r in results} == {version + 1}, f"STALE must report the winner's version: {results}"
        assert _row(engine, 1)[3] == version + 1


def test_many_workers_incrementing_through_retries_end_with_exactly_n(
    engine: Engine, backend: Backend
) -> None:
    workers, each = 6, 5

    def unit(eng: Engine) -> Any:
        with Session(eng) as s, s.begin():
            doc = s.get_one(Doc, 2)
            return guarded_update(s, Doc, doc, {"hits": doc.hits + 1}, expected_version=doc.version)

    def body(eng: Engine, barrier: threading.Barrier, i: int) -> int:
        barrier.wait(30)
        done = 0
        for _ in range(each):
            r = retry_on_conflict(lambda: unit(eng), attempts=200, backoff=0.001, max_backoff=0.02)
            assert r.applied, r
            done += 1
        return done

    results = _race(backend, workers, body)
    assert results == [each] * workers, results
    row = _row(engine, 2)
    assert (row.hits, row.version) == (workers * each, 1 + workers * each)


def test_racing_triggers_from_one_source_only_one_publishes(engine: Engine, backend: Backend) -> None:
    def body(eng: Engine, barrier: threading.Barrier, i: int) -> Any:
        calls: list[int] = []
        with Session(eng) as s, s.begin():
            s.get_one(Doc, 2)
            barrier.wait(30)
            r = Doc.flow.publish(s, 2)
            r.on_commit(calls.append, i)
        return r.outcome, calls

    results = _race(backend, 4, body)
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert sorted(r[0].name for r in results) == ["APPLIED", "REPEATED", "REPEATED", "REPEATED"]
    assert sum(len(r[1]) for r in results) == 1
    assert len(_declared_calls) == 1 and _declared_calls[0].applied


# -- hostile values= -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [
        {"title": "123456789"},
        {"title": "ab\x00cd"},
        {"title": "\ud800"},
        # Found: Decimal/float values= were not checked against Numeric(6, 2): 1.005 and 0.001 were
        # rounded by the database, 12345.6 was a raw DataError.
        {"price": Decimal("1.005")},
        {"price": Decimal("12345.6")},
        {"price": 0.001},
        {"small": 40000},
        {"small": 2**70},
        {"hits": -(2**31) - 1},
        {"title": 12},
        {"title": b"bytes"},
        {"nope": 1},
        {"version": 5},
        {"status": "published"},
        {},
    ],
    ids=lambda v: repr(v)[:30],
)
def test_hostile_values_write_nothing_and_the_transaction_goes_on(engine: Engine, values: Any) -> None:
    with Session(engine) as s, s.begin():
        doc = s.get_one(Doc, 1)
        with pytest.raises(InvalidArgument):
            guarded_update(s, Doc, doc, values, expected_version=1)
        assert doc.version == 1
        assert guarded_update(s, Doc, doc, {"note": "after"}, expected_version=1).applied
    assert _row(engine, 1) == ("draft", "orig", "after", 2, 0)


def test_trigger_values_with_more_decimals_than_the_scale_are_invalid(engine: Engine) -> None:
    """README (Errors): a values= entry with more decimal places than the column's scale is InvalidArgument
    (found: a trigger's values={"price": Decimal("0.004")} was written as 0.00)."""
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            Doc.flow.publish(s, 1, values={"price": Decimal("0.004")})
        assert Doc.flow.archive(s, 1).applied
    assert _row(engine, 1)[0::3] == ("archived", 2)


def test_sql_injection_text_and_expressions_in_values_are_bound_not_run(engine: Engine) -> None:
    evil = "x'); DROP TABLE sg_va_doc; --"
    with Session(engine) as s, s.begin():
        doc = s.get_one(Doc, 1)
        r = guarded_update(
            s, Doc, doc, {"note": evil, "hits": Doc.hits + 41, "title": func.upper("ab")}, expected_version=1
        )
        assert r.applied
        assert (doc.note, doc.hits, doc.title) == (evil, 41, "AB")
    assert _row(engine, 1) == ("draft", "AB", evil, 2, 41)


def test_exact_limits_are_accepted(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        r = guarded_update(
            s,
            Doc,
            1,
            {"title": "ü" * 8, "price": Decimal("9999.99"), "small": -32768, "hits": 2**31 - 1},
            expected_version=1,
        )
        assert r.applied
    with Session(engine) as s:
        doc = s.get_one(Doc, 1)
        assert (doc.title, doc.price, doc.small, doc.hits) == ("ü" * 8, Decimal("9999.99"), -32768, 2**31 - 1)


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


# -- after-commit callbacks ------------------------------------------------------------------------


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
