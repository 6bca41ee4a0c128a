"""IdempotencyMiddleware when the client goes away: a disconnect in the request body runs nothing and
claims nothing, a client gone while the response is sent still gets it stored, and a cancelled
request releases its key at once.  Side effects are counted in the database."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta

import pytest
from sqlalchemy.orm import sessionmaker

from stateguard.tables import metadata as stateguard_metadata
from tests._support.raw_asgi import (
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
# Client disconnects
# --------------------------------------------------------------------------


@pytest.mark.cancel
def test_disconnect_mid_request_body_runs_nothing_and_claims_nothing(world: World) -> None:
    """A client that goes away half-way through its body: no app run, no key record, no response;
    the full retry then runs once and replays after."""
    app = middleware(world)

    async def scenario() -> tuple[Answer, Answer, Answer]:
        cut = await request(app, chunks=[b'{"amou', b'nt": 1}'], disconnect_mid_body=True)
        first = await request(app, chunks=[b'{"amou', b'nt": 1}'])
        again = await request(app)
        return cut, first, again

    cut, first, again = asyncio.run(scenario())
    assert cut.error is None and cut.messages == []
    assert first.status == 201 and not first.replayed
    assert again.status == 201 and again.replayed and again.body == first.body
    assert world.calls == 1 and world.effects() == 1


@pytest.mark.cancel
def test_client_gone_while_the_response_is_sent_still_stores_it(world: World) -> None:
    """The send of the response fails (the client disconnected): the response was stored first, so the
    retry replays it and the app ran once."""
    app = middleware(world)

    async def scenario() -> tuple[Answer, Answer]:
        lost = await request(app, key=b"lost", send_fails=True)
        retry = await request(app, key=b"lost")
        return lost, retry

    lost, retry = asyncio.run(scenario())
    assert isinstance(lost.error, OSError)
    assert retry.status == 201 and retry.replayed
    assert world.calls == 1 and world.effects() == 1
    assert json.loads(retry.body)["effect"] == int(retry.header(b"x-effect") or 0)


@pytest.mark.cancel
@pytest.mark.parametrize("heartbeat", [None, timedelta(milliseconds=200)], ids=["no-heartbeat", "heartbeat"])
def test_cancelled_request_releases_its_key_at_once(world: World, heartbeat: timedelta | None) -> None:
    """A request task cancelled while the app runs (a server that cancels on disconnect) does not leave the
    key in progress for a whole lease (nor a heartbeat running): the retry runs at once, not a 409."""
    app = middleware(world, lease=timedelta(seconds=60), heartbeat_every=heartbeat)

    async def scenario() -> Answer:
        world.entered, world.gate = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(request(app, "/wait", key=b"cancel-me"))
        await asyncio.wait_for(world.entered.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        world.entered, world.gate = asyncio.Event(), asyncio.Event()
        world.gate.set()
        return await request(app, "/wait", key=b"cancel-me")

    retry = asyncio.run(scenario())
    assert retry.status == 201 and not retry.replayed, (retry.status, retry.body)
    assert world.effects() == 1  # the cancelled run never reached its effect
    [row] = world.key_rows()
    assert row.status == "completed"
