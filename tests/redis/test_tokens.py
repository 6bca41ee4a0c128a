"""RedisTokens under real races on the local Redis: 64 threads or async tasks consume a token once,
tombstones keep the TTL, only the digest is stored, scopes with glob and hash-tag characters stay
apart, a new thread never inherits a dead thread's lost consume, and ``wait_replicas`` without
replicas is a typed timeout."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, select

from stateguard import (
    AsyncRedisTokens,
    InvalidArgument,
    Outcome,
    RedisTokens,
)
from stateguard.tables import tokens
from stateguard.tokens import token_digest
from tests._support.token_races import (
    HOUR,
    _issue,
    _outcomes,
    _run_threads,
)
from tests.conftest import REDIS_URL

# --------------------------------------------------------------------------
# Redis tokens
# --------------------------------------------------------------------------


@pytest.fixture
def redis_scope(redis_client: Any) -> Iterator[str]:
    """A scope unique to this test; its keys are deleted afterwards."""
    scope = f"sg-token-{uuid.uuid4().hex[:10]}"
    yield scope
    for key in redis_client.scan_iter(match=f"stateguard:token:{scope}*", count=1000):
        redis_client.delete(key)


def test_redis_64_threads_from_a_barrier_consume_once(redis_client: Any, redis_scope: str) -> None:
    """64 threads, each with its own RedisTokens and client, released together on one token: one
    APPLIED and 63 REPEATED; a token of a neighbouring scope (scope + ":x") is untouched."""
    tokens_ = RedisTokens(redis_client)
    token = tokens_.issue(scope=redis_scope, ttl=HOUR)
    neighbour = tokens_.issue(scope=redis_scope + ":x", ttl=HOUR)
    barrier = threading.Barrier(64)
    import redis

    def consume(i: int) -> Any:
        client = redis.Redis.from_url(REDIS_URL)
        try:
            mine = RedisTokens(client)
            barrier.wait()
            return mine.consume(token, scope=redis_scope)
        finally:
            client.close()

    outcomes = _outcomes(_run_threads(64, consume))
    assert outcomes == Counter({"APPLIED": 1, "REPEATED": 63}), outcomes
    assert tokens_.consume(neighbour, scope=redis_scope + ":x").outcome is Outcome.APPLIED
    assert tokens_.consume(token, scope=redis_scope + ":x").outcome is Outcome.NOT_FOUND


def test_redis_async_tasks_on_one_object_consume_once(redis_scope: str) -> None:
    """200 asyncio tasks on one AsyncRedisTokens, gathered at once: exactly one APPLIED."""
    import redis.asyncio as aredis

    async def main() -> Counter[str]:
        pool = aredis.BlockingConnectionPool.from_url(REDIS_URL, max_connections=32, timeout=30)
        client = aredis.Redis(connection_pool=pool)
        try:
            tokens_ = AsyncRedisTokens(client)
            token = await tokens_.issue(scope=redis_scope, ttl=HOUR)
            results = await asyncio.gather(
                *(tokens_.consume(token, scope=redis_scope) for _ in range(200)), return_exceptions=True
            )
            return _outcomes(list(results))
        finally:
            await client.aclose()
            # A pool passed in is not closed with its client: its connections' StreamWriters would
            # outlive this event loop and warn "loop is closed" in a later test.
            await pool.aclose()

    outcomes = asyncio.run(main())
    assert outcomes == Counter({"APPLIED": 1, "REPEATED": 199}), outcomes


def test_redis_tombstone_keeps_the_ttl_and_ttl_edges(redis_client: Any, redis_scope: str) -> None:
    """A consumed token's tombstone keeps the remaining TTL (no key without expiry is left behind);
    ttl=1 ms expires to NOT_FOUND; timedelta.max is accepted or refused as InvalidArgument, never a
    raw Redis error; bad ttls are InvalidArgument and write nothing."""
    tokens_ = RedisTokens(redis_client)
    token = tokens_.issue(scope=redis_scope, ttl=timedelta(seconds=30))
    assert tokens_.consume(token, scope=redis_scope).applied
    pttl = redis_client.pttl(RedisTokens.key(redis_scope, token))
    assert 0 < pttl <= 30_000
    assert tokens_.consume(token, scope=redis_scope).outcome is Outcome.REPEATED
    tiny = tokens_.issue(scope=redis_scope, ttl=timedelta(milliseconds=1))
    time.sleep(0.05)
    assert tokens_.consume(tiny, scope=redis_scope).outcome is Outcome.NOT_FOUND
    try:
        huge = tokens_.issue(scope=redis_scope, ttl=timedelta.max)
    except InvalidArgument:
        pass
    else:
        assert tokens_.consume(huge, scope=redis_scope).applied
        assert redis_client.pttl(RedisTokens.key(redis_scope, huge)) > 0
    for bad in [timedelta(0), timedelta(seconds=-5), timedelta(microseconds=10), 60]:
        with pytest.raises(InvalidArgument):
            tokens_.issue(scope=redis_scope, ttl=bad)
    for hostile in ["a\x00b", "x\udc00", b"raw", None, "", "x" * 256]:
        with pytest.raises(InvalidArgument):
            tokens_.consume(hostile, scope=redis_scope)  # type: ignore[arg-type]
    keys = list(redis_client.scan_iter(match=f"stateguard:token:{redis_scope}*"))
    assert all(redis_client.pttl(k) > 0 for k in keys), keys


def test_redis_and_sql_tokens_store_only_the_digest(
    redis_client: Any, redis_scope: str, engine: Engine
) -> None:
    """Neither Redis nor the table holds the token itself, only its SHA-256."""
    token = RedisTokens(redis_client).issue(scope=redis_scope, ttl=HOUR)
    keys = [k.decode() for k in redis_client.scan_iter(match=f"stateguard:token:{redis_scope}*")]
    assert keys == [f"stateguard:token:{redis_scope}:{token_digest(token)}"]
    assert token not in redis_client.get(keys[0]).decode()
    sql_token = _issue(engine, "digest")
    with engine.connect() as conn:
        row = conn.execute(select(tokens)).one()
    assert row.token_hash == token_digest(sql_token) and sql_token not in str(tuple(row))


_BUSY_SCRIPT = """
local s = redis.call('TIME')
local start = s[1] * 1000000 + s[2]
while true do
    local n = redis.call('TIME')
    if n[1] * 1000000 + n[2] - start > tonumber(ARGV[1]) then break end
end
return 1
"""


# Regression: README: "calling consume again for the same token on the same RedisTokens object from the
# same thread ... goes on under the failed call's id ... Any other caller gets REPEATED."  A thread
# whose consume timed out (the script still ran: the token is now used:<its call id>) and then ended
# handed its identity to the next new thread that got the recycled thread ident, which was told
# APPLIED without having consumed the token: _caller() keyed pending calls by threading.get_ident().
@pytest.mark.lost_reply
@pytest.mark.restart
def test_redis_a_new_thread_never_inherits_a_dead_threads_lost_consume(
    redis_client: Any, redis_scope: str
) -> None:
    import redis

    slow = redis.Redis.from_url(REDIS_URL, socket_timeout=0.1, retry=None)
    try:
        tokens_ = RedisTokens(slow)
        token = tokens_.issue(scope=redis_scope, ttl=HOUR)
        seen: dict[str, Any] = {}

        def stall_server() -> None:
            blocker = redis.Redis.from_url(REDIS_URL)
            try:
                blocker.eval(_BUSY_SCRIPT, 0, 400_000)  # Redis runs nothing else for 0.4 s
            finally:
                blocker.close()

        def first_caller() -> None:
            seen["first_ident"] = threading.get_ident()
            stall = threading.Thread(target=stall_server)
            stall.start()
            time.sleep(0.05)
            try:
                seen["first"] = tokens_.consume(token, scope=redis_scope)
            except redis.RedisError as error:  # the reply did not come within socket_timeout
                seen["first"] = error
            stall.join()

        def later_caller() -> None:
            # Only the new thread that got the dead thread's recycled ident consumes.
            if threading.get_ident() == seen["first_ident"]:
                seen["later"] = tokens_.consume(token, scope=redis_scope)

        t = threading.Thread(target=first_caller)
        t.start()
        t.join(30)
        assert isinstance(seen["first"], redis.RedisError), seen
        time.sleep(0.1)
        stored = redis_client.get(RedisTokens.key(redis_scope, token))
        assert stored is not None and stored.startswith(b"used:"), "the timed-out consume did not run"
        for _ in range(2000):  # new threads until one gets the dead thread's ident
            t = threading.Thread(target=later_caller)
            t.start()
            t.join(30)
            if "later" in seen:
                break
        else:
            pytest.skip("no new thread got the dead thread's ident")
        assert seen["later"].outcome is Outcome.REPEATED, "a new thread inherited a dead thread's consume"
    finally:
        slow.close()


@pytest.mark.failover
@pytest.mark.cancel
def test_redis_wait_replicas_without_replicas_is_a_typed_timeout_with_the_value(
    redis_client: Any, redis_scope: str
) -> None:
    """wait_replicas=1 on a server with no replica: issue and APPLIED consume raise ReplicationTimeout
    whose .value is the token / the Result (the write happened on the master); REPEATED and
    NOT_FOUND wrote nothing and are answered, not raised."""
    from stateguard import ReplicationTimeout

    if int(redis_client.info("replication").get("connected_slaves", 0)) > 0:
        pytest.skip("this Redis has replicas")
    durable = RedisTokens(redis_client, wait_replicas=1, wait_timeout=0.05)
    with pytest.raises(ReplicationTimeout) as issued:
        durable.issue(scope=redis_scope, ttl=HOUR)
    token = issued.value.value
    assert isinstance(token, str) and redis_client.get(RedisTokens.key(redis_scope, token)) is not None
    with pytest.raises(ReplicationTimeout) as consumed:
        durable.consume(token, scope=redis_scope)
    assert consumed.value.value.outcome is Outcome.APPLIED
    # They still send WAIT and wait wait_timeout (the docstring's "each consume that wrote" is not
    # what happens), but they are answered, not raised.
    assert durable.consume(token, scope=redis_scope).outcome is Outcome.REPEATED
    assert durable.consume("never-issued", scope=redis_scope).outcome is Outcome.NOT_FOUND


@pytest.mark.parametrize("suffix", ["*", "?", "[a-z]", "{tag}", ":", "\\", " ", "\u00e9\U0001f600"])
def test_redis_scopes_with_glob_and_hash_tag_characters_stay_separate(
    redis_client: Any, redis_scope: str, suffix: str
) -> None:
    """A scope with glob, hash-tag or separator characters is its own scope: its token is NOT_FOUND
    in the bare scope and in a look-alike, APPLIED in its own."""
    tokens_ = RedisTokens(redis_client)
    scope = redis_scope + suffix
    token = tokens_.issue(scope=scope, ttl=HOUR)
    for other in [redis_scope, redis_scope + "x", redis_scope + suffix + suffix]:
        assert tokens_.consume(token, scope=other).outcome is Outcome.NOT_FOUND, other
    assert tokens_.consume(token, scope=scope).outcome is Outcome.APPLIED
    assert tokens_.consume(token, scope=scope).outcome is Outcome.REPEATED
