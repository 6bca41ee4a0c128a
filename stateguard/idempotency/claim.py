"""The claim of one idempotency key: the whole algorithm, written once against a Session.

:class:`Claim` is a one-use context manager.  Entering claims the key (one
INSERT; on PostgreSQL it also returns the record that holds a taken key),
or reads the record and decides: replay, refuse, reclaim an expired record,
or take over a dead or released claim.  An open call's writes are
owner-conditional UPDATEs; leaving completes, releases or fails the key.
Same-transaction mode wraps the block in a savepoint sent before its first
statement; separate mode commits the claim at once and keeps the lease alive
from a background thread when asked to.  The statements are
:mod:`~stateguard.idempotency.statements`'; :mod:`~stateguard._async` runs
this class inside ``run_sync`` for an AsyncSession.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from logging import DEBUG
from types import TracebackType
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from .. import _kernel
from .. import observe as _observe
from .._async import AsyncSession, DualContextManager, as_session
from ..exceptions import (
    ConfigurationError,
    DeadlockDetected,
    IdempotencyKeyReused,
    InvalidArgument,
    LeaseLost,
    NotSupported,
    ReplicationTimeout,
    RequestFailed,
    RequestInProgress,
    SerializationConflict,
)
from ..tables import idempotency_keys
from .call import IdempotentCall
from .events import _listeners, emit, log
from .options import IdempotencyOptions
from .serialization import exception_text, load
from .statements import (
    CLAIM,
    COMPLETE,
    COMPLETE_FRESH,
    COMPLETED,
    FAIL,
    FAILED,
    FORGET,
    HEARTBEAT,
    READ,
    READ_LOCKING,
    RECLAIM,
    RELEASE,
    TAKEOVER,
    UNCLAIM,
    Record,
)

__all__ = ["CLAIM_ATTEMPTS", "MAX_ROUNDS", "Claim"]

#: The kind of session a call was made for (a Session or an AsyncSession).
S = TypeVar("S")
T = TypeVar("T")
E = TypeVar("E", bound=BaseException)

#: Rounds of read-then-decide before giving up on a record that keeps changing.
MAX_ROUNDS = 8
#: Attempts of a separate-mode claim transaction that hit a deadlock or serialization failure.
CLAIM_ATTEMPTS = 5


class Claim(DualContextManager[IdempotentCall[S]]):
    """The claim of one key: the whole algorithm, written once against a Session; a one-use context manager.

    :func:`idempotent` returns it: a :class:`~stateguard._async.DualContextManager`,
    entered directly with ``with`` and inside ``run_sync`` with ``async with``;
    ``face`` is the session the caller passed, so the :class:`IdempotentCall`
    it hands out answers in the caller's kind (awaitables for an AsyncSession).
    """

    def __init__(
        self,
        face: S,
        scope: str,
        key: str,
        options: IdempotencyOptions,
        fingerprint: str | None,
    ) -> None:
        """``face``: the Session or AsyncSession the caller passed; the other arguments are checked.

        :raises NotSupported: ``heartbeat_every`` with an AsyncSession.
        :raises InvalidArgument: ``face`` is not a session.
        """
        session: Session
        if isinstance(face, AsyncSession):
            if options.heartbeat_every is not None:
                raise NotSupported(
                    "heartbeat_every runs a thread, which cannot use an AsyncSession's connections; "
                    "await call.heartbeat() from your own task instead"
                )
            session = face.sync_session
            self._async = face
        else:
            session = face if isinstance(face, Session) else as_session(face, "idempotent()")
            face = session  # a scoped_session's current Session
            self._async = None
        self._name = "idempotent()"  # DualContextManager's attributes, set here: one call less per claim
        self.session = session
        self.face = face
        self.scope = scope
        self.key = key
        self.options = options
        self.fingerprint = fingerprint
        # 128 random bits as 32 hex characters (uuid4().hex without the UUID object: a third of the cost).
        self.owner = owner = os.urandom(16).hex()
        self._base_params = {
            "sg_scope": scope,
            "sg_key": key,
            "sg_fp": fingerprint,
            "sg_owner": owner,
            "sg_lease": options.lease_ms,
            "sg_ttl": options.ttl_ms,
        }
        # Everything else starts at its class-level default (below): a claim is built on every
        # call, and most of its parts only exist on the slow paths (heartbeat, separate mode).

    #: The call handed out on entering.
    call: IdempotentCall[S] | None = None
    #: Same transaction: the savepoint of the block (sent before its first statement).
    _block_savepoint: _kernel.DeferredSavepoint | None = None
    #: Same transaction: this call inserted the record (outside the savepoint).
    fresh: bool = False
    _conn: Connection | None = None
    #: Same transaction: where the session runs statements on the keys table.
    _binds: dict[str, Any] | None = None
    _engine: Engine | None = None
    _stop: threading.Event | None = None
    _beater: threading.Thread | None = None
    #: Separate mode with heartbeat_every: the background heartbeat's own connection.
    _beat_conn: Connection | None = None
    #: Set before the write that ends the claim (complete, fail, release) is sent: a
    #: heartbeat that then finds no claim of ours in progress lost nothing.  No lock:
    #: with an AsyncSession both run on the event loop's thread.
    _finishing: bool = False

    def _emit(self, kind: str, attempt: int | None) -> None:
        emit(kind, self.scope, self.key, attempt, self.options.mode)

    @property
    def _what(self) -> str:
        return f"idempotency key {self.key!r} in scope {self.scope!r}"

    def _refuse(self, kind: str, attempt: int, cls: Callable[..., E], message: str, **found: Any) -> E:
        """Emit ``kind`` and build the error ``cls`` about this key, carrying the scope, key and ``found``."""
        self._emit(kind, attempt)
        return cls(message, scope=self.scope, key=self.key, **found)

    # -- entering ----------------------------------------------------------

    def _enter(self) -> IdempotentCall[S]:
        if self.call is not None:
            raise InvalidArgument(
                "an idempotent() context manager can be entered only once; call idempotent() again"
            )
        options = self.options
        if options.mode == "same_transaction":
            # The claim needs no SAVEPOINT: its INSERT cannot abort the transaction
            # (ON CONFLICT DO NOTHING; InnoDB rolls back only a duplicate-key
            # statement).  The block gets one, sent before its first statement
            # (none if it sends none): an exception rolls back the block's writes,
            # and the claim is deleted (a new record) or rolled back with the
            # savepoint (a takeover or reclaim, which opens it before its UPDATE).
            # A replay wrote nothing and its block only returns the response: no savepoint.
            session = self.session
            binds = self._binds = {"bind": _kernel.own_bind(session, idempotency_keys)}
            conn = self._conn = session.connection(bind_arguments=binds)
            try:
                call = self.call = self._claim(conn)
            except BaseException:
                self._drop_savepoint()
                raise
            if self._block_savepoint is None and call._state == "open":
                self._block_savepoint = _kernel.DeferredSavepoint(session, conn, binds)
        else:
            call = self.call = self._enter_separate()
        if options.heartbeat_every is not None and call._state == "open":
            self._start_heartbeat()
        elif self._beat_conn is not None:
            self._close_beat_conn()  # replayed or refused: nothing to keep alive
        return call

    def _savepoint_now(self) -> None:
        """Same transaction: open the block's savepoint before an UPDATE of an existing record."""
        if self.options.mode == "same_transaction" and self._block_savepoint is None:
            conn = self._open(self._conn)
            self._block_savepoint = _kernel.DeferredSavepoint(self.session, conn, self._open(self._binds))
            self._block_savepoint.open()

    def _drop_savepoint(self) -> None:
        """Roll back the block's savepoint (if it was sent) and stop watching the connection."""
        savepoint, self._block_savepoint = self._block_savepoint, None
        if savepoint is not None:
            savepoint.close()
            _kernel.abandon_savepoint(savepoint.nested)

    def _undo_same(self) -> None:
        """Same transaction, the block failed or was released: its writes and the claim are undone."""
        conn = self._conn
        self._drop_savepoint()
        if self.fresh and conn is not None:
            self.fresh = False
            try:
                _kernel.execute(conn, UNCLAIM, self._params())
            except (sa_exc.DBAPIError, sa_exc.PendingRollbackError, sa_exc.ResourceClosedError):
                # The transaction is aborted or gone (a deadlock on MariaDB, a lost connection, a
                # statement cancelled by an asyncio task's cancellation, which invalidates the
                # connection): the record cannot be committed with it either, and the block's own
                # exception is what the caller must see.
                log.warning(
                    "could not delete the claim of %s after its block failed", self._what, exc_info=True
                )

    def _enter_separate(self) -> IdempotentCall[S]:
        if self.session.in_transaction():
            # checkpoint() and complete() commit the session; inside `with
            # session.begin():` (or with uncommitted work) that would commit
            # someone else's unit of work, or fail.
            raise InvalidArgument(
                "mode='separate' commits the session at checkpoint() and complete(), so it must start "
                "with no transaction open: commit or roll back first, and do not wrap it in "
                "`with session.begin():`"
            )
        bind = _kernel.own_bind(self.session, idempotency_keys)
        engine = bind if isinstance(bind, Engine) else bind.engine
        self._engine = engine
        if self.options.heartbeat_every is not None:
            # The background heartbeat's own connection, checked out before the
            # claim: a block that holds the pool's last connection would
            # otherwise starve every beat, the lease would lapse while the
            # owner works, and a retry would take the key over and run the
            # work twice.  No connection: nothing was claimed (the pool's error).
            self._beat_conn = engine.connect()
        for attempt in range(1, CLAIM_ATTEMPTS + 1):
            try:
                with engine.begin() as conn:
                    return self._claim(conn)
            except BaseException as error:
                # Our own short transaction: twins taking over one record on
                # MariaDB can deadlock on their shared read locks; the loser
                # simply looks again.
                if attempt < CLAIM_ATTEMPTS and isinstance(error, SerializationConflict | DeadlockDetected):
                    continue
                self._close_beat_conn()
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _params(self) -> dict[str, Any]:
        """The parameters every statement of this claim takes (a new dict each time)."""
        return self._base_params.copy()

    def _claimed(self) -> IdempotentCall[S]:
        self.fresh = True
        if _observe.hooked or _listeners or log.isEnabledFor(DEBUG):
            emit("claimed", self.scope, self.key, 1, self.options.mode)
        return IdempotentCall(self)

    def _claim(self, conn: Connection) -> IdempotentCall[S]:
        params = self._base_params.copy()
        # PostgreSQL: one statement claims the key or returns its record.
        inserted, values = CLAIM.insert_or_read(conn, params)
        if inserted:
            # _claimed(), written out: the path of every first call.
            self.fresh = True
            if _observe.hooked or _listeners or log.isEnabledFor(DEBUG):
                emit("claimed", self.scope, self.key, 1, self.options.mode)
            return IdempotentCall(self)
        row: Any = None if values is None else Record._make(values)
        read = READ_LOCKING if _kernel.backend(conn.dialect).fresh_read_needs_lock else READ
        for _ in range(MAX_ROUNDS):
            if row is None:
                # Not read yet (MariaDB, SQLite; PostgreSQL after waiting for a twin that committed).
                row = _kernel.execute(conn, read, params).first()
            if row is None:
                # Purged (or its claimant rolled back) between our statements.
                if CLAIM(conn, params) is not None:
                    return self._claimed()
                continue
            call = self._decide(conn, row, params)
            if call is not None:
                return call
            row = None
        raise SerializationConflict(
            f"{self._what} changed {MAX_ROUNDS} times while it was being claimed; retry the request"
        )

    def _decide(self, conn: Connection, row: Any, params: dict[str, Any]) -> IdempotentCall[S] | None:
        """Act on the record found; None when a conditional UPDATE lost a race (read again).

        ``now`` is the database's clock as the read saw it; the UPDATEs that
        act on what was read judge the lease again on their own statement's clock.
        """
        now = row.db_now
        options = self.options
        if row.expires_ms <= now:
            self._savepoint_now()
            if _kernel.execute(conn, RECLAIM, {**params, "sg_old_owner": row.owner}).rowcount != 1:
                return None
            return self._claimed()
        if (
            self.fingerprint is not None
            and row.fingerprint is not None
            and row.fingerprint != self.fingerprint
        ):
            raise self._refuse(
                "key_reused",
                row.attempt,
                IdempotencyKeyReused,
                f"{self._what} was first used for a different request (another fingerprint); send a new key "
                f"for a new request",
            )
        if row.status == COMPLETED:
            self._emit("replayed", row.attempt)
            call = IdempotentCall(self, "replayed")
            call.replayed, call.attempt = True, row.attempt
            call.response = load(options.serializer, row.response)
            return call
        if row.status == FAILED:
            raise self._refuse(
                "failed_replayed",
                row.attempt,
                RequestFailed,
                f"the request of {self._what} failed with a non-retryable error ({row.error}); use a new key "
                f"to try again",
                error=row.error,
            )
        locked_until = row.locked_until_ms or 0
        if locked_until > now:
            raise self._refuse(
                "in_progress",
                row.attempt,
                RequestInProgress,
                f"{self._what} is being worked on by another request; retry after its lease ends",
                retry_after=timedelta(milliseconds=locked_until - now),
            )
        self._savepoint_now()
        if _kernel.execute(conn, TAKEOVER, {**params, "sg_old_owner": row.owner}).rowcount != 1:
            return None
        call = IdempotentCall(self)
        call.attempt, call.taken_over = row.attempt + 1, True
        self._emit("taken_over", call.attempt)
        call.checkpoint_name = row.checkpoint_name
        call.checkpoint_data = load(options.serializer, row.checkpoint_data)
        return call

    # -- writes of an open call ---------------------------------------------

    def complete_same(
        self, call: IdempotentCall[S], text: str, durability: str | None, response: Any
    ) -> None:
        """Same transaction: store ``text`` as the response (:meth:`write` for a completion, written out).

        The completion is what every owned call ends with: no merging of extra
        parameters, no mode dispatch, the UPDATE run by the block's savepoint
        without opening it.
        """
        savepoint = self._block_savepoint
        conn = self._conn
        if savepoint is None or conn is None:
            raise self._not_open()
        params = self._base_params.copy()
        params["sg_text"] = text
        stmt = COMPLETE_FRESH if self.fresh else COMPLETE
        self._finishing = True
        try:
            if durability is not None or _kernel.DURABLE or len(text) >= _kernel.SIZE_CHECK_FROM:
                # What write() does: anything these send is stateguard's, outside the block's savepoint.
                with savepoint.paused():
                    if _kernel.needs_size_check(conn, text):
                        self._check_size(conn, text)
                    watch = _kernel.durable(self.session, conn, durability)
                    matched = _kernel.execute(conn, stmt, params).rowcount
                    if watch is not None and matched == 1:
                        watch.note(response)
            else:
                matched = savepoint.execute_paused(stmt, params).rowcount
        except BaseException:
            self._finishing = False  # nothing ended: the call is still open and may be finished again
            raise
        if matched != 1:
            self._lost(call)
        call._state = "completed"
        if _observe.hooked or _listeners or log.isEnabledFor(DEBUG):
            emit("completed", self.scope, self.key, call.attempt, self.options.mode)

    def write(
        self,
        call: IdempotentCall[S],
        stmt: Any,
        extra: dict[str, Any],
        kind: str | None,
        durability: str | None = None,
        response: Any = None,
    ) -> None:
        """Run one owner-conditional UPDATE of the record (and in separate mode commit the session).

        ``durability`` (a completion's, whose ``response`` is noted for the error): as
        :func:`stateguard._kernel.durable` says; checked on the record's connection before the
        UPDATE.  Checkpoints, releases and failures are never durable.  In separate mode a
        commit the standby did not confirm finishes the call all the same (the record is
        committed on the primary) and its ReplicationTimeout is raised after.
        """
        params = {**self._base_params, **extra}
        ask = kind == "completed" and (durability is not None or bool(_kernel.DURABLE))
        unconfirmed: ReplicationTimeout | None = None
        if kind is not None:
            self._finishing = True
        text = extra.get("sg_text")
        try:
            if self.options.mode == "same_transaction":
                with self._open(self._block_savepoint).paused() as conn:
                    if text is not None and _kernel.needs_size_check(conn, text):
                        self._check_size(conn, text)
                    watch = _kernel.durable(self.session, conn, durability) if ask else None
                    matched = _kernel.execute(conn, stmt, params).rowcount
                    if watch is not None and matched == 1:
                        watch.note(response)
            else:
                session = self.session
                try:
                    conn = _kernel.own_connection(session, idempotency_keys)
                    if text is not None and _kernel.needs_size_check(conn, text):
                        self._check_size(conn, text)
                    watch = _kernel.durable(session, conn, durability) if ask else None
                    matched = _kernel.execute(conn, stmt, params).rowcount
                    if watch is not None and matched == 1:
                        watch.note(response)
                    if matched == 1:
                        try:
                            session.commit()
                        except ReplicationTimeout as error:
                            unconfirmed = error  # committed on the primary: the call is finished
                except (InvalidArgument, NotSupported, ConfigurationError):
                    raise  # refused before sending: the phase's work is not rolled back
                except BaseException:
                    session.rollback()
                    raise
                if matched != 1:
                    session.rollback()
        except BaseException:
            self._finishing = False  # nothing ended: the call is still open and may be finished again
            raise
        if matched != 1:
            self._lost(call)
        if kind is not None:
            if self._beater is not None or self._beat_conn is not None:
                self._stop_heartbeat()
            call._state = kind
            emit(kind, self.scope, self.key, call.attempt, self.options.mode)
        if unconfirmed is not None:
            raise unconfirmed

    def _check_size(self, conn: Connection, text: str) -> None:
        """InvalidArgument (nothing sent) when ``text`` cannot travel to the server in one statement.

        Called only when :func:`stateguard._kernel.needs_size_check` says ``text`` may be too large.
        """
        _kernel.check_statement_size(conn, text, f"the stored value of {self._what}")

    def heartbeat(self, call: IdempotentCall[S], dedicated: Connection | None = None) -> None:
        """Extend the lease; LeaseLost when another owner took the key (not when this owner finished it).

        ``dedicated``: the background heartbeat's own connection (separate mode).
        """
        if self._finishing or call._state != "open":
            return  # this owner is completing, failing or releasing the claim: nothing to keep alive
        params = self._params()
        if self.options.mode == "same_transaction":
            with self._open(self._block_savepoint).paused() as conn:
                matched = _kernel.execute(conn, HEARTBEAT, params).rowcount
        elif dedicated is not None:
            with dedicated.begin():
                matched = _kernel.execute(dedicated, HEARTBEAT, params).rowcount
        else:
            with self._open(self._engine).begin() as conn:
                matched = _kernel.execute(conn, HEARTBEAT, params).rowcount
        if matched != 1:
            if self._finishing or call._state != "open":
                # Its own complete()/fail/release() ended the claim between the check
                # above and this UPDATE: that write reports a real loss itself.
                return
            self._lost(call)

    def release(self, call: IdempotentCall[S], reason: str | None, forget: bool = False) -> None:
        if self.options.mode == "same_transaction":
            self._stop_heartbeat()
            self._open(self._block_savepoint)
            self._undo_same()
            call._state = "released"
            self._emit("released", call.attempt)
            return
        if forget:
            self.write(call, FORGET, {}, "released")
        else:
            self.write(call, RELEASE, {"sg_text": reason}, "released")

    def _open(self, part: T | None) -> T:
        """A part of the open claim (its connection, savepoint, call ...); InvalidArgument once it is over."""
        if part is None:
            raise self._not_open()
        return part

    def _not_open(self) -> InvalidArgument:
        return InvalidArgument(f"{self._what} is not open: use the call inside its with block")

    def _lost(self, call: IdempotentCall[S]) -> None:
        self._stop_heartbeat()
        call._state = "lost"
        raise self._refuse(
            "lease_lost",
            call.attempt,
            LeaseLost,
            f"the lease on {self._what} expired and another request took the key over; its record was left "
            f"untouched. Use a longer lease or heartbeat() for long work",
        )

    # -- background heartbeat -----------------------------------------------

    def _start_heartbeat(self) -> None:
        stop = threading.Event()
        call, interval = self._open(self.call), self._open(self.options.heartbeat_seconds)
        key = self.key
        dedicated = self._beat_conn

        def beat() -> None:
            while not stop.wait(interval):
                try:
                    self.heartbeat(call, dedicated)
                except LeaseLost:
                    return
                except Exception:  # the database is away: the next beat tries again
                    log.warning(
                        "heartbeat of idempotency key %r in scope %r failed",
                        key,
                        self.scope,
                        exc_info=True,
                    )

        self._stop = stop
        self._beater = threading.Thread(target=beat, name=f"stateguard-heartbeat:{key[:40]}", daemon=True)
        self._beater.start()

    def _stop_heartbeat(self) -> None:
        stop, beater = self._stop, self._beater
        if stop is None or beater is None:
            if self._beat_conn is not None:
                self._close_beat_conn()
            return
        self._stop = self._beater = None
        stop.set()
        if beater is not threading.current_thread():
            beater.join()
            self._close_beat_conn()

    def _close_beat_conn(self) -> None:
        conn, self._beat_conn = self._beat_conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # a broken connection is discarded by the pool
                conn.close()

    # -- leaving -------------------------------------------------------------

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # With an AsyncSession this runs also on cancellation (CancelledError):
        # the savepoint is rolled back (same transaction) or the key released
        # (separate), so it is free again.
        call = self.call
        if call is None:
            return
        if self._beater is not None or self._beat_conn is not None:
            self._stop_heartbeat()
        if exc is None:
            if call._state == "open":
                # The block finished without complete(): its work is done, the response is None.
                call._complete(None)
            savepoint, self._block_savepoint = self._block_savepoint, None
            if savepoint is not None:
                savepoint.end()
            return
        if self.options.mode == "same_transaction":
            self._undo_same()
            if call._state == "open":
                call._state = "released"
                self._emit("released", call.attempt)
            return
        if call._state != "open":
            return
        self._finish_failed(call, exc)

    def _finish_failed(self, call: IdempotentCall[S], exc: BaseException) -> None:
        """Separate mode, the block raised: roll the session back, then release or fail the key.

        Nothing here may replace the block's own exception: if the database is
        unreachable, the claim stays in progress and the next retry takes it
        over once the lease ends.
        """
        # Sanitised: a NUL (PostgreSQL) or lone surrogate in the message must not
        # make this write fail and leave the key in progress for a whole lease.
        text = exception_text(exc)
        options = self.options
        try:
            self.session.rollback()
            if isinstance(exc, options.non_retryable):
                self.write(call, FAIL, {"sg_text": text}, "failed")
            else:
                self.write(call, RELEASE, {"sg_text": text}, "released")
        except LeaseLost:
            exc.add_note(
                f"stateguard: the lease on {self._what} had been taken over; the new owner's record was "
                f"left untouched"
            )
        except Exception:
            # The database is unreachable: the claim stays in progress and the
            # next retry takes it over once the lease ends.
            log.warning(
                "could not release idempotency key %r in scope %r; it is taken over when its lease ends",
                self.key,
                self.scope,
                exc_info=True,
            )
