"""What stateguard hooks into SQLAlchemy, and where: per engine and per session, never on a class.

An engine stateguard never wrote through, and a session it never scheduled a
callback on, pay nothing: no listener exists on the ``Engine``, ``Connection``
or ``Session`` classes that every application object shares.

- :func:`hook_dialect`: one dialect-level statement hook (``do_execute`` and
  its two siblings), registered on an engine's dialect the first time
  stateguard needs it there (the savepoint journal of
  :mod:`~stateguard._kernel.instances` says which hook and when).  A dialect
  hook, not a Connection event: any Connection-level listener makes
  SQLAlchemy build a joined event dispatcher for every new Connection of the
  engine (about a third more Python calls for a one-statement transaction);
  the dialect's dispatch is built once.
- :func:`schedule`: callbacks run after the outermost commit of a Session,
  never after a rollback, through ``after_commit`` and
  ``after_transaction_end`` listeners registered on that session the first
  time one is scheduled (``AsyncSession.sync_session`` for an async one).
- :func:`watch_commit`: the same two listeners check the COMMIT of a
  transaction that asked for a replicated commit
  (:mod:`~stateguard._kernel.durability`).  When the standby did not confirm
  it, the session's commit raises :class:`~stateguard.ReplicationTimeout`
  once the transaction is closed (the session is usable), and the
  ``on_commit`` callbacks of that transaction are *not* run: they are handed
  to the error (``error.callbacks``, each callable with no arguments), for
  the caller to run once it has decided the write is safe to act on.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy import Engine, event
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Session, SessionTransaction

if TYPE_CHECKING:
    from ..exceptions import ReplicationTimeout
    from .durability import CommitWatch

__all__ = ["HOOKED", "hook_dialect", "hooked", "pending", "schedule", "watch_commit"]

log = logging.getLogger("stateguard")

# --------------------------------------------------------------------------
# The statement hook, registered per engine on first use
# --------------------------------------------------------------------------

#: The dialects (one per engine) stateguard's statement hook is registered on.
HOOKED: Final[weakref.WeakSet[Any]] = weakref.WeakSet()
_HOOK_LOCK: Final = threading.Lock()


def hook_dialect(
    dialect: Dialect,
    on_execute: Callable[[Any, str, Any, Any], bool],
    on_execute_no_params: Callable[[Any, str, Any], bool],
) -> None:
    """Register the statement hook on ``dialect`` (once: later calls return at once)."""
    if dialect in HOOKED:
        return
    with _HOOK_LOCK:
        if dialect in HOOKED:
            return
        event.listen(dialect, "do_execute", on_execute)
        event.listen(dialect, "do_executemany", on_execute)
        event.listen(dialect, "do_execute_no_params", on_execute_no_params)
        HOOKED.add(dialect)


def hooked(engine: Engine) -> bool:
    """Whether stateguard's statement hook is registered on ``engine`` (for tests)."""
    return engine.dialect in HOOKED


# --------------------------------------------------------------------------
# After-commit callbacks, per session
# --------------------------------------------------------------------------
#
# Each callback is owned by the session transaction that was current when it
# was scheduled (the innermost savepoint, or the root).  When a savepoint
# commits, its callbacks move to the enclosing transaction; when any
# transaction ends without committing (rollback, close), the callbacks it owns,
# or that its inner savepoints own, are dropped.  When the root commits, the
# remaining callbacks run in the order they were scheduled, once the root
# transaction is closed: its connection is back in the pool and the session is
# usable, so a failing callback cannot leave the session half-committed.
#
# SQLAlchemy dispatches ``after_commit`` both for the root and for a released
# savepoint (``SessionTransaction.commit``), and ``after_transaction_end`` for
# every transaction that closes, committed or not; those two events are all we
# need.

_ATTR = "_stateguard_on_commit"
_WATCHES = "_stateguard_commit_watches"
_HOOKED = "_stateguard_session_hooked"

_Entry = list[Any]  # [owner transaction, fn, args, kwargs]


def schedule(
    session: Session, fn: Callable[..., object], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    owner = session.get_nested_transaction() or session.get_transaction()
    if owner is None:  # pragma: no cover - a guarded write always runs in a transaction
        raise RuntimeError("on_commit() needs a session inside a transaction")
    entries: list[_Entry] | None = session.__dict__.get(_ATTR)
    if entries is None:
        entries = session.__dict__[_ATTR] = []
        _hook_session(session)
    entries.append([owner, fn, args, kwargs])


def _hook_session(session: Session) -> None:
    if _HOOKED not in session.__dict__:
        session.__dict__[_HOOKED] = True
        event.listen(session, "after_commit", _after_commit)
        event.listen(session, "after_transaction_end", _after_transaction_end)


def watch_commit(session: Session, watch: CommitWatch) -> None:
    """Check the COMMIT of ``session``'s current root transaction with ``watch`` (durability)."""
    watches: list[Any] | None = session.__dict__.get(_WATCHES)
    if watches is None:
        watches = session.__dict__[_WATCHES] = []
        _hook_session(session)
    if watch not in watches:
        watches.append(watch)


def _within(owner: Any, ancestor: SessionTransaction) -> bool:
    while isinstance(owner, SessionTransaction):
        if owner is ancestor:
            return True
        owner = owner.parent
    return False


_COMMITTED = object()  # owner marker: the root committed, run after it closes


def _after_commit(session: Session) -> None:
    # The committing transaction has not been closed yet, so it is still the
    # session's current (nested) transaction.
    watches: list[Any] | None = session.__dict__.get(_WATCHES)
    released = session.get_nested_transaction()
    if watches and released is not None:
        for watch in watches:
            watch.released(released)
    elif watches:
        # The root's COMMIT returned: no cancel request may go out any more.
        for watch in watches:
            watch.stop()
        session.__dict__[_WATCHES] = [(watch, True) for watch in watches]
    entries: list[_Entry] | None = session.__dict__.get(_ATTR)
    if not entries:
        return
    nested = session.get_nested_transaction()
    target: Any = nested.parent if nested is not None else _COMMITTED
    for entry in entries:
        if nested is None or entry[0] is nested:
            entry[0] = target


def _after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    unconfirmed: ReplicationTimeout | None = None
    if transaction.parent is not None:
        for watch in session.__dict__.get(_WATCHES) or ():
            watch.ended(transaction)
    else:
        watches: list[Any] | None = session.__dict__.get(_WATCHES)
        if watches:
            session.__dict__[_WATCHES] = []
            for item in watches:
                # (watch, True) after the root's commit; a bare watch after a rollback or close.
                watch, committed = item if type(item) is tuple else (item, False)
                error = watch.finish(committed)
                if unconfirmed is None:
                    unconfirmed = error
    entries: list[_Entry] | None = session.__dict__.get(_ATTR)
    if not entries:
        if unconfirmed is not None:
            raise unconfirmed
        return
    if transaction.parent is not None:
        entries[:] = [e for e in entries if not _within(e[0], transaction)]
        return
    # The root transaction is closed (connections released, session usable):
    # run what its commit made ready, drop the rest (rollback or close).  The
    # listeners stay on the session (removing them costs more than an empty call).
    session.__dict__[_ATTR] = []
    if unconfirmed is not None:
        # Committed on the primary only: the caller decides whether to act on it.
        unconfirmed.callbacks = tuple(
            functools.partial(fn, *args, **kwargs)
            for owner, fn, args, kwargs in entries
            if owner is _COMMITTED
        )
        raise unconfirmed
    errors: list[BaseException] = []
    for owner, fn, args, kwargs in entries:
        if owner is not _COMMITTED:
            continue
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # run every callback even if one fails
            log.exception("stateguard: after-commit callback %r failed", fn)
            errors.append(exc)
    if errors:
        # The transaction is committed; the first failure is re-raised so that
        # it is not silently lost (the others were logged).
        raise errors[0]


def pending(session: Session) -> int:
    """How many callbacks wait for a commit of ``session`` (for tests)."""
    return len(session.__dict__.get(_ATTR) or ())
