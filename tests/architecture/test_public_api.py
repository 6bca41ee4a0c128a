"""The public surface is pinned: adding or removing a name is a deliberate change."""

import stateguard

EXPECTED = [
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


def test_all_is_pinned_and_sorted() -> None:
    """``stateguard.__all__`` is sorted and equals the pinned list of public names."""
    assert stateguard.__all__ == sorted(stateguard.__all__)
    assert stateguard.__all__ == EXPECTED


def test_every_public_name_exists_and_is_documented() -> None:
    """Every exported name resolves and carries a docstring."""
    for name in stateguard.__all__:
        obj = getattr(stateguard, name)
        assert obj.__doc__, f"{name} has no docstring"


def test_every_error_derives_from_the_root_and_has_retryable() -> None:
    """All stateguard exceptions derive from StateguardError and say whether a retry can help."""
    for name in stateguard.__all__:
        obj = getattr(stateguard, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, stateguard.StateguardError), name
            assert isinstance(obj.retryable, bool), name


def test_py_typed_marker_is_shipped() -> None:
    """The package ships its py.typed marker."""
    from importlib.resources import files

    assert files("stateguard").joinpath("py.typed").is_file()


def test_every_error_survives_pickling_with_its_attributes() -> None:
    """Each exported error round-trips through pickle (process pools) with message and attributes."""
    import pickle
    from datetime import timedelta

    from stateguard import Outcome, Result

    result = Result(Outcome.REJECTED, model=int, key=7, trigger="pay", state="paid")
    samples: list[stateguard.StateguardError] = [
        stateguard.IdempotencyKeyReused("reused", scope="s", key="k"),
        stateguard.RequestInProgress("busy", scope="s", key="k", retry_after=timedelta(seconds=3)),
        stateguard.RequestFailed("failed", scope="s", key="k", error="declined"),
        stateguard.LeaseLost("lost", scope="s", key="k"),
        stateguard.WorkerLeaseLost("lost", namespace="ns", worker_id=3),
        stateguard.WorkerIdsExhausted("full", namespace="ns"),
        stateguard.TransitionRejected(result),
        stateguard.DeadlockDetected("deadlock"),
    ]
    for error in samples:
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error)
        assert vars(copy).keys() == vars(error).keys()
    assert pickle.loads(pickle.dumps(samples[1])).retry_after == timedelta(seconds=3)  # type: ignore[attr-defined]
    assert pickle.loads(pickle.dumps(samples[6])).state == "paid"  # type: ignore[attr-defined]
