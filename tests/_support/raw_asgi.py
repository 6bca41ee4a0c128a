"""A plain ASGI app whose side effect writes a row to a real table, and a raw ASGI client that
controls disconnects, crashes after ``http.response.start`` and exact header bytes."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio.to_thread
from sqlalchemy import String, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard.asgi import IdempotencyMiddleware
from stateguard.tables import idempotency_keys


class _Base(DeclarativeBase):
    pass


class Effect(_Base):
    """One row per execution of the app's side effect."""

    __tablename__ = "sg_test_asgi_effects"
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
