"""Fixtures of the ZooKeeperLock tests: a private ZooKeeper server, clients of it, a lock path per test."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests._support.zk_workers import client_for
from tests._support.zookeeper_server import ZooKeeperServer

pytest.importorskip("kazoo", reason="!!! SKIPPED: kazoo is not installed (pip install -e '.[test]')")


@pytest.fixture(scope="module")
def server() -> Iterator[ZooKeeperServer]:
    """A private standalone ZooKeeper (skips loudly, fails in CI, when zookeeperd is not installed)."""
    with ZooKeeperServer() as running:
        yield running


@pytest.fixture
def clients(server: ZooKeeperServer) -> Iterator[Callable[..., Any]]:
    """``clients()`` makes a started KazooClient of the private server; all are stopped afterwards."""
    made: list[Any] = []

    def make(hosts: str | None = None, **kw: Any) -> Any:
        client = client_for(hosts or server.hosts, **kw)
        made.append(client)
        return client

    yield make
    for client in made:
        client.stop()
        client.close()


@pytest.fixture
def zk(clients: Callable[..., Any]) -> Any:
    """One started client of the private server."""
    return clients()


@pytest.fixture
def path() -> str:
    """A lock path of this test's own."""
    return f"/sg-tests/{uuid.uuid4().hex[:12]}/lock"
