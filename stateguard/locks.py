"""Database locks: row locks and named (advisory) locks.

* :func:`row_lock`: ``SELECT ... FOR UPDATE`` through the ORM, with NOWAIT /
  SKIP LOCKED, several rows always locked in primary-key order.
* :func:`advisory_lock`: a named lock in the database itself (PostgreSQL
  transaction-level advisory locks, MariaDB/MySQL ``GET_LOCK``).

The distributed lock with fencing tokens, :class:`~stateguard.RedisLock`
and :class:`~stateguard.AsyncRedisLock`, lives in :mod:`stateguard.redis`.

A lock only makes the code inside it exclusive; prefer a conditional write
(a trigger, a guarded counter, a version check) when one statement can decide
(``docs/how-to/locks.md``).
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Final

from sqlalchemy import ColumnElement, Connection, Engine, Select, event, inspect, select, text, tuple_
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from . import _compat, _kernel
from . import observe as _observe
from ._async import AsyncSession, DualContext, dual
from .engine import BEGIN_MARK
from .exceptions import InvalidArgument, LockLost, LockNotAcquired, NotSupported

__all__ = ["advisory_lock", "row_lock"]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------
# Row locks
# --------------------------------------------------------------------------


@dual
def row_lock(
    session: Session,
    model: type[Any],
    target: Any,
    *,
    nowait: bool = False,
    skip_locked: bool = False,
    of: Any = None,
) -> Any:
    """Lock rows with ``SELECT ... FOR UPDATE`` and return them, fresh from the database.

    ``target`` is a primary key (a tuple for composite keys), a loaded
    instance, or a list of those.  The row stays locked until the
    transaction ends; the instance is refreshed from the locked row
    (``populate_existing``), so it shows what the next write will overwrite.
    Pending changes are flushed first (a refresh would discard them)::

        with Session(engine) as session, session.begin():
            order = row_lock(session, Order, 42)              # None if no such row
            order.amount += 1                                  # safe read-modify-write

            rows = row_lock(session, Order, [3, 1, 2])         # locked in key order 1, 2, 3
            row = row_lock(session, Order, 42, nowait=True)    # LockNotAcquired if held

    A list is locked by one statement with ``ORDER BY`` the primary key, so
    two callers locking the same rows in opposite orders cannot deadlock;
    it returns the instances it locked, in key order (missing rows are left
    out).  ``skip_locked=True`` leaves out rows other transactions hold
    (the job-queue pattern; a single target then returns ``None``);
    ``nowait=True`` raises :class:`~stateguard.LockNotAcquired` at once
    instead of waiting, and the transaction stays usable (on PostgreSQL,
    where NOWAIT's own error would abort it, the rows are locked with SKIP
    LOCKED and a row left out that exists is the held one; rows of a list
    that were free stay locked until the transaction ends); a missing row
    is ``None`` (left out of a list), as without it.  ``of`` (PostgreSQL, MySQL 8) is
    passed to :meth:`~sqlalchemy.sql.expression.Select.with_for_update`, to
    restrict the lock to some tables of a joined load.

    Backends: PostgreSQL; MariaDB (NOWAIT needs 10.3, SKIP LOCKED 10.6,
    ``of`` is not supported) and MySQL 8; an option the server cannot honour
    raises :class:`~stateguard.NotSupported` instead of being dropped.

    **MariaDB Galera**: ``FOR UPDATE`` locks are local to the node.  Holders
    on one node queue as above; a holder on another node is *not* excluded
    (``nowait`` does not raise, ``skip_locked`` hands the same row to a worker
    on each node).  When both write the row, the second COMMIT fails with
    :class:`~stateguard.DeadlockDetected`: the critical section must write
    the locked row, be retryable (:func:`~stateguard.retry_on_conflict`) and
    do nothing outside the database before COMMIT.  A holder that only reads
    excludes nothing across nodes (docs/explanation/clusters-galera.md).
    SQLite has no row locks: the honest equivalent is that the transaction
    holds the database's write lock from its start: on an engine from
    :func:`~stateguard.sqlite_engine` a transaction that ``row_lock`` starts
    begins with ``BEGIN IMMEDIATE`` (``begin="auto"``, the default; with
    ``begin="immediate"`` every transaction does); in a transaction that
    already read (``"auto"``), or on any other SQLite engine, ``row_lock``
    raises :class:`~stateguard.NotSupported`.  There, ``nowait`` and
    ``skip_locked`` are trivially met (no other writer can hold a row).
    """
    info = _kernel.model_info(model)
    if nowait and skip_locked:
        raise InvalidArgument("row_lock: nowait and skip_locked cannot be combined")
    many = isinstance(target, list | set | frozenset)
    targets = target if many else (target,)
    keys = list(dict.fromkeys(_kernel.resolve_target(session, info, t)[0] for t in targets))
    session.flush()
    conn = _kernel.connection_for(session, info, keys)
    _check_row_lock_support(conn, nowait=nowait, skip_locked=skip_locked, of=of)
    backend = _kernel.backend(conn.dialect)
    if not backend.row_locks:
        nowait = skip_locked = False  # SQLite: the whole database is already ours
        of = None
    # Where a failed statement aborts the transaction (PostgreSQL), NOWAIT's error would leave the
    # caller's transaction unusable; SKIP LOCKED takes the same locks without waiting and without
    # an error, and a row it left out that exists is the held one: LockNotAcquired, the
    # transaction still usable (as InnoDB leaves it after its NOWAIT error).
    looks = nowait and backend.errors_abort_transaction
    base: Select[Any] = (
        select(model)
        .with_for_update(nowait=nowait and not looks, skip_locked=skip_locked or looks, of=of)
        .execution_options(populate_existing=True)
    )

    def one(key: tuple[Any, ...]) -> list[Any]:
        return _run(session, base.where(info.bound_pk_where(info.key_params(key))))

    if not many:
        found = one(keys[0])
        if looks and not found:
            _refuse_if_held(session, info, keys, found)
        return found[0] if found else None
    if not keys:
        return []
    # PostgreSQL sorts before its LockRows step and InnoDB locks rows as it
    # walks the primary key, so the rows are locked in this order.
    locked = _run(session, base.where(_keys_in(info, keys)).order_by(*info.pk_columns))
    if looks and len(locked) < len(keys):
        _refuse_if_held(session, info, keys, locked)
    return locked


def _keys_in(info: _kernel.ModelInfo, keys: list[tuple[Any, ...]]) -> ColumnElement[bool]:
    """``pk IN (keys)`` (a row-value IN for a composite key)."""
    cols = info.pk_columns
    return cols[0].in_([k[0] for k in keys]) if len(cols) == 1 else tuple_(*cols).in_(keys)


def _refuse_if_held(
    session: Session, info: _kernel.ModelInfo, keys: list[tuple[Any, ...]], locked: list[Any]
) -> None:
    """LockNotAcquired if a row of ``keys`` exists that the SKIP LOCKED read did not lock.

    A plain read, which waits for no lock; its keys and the locked instances' identities both
    come from the database, so they compare exactly.  A row that is not there is simply missing
    (left out of the result, as without ``nowait``).
    """
    existing = session.execute(select(*info.pk_columns).where(_keys_in(info, keys))).all()
    got = {inspect(row).identity for row in locked}
    held = [tuple(row) for row in existing if tuple(row) not in got]
    if held:
        raise LockNotAcquired(
            f"row_lock(nowait=True): {info.model.__name__} {_kernel.public_key(held[0])!r} is locked "
            f"by another transaction; this transaction is still usable (rows of the call that were "
            f"free stay locked until it ends): roll back and retry later, or go on without that "
            f"row (retry_on_conflict() retries the unit of work)"
        )


def _run(session: Session, stmt: Select[Any]) -> list[Any]:
    try:
        return list(session.execute(stmt).scalars())
    except sa_exc.DBAPIError as error:
        mapped = _kernel.conflict_error(error)
        if mapped is None:
            raise
        raise mapped from error


def _check_row_lock_support(conn: Connection, *, nowait: bool, skip_locked: bool, of: Any) -> None:
    dialect = conn.dialect
    backend = _kernel.backend(dialect)
    if not backend.row_locks:
        if conn.info.get(BEGIN_MARK) != "immediate":
            raise NotSupported(
                "row_lock on SQLite: SQLite has no row locks; the equivalent is a transaction that "
                "holds the database write lock from its start. Use an engine made by "
                "stateguard.sqlite_engine(url) and call row_lock before anything else reads in the "
                "transaction (begin='auto', the default, then begins it with BEGIN IMMEDIATE), or "
                "sqlite_engine(url, begin='immediate'), whose transactions all hold the write lock"
            )
        if of is not None:
            raise NotSupported("row_lock(of=...) is not supported on SQLite (it locks the whole database)")
        return
    minimums = _kernel.row_lock_minimums(dialect)
    if minimums is not None:
        server, needs = minimums
        version = dialect.server_version_info or (0,)
        found = ".".join(map(str, version))
        for option, wanted in (("nowait", nowait), ("skip_locked", skip_locked), ("of", of is not None)):
            minimum = needs[option]
            if wanted and minimum is None:
                raise NotSupported(
                    f"row_lock({option}=...) is not supported on {server}: it has no FOR UPDATE OF "
                    f"(SQLAlchemy would silently leave the clause out and lock every joined table)"
                )
            if wanted and minimum is not None and tuple(version) < minimum:
                raise NotSupported(
                    f"row_lock({option}=...) needs {server} {'.'.join(map(str, minimum))} or later; "
                    f"this server is {found}"
                )
        return
    if backend.family == "other":
        raise NotSupported(
            f"row_lock supports PostgreSQL (and CockroachDB), MySQL/MariaDB and SQLite, not {backend.name}"
        )


# --------------------------------------------------------------------------
# Advisory locks
# --------------------------------------------------------------------------

#: ``GET_LOCK`` names are limited to 64 characters (MySQL 5.7+).
MYSQL_LOCK_NAME_MAX: Final = 64
#: ``GET_LOCK`` has no "forever" that MariaDB and MySQL agree on (MariaDB
#: returns NULL for a negative timeout): one year stands in for it.
_FOREVER: Final = 365 * 24 * 3600
#: ``Connection.info`` key: GET_LOCK names held on that DBAPI connection.
_HELD: Final = "stateguard.user_locks"

_PG_LOCK = {
    False: text("SELECT pg_advisory_xact_lock(:k)"),
    True: text("SELECT pg_advisory_xact_lock_shared(:k)"),
}
_PG_TRY = {
    False: text("SELECT pg_try_advisory_xact_lock(:k)"),
    True: text("SELECT pg_try_advisory_xact_lock_shared(:k)"),
}
_GET_LOCK = text("SELECT GET_LOCK(:name, :timeout)")
_RELEASE_LOCK = text("SELECT RELEASE_LOCK(:name)")


def advisory_key(name: str) -> int:
    """The PostgreSQL advisory-lock key for ``name``: a stable signed 64-bit hash.

    The first 8 bytes of the SHA-256 of the UTF-8 name, read big-endian as a
    signed integer.  It never changes between versions, so processes running
    different releases agree on it.  Different names can collide (with
    probability about n²/2⁶⁵): namespace your names (``"billing:settle"``)
    and do not mix them with hand-picked integer keys::

        advisory_key("nightly-settlement")   # the same number everywhere
    """
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


def mysql_lock_name(name: str) -> str:
    """The ``GET_LOCK`` name for ``name``: itself, or a prefix and hash if longer than 64 characters.

    ::

        mysql_lock_name("short")     # "short"
        mysql_lock_name("x" * 100)   # "xxxx...x~" + 32 hex digits, 64 characters
    """
    if len(name) <= MYSQL_LOCK_NAME_MAX:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:32]
    return f"{name[: MYSQL_LOCK_NAME_MAX - 33]}~{digest}"


def advisory_lock(
    session: Session | AsyncSession,
    name: str,
    *,
    timeout: float | timedelta | None = None,
    shared: bool = False,
) -> DualContext[None]:
    """Hold a named lock in the database while the block (and its commit) runs.

    Only code that takes the same lock is excluded; rows are not locked.
    ``timeout`` (seconds or a ``timedelta``; ``0`` tries once) bounds the
    wait, then :class:`~stateguard.LockNotAcquired` (retryable) is raised;
    ``None`` waits as long as the database lets it.  Commit inside the block,
    so the next holder sees your writes::

        with Session(engine) as session:
            with advisory_lock(session, "billing:nightly-settlement", timeout=5):
                settle(session)
                session.commit()

    **PostgreSQL**: a transaction-level advisory lock
    (``pg_advisory_xact_lock``, or ``_shared`` with ``shared=True``) on
    :func:`advisory_key` of the name.  It is released when the transaction
    ends, not when the block exits: releasing before the commit would let
    the next holder read the rows before our writes are visible, and a
    transaction-level lock can never stay behind in a pooled connection.  A
    ``timeout`` polls ``pg_try_advisory_xact_lock`` until the deadline,
    because a failing ``lock_timeout`` statement would abort the caller's
    transaction.  Needs a transaction (not AUTOCOMMIT).  Keys are per
    database.

    **MariaDB / MySQL**: ``GET_LOCK``/``RELEASE_LOCK``, which belong to the
    connection, not the transaction.  The lock is released when the block
    exits, even on an exception, or as soon as the session hands its
    connection back to the pool (a commit inside the block), so it never
    leaks into the pool.  A block that ends before the commit (inside
    ``with session.begin():``) releases the lock while the writes are still
    uncommitted, and the next holder may read the old rows: commit inside
    the block.  Names are server-wide (not per database); names
    over 64 characters are shortened by :func:`mysql_lock_name`.
    ``shared=True`` raises :class:`~stateguard.NotSupported`.

    With an :class:`~sqlalchemy.ext.asyncio.AsyncSession`, use ``async with``.

    **MariaDB Galera**: ``GET_LOCK`` is local to a node, so on a Galera node
    (``wsrep_on``, read once per engine) the call raises
    :class:`~stateguard.NotSupported` after that one read, before any lock
    is taken; use :func:`row_lock`, :class:`~stateguard.ZooKeeperLock` or
    :class:`~stateguard.RedisLock` with a fence.

    **SQLite** has no named locks: :class:`~stateguard.NotSupported`.
    **CockroachDB** (the ``cockroachdb`` dialect) neither: its advisory-lock
    functions have been missing or no-op stubs, so the call raises
    :class:`~stateguard.NotSupported` from the dialect's name, before a
    connection is checked out; use :func:`row_lock`, or
    :class:`~stateguard.RedisLock` / :class:`~stateguard.ZooKeeperLock` with
    a fence.
    """
    return DualContext(
        session,
        lambda sync: _advisory_lock(sync, name, timeout=timeout, shared=shared),
        name="advisory_lock()",
    )


@contextmanager
def _advisory_lock(
    session: Session,
    name: str,
    *,
    timeout: float | timedelta | None,
    shared: bool,
) -> Iterator[None]:
    # The acquisition is what stateguard.observe reports (its wait is the duration).
    with _observe.watch("advisory_lock", log, scope=name if isinstance(name, str) else None) as box:
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"advisory_lock needs a non-empty str name, got {name!r}")
        wait = _kernel.seconds(timeout, "timeout", allow_zero=True)
        if wait == float("inf"):
            wait = None  # wait forever, as timeout=None does (GET_LOCK would refuse 'inf')
        # Decided from the bind's dialect before the session checks out a
        # connection, so nothing is sent to a server that cannot honour the lock.
        backend = _kernel.backend(_kernel.own_bind(session, None).dialect)
        _refuse_unlocking(backend)
        conn = _kernel.own_connection(session, None)
        box["backend"] = backend.name
        kind = backend.named_locks
        lock_name = ""
        if kind == "transaction":
            _pg_advisory_lock(conn, name, wait, shared)
        elif kind == "connection":
            if shared:
                raise NotSupported("advisory_lock(shared=True): MariaDB/MySQL GET_LOCK has no shared mode")
            if _kernel.is_galera(conn):
                # GET_LOCK is not replicated: two holders on two nodes both get it.
                raise NotSupported(
                    "advisory_lock is not supported on a MariaDB Galera cluster: GET_LOCK is local to "
                    "the node, so holders connected to different nodes would all hold it; use "
                    "row_lock() on a row every holder updates (across nodes the loser fails at COMMIT "
                    "with DeadlockDetected: retry it), ZooKeeperLock, or RedisLock(fences=engine) with "
                    "a fence_column() on the rows it guards"
                )
            lock_name = mysql_lock_name(name)
            _mysql_get_lock(conn, name, lock_name, wait)
        else:
            raise NotSupported(
                f"advisory_lock is not available on {backend.name}: it has no named locks "
                f"(use row_lock with stateguard.sqlite_engine() on SQLite)"
            )
    if kind == "transaction":
        yield
        return
    raised = True
    try:
        yield
        raised = False
    finally:
        _mysql_release(conn, name, lock_name, raised)


#: Backends (by name) that speak PostgreSQL but have no advisory locks, and what to use instead.
_NO_ADVISORY_LOCKS: Final = {
    "cockroachdb": (
        "advisory_lock is not supported on CockroachDB: its releases have had no "
        "pg_advisory_xact_lock and only no-op stubs of the session-level advisory-lock functions "
        "(they return true without excluding anyone; cockroachdb/cockroach#13546), and the "
        "transaction-level locks added in 2026 are not tested with stateguard. Lock a row with "
        "row_lock(session, Model, key) (SELECT ... FOR UPDATE), or take a named lock outside the "
        "database with stateguard.RedisLock or stateguard.ZooKeeperLock and pass its fence"
    ),
}


def _refuse_unlocking(backend: _kernel.Backend) -> None:
    """:class:`NotSupported` for a backend whose named locks cannot exclude (checked before any SQL)."""
    message = None if backend.named_locks else _NO_ADVISORY_LOCKS.get(backend.name)
    if message is not None:
        raise NotSupported(message)


def _pg_advisory_lock(conn: Connection, name: str, wait: float | None, shared: bool) -> None:
    dbapi_conn = conn.connection.dbapi_connection
    if getattr(dbapi_conn, "autocommit", False):
        raise NotSupported(
            "advisory_lock on PostgreSQL takes a transaction-level lock, which AUTOCOMMIT would "
            "release as soon as the statement ends; use a session with a transaction"
        )
    params = {"k": advisory_key(name)}
    if wait is None:
        _kernel.execute(conn, _PG_LOCK[shared], params)
        return
    deadline = time.monotonic() + wait
    delay = 0.002
    while True:
        if _kernel.execute(conn, _PG_TRY[shared], params).scalar():
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise LockNotAcquired(
                f"advisory lock {name!r} (key {params['k']}) is held by another transaction; "
                f"gave up after {wait:g}s. Retry later (retry_on_conflict() does this)"
            )
        time.sleep(min(left, random.uniform(delay / 2, delay)))
        delay = min(delay * 2, 0.05)


def _mysql_get_lock(conn: Connection, name: str, lock_name: str, wait: float | None) -> None:
    got = _kernel.execute(
        conn, _GET_LOCK, {"name": lock_name, "timeout": _FOREVER if wait is None else min(wait, _FOREVER)}
    ).scalar()
    if got != 1:
        why = (
            "the timeout passed" if got == 0 else "GET_LOCK returned NULL (an error, or the wait was killed)"
        )
        raise LockNotAcquired(
            f"advisory lock {name!r} is held by another connection; {why}. "
            f"Retry later (retry_on_conflict() does this)"
        )
    held: Counter[str] = conn.info.setdefault(_HELD, Counter())
    held[lock_name] += 1
    _watch_pool(conn.engine)


def _mysql_release(conn: Connection, name: str, lock_name: str, raised: bool) -> None:
    if conn.closed or conn.invalidated:
        # The connection went back to the pool (a commit inside the block):
        # the checkin hook released the lock then, or it died with the connection.
        return
    held: Counter[str] = conn.info.get(_HELD, Counter())
    if held[lock_name] <= 0:
        return
    held[lock_name] -= 1
    try:
        released = _kernel.execute(conn, _RELEASE_LOCK, {"name": lock_name}).scalar()
    except Exception as error:
        if raised:
            return  # keep the block's own error; a broken connection dropped its locks anyway
        if isinstance(error, sa_exc.DBAPIError) and error.connection_invalidated:
            # The server dropped the connection (KILL, restart, network): it
            # released the lock then, so part of the block may have run
            # without it.
            raise LockLost(
                f"advisory lock {name!r} was lost with its connection before the block ended "
                f"({error.orig!r}); the block's work may have overlapped another holder's: "
                f"check it, or make it safe to run twice"
            ) from error
        raise
    if released != 1 and not raised:
        raise LockLost(f"advisory lock {name!r} was no longer held by this connection when the block ended")


_watch_lock = threading.Lock()


def _watch_pool(engine: Engine) -> None:
    """Release leftover GET_LOCKs when a connection returns to the pool."""
    pool = engine.pool
    if not event.contains(pool, "checkin", _release_on_checkin):
        with _watch_lock:
            if not event.contains(pool, "checkin", _release_on_checkin):
                event.listen(pool, "checkin", _release_on_checkin)


def _release_on_checkin(dbapi_conn: Any, record: Any) -> None:
    held: Counter[str] | None = record.info.pop(_HELD, None)
    if not held or dbapi_conn is None:
        return
    try:
        cursor = dbapi_conn.cursor()
        try:
            for lock_name, count in held.items():
                for _ in range(count):
                    # Every MySQL driver stateguard supports uses the format paramstyle.
                    cursor.execute("SELECT RELEASE_LOCK(%s)", (lock_name,))
                    cursor.fetchall()
        finally:
            cursor.close()
    except Exception as error:
        # A connection that may still hold a lock must never be reused.
        record.invalidate(error)


#: Names this module defined before the 0.2 layout, and where they live now.
_MOVED: Final = {"RedisLock": "stateguard.redis", "AsyncRedisLock": "stateguard.redis"}


def __getattr__(name: str) -> Any:
    return _compat.moved(__name__, name, _MOVED)
