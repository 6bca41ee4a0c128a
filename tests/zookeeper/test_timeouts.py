"""ZooKeeperLock.acquire(timeout=T) bounds the whole call, a client cut off from ZooKeeper included.

The client is cut off two ways: behind a :class:`~tests._support.zookeeper_server.Gate`
that closes every connection and refuses new ones (the client is SUSPENDED
and keeps trying to reconnect), and with the server process frozen by
SIGSTOP (the connection stays open, nothing answers).  Either way the call
ends within its timeout and a small slack with LockNotAcquired, nothing is
held, and once the client is back no contender znode of the abandoned
attempt is left to block the lock.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from stateguard import LockNotAcquired, ZooKeeperLock
from tests._support.zookeeper_server import Gate, ZooKeeperServer

pytest.importorskip("kazoo", reason="!!! SKIPPED: kazoo is not installed (pip install -e '.[test]')")

from kazoo.protocol.states import KazooState

#: How late past its timeout an acquire() may return: scheduling on a shared 2-core machine.
SLACK = 1.0


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout}s")
        time.sleep(0.02)


def timed_acquire(lock: ZooKeeperLock, timeout: float, limit: float) -> tuple[BaseException | int, float]:
    """``lock.acquire(timeout=timeout)`` in a thread: its outcome and duration, or a failure after ``limit``
    seconds (a call that does not end must not hang the test run)."""
    outcome: list[BaseException | int] = []
    started = time.monotonic()

    def run() -> None:
        try:
            outcome.append(lock.acquire(timeout=timeout))
        except BaseException as error:  # handed back to the test
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    elapsed = time.monotonic() - started
    assert outcome, f"acquire(timeout={timeout}) had not returned after {elapsed:.1f}s"
    return outcome[0], elapsed


@pytest.fixture
def gate(server: ZooKeeperServer) -> Iterator[Gate]:
    """A forwarder to the private server that the test can shut (cutting its clients off) and open."""
    with Gate(server.port) as running:
        yield running


@pytest.mark.cancel
@pytest.mark.parametrize("timeout", [0.5, 2.0])
def test_cut_off_client_gives_up_within_its_timeout(
    gate: Gate, clients: Callable[..., Any], path: str, timeout: float
) -> None:
    """A client whose connection is cut and cannot reconnect: acquire(timeout=T) raises LockNotAcquired
    within T plus a small slack, saying ZooKeeper did not answer, and holds nothing."""
    zk = clients(gate.hosts, timeout=10.0)
    states: list[str] = []
    zk.add_listener(states.append)
    lock = ZooKeeperLock(zk, path)
    gate.shut()
    wait_for(lambda: KazooState.SUSPENDED in states, 10, "SUSPENDED")
    outcome, elapsed = timed_acquire(lock, timeout, limit=timeout + 30)
    assert isinstance(outcome, LockNotAcquired), outcome
    assert "ZooKeeper did not answer" in str(outcome)
    assert elapsed < timeout + SLACK, f"acquire(timeout={timeout}) took {elapsed:.1f}s"
    assert not lock.is_held()


@pytest.mark.cancel
def test_connection_cut_during_acquire_gives_up_within_its_timeout(
    gate: Gate, clients: Callable[..., Any], path: str
) -> None:
    """The lock is contended and the connection is cut while acquire(timeout=2) waits: it still ends
    within its timeout with LockNotAcquired."""
    holder = ZooKeeperLock(clients(), path)
    holder.acquire()
    zk = clients(gate.hosts, timeout=10.0)
    lock = ZooKeeperLock(zk, path)
    threading.Timer(0.5, gate.shut).start()
    outcome, elapsed = timed_acquire(lock, 2.0, limit=40)
    assert isinstance(outcome, LockNotAcquired), outcome
    assert elapsed < 2.0 + SLACK, f"acquire(timeout=2) took {elapsed:.1f}s"
    holder.release()


@pytest.mark.cancel
def test_one_try_on_a_cut_off_client_is_bounded_by_the_session_timeout(
    gate: Gate, clients: Callable[..., Any], path: str
) -> None:
    """acquire(timeout=0) is one try: cut off, it gives up after the client's session timeout, not never."""
    zk = clients(gate.hosts, timeout=2.0)
    states: list[str] = []
    zk.add_listener(states.append)
    lock = ZooKeeperLock(zk, path)
    gate.shut()
    wait_for(lambda: KazooState.SUSPENDED in states, 10, "SUSPENDED")
    outcome, elapsed = timed_acquire(lock, 0, limit=40)
    assert isinstance(outcome, LockNotAcquired), outcome
    assert elapsed < 2.0 + SLACK, f"acquire(timeout=0) took {elapsed:.1f}s"


@pytest.mark.cancel
def test_abandoned_attempt_leaves_no_contender_once_reconnected(
    gate: Gate, clients: Callable[..., Any], path: str
) -> None:
    """An acquire() that gave up while cut off leaves no znode behind once the client reconnects
    within its session: another contender takes the lock at once, and the first can acquire again."""
    observer = clients()
    observer.ensure_path(path)
    zk = clients(gate.hosts, timeout=20.0)
    states: list[str] = []
    zk.add_listener(states.append)
    lock = ZooKeeperLock(zk, path)
    gate.shut()
    wait_for(lambda: KazooState.SUSPENDED in states, 10, "SUSPENDED")
    outcome, _ = timed_acquire(lock, 1.0, limit=40)
    assert isinstance(outcome, LockNotAcquired), outcome
    gate.open()
    wait_for(lambda: states[-1] == KazooState.CONNECTED, 20, "reconnection")
    assert KazooState.LOST not in states  # the same session: its znodes would still be there
    wait_for(lambda: observer.get_children(path) == [], 10, "no contender znode left")
    other = ZooKeeperLock(observer, path)
    other.acquire(timeout=0)
    other.release()
    fence = lock.acquire(timeout=5)
    assert lock.is_held() and fence > 0
    lock.release()
    assert observer.get_children(path) == []


@pytest.fixture
def frozen_server() -> Iterator[ZooKeeperServer]:
    """A private server of this test's own, that the test freezes (SIGSTOP) and thaws by its pid."""
    with ZooKeeperServer() as running:
        yield running
        if running.process is not None:
            os.kill(running.process.pid, signal.SIGCONT)


@pytest.mark.restart
@pytest.mark.cancel
def test_frozen_server_gives_up_within_its_timeout(
    frozen_server: ZooKeeperServer, clients: Callable[..., Any], path: str
) -> None:
    """The server process is frozen (SIGSTOP: the connection stays open, nothing answers): acquire(
    timeout=2) raises LockNotAcquired within its timeout; thawed, the lock works again."""
    zk = clients(frozen_server.hosts, timeout=10.0)
    lock = ZooKeeperLock(zk, path)
    assert frozen_server.process is not None
    pid = frozen_server.process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        outcome, elapsed = timed_acquire(lock, 2.0, limit=60)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert isinstance(outcome, LockNotAcquired), outcome
    assert elapsed < 2.0 + SLACK, f"acquire(timeout=2) took {elapsed:.1f}s"
    wait_for(lambda: zk.connected, 20, "reconnection")
    fence = lock.acquire(timeout=10)
    assert fence > 0 and lock.is_held()
    lock.release()
