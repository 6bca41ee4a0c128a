"""Loaded ORM instances kept true to the rows stateguard writes, and the savepoint journal.

:func:`sync_loaded` makes a loaded instance agree with the row a guarded
write changed or read.  A value synced inside a SAVEPOINT is only true while
that savepoint stands, so each connection journals what was synced under each
open savepoint, fed by stateguard's statement hook (registered per engine by
:func:`hook_engine`), and a rolled-back savepoint expires those attributes.
:class:`DeferredSavepoint` is the savepoint of a block that may send nothing:
the same hook sends it just before the block's first statement.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from typing import Any, Final

from sqlalchemy import Connection, CursorResult, Executable
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import instance_state, set_committed_value

from .execute import ensure_real_transaction, execute
from .listeners import HOOKED, hook_dialect
from .models import ModelInfo

__all__ = [
    "DeferredSavepoint",
    "abandon_savepoint",
    "hook_engine",
    "identity_instance",
    "sync_loaded",
]

# --------------------------------------------------------------------------
# Loaded instances
# --------------------------------------------------------------------------


def identity_instance(session: Session, info: ModelInfo, key: tuple[Any, ...]) -> Any:
    """The instance for ``key`` already in the session's identity map, if any (no SQL)."""
    identity_map = session.identity_map
    if not len(identity_map):
        return None
    return identity_map.get((info.identity_class, key, None))


def sync_loaded(
    session: Session,
    info: ModelInfo,
    key: tuple[Any, ...],
    instance: Any,
    committed: Mapping[str, Any],
    expire: Iterable[str] = (),
) -> None:
    """Make the loaded instance of ``key`` (``instance``, or the identity map's) agree with the row.

    ``committed`` values are known exactly and become the instance's
    committed state (so a later ORM flush's version check uses the new
    version); the ``expire`` attributes were changed by SQL expressions and
    reload on access.  Nothing happens when the row is not loaded.

    Only an instance of this session is synced: one of another session, or a
    detached one, only named the row (its session would not expire it when
    this transaction or savepoint rolls back, so it would go on showing values
    the database never kept); this session's own instance of the row, if
    loaded, is synced instead.
    """
    if instance is None or instance_state(instance).session_id != session.hash_key:
        instance = identity_instance(session, info, key)
        if instance is None:
            return
    for attr, value in committed.items():
        set_committed_value(instance, attr, value)
    expire = [a for a in expire if a not in committed]
    if expire and instance in session:
        session.expire(instance, expire)
    _journal(session, info, instance, (*committed, *expire))


# --------------------------------------------------------------------------
# Savepoints and loaded instances
# --------------------------------------------------------------------------
#
# A value synced into a loaded instance inside a SAVEPOINT is only true while
# that savepoint stands.  When it is rolled back (reserve() ending
# INSUFFICIENT, an idempotent() block that raises, the user's own
# begin_nested()), the row is back to its old value but the instance still
# holds the new one, and its next flush would write it back: a lost update.
# The Session itself cannot know (set_committed_value does not make the
# instance dirty, and reserve() uses a Connection-level savepoint), so each
# connection keeps a journal of what was synced under each open savepoint,
# fed by SQLAlchemy's savepoint events, and a rolled-back savepoint expires
# those attributes: they reload from the database on the next access.

# Both live in the Connection object's own __dict__: Connection.info belongs to the pooled DBAPI
# connection (it outlives the Connection and is three properties deep), and a Connection lives
# for one Session transaction.  A Connection the application keeps across transactions is why
# the journal is tagged with the root transaction it belongs to.
_JOURNAL: Final = "_stateguard_savepoints"
_DEFERRED: Final = "_stateguard_deferred_savepoint"


def _frames(conn: Connection, *, create: bool = False) -> list[Any] | None:
    """The savepoint journal of ``conn``'s current transaction: ``[(name, [(session, instance,
    attrs), ...]), ...]``, outermost first; ``None`` when there is none (one left by an earlier
    transaction of the same Connection reads as none)."""
    state = conn.__dict__
    entry: tuple[Any, list[Any]] | None = state.get(_JOURNAL)
    root = conn._transaction
    if entry is None or entry[0] is not root:
        if not create or root is None:
            return None
        entry = state[_JOURNAL] = (root, [])
    return entry[1]


def _open_savepoints(conn: Connection) -> list[str]:
    """The names of the savepoints open on ``conn``, outermost first (SQLAlchemy's own chain)."""
    names: list[str] = []
    nested = conn._nested_transaction
    while nested is not None:
        names.append(nested._savepoint)
        nested = nested._previous_nested
    names.reverse()
    return names


def _journal(session: Session, info: ModelInfo, instance: Any, attrs: tuple[str, ...]) -> None:
    if not attrs:
        return
    conn = session.connection(bind_arguments=info.bind_arguments)
    if conn._nested_transaction is None:
        # A whole-transaction rollback expires every loaded instance already (Session.rollback).
        return
    hook_engine(conn)
    stack = _frames(conn, create=True)
    if stack is None:
        return
    known = {frame[0] for frame in stack}
    missing: list[tuple[str, list[Any]]] = [(n, []) for n in _open_savepoints(conn) if n not in known]
    if missing:
        # Opened before stateguard's hooks were on this engine (the application's begin_nested()
        # before its first guarded write), so never announced to them; everything since was, so
        # these are the outermost.
        stack[:0] = missing
    stack[-1][1].append((session, instance, attrs))


def _pop_to(conn: Connection, name: str) -> list[Any]:
    """Remove the frame of savepoint ``name`` and any still open inside it; what they journaled."""
    stack = _frames(conn)
    entries: list[Any] = []
    if not stack or all(frame_name != name for frame_name, _ in stack):
        return entries
    while stack:
        frame_name, frame = stack.pop()
        entries.extend(frame)
        if frame_name == name:
            break
    return entries


def _savepoint_statement(conn: Connection, statement: str) -> str | None:
    """Journal a ``SAVEPOINT`` / ``RELEASE SAVEPOINT`` / ``ROLLBACK TO SAVEPOINT`` about to be sent;
    the savepoint's name (``None``: not such a statement)."""
    words = statement.split()
    if len(words) == 2 and words[0] == "SAVEPOINT":
        stack = _frames(conn, create=True)
        if stack is not None:
            stack.append((words[1], []))
        return words[1]
    if len(words) == 3 and words[0] == "RELEASE" and words[1] == "SAVEPOINT":
        # Released: its syncs now stand or fall with the enclosing savepoint (or transaction).
        entries = _pop_to(conn, words[2])
        stack = _frames(conn)
        if stack and entries:
            stack[-1][1].extend(entries)
        return words[2]
    if len(words) == 4 and words[0] == "ROLLBACK" and words[1] == "TO" and words[2] == "SAVEPOINT":
        for session, instance, attrs in _pop_to(conn, words[3]):
            if instance in session:
                session.expire(instance, list(attrs))
        return words[3]
    return None


# --------------------------------------------------------------------------
# The statement hook: the journal's feed, and the deferred savepoint's trigger
# --------------------------------------------------------------------------
#
# Registered on an engine's dialect the first time stateguard needs it there
# (a loaded instance synced inside a savepoint, a deferred savepoint); on such
# an engine the application's statements pay one short call each.


#: The dialect :func:`hook_engine` last saw hooked: nearly every application has one engine, and
#: a hit skips the weak set's lookup (a weakref built per call).
_last_hooked: Any = None


def hook_engine(conn: Connection) -> None:
    """Make sure stateguard's statement hook is registered on ``conn``'s engine (once per dialect)."""
    global _last_hooked
    dialect = conn.dialect
    if dialect is _last_hooked:
        return
    if dialect not in HOOKED:
        hook_dialect(dialect, _on_execute, _on_execute_no_params)
    _last_hooked = dialect


def _on_execute(cursor: Any, statement: str, parameters: Any, context: Any) -> bool:
    conn: Connection = context.root_connection
    head = statement[:9]
    if head == "SAVEPOINT" or head == "RELEASE S" or head == "ROLLBACK ":
        _before_savepoint_statement(conn, statement)
    elif _DEFERRED in conn.__dict__:
        _open_deferred(conn)
    return False  # not executed here: SQLAlchemy sends the statement


def _on_execute_no_params(cursor: Any, statement: str, context: Any) -> bool:
    return _on_execute(cursor, statement, None, context)


def _before_savepoint_statement(conn: Connection, statement: str) -> None:
    # SQLAlchemy's own savepoint management (SAVEPOINT sa_savepoint_1 ..., sent when a Session
    # provisions one) does not open the block's savepoint: a nested transaction the block begins
    # is the block savepoint's child, and SQLAlchemy sends the parent's SAVEPOINT first.  A
    # savepoint the application sends itself (exec_driver_sql("SAVEPOINT mine")) is a statement
    # of the block like any other: the block's savepoint goes out before it, so releasing or
    # rolling back to it cannot take the block's savepoint with it.
    words = statement.split(None, 4)
    name = words[-1] if len(words) >= 2 else ""
    if _DEFERRED in conn.__dict__ and not name.lower().startswith("sa_savepoint_"):
        _open_deferred(conn)
    _savepoint_statement(conn, statement)


def _open_deferred(conn: Connection) -> None:
    state = conn.__dict__
    deferred: DeferredSavepoint = state[_DEFERRED]
    if deferred._paused:
        return  # looked at, not popped: a key deleted from an instance's dict slows it (3.11)
    del state[_DEFERRED]
    # Forgotten here: one left by an earlier transaction of this Connection is not opened.
    if deferred._root is conn._transaction:
        deferred.open()


# --------------------------------------------------------------------------
# Savepoints
# --------------------------------------------------------------------------


def abandon_savepoint(savepoint: Any) -> None:
    """Roll back a SAVEPOINT (Connection or Session level) while an error propagates, keeping that error.

    MariaDB/MySQL roll the whole transaction back on a deadlock (1213),
    savepoints included: ``ROLLBACK TO SAVEPOINT`` then fails with 1305
    ("SAVEPOINT ... does not exist"), and raising that would hide the
    retryable :class:`DeadlockDetected`.  The caller's transaction is dead
    either way and must be rolled back.
    """
    if not savepoint.is_active:
        return
    with contextlib.suppress(sa_exc.DBAPIError):
        savepoint.rollback()


class DeferredSavepoint:
    """A Session SAVEPOINT sent only when something else runs a statement on the connection.

    ``session.begin_nested()`` is lazy already for the Session's own use (the
    SAVEPOINT goes out when the savepoint first needs its connection); this
    also covers a statement sent on the Connection directly (one fetched
    before, ``exec_driver_sql`` ...): the statement hook opens the savepoint
    first.  Statements sent inside :meth:`paused` do not open it.
    So a block that sends nothing costs no SAVEPOINT and no RELEASE, and a
    block that does has all of its statements inside the savepoint, rolled
    back with it.  :meth:`close` (or the end of the transaction) forgets it.
    """

    __slots__ = ("_bind_arguments", "_conn", "_paused", "_root", "nested", "session")

    def __init__(self, session: Session, conn: Connection, bind_arguments: dict[str, Any]) -> None:
        self.session = session
        self._conn = conn
        self._bind_arguments = bind_arguments
        self._paused = False
        self.nested = session.begin_nested()
        self._root = conn._transaction
        if conn.dialect is not _last_hooked:
            hook_engine(conn)
        conn.__dict__[_DEFERRED] = self

    def open(self) -> None:
        """Send the SAVEPOINT now (no-op if it is out already or the savepoint has ended)."""
        self.close()
        if self.nested.is_active:
            self._paused = True
            try:
                ensure_real_transaction(self._conn)
                self.session.connection(bind_arguments=self._bind_arguments)
            finally:
                self._paused = False

    def paused(self) -> DeferredSavepoint:
        """``with savepoint.paused() as conn``: the connection, for stateguard's own statements that
        must not open the savepoint (a plain class, not a generator: it runs on every call)."""
        return self

    def __enter__(self) -> Connection:
        self._paused = True
        return self._conn

    def execute_paused(self, stmt: Executable, params: Mapping[str, Any]) -> CursorResult[Any]:
        """:func:`~stateguard._kernel.execute` of ``stmt`` on the connection, inside :meth:`paused`
        (one call instead of four, for the statement that completes an idempotent block)."""
        self._paused = True
        try:
            return execute(self._conn, stmt, params)
        finally:
            self._paused = False

    def __exit__(self, *exc_info: object) -> None:
        self._paused = False

    def close(self) -> None:
        """Stop watching the connection (the savepoint itself is left as it is)."""
        state = self._conn.__dict__
        if state.get(_DEFERRED) is self:
            del state[_DEFERRED]

    def end(self) -> None:
        """The block succeeded: stop watching, and commit the savepoint (RELEASE only if it was sent).

        A savepoint nothing ran in (no connection of any bind joined it, nothing is pending to
        flush, and it is still the session's innermost transaction) is only closed:
        ``SessionTransaction.commit()`` would flush, fire ``before_commit`` and merge an empty
        snapshot into its parent, three times the cost of the whole bookkeeping.
        """
        state = self._conn.__dict__  # close(), written out: end() runs at every completed block
        if state.get(_DEFERRED) is self:
            del state[_DEFERRED]
        nested = self.nested
        if not nested.is_active:
            return
        session = self.session
        # SQLAlchemy's own attributes, read with fallbacks that take the commit() path: the
        # SessionTransaction's connections, the session's innermost transaction, and
        # Session._is_clean() (nothing new, deleted or modified: what flush() checks first).
        is_clean = getattr(session, "_is_clean", None)
        if (
            not getattr(nested, "_connections", True)
            and getattr(session, "_transaction", None) is nested
            and is_clean is not None
            and is_clean()
        ):
            nested.close()
        else:
            nested.commit()
