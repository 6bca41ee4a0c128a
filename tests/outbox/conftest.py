"""Fixtures of the outbox tests: each async driver, a private Redis server the tests stop, crash and
restart by pid."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests._support.async_helpers import ASYNC_TARGETS, AsyncTarget, target_from
from tests._support.redis_server import RedisServer
from tests.conftest import Backend


@pytest.fixture(scope="module")
def private_redis() -> Iterator[RedisServer]:
    """A private Redis without persistence that a test module crashes, stops and restarts."""
    with RedisServer() as running:
        yield running


@pytest.fixture(params=list(ASYNC_TARGETS))
def target(request: pytest.FixtureRequest) -> AsyncTarget:
    """Each async driver, on the namespace of its backend."""
    return target_from(request)


@pytest.fixture(params=["lease", "locks"])
def hold(request: pytest.FixtureRequest, backend: Backend) -> str:
    """Each way a relay holds its claim (``Relay(hold=...)``); the "locks" variants of the other
    backends are not collected (tests/conftest.py deselects them: the mode does not exist there)."""
    return str(request.param)
