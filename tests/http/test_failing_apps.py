"""IdempotencyMiddleware around apps that fail part-way, stream or never answer: a crash after the
response started is a clean 500 that releases the key, a stream is delivered in order and not
stored, an app that never answers releases the key, and a failure after a complete response keeps
it stored and sent.  Side effects are counted in the database."""

from __future__ import annotations

import asyncio

import anyio.to_thread
import pytest
from sqlalchemy.orm import sessionmaker
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from stateguard.asgi import IdempotencyMiddleware
from stateguard.tables import metadata as stateguard_metadata
from tests._support.raw_asgi import (
    Answer,
    Effect,
    Message,
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
# Apps that fail part-way, stream, or never answer
# --------------------------------------------------------------------------


@pytest.mark.restart
def test_crash_after_response_start_is_a_clean_500_and_releases_the_key(world: World) -> None:
    """The app sent http.response.start, then raised: the half response never reaches the client (the server
    can still answer 500), the exception propagates, and the same request runs again."""
    app = middleware(world)

    async def scenario() -> tuple[Answer, Answer, Answer]:
        first = await request(app, "/crash-after-start", key=b"half")
        second = await request(app, "/crash-after-start", key=b"half")
        other = await request(app, "/crash-after-start", key=b"half", body=b'{"amount": 2}')
        return first, second, other

    first, second, other = asyncio.run(scenario())
    assert isinstance(first.error, RuntimeError) and first.messages == []
    assert isinstance(second.error, RuntimeError) and second.messages == []
    assert world.calls == 2  # released: the same request ran again
    assert other.status == 422  # ... and the key stays bound to its request
    assert all(r.status != "completed" and r.response is None for r in world.key_rows())


def test_stream_of_500_chunks_arrives_in_order_and_is_not_stored(world: World) -> None:
    """A 501-message streaming response is passed through byte for byte, in order, and not stored."""
    app = middleware(world)

    async def scenario() -> tuple[Answer, Answer]:
        return await request(app, "/stream", key=b"s"), await request(app, "/stream", key=b"s")

    first, second = asyncio.run(scenario())
    expected = b"".join(b"%d," % i for i in range(500)) + b"end"
    assert first.status == second.status == 200
    assert first.body == second.body == expected
    assert len([m for m in first.messages if m["type"] == "http.response.body"]) == 501
    assert not second.replayed and world.calls == 2
    assert all(r.response is None for r in world.key_rows())


def test_stream_that_breaks_half_way_releases_the_key(world: World) -> None:
    """A stream that raises after 100 chunks: the client got exactly those, the exception propagates, and
    the same request runs again."""
    app = middleware(world)

    async def scenario() -> tuple[Answer, Answer]:
        return await request(app, "/stream-crash", key=b"sc"), await request(app, "/stream-crash", key=b"sc")

    first, second = asyncio.run(scenario())
    assert isinstance(first.error, RuntimeError) and isinstance(second.error, RuntimeError)
    assert first.status == 200 and first.body == b"".join(b"%d," % i for i in range(100))
    assert world.calls == 2
    assert all(r.status != "completed" for r in world.key_rows())


@pytest.mark.cancel
def test_an_app_that_never_answers_releases_the_key(world: World) -> None:
    """An app that returns without a response: the middleware sends nothing of its own, stores nothing,
    and the same request runs again (not a 409 for a whole lease)."""
    app = middleware(world)

    async def scenario() -> tuple[Answer, Answer]:
        return await request(app, "/silent", key=b"mute"), await request(app, "/silent", key=b"mute")

    first, second = asyncio.run(scenario())
    assert first.error is None and first.messages == [] and second.messages == []
    assert world.calls == 2
    assert all(r.status != "completed" for r in world.key_rows())


def test_background_task_failure_after_a_complete_response_does_not_rerun_the_payment(world: World) -> None:
    """Starlette runs BackgroundTasks after the response was sent.  The handler charged and answered 201; the
    receipt e-mail task then fails.  The client must see the 201, and a retry must replay it.

    Regression: the middleware held the whole 201 back until the app returned (after its background tasks),
    then, on the task's exception, released the key and re-raised: the client got a 500 and its retry
    charged again.  The response is now recorded and sent as soon as the app sent it whole."""

    def send_receipt() -> None:
        raise RuntimeError("SMTP down")

    async def pay(req: Request) -> Response:
        await req.body()
        effect_id = await anyio.to_thread.run_sync(world.effect, "charge")
        return JSONResponse({"effect": effect_id}, status_code=201, background=BackgroundTask(send_receipt))

    bare = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    with TestClient(bare, raise_server_exceptions=False) as tc:
        assert tc.post("/pay", json={"amount": 10}).status_code == 201  # without the middleware: the 201
    world.calls = 0
    with world.session_factory() as s, s.begin():
        s.query(Effect).delete()
    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, session_factory=world.session_factory, anonymous="shared")
    with TestClient(app, raise_server_exceptions=False) as tc:
        first = tc.post("/pay", json={"amount": 10}, headers={"Idempotency-Key": "receipt"})
        retry = tc.post("/pay", json={"amount": 10}, headers={"Idempotency-Key": "receipt"})
    assert (first.status_code, retry.status_code, world.effects()) == (201, 201, 1)
    assert retry.headers.get("idempotency-replayed") == "true"


@pytest.mark.restart
def test_a_crash_after_the_whole_response_keeps_it_stored_and_sent(world: World) -> None:
    """The app sent its whole 201, then raised: the client has the 201, the error goes on to the server
    (to log), and the retry replays the 201 instead of running the app again."""
    app = middleware(world)

    async def scenario() -> tuple[Answer, Answer]:
        return (
            await request(app, "/crash-after-body", key=b"whole"),
            await request(app, "/crash-after-body", key=b"whole"),
        )

    first, retry = asyncio.run(scenario())
    assert isinstance(first.error, RuntimeError)
    assert first.status == 201 and first.body == b"done" and first.header(b"x-whole") == b"sent"
    assert retry.error is None and retry.replayed and retry.status == 201 and retry.body == b"done"
    assert world.calls == 1
    assert [r.status for r in world.key_rows()] == ["completed"]


def test_the_response_is_sent_before_the_apps_background_work(world: World) -> None:
    """A Starlette response's background task runs after the response was sent: with the middleware the
    client has the whole response (and the key is completed) before the task starts, not after it ends."""
    order: list[str] = []

    async def task() -> None:
        order.append("background task")

    async def pay(req: Request) -> Response:
        await req.body()
        await anyio.to_thread.run_sync(world.effect, "charge")
        return JSONResponse({"ok": True}, status_code=201, background=BackgroundTask(task))

    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/pay", pay, methods=["POST"])]),
        session_factory=world.session_factory,
        anonymous="shared",
    )

    async def scenario() -> Answer:
        sent: list[Message] = []

        async def send(message: Message) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                statuses = [r.status for r in await anyio.to_thread.run_sync(world.key_rows)]
                order.append(f"response sent, key {statuses}")

        incoming = [{"type": "http.request", "body": b'{"amount": 1}', "more_body": False}]

        async def receive() -> Message:
            return incoming.pop(0) if incoming else {"type": "http.disconnect"}

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/pay",
            "raw_path": b"/pay",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"idempotency-key", b"bg")],
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 80),
        }
        await app(scope, receive, send)
        return Answer(sent)

    answer = asyncio.run(scenario())
    assert answer.status == 201
    assert order == ["response sent, key ['completed']", "background task"]
