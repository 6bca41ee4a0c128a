"""Hostile review of the one-statement claim of idempotent() on PostgreSQL (and its peers elsewhere).

``WITH sg_inserted AS (INSERT ... ON CONFLICT DO NOTHING RETURNING 1) SELECT (SELECT record ...)
WHERE NOT EXISTS (SELECT 1 FROM sg_inserted)``: no row means "claimed", a JSON text is the record,
a NULL means "the key is taken by a row this statement cannot see" and the record is read again.

Every test counts "the work ran" from the outside (rows in ``ca_work``, a table of this file) and
from the record, with real connections and threads.  Written from README.md's promises
("Idempotency keys", "Statements", "mode=").
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import (
    Column,
    Connection,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    event,
    func,
    insert,
    select,
    text,
)
from sqlalchemy.orm import Session

from stateguard import (
    IdempotencyKeyReused,
    InvalidArgument,
    RequestFailed,
    RequestInProgress,
    SerializationConflict,
    create_tables,
    drop_tables,
    idempotent,
    retry_on_conflict,
)
from stateguard.idempotency import _CLAIM, purge_expired
from stateguard.tables import MAX_KEY, MAX_SCOPE, idempotency_keys
from tests.conftest import Backend

ca_md = MetaData()
work = Table(
    "ca_work",
    ca_md,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("label", String(64), nullable=False),
    Column("by", String(64), nullable=False),
)
#: Read to take a transaction's snapshot without locking anything the other requests write
#: (MariaDB at SERIALIZABLE turns a plain SELECT into a locking read).
snap_table = Table("ca_snap", ca_md, Column("id", Integer, primary_key=True))

_DAY_MS = 86_400_000


class Boom(Exception):
    pass


@pytest.fixture
def eng(engine: Engine, backend: Backend) -> Iterator[Engine]:
    """stateguard's tables (conftest ``engine``) and ``ca_work`` on each backend, dropped afterwards."""
    backend.create(ca_md)
    yield engine


@pytest.fixture
def pg_eng(pg: Backend) -> Iterator[Engine]:
    """PostgreSQL only: stateguard's tables and ``ca_work``."""
    eng = pg.engine
    drop_tables(eng)
    create_tables(eng)
    pg.create(ca_md)
    yield eng
    drop_tables(eng)


# --------------------------------------------------------------------------- helpers


def _runs(engine: Engine, label: str) -> list[str]:
    """Who ran the work for ``label`` (one row per run that committed)."""
    with engine.connect() as c:
        return sorted(c.scalars(select(work.c.by).where(work.c.label == label)).all())


def _record(engine: Engine, scope: str, key: str) -> Any:
    t = idempotency_keys
    with engine.connect() as c:
        return c.execute(select(t).where(t.c.scope == scope, t.c.idem_key == key)).first()


def _records(engine: Engine, scope: str) -> int:
    t = idempotency_keys
    with engine.connect() as c:
        return int(c.scalar(select(func.count()).select_from(t).where(t.c.scope == scope)) or 0)


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
    return "WITH" if backend.name == "postgresql" else "INSERT"


def _put_record(engine: Engine, scope: str, key: str, **values: Any) -> None:
    """A record as another worker left it."""
    now = int(time.time() * 1000)
    row = {
        "scope": scope,
        "idem_key": key,
        "status": "completed",
        "fingerprint": None,
        "owner": "old-owner",
        "attempt": 1,
        "locked_until_ms": None,
        "expires_ms": now + _DAY_MS,
        "created_ms": now,
        "updated_ms": now,
        "response": None,
        **values,
    }
    with engine.begin() as conn:
        conn.execute(insert(idempotency_keys).values(row))


# --------------------------------------------------------------------------- 1. the statement itself


def test_pg_claim_statement_reports_claimed_record_and_invisible_exactly(pg: Backend, pg_eng: Engine) -> None:
    """The kernel's three answers, each produced for real: a new key (True, None) with the row
    written; a visible record (False, its 11 values); a twin's row that committed while our INSERT
    waited on it (False, None) with nothing inserted by us; and a twin that rolled back instead
    (True, None): we inserted."""
    t = idempotency_keys
    params = {
        "sg_scope": "ca-kernel",
        "sg_fp": "f" * 64,
        "sg_lease": 60_000,
        "sg_ttl": _DAY_MS,
    }
    with pg_eng.begin() as conn:
        assert _CLAIM.insert_or_read(conn, {**params, "sg_key": "new", "sg_owner": "o1"}) == (True, None)
    assert _record(pg_eng, "ca-kernel", "new").owner == "o1"
    with pg_eng.begin() as conn:
        inserted, values = _CLAIM.insert_or_read(conn, {**params, "sg_key": "new", "sg_owner": "o2"})
    assert inserted is False and values is not None and len(values) == 11
    assert values[:4] == ["in_progress", "f" * 64, "o1", 1]
    assert _record(pg_eng, "ca-kernel", "new").owner == "o1"

    probe = pg.new_engine(pool_size=1, max_overflow=0)
    try:
        for outcome in ("commit", "rollback"):
            key = f"twin-{outcome}"
            holder = pg_eng.connect()
            tx = holder.begin()
            pid = int(holder.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())
            assert _CLAIM.insert_or_read(holder, {**params, "sg_key": key, "sg_owner": "holder"}) == (
                True,
                None,
            )
            answer: dict[str, Any] = {}

            def twin(key: str = key, answer: dict[str, Any] = answer) -> None:
                with pg_eng.begin() as conn:
                    answer["r"] = _CLAIM.insert_or_read(conn, {**params, "sg_key": key, "sg_owner": "twin"})

            thread = threading.Thread(target=twin)
            thread.start()
            waited = _await_waiters(pg, probe, pid, 1)
            if outcome == "commit":
                tx.commit()
            else:
                tx.rollback()
            holder.close()
            thread.join(30)
            assert waited, "the twin never waited on the holder"
            with pg_eng.connect() as c:
                owners = c.scalars(
                    select(t.c.owner).where(t.c.scope == "ca-kernel", t.c.idem_key == key)
                ).all()
            if outcome == "commit":
                assert answer["r"] == (False, None), answer
                assert owners == ["holder"]
            else:
                assert answer["r"] == (True, None), answer
                assert owners == ["twin"]
    finally:
        probe.dispose()


# --------------------------------------------------------------------------- 2. one waiting twin


@pytest.mark.parametrize("outcome", ["commit", "rollback", "block_raises_caller_commits"])
def test_a_twin_waiting_on_the_claim_replays_or_claims_exactly_once(
    eng: Engine, backend: Backend, outcome: str
) -> None:
    """Same-transaction mode: the twin's claim waits on the first's uncommitted claim.  First commits:
    the twin replays (PostgreSQL: through the NULL answer and one read).  First's transaction rolls
    back, or its block raises and the caller commits: the twin claims and runs the work once."""
    probe = backend.new_engine(pool_size=1, max_overflow=0)
    claimed = threading.Event()
    out: dict[str, Any] = {}

    def first() -> None:
        with Session(eng) as s:
            s.begin()
            pid = _pid(s)
            try:
                with idempotent(s, scope="ca2", key="k", fingerprint="b") as call:
                    assert not call.replayed
                    s.execute(insert(work).values(label="k", by="first"))
                    claimed.set()
                    out["waited"] = _await_waiters(backend, probe, pid, 1)
                    if outcome == "block_raises_caller_commits":
                        raise Boom
                    call.complete({"by": "first"})
            except Boom:
                pass
            if outcome == "rollback":
                s.rollback()
            else:
                s.commit()

    def twin() -> None:
        assert claimed.wait(10)
        with Session(eng) as s, s.begin():
            with _statements_of(s.connection()) as seen:
                with idempotent(s, scope="ca2", key="k", fingerprint="b") as call:
                    if call.replayed:
                        out["twin"] = ("replayed", call.response)
                    else:
                        s.execute(insert(work).values(label="k", by="twin"))
                        out["twin"] = ("ran", call.complete({"by": "twin"}))
            out["verbs"] = _verbs(seen)

    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(first), pool.submit(twin)]
            for f in futures:
                f.result(timeout=60)
    finally:
        probe.dispose()
    assert out.get("waited"), "the twin never waited on the claim"
    record = _record(eng, "ca2", "k")
    if outcome == "commit":
        assert out["twin"] == ("replayed", {"by": "first"}), out
        assert _runs(eng, "k") == ["first"]
        assert out["verbs"] == [_claim_verb(backend), "SELECT"], out["verbs"]
        assert record.status == "completed" and record.response == '{"by":"first"}'
    else:
        assert out["twin"] == ("ran", {"by": "twin"}), out
        assert _runs(eng, "k") == ["twin"]
        assert out["verbs"] == [_claim_verb(backend), "SAVEPOINT", "INSERT", "UPDATE", "RELEASE"], out
        assert record.status == "completed" and record.response == '{"by":"twin"}'
        assert record.attempt == 1
    assert _records(eng, "ca2") == 1


# --------------------------------------------------------------------------- 3. twelve twins


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_twelve_twins_released_by_a_barrier_on_a_held_claim(
    eng: Engine, backend: Backend, outcome: str
) -> None:
    """An owner holds a completed-but-uncommitted claim; 12 twins (a barrier) all wait on it.
    Commit: 12 replays of the owner's response.  Rollback: exactly one twin runs the work, the 11
    others replay its response (MariaDB: the documented deadlock victims replay on retry)."""
    n = 12
    probe = backend.new_engine(pool_size=1, max_overflow=0)
    barrier = threading.Barrier(n + 1)
    retried: list[str] = []
    out: dict[str, Any] = {}

    def owner() -> None:
        with _held_claim(eng, "ca3", "k", "owner", fingerprint="b") as (s, pid):
            barrier.wait(10)
            out["waited"] = _await_waiters(backend, probe, pid, n)
            if outcome == "commit":
                s.commit()
            else:
                s.rollback()

    def twin(i: int) -> tuple[str, Any]:
        barrier.wait(10)
        return _retrying(lambda: _unit(eng, "ca3", "k", f"twin-{i}", label="k", fingerprint="b"), retried)

    try:
        with ThreadPoolExecutor(n + 1) as pool:
            owned = pool.submit(owner)
            answers = [f.result(timeout=90) for f in [pool.submit(twin, i) for i in range(n)]]
            owned.result(timeout=90)
    finally:
        probe.dispose()
    assert out.get("waited"), "the twins never all waited on the claim"
    runs = _runs(eng, "k")
    assert len(runs) == 1, runs
    if outcome == "commit":
        assert runs == ["owner"]
        assert answers == [("replayed", {"by": "owner"})] * n
    else:
        winner = runs[0]
        assert winner.startswith("twin-"), runs
        assert sorted(answers, key=lambda a: a[0]) == [("ran", {"by": winner})] + [
            ("replayed", {"by": winner})
        ] * (n - 1)
    if backend.name != "mariadb":
        assert retried == [], retried
    record = _record(eng, "ca3", "k")
    assert record.status == "completed" and record.attempt == 1
    assert _records(eng, "ca3") == 1


# --------------------------------------------------------------------------- 4. what the JSON carries

_TEXTS: list[Any] = [
    '"',
    "\\",
    '\\"',
    "null",
    "",
    "\\u0000",
    "\\ud83d",
    "\u2028\u2029",
    "é😀\U0010ffff\ufeff",
    "\x01\x1f\x7f\t\r\n",
    "</script><!--",
    '{"by": "someone else"}',
    "[1,",
    "x" * 300_000,
    {"\\": '"', "null": None, "😀": ["\u2028", 2**63 - 1, -(2**63)]},
    2**64 + 1,
    None,
]


class _RawText:
    """A serializer that stores the response text exactly as given (not JSON)."""

    def dumps(self, value: Any) -> str:
        if not isinstance(value, str):
            raise TypeError("text only")
        return value

    def loads(self, text: str) -> Any:
        return text


def test_replays_carry_hostile_text_exactly_through_the_record(eng: Engine, backend: Backend) -> None:
    """Responses with quotes, backslashes, escapes-as-text, "null", unicode and 300 K characters
    come back from a replay exactly (PostgreSQL: a replay is the one WITH statement, so the record
    travelled inside json_build_array); also raw non-JSON text through a custom serializer."""
    raw = _RawText()
    cases: list[tuple[Any, Any]] = [(v, None) for v in _TEXTS]
    cases += [(v, raw) for v in _TEXTS if isinstance(v, str)]
    for i, (value, serializer) in enumerate(cases):
        key = f"t{i}"
        with Session(eng) as s, s.begin(), idempotent(s, scope="ca4", key=key, serializer=serializer) as call:
            assert not call.replayed
            s.execute(insert(work).values(label=key, by="first"))
            call.complete(value)
        with Session(eng) as s, s.begin():
            with (
                _statements_of(s.connection()) as seen,
                idempotent(s, scope="ca4", key=key, serializer=serializer) as call,
            ):
                assert call.replayed, (i, value if not isinstance(value, str) else value[:40])
                got = call.response
        assert type(got) is type(value) and got == value, (i, repr(got)[:80], repr(value)[:80])
        if backend.name == "postgresql":
            assert _verbs(seen) == ["WITH"], seen
        assert _runs(eng, key) == ["first"]


_NAME = 'ph"ase\\1 é😀' + "n" * 80  # 93 characters: the checkpoint name holds 100


def test_checkpoint_and_error_text_survive_the_record_transport(eng: Engine, backend: Backend) -> None:
    """Separate mode: a checkpoint (hostile name and data) is handed to the taker exactly, and a
    non-retryable error's text with quotes, backslashes and unicode is the RequestFailed.error."""
    data = {"\\": ['"', "null", "\\u0041"], "é😀": 2**62, "": None}
    with Session(eng) as s:
        with pytest.raises(Boom), idempotent(s, scope="ca5", key="cp", mode="separate") as call:
            s.execute(insert(work).values(label="cp", by="first"))
            call.checkpoint(_NAME, data)
            raise Boom("retry me")
    with Session(eng) as s, idempotent(s, scope="ca5", key="cp", mode="separate") as call:
        assert not call.replayed and call.taken_over and call.attempt == 2
        assert call.checkpoint_name == _NAME
        assert call.checkpoint_data == data
        call.complete("done")
    assert _runs(eng, "cp") == ["first"]  # the checkpointed phase committed; the taker did not redo it

    message = 'card "declined" \\ é😀 \u2028 null'
    with Session(eng) as s:
        with (
            pytest.raises(Boom),
            idempotent(s, scope="ca5", key="fail", mode="separate", non_retryable=(Boom,)),
        ):
            raise Boom(message)
    with Session(eng) as s:
        with pytest.raises(RequestFailed) as caught, idempotent(s, scope="ca5", key="fail", mode="separate"):
            pytest.fail("a failed-for-good key must not run again")
    assert caught.value.error == f"Boom: {message}"


# --------------------------------------------------------------------------- 5. keys at their limits


def test_max_length_unicode_keys_and_scopes_are_distinct_records(eng: Engine) -> None:
    """Keys of 255 and scopes of 200 characters (4-byte emoji too), and near-twins of them (last
    character, case, trailing space, NFC vs NFD) are distinct keys: each runs once and replays its
    own response; one character more is refused with nothing written."""
    scope_a = "s" * (MAX_SCOPE - 1) + "😀"
    scope_b = "s" * (MAX_SCOPE - 1) + "😁"
    keys = [
        "😀" * MAX_KEY,
        "😀" * (MAX_KEY - 1) + "😁",
        "a" * MAX_KEY,
        "A" + "a" * (MAX_KEY - 1),
        "a" * (MAX_KEY - 1) + " ",
        "caf\u00e9",
        "cafe\u0301",
    ]
    pairs = [(scope, key) for scope in (scope_a, scope_b) for key in keys]
    for i, (scope, key) in enumerate(pairs):
        assert _unit(eng, scope, key, f"r{i}", label=f"m{i}") == ("ran", {"by": f"r{i}"}), i
    for i, (scope, key) in enumerate(pairs):
        assert _unit(eng, scope, key, "again", label=f"m{i}") == ("replayed", {"by": f"r{i}"}), i
        assert _runs(eng, f"m{i}") == [f"r{i}"]
    for scope, key in ((scope_a, "😀" * (MAX_KEY + 1)), (scope_a + "x", "k")):
        with Session(eng) as s, s.begin(), pytest.raises(InvalidArgument):
            with idempotent(s, scope=scope, key=key):
                pytest.fail("an oversize key must not run")
    t = idempotency_keys
    with eng.connect() as c:
        stored = {tuple(r) for r in c.execute(select(t.c.scope, t.c.idem_key))}
    assert stored == set(pairs)


# --------------------------------------------------------------------------- 6. expiry races


@pytest.mark.parametrize("round_", range(4))
def test_purge_racing_claims_of_an_expired_key_runs_the_work_once(
    eng: Engine, backend: Backend, round_: int
) -> None:
    """An expired completed record (same fingerprint!) is purged while 6 claimers of its key race:
    whether they reclaim it or insert after the purge, the work runs once, the others replay the
    NEW response, the old response is never replayed."""
    key = f"exp{round_}"
    _put_record(eng, "ca6", key, fingerprint=None, response='{"by":"old"}', expires_ms=1, created_ms=1)
    n = 6
    barrier = threading.Barrier(n + 1)
    retried: list[str] = []
    purged: list[int] = []

    def purger() -> None:
        barrier.wait(10)
        for _ in range(3):
            purged.append(_retrying(lambda: purge_expired(eng), retried))

    def claimer(i: int) -> tuple[str, Any]:
        barrier.wait(10)
        if i % 2:
            time.sleep(0.002 * i)
        return _retrying(lambda: _unit(eng, "ca6", key, f"c{i}", label=key, fingerprint=None), retried)

    with ThreadPoolExecutor(n + 1) as pool:
        purging = pool.submit(purger)
        answers = [f.result(timeout=90) for f in [pool.submit(claimer, i) for i in range(n)]]
        purging.result(timeout=90)
    runs = _runs(eng, key)
    assert len(runs) == 1, (runs, answers)
    winner = runs[0]
    assert sorted(answers, key=lambda a: a[0]) == [("ran", {"by": winner})] + [
        ("replayed", {"by": winner})
    ] * (n - 1), answers
    assert sum(purged) <= 1, purged
    record = _record(eng, "ca6", key)
    assert record.status == "completed" and record.response == f'{{"by":"{winner}"}}'
    assert record.owner != "old-owner" and record.attempt == 1 and record.expires_ms > 1
    if backend.name != "mariadb":
        assert retried == [], retried


def test_reclaim_of_an_expired_key_refuses_the_old_request_and_replays_the_new(
    eng: Engine, backend: Backend
) -> None:
    """An expired record of request "old" is reclaimed by request "new", which holds its claim until
    two twins wait on it: the twin with the old body gets IdempotencyKeyReused (PostgreSQL: its
    statement still sees the expired old version), the twin with the new body replays; nobody
    replays the old response, the work runs once."""
    from stateguard.idempotency import fingerprint_of

    _put_record(
        eng,
        "ca7",
        "k",
        fingerprint=fingerprint_of("old"),
        response='{"by":"old"}',
        expires_ms=1,
        created_ms=1,
    )
    probe = backend.new_engine(pool_size=1, max_overflow=0)
    claimed = threading.Event()
    out: dict[str, Any] = {}
    retried: list[str] = []

    def reclaimer() -> None:
        with _held_claim(eng, "ca7", "k", "new", fingerprint="new") as (s, pid):
            claimed.set()
            out["waited"] = _await_waiters(backend, probe, pid, 2)
            s.commit()

    def twin(body: str) -> None:
        assert claimed.wait(10)

        def unit() -> Any:
            try:
                return _unit(eng, "ca7", "k", f"twin-{body}", label="k", fingerprint=body)
            except IdempotencyKeyReused:
                return ("reused", None)

        out[body] = _retrying(unit, retried)

    try:
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(reclaimer), pool.submit(twin, "old"), pool.submit(twin, "new")]
            for f in futures:
                f.result(timeout=60)
    finally:
        probe.dispose()
    assert out.get("waited"), "the twins never waited on the reclaim"
    assert out["old"] == ("reused", None), out
    assert out["new"] == ("replayed", {"by": "new"}), out
    assert _runs(eng, "k") == ["new"]
    record = _record(eng, "ca7", "k")
    assert (record.status, record.response, record.attempt) == ("completed", '{"by":"new"}', 1)
    assert record.fingerprint == fingerprint_of("new")


def test_a_completion_committing_while_the_claim_waits_is_never_run_again(
    eng: Engine, backend: Backend
) -> None:
    """A separate-mode owner's complete() has sent its UPDATE and commits only once a
    same-transaction claim of the key waits on it.  The claim may replay or say RequestInProgress
    (PostgreSQL: its statement sees the in-progress version it started with); it never runs the
    work, and its retry replays."""
    probe = backend.new_engine(pool_size=1, max_overflow=0)
    updated = threading.Event()
    out: dict[str, Any] = {}

    def owner() -> None:
        with Session(eng) as s:
            with idempotent(s, scope="ca8", key="k", mode="separate") as call:
                s.execute(insert(work).values(label="k", by="owner"))
                pid = _pid(s)

                def hold(_session: Session) -> None:
                    updated.set()
                    out["waited"] = _await_waiters(backend, probe, pid, 1)

                event.listen(s, "before_commit", hold, once=True)
                call.complete({"by": "owner"})

    def twin() -> None:
        assert updated.wait(10)
        try:
            out["twin"] = _unit(eng, "ca8", "k", "twin", label="k", fingerprint=None)
        except RequestInProgress as error:
            out["twin"] = ("in_progress", error.retry_after > timedelta(0))

    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(owner), pool.submit(twin)]
            for f in futures:
                f.result(timeout=60)
    finally:
        probe.dispose()
    assert out.get("waited"), "the claim never waited on the completion"
    assert out["twin"] in (("replayed", {"by": "owner"}), ("in_progress", True)), out
    assert _unit(eng, "ca8", "k", "retry", label="k", fingerprint=None) == ("replayed", {"by": "owner"})
    assert _runs(eng, "k") == ["owner"]


# --------------------------------------------------------------------------- 7. isolation


def _iso_engine(backend: Backend, isolation: str) -> Engine:
    if backend.name == "sqlite":
        return backend.new_engine(pool_size=2, max_overflow=0)  # SQLite is serializable already
    return backend.new_engine(pool_size=2, max_overflow=0, isolation_level=isolation)


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_a_claim_whose_snapshot_predates_the_committed_record_never_runs(
    eng: Engine, backend: Backend, isolation: str
) -> None:
    """No threads: transaction A takes its snapshot, request B runs and commits, then A claims the
    same key.  PostgreSQL: the typed SerializationConflict (README), and the retry replays;
    MariaDB (locking read) and SQLite: a replay.  The work never runs twice."""
    iso = _iso_engine(backend, isolation)
    try:
        with Session(iso) as s:
            s.begin()
            assert s.scalar(select(func.count()).select_from(snap_table)) == 0  # the snapshot
            assert _unit(eng, "ca9", "k", "b", label="k") == ("ran", {"by": "b"})
            if backend.name == "postgresql":
                with (
                    pytest.raises(SerializationConflict),
                    idempotent(s, scope="ca9", key="k", fingerprint="body"),
                ):
                    pytest.fail("a stale snapshot must not run the work")
            else:
                with idempotent(s, scope="ca9", key="k", fingerprint="body") as call:
                    assert call.replayed and call.response == {"by": "b"}
            s.rollback()
        retried: list[str] = []
        assert _retrying(lambda: _unit(iso, "ca9", "k", "retry", label="k"), retried) == (
            "replayed",
            {"by": "b"},
        )
        assert retried == []
    finally:
        iso.dispose()
    assert _runs(eng, "k") == ["b"]


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_a_repeatable_read_twin_waiting_on_the_claim(eng: Engine, backend: Backend, outcome: str) -> None:
    """The twin runs at REPEATABLE READ with its snapshot taken before it waits on the claim.  First
    commits: PostgreSQL raises the typed SerializationConflict (the retry replays), the others replay.
    First rolls back: the twin claims and runs the work, once."""
    iso = _iso_engine(backend, "REPEATABLE READ")
    probe = backend.new_engine(pool_size=1, max_overflow=0)
    claimed = threading.Event()
    snap = threading.Event()
    out: dict[str, Any] = {}

    def first() -> None:
        with Session(eng) as s:
            s.begin()
            pid = _pid(s)
            assert snap.wait(10)
            with idempotent(s, scope="ca10", key="k", fingerprint="b") as call:
                s.execute(insert(work).values(label="k", by="first"))
                call.complete({"by": "first"})
            claimed.set()
            out["waited"] = _await_waiters(backend, probe, pid, 1)
            if outcome == "commit":
                s.commit()
            else:
                s.rollback()

    def twin() -> None:
        with Session(iso) as s:
            s.begin()
            s.scalar(select(func.count()).select_from(snap_table))  # the snapshot, before the claim exists
            snap.set()
            assert claimed.wait(10)
            try:
                with idempotent(s, scope="ca10", key="k", fingerprint="b") as call:
                    if call.replayed:
                        out["twin"] = ("replayed", call.response)
                    else:
                        s.execute(insert(work).values(label="k", by="twin"))
                        out["twin"] = ("ran", call.complete({"by": "twin"}))
            except SerializationConflict as error:
                out["twin"] = ("conflict", type(error).__name__)
                s.rollback()
                return
            s.commit()

    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(first), pool.submit(twin)]
            for f in futures:
                f.result(timeout=60)
        retried: list[str] = []
        again = _retrying(lambda: _unit(iso, "ca10", "k", "retry", label="k", fingerprint="b"), retried)
    finally:
        iso.dispose()
        probe.dispose()
    assert out.get("waited"), "the twin never waited on the claim"
    if outcome == "commit":
        expected = (
            ("conflict", "SerializationConflict")
            if backend.name == "postgresql"
            else ("replayed", {"by": "first"})
        )
        assert out["twin"] == expected, out
        assert again == ("replayed", {"by": "first"})
        assert _runs(eng, "k") == ["first"]
    else:
        assert out["twin"] == ("ran", {"by": "twin"}), out
        assert again == ("replayed", {"by": "twin"})
        assert _runs(eng, "k") == ["twin"]
    assert retried == []


# --------------------------------------------------------------------------- 8. schema_translate_map


def _translate_attack(backend: Backend, base: Engine) -> None:
    """Tables in two extra schemas (databases on MariaDB) reached through schema_translate_map, and in
    the default one: the same (scope, key) is three records, each run once and replayed on its own
    engine; a twin behind a translated claim replays through the re-read; a failing block's claim is
    deleted in its own schema only."""
    tag = uuid.uuid4().hex[:8]
    names = [f"ca_x_{tag}", f"ca_y_{tag}"]
    quote = '"' if backend.name == "postgresql" else "`"
    create = "CREATE SCHEMA" if backend.name == "postgresql" else "CREATE DATABASE"
    drop = "DROP SCHEMA {} CASCADE" if backend.name == "postgresql" else "DROP DATABASE {}"
    admin = backend.new_engine(pool_size=1, max_overflow=0, isolation_level="AUTOCOMMIT")
    probe = backend.new_engine(pool_size=1, max_overflow=0)
    try:
        with admin.connect() as c:
            for name in names:
                c.execute(text(f"{create} {quote}{name}{quote}"))
        engines = {name: base.execution_options(schema_translate_map={None: name}) for name in names}
        for translated in engines.values():
            create_tables(translated)
            ca_md.create_all(translated)
        everywhere = {"base": base, **engines}
        for who, e in everywhere.items():
            assert _unit(e, "ca11", "k", who, label="k") == ("ran", {"by": who}), who
        for who, e in everywhere.items():
            assert _unit(e, "ca11", "k", "again", label="k") == ("replayed", {"by": who}), who
            assert _runs(e, "k") == [who]
            assert _record(e, "ca11", "k").response == f'{{"by":"{who}"}}'

        # A twin behind a claim on the translated engine: commit, then replay via the re-read.
        x = engines[names[0]]
        claimed = threading.Event()
        out: dict[str, Any] = {}

        def first() -> None:
            with _held_claim(x, "ca11", "tw", "first", fingerprint="body") as (s, pid):
                claimed.set()
                out["waited"] = _await_waiters(backend, probe, pid, 1)
                s.commit()

        def twin() -> None:
            assert claimed.wait(10)
            with Session(x) as s, s.begin():
                with _statements_of(s.connection()) as seen:
                    out["twin"] = _unit_in(s, "tw", "twin")
                out["seen"] = list(seen)

        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(first), pool.submit(twin)]:
                f.result(timeout=60)
        assert out.get("waited"), "the twin never waited"
        assert out["twin"] == ("replayed", {"by": "first"}), out
        assert _verbs(out["seen"]) == [_claim_verb(backend), "SELECT"]
        assert all(names[0] in stmt for stmt in out["seen"]), out["seen"]
        assert _runs(x, "tw") == ["first"] and _runs(base, "tw") == []
        assert _record(base, "ca11", "tw") is None and _record(engines[names[1]], "ca11", "tw") is None

        # The same key completed in the default schema; a failing block in X deletes only X's claim.
        assert _unit(base, "ca11", "fail", "base", label="fail") == ("ran", {"by": "base"})
        with Session(x) as s, s.begin():
            with pytest.raises(Boom), idempotent(s, scope="ca11", key="fail", fingerprint="body"):
                s.execute(insert(work).values(label="fail", by="x"))
                raise Boom
        assert _record(x, "ca11", "fail") is None and _runs(x, "fail") == []
        assert _record(base, "ca11", "fail").response == '{"by":"base"}'
        assert _unit(x, "ca11", "fail", "x2", label="fail") == ("ran", {"by": "x2"})
    finally:
        with admin.connect() as c:
            for name in names:
                c.execute(text(drop.format(f"{quote}{name}{quote}")))
        admin.dispose()
        probe.dispose()


def _unit_in(s: Session, key: str, by: str) -> tuple[str, Any]:
    with idempotent(s, scope="ca11", key=key, fingerprint="body") as call:
        if call.replayed:
            return "replayed", call.response
        s.execute(insert(work).values(label=key, by=by))
        return "ran", call.complete({"by": by})


def test_schema_translate_map_on_postgresql(pg: Backend, pg_eng: Engine) -> None:
    _translate_attack(pg, pg_eng)


def test_schema_translate_map_on_mariadb(mariadb: Backend) -> None:
    base = mariadb.engine
    drop_tables(base)
    create_tables(base)
    mariadb.create(ca_md)
    try:
        _translate_attack(mariadb, base)
    finally:
        drop_tables(base)


# --------------------------------------------------------------------------- 9. the longest ttl


@pytest.mark.parametrize("days", [10**8, timedelta.max.days])
def test_the_longest_ttl_claims_and_replays(eng: Engine, days: int) -> None:
    """``ttl`` is any positive timedelta and the claim computes ``db_now + ttl`` inside its statement.
    ``timedelta.max`` is 8.64e16 ms, so the sum fits a BIGINT: the key is claimed, stored with that
    expiry (carried back exactly through the record), and replayed; the caller's own earlier write
    in the same transaction commits with it."""
    ttl = timedelta(days=days)
    with Session(eng) as s, s.begin():
        s.execute(insert(work).values(label="before", by="caller"))
        with idempotent(s, scope="ca12", key="k", ttl=ttl, lease=timedelta(seconds=30)) as call:
            assert not call.replayed
            s.execute(insert(work).values(label="k", by="first"))
            call.complete({"by": "first"})
    assert _runs(eng, "before") == ["caller"]
    record = _record(eng, "ca12", "k")
    ttl_ms = days * _DAY_MS
    assert ttl_ms < record.expires_ms < ttl_ms + 10 * 365 * _DAY_MS * 100, record.expires_ms
    assert _unit(eng, "ca12", "k", "again", label="k") == ("replayed", {"by": "first"})
    assert _runs(eng, "k") == ["first"]
