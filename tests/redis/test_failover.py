"""Redis Cluster with replicas, failover and ``wait_replicas``.

One cluster per module: 3 masters + 3 replicas on private ports (tests/_support/redis_server.LocalCluster,
``redis-server --cluster-enabled yes`` + ``redis-cli --cluster create --cluster-replicas 1``),
stopped by pid.  Races are made with barriers and 8 threads; the failover tests SIGKILL the
master of the storm's slot while workers keep consuming tokens and taking locks, wait for its
replica to be promoted, start the killed node again (it rejoins as a replica) and then check
what must hold and count what was lost.  The counts are printed (run with ``-s``) and quoted in
the README's "Scaling out" section::

    .venv/bin/python -m pytest tests/test_redis_failover.py -s -q -k failover
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

import stateguard.redis.lock
from stateguard import (
    AsyncRedisLock,
    AsyncRedisTokens,
    InvalidArgument,
    Outcome,
    RedisLock,
    RedisTokens,
    ReplicationTimeout,
    create_tables,
    drop_tables,
    guarded_update,
)
from tests._support.lock_workers import LockBase, Payout
from tests._support.redis_server import LocalCluster, RedisServer
from tests.conftest import Backend

THREADS = 8
MINUTE = timedelta(minutes=1)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """3 masters + 3 replicas on private ports (node timeout 2 s), shared by the module."""
    with LocalCluster(masters=3, replicas=1, node_timeout_ms=2000) as running:
        yield running


def cluster_client(cluster: LocalCluster) -> Any:
    from redis.cluster import RedisCluster

    return RedisCluster(host="127.0.0.1", port=cluster.port)


# --------------------------------------------------------------------------
# wait_replicas: validation (no server)
# --------------------------------------------------------------------------

BAD_REPLICAS = [True, False, -1, 1.0, "1", None]


@pytest.mark.failover
@pytest.mark.parametrize("bad", BAD_REPLICAS)
def test_wait_replicas_must_be_an_int_at_least_zero(bad: Any) -> None:
    """bool, negative, float, str and None are InvalidArgument for all four classes (nothing is sent)."""
    import redis
    import redis.asyncio

    sync, asynchronous = redis.Redis(), redis.asyncio.Redis()
    with pytest.raises(InvalidArgument, match="wait_replicas"):
        RedisTokens(sync, wait_replicas=bad)
    with pytest.raises(InvalidArgument, match="wait_replicas"):
        AsyncRedisTokens(asynchronous, wait_replicas=bad)
    with pytest.raises(InvalidArgument, match="wait_replicas"):
        RedisLock(sync, "x", ttl=1, wait_replicas=bad)
    with pytest.raises(InvalidArgument, match="wait_replicas"):
        AsyncRedisLock(asynchronous, "x", ttl=1, wait_replicas=bad)


@pytest.mark.failover
@pytest.mark.cancel
@pytest.mark.parametrize("bad", [0, -1, 0.0001, None, float("inf"), "1"])
def test_wait_timeout_must_be_a_positive_duration(bad: Any) -> None:
    """wait_timeout is at least 1 ms and finite (WAIT 0 would block forever)."""
    import redis

    with pytest.raises(InvalidArgument, match="wait_timeout"):
        RedisTokens(redis.Redis(), wait_replicas=1, wait_timeout=bad)
    with pytest.raises(InvalidArgument, match="wait_timeout"):
        RedisLock(redis.Redis(), "x", ttl=1, wait_replicas=1, wait_timeout=bad)


@pytest.mark.failover
def test_wait_replicas_defaults_to_off() -> None:
    """0 by default: nothing changes for existing users; a timedelta wait_timeout is accepted."""
    import redis

    assert RedisTokens(redis.Redis()).wait_replicas == 0
    assert RedisLock(redis.Redis(), "x", ttl=1).wait_replicas == 0
    assert RedisTokens(redis.Redis(), wait_replicas=2, wait_timeout=timedelta(seconds=3)).wait_replicas == 2


# --------------------------------------------------------------------------
# wait_replicas on one server with one replica (the non-cluster path)
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replicated() -> Iterator[tuple[RedisServer, RedisServer]]:
    """A private master and one replica of it (``--replicaof``), synced."""
    import redis

    with RedisServer(args=["--repl-diskless-sync-delay", "0"]) as master:
        replica = RedisServer(args=["--replicaof", master.host, str(master.port)])
        with replica:
            client = redis.Redis(port=master.port, decode_responses=True)
            deadline = time.monotonic() + 20
            while (client.info("replication").get("slave0") or {}).get("state") != "online":
                if time.monotonic() > deadline:
                    raise RuntimeError("the private replica did not sync within 20 s")
                time.sleep(0.05)
            client.close()
            yield master, replica


@pytest.mark.failover
def test_wait_replicas_on_a_master_with_one_replica(replicated: tuple[RedisServer, RedisServer]) -> None:
    """WAIT 1 succeeds and the replica has each write; WAIT 2 raises ReplicationTimeout after the write."""
    import redis

    master, replica = replicated
    client, on_replica = redis.Redis(port=master.port), redis.Redis(port=replica.port)
    try:
        tokens = RedisTokens(client, wait_replicas=1)
        token = tokens.issue(scope="wait", ttl=MINUTE)
        assert on_replica.get(RedisTokens.key("wait", token)) == b"live"  # WAIT returned: it is there
        assert tokens.consume(token, scope="wait").outcome is Outcome.APPLIED
        assert on_replica.get(RedisTokens.key("wait", token)).startswith(b"used:")

        greedy = RedisTokens(client, wait_replicas=2, wait_timeout=0.05)
        with pytest.raises(ReplicationTimeout, match="applied but not durable") as caught:
            greedy.issue(scope="wait", ttl=MINUTE)
        assert (caught.value.acknowledged, caught.value.wanted) == (1, 2)
        stored = caught.value.value  # the token: issued on the master all the same
        with pytest.raises(ReplicationTimeout) as caught:
            greedy.consume(stored, scope="wait")
        assert caught.value.value.outcome is Outcome.APPLIED
        # Consumed on the master: nobody else gets APPLIED; a consume that writes nothing does not wait.
        assert greedy.consume(stored, scope="wait").outcome is Outcome.REPEATED
        assert tokens.consume(stored, scope="wait").outcome is Outcome.REPEATED

        lock = RedisLock(client, "wait-lock", ttl=5, wait_replicas=1, blocking_timeout=0)
        with lock as fence:
            assert int(on_replica.get(lock.fence_key)) == fence
            lock.extend(5)
        assert on_replica.get(lock.key) is None
        greedy_lock = RedisLock(client, "wait-lock", ttl=5, wait_replicas=2, wait_timeout=0.05)
        with pytest.raises(ReplicationTimeout, match="was taken") as caught:
            greedy_lock.acquire()
        assert caught.value.value > fence  # it had the lock, with a new fence...
        assert not greedy_lock.locked() and not greedy_lock.owned()  # ...and gave it back
        with lock:  # so the next holder gets it at once
            pass
    finally:
        client.close()
        on_replica.close()


@pytest.mark.failover
@pytest.mark.cancel
def test_writes_while_the_replica_stalls_raise_replication_timeout(
    replicated: tuple[RedisServer, RedisServer],
) -> None:
    """Replica stalled (SIGSTOP): consume, extend and release run on the master, then ReplicationTimeout.

    A second extend() after a ReplicationTimeout is a new extension (its time is added again), and
    the released lock is gone from the master.
    """
    import redis

    master, replica = replicated
    client = redis.Redis(port=master.port)
    tokens = RedisTokens(client, wait_replicas=1, wait_timeout=0.1)
    lock = RedisLock(client, "stalled", ttl=10, wait_replicas=1, wait_timeout=0.1, blocking_timeout=0)
    token = tokens.issue(scope="stall", ttl=MINUTE)
    lock.acquire()
    replica.pause()
    try:
        with pytest.raises(ReplicationTimeout) as caught:
            tokens.consume(token, scope="stall")
        assert caught.value.value.outcome is Outcome.APPLIED and caught.value.acknowledged == 0
        assert tokens.consume(token, scope="stall").outcome is Outcome.REPEATED  # no write: no WAIT
        with pytest.raises(ReplicationTimeout, match="was extended"):
            lock.extend(100)
        first = client.pttl(lock.key)
        assert first > 100_000
        with pytest.raises(ReplicationTimeout):
            lock.extend(100)
        assert client.pttl(lock.key) > first + 90_000  # added again: not taken for the first call's retry
        with pytest.raises(ReplicationTimeout, match="was released"):
            lock.release()
        assert client.get(lock.key) is None and not lock.owned()
    finally:
        replica.resume()
        client.close()


@pytest.mark.failover
def test_async_wait_replicas_on_a_master_with_one_replica(
    replicated: tuple[RedisServer, RedisServer],
) -> None:
    """The same through redis.asyncio: AsyncRedisTokens and AsyncRedisLock with WAIT."""
    import redis.asyncio

    master, replica = replicated

    async def main() -> None:
        client, on_replica = redis.asyncio.Redis(port=master.port), redis.asyncio.Redis(port=replica.port)
        try:
            tokens = AsyncRedisTokens(client, wait_replicas=1)
            token = await tokens.issue(scope="await", ttl=MINUTE)
            assert await on_replica.get(RedisTokens.key("await", token)) == b"live"
            assert (await tokens.consume(token, scope="await")).outcome is Outcome.APPLIED
            greedy = AsyncRedisTokens(client, wait_replicas=2, wait_timeout=0.05)
            with pytest.raises(ReplicationTimeout):
                await greedy.issue(scope="await", ttl=MINUTE)
            lock = AsyncRedisLock(client, "await-lock", ttl=5, wait_replicas=1, blocking_timeout=0)
            async with lock as fence:
                assert int(await on_replica.get(lock.fence_key)) == fence
                await lock.extend(5)
            assert await on_replica.get(lock.key) is None
            greedy_lock = AsyncRedisLock(client, "await-lock", ttl=5, wait_replicas=2, wait_timeout=0.05)
            with pytest.raises(ReplicationTimeout):
                await greedy_lock.acquire()
            assert not await greedy_lock.locked()
        finally:
            await client.aclose()
            await on_replica.aclose()

    asyncio.run(main())


# --------------------------------------------------------------------------
# wait_replicas / wait_timeout bounds, the client's socket_timeout, and the
# lock given back when the acquisition's WAIT fails (review: the lock stayed
# held with no owner)
# --------------------------------------------------------------------------


@pytest.mark.failover
@pytest.mark.cancel
@pytest.mark.parametrize(
    "kwargs",
    [
        {"wait_replicas": 2**31},
        {"wait_replicas": 2**70},
        {"wait_replicas": 1, "wait_timeout": 3601},
        {"wait_replicas": 1, "wait_timeout": 2**70},
        {"wait_replicas": 1, "wait_timeout": timedelta(days=10**6)},
    ],
)
def test_wait_replicas_and_wait_timeout_are_bounded(kwargs: dict[str, Any]) -> None:
    """More than 2**31 - 1 replicas, or a wait_timeout over one hour: InvalidArgument, nothing sent."""
    import redis
    import redis.asyncio

    sync, asynchronous = redis.Redis(socket_timeout=None), redis.asyncio.Redis(socket_timeout=None)
    name = "wait_replicas" if "wait_timeout" not in kwargs else "wait_timeout"
    for build in (
        lambda: RedisTokens(sync, **kwargs),
        lambda: AsyncRedisTokens(asynchronous, **kwargs),
        lambda: RedisLock(sync, "x", ttl=1, **kwargs),
        lambda: AsyncRedisLock(asynchronous, "x", ttl=1, **kwargs),
    ):
        with pytest.raises(InvalidArgument, match=name):
            build()
    # The bounds themselves are accepted.
    assert RedisLock(sync, "x", ttl=1, wait_replicas=2**31 - 1, wait_timeout=3600).wait_replicas == 2**31 - 1


@pytest.mark.failover
@pytest.mark.cancel
@pytest.mark.parametrize("socket_timeout", [0.2, 1])
def test_socket_timeout_must_be_above_wait_timeout(socket_timeout: float) -> None:
    """With wait_replicas, a client socket_timeout at or below wait_timeout is refused by all four classes."""
    import redis
    import redis.asyncio
    from redis.asyncio.cluster import RedisCluster as AsyncCluster

    sync = redis.Redis(socket_timeout=socket_timeout)
    asynchronous = redis.asyncio.Redis(socket_timeout=socket_timeout)
    cluster = AsyncCluster(host="127.0.0.1", port=1, socket_timeout=socket_timeout)  # connects lazily
    for build in (
        lambda: RedisTokens(sync, wait_replicas=1, wait_timeout=1),
        lambda: AsyncRedisTokens(asynchronous, wait_replicas=1, wait_timeout=1),
        lambda: RedisLock(sync, "x", ttl=1, wait_replicas=1, wait_timeout=1),
        lambda: AsyncRedisLock(asynchronous, "x", ttl=1, wait_replicas=1, wait_timeout=1),
        lambda: AsyncRedisTokens(cluster, wait_replicas=1, wait_timeout=1),
    ):
        with pytest.raises(InvalidArgument, match="socket_timeout"):
            build()
    # Without WAIT the socket_timeout does not matter; above wait_timeout, or none at all, is fine.
    RedisLock(sync, "x", ttl=1)
    RedisTokens(redis.Redis(socket_timeout=1.5), wait_replicas=1, wait_timeout=1)
    RedisTokens(redis.Redis(socket_timeout=None), wait_replicas=1, wait_timeout=1)


@pytest.mark.failover
@pytest.mark.cancel
def test_socket_timeout_of_a_cluster_client_is_checked(cluster: LocalCluster) -> None:
    """A sync RedisCluster's socket_timeout (its nodes' connections') is checked as well."""
    from redis.cluster import RedisCluster

    client = RedisCluster(host="127.0.0.1", port=cluster.port, socket_timeout=0.5)
    try:
        with pytest.raises(InvalidArgument, match="socket_timeout"):
            RedisLock(client, "x", ttl=1, wait_replicas=1, wait_timeout=1)
        RedisLock(client, "x", ttl=1, wait_replicas=1, wait_timeout=0.2)
    finally:
        client.close()


@pytest.mark.failover
def test_acquisition_whose_wait_fails_gives_the_lock_back(
    replicated: tuple[RedisServer, RedisServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """WAIT refused by Redis, or timed out in the socket: redis' error, and the lock is free again.

    Both are made past the constructor's checks (they are what the checks now prevent): WAIT's
    timeout out of Redis' range, then a client whose socket_timeout is below wait_timeout.
    """
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    master, _ = replicated
    client = redis.Redis(port=master.port, socket_timeout=5, retry=Retry(NoBackoff(), 0))
    try:
        lock = RedisLock(client, "wait-fails", ttl=30, wait_replicas=1, blocking_timeout=0)
        lock._lock.wait_ms = 2**70  # WAIT replies "timeout is not an integer or out of range"
        with pytest.raises(redis.ResponseError) as caught:
            lock.acquire()
        assert any("given back" in note for note in getattr(caught.value, "__notes__", []))
        assert client.exists(lock.key) == 0 and not lock.owned()
        other = RedisLock(client, "wait-fails", ttl=5, blocking_timeout=0)
        with other:  # free at once, not held for 30 s by nobody
            pass

        # The constructor refuses this client now: skip its check to make the socket time out under WAIT.
        monkeypatch.setattr(stateguard.redis.lock, "_check_socket_timeout", lambda *args: None)
        impatient = redis.Redis(port=master.port, socket_timeout=0.2, retry=Retry(NoBackoff(), 0))
        slow = RedisLock(
            impatient, "wait-times-out", ttl=30, wait_replicas=2, wait_timeout=1, blocking_timeout=0
        )
        with pytest.raises(redis.TimeoutError):
            slow.acquire()
        assert client.exists(slow.key) == 0 and not slow.owned()
        impatient.close()
        with RedisLock(client, "wait-times-out", ttl=5, blocking_timeout=0):
            pass
    finally:
        client.close()


@pytest.mark.failover
def test_async_acquisition_whose_wait_fails_gives_the_lock_back(
    replicated: tuple[RedisServer, RedisServer],
) -> None:
    """The same through redis.asyncio: WAIT refused, the lock is free again."""
    import redis.asyncio

    master, _ = replicated

    async def main() -> None:
        client = redis.asyncio.Redis(port=master.port)
        try:
            lock = AsyncRedisLock(client, "await-fails", ttl=30, wait_replicas=1, blocking_timeout=0)
            lock._lock.wait_ms = 2**70
            with pytest.raises(redis.asyncio.ResponseError):
                await lock.acquire()
            assert await client.exists(lock.key) == 0 and not await lock.owned()
            async with AsyncRedisLock(client, "await-fails", ttl=5, blocking_timeout=0):
                pass
        finally:
            await client.aclose()

    asyncio.run(main())


@pytest.mark.failover
@pytest.mark.cancel
def test_replication_timeout_of_an_acquisition_says_the_lock_was_given_back(
    replicated: tuple[RedisServer, RedisServer], fenced_db: Engine
) -> None:
    """The message says the lock was given back (not "applied but not durable") and what .value holds."""
    import redis

    master, _ = replicated
    client = redis.Redis(port=master.port)
    try:
        plain = RedisLock(client, "given-back", ttl=30, wait_replicas=2, wait_timeout=0.05)
        with pytest.raises(ReplicationTimeout, match="given back") as caught:
            plain.acquire()
        message = str(caught.value)
        assert "not durable" not in message and "unused Redis fence" in message
        assert isinstance(caught.value.value, int) and caught.value.value > 0
        assert client.exists(plain.key) == 0

        fenced = RedisLock(client, "given-back", ttl=30, fences=fenced_db, wait_replicas=2, wait_timeout=0.05)
        with pytest.raises(ReplicationTimeout, match="given back") as caught:
            fenced.acquire()
        assert caught.value.value is None and "None (with fences=engine" in str(caught.value)
        assert client.exists(fenced.key) == 0
    finally:
        client.close()


# --------------------------------------------------------------------------
# Races on the cluster
# --------------------------------------------------------------------------


@pytest.mark.failover
@pytest.mark.parametrize("wait_replicas", [0, 1])
def test_one_token_consumed_by_8_threads_is_applied_once(cluster: LocalCluster, wait_replicas: int) -> None:
    """8 threads released together consume the same token: exactly one APPLIED, 7 REPEATED (20 rounds)."""
    client = cluster_client(cluster)
    try:
        tokens = RedisTokens(client, wait_replicas=wait_replicas)
        rounds = 20
        issued = [tokens.issue(scope=f"race}}{i}{{", ttl=MINUTE) for i in range(rounds)]
        barrier = threading.Barrier(THREADS)
        outcomes: list[list[Outcome]] = [[] for _ in range(rounds)]

        def worker() -> None:
            for i, token in enumerate(issued):
                barrier.wait()
                outcomes[i].append(tokens.consume(token, scope=f"race}}{i}{{").outcome)

        threads = [threading.Thread(target=worker) for _ in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for seen in outcomes:
            assert (seen.count(Outcome.APPLIED), seen.count(Outcome.REPEATED)) == (1, THREADS - 1), seen
    finally:
        client.close()


@pytest.mark.failover
def test_one_token_consumed_by_8_async_clients_is_applied_once(cluster: LocalCluster) -> None:
    """8 threads, each with its own event loop and redis.asyncio RedisCluster: one APPLIED per token."""
    from redis.asyncio.cluster import RedisCluster as AsyncCluster

    setup = cluster_client(cluster)
    rounds = 10
    try:
        issued = [RedisTokens(setup).issue(scope=f"arace:{i}", ttl=MINUTE) for i in range(rounds)]
    finally:
        setup.close()
    barrier = threading.Barrier(THREADS)
    outcomes: list[list[Outcome]] = [[] for _ in range(rounds)]

    async def consume_all() -> None:
        client = AsyncCluster(host="127.0.0.1", port=cluster.port)
        try:
            tokens = AsyncRedisTokens(client, wait_replicas=1)
            await client.initialize()
            for i, token in enumerate(issued):
                barrier.wait()  # this thread's own loop: blocking here holds up nobody else
                outcomes[i].append((await tokens.consume(token, scope=f"arace:{i}")).outcome)
        finally:
            await client.aclose()

    threads = [threading.Thread(target=asyncio.run, args=(consume_all(),)) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for seen in outcomes:
        assert (seen.count(Outcome.APPLIED), seen.count(Outcome.REPEATED)) == (1, THREADS - 1), seen


@pytest.mark.failover
@pytest.mark.parametrize("wait_replicas", [0, 1])
def test_8_threads_never_hold_one_lock_together(cluster: LocalCluster, wait_replicas: int) -> None:
    """8 threads x 12 acquisitions of one name on the cluster: never two holders, fences strictly grow."""
    client = cluster_client(cluster)
    try:
        holders = 0
        most = 0
        fences: list[int] = []
        guard = threading.Lock()
        barrier = threading.Barrier(THREADS)

        def worker() -> None:
            nonlocal holders, most
            lock = RedisLock(client, "}exclusion{", ttl=10, sleep=0.005, wait_replicas=wait_replicas)
            barrier.wait()
            for _ in range(12):
                with lock as fence:
                    with guard:
                        holders += 1
                        most = max(most, holders)
                        fences.append(fence)
                    time.sleep(0.002)
                    with guard:
                        holders -= 1

        threads = [threading.Thread(target=worker) for _ in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert most == 1
        assert len(fences) == THREADS * 12
        assert fences == sorted(set(fences))  # in the order the holders got the lock
    finally:
        client.close()


@pytest.mark.failover
def test_8_asyncio_clients_never_hold_one_lock_together(cluster: LocalCluster) -> None:
    """8 threads, each an event loop with its own asyncio RedisCluster and AsyncRedisLock: one holder."""
    from redis.asyncio.cluster import RedisCluster as AsyncCluster

    holders = 0
    most = 0
    fences: list[int] = []
    guard = threading.Lock()
    barrier = threading.Barrier(THREADS)

    async def worker() -> None:
        nonlocal holders, most
        client = AsyncCluster(host="127.0.0.1", port=cluster.port)
        try:
            await client.initialize()
            lock = AsyncRedisLock(client, "a}exclusion", ttl=10, sleep=0.005, wait_replicas=1)
            barrier.wait()
            for _ in range(8):
                async with lock as fence:
                    with guard:
                        holders += 1
                        most = max(most, holders)
                        fences.append(fence)
                    await asyncio.sleep(0.002)
                    with guard:
                        holders -= 1
        finally:
            await client.aclose()

    threads = [threading.Thread(target=lambda: asyncio.run(worker())) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert most == 1
    assert len(fences) == THREADS * 8
    assert fences == sorted(set(fences))


# --------------------------------------------------------------------------
# A failover in the middle of a storm
# --------------------------------------------------------------------------


@pytest.fixture
def fenced_db(pg: Backend) -> Iterator[Engine]:
    """PostgreSQL with stateguard's tables (stateguard_fences) and one Payout row to write under the lock."""
    engine = pg.engine
    drop_tables(engine)
    create_tables(engine)
    pg.create(LockBase.metadata)
    with Session(engine) as s, s.begin():
        s.add(Payout(id=1, holder=None))
    yield engine
    drop_tables(engine)


def fenced_write(engine: Engine, holder: str, fence: int) -> Outcome:
    with Session(engine) as s, s.begin():
        version = s.get_one(Payout, 1).version
        return guarded_update(s, Payout, 1, {"holder": holder}, expected_version=version, fence=fence).outcome


class Storm:
    """Token and lock workers hammering one slot until :meth:`stop`; what each saw acknowledged.

    6 threads issue and consume tokens (sync RedisCluster), 2 take a fenced RedisLock and write
    under it, one asyncio task issues and consumes through redis.asyncio's RedisCluster.
    """

    def __init__(self, cluster: LocalCluster, engine: Engine, tag: str, wait_replicas: int) -> None:
        self.cluster, self.engine, self.tag, self.wait_replicas = cluster, engine, tag, wait_replicas
        self.scope = f"{{{tag}}}"
        self.stopping = threading.Event()
        self.guard = threading.Lock()
        self.kept: list[tuple[float, str]] = []  # (when acknowledged, token) issued and never consumed
        self.consumed: list[tuple[float, str]] = []  # (when, token) consumed APPLIED, acknowledged
        self.not_durable = 0  # ReplicationTimeout: applied on the master, not acknowledged by a replica
        self.unacked: list[tuple[float, str]] = []  # (when, token) issued with a ReplicationTimeout
        self.errors: dict[str, int] = {}
        self.acquired: list[tuple[float, int]] = []  # (when, fence) per acquisition
        self.writes: list[tuple[int, Outcome]] = []  # (fence, outcome) of the fenced writes
        self.fences_of: dict[str, list[int]] = {}
        self.holders = 0
        self.overlaps = 0
        self.threads = [threading.Thread(target=self.tokens_worker) for _ in range(6)]
        self.threads += [threading.Thread(target=self.lock_worker, args=(f"L{i}",)) for i in range(2)]
        self.threads.append(threading.Thread(target=lambda: asyncio.run(self.async_tokens_worker())))
        self.async_consumed: list[float] = []  # when the asyncio cluster client's consumes were APPLIED

    def error(self, error: BaseException) -> None:
        with self.guard:
            name = type(error).__name__
            self.errors[name] = self.errors.get(name, 0) + 1
        time.sleep(0.02)

    def tokens_worker(self) -> None:
        client = cluster_client(self.cluster)
        tokens = RedisTokens(client, wait_replicas=self.wait_replicas, wait_timeout=0.2)
        try:
            while not self.stopping.is_set():
                try:
                    kept = tokens.issue(scope=self.scope, ttl=timedelta(minutes=5))
                    with self.guard:
                        self.kept.append((time.monotonic(), kept))
                    used = tokens.issue(scope=self.scope, ttl=timedelta(minutes=5))
                    if tokens.consume(used, scope=self.scope).applied:
                        with self.guard:
                            self.consumed.append((time.monotonic(), used))
                except ReplicationTimeout as error:
                    with self.guard:
                        self.not_durable += 1
                        if isinstance(error.value, str):  # an issued token, on the master only
                            self.unacked.append((time.monotonic(), error.value))
                    time.sleep(0.02)
                except Exception as error:  # the cluster is failing over: redis-py's errors
                    self.error(error)
        finally:
            client.close()

    async def async_tokens_worker(self) -> None:
        """The same through redis.asyncio's RedisCluster and AsyncRedisTokens (one task)."""
        from redis.asyncio.cluster import RedisCluster as AsyncCluster

        client = AsyncCluster(host="127.0.0.1", port=self.cluster.port)
        tokens = AsyncRedisTokens(client, wait_replicas=self.wait_replicas, wait_timeout=0.2)
        try:
            while not self.stopping.is_set():
                try:
                    used = await tokens.issue(scope=self.scope, ttl=timedelta(minutes=5))
                    if (await tokens.consume(used, scope=self.scope)).applied:
                        with self.guard:
                            self.consumed.append((time.monotonic(), used))
                            self.async_consumed.append(time.monotonic())
                except ReplicationTimeout:
                    with self.guard:
                        self.not_durable += 1
                    await asyncio.sleep(0.02)
                except Exception as error:
                    with self.guard:
                        name = f"async {type(error).__name__}"
                        self.errors[name] = self.errors.get(name, 0) + 1
                    await asyncio.sleep(0.02)
        finally:
            await client.aclose()

    def lock_worker(self, holder: str) -> None:
        client = cluster_client(self.cluster)
        lock = RedisLock(
            client, self.tag, ttl=3, blocking_timeout=1, sleep=0.01, fences=self.engine,
            wait_replicas=self.wait_replicas, wait_timeout=0.2,
        )  # fmt: skip
        try:
            while not self.stopping.is_set():
                try:
                    with lock as fence:
                        with self.guard:
                            self.acquired.append((time.monotonic(), fence))
                            self.fences_of.setdefault(holder, []).append(fence)
                            self.holders += 1
                            self.overlaps += self.holders > 1
                        try:
                            outcome = fenced_write(self.engine, holder, fence)
                            with self.guard:
                                self.writes.append((fence, outcome))
                        finally:
                            with self.guard:
                                self.holders -= 1
                except ReplicationTimeout:
                    with self.guard:
                        self.not_durable += 1
                    time.sleep(0.02)
                except Exception as error:
                    self.error(error)
        finally:
            client.close()

    def recovered(self, promoted_at: float, revived_at: float) -> bool:
        """Whether tokens (sync and asyncio) and locks have all worked again since the promotion."""
        with self.guard:
            return (
                any(when > revived_at for when, _ in self.consumed)
                and any(when > promoted_at for when in self.async_consumed)
                and any(when > promoted_at for when, _ in self.acquired)
            )

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(60)


@pytest.mark.failover
@pytest.mark.parametrize(("wait_replicas", "replica"), [(0, "healthy"), (0, "cut-off"), (1, "cut-off")])
def test_failover_in_the_middle_of_a_storm(
    cluster: LocalCluster, fenced_db: Engine, wait_replicas: int, replica: str
) -> None:
    """SIGKILL the storm slot's master mid-storm; its replica takes over; count what acknowledged writes lost.

    Must hold: with ``wait_replicas=1`` (every master has one replica, so the promoted replica has
    every write WAIT confirmed) no acknowledged token is lost and none consumed twice; with
    fences from the database, the fences never go back and the stored fence is the largest
    accepted one; clients work again after the failover (and, once the killed node rejoined as a
    replica, writes are acknowledged by WAIT again).  Measured (printed): acknowledged writes lost.

    ``cut-off``: for the last second before the master dies its replica is stalled (SIGSTOP) and
    the master drops the replication link (``CLIENT KILL TYPE replica``, what a network partition
    or an overflowing replica output buffer does); the replica is resumed (SIGCONT) right after
    the kill and promoted.  Whatever the master acknowledged in that second dies with it.
    """
    import redis

    tag = f"storm-{wait_replicas}-{replica}"
    victim = cluster.master_of(f"stateguard:token:{{{tag}}}:")
    follower = cluster.replica_of(victim)
    storm = Storm(cluster, fenced_db, tag, wait_replicas)
    storm.start()
    try:
        # At least 1.2 s, and until the storm has acknowledged enough to count losses in (on a
        # loaded machine 1.2 s once held only 8 consumes; a cut-off replica stalls WAIT-ed writes).
        started = time.monotonic()
        while time.monotonic() - started < 1.2 or len(storm.kept) < 10 or len(storm.consumed) < 10:
            assert time.monotonic() - started < 30, "the storm acknowledged too little in 30 s"
            time.sleep(0.05)
        if replica == "cut-off":
            follower.pause()
            on_victim = redis.Redis(host=victim.host, port=victim.port)
            on_victim.execute_command("CLIENT", "KILL", "TYPE", "replica")
            on_victim.close()
            time.sleep(1.0)
        killed_at = time.monotonic()
        cluster.kill(victim)
        follower.resume()
        promoted = cluster.wait_for_failover(victim)
        promoted_at = time.monotonic()
        cluster.revive(victim)  # it rejoins as the replica of the promoted node
        revived_at = time.monotonic()
        # Run on until every kind of client has worked again after the promotion (a lock whose
        # holder lost its release in the failover blocks the others until its 3 s TTL ends).
        deadline = revived_at + 8
        time.sleep(0.7)
        while time.monotonic() < deadline and not storm.recovered(promoted_at, revived_at):
            time.sleep(0.1)
    finally:
        follower.resume()
        storm.stop()
    assert cluster.master_of(f"stateguard:token:{{{tag}}}:").port == promoted.port == follower.port

    # What survived, read from the new master (no WAIT: reads only).
    client = cluster_client(cluster)
    try:
        checker = RedisTokens(client)
        before = [token for when, token in storm.kept if when < killed_at]
        lost_issues = sum(1 for token in before if not client.exists(RedisTokens.key(storm.scope, token)))
        unacked = [token for when, token in storm.unacked if when < killed_at]
        lost_unacked = sum(1 for token in unacked if not client.exists(RedisTokens.key(storm.scope, token)))
        consumed_before = [token for when, token in storm.consumed if when < killed_at]
        again = [checker.consume(token, scope=storm.scope).outcome for token in consumed_before]
        consumed_twice = again.count(Outcome.APPLIED)  # the tombstone was lost: a second APPLIED
        tokens_gone = again.count(Outcome.NOT_FOUND)  # the token itself was lost as well
    finally:
        client.close()

    fences = [fence for _, fence in storm.acquired]
    accepted = [fence for fence, outcome in storm.writes if outcome is Outcome.APPLIED]
    with Session(fenced_db) as s:
        stored = s.execute(select(Payout.fence).where(Payout.id == 1)).scalar_one()
    after = {
        "tokens": sum(1 for when, _ in storm.consumed if when > promoted_at),
        "locks": sum(1 for when, _ in storm.acquired if when > promoted_at),
        "tokens after rejoin": sum(1 for when, _ in storm.consumed if when > revived_at),
        "asyncio client": sum(1 for when in storm.async_consumed if when > promoted_at),
    }
    print(
        f"\nFAILOVER wait_replicas={wait_replicas}, {replica} replica: "
        f"failover took {promoted_at - killed_at:.1f}s; "
        f"acknowledged before the kill: {len(before)} issues, {len(consumed_before)} consumes; "
        f"lost: {lost_issues} issued tokens, {consumed_twice} consumes (token APPLIED again), "
        f"{tokens_gone} consumed tokens gone; lock acquisitions {len(fences)}, overlapping holders "
        f"{storm.overlaps}, fenced writes {len(storm.writes)} ({len(storm.writes) - len(accepted)} STALE); "
        f"ReplicationTimeout {storm.not_durable} (of its {len(unacked)} issued tokens, {lost_unacked} lost); "
        f"errors {storm.errors}; "
        f"successes after promotion {after}"
    )
    assert len(before) >= 10 and len(consumed_before) >= 10  # the storm really ran before the kill
    # Fences from the database never go back, failover or not: each holder's grow, none is handed out
    # twice, the row keeps the largest accepted one and (holders one at a time) accepted ones only grow.
    for holder in ("L0", "L1"):
        mine = storm.fences_of[holder]
        assert mine == sorted(set(mine)), holder
    assert len(set(fences)) == len(fences)
    assert stored == max(accepted)
    if storm.overlaps == 0:
        assert accepted == sorted(accepted)
    # Clients recover after the failover.
    assert after["tokens"] > 0 and after["locks"] > 0 and after["tokens after rejoin"] > 0
    assert after["asyncio client"] > 0
    if wait_replicas:
        assert lost_issues == 0 and consumed_twice == 0 and tokens_gone == 0
    elif replica == "cut-off":
        assert lost_issues > 0  # the window WAIT closes is real: without it, acknowledged tokens vanish
