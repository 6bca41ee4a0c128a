"""Every statement on ``stateguard_idempotency_keys``, built once when the package is imported.

The claim (an INSERT that reports a taken key, on PostgreSQL returning the
record that holds it), the read of a record, the reclaim of an expired one,
the takeover of a dead or released claim, and the owner-conditional writes
of an open call (complete, checkpoint, heartbeat, release, fail, forget).
Each is one conditional statement, so the database settles every race; every
lease and expiry in them is computed on the database's clock.  Statements
run on every call are frozen (:func:`stateguard._kernel.frozen`): their SQL
cache key is computed once, not at every execution.
"""

from __future__ import annotations

from typing import Any, Final, NamedTuple

from sqlalchemy import (
    Delete,
    Integer,
    Select,
    String,
    Update,
    and_,
    bindparam,
    column,
    delete,
    literal_column,
    null,
    select,
    update,
)
from sqlalchemy.sql.lambdas import StatementLambdaElement

from .. import _kernel
from ..tables import idempotency_keys

__all__ = [
    "CHECKPOINT",
    "CLAIM",
    "COMPLETE",
    "COMPLETED",
    "COMPLETE_FRESH",
    "FAIL",
    "FAILED",
    "FORGET",
    "HEARTBEAT",
    "IN_PROGRESS",
    "READ",
    "READ_LOCKING",
    "RECLAIM",
    "RELEASE",
    "TAKEOVER",
    "UNCLAIM",
    "Record",
]

IN_PROGRESS: Final = "in_progress"
COMPLETED: Final = "completed"
FAILED: Final = "failed"
# The same constants as SQL literals in the statements: a bound parameter is converted
# and sent at every execution, a literal is part of the (prepared) statement.
_IN_PROGRESS_SQL: Final = literal_column(f"'{IN_PROGRESS}'", String)
_COMPLETED_SQL: Final = literal_column(f"'{COMPLETED}'", String)
_FAILED_SQL: Final = literal_column(f"'{FAILED}'", String)

_columns: Final = idempotency_keys.c
# Every lease and expiry is judged and stored on the database's clock, inside
# the deciding statement: an application server whose clock runs ahead must
# not take over live claims (nor one running behind keep dead ones).
_NOW: Final = _kernel.db_now_ms()
_LEASE_END: Final = _NOW + bindparam("sg_lease")
_EXPIRY: Final = _NOW + bindparam("sg_ttl")
# The statements below touch one table: their conditions name its columns unqualified
# (``scope``, not ``stateguard_idempotency_keys.scope``), which SQLAlchemy renders as they are;
# with a ``schema_translate_map``, every qualified name is one more substitution in the SQL text
# at every execution.
_scope, _idem_key, _owner, _status = (
    column(c.name, c.type) for c in (_columns.scope, _columns.idem_key, _columns.owner, _columns.status)
)
_THIS_KEY: Final = (_scope == bindparam("sg_scope"), _idem_key == bindparam("sg_key"))
_MINE: Final = (*_THIS_KEY, _owner == bindparam("sg_owner"), _status == _IN_PROGRESS_SQL)
_FRESH: Final[dict[str, Any]] = {
    "status": _IN_PROGRESS_SQL,
    "fingerprint": bindparam("sg_fp"),
    "owner": bindparam("sg_owner"),
    "attempt": literal_column("1", Integer),
    "locked_until_ms": _LEASE_END,
    "expires_ms": _EXPIRY,
    "created_ms": _NOW,
    "updated_ms": _NOW,
}
_NEW_ROW: Final = {"scope": bindparam("sg_scope"), "idem_key": bindparam("sg_key"), **_FRESH}
#: What a claim that finds the key taken reads of the record (and the database's clock).
_RECORD: Final = (
    _columns.status,
    _columns.fingerprint,
    _columns.owner,
    _columns.attempt,
    _columns.locked_until_ms,
    _columns.expires_ms,
    _columns.response,
    _columns.checkpoint_name,
    _columns.checkpoint_data,
    _columns.error,
    _NOW.label("db_now"),
)


class Record(NamedTuple):
    """The record as the claim's statement hands it back on PostgreSQL (``_RECORD``'s values, in order)."""

    status: str
    fingerprint: str | None
    owner: str
    attempt: int
    locked_until_ms: int | None
    expires_ms: int
    response: str | None
    checkpoint_name: str | None
    checkpoint_data: str | None
    error: str | None
    db_now: int


#: One statement on PostgreSQL: the claim, or the record that holds the key (the kernel's CTE form).
CLAIM: Final = _kernel.InsertOnce(
    idempotency_keys,
    _NEW_ROW,
    returning=[_columns.scope],
    read=_RECORD,
    where=and_(_columns.scope == bindparam("sg_scope"), _columns.idem_key == bindparam("sg_key")),
)
#: The record of the key, with the database's clock.
READ: Final[Select[Any]] = select(*_RECORD).where(*_THIS_KEY)
#: InnoDB at REPEATABLE READ: a plain SELECT reads the transaction's snapshot,
#: which may predate the twin whose row made our INSERT fail; a locking read
#: sees the latest committed row.  A shared lock, because the failed INSERT
#: already holds one on that index record: twins that each upgraded to an
#: exclusive lock would deadlock.
READ_LOCKING: Final[Select[Any]] = READ.with_for_update(read=True)
#: An expired record is a brand-new request: everything is reset.
RECLAIM: Final[Update] = (
    update(idempotency_keys)
    .where(*_THIS_KEY, _columns.owner == bindparam("sg_old_owner"), _columns.expires_ms <= _NOW)
    .values({**_FRESH, "response": None, "checkpoint_name": None, "checkpoint_data": None, "error": None})
)
#: A dead or released claim is resumed: attempt + 1, checkpoint kept.
TAKEOVER: Final[Update] = (
    update(idempotency_keys)
    .where(
        *_THIS_KEY,
        _columns.owner == bindparam("sg_old_owner"),
        _columns.status == _IN_PROGRESS_SQL,
        _columns.locked_until_ms <= _NOW,
        _columns.expires_ms > _NOW,
    )
    .values(
        owner=bindparam("sg_owner"),
        attempt=_columns.attempt + 1,
        locked_until_ms=_LEASE_END,
        updated_ms=_NOW,
    )
)


def _owned_update(**values: Any) -> StatementLambdaElement:
    """``UPDATE ... SET values, updated_ms = db_now WHERE key AND owner = :me AND status = 'in_progress'``."""
    return _kernel.frozen(update(idempotency_keys).where(*_MINE).values(updated_ms=_NOW, **values))


#: The response is stored, and the key kept ttl from now.
COMPLETE: Final = _owned_update(
    status=_COMPLETED_SQL, response=bindparam("sg_text"), locked_until_ms=null(), expires_ms=_EXPIRY
)
#: Same transaction, a record this call inserted: its expiry (the claim's time plus ttl) is kept, so
#: no indexed column changes (expires_ms is indexed, for purging) and PostgreSQL can update the row
#: in place (a HOT update: no new index entries, less WAL).  The claim and its completion commit
#: together, so the key is kept ttl from the claim rather than from the completion: the block's
#: duration less.
COMPLETE_FRESH: Final = _owned_update(
    status=_COMPLETED_SQL, response=bindparam("sg_text"), locked_until_ms=null()
)
#: Failed for good (a non-retryable exception): retries get RequestFailed until the key expires.
FAIL: Final = _owned_update(
    status=_FAILED_SQL, error=bindparam("sg_text"), locked_until_ms=null(), expires_ms=_EXPIRY
)
#: Released: still in progress, with a lease that ended now, so the next
#: caller takes it over at once and reads the checkpoint.
RELEASE: Final = _owned_update(locked_until_ms=0, error=bindparam("sg_text"))
#: Forgotten: this owner's record is gone, so any request may claim the key anew.
FORGET: Final[Delete] = delete(idempotency_keys).where(*_MINE)
#: Same transaction, a new record claimed outside the block's savepoint: undone (completed or not).
UNCLAIM: Final[Delete] = delete(idempotency_keys).where(*_THIS_KEY, _columns.owner == bindparam("sg_owner"))
#: Not a released claim (locked_until_ms = 0): a heartbeat racing its own
#: release() must not lease the key again, or the next retry waits a whole lease.
HEARTBEAT: Final[Update] = (
    update(idempotency_keys)
    .where(*_MINE, _columns.locked_until_ms > 0)
    .values(updated_ms=_NOW, locked_until_ms=_LEASE_END, expires_ms=_EXPIRY)
)
#: A recovery point: its name and data, and the lease extended.
CHECKPOINT: Final = _owned_update(
    checkpoint_name=bindparam("sg_name"),
    checkpoint_data=bindparam("sg_text"),
    locked_until_ms=_LEASE_END,
    expires_ms=_EXPIRY,
)
