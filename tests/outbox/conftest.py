"""Fixtures of the outbox tests: a private Redis server the tests stop, crash and restart by pid."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .._redis_server import RedisServer


@pytest.fixture(scope="module")
def private_redis() -> Iterator[RedisServer]:
    """A private Redis without persistence that a test module crashes, stops and restarts."""
    with RedisServer() as running:
        yield running
