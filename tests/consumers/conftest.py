"""Fixtures of the consumer tests: a database with stateguard's tables and an effects table, and the
brokers' private queues and streams."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine

from stateguard import create_tables, drop_tables

from .._support import brokers as _brokers
from .._support.faultproxy import FaultProxy, proxied_engine
from ..conftest import Backend
from ._effects import metadata


@pytest.fixture
def db(sqlite: Backend) -> Iterator[Engine]:
    """SQLite with stateguard's tables and ``consumer_effects``: for tests of a broker's consumer."""
    drop_tables(sqlite.engine)
    create_tables(sqlite.engine)
    sqlite.create(metadata)
    yield sqlite.engine
    drop_tables(sqlite.engine)


@pytest.fixture
def direct(backend: Backend) -> Iterator[Engine]:
    """stateguard's tables and ``consumer_effects`` on a ``backend``-parametrized test's
    backend, dropped afterwards."""
    engine = backend.create(metadata)
    drop_tables(engine)
    create_tables(engine)
    yield engine
    drop_tables(engine)


@pytest.fixture
def proxied(backend: Backend, direct: Engine) -> Iterator[tuple[Engine, FaultProxy]]:
    """An engine reaching the server through a FaultProxy, and the proxy."""
    with proxied_engine(backend.url) as made:
        yield made


@pytest.fixture
def mq() -> Iterator[_brokers.Queue]:
    """A private RabbitMQ exchange, queue and dead-letter queue."""
    with _brokers.rabbit_queue() as box:
        yield box


@pytest.fixture
def js() -> Iterator[_brokers.Stream]:
    """A private JetStream stream and its dead-letter stream."""
    with _brokers.nats_stream() as made:
        yield made


@pytest.fixture
def stream() -> Iterator[tuple[Any, str]]:
    """A Redis client and a private stream name."""
    with _brokers.redis_stream() as made:
        yield made
