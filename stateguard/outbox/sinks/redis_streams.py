"""An outbox sink that appends each event to a Redis stream: :class:`RedisStreamSink`.

One ``XADD`` per event, the whole batch in one pipeline; it drives any
redis-py client it is given (``redis.Redis``, a cluster, ``redis.asyncio``)
and imports nothing of redis-py itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from ... import _kernel
from ...exceptions import InvalidArgument
from ...tables import MAX_KEY

if TYPE_CHECKING:
    from ..events import OutboxEvent

__all__ = ["MAX_MAXLEN", "RedisStreamSink"]

#: Largest ``RedisStreamSink(maxlen=...)``: Redis parses XADD's MAXLEN as a signed 64-bit
#: integer (``XADD s MAXLEN 9223372036854775808 * f v`` is "ERR value is not an integer or
#: out of range", Redis 7.0).
MAX_MAXLEN: Final = 2**63 - 1


class RedisStreamSink:
    """An outbox :class:`~stateguard.outbox.Sink`: each event is appended to a Redis stream.

    One ``XADD`` per event, the whole batch in one pipeline (one round
    trip).  The entry's fields are ``id`` (the outbox event id, as text),
    ``topic``, ``key`` (empty for an event without a key: a real key is
    never blank) and ``payload`` (JSON text).  A relay may publish an event
    twice (at least once), so a consumer deduplicates by ``id``::

        relay = Relay(engine, RedisStreamSink(redis.Redis(), stream="orders", maxlen=1_000_000))

        for _, entries in r.xread({"orders": last}, block=5000):
            for entry_id, fields in entries:
                with Session(engine) as session, session.begin():
                    if consume_once(session, "billing", fields[b"id"].decode()).applied:
                        bill(session, json.loads(fields[b"payload"]))

    ``maxlen`` trims the stream (``MAXLEN ~``, approximate unless
    ``approximate=False``); an event trimmed before a consumer read it is
    lost for that consumer, so size it for the slowest one.  With a
    ``redis.asyncio`` client, :meth:`publish` returns an awaitable: use it
    with :class:`~stateguard.outbox.AsyncRelay`.

    :raises InvalidArgument: no redis client, a blank or oversize
        ``stream``, a ``maxlen`` that is not an int from 1 to
        :data:`MAX_MAXLEN`.
    """

    __slots__ = ("approximate", "client", "maxlen", "stream")

    def __init__(
        self, client: Any, *, stream: str, maxlen: int | None = None, approximate: bool = True
    ) -> None:
        if client is None or not callable(getattr(client, "pipeline", None)):
            raise InvalidArgument(
                f"RedisStreamSink needs a redis client (redis.Redis or redis.asyncio), got {client!r}"
            )
        self.client = client
        self.stream = _kernel.check_text(stream, "stream", MAX_KEY)
        if maxlen is not None and (type(maxlen) is not int or not 1 <= maxlen <= MAX_MAXLEN):
            # Redis refuses a larger MAXLEN on every XADD ("value is not an integer or out of
            # range"): the relay would retry forever and publish nothing.
            raise InvalidArgument(
                f"maxlen must be an int from 1 to {MAX_MAXLEN} (what Redis's XADD MAXLEN takes) "
                f"or None, got {maxlen!r}"
            )
        self.maxlen = maxlen
        self.approximate = bool(approximate)

    def publish(self, events: Sequence[OutboxEvent]) -> Any:
        """XADD every event, in order, in one pipeline; the pipeline's reply (awaitable for an async client).

        A failed XADD raises (redis-py raises the first error of a pipeline):
        the relay then counts none of the batch as published.
        """
        pipe = self.client.pipeline(transaction=False)
        for event in events:
            fields = {
                "id": str(event.id),
                "topic": event.topic,
                "key": event.key or "",
                "payload": event.payload_json(),
            }
            pipe.xadd(self.stream, fields, maxlen=self.maxlen, approximate=self.approximate)
        return pipe.execute()
