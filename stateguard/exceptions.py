"""The exceptions stateguard raises.

Every exception derives from :class:`StateguardError` and has a ``retryable``
attribute: ``True`` only when running the *whole unit of work* again in a new
transaction may succeed (see :func:`stateguard.retry_on_conflict`).

::

    StateguardError                      retryable=False
    ├── ConfigurationError               a declaration is wrong (raised at class definition)
    ├── InvalidArgument (ValueError)     a call got bad input; nothing was written
    │   └── UnknownTrigger (AttributeError)
    ├── NotSupported                     the backend cannot do this honestly
    ├── OutcomeError                     raised by Result.raise_for_outcome()
    │   ├── TransitionRejected           the row's state does not allow the trigger
    │   ├── StaleVersion (StaleDataError) the row's version is not the expected one
    │   ├── NotFound (LookupError)       no such row
    │   └── InsufficientQuantity         a guarded counter would cross its bound
    ├── RefConflict                      a counter ref was reused with a different amount
    ├── LockNotAcquired                  retryable=True: a lock was held (NOWAIT / timeout)
    ├── LockLost                         a lock expired and another holder took it
    │   ├── LeaseLost                    an idempotency key's lease was taken over
    │   └── WorkerLeaseLost              a Snowflake's worker-id lease was taken over
    ├── ReplicationTimeout               a write is on the primary, not confirmed by its replicas
    ├── PublishFailed                    retryable=True: a broker did not take an outbox batch
    ├── WorkerIdsExhausted               retryable=True: every Snowflake worker id is leased
    ├── RequestInProgress                an idempotency key is being worked on (.retry_after)
    ├── IdempotencyKeyReused             a key came back with a different request fingerprint
    ├── RequestFailed                    an idempotency key's request failed for good (.error)
    ├── TransactionAborted               an earlier statement failed: roll the transaction back
    └── SerializationConflict            retryable=True: serialization failure / busy snapshot
        └── DeadlockDetected             retryable=True: the database broke a deadlock

``OutcomeError`` instances carry what was found: ``.model``, ``.key``,
``.trigger`` (``None`` outside transitions), ``.state`` and the full
``.result``.  ``StaleVersion`` also carries ``.expected_version`` and
``.version``, and is a subclass of SQLAlchemy's
:class:`~sqlalchemy.orm.exc.StaleDataError`, so existing handlers for ORM
version conflicts keep working.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm.exc import StaleDataError

if TYPE_CHECKING:
    from .result import Result

__all__ = [
    "ConfigurationError",
    "DeadlockDetected",
    "IdempotencyKeyReused",
    "InsufficientQuantity",
    "InvalidArgument",
    "LeaseLost",
    "LockLost",
    "LockNotAcquired",
    "NotFound",
    "NotSupported",
    "OutcomeError",
    "PublishFailed",
    "RefConflict",
    "ReplicationTimeout",
    "RequestFailed",
    "RequestInProgress",
    "SerializationConflict",
    "StaleVersion",
    "StateguardError",
    "TransactionAborted",
    "TransitionRejected",
    "UnknownTrigger",
    "WorkerIdsExhausted",
    "WorkerLeaseLost",
]


class StateguardError(Exception):
    """Root of every stateguard exception."""

    retryable: bool = False

    def __reduce__(self) -> tuple[Any, ...]:
        # BaseException pickles as cls(*args), which loses keyword-only
        # arguments and attributes (scope, key, result, retry_after...): an
        # error could not come back from a process pool.  Rebuild it without
        # calling __init__, from its args and attributes.
        return _restore, (type(self), self.args, self.__dict__)


def _restore(cls: type[StateguardError], args: tuple[Any, ...], state: dict[str, Any]) -> StateguardError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class ConfigurationError(StateguardError):
    """A declaration (state machine, version column, ...) or the set-up is inconsistent.

    Mostly raised while the mapped class is being defined; at run time when
    stateguard's own tables are missing, or a row's version outgrew its
    column (see :func:`~stateguard.version_column`).
    """


class InvalidArgument(StateguardError, ValueError):
    """A call received bad input.  Nothing was sent to the database."""


class UnknownTrigger(InvalidArgument, AttributeError):
    """The trigger name is not declared on the state machine."""


class NotSupported(StateguardError):
    """The backend cannot provide this operation with its guarantees."""


def _key_repr(key: Any) -> str:
    return repr(key[0]) if isinstance(key, tuple) and len(key) == 1 else repr(key)


class OutcomeError(StateguardError):
    """Base of the errors :meth:`Result.raise_for_outcome` raises."""

    def __init__(self, result: Result, message: str | None = None) -> None:
        self.result = result
        self.model = result.model
        self.key = result.key
        self.trigger = result.trigger
        self.state = result.state
        super().__init__(message or self._message())

    def _where(self) -> str:
        name = getattr(self.model, "__name__", str(self.model))
        return f"{name} {_key_repr(self.key)}"

    def _message(self) -> str:  # pragma: no cover - overridden
        return f"{self._where()}: {self.result.outcome.name}"


class TransitionRejected(OutcomeError):
    """The row exists but its current state does not allow the trigger."""

    def _message(self) -> str:
        return (
            f"{self._where()}: trigger {self.trigger!r} is not allowed from state "
            f"{self.state!r}; reload the row and check its state before retrying "
            f"(this is a business conflict, usually HTTP 409)"
        )


class NotFound(OutcomeError, LookupError):
    """No row has the given primary key."""

    def _message(self) -> str:
        what = f"trigger {self.trigger!r}" if self.trigger else "the update"
        return f"{self._where()} does not exist; {what} changed nothing"


class StaleVersion(OutcomeError, StaleDataError):
    """The row's version is not the one the caller read (someone else wrote it)."""

    def __init__(self, result: Result, message: str | None = None) -> None:
        self.expected_version = result.expected_version
        self.version = result.version
        super().__init__(result, message)

    def _message(self) -> str:
        what = f"trigger {self.trigger!r}" if self.trigger else "the guarded update"
        return (
            f"{self._where()}: {what} expected version {self.expected_version!r} but the "
            f"row is at version {self.version!r} (state {self.state!r}); reload it and "
            f"retry, or use retry_on_conflict()"
        )


class InsufficientQuantity(OutcomeError):
    """A guarded counter change would cross its floor or ceiling."""

    def __init__(self, result: Result, message: str | None = None) -> None:
        self.target = result.key
        self.value = result.value
        super().__init__(result, message)

    def _message(self) -> str:
        found = "" if self.value is None else f" (found {self.value!r})"
        return f"{self._where()}: the change would cross the counter's bound{found}; nothing was changed"


class RefConflict(StateguardError):
    """A counter ``ref`` was used again with a different amount or target."""


class SerializationConflict(StateguardError):
    """The database aborted the statement to keep transactions serializable.

    The transaction is no longer usable: roll it back and run the whole unit
    of work again (``retry_on_conflict`` does that).  The driver's error is
    chained as ``__cause__``.
    """

    retryable = True


class DeadlockDetected(SerializationConflict):
    """The database detected a deadlock and chose this transaction as victim."""


class TransactionAborted(StateguardError):
    """The transaction is aborted: an earlier statement in it failed, so the database refuses the rest.

    PostgreSQL answers every statement after a failed one with
    ``in_failed_sql_transaction`` (SQLSTATE 25P02) until the transaction
    ends.  Nothing was written; roll the transaction back (and find the
    earlier error, which is the real one), then run the unit of work again.
    A statement that may fail without ending the transaction belongs in a
    savepoint (``session.begin_nested()``).  The driver's error is chained as
    ``__cause__``.
    """


class LockNotAcquired(StateguardError):
    """A lock could not be taken: NOWAIT found it held, or the timeout passed.

    After a lock timeout on PostgreSQL the transaction is aborted by the
    failed statement: roll it back (``retry_on_conflict`` retries the whole
    unit of work).  ``row_lock(nowait=True)`` leaves it usable everywhere.
    """

    retryable = True


class LockLost(StateguardError):
    """A lock expired while held and another holder took it.

    Writes made under the lock with its fencing token are protected (a newer
    holder's writes win); anything else done after the expiry was unprotected.
    """


class ReplicationTimeout(StateguardError):
    """A write happened on the primary (Redis master, PostgreSQL), but its replicas did not confirm it.

    **Redis.**  Raised by :class:`~stateguard.RedisTokens` and :class:`~stateguard.RedisLock`
    (and their async forms) built with ``wait_replicas=N`` when Redis ``WAIT``
    returned fewer than ``N`` acknowledgements within ``wait_timeout``.  The
    write **was applied** on the master and is not undone: it is *applied but
    not durable*, and a failover before it reaches a replica can still lose
    it.  ``value`` is what the call would have returned (the token of
    ``issue``, the :class:`~stateguard.Result` of ``consume``, ``None`` for a
    release or an extension); ``acknowledged`` and ``wanted`` are the
    replica counts.  A lock acquisition is the exception: it has given the
    lock back (released it on the master; its message says if that failed)
    and the caller does not hold it; its ``value`` is the unused Redis fence
    the master handed out, ``None`` with ``fences=engine``::

        try:
            r = tokens.consume(token, scope="payout:42")
        except ReplicationTimeout as error:
            r = error.value          # consumed on the master; decide whether to act on it

    **PostgreSQL.**  Raised by the session's commit (``session.commit()``, the
    end of ``with session.begin():``, or :meth:`~stateguard.IdempotentCall.complete`
    in separate mode) of a transaction in which a call asked for
    ``durability="replicated"`` (or ran on an engine given
    :func:`~stateguard.set_durability`), when PostgreSQL cut the COMMIT's wait
    for the synchronous standby short: the wait was cancelled (the
    ``timeout`` of :func:`~stateguard.set_durability`, ``pg_cancel_backend``,
    a client's cancel request), which the server reports only as a WARNING
    ("canceling wait for synchronous replication", "already committed
    locally").  The whole transaction **is committed on the primary** and is
    not undone; only the standby's confirmation is missing.  The session is
    usable again (no transaction open).  ``value`` is the tuple of what the
    durable calls of the transaction returned, in call order (a
    :class:`~stateguard.Result`, an outbox event id, a stored response);
    ``acknowledged`` is 0 and ``wanted`` 1 (standbys).  The transaction's
    ``on_commit`` callbacks were **not** run: ``callbacks`` holds them, each
    callable with no arguments, for the caller to run once it has decided to
    act on the write (for instance after the standby caught up)::

        try:
            with Session(engine) as s, s.begin():
                r = consume_token(s, token, scope="payout", durability="replicated")
                r.on_commit(send_payout)
        except ReplicationTimeout as error:
            [r] = error.value        # consumed on the primary, not confirmed by the standby
            wait_for_standby()       # or alert, or hold the payout for review
            for run in error.callbacks:
                run()
    """

    def __init__(
        self,
        message: str,
        *,
        value: Any = None,
        acknowledged: int = 0,
        wanted: int = 0,
        callbacks: tuple[Callable[[], object], ...] = (),
    ) -> None:
        self.value = value
        self.acknowledged = acknowledged
        self.wanted = wanted
        #: PostgreSQL: the transaction's ``on_commit`` callbacks, not run (empty for Redis).
        self.callbacks = callbacks
        super().__init__(message)


class PublishFailed(StateguardError):
    """An outbox sink's broker did not take (all of) a batch: the events it names are not published.

    Raised by the RabbitMQ and NATS sinks (:mod:`stateguard.outbox.sinks`)
    for a message the broker could not route (``mandatory``), refused (a
    nack, a JetStream error) or never confirmed (the connection was lost or
    the confirmation did not come within the sink's ``timeout``).  Two
    fields say which events:

    ``event_ids``
        every event of the batch that is *not* published: refused,
        unconfirmed, or not sent after the first failure (the batch's other
        events were confirmed); empty when the broker could not be reached
        at all (then nothing of the batch is published).  A relay counts none
        of them published.
    ``refused_ids``
        those of ``event_ids`` the broker answered *for that message* with a
        refusal (unroutable, nacked, a JetStream error, too large): the
        broker works and does not want these.  A relay counts a refusal for
        each (after ``max_attempts`` it parks the event dead).  An event that
        is only unconfirmed or unsent is not refused: a broker that is down
        refuses nothing, so an outage parks no event.

    A message whose confirmation was lost may have reached the broker anyway:
    its event comes again, so consumers see duplicates and deduplicate by
    the event id.  The client's error is chained as ``__cause__``.
    ``retryable`` is ``True``: a running relay logs it and tries again::

        try:
            relay.run_once()
        except PublishFailed as error:
            log.warning("batch not taken (%s): events %s come again", error, error.event_ids)
    """

    retryable = True

    def __init__(
        self, message: str, *, event_ids: tuple[int, ...] = (), refused_ids: tuple[int, ...] = ()
    ) -> None:
        # A refused event is not published either: event_ids holds it whatever the caller passed.
        self.event_ids = tuple(event_ids) + tuple(i for i in refused_ids if i not in event_ids)
        self.refused_ids = tuple(refused_ids)
        super().__init__(message)


class _KeyError(StateguardError):
    """Shared shape of the idempotency-key errors: they carry ``scope`` and ``key``."""

    def __init__(self, message: str, *, scope: str, key: str) -> None:
        self.scope = scope
        self.key = key
        super().__init__(message)


class LeaseLost(LockLost, _KeyError):
    """The lease on an idempotency key expired and another worker took the key over.

    Nothing this worker tries to write to the key record afterwards is written
    (completing, failing, checkpointing and releasing are conditional on the
    owner): the new owner's record is never overwritten or deleted.  Work this
    worker did outside the database after the lease expired was unprotected;
    use ``heartbeat()`` (or ``heartbeat_every=``) for long work.
    """


class RequestInProgress(_KeyError):
    """Another caller holds the idempotency key and its lease is live.

    ``retry_after`` (a :class:`datetime.timedelta`) is how long until that
    lease expires; answer HTTP 409 (with ``Retry-After``) and let the client
    retry: it then gets the stored response, or takes the key over if the
    other worker died.
    """

    def __init__(self, message: str, *, scope: str, key: str, retry_after: Any) -> None:
        self.retry_after = retry_after
        super().__init__(message, scope=scope, key=key)


class IdempotencyKeyReused(_KeyError):
    """An idempotency key came back with a request whose fingerprint differs.

    The client reused a key for a different request (HTTP 422).  Nothing was
    written; the stored record is untouched.
    """


class RequestFailed(_KeyError):
    """The request of this idempotency key failed with an error marked non-retryable.

    ``error`` is the stored description of that error.  Retrying with the
    same key will not run the work again (until the key expires); answer
    with the error, or use a new key for a new attempt.
    """

    def __init__(self, message: str, *, scope: str, key: str, error: str | None) -> None:
        self.error = error
        super().__init__(message, scope=scope, key=key)


class WorkerLeaseLost(LockLost):
    """A :class:`Snowflake` lost the lease on its worker id: it will issue no more ids.

    The lease expired (no renewal reached the database in time) and another
    generator may have taken the worker id over.  Ids already returned are
    safe; close this generator and create a new one (it leases a fresh
    worker id).  ``namespace`` and ``worker_id`` say which lease::

        try:
            order.id = ids.next_id()
        except WorkerLeaseLost:
            ids.close()
            ids = Snowflake(engine, namespace="orders")
            order.id = ids.next_id()
    """

    def __init__(self, message: str, *, namespace: str, worker_id: int) -> None:
        self.namespace = namespace
        self.worker_id = worker_id
        super().__init__(message)


class WorkerIdsExhausted(StateguardError):
    """All 1024 worker ids of a :class:`Snowflake` namespace are leased by live generators.

    ``retryable`` is ``True``: a lease frees up when a generator closes or
    dies (after its lease expires).  Use separate namespaces for id spaces
    that do not need to be unique with each other::

        try:
            ids = Snowflake(engine, namespace="orders")
        except WorkerIdsExhausted as error:
            log.warning("no free worker id in %s; retrying", error.namespace)
    """

    retryable = True

    def __init__(self, message: str, *, namespace: str) -> None:
        self.namespace = namespace
        super().__init__(message)
