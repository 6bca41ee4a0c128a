"""Idempotency keys (SCHEMES.md, scheme 5): a retried request runs once and replays its response.

::

    with idempotent(session, scope=f"payments:{client_id}", key=key, fingerprint=body) as call:
        if call.replayed:
            return call.response
        ...                                    # the work: runs once per key
        return call.complete({"payment_id": payment.id})

The record lives in ``stateguard_idempotency_keys``, unique on
``(scope, idem_key)``.  The algorithm is written once here; each decision is
one conditional statement, so the database settles every race:

- **claim**: one INSERT (``ON CONFLICT DO NOTHING RETURNING`` on PostgreSQL and
  SQLite; on MariaDB a duplicate-key error, which InnoDB rolls back alone and
  leaves the transaction usable).  Inserted: this caller owns the key.  On
  PostgreSQL the same statement returns the existing record
  (:meth:`~stateguard._write.InsertOnce.insert_or_read`), unless it waited
  for a twin that committed meanwhile (its snapshot is older than the twin's
  row): then, and on the other backends, a read follows.
- otherwise **one read** of the record decides: completed with the same
  fingerprint → replay the stored response; another fingerprint →
  :class:`~stateguard.IdempotencyKeyReused`; in progress with a live lease →
  :class:`~stateguard.RequestInProgress`; failed for good →
  :class:`~stateguard.RequestFailed`; lease expired (the worker died) or
  released → **take over** with ``UPDATE ... WHERE owner = :old AND
  locked_until_ms <= db_now``; expired (older than ``ttl``) → **reclaim** as a
  brand-new request with ``UPDATE ... WHERE owner = :old AND expires_ms <=
  db_now`` (``db_now``: the database's clock, see below).  Of several takers
  exactly one UPDATE matches: PostgreSQL re-checks a waiting UPDATE's WHERE
  against the committed row at READ COMMITTED, InnoDB updates the latest
  committed row, SQLite has one writer.
- every later write (complete, checkpoint, heartbeat, release, fail) is
  ``UPDATE ... WHERE owner = :me AND status = 'in_progress'``: a worker whose
  lease was taken over learns it (:class:`~stateguard.LeaseLost`) and never
  overwrites or deletes the new owner's record.

Two modes:

``mode="same_transaction"`` (default): the claim, the block's writes and the
stored response share the session's transaction.  The claim needs no
SAVEPOINT (its INSERT cannot abort the transaction; on PostgreSQL one
statement claims the key or returns its record); the block gets one, sent
just before its first statement (:class:`~stateguard._write.DeferredSavepoint`),
so a first call whose block sends nothing is two statements.  If the block
raises, the savepoint rolls back the block's writes and the claim is deleted
(a takeover or reclaim opens the savepoint before its UPDATE and is rolled
back with it): the key is free again, even when the caller catches the
exception and commits.  A concurrent twin's INSERT waits on the
unique index until the first transaction ends, then replays (or claims, if it
rolled back).  Nothing is visible to others before commit, so leases only
matter when the same keys are also used in separate mode.

``mode="separate"``: for work that calls an outside system that cannot be
rolled back.  The claim commits at once in its own short transaction (status
in progress, with a lease); the session must have no transaction open.
``checkpoint()`` and ``complete()`` write through the session's connection
and commit the session, so the writes of a phase and its recovery point
(Stripe's "atomic phases") land together.  An exception rolls the session
back and releases the key (or marks it failed for good when the exception is
one of ``non_retryable``); a caller whose lease expired is taken over by the
next retry, which reads the last checkpoint.

Times are integer epoch milliseconds on the database's clock: every lease
and expiry is computed and judged by the database inside the statement that
decides it (:func:`stateguard._sql.db_now_ms`), so application servers whose
clocks disagree never take over a live claim or keep a dead one.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import inspect
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any, Final, Generic, Literal, NamedTuple, ParamSpec, Protocol, TypeVar, cast

from sqlalchemy import (
    Connection,
    Engine,
    Integer,
    String,
    and_,
    bindparam,
    column,
    delete,
    literal_column,
    null,
    select,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from . import _compat, _sql, _write
from . import observe as _observe
from ._async import (
    AsyncSession,
    DualContext,
    DualObject,
    as_session,
    dual_bind,
    dual_member,
)
from .exceptions import (
    DeadlockDetected,
    IdempotencyKeyReused,
    InvalidArgument,
    LeaseLost,
    NotSupported,
    RequestFailed,
    RequestInProgress,
    SerializationConflict,
)
from .tables import MAX_KEY, MAX_SCOPE, idempotency_keys

__all__ = [
    "IdempotencyEvent",
    "IdempotentCall",
    "JSONSerializer",
    "Mode",
    "Serializer",
    "fingerprint_of",
    "idempotent",
    "idempotent_function",
    "on_idempotency_event",
    "purge_expired",
]

log = logging.getLogger("stateguard.idempotency")

Mode = Literal["same_transaction", "separate"]
R = TypeVar("R")
P = ParamSpec("P")
#: The kind of session a call was made for (a Session or an AsyncSession).
S = TypeVar("S")
T = TypeVar("T")
SessionT = TypeVar("SessionT", bound="Session | AsyncSession")
E = TypeVar("E", bound=BaseException)

_IN_PROGRESS: Final = "in_progress"
_COMPLETED: Final = "completed"
_FAILED: Final = "failed"
# The same constants as SQL literals in the statements: a bound parameter is converted
# and sent at every execution, a literal is part of the (prepared) statement.
_IN_PROGRESS_SQL: Final = literal_column(f"'{_IN_PROGRESS}'", String)
_COMPLETED_SQL: Final = literal_column(f"'{_COMPLETED}'", String)
_FAILED_SQL: Final = literal_column(f"'{_FAILED}'", String)
#: Rounds of read-then-decide before giving up on a record that keeps changing.
_MAX_ROUNDS: Final = 8
#: Attempts of a separate-mode claim transaction that hit a deadlock or serialization failure.
_CLAIM_ATTEMPTS: Final = 5


# --------------------------------------------------------------------------
# Serialisation and fingerprints
# --------------------------------------------------------------------------


class Serializer(Protocol):
    """Turns stored responses and checkpoint data into text and back.

    ``dumps`` must raise ``TypeError`` or ``ValueError`` for a value it cannot
    store; stateguard turns that into :class:`~stateguard.InvalidArgument`
    before anything is written.
    """

    def dumps(self, value: Any) -> str:
        """Text to store for ``value``."""
        ...

    def loads(self, text: str) -> Any:
        """The value ``text`` was made from."""
        ...


class JSONSerializer:
    """The default :class:`Serializer`: strict JSON (no NaN), UTF-8 kept as is.

    A replay gets the JSON round trip of the response: tuples come back as
    lists, dict keys as strings.  Pass ``serializer=`` for other types.
    """

    def dumps(self, value: Any) -> str:
        """``value`` as compact JSON."""
        return _write.dumps_json(value)

    def loads(self, text: str) -> Any:
        """The value of JSON ``text``."""
        return json.loads(text)


_JSON: Final = JSONSerializer()


#: Canonical JSON of a fingerprint (sorted keys, no whitespace), built once.
_canonical: Final = _write.json_encoder(sort_keys=True)


def _builtin_sha256() -> Callable[[bytes], Any]:
    """CPython's own SHA-256 (``_sha2``; ``_sha256`` before 3.12), else hashlib's.

    The same digest as ``hashlib.sha256``, which is OpenSSL's: its context setup costs more than
    hashing a request fingerprint (a third of the time, measured right after a database round
    trip).  The fingerprint only tells requests apart; nothing security-related depends on it.
    """
    for module in ("_sha2", "_sha256"):
        try:
            return cast("Callable[[bytes], Any]", importlib.import_module(module).sha256)
        except (ImportError, AttributeError):
            continue
    return hashlib.sha256  # pragma: no cover - CPython has one of the two


_sha256: Final = _builtin_sha256()


_BYTES: Final = (bytes, bytearray, memoryview)


def fingerprint_of(value: Any) -> str | None:
    """SHA-256 (hex) of a request fingerprint's canonical form, or ``None`` for ``None``.

    Bytes are hashed as they are; anything else as canonical JSON (sorted
    keys, no whitespace), so ``{"a": 1, "b": 2}`` and ``{"b": 2, "a": 1}``
    are the same request.  Only this hash is stored, never the payload::

        fingerprint_of({"amount": 100, "currency": "EUR"})   # '5c1d...'

    :raises InvalidArgument: the value is not JSON-serialisable.
    """
    if value is None:
        return None
    if isinstance(value, _BYTES):
        data = b"bytes:" + bytes(value)
    else:
        try:
            canonical = _canonical(value)
        except RecursionError:
            raise InvalidArgument("fingerprint is nested too deeply to serialise as JSON") from None
        except (TypeError, ValueError) as error:
            raise InvalidArgument(
                f"fingerprint must be bytes or JSON-serialisable (dicts with str keys, lists, str, "
                f"numbers without NaN, bools, None): {error}"
            ) from error
        try:
            data = b"json:" + canonical.encode("utf-8")
        except UnicodeEncodeError as error:
            # json.loads accepts "\udc80"; there is no UTF-8 (hence no canonical form) for it.
            raise InvalidArgument(f"fingerprint holds a lone surrogate ({error.reason})") from None
    digest: str = _sha256(data).hexdigest()
    return digest


def _dump(serializer: Serializer, value: Any, what: str) -> str:
    """``value`` as the text to store; InvalidArgument (nothing sent) for what no database can take."""
    try:
        text = serializer.dumps(value)
    except RecursionError:
        raise InvalidArgument(
            f"the {what} is nested too deeply for {type(serializer).__name__} to store; flatten it"
        ) from None
    except (TypeError, ValueError) as error:
        # Strict JSON: NaN and Infinity are ValueError.
        raise InvalidArgument(
            f"the {what} cannot be stored by {type(serializer).__name__}: {error}; "
            f"return a serialisable value or pass serializer="
        ) from error
    if not isinstance(text, str):
        raise InvalidArgument(
            f"{type(serializer).__name__}.dumps() must return str, got {type(text).__name__}"
        )
    # PostgreSQL refuses NUL in text and no driver encodes a lone surrogate
    # (JSON with ensure_ascii=False passes one through).
    return _write.check_storable(text, f"the serialised {what}")


#: Characters of a stored error description (release reasons, exception messages).
_MAX_ERROR: Final = 2000


def _storable_error(text: str) -> str:
    """An error description any database stores: NUL and lone surrogates escaped, at most _MAX_ERROR long."""
    text = text[:_MAX_ERROR].replace("\x00", "\\x00")
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _exception_text(exc: BaseException) -> str:
    """``"Type: message"`` of ``exc``, storable; never raises (a broken ``__str__`` is not the error)."""
    try:
        message = str(exc)
    except Exception:
        message = "<str() of the exception failed>"
    return _storable_error(f"{type(exc).__name__}: {message}")


def _load(serializer: Serializer, text: str | None) -> Any:
    return None if text is None else serializer.loads(text)


# --------------------------------------------------------------------------
# Observability
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class IdempotencyEvent:
    """One thing that happened to an idempotency key, as given to :func:`on_idempotency_event` listeners.

    ``kind`` is one of ``"claimed"`` (this call owns a new or expired key),
    ``"replayed"``, ``"in_progress"`` (RequestInProgress), ``"key_reused"``
    (IdempotencyKeyReused), ``"failed_replayed"`` (RequestFailed),
    ``"taken_over"`` (a dead or released claim was resumed), ``"completed"``,
    ``"released"``, ``"failed"`` (marked failed for good) and
    ``"lease_lost"``.
    """

    kind: str
    scope: str
    key: str
    attempt: int | None
    mode: Mode


_listeners: list[Callable[[IdempotencyEvent], object]] = []


def on_idempotency_event(listener: Callable[[IdempotencyEvent], object]) -> Callable[[], None]:
    """Call ``listener(event)`` for every :class:`IdempotencyEvent`; return a function that removes it.

    Listeners run synchronously in the thread of the call; an exception in a
    listener is logged and never breaks the request::

        counts = collections.Counter()
        remove = on_idempotency_event(lambda e: counts.update([e.kind]))
        ...
        remove()

    Every event is also logged at DEBUG on the ``stateguard.idempotency`` logger.
    """
    _listeners.append(listener)

    def remove() -> None:
        with contextlib.suppress(ValueError):
            _listeners.remove(listener)

    return remove


def _emit(kind: str, scope: str, key: str, attempt: int | None, mode: Mode) -> None:
    if _observe.hooked or log.isEnabledFor(logging.DEBUG):
        # The generic outcome event (stateguard.observe), also the DEBUG log line with its extra fields.
        _observe.deliver(
            _observe.GuardEvent("idempotency", kind, 0.0, scope=scope, retries=max(0, (attempt or 1) - 1)),
            log,
        )
    if not _listeners:
        return
    event = IdempotencyEvent(kind, scope, key, attempt, mode)
    for listener in tuple(_listeners):
        try:
            listener(event)
        except Exception:
            _observe.failed(listener, f"taking the idempotency event {kind!r}", log)


# --------------------------------------------------------------------------
# SQL, built once
# --------------------------------------------------------------------------

_t = idempotency_keys
# Every lease and expiry is judged and stored on the database's clock, inside
# the deciding statement: an application server whose clock runs ahead must
# not take over live claims (nor one running behind keep dead ones).
_NOW: Final = _sql.db_now_ms()
_LEASE_END: Final = _NOW + bindparam("sg_lease")
_EXPIRY: Final = _NOW + bindparam("sg_ttl")
# The statements below touch one table: their conditions name its columns unqualified
# (``scope``, not ``stateguard_idempotency_keys.scope``), which SQLAlchemy renders as they are;
# with a ``schema_translate_map``, every qualified name is one more substitution in the SQL text
# at every execution.
_scope, _idem_key, _owner, _status = (
    column(c.name, c.type) for c in (_t.c.scope, _t.c.idem_key, _t.c.owner, _t.c.status)
)
_THIS_KEY: Final = (_scope == bindparam("sg_scope"), _idem_key == bindparam("sg_key"))
_MINE: Final = (*_THIS_KEY, _owner == bindparam("sg_owner"), _status == _IN_PROGRESS_SQL)
_FRESH: Final = {
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
    _t.c.status,
    _t.c.fingerprint,
    _t.c.owner,
    _t.c.attempt,
    _t.c.locked_until_ms,
    _t.c.expires_ms,
    _t.c.response,
    _t.c.checkpoint_name,
    _t.c.checkpoint_data,
    _t.c.error,
    _NOW.label("db_now"),
)


class _Record(NamedTuple):
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


# One statement on PostgreSQL: the claim, or the record that holds the key (the kernel's CTE form).
_CLAIM: Final = _write.InsertOnce(
    _t,
    _NEW_ROW,
    returning=[_t.c.scope],
    read=_RECORD,
    where=and_(_t.c.scope == bindparam("sg_scope"), _t.c.idem_key == bindparam("sg_key")),
)
_READ: Final = select(*_RECORD).where(*_THIS_KEY)
# InnoDB at REPEATABLE READ: a plain SELECT reads the transaction's snapshot,
# which may predate the twin whose row made our INSERT fail; a locking read
# sees the latest committed row.  A shared lock, because the failed INSERT
# already holds one on that index record: twins that each upgraded to an
# exclusive lock would deadlock.
_READ_LOCKING: Final = _READ.with_for_update(read=True)
# An expired record is a brand-new request: everything is reset.
_RECLAIM: Final = (
    update(_t)
    .where(*_THIS_KEY, _t.c.owner == bindparam("sg_old_owner"), _t.c.expires_ms <= _NOW)
    .values({**_FRESH, "response": None, "checkpoint_name": None, "checkpoint_data": None, "error": None})
)
# A dead or released claim is resumed: attempt + 1, checkpoint kept.
_TAKEOVER: Final = (
    update(_t)
    .where(
        *_THIS_KEY,
        _t.c.owner == bindparam("sg_old_owner"),
        _t.c.status == _IN_PROGRESS_SQL,
        _t.c.locked_until_ms <= _NOW,
        _t.c.expires_ms > _NOW,
    )
    .values(
        owner=bindparam("sg_owner"),
        attempt=_t.c.attempt + 1,
        locked_until_ms=_LEASE_END,
        updated_ms=_NOW,
    )
)


def _owned_update(**values: Any) -> Any:
    """``UPDATE ... SET values, updated_ms = db_now WHERE key AND owner = :me AND status = 'in_progress'``."""
    return _write.frozen(update(_t).where(*_MINE).values(updated_ms=_NOW, **values))


_COMPLETE: Final = _owned_update(
    status=_COMPLETED_SQL, response=bindparam("sg_text"), locked_until_ms=null(), expires_ms=_EXPIRY
)
# Same transaction, a record this call inserted: its expiry (the claim's time plus ttl) is kept, so
# no indexed column changes (expires_ms is indexed, for purging) and PostgreSQL can update the row
# in place (a HOT update: no new index entries, less WAL).  The claim and its completion commit
# together, so the key is kept ttl from the claim rather than from the completion: the block's
# duration less.
_COMPLETE_FRESH: Final = _owned_update(
    status=_COMPLETED_SQL, response=bindparam("sg_text"), locked_until_ms=null()
)
_FAIL: Final = _owned_update(
    status=_FAILED_SQL, error=bindparam("sg_text"), locked_until_ms=null(), expires_ms=_EXPIRY
)
# Released: still in progress, with a lease that ended now, so the next
# caller takes it over at once and reads the checkpoint.
_RELEASE: Final = _owned_update(locked_until_ms=0, error=bindparam("sg_text"))
# Forgotten: this owner's record is gone, so any request may claim the key anew.
_FORGET: Final = delete(_t).where(*_MINE)
# Same transaction, a new record claimed outside the block's savepoint: undone (completed or not).
_UNCLAIM: Final = delete(_t).where(*_THIS_KEY, _t.c.owner == bindparam("sg_owner"))
# Not a released claim (locked_until_ms = 0): a heartbeat racing its own
# release() must not lease the key again, or the next retry waits a whole lease.
_HEARTBEAT: Final = (
    update(_t)
    .where(*_MINE, _t.c.locked_until_ms > 0)
    .values(updated_ms=_NOW, locked_until_ms=_LEASE_END, expires_ms=_EXPIRY)
)
_CHECKPOINT: Final = _owned_update(
    checkpoint_name=bindparam("sg_name"),
    checkpoint_data=bindparam("sg_text"),
    locked_until_ms=_LEASE_END,
    expires_ms=_EXPIRY,
)


# --------------------------------------------------------------------------
# The call
# --------------------------------------------------------------------------


class IdempotentCall(DualObject[S]):
    """What :func:`idempotent` found for a key, and the way to finish it.

    - ``replayed``: ``True`` when the key was completed before; ``response``
      is the stored response (after a serializer round trip).  Do not run
      the work again.
    - otherwise this call owns the key: do the work, then
      ``return call.complete(response)``.  ``attempt`` counts the claims of
      this key (1 for a first call); ``taken_over`` is ``True`` when an
      earlier claim died or was released, and ``checkpoint_name`` /
      ``checkpoint_data`` then hold its last :meth:`checkpoint`.

    With an AsyncSession (``async with idempotent(...) as call``) the
    attributes are the same and ``complete``, ``checkpoint``, ``heartbeat``
    and ``release`` are awaited::

        return await call.complete({"payment_id": payment.id})
    """

    #: ``True`` when the key was completed before: return :attr:`response`, do not run the work again.
    replayed: bool = False
    #: The stored response of a replay (after a serializer round trip).
    response: Any = None
    #: How many times the key was claimed (1 for a first call).
    attempt: int = 1
    #: ``True`` when an earlier claim died or was released and this call resumed it.
    taken_over: bool = False
    #: The last :meth:`checkpoint` of a taken-over claim.
    checkpoint_name: str | None = None
    #: Its data (after a serializer round trip).
    checkpoint_data: Any = None

    def __init__(self, claim: _Claim[S], state: str = "open") -> None:
        super().__init__(claim.face)
        self._claim = claim
        #: "replayed", "open", "completed", "released", "failed" or "lost".
        self._state = state

    @property
    def scope(self) -> str:
        """The key's scope."""
        return self._claim.options.scope

    @property
    def key(self) -> str:
        """The idempotency key."""
        return self._claim.options.key

    @property
    def mode(self) -> Mode:
        """``"same_transaction"`` or ``"separate"``."""
        return self._claim.options.mode

    def _complete(self, response: R) -> R:
        """Store ``response`` as the key's result and return it.

        In same-transaction mode the record commits with the caller's
        transaction; in separate mode this commits the session (the last
        phase's writes and the response land together).  A replay of this key
        returns ``response`` through the serializer (JSON by default)::

            return call.complete({"payment_id": payment.id})

        :raises InvalidArgument: the response cannot be stored (not
            serialisable, NaN, nested too deeply, a NUL or lone surrogate in
            its text, larger than the server accepts): nothing was sent and
            the call stays open; or the call is a replay or already finished.
        :raises LeaseLost: the lease expired and another worker took the key
            over; its record was left as it was.
        """
        self._check_open("complete")
        claim = self._claim
        text = _dump(claim.options.serializer, response, "response")
        fresh = claim._fresh and claim.options.mode == "same_transaction"
        claim.write(self, _COMPLETE_FRESH if fresh else _COMPLETE, {"sg_text": text}, "completed")
        return response

    def _checkpoint(self, name: str, data: Any = None) -> None:
        """Record a recovery point (Stripe's atomic phases) and extend the lease.

        A worker that takes this key over after a crash finds ``name`` and
        ``data`` in its call's ``checkpoint_name`` / ``checkpoint_data``.  In
        separate mode this commits the session, so the phase's writes and its
        recovery point land together::

            if call.checkpoint_name != "charged":
                charge_id = psp.charge(...)                # outside system
                call.checkpoint("charged", {"charge_id": charge_id})

        :raises InvalidArgument: bad ``name``, or ``data`` that cannot be
            stored (as for :meth:`complete`); nothing was sent.
        :raises LeaseLost: the key was taken over.
        """
        self._check_open("checkpoint")
        _write.check_text(name, "checkpoint name", 100)
        claim = self._claim
        serializer = claim.options.serializer
        text = _dump(serializer, data, "checkpoint data")
        claim.write(self, _CHECKPOINT, {"sg_name": name, "sg_text": text}, None)
        self.checkpoint_name = name
        self.checkpoint_data = serializer.loads(text)

    def _heartbeat(self) -> None:
        """Extend the lease by ``lease`` from now, for work that takes longer than one lease.

        In separate mode it commits in its own short transaction (the
        session's work is not committed); ``heartbeat_every=`` does this from
        a background thread::

            for chunk in chunks:
                process(chunk)
                call.heartbeat()

        :raises LeaseLost: the key was taken over meanwhile.
        """
        self._check_open("heartbeat")
        self._claim.heartbeat(self)

    def _release(self, reason: str | None = None, *, forget: bool = False) -> None:
        """Give the key back without a response, so the next retry runs the work (e.g. after a 5xx).

        In separate mode the release commits the session; the record keeps
        the last checkpoint (and the request's fingerprint) for the next
        attempt.  ``forget=True`` deletes this call's record instead, so any
        request may use the key again, not only the same one (the HTTP
        middleware does this for requests refused before they ran).  In
        same-transaction mode it rolls back the savepoint: the claim and
        everything the block wrote, exactly as an exception would (the key
        is then as it was before this call, ``forget`` or not)::

            if response.status_code >= 500:
                call.release("upstream failed")

        :raises InvalidArgument: ``reason`` is not a str, longer than 2,000
            characters, or holds a NUL or lone surrogate; nothing was sent.
        :raises LeaseLost: the key was taken over meanwhile.
        """
        self._check_open("release")
        if reason is not None:
            if not isinstance(reason, str):
                raise InvalidArgument(f"release reason must be a str or None, got {type(reason).__name__}")
            if len(reason) > _MAX_ERROR:
                raise InvalidArgument(
                    f"release reason is {len(reason)} characters long; the limit is {_MAX_ERROR}"
                )
            _write.check_storable(reason, "release reason")
        self._claim.release(self, reason, forget)

    complete = dual_member(_complete)
    checkpoint = dual_member(_checkpoint)
    heartbeat = dual_member(_heartbeat)
    release = dual_member(_release)

    def _check_open(self, what: str) -> None:
        if self._state != "open":
            if self._state == "replayed":
                raise InvalidArgument(
                    f"cannot {what} idempotency key {self.key!r} in scope {self.scope!r}: this call replayed "
                    f"the stored response; return call.response instead"
                )
            raise InvalidArgument(
                f"cannot {what} idempotency key {self.key!r} in scope {self.scope!r}: the call is already "
                f"{self._state}"
            )

    def __repr__(self) -> str:
        return (
            f"<IdempotentCall scope={self.scope!r} key={self.key!r} {self._state} attempt={self.attempt}"
            f"{' taken_over' if self.taken_over else ''}>"
        )


@dataclass(slots=True)
class _Options:
    """The checked options of one :func:`idempotent` call (lease and ttl in ms, the heartbeat in seconds)."""

    scope: str
    key: str
    lease_ms: int
    ttl_ms: int
    mode: Mode
    serializer: Serializer
    heartbeat_every: float | None
    non_retryable: tuple[type[BaseException], ...]


class _Claim(Generic[S]):
    """The claim of one key: the whole algorithm, written once against a Session; a one-use context manager.

    :func:`idempotent` wraps it in a :class:`~stateguard._async.DualContext`,
    which runs it inside ``run_sync`` for an AsyncSession; ``face`` is the
    session the caller passed, so the :class:`IdempotentCall` it hands out
    answers in the caller's kind (awaitables for an AsyncSession).
    """

    def __init__(self, session: Session, face: S, options: _Options, fingerprint: str | None) -> None:
        self.session = session
        self.face = face
        self.options = options
        self.fingerprint = fingerprint
        # 128 random bits as 32 hex characters (uuid4().hex without the UUID object: a third of the cost).
        self.owner = owner = os.urandom(16).hex()
        self._base_params = {
            "sg_scope": options.scope,
            "sg_key": options.key,
            "sg_fp": fingerprint,
            "sg_owner": owner,
            "sg_lease": options.lease_ms,
            "sg_ttl": options.ttl_ms,
        }
        self.call: IdempotentCall[S] | None = None
        #: Same transaction: the savepoint of the block (sent before its first statement).
        self._block_savepoint: _write.DeferredSavepoint | None = None
        #: Same transaction: this call inserted the record (outside the savepoint).
        self._fresh = False
        self._conn: Connection | None = None
        #: Same transaction: where the session runs statements on the keys table.
        self._binds: dict[str, Any] = {}
        self._engine: Engine | None = None
        self._stop: threading.Event | None = None
        self._beater: threading.Thread | None = None
        #: Separate mode with heartbeat_every: the background heartbeat's own connection.
        self._beat_conn: Connection | None = None
        #: Set before the write that ends the claim (complete, fail, release) is sent: a
        #: heartbeat that then finds no claim of ours in progress lost nothing.  No lock:
        #: with an AsyncSession both run on the event loop's thread.
        self._finishing = False

    def _emit(self, kind: str, attempt: int | None) -> None:
        _emit(kind, self.options.scope, self.options.key, attempt, self.options.mode)

    @property
    def _name(self) -> str:
        return f"idempotency key {self.options.key!r} in scope {self.options.scope!r}"

    def _refuse(self, kind: str, attempt: int, cls: Callable[..., E], message: str, **found: Any) -> E:
        """Emit ``kind`` and build the error ``cls`` about this key, carrying the scope, key and ``found``."""
        self._emit(kind, attempt)
        return cls(message, scope=self.options.scope, key=self.options.key, **found)

    # -- entering ----------------------------------------------------------

    def __enter__(self) -> IdempotentCall[S]:
        if self.call is not None:
            raise InvalidArgument(
                "an idempotent() context manager can be entered only once; call idempotent() again"
            )
        if self.options.mode == "same_transaction":
            self.call = self._enter_same()
        else:
            self.call = self._enter_separate()
        if self.options.heartbeat_every is not None and self.call._state == "open":
            self._start_heartbeat()
        else:
            self._close_beat_conn()  # replayed or refused: nothing to keep alive
        return self.call

    def _enter_same(self) -> IdempotentCall[S]:
        # The claim needs no SAVEPOINT: its INSERT cannot abort the transaction
        # (ON CONFLICT DO NOTHING; InnoDB rolls back only a duplicate-key
        # statement).  The block gets one, sent before its first statement
        # (none if it sends none): an exception rolls back the block's writes,
        # and the claim is deleted (a new record) or rolled back with the
        # savepoint (a takeover or reclaim, which opens it before its UPDATE).
        # A replay wrote nothing and its block only returns the response: no savepoint.
        session = self.session
        self._binds = {"bind": _write.own_bind(session, idempotency_keys)}
        conn = self._conn = session.connection(bind_arguments=self._binds)
        try:
            call = self._claim(conn)
        except BaseException:
            self._drop_savepoint()
            raise
        if self._block_savepoint is None and call._state == "open":
            self._block_savepoint = _write.DeferredSavepoint(session, conn, self._binds)
        return call

    def _savepoint_now(self) -> None:
        """Same transaction: open the block's savepoint before an UPDATE of an existing record."""
        if self.options.mode == "same_transaction" and self._block_savepoint is None:
            conn = self._open(self._conn)
            self._block_savepoint = _write.DeferredSavepoint(self.session, conn, self._binds)
            self._block_savepoint.open()

    def _drop_savepoint(self) -> None:
        """Roll back the block's savepoint (if it was sent) and stop watching the connection."""
        savepoint, self._block_savepoint = self._block_savepoint, None
        if savepoint is not None:
            savepoint.close()
            _write.abandon_savepoint(savepoint.nested)

    def _undo_same(self) -> None:
        """Same transaction, the block failed or was released: its writes and the claim are undone."""
        conn = self._conn
        self._drop_savepoint()
        if self._fresh and conn is not None:
            self._fresh = False
            try:
                _write.execute(conn, _UNCLAIM, self._params())
            except (sa_exc.DBAPIError, sa_exc.PendingRollbackError, sa_exc.ResourceClosedError):
                # The transaction is aborted or gone (a deadlock on MariaDB, a lost connection, a
                # statement cancelled by an asyncio task's cancellation, which invalidates the
                # connection): the record cannot be committed with it either, and the block's own
                # exception is what the caller must see.
                log.warning(
                    "could not delete the claim of %s after its block failed", self._name, exc_info=True
                )

    def _enter_separate(self) -> IdempotentCall[S]:
        if self.session.in_transaction():
            # checkpoint() and complete() commit the session; inside `with
            # session.begin():` (or with uncommitted work) that would commit
            # someone else's unit of work, or fail.
            raise InvalidArgument(
                "mode='separate' commits the session at checkpoint() and complete(), so it must start "
                "with no transaction open: commit or roll back first, and do not wrap it in "
                "`with session.begin():`"
            )
        bind = _write.own_bind(self.session, _t)
        engine = bind if isinstance(bind, Engine) else bind.engine
        self._engine = engine
        if self.options.heartbeat_every is not None:
            # The background heartbeat's own connection, checked out before the
            # claim: a block that holds the pool's last connection would
            # otherwise starve every beat, the lease would lapse while the
            # owner works, and a retry would take the key over and run the
            # work twice.  No connection: nothing was claimed (the pool's error).
            self._beat_conn = engine.connect()
        for attempt in range(1, _CLAIM_ATTEMPTS + 1):
            try:
                with engine.begin() as conn:
                    return self._claim(conn)
            except BaseException as error:
                # Our own short transaction: twins taking over one record on
                # MariaDB can deadlock on their shared read locks; the loser
                # simply looks again.
                if attempt < _CLAIM_ATTEMPTS and isinstance(error, SerializationConflict | DeadlockDetected):
                    continue
                self._close_beat_conn()
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _params(self) -> dict[str, Any]:
        """The parameters every statement of this claim takes (a new dict each time)."""
        return self._base_params.copy()

    def _claimed(self) -> IdempotentCall[S]:
        self._fresh = True
        self._emit("claimed", 1)
        return IdempotentCall(self)

    def _claim(self, conn: Connection) -> IdempotentCall[S]:
        backend = _sql.backend(conn.dialect)
        params = self._params()
        # PostgreSQL: one statement claims the key or returns its record.
        inserted, values = _CLAIM.insert_or_read(conn, params)
        if inserted:
            return self._claimed()
        row: Any = None if values is None else _Record._make(values)
        read = _READ_LOCKING if backend.locking_read else _READ
        for _ in range(_MAX_ROUNDS):
            if row is None:
                # Not read yet (MariaDB, SQLite; PostgreSQL after waiting for a twin that committed).
                row = _write.execute(conn, read, params).first()
            if row is None:
                # Purged (or its claimant rolled back) between our statements.
                if _CLAIM(conn, params) is not None:
                    return self._claimed()
                continue
            call = self._decide(conn, row, params)
            if call is not None:
                return call
            row = None
        raise SerializationConflict(
            f"{self._name} changed {_MAX_ROUNDS} times while it was being claimed; retry the request"
        )

    def _decide(self, conn: Connection, row: Any, params: dict[str, Any]) -> IdempotentCall[S] | None:
        """Act on the record found; None when a conditional UPDATE lost a race (read again).

        ``now`` is the database's clock as the read saw it; the UPDATEs that
        act on what was read judge the lease again on their own statement's clock.
        """
        now = row.db_now
        options = self.options
        if row.expires_ms <= now:
            self._savepoint_now()
            if _write.execute(conn, _RECLAIM, {**params, "sg_old_owner": row.owner}).rowcount != 1:
                return None
            return self._claimed()
        if (
            self.fingerprint is not None
            and row.fingerprint is not None
            and row.fingerprint != self.fingerprint
        ):
            raise self._refuse(
                "key_reused",
                row.attempt,
                IdempotencyKeyReused,
                f"{self._name} was first used for a different request (another fingerprint); send a new key "
                f"for a new request",
            )
        if row.status == _COMPLETED:
            self._emit("replayed", row.attempt)
            call = IdempotentCall(self, "replayed")
            call.replayed, call.attempt = True, row.attempt
            call.response = _load(options.serializer, row.response)
            return call
        if row.status == _FAILED:
            raise self._refuse(
                "failed_replayed",
                row.attempt,
                RequestFailed,
                f"the request of {self._name} failed with a non-retryable error ({row.error}); use a new key "
                f"to try again",
                error=row.error,
            )
        locked_until = row.locked_until_ms or 0
        if locked_until > now:
            raise self._refuse(
                "in_progress",
                row.attempt,
                RequestInProgress,
                f"{self._name} is being worked on by another request; retry after its lease ends",
                retry_after=timedelta(milliseconds=locked_until - now),
            )
        self._savepoint_now()
        if _write.execute(conn, _TAKEOVER, {**params, "sg_old_owner": row.owner}).rowcount != 1:
            return None
        call = IdempotentCall(self)
        call.attempt, call.taken_over = row.attempt + 1, True
        self._emit("taken_over", call.attempt)
        call.checkpoint_name = row.checkpoint_name
        call.checkpoint_data = _load(options.serializer, row.checkpoint_data)
        return call

    # -- writes of an open call ---------------------------------------------

    def write(self, call: IdempotentCall[S], stmt: Any, extra: dict[str, Any], kind: str | None) -> None:
        """Run one owner-conditional UPDATE of the record (and in separate mode commit the session)."""
        params = {**self._base_params, **extra}
        if kind is not None:
            self._finishing = True
        text = extra.get("sg_text")
        try:
            if self.options.mode == "same_transaction":
                with self._open(self._block_savepoint).paused() as conn:
                    if text is not None:
                        self._check_size(conn, text)
                    matched = _write.execute(conn, stmt, params).rowcount
            else:
                session = self.session
                try:
                    conn = _write.own_connection(session, idempotency_keys)
                    if text is not None:
                        self._check_size(conn, text)
                    matched = _write.execute(conn, stmt, params).rowcount
                    if matched == 1:
                        session.commit()
                except InvalidArgument:
                    raise  # refused before sending: the phase's work is not rolled back
                except BaseException:
                    session.rollback()
                    raise
                if matched != 1:
                    session.rollback()
        except BaseException:
            self._finishing = False  # nothing ended: the call is still open and may be finished again
            raise
        if matched != 1:
            self._lost(call)
        if kind is not None:
            self._stop_heartbeat()
            call._state = kind
            self._emit(kind, call.attempt)

    def _check_size(self, conn: Connection, text: str) -> None:
        """InvalidArgument (nothing sent) when ``text`` cannot travel to the server in one statement."""
        if _write.needs_size_check(conn, text):
            _write.check_statement_size(conn, text, f"the stored value of {self._name}")

    def heartbeat(self, call: IdempotentCall[S], dedicated: Connection | None = None) -> None:
        """Extend the lease; LeaseLost when another owner took the key (not when this owner finished it).

        ``dedicated``: the background heartbeat's own connection (separate mode).
        """
        if self._finishing or call._state != "open":
            return  # this owner is completing, failing or releasing the claim: nothing to keep alive
        params = self._params()
        if self.options.mode == "same_transaction":
            with self._open(self._block_savepoint).paused() as conn:
                matched = _write.execute(conn, _HEARTBEAT, params).rowcount
        elif dedicated is not None:
            with dedicated.begin():
                matched = _write.execute(dedicated, _HEARTBEAT, params).rowcount
        else:
            with self._open(self._engine).begin() as conn:
                matched = _write.execute(conn, _HEARTBEAT, params).rowcount
        if matched != 1:
            if self._finishing or call._state != "open":
                # Its own complete()/fail/release() ended the claim between the check
                # above and this UPDATE: that write reports a real loss itself.
                return
            self._lost(call)

    def release(self, call: IdempotentCall[S], reason: str | None, forget: bool = False) -> None:
        if self.options.mode == "same_transaction":
            self._stop_heartbeat()
            self._open(self._block_savepoint)
            self._undo_same()
            call._state = "released"
            self._emit("released", call.attempt)
            return
        if forget:
            self.write(call, _FORGET, {}, "released")
        else:
            self.write(call, _RELEASE, {"sg_text": reason}, "released")

    def _open(self, part: T | None) -> T:
        """A part of the open claim (its connection, savepoint, call ...); InvalidArgument once it is over."""
        if part is None:
            raise InvalidArgument(f"{self._name} is not open: use the call inside its with block")
        return part

    def _lost(self, call: IdempotentCall[S]) -> None:
        self._stop_heartbeat()
        call._state = "lost"
        raise self._refuse(
            "lease_lost",
            call.attempt,
            LeaseLost,
            f"the lease on {self._name} expired and another request took the key over; its record was left "
            f"untouched. Use a longer lease or heartbeat() for long work",
        )

    # -- background heartbeat -----------------------------------------------

    def _start_heartbeat(self) -> None:
        stop = threading.Event()
        call, interval = self._open(self.call), self._open(self.options.heartbeat_every)
        key = self.options.key
        dedicated = self._beat_conn

        def beat() -> None:
            while not stop.wait(interval):
                try:
                    self.heartbeat(call, dedicated)
                except LeaseLost:
                    return
                except Exception:  # the database is away: the next beat tries again
                    log.warning(
                        "heartbeat of idempotency key %r in scope %r failed",
                        key,
                        self.options.scope,
                        exc_info=True,
                    )

        self._stop = stop
        self._beater = threading.Thread(target=beat, name=f"stateguard-heartbeat:{key[:40]}", daemon=True)
        self._beater.start()

    def _stop_heartbeat(self) -> None:
        stop, beater = self._stop, self._beater
        if stop is None or beater is None:
            if self._beat_conn is not None:
                self._close_beat_conn()
            return
        self._stop = self._beater = None
        stop.set()
        if beater is not threading.current_thread():
            beater.join()
            self._close_beat_conn()

    def _close_beat_conn(self) -> None:
        conn, self._beat_conn = self._beat_conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # a broken connection is discarded by the pool
                conn.close()

    # -- leaving -------------------------------------------------------------

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # With an AsyncSession this runs also on cancellation (CancelledError):
        # the savepoint is rolled back (same transaction) or the key released
        # (separate), so it is free again.
        call = self.call
        if call is None:
            return
        self._stop_heartbeat()
        if exc is None:
            if call._state == "open":
                # The block finished without complete(): its work is done, the response is None.
                call._complete(None)
            savepoint, self._block_savepoint = self._block_savepoint, None
            if savepoint is not None:
                savepoint.end()
            return
        if self.options.mode == "same_transaction":
            self._undo_same()
            if call._state == "open":
                call._state = "released"
                self._emit("released", call.attempt)
            return
        if call._state != "open":
            return
        self._finish_failed(call, exc)

    def _finish_failed(self, call: IdempotentCall[S], exc: BaseException) -> None:
        """Separate mode, the block raised: roll the session back, then release or fail the key.

        Nothing here may replace the block's own exception: if the database is
        unreachable, the claim stays in progress and the next retry takes it
        over once the lease ends.
        """
        # Sanitised: a NUL (PostgreSQL) or lone surrogate in the message must not
        # make this write fail and leave the key in progress for a whole lease.
        text = _exception_text(exc)
        options = self.options
        try:
            self.session.rollback()
            if isinstance(exc, options.non_retryable):
                self.write(call, _FAIL, {"sg_text": text}, "failed")
            else:
                self.write(call, _RELEASE, {"sg_text": text}, "released")
        except LeaseLost:
            exc.add_note(
                f"stateguard: the lease on {self._name} had been taken over; the new owner's record was "
                f"left untouched"
            )
        except Exception:
            # The database is unreachable: the claim stays in progress and the
            # next retry takes it over once the lease ends.
            log.warning(
                "could not release idempotency key %r in scope %r; it is taken over when its lease ends",
                options.key,
                options.scope,
                exc_info=True,
            )


def _options(
    scope: Any,
    key: Any,
    lease: Any,
    ttl: Any,
    mode: Any,
    serializer: Serializer | None,
    heartbeat_every: Any,
    non_retryable: Any,
) -> _Options:
    """Check the options of :func:`idempotent` (nothing is written before they pass)."""
    _write.check_text(scope, "scope", MAX_SCOPE)
    _write.check_text(key, "idempotency key", MAX_KEY)
    policy: tuple[Any, ...] = (lease, ttl, mode, heartbeat_every, non_retryable)
    try:
        lease_ms, ttl_ms, mode, interval, non_retryable = _checked_policy(*policy)
    except TypeError:  # an unhashable argument: checked without the memo (and most likely refused)
        lease_ms, ttl_ms, mode, interval, non_retryable = _check_policy(*policy)
    # The caller's own serializer object, never an equal one memoised from another call.
    return _Options(
        scope,
        key,
        lease_ms,
        ttl_ms,
        mode,
        _JSON if serializer is None else serializer,
        interval,
        non_retryable,
    )


def _check_policy(
    lease: Any,
    ttl: Any,
    mode: Any,
    heartbeat_every: Any,
    non_retryable: Any,
) -> tuple[int, int, Mode, float | None, tuple[type[BaseException], ...]]:
    """The options other than scope, key and serializer, checked: ``(lease_ms, ttl_ms, mode, heartbeat
    interval in seconds, non_retryable)``."""
    lease_ms = _write.duration_ms(lease, "lease")
    ttl_ms = _write.duration_ms(ttl, "ttl")
    if ttl_ms < lease_ms:
        raise InvalidArgument(f"ttl ({ttl}) must not be shorter than lease ({lease})")
    if mode not in ("same_transaction", "separate"):
        raise InvalidArgument(f"mode must be 'same_transaction' or 'separate', got {mode!r}")
    interval: float | None = None
    if heartbeat_every is not None:
        if mode != "separate":
            raise InvalidArgument(
                "heartbeat_every needs mode='separate': in same_transaction mode the claim is invisible to "
                "other transactions until it commits, so there is no lease to keep alive"
            )
        interval = _write.duration_ms(heartbeat_every, "heartbeat_every") / 1000
        if interval * 1000 >= lease_ms:
            raise InvalidArgument(f"heartbeat_every ({heartbeat_every}) must be shorter than lease ({lease})")
    if isinstance(non_retryable, type):
        non_retryable = (non_retryable,)
    if not isinstance(non_retryable, tuple) or not all(
        isinstance(t, type) and issubclass(t, BaseException) for t in non_retryable
    ):
        raise InvalidArgument(f"non_retryable must be a tuple of exception classes, got {non_retryable!r}")
    if non_retryable and mode != "separate":
        raise InvalidArgument(
            "non_retryable needs mode='separate': in same_transaction mode a failure rolls back with the "
            "transaction, so there is no failure record to keep"
        )
    return lease_ms, ttl_ms, mode, interval, non_retryable


#: An application passes the same few policies (lease, ttl, mode ...) on every call: each is checked once.
#: Only valid ones are kept (a refusal raises, and lru_cache keeps no exception).
_checked_policy: Final = functools.lru_cache(maxsize=64)(_check_policy)


def idempotent(
    session: SessionT,
    *,
    scope: str,
    key: str,
    fingerprint: Any = None,
    lease: timedelta = timedelta(seconds=60),
    ttl: timedelta = timedelta(hours=24),
    mode: Mode = "same_transaction",
    serializer: Serializer | None = None,
    heartbeat_every: timedelta | None = None,
    non_retryable: tuple[type[BaseException], ...] = (),
) -> DualContext[IdempotentCall[SessionT]]:
    """Run a block at most once per ``(scope, key)``; replay its stored response to retries.

    ::

        with idempotent(session, scope=f"payments:{client_id}", key=key, fingerprint=body) as call:
            if call.replayed:
                return call.response
            payment = Payment(amount=body["amount"]); session.add(payment); session.flush()
            return call.complete({"payment_id": payment.id})

    :param scope: a namespace for keys (put the client identity in it: keys
        are chosen by clients and must not collide across them); at most
        200 characters.
    :param key: the idempotency key, compared byte-exact, stored as given;
        at most 255 characters, not blank.
    :param fingerprint: the request (any JSON-serialisable value, or bytes);
        only its SHA-256 is stored.  The same key with another fingerprint
        raises :class:`~stateguard.IdempotencyKeyReused`.  ``None`` skips
        the check.
    :param lease: how long a claim is held before another caller may take it
        over (separate mode).
    :param ttl: how long the key and its response are kept: from completion
        (same transaction: from the claim, which commits with the completion).
    :param mode: ``"same_transaction"`` (the claim, the block's writes and the
        response commit together; an exception frees the key) or
        ``"separate"`` (the claim commits first; for outside side effects).
    :param serializer: stores responses and checkpoint data (JSON by default).
    :param heartbeat_every: separate mode: extend the lease from a background
        thread this often (shorter than ``lease``).
    :param non_retryable: separate mode: exception classes that mark the key
        failed for good (retries get :class:`~stateguard.RequestFailed`);
        any other exception releases the key for a retry.
    With an :class:`~sqlalchemy.ext.asyncio.AsyncSession`, use ``async with``;
    the call's methods are then awaited, and a task cancelled inside the
    block frees the key like an exception does.

    :raises InvalidArgument: bad arguments (nothing written).
    :raises RequestInProgress: on entering, another caller holds a live lease.
    :raises IdempotencyKeyReused: on entering, the key was used for another request.
    :raises RequestFailed: on entering, the key's request failed for good.
    """
    options = _options(scope, key, lease, ttl, mode, serializer, heartbeat_every, non_retryable)
    if isinstance(session, AsyncSession):
        if options.heartbeat_every is not None:
            raise NotSupported(
                "heartbeat_every runs a thread, which cannot use an AsyncSession's connections; "
                "await call.heartbeat() from your own task instead"
            )
        sync_session = session.sync_session
    else:
        session = sync_session = as_session(session, "idempotent()")
    claim = _Claim(sync_session, session, options, fingerprint_of(fingerprint))
    return DualContext(session, lambda _sync: claim, name="idempotent()")


def idempotent_function(
    *,
    scope: str | Callable[..., str],
    key: Callable[..., str],
    fingerprint: Callable[..., Any] | None = None,
    lease: timedelta = timedelta(seconds=60),
    ttl: timedelta = timedelta(hours=24),
    mode: Mode = "same_transaction",
    serializer: Serializer | None = None,
    heartbeat_every: timedelta | None = None,
    non_retryable: tuple[type[BaseException], ...] = (),
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a function whose first positional argument is the session: it runs once per key.

    ``key`` (and ``scope`` and ``fingerprint`` when callables) receive the
    function's own arguments.  The return value is stored as the response and
    returned to every replay (through the serializer)::

        @idempotent_function(scope="refunds", key=lambda session, refund_id, amount: refund_id,
                             fingerprint=lambda session, refund_id, amount: {"amount": amount})
        def refund(session: Session, refund_id: str, amount: int) -> dict:
            ...
            return {"refunded": amount}

    Options are those of :func:`idempotent`; they are checked when decorating.
    An ``async def`` function takes an AsyncSession and is awaited the same way.
    """
    _options(
        "scope" if callable(scope) else scope,
        "key",
        lease,
        ttl,
        mode,
        serializer,
        heartbeat_every,
        non_retryable,
    )
    if not callable(key):
        raise InvalidArgument(
            "key must be a callable that receives the function's arguments and returns the key"
        )

    def manager_for(fn: Callable[..., Any], session_type: type, args: Any, kwargs: Any) -> Any:
        if not args or not isinstance(args[0], session_type):
            raise InvalidArgument(
                f"{fn.__qualname__}() is @idempotent_function: its first positional argument must be "
                f"the {session_type.__name__}"
            )
        return idempotent(
            args[0],
            scope=scope(*args, **kwargs) if callable(scope) else scope,
            key=key(*args, **kwargs),
            fingerprint=None if fingerprint is None else fingerprint(*args, **kwargs),
            lease=lease,
            ttl=ttl,
            mode=mode,
            serializer=serializer,
            heartbeat_every=heartbeat_every,
            non_retryable=non_retryable,
        )

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        if inspect.iscoroutinefunction(fn):
            # async def f(session: AsyncSession, ...): the same, with `async with`.
            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                manager: DualContext[IdempotentCall[AsyncSession]] = manager_for(
                    fn, AsyncSession, args, kwargs
                )
                async with manager as call:
                    if call.replayed:
                        return call.response
                    return await call.complete(await fn(*args, **kwargs))

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            manager: DualContext[IdempotentCall[Session]] = manager_for(fn, Session, args, kwargs)
            with manager as call:
                if call.replayed:
                    return call.response  # type: ignore[no-any-return]
                return call.complete(fn(*args, **kwargs))

        return wrapper

    return decorate


@dual_bind
def purge_expired(bind: Engine | Connection | Session, *, batch: int = 1000) -> int:
    """Delete at most ``batch`` expired idempotency keys and return how many were deleted.

    With an :class:`~sqlalchemy.Engine` the batch runs in its own short
    transaction; with a ``Connection`` or ``Session`` in the caller's (the
    caller commits).  On PostgreSQL the batch skips rows locked by a claim in
    flight, so a purge never makes a claim wait; on MariaDB and SQLite a
    batch holds its locks only for one short DELETE.  Loop until it returns
    less than ``batch`` (``stateguard purge`` does)::

        while purge_expired(engine, batch=1000) == 1000:
            time.sleep(0.05)

    Expired keys are already ignored by claims; purging only reclaims space.

    :raises InvalidArgument: ``batch`` is not a positive int.
    """
    return _write.purge_rows(_t, bind, batch)


#: Names this module defined before the 0.2 layout, and where they live now.
_MOVED: Final = {"consume_once": "stateguard.inserts", "ConsumedMessage": "stateguard.inserts"}


def __getattr__(name: str) -> Any:
    return _compat.moved(__name__, name, _MOVED)
