"""A FastAPI app with a ``@app.middleware("http")`` function (Starlette's ``BaseHTTPMiddleware``) inside
``IdempotencyMiddleware``: its plain JSON answers reach the middleware as one body chunk followed by an
empty final one.  A retry must still replay the answer, not run the payment again, as on the WSGI face,
which counts a response of one chunk and empty ones as whole."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request, Response
from sqlalchemy.orm import sessionmaker

from stateguard.asgi import IdempotencyMiddleware
from stateguard.tables import metadata as stateguard_metadata
from tests._support.raw_asgi import World, _Base, middleware, request
from tests.conftest import Backend

pytestmark = pytest.mark.parametrize("backend", ["sqlite", "postgresql"], indirect=True)

HEADERS = {"Authorization": "Bearer rev-inner-alice", "Idempotency-Key": "rev-inner-1"}


def test_a_retry_through_an_inner_http_middleware_replays_and_charges_once(backend: Backend) -> None:
    """The timing middleware is declared before the idempotency one (so it runs inside it): the retry is
    the stored 201 with Idempotency-Replayed, and the card is charged once."""
    backend.create(stateguard_metadata)
    charges: list[int] = []
    app = FastAPI()

    @app.middleware("http")
    async def timing(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        response = await call_next(request)
        response.headers["x-elapsed"] = "1"
        return response

    @app.post("/payments")
    def pay(body: dict[str, Any]) -> dict[str, int]:
        charges.append(body["amount"])
        return {"charged": len(charges)}

    app.add_middleware(IdempotencyMiddleware, session_factory=sessionmaker(backend.engine))

    async def scenario() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://shop") as client:
            return [await client.post("/payments", json={"amount": 5}, headers=HEADERS) for _ in range(2)]

    first, retry = asyncio.run(scenario())
    assert first.status_code == retry.status_code == 200 and retry.content == first.content
    assert retry.headers.get("idempotency-replayed") == "true" and charges == [5], charges


@pytest.fixture
def world(backend: Backend) -> World:
    """stateguard's tables and the effect table on the backend, and a World on them."""
    backend.create(stateguard_metadata, _Base.metadata)
    return World(sessionmaker(backend.engine))


@pytest.mark.parametrize(
    "parts",
    [[b"", b"whole"], [b"whole", b""], [b"", b"whole", b"", b""]],
    ids=["empty-first", "empty-last", "empties-around"],
)
def test_one_chunk_among_empty_ones_is_a_whole_response(world: World, parts: list[bytes]) -> None:
    """A raw ASGI app sending one non-empty body chunk among empty ones: stored and replayed, run once."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        await asyncio.to_thread(world.effect, "parts")
        await send({"type": "http.response.start", "status": 201, "headers": [(b"x-parts", b"1")]})
        for i, part in enumerate(parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1})

    guarded = IdempotencyMiddleware(app, session_factory=world.session_factory, anonymous="shared")

    async def scenario() -> list[Any]:
        return [await request(guarded, "/parts", key=b"rev-parts") for _ in range(2)]

    first, retry = asyncio.run(scenario())
    assert first.status == retry.status == 201 and first.body == retry.body == b"whole"
    assert retry.replayed and world.effects() == 1


def test_two_non_empty_chunks_are_still_a_stream_sent_as_they_come(world: World) -> None:
    """The control: a response of two non-empty chunks is streamed, not stored; its retry runs again."""
    app = middleware(world)

    async def scenario() -> list[Any]:
        return [await request(app, "/stream", key=b"rev-stream") for _ in range(2)]

    first, retry = asyncio.run(scenario())
    assert first.status == retry.status == 200 and not retry.replayed and world.effects() == 2
