"""Run callbacks after the outermost commit of a Session, never after a rollback.

Each callback is owned by the session transaction that was current when it
was scheduled (the innermost savepoint, or the root).  When a savepoint
commits, its callbacks move to the enclosing transaction; when any
transaction ends without committing (rollback, close), the callbacks it owns,
or that its inner savepoints own, are dropped.  When the root commits, the
remaining callbacks run in the order they were scheduled, once the root
transaction is closed: its connection is back in the pool and the session is
usable, so a failing callback cannot leave the session half-committed.

SQLAlchemy dispatches ``after_commit`` both for the root and for a released
savepoint (``SessionTransaction.commit``), and ``after_transaction_end`` for
every transaction that closes, committed or not; those two events are all we
need.  They are registered on a session the first time a callback is
scheduled on it (``AsyncSession.sync_session`` for an async one), never on
the ``Session`` class: a session that never scheduled one pays nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session, SessionTransaction

log = logging.getLogger("stateguard")

_ATTR = "_stateguard_on_commit"

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
        event.listen(session, "after_commit", _after_commit)
        event.listen(session, "after_transaction_end", _after_transaction_end)
    entries.append([owner, fn, args, kwargs])


def _within(owner: Any, ancestor: SessionTransaction) -> bool:
    while isinstance(owner, SessionTransaction):
        if owner is ancestor:
            return True
        owner = owner.parent
    return False


_COMMITTED = object()  # owner marker: the root committed, run after it closes


def _after_commit(session: Session) -> None:
    entries: list[_Entry] | None = session.__dict__.get(_ATTR)
    if not entries:
        return
    # The committing transaction has not been closed yet, so it is still the
    # session's current (nested) transaction.
    nested = session.get_nested_transaction()
    target: Any = nested.parent if nested is not None else _COMMITTED
    for entry in entries:
        if nested is None or entry[0] is nested:
            entry[0] = target


def _after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    entries: list[_Entry] | None = session.__dict__.get(_ATTR)
    if not entries:
        return
    if transaction.parent is not None:
        entries[:] = [e for e in entries if not _within(e[0], transaction)]
        return
    # The root transaction is closed (connections released, session usable):
    # run what its commit made ready, drop the rest (rollback or close).  The
    # listeners stay on the session (removing them costs more than an empty call).
    session.__dict__[_ATTR] = []
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
