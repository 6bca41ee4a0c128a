"""Insert-once: let a unique key decide the first insert (``docs/explanation/schemes.md``);
:func:`consume_once`, the same scheme on stateguard's consumed-messages table.

One statement through the kernel's :class:`~stateguard._write.InsertOnce`:
``INSERT ... ON CONFLICT DO NOTHING RETURNING pk`` on PostgreSQL and SQLite,
a plain INSERT whose duplicate-key error (1062) InnoDB rolls back alone on
MySQL/MariaDB.  Either way the surrounding transaction stays usable, with no
SAVEPOINT round trips.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Final

from sqlalchemy import Connection, Engine, bindparam
from sqlalchemy.orm import Session

from . import _sql, _write
from ._async import dual, dual_bind
from .exceptions import InvalidArgument
from .result import Outcome, Result
from .tables import MAX_KEY, MAX_SCOPE, consumed_messages

__all__ = ["ConsumedMessage", "consume_once", "insert_once", "purge_consumed"]


@dual
def insert_once(session: Session, model: type[Any], values: Mapping[str, Any]) -> Result:
    """Insert a row unless a row with the same unique key exists.

    APPLIED (``.key`` is the new primary key) when this call inserted it,
    REPEATED when a unique constraint already held that key; the session's
    transaction stays usable in both cases::

        r = insert_once(session, ProcessedMessage, {"message_id": msg.id})
        if r.applied:
            handle(msg)             # once per message, however often redelivered
    """
    if not isinstance(values, Mapping) or not values:
        raise InvalidArgument("insert_once needs a non-empty mapping of attribute names to values")
    info = _sql.model_info(model)
    items: list[tuple[str, Any, Any]] = []
    for attr in sorted(values):
        if not isinstance(attr, str):
            raise InvalidArgument(f"values keys must be attribute names (str), got {attr!r}")
        items.append((attr, info.column(attr, role="a values entry"), values[attr]))
    frozen = tuple(items)
    has_sql = any(isinstance(v, _sql.ClauseElement) for _, _, v in frozen)
    conn = _write.connection_for(session, info, (), _write.value_integers(frozen))
    variant = _sql.variant_key(frozen, has_sql)
    cache_key = ("insert_once", info, variant)
    insert = _write.memo.get(cache_key) if variant is not None else None
    if insert is None:
        insert = _write.InsertOnce(info.table, dict(_sql.set_clause(frozen, embed=False)), info.pk_columns)
        if variant is not None:
            _write.memo.put(cache_key, insert)
    given_key = tuple(values.get(info.attr_by_column[c]) for c in info.pk_columns)
    known_key = None if any(k is None for k in given_key) else _sql.public_key(given_key)
    inserted = insert(conn, _sql.value_params(frozen))
    if inserted is None:
        return Result(Outcome.REPEATED, model=model, key=known_key, session=session, same_request=True)
    key = _sql.public_key(inserted) if inserted and None not in inserted else known_key
    return Result(Outcome.APPLIED, model=model, key=key, session=session)


# --------------------------------------------------------------------------
# Message consumers
# --------------------------------------------------------------------------


class ConsumedMessage:
    """The ``model`` of every :func:`consume_once` result; its ``key`` is ``(consumer, message_id)``."""


_CONSUME_ROW: Final[dict[str, Any]] = {
    "consumer": bindparam("sg_consumer"),
    "message_id": bindparam("sg_message"),
    # The database's clock, as purge_consumed() judges ages on it.
    "consumed_ms": _sql.db_now_ms(),
}
_CONSUME: Final = _write.InsertOnce(consumed_messages, _CONSUME_ROW, returning=[consumed_messages.c.consumer])


@dual
def consume_once(session: Session, consumer: str, message_id: str) -> Result:
    """Record that ``consumer`` handled ``message_id``: APPLIED the first time, REPEATED after.

    One INSERT in the session's transaction (a unique key decides), so the
    record commits or rolls back with the handler's own writes: a message
    whose handling failed is handled again on redelivery::

        with Session(engine) as session, session.begin():
            if consume_once(session, "billing", message.id).applied:
                handle(session, message)

    :raises InvalidArgument: blank, oversize or non-str ``consumer`` or
        ``message_id``; nothing was written.
    """
    _write.check_text(consumer, "consumer", MAX_SCOPE)
    _write.check_text(message_id, "message_id", MAX_KEY)
    if session.autoflush:
        session.flush()
    conn = _write.own_connection(session, consumed_messages)
    params = {"sg_consumer": consumer, "sg_message": message_id}
    inserted = _CONSUME(conn, params) is not None
    return Result(
        Outcome.APPLIED if inserted else Outcome.REPEATED,
        model=ConsumedMessage,
        key=(consumer, message_id),
        trigger="consume",
        session=session,
        same_request=not inserted,
    )


_c = consumed_messages


@dual_bind
def purge_consumed(bind: Engine | Connection | Session, *, older_than: timedelta, batch: int = 1000) -> int:
    """Delete at most ``batch`` records of messages consumed more than ``older_than`` ago; return how many.

    :func:`consume_once` keeps one row per message for good; purge them once
    no redelivery can come any more: a message redelivered after its record
    was purged is handled again.  So ``older_than`` must exceed the longest
    your broker may redeliver (its retention, or your consumers' replay
    window).  Ages are judged on the database's clock.  With an Engine the
    batch runs in its own short transaction; with a Connection or Session in
    the caller's.  Loop until it returns less than ``batch`` (``stateguard
    purge --consumed-retention`` does)::

        while purge_consumed(engine, older_than=timedelta(days=30)) == 1000:
            pass

    :raises InvalidArgument: ``older_than`` is not a positive timedelta or
        ``batch`` not a positive int; nothing was deleted.
    """
    old = _c.c.consumed_ms <= _sql.db_now_ms() - bindparam("sg_older")
    return _write.purge_rows(_c, bind, batch, old, sg_older=_write.duration_ms(older_than, "older_than"))
