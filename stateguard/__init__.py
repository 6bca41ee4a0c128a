"""stateguard: retried, duplicated and concurrent writes made safe in SQLAlchemy.

Every guarded write is one conditional statement; the database decides and
the affected-row count (or the conflict) says what happened.  See README.md.
"""

from __future__ import annotations

from .counters import decrement, increment, release, reserve
from .durability import set_durability
from .engine import async_sqlite_engine, sqlite_engine
from .exceptions import (
    ConfigurationError,
    DeadlockDetected,
    IdempotencyKeyReused,
    InsufficientQuantity,
    InvalidArgument,
    LeaseLost,
    LockLost,
    LockNotAcquired,
    NotFound,
    NotSupported,
    OutcomeError,
    PublishFailed,
    RefConflict,
    ReplicationTimeout,
    RequestFailed,
    RequestInProgress,
    SerializationConflict,
    StaleVersion,
    StateguardError,
    TransactionAborted,
    TransitionRejected,
    UnknownTrigger,
    WorkerIdsExhausted,
    WorkerLeaseLost,
)
from .idempotency import (
    IdempotencyEvent,
    IdempotentCall,
    JSONSerializer,
    Serializer,
    idempotent,
    idempotent_function,
    on_idempotency_event,
    purge_expired,
)
from .ids import Snowflake, new_request_id
from .inserts import consume_once, insert_once, purge_consumed
from .locks import advisory_lock, row_lock
from .machine import HistoryEntry, StateMachine, Trigger
from .observe import GuardEvent, on_event
from .outbox import AsyncRelay, CallableSink, OutboxEvent, Relay, Sink, emit, purge_published, requeue_dead
from .outbox.sinks.redis_streams import RedisStreamSink
from .redis import AsyncRedisLock, AsyncRedisTokens, RedisLock, RedisTokens
from .result import Outcome, Result
from .retry import retry_on_conflict
from .striped import StripedCounter
from .tables import create_tables, drop_tables, migrations_location
from .tokens import consume_token, issue_token, purge_expired_tokens
from .versioning import fence_column, guarded_update, version_column
from .zookeeper import ZooKeeperLock

__version__ = "0.1.0"

__all__ = [
    "AsyncRedisLock",
    "AsyncRedisTokens",
    "AsyncRelay",
    "CallableSink",
    "ConfigurationError",
    "DeadlockDetected",
    "GuardEvent",
    "HistoryEntry",
    "IdempotencyEvent",
    "IdempotencyKeyReused",
    "IdempotentCall",
    "InsufficientQuantity",
    "InvalidArgument",
    "JSONSerializer",
    "LeaseLost",
    "LockLost",
    "LockNotAcquired",
    "NotFound",
    "NotSupported",
    "OutboxEvent",
    "Outcome",
    "OutcomeError",
    "PublishFailed",
    "RedisLock",
    "RedisStreamSink",
    "RedisTokens",
    "RefConflict",
    "Relay",
    "ReplicationTimeout",
    "RequestFailed",
    "RequestInProgress",
    "Result",
    "SerializationConflict",
    "Serializer",
    "Sink",
    "Snowflake",
    "StaleVersion",
    "StateMachine",
    "StateguardError",
    "StripedCounter",
    "TransactionAborted",
    "TransitionRejected",
    "Trigger",
    "UnknownTrigger",
    "WorkerIdsExhausted",
    "WorkerLeaseLost",
    "ZooKeeperLock",
    "advisory_lock",
    "async_sqlite_engine",
    "consume_once",
    "consume_token",
    "create_tables",
    "decrement",
    "drop_tables",
    "emit",
    "fence_column",
    "guarded_update",
    "idempotent",
    "idempotent_function",
    "increment",
    "insert_once",
    "issue_token",
    "migrations_location",
    "new_request_id",
    "on_event",
    "on_idempotency_event",
    "purge_consumed",
    "purge_expired",
    "purge_expired_tokens",
    "purge_published",
    "release",
    "requeue_dead",
    "reserve",
    "retry_on_conflict",
    "row_lock",
    "set_durability",
    "sqlite_engine",
    "version_column",
]
