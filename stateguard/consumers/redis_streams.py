"""A Redis Streams consumer-group reader that applies each outbox event once: :class:`RedisStreamConsumer`.

Each entry is handled in one transaction with
:func:`~stateguard.consume_once` keyed by the entry's ``id`` field (the
outbox event id :class:`~stateguard.RedisStreamSink` writes), committed, and
only then acknowledged with ``XACK``.  At start the reader reads its own
pending entries again (``XREADGROUP`` from id ``0``: what it had read before
a restart), then each round claims entries other workers left pending longer
than ``claim_idle`` (``XAUTOCLAIM``) and reads new ones (``>``).  An entry
whose handler failed stays pending and is claimed again after
``claim_idle``; once Redis delivered it ``max_deliveries`` times (its
``XPENDING`` count) it moves to a dead-letter stream (``XADD`` then
``XACK`` in one script, the ``XACK`` only if the ``XADD`` succeeded).
redis-py (the ``stateguard[redis]`` extra) is the only client this module
uses.  See ``docs/how-to/consumers.md``.
"""

from __future__ import annotations

import random
import threading
from datetime import timedelta
from typing import Any, Final

from ..exceptions import InvalidArgument
from ..tables import MAX_KEY
from ._core import (
    DEFAULT_MAX_DELIVERIES,
    MAX_BACKOFF,
    Handling,
    Message,
    Verdict,
    check_deliveries,
    check_name,
    log,
)
from ._core import serve as _serve

__all__ = ["RedisStreamConsumer"]


#: Suffix of the default dead-letter stream's name.
DEAD_SUFFIX: Final = ":dead"

#: KEYS: the stream, its dead-letter stream; ARGV: the group, the entry id, the copy's fields and
#: values.  The XACK runs only once the XADD has succeeded.
_DEAD_LETTER: Final = """
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
return redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
"""
#: The most field names and values the script passes on: Lua's unpack() refuses ~8000 results.
_SCRIPT_ARGS: Final = 7000


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _is_utf8(value: Any) -> bool:
    if not isinstance(value, bytes):
        return True
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _field(fields: dict[Any, Any], name: str) -> Any:
    """A field of an entry read with or without ``decode_responses``."""
    value = fields.get(name.encode())
    return fields.get(name) if value is None else value


class RedisStreamConsumer:
    """Read a stream as one worker of a consumer group; run ``handler(session, message)`` once per event.

    ::

        def bill(session: Session, message: Message) -> None:
            session.add(Invoice(order_id=message.payload["order"]))

        consumer = RedisStreamConsumer(
            engine, bill, redis.Redis(), stream="orders", group="billing", worker="billing-1"
        )
        sys.exit(consumer.serve())            # until SIGTERM: finishes the entry in hand, exits 0

    ``consumer`` (default: ``group``) is the name
    :func:`~stateguard.consume_once` records the event ids under; give
    ``worker`` a name that stays the same across restarts (a pod or host
    name with an index), so a restarted worker handles its own pending
    entries at once instead of waiting ``claim_idle`` for another to claim
    them.  The group is created (from the stream's start) if it does not
    exist.  A failing handler's transaction rolls back and the entry stays
    pending; the database being unreachable is waited out on the entry in
    hand (it is not counted against it).  An entry delivered
    ``max_deliveries`` times whose handler failed, or delivered more often
    (it crashed workers), goes to ``dead_letter_stream`` (default
    ``<stream>:dead``) with the fields ``entry`` (its id), ``stream``,
    ``group``, ``deliveries`` and ``error`` added; on Redis Cluster give
    both names one hash tag (``{orders}``, ``{orders}:dead``).

    :param bind: a synchronous Engine, or a sessionmaker.
    :param handler: ``handler(session, message)`` with a :class:`Message`;
        its writes commit with the ``consume_once`` record.
    :param client: a ``redis.Redis`` client (with or without ``decode_responses``).
    :param block: how long one read waits for new entries (also how soon
        :meth:`stop` is noticed while idle).
    :param batch: entries read (and claimed) per round.
    :raises InvalidArgument: a bad name, count or duration.
    """

    def __init__(
        self,
        bind: Any,
        handler: Any,
        client: Any,
        *,
        stream: str,
        group: str,
        worker: str,
        consumer: str | None = None,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        claim_idle: timedelta = timedelta(seconds=30),
        dead_letter_stream: str | None = None,
        block: timedelta = timedelta(seconds=1),
        batch: int = 10,
    ) -> None:
        self._handling = Handling(
            bind, handler, group if consumer is None else consumer, "RedisStreamConsumer"
        )
        if client is None or not callable(getattr(client, "xreadgroup", None)):
            raise InvalidArgument(f"RedisStreamConsumer needs a redis.Redis client, got {client!r}")
        self.client = client
        self.stream = check_name(stream, "stream", MAX_KEY)
        self.group = check_name(group, "group", MAX_KEY)
        self.worker = check_name(worker, "worker", MAX_KEY)
        self.max_deliveries = check_deliveries(max_deliveries)
        self.dead_letter_stream = check_name(
            dead_letter_stream if dead_letter_stream is not None else self.stream + DEAD_SUFFIX,
            "dead_letter_stream",
            MAX_KEY + len(DEAD_SUFFIX),
        )
        if self.dead_letter_stream == self.stream:
            raise InvalidArgument("dead_letter_stream must not be the stream itself")
        self.claim_idle_ms = _ms(claim_idle, "claim_idle")
        self.block_ms = _ms(block, "block")
        if type(batch) is not int or not 1 <= batch <= 10_000:
            raise InvalidArgument(f"batch must be an int from 1 to 10000, got {batch!r}")
        self.batch = batch
        #: How many entries this reader acknowledged (handled now or before) and dead-lettered.
        self.handled = 0
        self.dead_lettered = 0
        self._recovered = False
        self._group_ready = False
        self._claim_cursor = "0-0"

    @property
    def consumer(self) -> str:
        """The name :func:`~stateguard.consume_once` records this group's event ids under."""
        return self._handling.consumer

    def run(self, stop_event: threading.Event | None = None) -> None:
        """Read and handle entries until ``stop_event`` is set (or :meth:`stop` is called).

        A lost Redis connection is logged and tried again after a pause
        (doubling to 30 s, jittered); only the stop ends the loop, after the
        entry in hand was committed and acknowledged.  Entries read but not
        handled yet stay pending: this worker handles them when it starts
        again, another claims them after ``claim_idle``::

            stop = threading.Event()
            threading.Thread(target=consumer.run, args=(stop,)).start()
            ...
            stop.set()
        """
        import redis

        if stop_event is not None:
            self._handling.stop_event = stop_event
        stop = self._handling.stop_event
        pause = 0.05
        while not stop.is_set():
            try:
                self.run_once()
                pause = 0.05
            except redis.RedisError as error:
                log.warning(
                    "consumer %r: Redis stream %r: %s: %s; trying again in %.2f s",
                    self.consumer,
                    self.stream,
                    type(error).__name__,
                    error,
                    pause,
                )
                stop.wait(pause * random.uniform(0.5, 1.0))  # jitter, not security
                pause = min(pause * 2, MAX_BACKOFF)

    def serve(self) -> int:
        """:meth:`run` until SIGTERM or SIGINT, then return 0 (``sys.exit(consumer.serve())``).

        Call it from the main thread: the signal finishes the entry in hand,
        acknowledges it and returns.
        """
        return _serve(self.run, self._handling.stop_event)

    def stop(self) -> None:
        """Ask :meth:`run` to return after the entry in hand (from any thread or a signal handler)."""
        self._handling.stop_event.set()

    def run_once(self) -> int:
        """One round: own pending entries (first round only), entries claimed from others, new entries.

        Returns how many entries it acknowledged or dead-lettered; waits up
        to ``block`` for new entries when there were none to claim::

            while consumer.run_once():
                pass                            # drain what is there, then return
        """
        self._ensure_group()
        done = 0
        if not self._recovered:
            done += self._recover_own()
            self._recovered = True
        done += self._claim_stuck()
        if self._handling.stop_event.is_set():
            return done
        reply = self._read(">", block=True)
        for _, entries in reply or ():
            done += self._handle_entries([(entry_id, fields, 1) for entry_id, fields in entries])
        return done

    # -- rounds -------------------------------------------------------------

    def _ensure_group(self) -> None:
        import redis

        if self._group_ready:
            return
        try:
            self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise
        self._group_ready = True

    def _recover_own(self) -> int:
        """Handle again what this worker had read and not acknowledged (before a restart)."""
        done, after = 0, "0"
        while not self._handling.stop_event.is_set():
            reply = self._read(after)
            entries = reply[0][1] if reply else []
            if not entries:
                return done
            after = _text(entries[-1][0]) or after
            done += self._handle_entries(self._with_counts(entries))
        return done

    def _claim_stuck(self) -> int:
        """XAUTOCLAIM entries idle longer than ``claim_idle`` (a worker died, a handler failed)."""
        reply = self._raw(
            "XAUTOCLAIM",
            self.stream,
            self.group,
            self.worker,
            self.claim_idle_ms,
            self._claim_cursor,
            "COUNT",
            self.batch,
        )
        # Redis 7 answers [cursor, entries, deleted ids]; the deleted ones left the PEL already.
        self._claim_cursor = _text(reply[0]) or "0-0"
        entries = reply[1]
        return self._handle_entries(self._with_counts(entries)) if entries else 0

    def _read(self, after: str, *, block: bool = False) -> list[Any]:
        """XREADGROUP from ``after`` (``>``: new entries), waiting ``block`` ms for new ones if asked:
        ``[(stream, entries)]``, whichever protocol the client speaks."""
        waiting = ("BLOCK", self.block_ms) if block else ()
        reply = self._raw(
            "XREADGROUP",
            "GROUP",
            self.group,
            self.worker,
            "COUNT",
            self.batch,
            *waiting,
            "STREAMS",
            self.stream,
            after,
        )
        if isinstance(reply, dict):  # RESP3 (protocol=3): {stream: [entries]}, not [[stream, entries]]
            return [(name, value[0] if value else []) for name, value in reply.items()]
        return list(reply or ())

    def _raw(self, *command: Any, **options: Any) -> Any:
        """``command``'s reply as bytes, even from a ``decode_responses`` client.

        Decoding an entry is this module's job: redis-py's decoder is strict, so an entry holding
        bytes that are not UTF-8 (a hostile id, a binary payload) would raise UnicodeDecodeError
        out of every read, at every start again (the entry stays pending and is read first), and
        block every entry after it instead of being dead-lettered.
        """
        from redis.client import NEVER_DECODE

        return self.client.execute_command(*command, **options, **{NEVER_DECODE: []})

    def _with_counts(self, entries: list[Any]) -> list[tuple[Any, Any, int]]:
        """``entries`` with how often Redis delivered each (one XPENDING over their id range)."""
        first, last = entries[0][0], entries[-1][0]
        pending = self.client.xpending_range(self.stream, self.group, first, last, len(entries) + 100)
        counts = {_text(p["message_id"]): int(p["times_delivered"]) for p in pending}
        return [(entry_id, fields, counts.get(_text(entry_id), 1)) for entry_id, fields in entries]

    def _handle_entries(self, entries: list[tuple[Any, Any, int]]) -> int:
        done = 0
        for index, (entry_id, fields, deliveries) in enumerate(entries):
            if self._handling.stop_event.is_set():
                # The rest stays pending: this worker's next start, or another's claim, takes it.
                self._give_back(entries[index:])
                break
            done += self._handle(entry_id, fields, deliveries)
        return done

    def _give_back(self, entries: list[tuple[Any, Any, int]]) -> None:
        """Take back the delivery Redis counted for entries read and not started (a stop).

        Otherwise the next read counts them once more, and with ``max_deliveries=1`` they would be
        dead-lettered unhandled as if they had crashed a worker.  ``XCLAIM ... RETRYCOUNT n
        JUSTID`` sets the count (JUSTID does not add one); one call per count.
        """
        by_count: dict[int, list[Any]] = {}
        for entry_id, _, deliveries in entries:
            by_count.setdefault(max(deliveries - 1, 0), []).append(entry_id)
        for count, ids in by_count.items():
            self._raw(
                "XCLAIM",
                self.stream,
                self.group,
                self.worker,
                0,
                *ids,
                "RETRYCOUNT",
                count,
                "JUSTID",
                parse_justid=True,  # for redis-py's reply parser: ids, not entries
            )

    def _handle(self, entry_id: Any, fields: Any, deliveries: int) -> int:
        if not fields:
            # Trimmed from the stream while pending: nothing left to handle.
            self.client.xack(self.stream, self.group, entry_id)
            return 1
        if not _is_utf8(_field(fields, "id")):
            # Decoded with replacement, b"\xff" and b"\xfe" would both read "\ufffd" and the
            # second would pass for a repeat of the first: its effect lost.  No delivery can help.
            return self._dead_letter(entry_id, fields, deliveries, "its id is not UTF-8 text")
        message = Message(
            id=_text(_field(fields, "id")) or "",
            body=_bytes(_field(fields, "payload")),
            topic=_text(_field(fields, "topic")),
            key=_text(_field(fields, "key")) or None,
            deliveries=deliveries,
            raw=(entry_id, fields),
        )
        if deliveries > self.max_deliveries:
            return self._dead_letter(entry_id, fields, deliveries, "delivered more often than max_deliveries")
        verdict = self._handling.handle(message)
        if verdict is Verdict.DONE:
            self.client.xack(self.stream, self.group, entry_id)
            self.handled += 1
            return 1
        if verdict is Verdict.UNUSABLE:
            return self._dead_letter(entry_id, fields, deliveries, "its id cannot be recorded")
        if verdict is Verdict.FAILED and deliveries >= self.max_deliveries:
            return self._dead_letter(entry_id, fields, deliveries, "the handler failed")
        if verdict is Verdict.STOPPED:
            # Stopped while waiting out the database (a COMMIT's fate unknown): not a failure, so
            # not a delivery either, or with max_deliveries=1 the next read dead-letters it unhandled.
            self._give_back([(entry_id, fields, deliveries)])
        return 0  # pending: claimed again after claim_idle

    def _dead_letter(self, entry_id: Any, fields: Any, deliveries: int, why: str) -> int:
        copy = {(_text(k) or ""): v for k, v in fields.items()}
        copy.update(
            entry=_text(entry_id) or "",
            stream=self.stream,
            group=self.group,
            deliveries=str(deliveries),
            error=why,
        )
        pairs = [part for pair in copy.items() for part in pair]
        # One script, not MULTI: Redis does not roll a MULTI back, so an XADD refused when it runs
        # (WRONGTYPE: the dead-letter key is not a stream) would still let the XACK run and the
        # entry vanish from both streams.  A script stops at its first failing redis.call.
        if len(pairs) <= _SCRIPT_ARGS:
            self.client.eval(
                _DEAD_LETTER, 2, self.stream, self.dead_letter_stream, self.group, entry_id, *pairs
            )
        else:  # too many fields for one Lua unpack(): XACK after the XADD (a crash between: two copies)
            self.client.xadd(self.dead_letter_stream, copy)
            self.client.xack(self.stream, self.group, entry_id)
        log.error(
            "consumer %r: stream entry %s (event %s) moved to %r after %d deliveries: %s",
            self.consumer,
            _text(entry_id),
            _text(_field(fields, "id")),
            self.dead_letter_stream,
            deliveries,
            why,
        )
        self.dead_lettered += 1
        return 1

    def __repr__(self) -> str:
        return f"RedisStreamConsumer(stream={self.stream!r}, group={self.group!r}, worker={self.worker!r})"


def _bytes(value: Any) -> bytes:
    if value is None:
        return b""
    return value if isinstance(value, bytes) else str(value).encode("utf-8")


def _ms(value: Any, what: str) -> int:
    if not isinstance(value, timedelta) or value <= timedelta(0):
        raise InvalidArgument(f"{what} must be a positive datetime.timedelta, got {value!r}")
    return max(1, int(value / timedelta(milliseconds=1)))
