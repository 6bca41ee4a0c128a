"""Attacks on ``IdempotencyMiddleware``'s README promises, the way production breaks them.

Most tests drive the middleware with raw ASGI messages (so a disconnect, a
crash after ``http.response.start`` or exact header bytes are under the test's
control) around a plain ASGI app; a few use Starlette's TestClient.  Every
execution of the app's side effect writes a row to a real table, so "the app
ran once" is counted in the database, not only in memory.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from typing import Any

import anyio.to_thread
import pytest
from sqlalchemy import Engine, String, create_engine, func, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from stateguard.asgi import IdempotencyMiddleware
from stateguard.tables import idempotency_keys
from stateguard.tables import metadata as stateguard_metadata
from tests._support.faultproxy import FaultProxy
from tests.conftest import Backend, _Namespaces, _only


class _Base(DeclarativeBase):
    pass


class Effect(_Base):
    """One row per execution of the app's side effect."""

    __tablename__ = "sg_test_asgi_attack_effects"
    id: Mapped[int] = mapped_column(primary_key=True)
    tag: Mapped[str] = mapped_column(String(64), default="")


Message = dict[str, Any]


@dataclass
class World:
    """The database, an effect counter, and gates the app waits on."""

    session_factory: Callable[[], Session]
    lock: threading.Lock = field(default_factory=threading.Lock)
    calls: int = 0
    entered: asyncio.Event | None = None
    gate: asyncio.Event | None = None

    def effect(self, tag: str) -> int:
        with self.lock:
            self.calls += 1
        with self.session_factory() as s, s.begin():
            row = Effect(tag=tag[:64])
            s.add(row)
            s.flush()
            return row.id

    def effects(self) -> int:
        with self.session_factory() as s:
            return int(s.scalar(select(func.count()).select_from(Effect)) or 0)

    def key_rows(self) -> list[Any]:
        with self.session_factory() as s:
            return list(s.execute(select(idempotency_keys)).all())


@pytest.fixture
def world(backend: Backend) -> World:
    backend.create(stateguard_metadata, _Base.metadata)
    return World(sessionmaker(backend.engine))


# --------------------------------------------------------------------------
# A plain ASGI app (no framework) and a raw ASGI client
# --------------------------------------------------------------------------

BINARY_BODY = bytes(range(256)) * 3000  # 768,000 bytes, every byte value, NULs included
BINARY_HEADERS = [
    (b"content-type", b"application/octet-stream"),
    (b"content-length", str(len(BINARY_BODY)).encode()),
    (b"x-obs-text", b"caf\xe9 \x80\xff"),  # obs-text bytes, legal in a field value
    (b"x-multi", b"one"),
    (b"x-multi", b"two"),
    (b"x-empty", b""),
    (b"x-nul", b"a\x00b"),  # not legal HTTP, but an app may send it: stored and replayed as given
    (b"location", b"/things/1?a=1&b=%20"),
]


async def _body(receive: Callable[[], Awaitable[Message]]) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def raw_app(world: World) -> Callable[..., Awaitable[None]]:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        path = scope["path"]
        body = await _body(receive)
        assert body is not None, "the app was handed a disconnect instead of the buffered body"
        if path == "/wait":
            assert world.entered is not None and world.gate is not None
            world.entered.set()
            await asyncio.wait_for(world.gate.wait(), 30)
        effect_id = await anyio.to_thread.run_sync(world.effect, path)
        if path in ("/pay", "/wait"):
            payload = json.dumps({"effect": effect_id}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 201,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"x-effect", str(effect_id).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": payload})
        elif path == "/binary":
            await send({"type": "http.response.start", "status": 200, "headers": BINARY_HEADERS})
            await send({"type": "http.response.body", "body": BINARY_BODY, "more_body": False})
        elif path == "/no-content":
            await send({"type": "http.response.start", "status": 204, "headers": [(b"x-effect", b"1")]})
            await send({"type": "http.response.body"})
        elif path == "/crash-after-start":
            await send({"type": "http.response.start", "status": 201, "headers": [(b"x-half", b"sent")]})
            raise RuntimeError("crashed after http.response.start")
        elif path == "/crash-after-body":
            await send({"type": "http.response.start", "status": 201, "headers": [(b"x-whole", b"sent")]})
            await send({"type": "http.response.body", "body": b"done", "more_body": False})
            raise RuntimeError("crashed after the whole response was sent")
        elif path in ("/stream", "/stream-crash"):
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
            )
            for i in range(500):
                await send({"type": "http.response.body", "body": b"%d," % i, "more_body": True})
                if path == "/stream-crash" and i == 99:
                    raise RuntimeError("the stream broke")
            await send({"type": "http.response.body", "body": b"end", "more_body": False})
        elif path == "/silent":
            return  # never answers
        else:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": body})

    return app


@dataclass
class Answer:
    messages: list[Message]
    error: BaseException | None = None

    @property
    def start(self) -> Message | None:
        return next((m for m in self.messages if m["type"] == "http.response.start"), None)

    @property
    def status(self) -> int | None:
        return None if self.start is None else int(self.start["status"])

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        return [] if self.start is None else [(bytes(k), bytes(v)) for k, v in self.start["headers"]]

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k.lower() == name), None)

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")

    @property
    def replayed(self) -> bool:
        return self.header(b"idempotency-replayed") == b"true"


async def request(
    app: Callable[..., Awaitable[None]],
    path: str = "/pay",
    *,
    key: bytes | None = b"k",
    body: bytes = b'{"amount": 1}',
    method: str = "POST",
    headers: list[tuple[bytes, bytes]] | None = None,
    chunks: list[bytes] | None = None,
    disconnect_mid_body: bool = False,
    send_fails: bool = False,
) -> Answer:
    """One request through raw ASGI; records what the server would have sent and any exception."""
    sent: list[Message] = []
    all_headers = [(b"host", b"test"), (b"content-type", b"application/json")] + (headers or [])
    if key is not None:
        all_headers.append((b"idempotency-key", key))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": all_headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
    }
    parts = chunks if chunks is not None else [body]
    incoming: list[Message] = [
        {"type": "http.request", "body": part, "more_body": i < len(parts) - 1}
        for i, part in enumerate(parts)
    ]
    if disconnect_mid_body:
        incoming[-1]["more_body"] = True
        incoming.append({"type": "http.disconnect"})
    finished = asyncio.Event()

    async def receive() -> Message:
        if incoming:
            return incoming.pop(0)
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if send_fails:
            raise OSError("the client went away")
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            finished.set()

    try:
        await app(scope, receive, send)
    except Exception as error:  # recorded for the test to judge
        return Answer(sent, error)
    return Answer(sent)


def middleware(world: World, **options: Any) -> IdempotencyMiddleware:
    # These attacks send no credentials: they opt in to the one anonymous namespace.
    options.setdefault("anonymous", "shared")
    return IdempotencyMiddleware(raw_app(world), session_factory=world.session_factory, **options)


# --------------------------------------------------------------------------
# Client disconnects
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# Apps that fail part-way, stream, or never answer
# --------------------------------------------------------------------------


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

    Found: the middleware held the whole 201 back until the app returned (after its background tasks),
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


# --------------------------------------------------------------------------
# Replays: byte-exact status, headers and body
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# Methods the header is ignored on, key values, body sizes
# --------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["HEAD", "OPTIONS", "PUT", "DELETE"])
def test_other_methods_pass_through_even_on_a_required_path(world: World, method: str) -> None:
    """The header is honoured only on POST and PATCH: elsewhere no 400 without a key, no claim, no replay."""
    app = middleware(world, required_paths=["/*"])

    async def scenario() -> list[Answer]:
        return [
            await request(app, "/pay", key=None, method=method),
            await request(app, "/pay", key=b"m", method=method),
            await request(app, "/pay", key=b"m", method=method),
        ]

    answers = asyncio.run(scenario())
    assert [a.status for a in answers] == [201, 201, 201]
    assert not any(a.replayed for a in answers)
    assert world.calls == 3 and world.key_rows() == []


@pytest.mark.parametrize(
    "value",
    [
        b"nul\x00inside",
        b"\xed\xa0\x80",  # a UTF-8-encoded lone surrogate
        b"\xff\xfe",  # not UTF-8 at all
        b"del\x7f",
        b"k" * 100_000,  # huge
        b'"' + b"k" * 256 + b'"',  # a quoted key that is one character too long once unquoted
        b'"   "',  # a quoted blank
        b"\t",
        b"key-a, key-b",  # two headers a proxy joined into one line
        b'"key-a", "key-b"',  # the same, quoted
    ],
    ids=[
        "nul",
        "surrogate",
        "not-utf8",
        "del",
        "huge",
        "quoted-oversize",
        "quoted-blank",
        "tab",
        "joined",
        "joined-quoted",
    ],
)
def test_hostile_key_bytes_are_400_problem_json(world: World, value: bytes) -> None:
    """Key values no database should see are answered 400 problem+json, and nothing runs or is stored."""
    app = middleware(world)
    answer = asyncio.run(request(app, key=value))
    assert answer.error is None and answer.status == 400
    assert answer.header(b"content-type") == b"application/problem+json"
    assert json.loads(answer.body)["title"] == "Invalid Idempotency-Key"
    assert world.calls == 0 and world.key_rows() == []


def test_a_quoted_key_of_255_characters_is_accepted(world: World) -> None:
    """The 255-character limit applies to the key, not to the quoted header value (257 bytes)."""
    app = middleware(world)

    async def scenario() -> tuple[Answer, Answer]:
        return await request(app, key=b'"' + b"q" * 255 + b'"'), await request(app, key=b"q" * 255)

    first, replay = asyncio.run(scenario())
    assert first.status == 201 and replay.replayed and world.calls == 1


def test_a_comma_is_a_key_character_only_when_quoted(world: World) -> None:
    """A bare ``a,b`` is two joined headers (400); the Structured Field string ``"a,b"`` is one key."""
    app = middleware(world)

    async def scenario() -> tuple[Answer, Answer]:
        return await request(app, key=b'"a,b"'), await request(app, key=b'"a,b"')

    first, replay = asyncio.run(scenario())
    assert first.status == 201 and replay.replayed and world.calls == 1
    assert [r.idem_key for r in world.key_rows()] == ["a,b"]


def test_a_body_of_exactly_max_body_in_many_chunks_is_accepted_and_one_more_byte_is_413(world: World) -> None:
    """max_body counts the whole body across chunks: exactly the limit runs, one byte over is 413."""
    app = middleware(world, max_body=1000)
    exact = [b"x" * 100] * 10
    over = [*exact, b"y"]

    async def scenario() -> tuple[Answer, Answer]:
        return await request(app, "/echo", key=b"a", chunks=exact), await request(
            app, "/echo", key=b"b", chunks=over
        )

    ok, too_big = asyncio.run(scenario())
    assert ok.status == 200 and ok.body == b"x" * 1000
    assert too_big.status == 413 and too_big.header(b"content-type") == b"application/problem+json"
    assert world.calls == 1
    assert [r.idem_key for r in world.key_rows()] == ["a"]


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
        assert world.entered.is_set()
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


# --------------------------------------------------------------------------
# Request identity
# --------------------------------------------------------------------------


def test_json_numbers_that_differ_only_beyond_float_precision_are_another_request(world: World) -> None:
    """Two JSON bodies whose amounts differ (as a Decimal-parsing handler sees them) are two requests: the
    second is 422, never a replay of the first one's response for a different amount.  Numbers a double
    holds exactly still count by value (1.50 is 1.5).

    Found: bodies were parsed into floats, so 12345678901234567890.5 and 12345678901234567891.5 (one
    double) were one request and the second client got a replay for another amount."""
    seen: list[Decimal] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = await _body(receive)
        amount = json.loads(body or b"", parse_float=Decimal)["amount"]
        seen.append(amount)
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": str(amount).encode()})

    mw = IdempotencyMiddleware(app, session_factory=world.session_factory, anonymous="shared")

    async def scenario() -> tuple[Answer, Answer]:
        first = await request(mw, key=b"dec", body=b'{"amount": 12345678901234567890.5}')
        other = await request(mw, key=b"dec", body=b'{"amount": 12345678901234567891.5}')
        return first, other

    first, other = asyncio.run(scenario())
    assert first.status == 201 and first.body == b"12345678901234567890.5"
    assert other.status == 422, (other.status, other.body, other.replayed)

    async def exact() -> tuple[Answer, Answer]:
        first = await request(mw, key=b"exact", body=b'{"amount": 1.50, "fee": 0.1}')
        same = await request(mw, key=b"exact", body=b'{"fee":1e-1,"amount":1.5}')
        return first, same

    first, same = asyncio.run(exact())
    assert first.status == 201 and same.status == 201 and same.replayed and same.body == first.body
    assert seen == [Decimal("12345678901234567890.5"), Decimal("1.50")]


# --------------------------------------------------------------------------
# The database: down before the claim, gone after the app ran, too small for the response
# --------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("dialect", ["postgresql+psycopg", "mysql+pymysql"])
def test_database_down_never_runs_the_app(dialect: str) -> None:
    """With the database unreachable the claim cannot be made: the app must not run, and the client must get
    a clear answer (a 5xx), not a success it cannot retry safely."""
    engine = create_engine(f"{dialect}://root@127.0.0.1:{_closed_port()}/test", pool_pre_ping=False)
    calls: list[str] = []

    async def pay(req: Request) -> Response:
        calls.append("pay")
        return JSONResponse({"ok": True}, status_code=201)

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, session_factory=sessionmaker(engine), anonymous="shared")
    try:
        with TestClient(app, raise_server_exceptions=False) as tc:
            answer = tc.post("/pay", json={"amount": 1}, headers={"Idempotency-Key": "down"})
            unkeyed = tc.post("/pay", json={"amount": 1})
    finally:
        engine.dispose()
    assert calls == ["pay"]  # only the request without a key reached the app
    assert unkeyed.status_code == 201
    assert 500 <= answer.status_code < 600


@pytest.mark.parametrize("dialect", ["postgresql+psycopg", "mysql+pymysql"])
def test_database_down_is_a_typed_503_problem(dialect: str) -> None:
    """README: "Errors are application/problem+json".  A database outage before the claim is a 503 problem
    with Retry-After, and the app does not run.

    Found: the driver's OperationalError escaped the middleware (a bare text/plain 500 from the server)."""
    engine = create_engine(f"{dialect}://root@127.0.0.1:{_closed_port()}/test")

    async def pay(req: Request) -> Response:
        return JSONResponse({"ok": True}, status_code=201)

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, session_factory=sessionmaker(engine), anonymous="shared")
    try:
        with TestClient(app, raise_server_exceptions=True) as tc:
            answer = tc.post("/pay", json={"amount": 1}, headers={"Idempotency-Key": "down"})
    finally:
        engine.dispose()
    assert answer.status_code == 503
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.headers["retry-after"] == "1"
    assert answer.json()["title"] == "Idempotency store unavailable"


def _proxied_url(backend: Backend, proxy: FaultProxy) -> str:
    url = make_url(backend.url).set(host=proxy.host, port=proxy.port)
    if backend.name == "postgresql":
        url = url.update_query_dict({"sslmode": "disable"})
    return url.render_as_string(hide_password=False)


@pytest.fixture(params=["postgresql", "mariadb"])
def server_backend(request: pytest.FixtureRequest, namespaces: _Namespaces) -> Iterator[Backend]:
    """PostgreSQL, then MariaDB: a database server the middleware can lose (not SQLite's file)."""
    yield from _only(request.param, namespaces)


def test_database_lost_after_the_app_ran_is_not_a_double_execution_within_the_lease(
    server_backend: Backend,
) -> None:
    """The database goes away after the claim, while the app runs: the response cannot be stored.  The key
    must stay held (409) for the rest of the lease once the database is back, not run the app again."""
    backend = server_backend
    backend.create(stateguard_metadata, _Base.metadata)
    direct = World(sessionmaker(backend.engine))
    proxy = FaultProxy("127.0.0.1", make_url(backend.url).port or 0)
    proxied: Engine = create_engine(_proxied_url(backend, proxy), pool_pre_ping=False)
    current: list[Engine] = [proxied]

    def factory() -> Session:
        return Session(current[0])

    async def pay(req: Request) -> Response:
        await req.body()
        effect_id = await anyio.to_thread.run_sync(direct.effect, "charge")
        proxy.close()  # the database becomes unreachable for the middleware
        return JSONResponse({"effect": effect_id}, status_code=201)

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware, session_factory=factory, lease=timedelta(seconds=60), anonymous="shared"
    )
    try:
        with TestClient(app, raise_server_exceptions=False) as tc:
            first = tc.post("/pay", json={"amount": 1}, headers={"Idempotency-Key": "lost-db"})
            current[0] = backend.engine  # the database is back
            retry = tc.post("/pay", json={"amount": 1}, headers={"Idempotency-Key": "lost-db"})
    finally:
        proxied.dispose()
        proxy.close()
    assert direct.calls == 1 and direct.effects() == 1
    assert first.status_code in (201, 500), first.status_code
    assert retry.status_code == 409 and int(retry.headers["retry-after"]) >= 1
    [row] = direct.key_rows()
    assert row.status == "in_progress"


def test_a_response_too_large_to_store_is_still_answered_and_not_run_twice(mariadb: Backend) -> None:
    """MariaDB: a 13 MB response (about 17 MB as base64) exceeds max_allowed_packet (16 MB), so it cannot be
    stored.  The app ran and answered 200; the client gets that 200, and its retry is told (a replayed 500
    problem naming the original status) instead of running the app a second time.

    Found: complete()'s InvalidArgument released the key and discarded the 200: the client got a 500 and
    its retry ran the app again."""
    mariadb.create(stateguard_metadata, _Base.metadata)
    world = World(sessionmaker(mariadb.engine))
    big = b"z" * (13 * 1024 * 1024)

    async def export(req: Request) -> Response:
        await req.body()
        await anyio.to_thread.run_sync(world.effect, "export")
        return Response(big, status_code=200, media_type="application/octet-stream")

    app = Starlette(routes=[Route("/export", export, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, session_factory=world.session_factory, anonymous="shared")
    with TestClient(app, raise_server_exceptions=False) as tc:
        first = tc.post("/export", json={}, headers={"Idempotency-Key": "huge"})
        retry = tc.post("/export", json={}, headers={"Idempotency-Key": "huge"})
    assert first.status_code == 200 and len(first.content) == len(big)
    assert world.effects() == 1, (retry.status_code, world.effects())
    assert retry.status_code == 500 and retry.headers["idempotency-replayed"] == "true"
    assert retry.headers["content-type"] == "application/problem+json"
    problem = retry.json()
    assert problem["original_status"] == 200 and "not run again" in problem["detail"], problem
    [row] = world.key_rows()
    assert row.status == "completed"
