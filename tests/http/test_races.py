"""Concurrent twins of one Idempotency-Key on the event loop run the app once."""

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
# Races, on the event loop
# --------------------------------------------------------------------------


def test_eight_concurrent_twins_on_the_event_loop_run_the_app_once(world: World) -> None:
    """Eight same-key requests start together; while the first holds the key, every other one is answered
    409 + Retry-After (same body) or 422 (another body), then all retries replay the one response."""
    app = middleware(world, lease=timedelta(seconds=30))

    async def scenario() -> tuple[list[Answer], list[Answer]]:
        world.entered, world.gate = asyncio.Event(), asyncio.Event()
        bodies = [b'{"amount": 1}'] * 6 + [b'{"amount": 2}'] * 2
        tasks = [asyncio.create_task(request(app, "/wait", key=b"twin", body=b)) for b in bodies]
        pending = set(tasks)
        while len(pending) > 1:
            _, pending = await asyncio.wait(pending, timeout=30, return_when=asyncio.FIRST_COMPLETED)
            assert pending, "every twin finished: none held the key"
        # the seven others can all be answered between the holder's claim and its first step into the app
        await asyncio.wait_for(world.entered.wait(), 30)
        world.gate.set()
        answers = list(await asyncio.gather(*tasks))
        retries = [await request(app, "/wait", key=b"twin") for _ in range(3)]
        return answers, retries

    answers, retries = asyncio.run(scenario())
    ran = [a for a in answers if a.status == 201]
    assert len(ran) == 1 and not ran[0].replayed
    others = sorted(a.status or 0 for a in answers if a is not ran[0])
    winner_body = json.loads(ran[0].body)
    assert all(a.error is None for a in answers)
    busy = [a for a in answers if a.status == 409]
    assert all(1 <= int(a.header(b"retry-after") or b"0") <= 30 for a in busy)
    if answers.index(ran[0]) < 6:
        assert others == [409] * 5 + [422] * 2
    else:  # a different-body twin won: the six same-body ones are now "another request"
        assert others == [409] + [422] * 6
    assert world.calls == 1 and world.effects() == 1
    if answers.index(ran[0]) < 6:
        assert all(r.status == 201 and r.replayed and json.loads(r.body) == winner_body for r in retries)


def test_two_clients_racing_with_the_same_key_each_run_once(world: World) -> None:
    """Two clients (different Authorization) send the same key and body at the same moment: each gets its own
    execution, neither a 409, a 422 nor the other's response."""
    app = middleware(world)

    async def scenario() -> list[Answer]:
        world.entered, world.gate = asyncio.Event(), asyncio.Event()
        world.gate.set()
        alice = [(b"authorization", b"Bearer alice")]
        bob = [(b"authorization", b"Bearer bob")]
        first = await asyncio.gather(
            request(app, "/wait", key=b"same", headers=alice), request(app, "/wait", key=b"same", headers=bob)
        )
        again = await asyncio.gather(
            request(app, "/wait", key=b"same", headers=alice), request(app, "/wait", key=b"same", headers=bob)
        )
        return [*first, *again]

    a1, b1, a2, b2 = asyncio.run(scenario())
    assert [a.status for a in (a1, b1, a2, b2)] == [201, 201, 201, 201]
    assert a1.body != b1.body and a2.body == a1.body and b2.body == b1.body
    assert a2.replayed and b2.replayed
    assert world.effects() == 2
