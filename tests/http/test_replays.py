"""Replays of IdempotencyMiddleware are byte-exact: binary bodies, raw header bytes and a 204
without a body come back as they were sent."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy.orm import sessionmaker

from stateguard.tables import metadata as stateguard_metadata
from tests._support.raw_asgi import (
    BINARY_BODY,
    BINARY_HEADERS,
    Answer,
    World,
    _Base,
    middleware,
    request,
)
from tests.conftest import Backend


@pytest.fixture
def world(backend: Backend) -> World:
    backend.create(stateguard_metadata, _Base.metadata)
    return World(sessionmaker(backend.engine))


# --------------------------------------------------------------------------
# Replays: byte-exact status, headers and body
# --------------------------------------------------------------------------


@pytest.mark.hostile
def test_binary_body_and_raw_header_bytes_replay_byte_exact(world: World) -> None:
    """A 768 KB binary body (every byte value) and headers with obs-text, repeated names and an empty value
    come back byte for byte, in order, plus Idempotency-Replayed."""
    app = middleware(world)

    async def scenario() -> tuple[Answer, Answer]:
        return await request(app, "/binary", key=b"bin"), await request(app, "/binary", key=b"bin")

    first, replay = asyncio.run(scenario())
    assert first.status == replay.status == 200
    assert first.body == replay.body == BINARY_BODY
    assert first.headers == BINARY_HEADERS and not first.replayed
    assert replay.headers == [*BINARY_HEADERS, (b"idempotency-replayed", b"true")]
    assert world.calls == 1 and world.effects() == 1


def test_204_without_body_replays_as_204(world: World) -> None:
    """A response whose body message has no ``body`` at all is stored and replayed as an empty 204."""
    app = middleware(world)

    async def scenario() -> tuple[Answer, Answer]:
        return await request(app, "/no-content", key=b"nc"), await request(app, "/no-content", key=b"nc")

    first, replay = asyncio.run(scenario())
    assert first.status == replay.status == 204 and first.body == replay.body == b""
    assert replay.replayed and replay.header(b"x-effect") == b"1"
    assert world.calls == 1
