"""A request cancelled mid-handler (its client went away) frees its key on an AsyncSession, however often."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
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

HEADERS = [
    (b"idempotency-key", b"c-1"),
    (b"authorization", b"Bearer alice"),
    (b"content-type", b"application/json"),
]


@pytest.fixture(params=["aiosqlite", "asyncpg", "psycopg_async", "aiomysql"])
def target(request: pytest.FixtureRequest) -> Iterator[AsyncTarget]:
    """Each async driver with stateguard's tables."""
    t = target_from(request)
    t.backend.create(stateguard_metadata)
    yield t


def _scope() -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/payments",
        "raw_path": b"/payments",
        "root_path": "",
        "query_string": b"",
        "headers": HEADERS,
        "server": ("shop", 80),
        "client": ("10.0.0.1", 5000),
    }


@pytest.mark.cancel
@pytest.mark.parametrize("cancels", [1, 2, 5])
def test_a_cancelled_request_frees_its_key_for_the_retry(target: AsyncTarget, cancels: int) -> None:
    """Cancel the request (once, or again and again as anyio's scopes do): its retry runs at once, not 409."""
    runs: list[str] = []

    async def scenario() -> httpx.Response:
        entered = asyncio.Event()

        async def pay(request: Request) -> JSONResponse:
            await request.body()
            runs.append("pay")
            entered.set()
            if len(runs) == 1:
                await asyncio.sleep(60)  # the first is cancelled here
            return JSONResponse({"paid": len(runs)}, 201)

        engine = target.engine()
        try:
            app = Starlette(routes=[Route("/payments", pay, methods=["POST"])])
            middleware = IdempotencyMiddleware(app, session_factory=async_sessionmaker(engine))
            messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

            async def receive() -> dict[str, Any]:
                if messages:
                    return messages.pop()
                await asyncio.sleep(3600)
                raise AssertionError("unreachable")

            async def send(message: Any) -> None:
                pass

            task = asyncio.ensure_future(middleware(_scope(), receive, send))
            await asyncio.wait_for(entered.wait(), 30)
            for _ in range(cancels):
                task.cancel()
                await asyncio.sleep(0)
            with pytest.raises(asyncio.CancelledError):
                await task
            transport = httpx.ASGITransport(app=middleware)
            async with httpx.AsyncClient(transport=transport, base_url="http://shop") as client:
                headers = [(k.decode(), v.decode()) for k, v in HEADERS]
                return await client.post("/payments", content=b"{}", headers=headers)
        finally:
            await engine.dispose()

    retry = asyncio.run(scenario())
    assert retry.status_code == 201 and "idempotency-replayed" not in retry.headers, retry.text
    assert runs == ["pay", "pay"]
