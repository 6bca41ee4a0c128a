"""Events of APPLIED transitions, written to the transactional outbox in the transaction that applies them.

Enabled per machine with ``StateMachine(..., events=True)`` (topic
``"<table name>.<trigger>"``) or per transition with ``"event": "order.paid"``.
Every APPLIED transition inserts one row into ``stateguard_outbox``; other
outcomes write nothing, and a rollback discards the event with the
transition.  The payload is JSON text::

    {"model": "Order", "key": 42, "trigger": "pay", "source": "pending", "dest": "paid",
     "version": 2, "request_id": "req-7f3a" or None, "metadata": {...} or None}

the same text whichever path wrote it (Python writes the parts it knows, SQL
the version and, for a trigger with several sources or destinations, the
state names).  The event's key is the row's table and key as text
(:func:`event_key`: ``"orders:42"``), so one row's events are published in
order.  On PostgreSQL the UPDATE and the INSERT are one statement, a
data-modifying CTE built once per trigger and call variant (a trigger with
several sources joins the row read ``FOR UPDATE`` to learn its real source);
other databases run the UPDATE, then the INSERT.  ``many()`` and ``where()``
insert a chunk's events with one multi-row INSERT.  The statements are shown
in ``docs/how-to/outbox.md``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy import Connection, Text, and_, bindparam, case, cast, func, insert, literal, select, true

from .. import _sql, _write
from ..exceptions import ConfigurationError
from ..tables import DIGEST_PREFIX, MAX_KEY, outbox, row_key
from . import compile

if TYPE_CHECKING:
    from .declaration import StateMachine
    from .trigger import Trigger

__all__ = [
    "FIELDS",
    "MAX_TOPIC",
    "CtePlan",
    "check_topic",
    "cte_params",
    "cte_plan",
    "json_key",
    "payload",
    "pieces",
    "record",
    "topic_for",
]

#: Longest topic the outbox takes.
MAX_TOPIC: Final = int(getattr(outbox.c.topic.type, "length", None) or 200)


def check_topic(topic: Any, what: str) -> str:
    """Raise ConfigurationError unless ``topic`` is a non-empty str the outbox can store."""
    if not isinstance(topic, str) or not topic.strip():
        raise ConfigurationError(f"{what} must be a non-empty string (the event's topic), got {topic!r}")
    if len(topic) > MAX_TOPIC:
        raise ConfigurationError(
            f"{what} is {len(topic)} characters; the outbox takes topics of at most {MAX_TOPIC}"
        )
    try:
        topic.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigurationError(f"{what} contains a lone surrogate, which no database stores") from None
    return topic


def topic_for(machine: StateMachine[Any], trigger: Trigger, table_name: str) -> str | None:
    """The topic ``trigger`` writes its events under, or ``None`` when it writes none."""
    named = trigger.edges[0].event
    if named is not None:
        return named
    if not machine.events_enabled:
        return None
    return check_topic(
        f"{table_name}.{trigger.name}", f"{machine.qualname}: the default topic of {trigger.name!r}"
    )


def json_key(info: _sql.ModelInfo, key: tuple[Any, ...]) -> Any:
    """The primary key as JSON-able data, spelled like :func:`~stateguard.tables.row_key`."""
    canonical = _sql.canonical_key(info, key)
    value: Any = canonical[0] if len(canonical) == 1 else list(canonical)
    if all(type(part) in (int, str) for part in canonical):
        return value
    return json.loads(json.dumps(value, default=str))


#: The payload's fields, in the order its JSON text lists them.
FIELDS: Final = ("model", "key", "trigger", "source", "dest", "version", "request_id", "metadata")


#: The outbox's JSON text, written the same way whichever path writes an event.
_dumps = _write.dumps_json


def payload(
    trigger: Trigger,
    key: tuple[Any, ...],
    source: Any,
    dest: Any,
    version: int | None,
    request_id: str | None,
    meta: Any,
) -> dict[str, Any]:
    """The payload of one event (``source``/``dest`` are states, or ``None`` when SQL fills them)."""
    m = trigger.machine
    name = m.codec.name
    return {
        "model": m.info.model.__name__,
        "key": json_key(m.info, key),
        "trigger": trigger.name,
        "source": None if source is None else name(source),
        "dest": None if dest is None else name(dest),
        "version": version,
        "request_id": request_id,
        "metadata": meta,
    }


def pieces(values: dict[str, Any], holes: Sequence[str]) -> list[str]:
    """The payload's JSON text cut around ``holes`` (fields SQL fills in), in :data:`FIELDS` order.

    Joined with the holes' JSON, the pieces are exactly ``json.dumps`` of the
    payload as :func:`record` writes it.
    """
    out: list[str] = []
    current = "{"
    for i, field in enumerate(FIELDS):
        current += ("," if i else "") + _dumps(field) + ":"
        if field in holes:
            out.append(current)
            current = ""
        else:
            current += _dumps(values[field])
    out.append(current + "}")
    return out


def event_key(info: _sql.ModelInfo, key: tuple[Any, ...]) -> str:
    """The outbox key of a row's events: ``"<table>:<row key>"``; a row key too long for the
    outbox's key column beside the table name is replaced by its SHA-256."""
    stored = row_key(_sql.canonical_key(info, key))
    table = info.table.fullname
    found = f"{table}:{stored}"
    if len(found) > MAX_KEY:
        digest = hashlib.sha256(stored.encode("utf-8", "surrogatepass")).hexdigest()
        found = f"{table}:{DIGEST_PREFIX}{digest}"
    return found


def record(
    conn: Connection,
    trigger: Trigger,
    entries: Sequence[tuple[tuple[Any, ...], Any, Any, int | None]],
    request_id: str | None,
    meta: Any,
) -> None:
    """Insert the events of ``(key, source, dest, version)``: one (multi-row) INSERT, more when the
    rows outgrow one statement (:func:`stateguard._write.insert_rows`)."""
    if not entries:
        return
    info = trigger.machine.info
    payloads = [
        _dumps(payload(trigger, key, source, dest, version, request_id, meta))
        for key, source, dest, version in entries
    ]
    rows = [
        {
            "topic": trigger.topic,
            "key": event_key(info, entry[0]),
            "payload": text,
            "created_ms": _sql.db_now_ms(),
            "attempts": 0,
        }
        for entry, text in zip(entries, payloads, strict=True)
    ]
    _write.insert_rows(conn, outbox, rows, max(len(p.encode("utf-8")) for p in payloads))


class CtePlan:
    """The one-statement UPDATE + event INSERT of a trigger (PostgreSQL).

    Its row is ``([version], [new state], [old state])``: the version when
    the model has a version column, the new state when the trigger has
    several destinations, the old state when it has several sources.
    """

    __slots__ = ("returns_source", "returns_state", "stmt")

    def __init__(self, stmt: Any, returns_state: bool, returns_source: bool) -> None:
        self.stmt = stmt
        self.returns_state = returns_state
        self.returns_source = returns_source


def _names(machine: StateMachine[Any], column: Any, states: Sequence[Any]) -> Any:
    """SQL turning a database state value of ``column`` into its name as JSON text."""
    codec = machine.codec
    return case(*((column == codec.to_db(s), literal(_dumps(codec.name(s)))) for s in states), else_="null")


#: The SQL-filled fields of a CtePlan, by what the plan returns.
def _holes(trigger: Trigger) -> tuple[str, ...]:
    holes = []
    if len(trigger.sources) > 1:
        holes.append("source")
    if len(trigger.dests) > 1:
        holes.append("dest")
    if trigger.machine.info.version_column is not None:
        holes.append("version")
    return tuple(holes)


def _build(trigger: Trigger, items: compile.Items, expected: bool, fence: bool) -> CtePlan:
    m = trigger.machine
    info = m.info
    base = compile.build(trigger, None, items, expected, embed=False, fence=fence).stmt
    returning: list[Any] = []
    filled: dict[str, Any] = {}
    vcol = info.version_column
    if vcol is not None:
        returning.append(vcol.label("sg_version"))
    returns_state = len(trigger.dests) > 1
    if returns_state:
        returning.append(m.state_column.label("sg_state"))
    returns_source = len(trigger.sources) > 1
    if returns_source:
        # PostgreSQL's RETURNING sees only new values: join the row locked
        # FOR UPDATE, whose value is the latest committed one (the lock waits
        # for a concurrent writer, then reads its row), and which the UPDATE
        # then changes (a waiting UPDATE re-checks that same, locked row).
        old = (
            select(*info.pk_columns, m.state_column.label("sg_old"))
            .where(info.pk_where)
            .with_for_update()
            .subquery("sg_old")
        )
        base = base.where(and_(*(c == old.c[c.key] for c in info.pk_columns)))
        returning.append(old.c.sg_old)
    if not returning:
        # Nothing to learn but that the row moved: RETURNING needs a column.
        returning.append(literal(1).label("sg_moved"))
    moved = base.returning(*returning).cte("sg_moved")
    if returns_source:
        filled["source"] = _names(m, moved.c.sg_old, trigger.sources)
    if returns_state:
        filled["dest"] = _names(m, moved.c.sg_state, trigger.dests)
    if vcol is not None:
        filled["version"] = func.coalesce(cast(moved.c.sg_version, Text), "null")
    holes = _holes(trigger)
    text: Any = bindparam("sg_event_p0", type_=Text)
    for i, field in enumerate(holes, 1):
        text = text.concat(filled[field]).concat(bindparam(f"sg_event_p{i}", type_=Text))
    sent = (
        insert(outbox)
        .from_select(
            ["topic", "key", "payload", "created_ms", "attempts"],
            select(
                bindparam("sg_event_topic", type_=outbox.c.topic.type),
                bindparam("sg_event_key", type_=outbox.c.key.type),
                cast(text, outbox.c.payload.type),
                _sql.db_now_ms(),
                literal(0),
            ).select_from(moved),
        )
        .returning(outbox.c.id)
        .cte("sg_sent")
    )
    stmt = select(*moved.c).select_from(moved.join(sent, true()))
    return CtePlan(stmt, returns_state, returns_source)


def cte_plan(
    trigger: Trigger, backend: _sql.Backend, items: compile.Items, has_sql: bool, expected: bool, fence: bool
) -> CtePlan:
    """The memoised :class:`CtePlan` for one call variant (built afresh when a SQL value cannot be cached)."""
    variant = _sql.variant_key(items, has_sql) if items else ()
    if variant is None:
        return _build(trigger, items, expected, fence)
    key = ("machine.event", trigger, backend, variant, expected, fence)
    found: CtePlan | None = _write.memo.get(key)
    if found is None:
        found = _write.memo.put(key, _build(trigger, items, expected, fence))
    return found


def cte_params(
    trigger: Trigger,
    key: tuple[Any, ...],
    request_id: str | None,
    meta: Any,
) -> dict[str, Any]:
    """The event's parameters of a :class:`CtePlan` (what SQL does not fill in)."""
    dest = trigger.dests[0] if len(trigger.dests) == 1 else None
    source = trigger.sources[0] if len(trigger.sources) == 1 else None
    values = payload(trigger, key, source, dest, None, request_id, meta)
    params: dict[str, Any] = {f"sg_event_p{i}": p for i, p in enumerate(pieces(values, _holes(trigger)))}
    params["sg_event_topic"] = trigger.topic
    params["sg_event_key"] = event_key(trigger.machine.info, key)
    return params
