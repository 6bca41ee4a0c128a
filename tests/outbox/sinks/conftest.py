"""Fixtures of the sink tests: a private RabbitMQ exchange and queue, a private JetStream stream."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from stateguard import create_tables, drop_tables

from ..._support import brokers as _brokers
from ...conftest import Backend


@pytest.fixture
def mq() -> Iterator[_brokers.Queue]:
    """A private topic exchange with a queue bound to ``#`` (and an exchange with no queue)."""
    with _brokers.rabbit_queue(dead_letters=False) as box:
        yield box


@pytest.fixture
def js() -> Iterator[_brokers.Stream]:
    """A private JetStream stream with a 60 s duplicate window."""
    with _brokers.nats_stream() as made:
        yield made


@pytest.fixture
def outbox_db(sqlite: Backend) -> Iterator[Engine]:
    """A SQLite outbox (stateguard's tables), dropped afterwards: for tests of a sink, not of a database."""
    drop_tables(sqlite.engine)
    create_tables(sqlite.engine)
    yield sqlite.engine
    drop_tables(sqlite.engine)
