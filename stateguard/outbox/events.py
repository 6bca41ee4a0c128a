"""Outbox events and sinks: :func:`emit` stores an event in the caller's transaction; a :class:`Sink`
is where a relay publishes it.

An :class:`OutboxEvent` is what a sink gets; a :class:`Sink` is any object
with ``publish(events)``; :class:`CallableSink` makes one of a function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol, runtime_checkable

from sqlalchemy import Insert, bindparam, insert
from sqlalchemy.orm import Session
from sqlalchemy.sql.dml import ReturningInsert

from .. import _kernel
from .._async import dual
from ..exceptions import InvalidArgument
from ..tables import MAX_KEY, outbox
from .wakeup import notifies, notify_column

#: Longest topic accepted (characters): the ``topic`` column's length.
MAX_TOPIC: Final = 200
#: How deep a payload may nest (lists and objects): deeper is InvalidArgument, not a RecursionError.
MAX_DEPTH: Final = 100


@dataclass(frozen=True, slots=True)
class OutboxEvent:
    """One event as a relay hands it to a sink.

    ``id`` (int) is unique and stable across redeliveries: a consumer
    deduplicates with ``consume_once(session, consumer, str(event.id))``.
    ``topic`` (str) and ``key`` (str or ``None``) are what :func:`emit` got;
    events of one key are published in id order.  ``payload`` is what
    :func:`emit` got, read back from its JSON (tuples come back as lists).
    ``created_ms`` is the database's clock at the INSERT (epoch
    milliseconds).  :meth:`payload_json` is the payload as the JSON text
    stored, what a sink sends as a message body.
    """

    id: int
    topic: str
    key: str | None
    payload: Any
    created_ms: int
    # The stored JSON text, kept by the relay so that a sink does not serialise the payload again.
    _json: str | None = field(default=None, repr=False, compare=False)
    # How many times a sink refused it before this claim (the relay's retry delay and max_attempts).
    _refusals: int = field(default=0, repr=False, compare=False)

    def payload_json(self) -> str:
        """The payload as JSON text, exactly as stored: compact (no spaces), non-ASCII kept as is.

        An event a relay claimed returns the stored text without serialising
        again; one built by hand serialises ``payload`` the way :func:`emit`
        does::

            >>> OutboxEvent(7, "order.paid", "order-7", {"total": 120, "name": "Zoë"}, 0).payload_json()
            '{"total":120,"name":"Zoë"}'
        """
        return self._json if self._json is not None else _kernel.dumps_json(self.payload)


@runtime_checkable
class Sink(Protocol):
    """Where a relay publishes events: any object with this one method.

    ``publish(events)`` gets a batch of :class:`OutboxEvent` in id order and
    must return only once every event of it is accepted (written to the
    stream, acknowledged by the broker).  Raising means *nothing* of the
    batch counts as published, unless the error says which events were not
    (``event_ids``) and which the broker refused (``refused_ids``), as
    :class:`~stateguard.PublishFailed` does: the relay then counts the
    others published and a refusal for each refused one.  An error that says
    the broker is unreachable (an OSError, a ``ConnectionError`` or
    ``TimeoutError`` class, ``PublishFailed`` refusing nothing) never counts
    against an event; see :class:`~stateguard.Relay` for which errors do.  A
    sink may also offer ``probe()``, returning when the broker answers and
    raising otherwise: the relay asks it before it counts a refusal it cannot
    tell from an outage.  A sink may get an event more than once (a relay
    that died after ``publish`` and before marking): delivery is at least
    once, and consumers deduplicate by :attr:`OutboxEvent.id`.  For
    :class:`AsyncRelay`, ``publish`` (and ``probe``) may return an awaitable.
    A sink for a queue client is a few lines::

        class QueueSink:
            def __init__(self, queue): self.queue = queue
            def publish(self, events):
                for e in events:                       # id order; a key's events in order
                    self.queue.put(
                        e.payload_json().encode(),     # the stored JSON text
                        headers={"id": str(e.id), "topic": e.topic, "key": e.key or "",
                                 "created_ms": str(e.created_ms)},
                    )
                self.queue.flush()                     # raise unless the broker took them all
            def probe(self):
                self.queue.ping()

    :mod:`stateguard.outbox.sinks` has RabbitMQ and NATS JetStream sinks, and
    Redis Streams has :class:`~stateguard.RedisStreamSink`.
    """

    def publish(self, events: Sequence[OutboxEvent]) -> Any:
        """Publish ``events`` (id order) or raise; see the class docstring."""


class CallableSink:
    """A :class:`Sink` made of a function: ``CallableSink(lambda events: ...)``.

    The function gets each batch (a sequence of :class:`OutboxEvent`, id
    order); it may be a coroutine function for :class:`AsyncRelay`.
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[Sequence[OutboxEvent]], Any]) -> None:
        if not callable(fn):
            raise InvalidArgument(f"CallableSink needs a function of a batch of events, got {fn!r}")
        self.fn = fn

    def publish(self, events: Sequence[OutboxEvent]) -> Any:
        """Call the function with the batch."""
        return self.fn(events)


# --------------------------------------------------------------------------
# emit
# --------------------------------------------------------------------------


def payload_text(payload: Any) -> str:
    """``payload`` as the JSON text the outbox stores, or InvalidArgument (nothing sent).

    JSON values only (dict with str keys, list, tuple, str, int, float, bool,
    None); no NaN or infinity (``allow_nan=False``: other JSON readers
    refuse them); no lone surrogates (no UTF-8 for them).
    """
    return _kernel.json_text(payload, "payload", MAX_DEPTH)


def _insert(backend: _kernel.Backend) -> Insert | ReturningInsert[Any]:
    def build() -> Insert | ReturningInsert[Any]:
        stmt = insert(outbox).values(
            topic=bindparam("sg_topic"),
            key=bindparam("sg_key"),
            payload=bindparam("sg_payload"),
            created_ms=_kernel.db_now_ms(),
            attempts=0,
        )
        if not backend.returning:
            # MariaDB answers with LAST_INSERT_ID in the OK packet (lastrowid): no RETURNING needed.
            return stmt
        if notifies(backend):
            # Wakes the relays when the transaction commits, in the same round trip (see .wakeup).
            return stmt.returning(outbox.c.id, notify_column())
        return stmt.returning(outbox.c.id)

    return _kernel.memo.get_or_build(("outbox_insert", backend), build)


@dual
def emit(
    session: Session,
    topic: str,
    payload: Any,
    *,
    key: str | None = None,
    durability: Literal["replicated", "local"] | None = None,
) -> int:
    """Store an event in the session's current transaction and return its id.

    One INSERT into ``stateguard_outbox``: a relay sees the event only after
    the transaction commits, and a rollback discards it with the rest::

        with Session(engine) as session, session.begin():
            session.add(Invoice(id=7, total=120))
            emit(session, "invoice.created", {"id": 7, "total": 120}, key="invoice-7")

        event_id = await emit(async_session, "invoice.created", {...})   # AsyncSession: awaited

    Events with the same ``key`` are published in id order (see the module
    docstring); ``key=None`` events have no order with any other.  On
    PostgreSQL the INSERT also NOTIFYs the relays (``pg_notify`` in its
    RETURNING, no extra round trip), delivered only if the transaction
    commits: a running relay publishes the event moments after the COMMIT.

    :raises InvalidArgument: a blank, oversize (200 / 255 characters) or
        non-str ``topic`` or ``key``; a payload that is not JSON (NaN or
        infinity, non-str object keys, lone surrogates, nesting deeper than
        100, a circular reference) or too large for a MariaDB statement;
        nothing was written.
    :raises NotSupported: ``durability="replicated"`` where no standby can
        confirm a COMMIT (SQLite, MariaDB, a driver other than psycopg).
    :raises ConfigurationError: ``durability="replicated"`` on a PostgreSQL
        with no synchronous standby; nothing was written.

    ``durability="replicated"``: the transaction commits only once a
    synchronous standby applied it, or its commit raises
    :class:`~stateguard.ReplicationTimeout` (see :func:`~stateguard.set_durability`).
    """
    _kernel.check_text(topic, "topic", MAX_TOPIC)
    if key is not None:
        _kernel.check_text(key, "key", MAX_KEY)
    text = payload_text(payload)
    if session.autoflush:
        session.flush()
    conn = _kernel.own_connection(session, outbox)
    _kernel.check_statement_size(conn, text, "payload")
    watch = _kernel.durable(session, conn, durability) if durability is not None or _kernel.DURABLE else None
    backend = _kernel.backend(conn.dialect)
    result = _kernel.execute(conn, _insert(backend), {"sg_topic": topic, "sg_key": key, "sg_payload": text})
    event_id = int(result.scalar_one() if backend.returning else result.lastrowid)
    return event_id if watch is None else watch.note(event_id)
