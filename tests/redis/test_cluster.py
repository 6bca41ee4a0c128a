"""Redis Cluster: the keys of one lock or token always share a
hash slot, whatever the name holds, so no script ever fails with CROSSSLOT.

The slot checks need no server (redis-py's own ``key_slot``).  The cluster test starts three
masters on private ports (``redis-server --cluster-enabled yes`` + ``redis-cli --cluster
create``) and stops them by pid; without redis-server it skips loudly (fails under CI=true).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from stateguard import (
    AsyncRedisLock,
    AsyncRedisTokens,
    InvalidArgument,
    LockLost,
    Outcome,
    RedisLock,
    RedisTokens,
)
from stateguard.redis.fences import _acquire_call, _extend_call, _release_call
from tests._support.redis_server import LocalCluster, RedisServer

#: Names an attacker (or an unlucky user) may pick: braces in every order and count.
HOSTILE = [
    "plain",
    "}",
    "}x",
    "}}",
    "}{",
    "}{x}",
    "a}b{",
    "a}b{c}",
    "{",
    "{}",
    "{}x",
    "{a}{b}",
    "x{y}z",
    "{{}}",
    "payout:{42}",
    "ключ}{键}",
    " } ",
    "\x00}",
]


def slot(key: Any) -> int:
    """Redis Cluster's slot of ``key`` (redis-py's implementation of the server's rule)."""
    from redis.crc import key_slot

    return int(key_slot(key.encode() if isinstance(key, str) else key))


def lock_keys(lock: Any) -> list[str]:
    """Every key any script of ``lock`` touches: acquire, release (markers) and extend."""
    inner = lock._lock
    inner.local.token = b"0123456789abcdef"
    inner.local.extend_call = "call"
    keys = [
        *_acquire_call(inner, "0123456789abcdef")["keys"],
        *_release_call(inner, b"0123456789abcdef")["keys"],
        *_extend_call(inner, 1.0, False)["keys"],
    ]
    inner.local.token = None
    return [k.decode() if isinstance(k, bytes) else k for k in keys]


@pytest.mark.parametrize("name", HOSTILE)
def test_every_key_of_a_lock_shares_one_slot(name: str) -> None:
    """Lock, fence, release and extend marker keys of any name hash to one slot; names never share keys."""
    import redis

    lock = RedisLock(redis.Redis(), name, ttl=1)  # no connection is made
    keys = lock_keys(lock)
    assert keys[0] == lock.key and keys[1] == lock.fence_key
    assert len({slot(k) for k in keys}) == 1, {k: slot(k) for k in keys}
    assert len(set(keys)) == 4  # lock, fence, released marker, extend marker


def test_lock_keys_of_distinct_names_are_distinct() -> None:
    """Two different names never get the same lock key (the digest form cannot collide with the plain one)."""
    import redis

    client = redis.Redis()
    keys = [RedisLock(client, name, ttl=1).key for name in HOSTILE]
    assert len(set(keys)) == len(HOSTILE)
    assert RedisLock(client, "payout:42", ttl=1).key == "stateguard:lock:{payout:42}"  # unchanged


@pytest.mark.hostile
def test_lock_name_with_a_lone_surrogate_is_invalid() -> None:
    """A lone surrogate cannot be a Redis key: InvalidArgument, not a UnicodeEncodeError from the client."""
    import redis

    with pytest.raises(InvalidArgument, match="surrogate"):
        RedisLock(redis.Redis(), "lock-\ud800", ttl=1)


def test_a_token_is_one_key_per_script_call() -> None:
    """RedisTokens' consume script takes exactly one key, so it cannot straddle slots."""
    from stateguard.redis import tokens as sg_redis

    assert "KEYS[2]" not in sg_redis._CONSUME_SCRIPT
    for scope in HOSTILE:
        if scope.strip() and "\x00" not in scope:
            assert RedisTokens.key(scope, "t").startswith(f"stateguard:token:{scope}:")


# --------------------------------------------------------------------------
# A real cluster of three masters
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[RedisServer]]:
    """Three cluster-enabled masters on private ports, joined by redis-cli --cluster create."""
    with LocalCluster(masters=3, replicas=0, node_timeout_ms=5000) as running:
        yield running.servers


@pytest.mark.hostile
def test_tokens_and_locks_with_hostile_names_work_on_a_cluster(cluster: list[RedisServer]) -> None:
    """On 3 masters, consume and acquire/extend/release work for every hostile name (no CROSSSLOT)."""
    from redis.cluster import RedisCluster

    client = RedisCluster(host="127.0.0.1", port=cluster[0].port)
    try:
        tokens = RedisTokens(client)
        slots = set()
        for name in HOSTILE:
            if name.strip() and "\x00" not in name:
                token = tokens.issue(scope=name, ttl=timedelta(minutes=1))
                assert tokens.consume(token, scope=name).outcome is Outcome.APPLIED
                assert tokens.consume(token, scope=name).outcome is Outcome.REPEATED
            lock = RedisLock(client, name, ttl=5, blocking_timeout=0)
            with lock as fence:
                lock.extend(5)
                assert lock.owned() and fence == int(client.get(lock.fence_key))
            assert not lock.locked()
            slots.add(slot(lock.key))
        assert len(slots) > 1  # the names really spread over the cluster's masters
        short = RedisLock(client, "}expired", ttl=0.05)
        with pytest.raises(LockLost), short:
            time.sleep(0.1)
    finally:
        client.close()


@pytest.mark.hostile
def test_async_tokens_and_locks_with_hostile_names_work_on_a_cluster(cluster: list[RedisServer]) -> None:
    """The same on redis.asyncio's RedisCluster with AsyncRedisTokens and AsyncRedisLock."""
    from redis.asyncio.cluster import RedisCluster

    async def main() -> None:
        client = RedisCluster(host="127.0.0.1", port=cluster[1].port)
        try:
            tokens = AsyncRedisTokens(client)
            for name in ("}x", "{a}{b}", "a}b{", "{}"):
                token = await tokens.issue(scope=name, ttl=timedelta(minutes=1))
                assert (await tokens.consume(token, scope=name)).outcome is Outcome.APPLIED
                lock = AsyncRedisLock(client, name, ttl=5, blocking_timeout=0)
                async with lock:
                    await lock.extend(5)
                    assert await lock.owned()
                assert not await lock.locked()
        finally:
            await client.aclose()

    asyncio.run(main())
