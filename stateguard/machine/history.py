"""An exact transition history, written in the same transaction as each transition.

Enabled per machine with ``StateMachine(..., history=True)``.  Every APPLIED
transition inserts one row into ``stateguard_transition_log``; REPEATED,
REJECTED and NOT_FOUND write nothing.  The source state logged is the row's
real previous state: for a trigger with a single source it is that source
(the UPDATE only matched rows in it); for a trigger with several sources the
row is first read with a locking read (``FOR UPDATE`` on PostgreSQL and
MariaDB; SQLite has one writer at a time), so the UPDATE that follows cannot
see anything else.

With a ``request_id``, the log's unique index on (model, machine, key,
trigger, request_id) makes repeat detection exact even after the row moved
on: a retried ``pay`` that arrives after the order was shipped finds its own
log row and reports REPEATED, while a ``pay`` with another request id is
REJECTED.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from sqlalchemy import (
    Connection,
    Row,
    and_,
    bindparam,
    insert,
    select,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from .. import _kernel
from ..exceptions import InvalidArgument, SerializationConflict
from ..tables import MAX_REQUEST_ID, row_key, transition_log

if TYPE_CHECKING:
    from .declaration import StateMachine
    from .trigger import Trigger

__all__ = [
    "MAX_META_BYTES",
    "HistoryEntry",
    "applied_by_request",
    "check_request",
    "entries",
    "meta_of",
    "record",
]


class HistoryEntry(NamedTuple):
    """One logged transition, as returned by :meth:`StateMachine.history`."""

    trigger: str
    source: Any
    dest: Any
    at: datetime.datetime
    request_id: str | None
    metadata: Any
    version: int | None


#: Largest ``metadata`` (JSON, UTF-8 bytes) one log row takes: well under MariaDB's default packet limit.
MAX_META_BYTES = 1 << 20
#: Deepest nesting of ``metadata`` (objects and lists), on every backend: MariaDB's JSON columns
#: (``CHECK (JSON_VALID(meta))``) refuse a document of more than 32 levels, a scalar in the innermost
#: container counting as one (JSON_DEPTH), and refused it only after the transition's UPDATE ran.
MAX_META_DEPTH = 31


def check_request(request_id: Any, meta: Any) -> None:
    """Raise InvalidArgument unless ``request_id`` fits the log and ``meta`` is JSON-serialisable."""
    if request_id is not None and (
        not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID
    ):
        raise InvalidArgument(
            f"request_id must be a non-empty string of at most {MAX_REQUEST_ID} characters, "
            f"got {request_id!r}"
        )
    if request_id is not None:
        _kernel.check_storable(request_id, "request_id")
    if meta is not None and not isinstance(meta, Mapping):
        raise InvalidArgument(f"metadata must be a mapping (a dict) or None, got {type(meta).__name__}")
    if meta is not None:
        # The rules of an outbox payload, which carries it too (events=True): checked before
        # the UPDATE, as PostgreSQL's json and MariaDB's JSON_VALID refuse NaN only after it.
        size = len(_kernel.json_text(meta, "metadata", MAX_META_DEPTH).encode("utf-8"))
        if size > MAX_META_BYTES:
            raise InvalidArgument(
                f"metadata is {size} bytes as JSON; the transition log takes at most {MAX_META_BYTES}"
            )


_lookup = (
    select(transition_log.c.dest, transition_log.c.version)
    .where(
        transition_log.c.model == bindparam("sg_model"),
        transition_log.c.machine == bindparam("sg_machine"),
        transition_log.c.row_key == bindparam("sg_row_key"),
        transition_log.c.trigger == bindparam("sg_trigger"),
        transition_log.c.request_id == bindparam("sg_request_id"),
    )
    .limit(1)
)


def applied_by_request(
    conn: Connection, machine: StateMachine[Any], trigger: str, key: tuple[Any, ...], request_id: str
) -> Row[*tuple[Any, ...]] | None:
    """The logged row (dest, version) if ``request_id`` already applied ``trigger`` to ``key``."""
    return _kernel.execute(
        conn,
        _lookup,
        {
            "sg_model": machine.info.table.fullname,
            "sg_machine": machine.name,
            "sg_row_key": row_key(_kernel.canonical_key(machine.info, key)),
            "sg_trigger": trigger,
            "sg_request_id": request_id,
        },
    ).first()


def record(
    conn: Connection,
    trigger: Trigger,
    entries: Sequence[tuple[tuple[Any, ...], Any, Any, int | None]],
    request_id: str | None,
    meta: Any,
) -> None:
    """Insert log rows ``(key, source, dest, version)``: one (multi-row) INSERT, more when the rows
    outgrow one statement (:func:`stateguard._kernel.insert_rows`)."""
    if not entries:
        return
    m = trigger.machine
    model = m.info.table.fullname
    name = m.codec.name
    rows = [
        {
            "model": model,
            "machine": m.name,
            "row_key": row_key(_kernel.canonical_key(m.info, key)),
            "trigger": trigger.name,
            "source": name(source),
            "dest": name(dest),
            "version": version,
            "request_id": request_id,
            "meta": meta,
        }
        for key, source, dest, version in entries
    ]
    try:
        if len(rows) == 1:
            _kernel.execute(conn, insert(transition_log), rows[0])
        else:
            meta_bytes = 0 if meta is None else len(_kernel.dumps_json(meta).encode("utf-8"))
            _kernel.insert_rows(conn, transition_log, rows, meta_bytes)
    except sa_exc.IntegrityError as error:
        # Two calls with the same request id raced after the row came back to a
        # source state: the unique index refused the second.  A retry of the
        # unit of work finds the first one's log row and reports REPEATED.
        raise SerializationConflict(
            f"{trigger!r}: request {request_id!r} was applied concurrently by another call; "
            f"roll back and retry (retry_on_conflict() does this)"
        ) from error


def entries(session: Session, machine: StateMachine[Any], target: Any) -> list[HistoryEntry]:
    """The logged transitions of ``target``, oldest first."""
    info = machine.info
    key, _ = _kernel.resolve_target(session, info, target)
    log = transition_log
    stmt = (
        select(log.c.trigger, log.c.source, log.c.dest, log.c.at, log.c.request_id, log.c.meta, log.c.version)
        .where(
            and_(
                log.c.model == info.table.fullname,
                log.c.machine == machine.name,
                log.c.row_key == row_key(_kernel.canonical_key(info, key)),
            )
        )
        .order_by(log.c.id)
    )
    conn = session.connection(bind_arguments=info.bind_arguments)
    named = machine.codec.named
    return [
        HistoryEntry(
            r.trigger,
            named(r.source),
            named(r.dest),
            r.at,
            r.request_id,
            r.meta,
            r.version,
        )
        for r in _kernel.execute(conn, stmt)
    ]


def meta_of(value: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``metadata`` as the log stores it (a plain dict, or ``None``)."""
    return None if value is None else dict(value)
