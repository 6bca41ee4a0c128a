"""What every Redis class here shares: the client check, the one place a call is made, and WAIT.

Each operation is written once, for both kinds of client, as a generator of
steps (:mod:`stateguard._async`'s ``Steps``) that makes every Redis call
through ``yield from self._call(fn, ...)``: a synchronous client's reply
comes back at once and ``run_steps`` runs the generator to its end; an async
client's coroutine is awaited by delegation.  ``wait_replicas`` sends a write
and its ``WAIT`` on one connection to the key's master (on a cluster whose
slot moved, again to the new master).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import secrets
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, suppress
from typing import Any, ClassVar, Final

from .. import _kernel
from .. import observe as _observe
from .._async import Steps, step
from ..exceptions import InvalidArgument, ReplicationTimeout

__all__ = ["DEFAULT_WAIT_TIMEOUT", "MAX_WAIT_REPLICAS", "MAX_WAIT_TIMEOUT"]

log = logging.getLogger("stateguard.redis")


def _watch(operation: str, scope: str) -> AbstractContextManager[dict[str, Any]]:
    """The stateguard.observe report of one Redis call (a no-op block while nothing listens)."""
    return _observe.watch(operation, log, scope=scope if isinstance(scope, str) else None, backend="redis")


class _RedisClient:
    """What every class here shares: the client check and :meth:`_call`."""

    #: Whether the client's commands return awaitables (redis.asyncio): the Async* classes.
    _asynchronous: ClassVar[bool] = False

    def _check_client(self, client: Any) -> None:
        """Refuse anything but a redis-py client of the kind this class drives.

        A redis.asyncio client handed to a synchronous class would return
        coroutines that are never awaited (a token "issued" but never
        stored); a synchronous one handed to an async class fails on the
        first ``await``.  Both are caught here, before anything is sent.
        """
        owner = type(self).__name__
        asynchronous = self._asynchronous
        wanted = "redis.asyncio.Redis" if asynchronous else "redis.Redis"
        if client is None or not callable(getattr(client, "register_script", None)):
            raise InvalidArgument(f"{owner} needs a redis client ({wanted}), got {client!r}")
        if inspect.iscoroutinefunction(getattr(client, "execute_command", None)) is not asynchronous:
            other = owner.removeprefix("Async") if asynchronous else f"Async{owner}"
            raise InvalidArgument(
                f"{owner} needs a {'redis.asyncio' if asynchronous else 'synchronous'} client ({wanted}), "
                f"got {client!r}; use {other} with this client"
            )

    def _call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Steps[Any]:
        """``fn(*args, **kwargs)``'s reply, awaited for an async client; use as ``yield from``."""
        return (yield from step(fn(*args, **kwargs)))


# --------------------------------------------------------------------------
# wait_replicas: a write, then WAIT, on one connection to the key's master
# --------------------------------------------------------------------------

#: ``wait_timeout``'s default (seconds): how long WAIT blocks for the replicas.
DEFAULT_WAIT_TIMEOUT: Final = 1.0

#: How many times a write with WAIT is sent again after the cluster moved the
#: key's slot (MOVED, a failover, CLUSTERDOWN, a refused connection), with
#: the slot map reloaded in between.  Every write here recognises its own
#: earlier run (call ids, owner tokens), so sending it again is safe.
_CLUSTER_ATTEMPTS: Final = 4


#: The largest ``wait_replicas``: Redis parses WAIT's count as a 64-bit
#: integer and refuses more; no deployment has anywhere near this many.
MAX_WAIT_REPLICAS: Final = 2**31 - 1

#: The longest ``wait_timeout`` (seconds): one hour.  WAIT blocks the call
#: (and holds its connection) that long when the replicas do not answer.
MAX_WAIT_TIMEOUT: Final = 3600.0


def _check_wait(wait_replicas: Any, wait_timeout: Any) -> tuple[int, int]:
    """``(replicas, timeout in ms)`` from the constructor's ``wait_replicas`` and ``wait_timeout``."""
    if type(wait_replicas) is not int or not 0 <= wait_replicas <= MAX_WAIT_REPLICAS:
        raise InvalidArgument(
            f"wait_replicas must be an int from 0 (0: do not wait for replicas) to {MAX_WAIT_REPLICAS}, "
            f"got {wait_replicas!r}; set it to at most the number of replicas each master has"
        )
    seconds = _kernel.required_seconds(wait_timeout, "wait_timeout")
    if not 0.001 <= seconds <= MAX_WAIT_TIMEOUT:
        raise InvalidArgument(
            f"wait_timeout must be from 1 millisecond to {MAX_WAIT_TIMEOUT:g} s (one hour), "
            f"got {wait_timeout!r}"
        )
    return wait_replicas, max(1, int(seconds * 1000))


def _socket_timeout(client: Any) -> float | None:
    """The ``socket_timeout`` ``client`` was built with (a cluster's: its nodes'); ``None``: none, unknown."""
    kind = _cluster_kind(client)
    if kind == "sync":
        kwargs = getattr(getattr(client, "nodes_manager", None), "connection_kwargs", None)
    elif kind == "async":
        kwargs = getattr(client, "connection_kwargs", None)
    else:
        kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
    timeout = kwargs.get("socket_timeout") if isinstance(kwargs, dict) else None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        return None
    return float(timeout)


def _check_socket_timeout(owner: str, client: Any, wait_replicas: int, wait_ms: int) -> None:
    """With ``wait_replicas``, the client must wait for WAIT's reply longer than WAIT may block.

    Otherwise a WAIT that times out on the server times out in the socket
    first: the call raises redis' TimeoutError (and redis-py sends it
    again) instead of ReplicationTimeout.
    """
    if not wait_replicas:
        return
    timeout = _socket_timeout(client)
    if timeout is not None and timeout * 1000 <= wait_ms:
        raise InvalidArgument(
            f"{owner}: the client's socket_timeout ({timeout:g} s) is not above wait_timeout "
            f"({wait_ms / 1000:g} s): a WAIT that lasts its whole wait_timeout would time out in the socket. "
            f"Build the client with a socket_timeout above wait_timeout (leave a margin for the round trip), "
            f"or lower wait_timeout"
        )


def _cluster_kind(client: Any) -> str:
    """``"sync"`` / ``"async"`` for a redis-py cluster client, ``""`` for one server."""
    from redis.asyncio.cluster import RedisCluster as AsyncCluster
    from redis.cluster import RedisCluster

    if isinstance(client, RedisCluster):
        return "sync"
    if isinstance(client, AsyncCluster):
        return "async"
    return ""


def _one_connection(
    client: Any, asynchronous: bool, key: str, commands: list[tuple[Any, ...]]
) -> Steps[list[Any]]:
    """Send ``commands`` in order on one connection to the master of ``key``; their replies (errors included).

    WAIT counts the replicas that have every write made *on its own
    connection*, so the write and its WAIT must share one: a pipeline on a
    single-server client, or on the key's master in a cluster.
    """
    kind = _cluster_kind(client)
    if kind == "async":
        # redis.asyncio's cluster client has no per-node Redis client to open a
        # pipeline on: the node's own execute_pipeline (what its ClusterPipeline
        # uses) sends the commands on one of its connections.  Not public API:
        # tests/redis/test_failover.py exercises it with every redis-py upgrade.
        from redis.asyncio.cluster import PipelineCommand

        yield from step(client.initialize())
        node = client.get_node_from_key(key)  # the slot's master
        sent = [PipelineCommand(i, *command) for i, command in enumerate(commands)]
        try:
            yield from step(node.execute_pipeline(sent))
        except BaseException:
            with suppress(Exception):
                yield from step(node.disconnect())
            raise
        if any(_is_connection_error(c.result) for c in sent):
            with suppress(Exception):
                yield from step(node.disconnect())
        return [c.result for c in sent]
    target = client.get_redis_connection(client.get_node_from_key(key)) if kind == "sync" else client
    pipe = target.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    replies: list[Any] = yield from step(pipe.execute(raise_on_error=False))
    return replies


def _is_connection_error(reply: Any) -> bool:
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    return isinstance(reply, (RedisConnectionError, RedisTimeoutError))


def _moved(reply: Any) -> bool:
    """Whether ``reply`` (an error) says the key's slot is served elsewhere or not at all right now."""
    from redis.exceptions import AskError, ClusterDownError, MovedError, SlotNotCoveredError, TryAgainError

    moved = (AskError, ClusterDownError, MovedError, SlotNotCoveredError, TryAgainError)
    return isinstance(reply, moved) or _is_connection_error(reply)


def _write_and_wait(
    client: Any,
    asynchronous: bool,
    key: str,
    command: tuple[Any, ...],
    script: str | None,
    replicas: int,
    timeout_ms: int,
) -> Steps[tuple[Any, int]]:
    """Run ``command`` (a SET, or an EVALSHA of ``script``) and ``WAIT replicas ms`` on one connection.

    Returns the command's reply and how many replicas acknowledged.  On a
    cluster whose slot moved (failover, resharding) the slot map is reloaded
    and both are sent again, to the new master.
    """
    from redis.exceptions import NoScriptError

    cluster = bool(_cluster_kind(client))
    load = False
    attempt = 0
    while True:
        commands: list[tuple[Any, ...]] = [("SCRIPT", "LOAD", script)] if load and script is not None else []
        commands += [command, ("WAIT", replicas, timeout_ms)]
        try:
            replies = yield from _one_connection(client, asynchronous, key, commands)
        except Exception as error:
            if not (cluster and _moved(error)):
                raise
            replies = [error, error]
        reply, acknowledged = replies[-2], replies[-1]
        if isinstance(reply, NoScriptError) and not load:
            load = True
            continue
        if cluster and _moved(reply) and attempt + 1 < _CLUSTER_ATTEMPTS:
            attempt += 1
            # Let the cluster settle (a failover takes the node timeout), then reload its slot map.
            pause = min(1.0, 0.1 * 2**attempt)
            if asynchronous:
                yield from asyncio.sleep(pause).__await__()
            else:
                time.sleep(pause)
            with suppress(Exception):
                yield from step(client.nodes_manager.initialize())
            continue
        if isinstance(reply, BaseException):
            raise reply
        if isinstance(acknowledged, BaseException):
            raise acknowledged
        return reply, int(acknowledged)


def _not_durable(
    what: str, value: Any, acknowledged: int, replicas: int, timeout_ms: int
) -> ReplicationTimeout:
    return ReplicationTimeout(
        f"{what} on the Redis master, but only {acknowledged} of the {replicas} replicas asked for "
        f"(wait_replicas) confirmed it within {timeout_ms} ms: it is applied but not durable, and a failover "
        f"before it reaches a replica can lose it. The error's .value is the call's result; check the "
        f"replicas (INFO replication), lower wait_replicas or raise wait_timeout",
        value=value,
        acknowledged=acknowledged,
        wanted=replicas,
    )


def _call_id() -> str:
    """A fresh identity for one call, stored with its effect so that a retry of it recognises it."""
    return secrets.token_hex(16)
