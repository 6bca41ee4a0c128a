"""IdempotencyMiddleware with an async_sessionmaker (an app on AsyncSession): the key record goes through
the AsyncSession, with the same answers as with a sessionmaker, and heartbeat_every keeps a slow claim."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import async_sessionmaker
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from stateguard.asgi import IdempotencyMiddleware
from stateguard.tables import metadata as stateguard_metadata
from tests._support.async_helpers import AsyncTarget, target_from


@pytest.fixture(params=["aiosqlite", "asyncpg", "psycopg_async", "aiomysql"])
def target(request: pytest.FixtureRequest) -> Iterator[AsyncTarget]:
    """Each async driver with stateguard's tables."""
    t = target_from(request)
    t.backend.create(stateguard_metadata)
    yield t


class Shop:
    """A Starlette app whose payments handler counts its runs; ``hold`` seconds keep it busy."""

    def __init__(self) -> None:
        self.runs = 0
        self.entered = asyncio.Event()

    async def pay(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.runs += 1
        self.entered.set()
        await asyncio.sleep(body.get("hold", 0))
        if body.get("amount", 0) <= 0:
            return JSONResponse({"error": "no amount"}, 404)
        return JSONResponse({"payment": self.runs, "amount": body["amount"]}, 201)

    def app(self, target: AsyncTarget, **options: Any) -> tuple[Starlette, Any]:
        engine = target.engine()
        app = Starlette(routes=[Route("/payments", self.pay, methods=["POST"])])
        options.setdefault("anonymous", "shared")  # the test clients send no credentials
        app.add_middleware(IdempotencyMiddleware, session_factory=async_sessionmaker(engine), **options)
        return app, engine


def _client(app: Starlette) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shop", timeout=60)


def test_an_async_session_factory_runs_once_and_replays(target: AsyncTarget) -> None:
    """async_sessionmaker: 201 once, the retry replays, another body 422, in flight 409, a refusal forgets."""
    shop = Shop()

    async def main() -> None:
        app, engine = shop.app(target)
        try:
            async with _client(app) as client:

                async def pay(key: str, body: dict[str, Any]) -> httpx.Response:
                    return await client.post("/payments", json=body, headers={"Idempotency-Key": key})

                first = await pay("k1", {"amount": 10})
                retry = await pay("k1", {"amount": 10})
                assert first.status_code == 201 and "idempotency-replayed" not in first.headers
                assert retry.headers["idempotency-replayed"] == "true" and retry.json() == first.json()
                assert (await pay("k1", {"amount": 11})).status_code == 422
                slow = asyncio.ensure_future(pay("k2", {"amount": 5, "hold": 1}))
                await asyncio.wait_for(shop.entered.wait(), 30)
                busy = await pay("k2", {"amount": 5, "hold": 1})
                assert busy.status_code == 409 and int(busy.headers["retry-after"]) >= 1
                assert (await slow).status_code == 201
                assert (await pay("k3", {"amount": 0})).status_code == 404
                assert (await pay("k3", {"amount": 3})).status_code == 201  # the refusal forgot the key
        finally:
            await engine.dispose()

    asyncio.run(main())
    assert shop.runs == 4


def test_heartbeat_every_keeps_an_async_claim_past_its_lease(target: AsyncTarget) -> None:
    """With an AsyncSession the lease is extended from a task: a retry after the lease is 409, not a rerun."""
    shop = Shop()

    async def main() -> None:
        app, engine = shop.app(target, lease=timedelta(seconds=1), heartbeat_every=timedelta(seconds=0.2))
        try:
            async with _client(app) as client:
                body, key = {"amount": 4, "hold": 2.5}, {"Idempotency-Key": "slow"}
                first = asyncio.ensure_future(client.post("/payments", json=body, headers=key))
                await asyncio.wait_for(shop.entered.wait(), 30)
                await asyncio.sleep(1.5)  # past the lease: only the heartbeat keeps the claim
                assert (await client.post("/payments", json=body, headers=key)).status_code == 409
                done = await first
                assert done.status_code == 201
                replay = await client.post("/payments", json=body, headers=key)
                assert replay.headers["idempotency-replayed"] == "true" and replay.json() == done.json()
        finally:
            await engine.dispose()

    asyncio.run(main())
    assert shop.runs == 1
