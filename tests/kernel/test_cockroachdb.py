"""CockroachDB through sqlalchemy-cockroachdb's ``cockroachdb`` dialect.

No CockroachDB server can run on this machine, so these tests check what stateguard
decides and builds for the dialect:

- without any connection: the dialect gets PostgreSQL's capabilities that CockroachDB has
  (RETURNING, ON CONFLICT, DML in a WITH clause, arrays, FOR UPDATE) and not the ones it
  lacks (advisory locks, PL/pgSQL trigger functions); ``advisory_lock`` is refused with
  NotSupported before a connection is even checked out; the database clock compiles;
  CockroachDB's restart errors (SQLSTATE 40001) are retried and its ambiguous result
  (40003) is not;
- with the dialect's SQL sent to the PostgreSQL server (the dialect speaks PostgreSQL's wire
  protocol and initialises against it): every guarded call sends exactly the statements it
  sends through the ``postgresql`` dialect, each one statement, and gets the same outcome.
  This proves the SQL text and statement count, not CockroachDB's own semantics.

sqlalchemy-cockroachdb 2.0.4 declares SQLAlchemy<2.1, so it is installed with --no-deps
(.ci/run); missing, these tests skip loudly on a laptop and fail under CI=true.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg.errors
import pytest
from sqlalchemy import Engine, String, create_engine, event, select
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Dialect, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import (
    NotSupported,
    Outcome,
    SerializationConflict,
    StateMachine,
    _kernel,
    advisory_lock,
    consume_once,
    consume_token,
    create_tables,
    decrement,
    drop_tables,
    emit,
    guarded_update,
    idempotent,
    increment,
    insert_once,
    issue_token,
    retry_on_conflict,
    row_lock,
)
from stateguard._kernel import db_now_ms
from tests._support.models import Base, Invoice, Message, Order
from tests._support.stock_workers import Stock, StockBase
from tests.conftest import Backend, unavailable


class EventBase(DeclarativeBase):
    pass


class Box(EventBase):
    """A state machine with events=True: its APPLIED transition and its outbox event are one statement."""

    __tablename__ = "crdb_boxes"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    state: Mapped[str] = mapped_column(String(20), default="free")

    flow = StateMachine(
        "state", states=["free", "taken"], transitions=[["take", "free", "taken"]], events=True
    )


@pytest.fixture
def crdb_dialect() -> Dialect:
    """A fresh, never connected CockroachDB dialect (psycopg driver)."""
    try:
        from sqlalchemy_cockroachdb.psycopg import CockroachDBDialect_psycopg  # type: ignore[import-untyped]
    except ImportError as error:
        unavailable("sqlalchemy-cockroachdb (pip install --no-deps sqlalchemy-cockroachdb)", error)
    dialect: Dialect = CockroachDBDialect_psycopg()
    return dialect


def _no_connection() -> Any:
    raise AssertionError("stateguard opened a connection to decide something the dialect name decides")


# -- decided without a connection -------------------------------------------------------------


#: Backend fields of PostgreSQL proper that CockroachDB lacks (the name aside).
_POSTGRESQL_ONLY = (
    "name",
    "named_locks",
    "trigger_functions",
    "listen_notify",
    "commit_without_flush",
    "synchronous_standbys",
)


def test_backend_has_the_postgresql_capabilities_cockroachdb_has(crdb_dialect: Dialect) -> None:
    """The cockroachdb dialect is PostgreSQL's Backend except named locks and trigger functions."""
    from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg

    crdb, pg = _kernel.backend(crdb_dialect), _kernel.backend(PGDialect_psycopg())  # type: ignore[no-untyped-call]
    assert crdb.name == "cockroachdb" and crdb is not pg
    assert (crdb.returning, crdb.on_conflict, crdb.dml_cte, crdb.array_params, crdb.row_locks) == (
        True,
        True,
        True,
        True,
        True,
    )
    assert (crdb.named_locks, crdb.trigger_functions) == ("", False)
    assert not (crdb.listen_notify or crdb.commit_without_flush)
    assert pg.listen_notify and pg.commit_without_flush
    assert not (crdb.last_insert_id or crdb.fresh_read_needs_lock or crdb.driver_begins_lazily)
    same = [f for f in _kernel.Backend.__slots__ if f not in _POSTGRESQL_ONLY]
    assert {f: getattr(crdb, f) for f in same} == {f: getattr(pg, f) for f in same}


@pytest.mark.clock
def test_database_clock_compiles_for_cockroachdb(crdb_dialect: Dialect) -> None:
    """Leases and expiries are judged on the server's statement_timestamp(), as on PostgreSQL."""
    sql = str(select(db_now_ms()).compile(dialect=crdb_dialect))
    assert "statement_timestamp()" in sql


def test_advisory_lock_is_refused_before_any_connection(crdb_dialect: Dialect) -> None:
    """advisory_lock on CockroachDB is NotSupported, says what to use instead, and connects to nothing."""
    engine = create_engine("cockroachdb+psycopg://", creator=_no_connection)
    assert engine.dialect.name == "cockroachdb"
    for kw in ({}, {"timeout": 0}, {"shared": True}):
        with Session(engine) as session:
            with pytest.raises(NotSupported) as info, advisory_lock(session, "billing:settle", **kw):
                pytest.fail("the block must not run")
            assert not session.in_transaction()
    message = str(info.value)
    for hint in ("CockroachDB", "pg_advisory_xact_lock", "row_lock", "RedisLock", "ZooKeeperLock"):
        assert hint in message


def test_async_advisory_lock_is_refused_before_any_connection(crdb_dialect: Dialect) -> None:
    """The same refusal through an AsyncSession (cockroachdb+asyncpg), with no connection made."""
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    async def no_connection() -> Any:
        _no_connection()

    async def main() -> None:
        engine = create_async_engine("cockroachdb+asyncpg://", async_creator=no_connection)
        try:
            async with AsyncSession(engine) as session:
                with pytest.raises(NotSupported, match="CockroachDB"):
                    async with advisory_lock(session, "billing:settle"):
                        pytest.fail("the block must not run")
        finally:
            await engine.dispose()

    asyncio.run(main())


def _restart_error(error: Exception) -> sa_exc.DBAPIError:
    """What SQLAlchemy raises when psycopg reports ``error`` at COMMIT."""
    return sa_exc.OperationalError("COMMIT", {}, error)


#: CockroachDB's client-side retry errors, as psycopg raises them: SQLSTATE 40001 with a reason.
RESTART_ERRORS = [
    "restart transaction: TransactionRetryWithProtoRefreshError: TransactionRetryError: "
    "retry txn (RETRY_SERIALIZABLE - failed preemptive refresh)",
    "restart transaction: TransactionRetryWithProtoRefreshError: WriteTooOldError: "
    "write for key /Table/104/1/1/0 at timestamp 1700000000.1 too old (RETRY_WRITE_TOO_OLD)",
    "restart transaction: TransactionRetryWithProtoRefreshError: ReadWithinUncertaintyIntervalError",
]


@pytest.mark.restart
@pytest.mark.parametrize("reason", RESTART_ERRORS)
def test_cockroachdb_restart_errors_are_retried(reason: str) -> None:
    """A 40001 restart error is a SerializationConflict: the unit runs again, sync and async."""
    error = _restart_error(psycopg.errors.SerializationFailure(reason))
    assert _kernel.classify_db_error(error) is SerializationConflict
    assert "retry_on_conflict" in str(_kernel.conflict_error(error))
    calls = []

    def unit() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise error
        return "committed"

    assert retry_on_conflict(unit, sleep=lambda _: None) == "committed" and len(calls) == 3

    async def async_unit() -> str:
        return unit()

    calls.clear()
    assert asyncio.run(retry_on_conflict(async_unit, sleep=lambda _: None)) == "committed"
    assert len(calls) == 3


@pytest.mark.restart
def test_cockroachdb_restart_errors_give_up_at_the_cap() -> None:
    """A unit that always gets a restart error is called ``attempts`` times, then that error is raised."""
    error = _restart_error(psycopg.errors.SerializationFailure(RESTART_ERRORS[0]))
    calls = []

    def unit() -> None:
        calls.append(1)
        raise error

    with pytest.raises(sa_exc.OperationalError) as info:
        retry_on_conflict(unit, attempts=4, sleep=lambda _: None)
    assert info.value is error and len(calls) == 4


def test_ambiguous_result_is_not_retried() -> None:
    """40003 (statement completion unknown: the COMMIT may have applied) is never retried blindly."""
    error = _restart_error(psycopg.errors.StatementCompletionUnknown("result is ambiguous"))
    assert _kernel.classify_db_error(error) is None
    calls = []

    def unit() -> None:
        calls.append(1)
        raise error

    with pytest.raises(sa_exc.OperationalError):
        retry_on_conflict(unit, sleep=lambda _: None)
    assert len(calls) == 1


# -- the dialect's SQL, sent to PostgreSQL ------------------------------------------------------


@pytest.fixture
def engines(pg: Backend, crdb_dialect: Dialect) -> Iterator[dict[str, Engine]]:
    """The run's PostgreSQL schema through the ``postgresql`` and the ``cockroachdb`` dialect."""
    direct = pg.create(Base.metadata, StockBase.metadata, EventBase.metadata)
    drop_tables(direct)
    create_tables(direct)
    crdb = create_engine(make_url(pg.url).set(drivername="cockroachdb+psycopg"), pool_size=2)
    try:
        yield {"postgresql": direct, "cockroachdb": crdb}
    finally:
        crdb.dispose()
        drop_tables(direct)


def _calls(base: int) -> list[tuple[str, Callable[[Session], Any]]]:
    """Every guarded write, on rows and keys of their own (``base`` keeps the two dialects apart)."""

    def claim(s: Session) -> Any:
        with idempotent(s, scope="crdb", key=f"k-{base}") as call:
            claimed = not call.replayed
            call.complete({"n": 1})
        return claimed

    def token(s: Session) -> Any:
        minted = issue_token(s, scope="crdb", ttl=timedelta(minutes=5))
        s.commit()
        return minted

    return [
        ("trigger", lambda s: Order.flow.pay(s, base)),
        ("trigger with history", lambda s: Invoice.flow.pay(s, base, request_id=f"r-{base}")),
        ("guarded_update", lambda s: guarded_update(s, Order, base, {"note": "n"}, expected_version=2)),
        ("decrement with ref", lambda s: decrement(s, Stock.amount, base, by=2, ref=f"d-{base}")),
        ("decrement repeated", lambda s: decrement(s, Stock.amount, base, by=2, ref=f"d-{base}")),
        ("increment with ref", lambda s: increment(s, Stock.amount, base, by=1, ref=f"i-{base}")),
        ("insert_once", lambda s: insert_once(s, Message, {"message_id": f"m-{base}"})),
        ("insert_once repeated", lambda s: insert_once(s, Message, {"message_id": f"m-{base}"})),
        ("consume_once", lambda s: consume_once(s, "crdb", f"m-{base}")),
        ("idempotency claim", claim),
        ("token issue", token),
        ("outbox emit", lambda s: emit(s, "crdb.topic", {"n": base}, key=f"e-{base}")),
        ("trigger with events", lambda s: Box.flow.take(s, base)),
        ("row_lock", lambda s: row_lock(s, Order, base, nowait=True)),
    ]


#: Calls that are one statement on PostgreSQL, and what that statement must contain.
ONE_STATEMENT = {
    "trigger": "RETURNING",
    "guarded_update": "AND orders.version = ",
    "insert_once": "ON CONFLICT DO NOTHING RETURNING",
    "insert_once repeated": "ON CONFLICT DO NOTHING RETURNING",
    "consume_once": "ON CONFLICT DO NOTHING",
    "outbox emit": "RETURNING",
    "trigger with events": "WITH sg_moved AS",
    "token consume": "statement_timestamp()",
}


def _run(engine: Engine, base: int) -> tuple[dict[str, list[str]], dict[str, Any]]:
    with Session(engine) as s, s.begin():
        s.add_all([Order(id=base), Invoice(id=base, status="sent"), Stock(id=base, amount=5), Box(id=base)])
    sent: list[str] = []
    clauses: list[Any] = []
    listeners = [
        ("before_cursor_execute", lambda conn, cursor, statement, *rest: sent.append(statement)),
        ("before_execute", lambda conn, clause, *rest: clauses.append(clause)),
    ]
    for name, fn in listeners:
        event.listen(engine, name, fn)
    statements: dict[str, list[str]] = {}
    outcomes: dict[str, Any] = {}
    try:
        calls = _calls(base)
        calls.append(("token consume", lambda s: consume_token(s, outcomes["token issue"], scope="crdb")))
        for label, call in calls:
            with Session(engine) as s, s.begin():
                sent.clear()
                result = call(s)
                statements[label] = [x for x in sent if not x.startswith(("SAVEPOINT", "RELEASE"))]
            outcomes[label] = getattr(result, "outcome", result)
    finally:
        for name, fn in listeners:
            event.remove(engine, name, fn)
    outcomes["row_lock"] = type(outcomes["row_lock"]).__name__
    outcomes["token issue"] = "issued"
    outcomes["outbox emit"] = type(outcomes["outbox emit"]).__name__  # the new event's id
    outcomes["clauses"] = clauses
    return statements, outcomes


def test_every_guarded_call_sends_postgresqls_statements(
    engines: dict[str, Engine], crdb_dialect: Dialect
) -> None:
    """Through the cockroachdb dialect every guarded call sends the same statements as through the
    postgresql dialect (one statement where PostgreSQL needs one), each a single statement, and each
    compiles on a dialect that never connected."""
    pg_sent, pg_outcomes = _run(engines["postgresql"], 1)
    crdb_sent, crdb_outcomes = _run(engines["cockroachdb"], 2)
    clauses = crdb_outcomes.pop("clauses")
    pg_outcomes.pop("clauses")
    # CockroachDB has no LISTEN/NOTIFY: the outbox writes that NOTIFY the relays on PostgreSQL
    # (pg_notify inside the statement) send no notification there, and its relays poll.
    notifying = sorted(label for label, sent in pg_sent.items() if any("pg_notify" in x for x in sent))
    assert notifying == ["outbox emit", "trigger with events"]
    for label in notifying:
        assert not any("pg_notify" in x for x in crdb_sent[label]) and len(pg_sent[label]) == 1
    assert {k: v for k, v in crdb_sent.items() if k not in notifying} == {
        k: v for k, v in pg_sent.items() if k not in notifying
    }
    assert crdb_outcomes == pg_outcomes
    assert (
        crdb_outcomes["trigger"] is Outcome.APPLIED
        and crdb_outcomes["decrement repeated"] is Outcome.REPEATED
    )
    assert crdb_outcomes["insert_once repeated"] is Outcome.REPEATED
    assert crdb_outcomes["token consume"] is Outcome.APPLIED and crdb_outcomes["idempotency claim"] is True
    for label, needle in ONE_STATEMENT.items():
        assert len(crdb_sent[label]) == 1 and needle in crdb_sent[label][0], (label, crdb_sent[label])
    # The idempotency claim is one INSERT ... in a WITH clause; the completion is the second statement.
    assert crdb_sent["idempotency claim"][0].startswith("WITH sg_inserted AS")
    for label, sent in crdb_sent.items():
        assert sent, label
        for statement in sent:
            assert ";" not in statement.rstrip().rstrip(";"), (label, statement)
            assert "advisory" not in statement and "LAST_INSERT_ID" not in statement
    for clause in clauses:
        assert ";" not in str(clause.compile(dialect=crdb_dialect)).rstrip(";")
