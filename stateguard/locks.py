"""Pessimistic and distributed locks (SCHEMES.md, schemes 7 and 8).

* :func:`row_lock`: ``SELECT ... FOR UPDATE`` through the ORM, with NOWAIT /
  SKIP LOCKED, several rows always locked in primary-key order.
* :func:`advisory_lock`: a named lock in the database itself (PostgreSQL
  transaction-level advisory locks, MariaDB/MySQL ``GET_LOCK``).
* :class:`RedisLock`: redis-py's own lock plus a *fencing token*, a number
  that only grows, to pass as ``fence=`` to a trigger or
  :func:`~stateguard.guarded_update` so a holder whose lock expired while it
  was paused cannot overwrite a newer holder's write; :class:`AsyncRedisLock`
  is the same lock for a ``redis.asyncio`` client.

A lock only makes the code inside it exclusive; prefer a conditional write
(a trigger, a guarded counter, a version check) when one statement can decide.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import threading
import time
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Final, cast

from sqlalchemy import Connection, Engine, Select, event, select, text, tuple_
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from . import _sql, _write
from ._async import AsyncSession, DualContext, dual
from .engine import BEGIN_MARK
from .exceptions import InvalidArgument, LockLost, LockNotAcquired, NotSupported
from .tokens import _check_redis_client

if TYPE_CHECKING:
    from redis.asyncio.lock import Lock as AsyncLock
    from redis.lock import Lock

__all__ = ["AsyncRedisLock", "RedisLock", "advisory_lock", "row_lock"]


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
    _ordered: bool = True,
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
    instead of waiting (on PostgreSQL the transaction is then aborted: roll
    back, ``retry_on_conflict`` retries).  ``of`` (PostgreSQL, MySQL 8) is
    passed to :meth:`~sqlalchemy.sql.expression.Select.with_for_update`, to
    restrict the lock to some tables of a joined load.

    Backends: PostgreSQL; MariaDB (NOWAIT needs 10.3, SKIP LOCKED 10.6,
    ``of`` is not supported) and MySQL 8; an option the server cannot honour
    raises :class:`~stateguard.NotSupported` instead of being dropped.
    SQLite has no row locks: the honest equivalent is that the transaction
    holds the database's write lock from its start, which is what an engine
    from :func:`~stateguard.sqlite_engine` (``begin="immediate"``, the
    default) does; on any other SQLite engine ``row_lock`` raises
    :class:`~stateguard.NotSupported`.  There, ``nowait`` and
    ``skip_locked`` are trivially met (no other writer can hold a row).
    """
    info = _sql.model_info(model)
    if nowait and skip_locked:
        raise InvalidArgument("row_lock: nowait and skip_locked cannot be combined")
    many = isinstance(target, list | set | frozenset)
    targets = target if many else (target,)
    keys = list(dict.fromkeys(_write.resolve_target(session, info, t)[0] for t in targets))
    session.flush()
    conn = session.connection(bind_arguments={"mapper": info.mapper})
    _check_row_lock_support(conn, nowait=nowait, skip_locked=skip_locked, of=of)
    if conn.dialect.name == "sqlite":
        nowait = skip_locked = False  # the whole database is already ours
        of = None
    base: Select[Any] = (
        select(model)
        .with_for_update(nowait=nowait, skip_locked=skip_locked, of=of)
        .execution_options(populate_existing=True)
    )

    def one(key: tuple[Any, ...]) -> list[Any]:
        return _run(session, base.where(info.bound_pk_where(info.key_params(key))))

    if not many:
        found = one(keys[0])
        return found[0] if found else None
    if not keys:
        return []
    if not _ordered:
        # Test hook: lock row by row in the caller's order, the way naive
        # code does; opposite-order callers can then deadlock.
        return [row for key in keys for row in one(key)]
    cols = info.pk_columns
    where = cols[0].in_([k[0] for k in keys]) if len(cols) == 1 else tuple_(*cols).in_(keys)
    # PostgreSQL sorts before its LockRows step and InnoDB locks rows as it
    # walks the primary key, so the rows are locked in this order.
    return _run(session, base.where(where).order_by(*cols))


def _run(session: Session, stmt: Select[Any]) -> list[Any]:
    try:
        return list(session.execute(stmt).scalars())
    except sa_exc.DBAPIError as error:
        mapped = _sql.conflict_error(error)
        if mapped is None:
            raise
        raise mapped from error


def _check_row_lock_support(conn: Connection, *, nowait: bool, skip_locked: bool, of: Any) -> None:
    dialect = conn.dialect
    name = dialect.name
    if name == "postgresql":
        return
    if name == "sqlite":
        if conn.info.get(BEGIN_MARK) != "immediate":
            raise NotSupported(
                "row_lock on SQLite: SQLite has no row locks; the equivalent is a transaction that "
                "holds the database write lock from its start. Use an engine made by "
                "stateguard.sqlite_engine(url) (begin='immediate', the default), whose transactions "
                "begin with BEGIN IMMEDIATE"
            )
        if of is not None:
            raise NotSupported("row_lock(of=...) is not supported on SQLite (it locks the whole database)")
        return
    if name in ("mysql", "mariadb"):
        version = dialect.server_version_info or (0,)
        if getattr(dialect, "is_mariadb", False):
            server = "MariaDB"
            needs: dict[str, tuple[int, ...] | None] = {"nowait": (10, 3), "skip_locked": (10, 6), "of": None}
        else:
            server = "MySQL"
            needs = {"nowait": (8, 0, 1), "skip_locked": (8, 0, 1), "of": (8, 0, 1)}
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
    raise NotSupported(f"row_lock supports PostgreSQL, MySQL/MariaDB and SQLite, not {name}")


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

    **SQLite** has no named locks: :class:`~stateguard.NotSupported`.
    """
    return DualContext(session, lambda sync: _advisory_lock(sync, name, timeout=timeout, shared=shared))


@contextmanager
def _advisory_lock(
    session: Session,
    name: str,
    *,
    timeout: float | timedelta | None,
    shared: bool,
) -> Iterator[None]:
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"advisory_lock needs a non-empty str name, got {name!r}")
    wait = _seconds(timeout, "timeout", allow_zero=True)
    conn = session.connection()
    dialect = conn.dialect.name
    if dialect == "postgresql":
        _pg_advisory_lock(conn, name, wait, shared)
        yield
    elif dialect in ("mysql", "mariadb"):
        if shared:
            raise NotSupported("advisory_lock(shared=True): MariaDB/MySQL GET_LOCK has no shared mode")
        lock_name = mysql_lock_name(name)
        _mysql_get_lock(conn, name, lock_name, wait)
        raised = True
        try:
            yield
            raised = False
        finally:
            _mysql_release(conn, name, lock_name, raised)
    else:
        raise NotSupported(
            f"advisory_lock is not available on {dialect}: it has no named locks "
            f"(use row_lock with stateguard.sqlite_engine() on SQLite)"
        )


def _pg_advisory_lock(conn: Connection, name: str, wait: float | None, shared: bool) -> None:
    dbapi_conn = conn.connection.dbapi_connection
    if getattr(dbapi_conn, "autocommit", False):
        raise NotSupported(
            "advisory_lock on PostgreSQL takes a transaction-level lock, which AUTOCOMMIT would "
            "release as soon as the statement ends; use a session with a transaction"
        )
    params = {"k": advisory_key(name)}
    if wait is None:
        _write.execute(conn, _PG_LOCK[shared], params)
        return
    deadline = time.monotonic() + wait
    delay = 0.002
    while True:
        if _write.execute(conn, _PG_TRY[shared], params).scalar():
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
    got = _write.execute(
        conn, _GET_LOCK, {"name": lock_name, "timeout": _FOREVER if wait is None else wait}
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
        released = _write.execute(conn, _RELEASE_LOCK, {"name": lock_name}).scalar()
    except Exception:
        if raised:
            return  # keep the block's own error; a broken connection dropped its locks anyway
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


def _seconds(value: float | timedelta | None, what: str, *, allow_zero: bool) -> float | None:
    if value is None:
        return None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise InvalidArgument(f"{what} must be seconds (int or float) or a timedelta, got {value!r}")
    if seconds < 0 or (seconds == 0 and not allow_zero) or seconds != seconds:
        raise InvalidArgument(f"{what} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return seconds


# --------------------------------------------------------------------------
# Redis locks with fencing tokens
# --------------------------------------------------------------------------

#: Acquire and issue the fencing token in one step: INCR only when SET NX
#: won, so a failed attempt never consumes a token and no holder ever runs
#: without one.  KEYS share a hash slot (see RedisLock), as Lua requires on
#: Redis Cluster.
_ACQUIRE_SCRIPT: Final = """
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return redis.call('incr', KEYS[2])
end
return false
"""

# The fencing subclasses of redis-py's two Lock classes differ only in
# awaiting the script; these three helpers are the rest of them.


def _register_acquire(lock: Any) -> None:
    cls = type(lock)
    if cls.lua_acquire is None:
        cls.lua_acquire = lock.redis.register_script(_ACQUIRE_SCRIPT)


def _acquire_call(lock: Any, token: Any) -> dict[str, Any]:
    """The keys and args of :data:`_ACQUIRE_SCRIPT` for ``lock`` (a redis-py Lock) and owner ``token``."""
    assert lock.timeout is not None  # RedisLock and AsyncRedisLock always set a ttl
    return {
        "keys": [lock.name, f"{lock.name}:fence"],
        "args": [token, max(1, int(lock.timeout * 1000))],
        "client": lock.redis,
    }


def _took(lock: Any, fence: Any) -> bool:
    """Record the fence the script returned (nil: the lock is held) where the owner token goes."""
    if fence is None:
        return False
    lock.local.fence = int(fence)
    return True


@contextmanager
def _needs_redis(owner: str) -> Iterator[None]:
    try:
        yield
    except ImportError as error:
        raise ImportError(f"{owner} needs the redis package: pip install 'stateguard[redis]'") from error


_fenced_classes: dict[str, Any] = {}


def _lock_class() -> type[Lock]:
    with _needs_redis("RedisLock"):
        from redis.lock import Lock
    if "sync" not in _fenced_classes:

        class _FencedLock(Lock):
            """redis-py's lock, acquiring with :data:`_ACQUIRE_SCRIPT` to get a fencing token."""

            lua_acquire: Any = None

            def register_scripts(self) -> None:
                super().register_scripts()
                _register_acquire(self)

            def do_acquire(self, token: str) -> bool:
                return _took(self, self.lua_acquire(**_acquire_call(self, token)))

        _fenced_classes["sync"] = _FencedLock
    cls: type[Lock] = _fenced_classes["sync"]
    return cls


def _async_lock_class() -> type[AsyncLock]:
    with _needs_redis("AsyncRedisLock"):
        from redis.asyncio.lock import Lock as AsyncLock
    if "async" not in _fenced_classes:

        class _AsyncFencedLock(AsyncLock):
            """redis-py's asyncio lock, acquiring with :data:`_ACQUIRE_SCRIPT`; its token is per task."""

            lua_acquire: Any = None

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                # redis-py types ``local`` as threading.local | SimpleNamespace;
                # it only ever gets and sets attributes on it.
                self.local = cast(Any, _TaskLocal())

            def register_scripts(self) -> None:
                super().register_scripts()  # type: ignore[no-untyped-call]  # untyped in redis-py
                _register_acquire(self)

            async def do_acquire(self, token: str | bytes) -> bool:
                return _took(self, await self.lua_acquire(**_acquire_call(self, token)))

        _fenced_classes["async"] = _AsyncFencedLock
    cls: type[AsyncLock] = _fenced_classes["async"]
    return cls


class _TaskLocal:
    """Attributes private to the asyncio task that set them: redis-py's thread-local token, per task.

    redis-py's asyncio lock keeps its owner token in a ``threading.local``,
    which every task of an event loop shares: task A's lock expires, task B
    takes it through the same lock object, and A's release then reads B's
    token and deletes B's lock.  Keyed by task (weakly, so finished tasks
    drop out), A still holds its own token and gets LockLost.
    """

    __slots__ = ("_outside", "_tasks")

    _DEFAULTS: Final = {"token": None}

    def __init__(self) -> None:
        object.__setattr__(self, "_tasks", weakref.WeakKeyDictionary())
        object.__setattr__(self, "_outside", {})

    def _mine(self) -> dict[str, Any]:
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no running event loop
            task = None
        if task is None:
            outside: dict[str, Any] = self._outside
            return outside
        tasks: weakref.WeakKeyDictionary[asyncio.Task[Any], dict[str, Any]] = self._tasks
        return tasks.setdefault(task, {})

    def __getattr__(self, name: str) -> Any:
        mine = self._mine()
        if name in mine:
            return mine[name]
        if name in self._DEFAULTS:
            return self._DEFAULTS[name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        self._mine()[name] = value


class _RedisLockBase:
    """What :class:`RedisLock` and :class:`AsyncRedisLock` share; they only add the (awaited) calls."""

    #: Whose token redis-py keeps: ``"thread"`` (threading.local) or ``"task"``.
    _holder: ClassVar[str] = "thread"
    _lock: Any

    def __init__(
        self,
        client: Any,
        name: str,
        *,
        ttl: float | timedelta,
        blocking_timeout: float | timedelta | None = None,
        sleep: float = 0.1,
    ) -> None:
        cls = self._lock_class()
        owner = type(self).__name__
        _check_redis_client(client, owner, asynchronous=self._holder == "task")
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"{owner} needs a non-empty str name, got {name!r}")
        seconds = _seconds(ttl, "ttl", allow_zero=False)
        assert seconds is not None
        if seconds < 0.001:
            raise InvalidArgument(f"ttl must be at least 1 millisecond, got {ttl!r}")
        self.name = name
        self.ttl = seconds
        self.blocking_timeout = _seconds(blocking_timeout, "blocking_timeout", allow_zero=True)
        self.key = f"stateguard:lock:{{{name}}}"
        # Everything up to the first "}" after the first "{" is the hash tag;
        # the fence key only appends to the lock key, so both hash alike
        # whatever braces the name itself contains.
        self.fence_key = f"{self.key}:fence"
        self._lock = cls(
            client, self.key, timeout=seconds, sleep=sleep, blocking_timeout=self.blocking_timeout
        )

    @staticmethod
    def _lock_class() -> type[Any]:
        raise NotImplementedError  # pragma: no cover

    @property
    def fence(self) -> int | None:
        """The fencing token of this thread's (task's) latest acquisition (``None`` before the first).

        ::

            lock.acquire()
            Payout.flow.send(session, 42, fence=lock.fence)
        """
        fence: int | None = getattr(self._lock.local, "fence", None)
        return fence

    def _wait(self, blocking_timeout: float | timedelta | None) -> float | None:
        wait = _seconds(blocking_timeout, "blocking_timeout", allow_zero=True)
        return self.blocking_timeout if wait is None else wait

    def _acquired(self, got: bool, wait: float | None) -> int:
        """The new fence after redis-py's ``acquire`` returned ``got``, or LockNotAcquired."""
        if not got:
            raise LockNotAcquired(
                f"{type(self).__name__} {self.name!r} is held by someone else"
                f"{'' if wait is None else f'; gave up after {wait:g}s'}. "
                f"Retry later (retry_on_conflict() does this)"
            )
        fence = self.fence
        assert fence is not None
        return fence

    @contextmanager
    def _owner_errors(self, when: str) -> Iterator[None]:
        """redis-py's lock errors as stateguard's: lost (expired) or never held here."""
        from redis.exceptions import LockError, LockNotOwnedError

        try:
            yield
        except LockNotOwnedError as error:
            raise self._lost(when) from error
        except LockError as error:
            raise InvalidArgument(
                f"{type(self).__name__} {self.name!r} is not held by this {self._holder}"
            ) from error

    @staticmethod
    def _extension(additional: float | timedelta) -> float:
        seconds = _seconds(additional, "additional", allow_zero=False)
        assert seconds is not None
        return seconds

    def _lost(self, when: str) -> LockLost:
        return LockLost(
            f"{type(self).__name__} {self.name!r} (fence {self.fence}) expired before it {when} "
            f"(ttl {self.ttl:g}s) and may belong to another holder now; writes made with its "
            f"fence after the expiry were refused by fenced updates, anything else was unprotected"
        )

    def _held(self) -> bool:
        """Whether this thread (task) still has an owner token (False once released in the block)."""
        return self._lock.local.token is not None

    @staticmethod
    @contextmanager
    def _exiting(exc_type: type[BaseException] | None) -> Iterator[None]:
        """Around the release at the end of the block: the block's own error wins over LockLost."""
        try:
            yield
        except LockLost:
            if exc_type is None:
                raise

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} ttl={self.ttl:g}s fence={self.fence}>"


class RedisLock(_RedisLockBase):
    """A Redis lock (redis-py's) that hands out a fencing token on every acquisition.

    ``ttl`` (seconds or a ``timedelta``) is required: a holder that dies
    must not keep the lock forever.  The price of a TTL is that a holder
    paused longer than it (GC, a stalled VM, a slow call) loses the lock
    while it still believes it holds it.  The fencing token protects its
    writes: an integer, incremented atomically with each acquisition, that
    only grows for this name.  Pass it as ``fence=`` to a trigger or
    :func:`~stateguard.guarded_update` on a model with a
    :func:`~stateguard.fence_column`, and the database refuses (STALE) a
    write carrying an older token than the last one it stored::

        lock = RedisLock(redis_client, "payout:42", ttl=timedelta(seconds=30))
        with lock as fence:
            Payout.flow.send(session, 42, fence=fence)
            session.commit()

    Entering waits up to ``blocking_timeout`` seconds (``None``: forever;
    ``0``: one try), polling every ``sleep`` seconds, then raises
    :class:`~stateguard.LockNotAcquired`.  Exiting releases the lock only
    if it is still ours (redis-py's compare-and-delete); if it expired it
    raises :class:`~stateguard.LockLost` (unless the block already raised)
    and leaves any newer holder's lock alone.  :meth:`extend` adds time.

    Keys: ``stateguard:lock:{<name>}`` holds the owner token with the TTL,
    ``stateguard:lock:{<name>}:fence`` the counter.  The braces are a Redis
    Cluster hash tag, so both keys live in one slot.  The counter has no TTL
    and must survive: with an ``allkeys-*`` eviction policy or a manual
    delete it restarts at 1, and fenced writes then fail STALE (safe, but
    stuck) until it passes the stored tokens again.

    Like redis-py's lock, the token (and :attr:`fence`) is thread-local:
    share a lock object between threads only if each acquires it itself.
    For a ``redis.asyncio`` client use :class:`AsyncRedisLock`.
    """

    _lock: Lock

    @staticmethod
    def _lock_class() -> type[Lock]:
        return _lock_class()

    def acquire(self, *, blocking_timeout: float | timedelta | None = None) -> int:
        """Take the lock and return its new fencing token, or raise :class:`~stateguard.LockNotAcquired`.

        ``blocking_timeout`` overrides the one given to the constructor::

            fence = lock.acquire(blocking_timeout=0)   # one try
            try:
                ...
            finally:
                lock.release()
        """
        wait = self._wait(blocking_timeout)
        return self._acquired(self._lock.acquire(blocking_timeout=wait), wait)

    def release(self) -> None:
        """Release the lock if it is still ours; :class:`~stateguard.LockLost` if it expired.

        Never deletes another holder's lock (the owner token is compared and
        the key deleted in one script)::

            lock.acquire()
            try:
                work()
            finally:
                lock.release()
        """
        with self._owner_errors("was released"):
            self._lock.release()

    def extend(self, additional: float | timedelta, *, replace_ttl: bool = False) -> None:
        """Add ``additional`` seconds to the remaining TTL (or set it, ``replace_ttl=True``).

        Raises :class:`~stateguard.LockLost` if the lock already expired; the
        fencing token stays the same::

            lock = RedisLock(r, "report", ttl=30)
            with lock as fence:
                for chunk in chunks:
                    process(chunk, fence)
                    lock.extend(30)
        """
        seconds = self._extension(additional)
        with self._owner_errors("was extended"):
            self._lock.extend(seconds, replace_ttl=replace_ttl)

    def owned(self) -> bool:
        """Whether this thread holds the lock right now (one ``GET``)::

        if not lock.owned():
            raise RuntimeError("lost the lock")
        """
        return bool(self._lock.owned())

    def locked(self) -> bool:
        """Whether anyone holds the lock right now (one ``GET``)::

        if lock.locked():
            print("someone is running the payout")
        """
        return bool(self._lock.locked())

    def __enter__(self) -> int:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._held():
            with self._exiting(exc_type):
                self.release()


class AsyncRedisLock(_RedisLockBase):
    """:class:`RedisLock` for a ``redis.asyncio`` client: the same keys, fences and errors, awaited.

    Built on redis-py's ``redis.asyncio.lock.Lock``; every method that talks
    to Redis is a coroutine, and ``async with`` takes and releases it::

        lock = AsyncRedisLock(redis.asyncio.Redis(), "payout:42", ttl=timedelta(seconds=30))
        async with lock as fence:
            await guarded_update(session, Payout, 42, {"sent": True},
                                 expected_version=version, fence=fence)
            await session.commit()

    The fencing counter and the lock key are the ones :class:`RedisLock`
    uses, so sync and async holders of one name exclude each other and
    share one growing sequence of fences.

    The owner token (and :attr:`fence`) belongs to the asyncio *task* that
    acquired, as the sync lock's belongs to a thread: one lock object may be
    shared by many tasks (a module-level lock in a web app), each waiting
    for and releasing only its own hold, so a task whose hold expired gets
    :class:`~stateguard.LockLost` instead of deleting the next task's lock.
    Acquire and release in the same task: bound the wait with
    ``blocking_timeout``, not ``asyncio.wait_for`` (which on Python 3.11 runs
    the acquisition in a task of its own).  A task cancelled while its
    acquisition is on the wire may leave the lock held until its TTL ends.
    """

    _holder = "task"
    _lock: AsyncLock

    @staticmethod
    def _lock_class() -> type[AsyncLock]:
        return _async_lock_class()

    async def acquire(self, *, blocking_timeout: float | timedelta | None = None) -> int:
        """Take the lock and return its new fencing token, or raise :class:`~stateguard.LockNotAcquired`.

        ``blocking_timeout`` overrides the one given to the constructor::

            fence = await lock.acquire(blocking_timeout=0)   # one try
            try:
                ...
            finally:
                await lock.release()
        """
        wait = self._wait(blocking_timeout)
        return self._acquired(await self._lock.acquire(blocking_timeout=wait), wait)

    async def release(self) -> None:
        """Release the lock if this task still holds it; :class:`~stateguard.LockLost` if it expired.

        Never deletes another holder's lock::

            await lock.acquire()
            try:
                await work()
            finally:
                await lock.release()
        """
        with self._owner_errors("was released"):
            await self._lock.release()

    async def extend(self, additional: float | timedelta, *, replace_ttl: bool = False) -> None:
        """Add ``additional`` seconds to the remaining TTL (or set it, ``replace_ttl=True``).

        Raises :class:`~stateguard.LockLost` if the lock already expired; the
        fencing token stays the same::

            async with lock as fence:
                for chunk in chunks:
                    await process(chunk, fence)
                    await lock.extend(30)
        """
        seconds = self._extension(additional)
        with self._owner_errors("was extended"):
            await self._lock.extend(seconds, replace_ttl=replace_ttl)

    async def owned(self) -> bool:
        """Whether this task holds the lock right now (one ``GET``)::

        if not await lock.owned():
            raise RuntimeError("lost the lock")
        """
        return bool(await self._lock.owned())

    async def locked(self) -> bool:
        """Whether anyone holds the lock right now (one ``GET``)::

        if await lock.locked():
            print("someone is running the payout")
        """
        return bool(await self._lock.locked())

    async def __aenter__(self) -> int:
        return await self.acquire()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._held():
            with self._exiting(exc_type):
                await self.release()
