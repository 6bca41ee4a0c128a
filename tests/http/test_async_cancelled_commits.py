"""The ASGI face over an AsyncSession: a client that goes away while its
key is being committed, and raising observers, against docs/how-to/http.md."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import async_sessionmaker
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from stateguard.asgi import IdempotencyMiddleware
from stateguard.tables import idempotency_keys
from stateguard.tables import metadata as stateguard_metadata
from tests._support.async_helpers import AsyncTarget, target_from
from tests._support.failing_observers import raising_listener_and_span

HEADERS = {"Idempotency-Key": "rev-async-1", "Authorization": "Bearer rev-async-alice"}


@pytest.fixture(params=["aiosqlite", "asyncpg", "psycopg_async"])
def target(request: pytest.FixtureRequest) -> Iterator[AsyncTarget]:
    """Each async driver on SQLite and PostgreSQL, with stateguard's tables."""
    t = target_from(request)
    t.backend.create(stateguard_metadata)
    yield t


def _shop(runs: list[str]) -> Starlette:
    async def pay(request: Request) -> JSONResponse:
        body = await request.json()
        runs.append("pay")
        return JSONResponse({"paid": len(runs), "amount": body["amount"]}, 201)

    return Starlette(routes=[Route("/payments", pay, methods=["POST"])])


def _scope() -> dict[str, Any]:
    headers = [(k.lower().encode(), v.encode()) for k, v in HEADERS.items()]
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/payments", "raw_path": b"/payments", "root_path": "",
        "query_string": b"", "headers": [*headers, (b"content-type", b"application/json")],
        "server": ("shop", 80), "client": ("10.0.0.1", 5000),
    }  # fmt: skip


@pytest.mark.cancel
@pytest.mark.parametrize("target", ["asyncpg", "psycopg_async"], indirect=True)
@pytest.mark.parametrize("delay", [0.05, 0.2, 0.35])
def test_a_request_cancelled_while_its_claim_commits_frees_the_key(target: AsyncTarget, delay: float) -> None:
    """The claim's COMMIT takes 0.4 s (a deferred trigger sleeps); the client goes away during it: the
    app never ran, so the retry runs at once rather than being answered 409 for the whole lease."""
    with target.backend.engine.begin() as conn:
        conn.execute(text(
            "CREATE FUNCTION rev_slow_commit() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN PERFORM pg_sleep(0.4); RETURN NULL; END $$"
        ))  # fmt: skip
        conn.execute(text(
            "CREATE CONSTRAINT TRIGGER rev_slow_commit AFTER INSERT ON stateguard_idempotency_keys "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION rev_slow_commit()"
        ))  # fmt: skip
    runs: list[str] = []

    async def scenario() -> tuple[httpx.Response, list[str]]:
        engine = target.engine()
        try:
            middleware = IdempotencyMiddleware(_shop(runs), session_factory=async_sessionmaker(engine))
            messages = [{"type": "http.request", "body": b'{"amount": 5}', "more_body": False}]

            async def receive() -> dict[str, Any]:
                if messages:
                    return messages.pop()
                await asyncio.sleep(3600)
                raise AssertionError("unreachable")

            async def send(message: Any) -> None:
                pass

            task = asyncio.ensure_future(middleware(_scope(), receive, send))
            await asyncio.sleep(delay)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            async with engine.connect() as conn:
                rows = [r.status for r in await conn.execute(select(idempotency_keys))]
            transport = httpx.ASGITransport(app=middleware)
            async with httpx.AsyncClient(transport=transport, base_url="http://shop") as client:
                return await client.post("/payments", json={"amount": 5}, headers=HEADERS), rows
        finally:
            await engine.dispose()

    try:
        retry, rows = asyncio.run(scenario())
    finally:
        with target.backend.engine.begin() as conn:
            conn.execute(text("DROP TRIGGER IF EXISTS rev_slow_commit ON stateguard_idempotency_keys"))
            conn.execute(text("DROP FUNCTION IF EXISTS rev_slow_commit()"))
    assert retry.status_code == 201, (retry.status_code, retry.text, rows, runs)
    assert runs == ["pay"]


@pytest.mark.failing_observer
@pytest.mark.parametrize("where", ["factory", "enter", "exit"])
def test_raising_observers_change_no_answer_on_an_async_session(target: AsyncTarget, where: str) -> None:
    """A raising listener and span around an AsyncSession's key record: the first answer, its replay and
    the 422 of another body are as without them, and the app runs once."""

    runs: list[str] = []

    async def scenario() -> list[httpx.Response]:
        engine = target.engine()
        try:
            middleware = IdempotencyMiddleware(_shop(runs), session_factory=async_sessionmaker(engine))
            transport = httpx.ASGITransport(app=middleware)
            async with httpx.AsyncClient(transport=transport, base_url="http://shop") as client:
                first = await client.post("/payments", json={"amount": 5}, headers=HEADERS)
                retry = await client.post("/payments", json={"amount": 5}, headers=HEADERS)
                other = await client.post("/payments", json={"amount": 6}, headers=HEADERS)
                return [first, retry, other]
        finally:
            await engine.dispose()

    with raising_listener_and_span(where):
        first, retry, other = asyncio.run(scenario())
    assert [first.status_code, retry.status_code, other.status_code] == [201, 201, 422]
    assert retry.headers["idempotency-replayed"] == "true" and retry.content == first.content
    assert runs == ["pay"]


@pytest.mark.cancel
@pytest.mark.parametrize("target", ["asyncpg", "psycopg_async"], indirect=True)
def test_a_request_cancelled_while_its_response_is_recorded_is_replayed(target: AsyncTarget) -> None:
    """The record's COMMIT takes 0.4 s (a deferred trigger on UPDATE sleeps); the client goes away during
    it: the record finishes, and the retry gets the stored answer without running the app again."""
    with target.backend.engine.begin() as conn:
        conn.execute(text(
            "CREATE FUNCTION rev_slow_record() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN PERFORM pg_sleep(0.4); RETURN NULL; END $$"
        ))  # fmt: skip
        conn.execute(text(
            "CREATE CONSTRAINT TRIGGER rev_slow_record AFTER UPDATE ON stateguard_idempotency_keys "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION rev_slow_record()"
        ))  # fmt: skip
    runs: list[str] = []

    async def scenario() -> httpx.Response:
        answering = asyncio.Event()

        async def app(scope: Any, receive: Any, send: Any) -> None:
            await receive()
            runs.append("pay")
            await send({"type": "http.response.start", "status": 201, "headers": [(b"x-paid", b"1")]})
            answering.set()
            await send({"type": "http.response.body", "body": b'{"paid": 1}', "more_body": False})

        engine = target.engine()
        try:
            middleware = IdempotencyMiddleware(app, session_factory=async_sessionmaker(engine))
            messages = [{"type": "http.request", "body": b'{"amount": 5}', "more_body": False}]

            async def receive() -> dict[str, Any]:
                if messages:
                    return messages.pop()
                await asyncio.sleep(3600)
                raise AssertionError("unreachable")

            async def send(message: Any) -> None:
                pass

            task = asyncio.ensure_future(middleware(_scope(), receive, send))
            await asyncio.wait_for(answering.wait(), 30)
            await asyncio.sleep(0.15)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            transport = httpx.ASGITransport(app=middleware)
            async with httpx.AsyncClient(transport=transport, base_url="http://shop") as client:
                return await client.post("/payments", json={"amount": 5}, headers=HEADERS)
        finally:
            await engine.dispose()

    try:
        retry = asyncio.run(scenario())
    finally:
        with target.backend.engine.begin() as conn:
            conn.execute(text("DROP TRIGGER IF EXISTS rev_slow_record ON stateguard_idempotency_keys"))
            conn.execute(text("DROP FUNCTION IF EXISTS rev_slow_record()"))
    assert retry.status_code == 201 and retry.headers.get("idempotency-replayed") == "true", retry.text
    assert runs == ["pay"]
