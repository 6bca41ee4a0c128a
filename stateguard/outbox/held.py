"""The cycle of a relay that holds its batch as row locks (``Relay(hold="locks")``, PostgreSQL's default).

:class:`_Holding` is mixed into the relay core, like :class:`~.refusals._Isolation`:
one transaction claims (a ``SELECT ... FOR UPDATE SKIP LOCKED`` that writes
nothing), stays open while the sink publishes, marks what the sink took,
counts its refusals and commits.  Each published event is written once; a
relay that dies rolls back and frees its batch at once; one whose publish
outlasts its lease loses its session to the server's idle timeout.  Why and
what it costs: :class:`stateguard.Relay` and ``docs/explanation/relay.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final, TypeVar

from sqlalchemy import Connection

from .. import _kernel
from .._async import Steps
from ..exceptions import ConfigurationError
from .events import OutboxEvent
from .refusals import _Round
from .statements import STRICT, _event, _held_claim_statement, _held_mark_statement

log = logging.getLogger("stateguard.outbox")

T = TypeVar("T")


def _holds_locks(dialect: Any) -> bool:
    """Whether a relay can hold its claim as row locks over the publish (``hold="locks"``): the claim
    is one statement that locks ``SKIP LOCKED`` and returns the rows, and the server ends a session
    idle in its transaction past the lease (``idle_in_transaction_session_timeout``, set with
    ``set_config`` as ``synchronous_commit`` is): PostgreSQL proper, not CockroachDB."""
    backend = _kernel.backend(dialect)
    return backend.returning and backend.row_locks and backend.array_params and backend.commit_without_flush


#: The largest ``idle_in_transaction_session_timeout`` PostgreSQL accepts (milliseconds, an int).
MAX_IDLE_TIMEOUT_MS: Final = 2**31 - 1


class _Holding:
    """The ``hold="locks"`` half of a relay (mixed into the relay core, which provides the hooks)."""

    batch: int
    lease_ms: int
    topics: tuple[str, ...] | None
    key_order: str
    _fatal: BaseException | None

    def _open(self) -> Steps[Any]:
        """A connection of ``_held_engine`` with its transaction begun (hold="locks")."""
        raise NotImplementedError

    def _on(self, conn: Any, fn: Callable[..., T], /, *args: Any) -> Steps[T]:
        """``fn(conn, *args)`` in the open transaction of ``conn`` (from :meth:`_open`)."""
        raise NotImplementedError

    def _end(self, conn: Any, commit: bool) -> Steps[None]:
        """Commit (``commit``) or roll back the transaction of ``conn``, and close it."""
        raise NotImplementedError

    def _claimed(
        self, run: Callable[..., Steps[list[OutboxEvent]]], /, *args: Any
    ) -> Steps[list[OutboxEvent]]:
        """The events ``run(*args)`` returns, none when it lost a race (the relay core's claim handling)."""
        raise NotImplementedError

    def _isolate(self, events: list[OutboxEvent]) -> Steps[_Round]:
        raise NotImplementedError

    def _count_refusals(
        self,
        conn: Connection,
        backend: _kernel.Backend,
        owner: str | None,
        counted: list[tuple[OutboxEvent, BaseException]],
        delayed: bool,
    ) -> list[int]:
        raise NotImplementedError

    def _report(self, counted: list[tuple[OutboxEvent, BaseException]], dead: list[int]) -> None:
        raise NotImplementedError

    def _claim_held(self, conn: Connection) -> list[OutboxEvent]:
        """Lock up to ``batch`` events for the transaction of ``conn`` (hold="locks"): the same choice
        as :meth:`_claim`, nothing written."""
        # The session's idle timeout stands in for the lease; PostgreSQL takes at most INT_MAX ms
        # (about 24.8 days): a longer lease waits that long.
        idle_ms = min(self.lease_ms, MAX_IDLE_TIMEOUT_MS)
        params: dict[str, Any] = {"sg_batch": self.batch, "sg_lease": idle_ms}
        if self.topics is not None:
            params["sg_topics"] = list(self.topics)
        stmt = _held_claim_statement(
            _kernel.backend(conn.dialect), self.topics is not None, self.key_order == STRICT
        )
        return [_event(r) for r in _kernel.execute(conn, stmt, params)]

    def _settle_held(
        self,
        conn: Connection,
        accepted: list[int],
        counted: list[tuple[OutboxEvent, BaseException]],
        delayed: bool,
    ) -> list[int]:
        """Mark ``accepted`` published and count the refusals of ``counted``, in the transaction that
        holds their locks (hold="locks"); the ids parked dead.  What is neither is freed by the commit."""
        backend = _kernel.backend(conn.dialect)
        if accepted:
            _kernel.execute(conn, _held_mark_statement(backend), {"sg_ids": accepted})
        return self._count_refusals(conn, backend, None, counted, delayed)

    def _held_cycle(self) -> Steps[int]:
        """The cycle with ``hold="locks"``: claim (lock), publish, mark in one transaction.

        One write per published event (the mark) instead of two (lease, then
        mark).  Whatever ends the transaction early (the relay's process
        dies, its connection drops, the mark fails, the session outlives its
        lease idle) rolls it back: every event of the batch is free again at
        once, and those the sink took are published again (at least once).
        """
        try:
            conn = yield from self._open()
        except ConfigurationError as error:
            self._fatal = error
            raise
        committed = False
        try:
            events = yield from self._claimed(self._on, conn, self._claim_held)
            if not events:
                return 0
            outcome = yield from self._isolate(events)
            accepted = outcome.accepted
            counted = outcome.refused if outcome.interrupt is None else []
            ids = [e.id for e in accepted]
            dead = yield from self._on(conn, self._settle_held, ids, counted, bool(accepted))
            yield from self._end(conn, commit=True)
            committed = True
        finally:
            if not committed:
                yield from self._end(conn, commit=False)
        self._report(counted, dead)
        return outcome.published()
