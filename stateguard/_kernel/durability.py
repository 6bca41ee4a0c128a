"""Durability a guarded write can ask for: a COMMIT that a synchronous standby has confirmed.

``durability="replicated"`` (per call, or per engine with :func:`set_durability`)
makes the transaction of a guarded write commit with ``synchronous_commit =
remote_apply``: PostgreSQL answers COMMIT only once a synchronous standby has
applied it, so an acknowledged write survives a failover to that standby.  The
first durable call of a transaction sends one statement, ``SELECT
set_config('synchronous_commit', 'remote_apply', true),
current_setting('synchronous_standby_names')`` (and, where the session's
``client_min_messages`` is ``error``, lowers it to ``warning`` for the
transaction, so that the WARNING below reaches the client), before its own
write; an empty ``synchronous_standby_names`` (no synchronous standby, so
nothing would wait) is a :class:`~stateguard.ConfigurationError` and the call
writes nothing.  So is a connection in AUTOCOMMIT, or a session that does not
send its connection's COMMIT (joined into a transaction the application
began): the COMMIT that waits would not be the session's to watch.

PostgreSQL ends the wait for the standby early when the COMMIT is cancelled
(``pg_cancel_backend``, a client's cancel request, the ``timeout`` enforced
here): the transaction is then committed on the primary only, and COMMIT
*succeeds* with a WARNING ("canceling wait for synchronous replication ...",
detail "The transaction has already committed locally, but might not have
been replicated to the standby").  A notice handler on the psycopg connection
(added once per DBAPI connection, ignoring every notice of a transaction that
asked for nothing) catches that WARNING, and the session's commit then raises
:class:`~stateguard.ReplicationTimeout` instead of passing the write off as
durable (see :func:`stateguard._kernel.listeners.watch_commit` for what
happens to ``on_commit`` callbacks).

An engine stateguard was never told about, and a call that does not ask, pay
one dictionary check: no statement, no listener.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final, Literal, TypeVar

from sqlalchemy import Connection, Engine, event, text
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Session, SessionTransaction

from ..exceptions import ConfigurationError, InvalidArgument, NotSupported, ReplicationTimeout
from .backend import backend as backend_of
from .listeners import watch_commit

__all__ = ["DURABLE", "LOCAL", "REPLICATED", "CommitWatch", "Durability", "durable", "set_durability"]

_T = TypeVar("_T")

#: The levels a call or an engine may ask for.
Durability = Literal["replicated", "local"]
REPLICATED: Final = "replicated"
LOCAL: Final = "local"
_LEVELS: Final = (REPLICATED, LOCAL)


@dataclass(frozen=True, slots=True)
class _Setting:
    level: str | None
    timeout: float | None


#: ``id(dialect)`` -> what :func:`set_durability` said for that engine (and its
#: ``execution_options()`` copies, which share its dialect).  A plain dict, so that the check on
#: every guarded write (``if durability is not None or DURABLE``) costs no Python call; an entry
#: goes when its dialect is collected.
DURABLE: Final[dict[int, _Setting]] = {}
_finalizers: Final[dict[int, weakref.finalize[Any, Any]]] = {}

#: The third column lets the cancelled-wait WARNING through for this transaction when the session's
#: ``client_min_messages`` is ``error`` (set on a role, a database or the URL): PostgreSQL sends
#: the client no WARNING then, and a cancelled wait would look like a confirmed COMMIT.
_REPLICATED_SQL: Final = text(
    "SELECT set_config('synchronous_commit', 'remote_apply', true), "
    "current_setting('synchronous_standby_names'), "
    "CASE WHEN current_setting('client_min_messages') = 'error' "
    "THEN set_config('client_min_messages', 'warning', true) END"
)
#: The start of PostgreSQL's WARNING when the wait of a COMMIT for its standby was cancelled
#: (src/backend/replication/syncrep.c: "... due to user request" or "... due to administrator
#: command"); its detail says the transaction "has already committed locally".
_CANCELLED_WAIT: Final = "canceling wait for synchronous replication"
_WATCH: Final = "stateguard.commit_watch"


def set_durability(engine: Engine, durability: str | None, timeout: timedelta | None) -> None:
    """What :func:`stateguard.set_durability` does (its docstring is the documentation)."""
    if durability is not None and durability not in _LEVELS:
        raise InvalidArgument(f"durability must be 'replicated', 'local' or None, got {durability!r}")
    seconds: float | None = None
    if timeout is not None:
        if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
            raise InvalidArgument(f"timeout must be a positive timedelta or None, got {timeout!r}")
        seconds = timeout.total_seconds()
    dialect = engine.dialect
    if durability == REPLICATED:
        _check_supported(dialect)
    key = id(dialect)
    if durability is None and seconds is None:
        DURABLE.pop(key, None)
        finalizer = _finalizers.pop(key, None)
        if finalizer is not None:
            finalizer.detach()
        return
    DURABLE[key] = _Setting(durability, seconds)
    if key not in _finalizers:
        _finalizers[key] = weakref.finalize(dialect, _forget, key)


def _forget(key: int) -> None:
    DURABLE.pop(key, None)
    _finalizers.pop(key, None)


def _check_supported(dialect: Dialect) -> None:
    """NotSupported unless ``dialect`` can commit with a synchronous standby's confirmation."""
    backend = backend_of(dialect)
    if not backend.synchronous_standbys:
        raise NotSupported(
            f"durability='replicated' needs PostgreSQL's synchronous replication "
            f"(synchronous_commit = remote_apply); {backend.name} has no such COMMIT, so stateguard "
            f"cannot make or report a replicated commit there: use durability='local' (or None), or "
            f"the database's own replication settings"
        )
    if dialect.driver != "psycopg":
        raise NotSupported(
            f"durability='replicated' needs the psycopg driver (postgresql+psycopg://): PostgreSQL "
            f"reports a cancelled wait for the standby only as a WARNING, which stateguard reads "
            f"with psycopg's notice handler; {dialect.driver} hands it no notices"
        )


def durable(session: Session, conn: Connection, durability: str | None) -> CommitWatch | None:
    """Prepare ``conn``'s transaction for a guarded write of ``durability`` (``None``: the engine's).

    Called by the public calls only when ``durability is not None or DURABLE``,
    after they checked their arguments and before their write.  ``None``: the
    write commits as the server is configured.  Else the watch that the call
    hands its return value to (:meth:`CommitWatch.note`).

    :raises InvalidArgument: an unknown level; nothing was sent.
    :raises NotSupported: ``"replicated"`` on SQLite, MariaDB/MySQL or another driver.
    :raises ConfigurationError: ``"replicated"`` on a server with no synchronous standby
        (empty ``synchronous_standby_names``), on a connection in AUTOCOMMIT, or in a session
        that does not commit its connection's transaction; the call wrote nothing.
    """
    setting = DURABLE.get(id(conn.dialect)) if DURABLE else None
    if durability is None:
        if setting is None or setting.level != REPLICATED:
            return None
    elif durability != REPLICATED:
        if durability == LOCAL:
            return None
        raise InvalidArgument(f"durability must be 'replicated', 'local' or None, got {durability!r}")
    _check_supported(conn.dialect)
    record = conn.connection
    _check_committed_by(session, conn, record.driver_connection)
    watch: CommitWatch | None = record.info.get(_WATCH)
    if watch is None:
        watch = record.info[_WATCH] = CommitWatch(record.driver_connection)
    if not watch.set_for(session):
        row = conn.execute(_REPLICATED_SQL).one()
        if not str(row[1] or "").strip():
            raise ConfigurationError(
                "durability='replicated' needs a synchronous standby, and this server has none "
                "(synchronous_standby_names is empty): its COMMIT would wait for no one, so the "
                "write could be lost by a failover; configure synchronous_standby_names on the "
                "primary, or call with durability='local'; nothing was written by this call"
            )
        watch.arm(session, conn, setting.timeout if setting is not None else None)
    return watch


def _check_committed_by(session: Session, conn: Connection, driver: Any) -> None:
    """ConfigurationError unless the session's commit sends the COMMIT of ``conn``'s transaction.

    Only that COMMIT is watched (its timer, its WARNING).  In AUTOCOMMIT each statement commits
    itself at once, before any ``remote_apply`` COMMIT; a two-phase session ends with COMMIT
    PREPARED, after PREPARE TRANSACTION dropped the setting; a session joined into a transaction the
    application began on its own Connection (``Session(bind=connection)``, every
    ``join_transaction_mode`` but ``"control_fully"`` of a root transaction) leaves the COMMIT to
    the application, where no session event sees it.
    """
    if getattr(driver, "autocommit", False):
        raise ConfigurationError(
            "durability='replicated' needs a transaction that the session commits, and this "
            "connection is in AUTOCOMMIT (isolation_level='AUTOCOMMIT'): each statement commits "
            "itself without waiting for the standby; run the call in a transaction, or call with "
            "durability='local'; nothing was written by this call"
        )
    if session.twophase:
        raise ConfigurationError(
            "durability='replicated' needs a session that commits with COMMIT, and this one is "
            "two-phase (twophase=True): its PREPARE TRANSACTION waits for the standby with no "
            "timeout, and COMMIT PREPARED runs after the transaction's remote_apply setting is "
            "gone, so the commit would not be confirmed; use a one-phase session, or call with "
            "durability='local'; nothing was written by this call"
        )
    root = session.get_transaction()
    # SQLAlchemy's own bookkeeping: (connection, transaction, should_commit, autoclose) per bind.
    joined = getattr(root, "_connections", {}).get(conn) if root is not None else None
    if joined is not None and not (joined[2] and joined[1] is conn.get_transaction()):
        raise ConfigurationError(
            "durability='replicated' needs a session that commits its connection's transaction, "
            "and this session does not commit it (it joined a transaction begun on the Connection "
            "it is bound to): the COMMIT that would wait for the standby is the application's, "
            "which stateguard cannot watch; give the session an Engine, or "
            "join_transaction_mode='control_fully', or call with durability='local'; nothing was "
            "written by this call"
        )


class CommitWatch:
    """What one DBAPI connection's durable transaction needs at COMMIT: the notice, the timer.

    Made once per psycopg connection (kept in its pool record's ``info``); its
    notice handler stays on the connection and records the cancelled-wait
    WARNING only while a durable transaction is :meth:`armed <arm>`.
    """

    __slots__ = (
        "__weakref__",
        "_cancelled",
        "_committing",
        "_driver",
        "_listened",
        "_lock",
        "_owners",
        "_root",
        "_session",
        "_timeout",
        "_timer",
        "armed",
        "results",
    )

    def __init__(self, driver_connection: Any) -> None:
        self._driver = weakref.ref(driver_connection)
        self._lock = threading.Lock()
        self.armed = False
        #: The transactions whose ``set_config`` is in effect (a released savepoint's passes to
        #: its parent, a rolled-back one's is undone): none left, the transaction asks for nothing.
        self._owners: list[SessionTransaction] = []
        self._root: SessionTransaction | None = None
        self._session: weakref.ref[Session] | None = None
        self._listened: Connection | None = None
        self._timeout: float | None = None
        self._timer: threading.Timer | None = None
        self._committing = False
        #: ``(message, detail)`` of the WARNING, once PostgreSQL said the wait was cancelled.
        self._cancelled: tuple[str, str] | None = None
        #: What the durable calls of the transaction returned, in order, each with the session
        #: transaction it was made in (a savepoint rolled back since drops it).
        self.results: list[tuple[SessionTransaction | None, Any]] = []
        watcher = weakref.ref(self)

        def on_notice(diagnostic: Any) -> None:
            # A Diagnostic is readable only inside the handler: its fields are copied.
            found = watcher()
            if found is not None and found.armed:
                message = diagnostic.message_primary or ""
                if message.startswith(_CANCELLED_WAIT):
                    found._cancelled = (message, diagnostic.message_detail or "")

        # First in line: psycopg calls the handlers in order and logs one that raises, and a log
        # handler that raises in turn ends the loop, so a handler after the application's may
        # never see the WARNING.  ``_notice_handlers`` is psycopg's list (add_notice_handler
        # appends to it); without it, appended like any handler.
        handlers = getattr(driver_connection, "_notice_handlers", None)
        if isinstance(handlers, list):
            handlers.insert(0, on_notice)
        else:  # pragma: no cover - a psycopg without the list
            driver_connection.add_notice_handler(on_notice)

    def note(self, value: _T) -> _T:
        """Keep ``value`` (what a durable call returns) for the error of an unconfirmed commit."""
        session = self._session() if self._session is not None else None
        owner = (session.get_nested_transaction() or session.get_transaction()) if session else None
        self.results.append((owner, value))
        return value

    def released(self, savepoint: SessionTransaction) -> None:
        """``savepoint`` was released: what it holds (its ``set_config``, its results) is its parent's."""
        parent = savepoint.parent
        self._owners = [parent if o is savepoint and parent is not None else o for o in self._owners]
        self.results = [(parent if o is savepoint else o, v) for o, v in self.results]

    def ended(self, savepoint: SessionTransaction) -> None:
        """``savepoint`` ended (after :meth:`released` if it was): drop what its rollback undid."""
        self._owners = [o for o in self._owners if not _within(o, savepoint)]
        self.results = [(o, v) for o, v in self.results if not _within(o, savepoint)]
        if not self._owners:
            # The rollback undid every set_config: the COMMIT is a plain one again.
            self.armed = False

    def set_for(self, session: Session) -> bool:
        """Whether ``remote_apply`` is set already in the session's current transaction.

        It is when the transaction that set it is the current one or encloses
        it; a savepoint rolled back since has undone the ``set_config`` (and
        the write that asked for it), so it is sent again.
        """
        if not self.armed:
            return False
        current = session.get_nested_transaction() or session.get_transaction()
        return any(_within(current, owner) for owner in self._owners)

    def arm(self, session: Session, conn: Connection, timeout: float | None) -> None:
        """``remote_apply`` was just set: watch this transaction's COMMIT."""
        root = session.get_transaction()
        if self._root is not root:
            # A new root transaction; or an arming whose session never ended its transaction
            # (dropped unclosed): what it left is forgotten, not reported for this one.
            self.stop()
            self._cancelled = None
            self.results = []
            self._timeout = None
            self._listened = None
            self._owners = []
            self._root = root
        self.armed = True
        self._session = weakref.ref(session)
        owner = session.get_nested_transaction() or root
        if owner is not None:  # a durable call always runs in a transaction
            self._owners.append(owner)
        if timeout is not None:
            self._timeout = timeout if self._timeout is None else min(timeout, self._timeout)
        watch_commit(session, self)
        if self._timeout is not None and self._listened is not conn:
            # Listeners on this one Connection (the session transaction's), not on the Engine:
            # only a durable transaction's COMMIT starts a timer.
            event.listen(conn, "commit", self._start)
            event.listen(conn, "rollback", self._stop_event)
            self._listened = conn

    def _start(self, conn: Connection) -> None:
        timeout = self._timeout
        if timeout is None or not self.armed:
            # Listened to only with a timeout; not armed: a savepoint rollback undid the durable calls.
            return
        with self._lock:
            self._committing = True
            self._timer = threading.Timer(timeout, self._expire)
            self._timer.daemon = True
            self._timer.start()

    def _expire(self) -> None:
        # Under the lock: the COMMIT's end (stop()) waits until the cancel request is sent, so the
        # request reaches a backend that is still in this COMMIT or idle (which ignores it), never
        # the connection's next statement.
        with self._lock:
            if not self._committing:
                return
            driver = self._driver()
            if driver is not None:
                # A failed cancel request leaves the COMMIT waiting, as without a timeout.
                with contextlib.suppress(Exception):
                    driver.cancel()

    def _stop_event(self, conn: Connection) -> None:
        self.stop()

    def stop(self) -> None:
        """The COMMIT returned (or the transaction rolls back): no cancel may be sent any more."""
        with self._lock:
            self._committing = False
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def finish(self, committed: bool) -> ReplicationTimeout | None:
        """The root transaction ended: disarm, and the error of a commit the standby did not confirm."""
        self.stop()
        cancelled, results, armed = self._cancelled, self.results, self.armed
        self.armed = False
        self._owners = []
        self._root = None
        self._session = None
        self._listened = None
        self._timeout = None
        self._cancelled = None
        self.results = []
        if not committed or cancelled is None or not armed:
            return None
        message, detail = cancelled
        return ReplicationTimeout(
            f"the transaction is committed on the PostgreSQL primary but no synchronous standby "
            f"confirmed it (the server said: {message}; {detail}): a failover now can lose it. It is "
            f"not undone: check the standby (pg_stat_replication), then act on .value, or retry the "
            f"same calls (idempotent ones answer REPEATED) once the standby is back",
            value=tuple(value for _, value in results),
            acknowledged=0,
            wanted=1,
        )


def _within(transaction: SessionTransaction | None, ancestor: SessionTransaction) -> bool:
    """Whether ``transaction`` is ``ancestor`` or one of its savepoints."""
    while transaction is not None:
        if transaction is ancestor:
            return True
        transaction = transaction.parent
    return False
