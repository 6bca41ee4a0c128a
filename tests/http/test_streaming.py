"""A streamed response keeps its key in progress until the stream ends, then releases it (nothing stored)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import sessionmaker
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from werkzeug.test import EnvironBuilder

from stateguard.asgi import IdempotencyMiddleware
from stateguard.http.wsgi import WSGIIdempotencyMiddleware
from stateguard.tables import idempotency_keys
from stateguard.tables import metadata as stateguard_metadata
from tests.conftest import Backend

HEADERS = {"Idempotency-Key": "export-1", "Authorization": "Bearer alice"}


@pytest.fixture
def factory(backend: Backend) -> sessionmaker[Any]:
    """stateguard's tables on each backend and a sessionmaker for them."""
    backend.create(stateguard_metadata)
    return sessionmaker(backend.engine)


def _status(backend: Backend) -> list[str]:
    with backend.engine.connect() as conn:
        return [row.status for row in conn.execute(select(idempotency_keys))]


def _wsgi_export(runs: list[int]) -> Any:
    def app(environ: dict[str, Any], start_response: Any) -> Iterator[bytes]:
        runs.append(1)
        start_response("200 OK", [("Content-Type", "text/csv")])
        return iter([b"id\n", b"1\n", b"2\n", b"3\n"])

    return app


def _environ() -> dict[str, Any]:
    return EnvironBuilder(method="POST", path="/exports", json={"rows": 3}, headers=HEADERS).get_environ()


def test_wsgi_a_duplicate_while_the_stream_is_sent_is_409(
    factory: sessionmaker[Any], backend: Backend
) -> None:
    """While the server still iterates a streamed response, its twin is 409 and does not run the app."""
    runs: list[int] = []
    app = WSGIIdempotencyMiddleware(_wsgi_export(runs), session_factory=factory)
    starts: list[str] = []
    stream = app(_environ(), lambda status, headers, exc_info=None: starts.append(status))
    first_chunk = next(iter(stream))  # the server has sent the first chunk; the rest is still to come
    twin = b"".join(app(_environ(), lambda status, headers, exc_info=None: starts.append(status)))
    assert first_chunk == b"id\n" and starts == ["200 OK", "409 Conflict"], twin
    assert runs == [1] and _status(backend) == ["in_progress"]
    stream.close()  # type: ignore[attr-defined]  # PEP 3333: the server closes the iterable at the end
    again = app(_environ(), lambda status, headers, exc_info=None: starts.append(status))
    assert b"".join(again) == b"id\n1\n2\n3\n" and runs == [1, 1]  # released: the retry runs again
    again.close()  # type: ignore[attr-defined]


def test_wsgi_a_stream_the_server_abandons_releases_the_key(
    factory: sessionmaker[Any], backend: Backend
) -> None:
    """A client that goes away mid-stream (the server closes the iterable early) leaves the key free."""
    runs: list[int] = []
    app = WSGIIdempotencyMiddleware(_wsgi_export(runs), session_factory=factory)
    stream = app(_environ(), lambda status, headers, exc_info=None: None)
    next(iter(stream))
    stream.close()  # type: ignore[attr-defined]
    again = app(_environ(), lambda status, headers, exc_info=None: None)
    assert b"".join(again) == b"id\n1\n2\n3\n" and runs == [1, 1]
    again.close()  # type: ignore[attr-defined]


def test_asgi_a_duplicate_while_the_stream_is_sent_is_409(factory: sessionmaker[Any]) -> None:
    """ASGI: the twin of a request whose StreamingResponse still runs is 409 and does not run the app."""
    runs: list[int] = []
    midway, finish = threading.Event(), threading.Event()

    def rows() -> Iterator[bytes]:
        yield b"id\n"
        midway.set()
        assert finish.wait(30)
        yield b"1\n"

    async def export(req: Request) -> StreamingResponse:
        await req.body()
        runs.append(1)
        return StreamingResponse(rows(), media_type="text/csv")

    app = Starlette(routes=[Route("/exports", export, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, session_factory=factory)
    with TestClient(app) as client:
        first: list[Any] = []
        thread = threading.Thread(
            target=lambda: first.append(client.post("/exports", json={}, headers=HEADERS))
        )
        thread.start()
        assert midway.wait(30)
        twin = client.post("/exports", json={}, headers=HEADERS)
        finish.set()
        thread.join(30)
        again = client.post("/exports", json={}, headers=HEADERS)
    assert twin.status_code == 409 and first[0].content == b"id\n1\n"
    assert again.status_code == 200 and "idempotency-replayed" not in again.headers and runs == [1, 1]
