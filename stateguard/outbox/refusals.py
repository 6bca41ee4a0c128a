"""Which events a sink refuses: a failed batch taken apart, and the rule that tells a refusal from an outage.

:class:`_Isolation` is the part of a relay's cycle between the claim and
the mark: it publishes the batch and, when the sink fails a part of it,
takes that part apart (halves, depth first, a key's earlier events first)
so that one event the sink refuses holds back only its key.  It counts a
refusal only for an event the sink refuses *while it works* (a per-event
verdict, a refusal repeated after the sink took other events or answered
its ``probe()``); a sink that is down (connection errors, timeouts, a batch
it did not confirm) refuses nothing, so an outage of any length parks no
event.  The rule in full: :class:`stateguard.Relay`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from .._async import Steps
from ..exceptions import ConfigurationError
from .events import OutboxEvent


def _ids(error: BaseException, name: str, wanted: set[int]) -> set[int]:
    """The ids of ``wanted`` that the error's attribute ``name`` lists."""
    ids = getattr(error, name, None)
    if not isinstance(ids, Iterable) or isinstance(ids, str | bytes):
        return set()
    return {i for i in ids if type(i) is int and i in wanted}


def _verdict(error: BaseException, part: list[OutboxEvent]) -> tuple[set[int], set[int]] | None:
    """What a sink's error says of ``part``: ``(refused, not published)`` ids, or ``None`` when it
    names no event of it (``refused_ids`` and ``event_ids``, as :class:`~stateguard.PublishFailed`
    carries them; every refused event is unpublished too)."""
    wanted = {e.id for e in part}
    refused = _ids(error, "refused_ids", wanted)
    lost = _ids(error, "event_ids", wanted) | refused
    return (refused, lost) if lost else None


#: Names of exception classes that say a connection failed, whichever client defines them (redis-py's
#: ConnectionError and TimeoutError are not the builtins): an outage, never an event's refusal.
_OUTAGE_NAMES: Final = frozenset({"ConnectionError", "TimeoutError"})


def _outage(error: BaseException) -> bool:
    """Whether ``error`` says the sink is unreachable or unusable rather than refusing the event: an
    OSError (connection refused or reset, a timeout), a class named ConnectionError or TimeoutError,
    a retryable error (PublishFailed naming no refused event), a ConfigurationError."""
    if isinstance(error, OSError | ConfigurationError) or getattr(error, "retryable", False) is True:
        return True
    return any(c.__name__ in _OUTAGE_NAMES for c in type(error).__mro__)


@dataclass
class _Round:
    """What the sink did with one claimed batch."""

    accepted: list[OutboxEvent] = field(default_factory=list)
    #: Events whose refusal counts (see :class:`Relay`), in id order, with the sink's error.
    refused: list[tuple[OutboxEvent, BaseException]] = field(default_factory=list)
    #: The round's first sink error (raised by run_once when the sink took nothing).
    error: BaseException | None = None
    #: An error that ends the round at once (KeyboardInterrupt, a cancellation, the relay's own mistake).
    interrupt: BaseException | None = None

    def published(self) -> int:
        """How many events the sink took, once the round is settled; raises :attr:`interrupt`, or
        :attr:`error` when the sink took nothing."""
        if self.interrupt is not None:
            raise self.interrupt
        if not self.accepted and self.error is not None:
            raise self.error
        return len(self.accepted)


@dataclass
class _Suspect:
    """An event that failed when published alone: refused, or the sink was down at that moment."""

    event: OutboxEvent
    error: BaseException
    #: The sink took something (or named a refusal) after this failure, in the same round.
    worked_after: bool = False


class _Isolation:
    """The publishing half of a relay's cycle (mixed into the relay core, which provides the hooks)."""

    sink: Any
    lease_ms: int
    _fatal: BaseException | None

    def _call_sink(self, fn: Callable[..., Any], /, *args: Any) -> Steps[Any]:
        raise NotImplementedError

    def _publish(self, events: list[OutboxEvent]) -> Steps[Any]:
        raise NotImplementedError

    def _isolate(self, events: list[OutboxEvent]) -> Steps[_Round]:
        """Publish ``events``; when the sink fails a part, take it apart to find what it refuses.

        Halves, depth first from the left: a key's earlier events are settled
        before any later one is tried, and once one event of a key is not
        taken the key's later events of the batch are left for a later claim
        (per-key order).  A sink error naming events (``refused_ids`` /
        ``event_ids``, as :class:`~stateguard.PublishFailed` does) settles
        them at once: the refused ones count, the rest of what it names is
        tried again (a refusal was named: the broker works) or given back (it
        named none: the broker did not confirm, the round ends).  An event
        that fails alone is a *suspect*; after two suspects in a row the next
        call is one event alone, and a third suspect in a row ends the round
        as an outage.  Which suspects count as refusals is
        :meth:`_judge`'s; the search also stops when half the lease is spent.
        """
        result = _Round()
        deadline = time.monotonic() + self.lease_ms / 2000
        blocked: set[str] = set()
        suspects: list[_Suspect] = []
        streak = 0  # suspects since the sink last took something
        down = False
        parts = [events]
        while parts:
            part = [e for e in parts.pop() if e.key is None or e.key not in blocked]
            if not part:
                continue
            if time.monotonic() > deadline and (result.accepted or result.refused or suspects):
                break
            if streak >= 2 and len(part) > 1:
                # Two events failed alone in a row: one more, alone, says whether the sink works at all.
                parts.append(part[1:])
                part = part[:1]
            try:
                yield from self._publish(part)
            except Exception as error:
                if error is self._fatal:
                    result.interrupt = error
                    break
                if result.error is None:
                    result.error = error
                verdict = _verdict(error, part)
                if verdict is not None:
                    refused, lost = verdict
                    again: list[OutboxEvent] = []
                    for e in part:
                        if e.key is not None and e.key in blocked:
                            continue
                        if e.id not in lost:
                            result.accepted.append(e)
                        elif e.id in refused or not refused:
                            if e.id in refused:
                                result.refused.append((e, error))
                            if e.key is not None:
                                blocked.add(e.key)
                        else:
                            again.append(e)
                    if not refused:
                        down = True  # nothing refused, something unconfirmed: the broker is not answering
                        break
                    streak = 0
                    for suspect in suspects:
                        suspect.worked_after = True
                    if again:
                        parts.append(again)
                    continue
                if len(part) > 1:
                    middle = len(part) // 2
                    parts.append(part[middle:])
                    parts.append(part[:middle])
                    continue
                suspects.append(_Suspect(part[0], error))
                if part[0].key is not None:
                    blocked.add(part[0].key)
                streak += 1
                if streak >= 3:
                    down = True
                    break
            except GeneratorExit:
                raise
            except BaseException as error:  # KeyboardInterrupt, SystemExit, a cancellation
                result.interrupt = error
                break
            else:
                result.accepted.extend(part)
                streak = 0
                for suspect in suspects:
                    suspect.worked_after = True
        if suspects and not down and result.interrupt is None:
            yield from self._judge(suspects, result, deadline)
        return result

    def _judge(self, suspects: list[_Suspect], result: _Round, deadline: float) -> Steps[None]:
        """Count the suspects the sink refuses while it works; the others are given back uncounted.

        A suspect after which the sink took other events of the round, or
        whose sink answers :meth:`probe() <stateguard.outbox.Sink>`, is
        published alone once more: taken, it is published; refused again,
        its refusal counts.  Without that evidence (nothing taken after it,
        a sink without ``probe``) it counts unless its error is one of an
        unreachable sink (:func:`_outage`).
        """
        retry = [s for s in suspects if s.worked_after]
        unknown = [s for s in suspects if not s.worked_after]
        if unknown:
            probe = getattr(self.sink, "probe", None)
            if callable(probe):
                try:
                    yield from self._call_sink(probe)
                except Exception as error:
                    if error is self._fatal:
                        result.interrupt = error
                    return  # the sink is down: no suspect's failure is its own
                except GeneratorExit:
                    raise
                except BaseException as error:
                    result.interrupt = error
                    return
                retry += unknown
            else:
                result.refused += [(s.event, s.error) for s in unknown if not _outage(s.error)]
        for suspect in sorted(retry, key=lambda s: s.event.id):
            if time.monotonic() > deadline:
                break
            try:
                yield from self._publish([suspect.event])
            except Exception as error:
                if error is self._fatal:
                    result.interrupt = error
                    return
                result.refused.append((suspect.event, error))
            except GeneratorExit:
                raise
            except BaseException as error:
                result.interrupt = error
                return
            else:
                result.accepted.append(suspect.event)
        result.refused.sort(key=lambda r: r[0].id)
