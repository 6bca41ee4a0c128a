"""Probes of the idempotency claim tests: held claims, waiting twins found in the server's lock
views, the statements a connection sent, and the records a key left."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from sqlalchemy import (
    Column,
    Connection,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    event,
    insert,
    select,
    text,
)
from sqlalchemy.orm import Session

from stateguard import (
    SerializationConflict,
    idempotent,
    retry_on_conflict,
)
from stateguard.tables import idempotency_keys
from tests.conftest import Backend, capable

ca_md = MetaData()
work = Table(
    "ca_work",
    ca_md,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("label", String(64), nullable=False),
    Column("by", String(64), nullable=False),
)

_DAY_MS = 86_400_000


class Boom(Exception):
    pass


# --------------------------------------------------------------------------- helpers


def _runs(engine: Engine, label: str) -> list[str]:
    """Who ran the work for ``label`` (one row per run that committed)."""
    with engine.connect() as c:
        return sorted(c.scalars(select(work.c.by).where(work.c.label == label)).all())


def _record(engine: Engine, scope: str, key: str) -> Any:
    t = idempotency_keys
    with engine.connect() as c:
        return c.execute(select(t).where(t.c.scope == scope, t.c.idem_key == key)).first()


def _unit(
    engine: Engine,
    scope: str,
    key: str,
    by: str,
    *,
    label: str,
    fingerprint: Any = "body",
    response: Any = None,
) -> tuple[str, Any]:
    """One request as a whole same-transaction unit of work: ``("ran"|"replayed", response)``."""
    with Session(engine) as s, s.begin():
        with idempotent(s, scope=scope, key=key, fingerprint=fingerprint) as call:
            if call.replayed:
                return "replayed", call.response
            s.execute(insert(work).values(label=label, by=by))
            out = call.complete({"by": by} if response is None else response)
        return "ran", out


@contextlib.contextmanager
def _held_claim(
    engine: Engine, scope: str, key: str, by: str, *, fingerprint: Any
) -> Iterator[tuple[Session, int]]:
    """A transaction that claimed ``key`` (a first claim, not a takeover), ran its work (a ``ca_work``
    row labelled ``key``) and completed it, not committed yet: yields its session and backend pid."""
    with Session(engine) as s:
        s.begin()
        pid = _pid(s)
        with idempotent(s, scope=scope, key=key, fingerprint=fingerprint) as call:
            assert not call.replayed and not call.taken_over
            s.execute(insert(work).values(label=key, by=by))
            call.complete({"by": by})
        yield s, pid


def _retrying(unit: Callable[[], Any], retried: list[str]) -> Any:
    """``unit`` in retry_on_conflict; each typed retryable error it met is appended to ``retried``."""

    def once() -> Any:
        try:
            return unit()
        except SerializationConflict as error:  # DeadlockDetected is one
            retried.append(type(error).__name__)
            raise

    return retry_on_conflict(once, attempts=25, backoff=0.01, max_backoff=0.2)


def _pid(session: Session) -> int | None:
    """The PostgreSQL backend pid of the session's connection (sent before any claim), else None."""
    conn = session.connection()
    if conn.dialect.name != "postgresql":
        return None
    return int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())


def _waiters(backend: Backend, probe: Engine, pid: int | None) -> int:
    """How many sessions are blocked right now (PostgreSQL: by backend ``pid``; MariaDB: queries running)."""
    with probe.connect() as c:
        if backend.name == "postgresql":
            return int(
                c.scalar(
                    text("SELECT count(*) FROM pg_stat_activity WHERE :pid = ANY(pg_blocking_pids(pid))"),
                    {"pid": pid},
                )
                or 0
            )
        return int(
            c.scalar(
                text(
                    "SELECT count(*) FROM information_schema.processlist WHERE id <> CONNECTION_ID()"
                    " AND db = DATABASE() AND command = 'Query' AND info IS NOT NULL"
                )
            )
            or 0
        )


def _await_waiters(backend: Backend, probe: Engine, pid: int | None, n: int, timeout: float = 10.0) -> bool:
    """Wait until ``n`` sessions are blocked behind the holder (SQLite: cannot be seen, a pause)."""
    if backend.name == "sqlite":
        time.sleep(0.4)
        return True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _waiters(backend, probe, pid) >= n:
            return True
        time.sleep(0.02)
    return False


@contextlib.contextmanager
def _statements_of(conn: Connection) -> Iterator[list[str]]:
    """The statements ``conn`` sends while active."""
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    event.listen(conn, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(conn, "before_cursor_execute", record)


def _verbs(statements: list[str]) -> list[str]:
    return [s.split()[0].upper() for s in statements if s.split()[0].upper() != "BEGIN"]


def _claim_verb(backend: Backend) -> str:
    return "WITH" if capable(backend, "writable_cte") else "INSERT"
