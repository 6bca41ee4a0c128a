"""The ASGI face as production calls it: cancellation at every step of a keyed request, raising
observers, header-name case, hostile keys, repeated headers and huge bodies, each against the promises
of docs/how-to/http.md."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import event, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker

from stateguard.observe import on_event
from stateguard.tables import idempotency_keys
from stateguard.tables import metadata as stateguard_metadata
from tests._support.failing_observers import raising_listener_and_span
from tests._support.raw_asgi import BINARY_BODY, BINARY_HEADERS, World, _Base, middleware, request
from tests.conftest import Backend

pytestmark = pytest.mark.parametrize("backend", ["sqlite", "postgresql"], indirect=True)

ALICE = [(b"authorization", b"Bearer rev-asgi-alice")]


@pytest.fixture
def world(backend: Backend) -> World:
    """stateguard's tables and the effect table on the backend, and a World on them."""
    backend.create(stateguard_metadata, _Base.metadata)
    return World(sessionmaker(backend.engine))


def _statuses(world: World) -> list[str]:
    with world.session_factory() as s:
        return [row.status for row in s.execute(select(idempotency_keys))]


@contextlib.contextmanager
def _slow_claim(engine: Engine, reached: threading.Event, pause: float) -> Iterator[None]:
    """Hold the worker thread for ``pause`` seconds right after the claim's INSERT of the key row."""

    def after(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "INSERT INTO stateguard_idempotency_keys" in statement:
            reached.set()
            time.sleep(pause)

    event.listen(engine, "after_cursor_execute", after)
    try:
        yield
    finally:
        event.remove(engine, "after_cursor_execute", after)


@pytest.mark.cancel
def test_a_request_cancelled_while_its_key_is_claimed_frees_the_key(world: World, backend: Backend) -> None:
    """The client goes away (the task is cancelled) while the claim is being written: the app never runs,
    and the retry runs at once rather than being answered 409 for the whole lease."""
    app = middleware(world, lease=timedelta(seconds=30))
    reached = threading.Event()

    async def scenario() -> tuple[BaseException | None, Any]:
        with _slow_claim(backend.engine, reached, 0.5):
            task = asyncio.create_task(request(app, "/pay", key=b"rev-cancel-claim", headers=ALICE))
            deadline = time.monotonic() + 30
            while not reached.is_set():
                assert time.monotonic() < deadline, "the claim's INSERT was never seen"
                await asyncio.sleep(0.005)
            task.cancel()
            outcome: BaseException | None = None
            try:
                await task
            except asyncio.CancelledError as error:
                outcome = error
        retry = await request(app, "/pay", key=b"rev-cancel-claim", headers=ALICE)
        return outcome, retry

    cancelled, retry = asyncio.run(scenario())
    assert isinstance(cancelled, asyncio.CancelledError)
    assert retry.status == 201, (retry.status, retry.body, _statuses(world))
    assert not retry.replayed and world.effects() == 1


@pytest.mark.failing_observer
@pytest.mark.parametrize("where", ["factory", "enter", "exit"])
def test_a_raising_event_listener_and_span_change_no_answer(world: World, where: str) -> None:
    """A listener that raises on every event and a span that raises (made, entered or exited): the first
    answer, its replay, the 409 of a twin and the 422 of another body are what they are without them,
    and the app runs once."""

    app = middleware(world, lease=timedelta(seconds=30))
    with raising_listener_and_span(where):

        async def scenario() -> list[Any]:
            world.entered, world.gate = asyncio.Event(), asyncio.Event()
            first = asyncio.create_task(request(app, "/wait", key=b"rev-obs", headers=ALICE))
            await asyncio.wait_for(world.entered.wait(), 30)
            twin = await request(app, "/wait", key=b"rev-obs", headers=ALICE)
            other = await request(app, "/wait", key=b"rev-obs", headers=ALICE, body=b'{"amount": 2}')
            world.gate.set()
            done = await first
            replay = await request(app, "/wait", key=b"rev-obs", headers=ALICE)
            return [done, twin, other, replay]

        done, twin, other, replay = asyncio.run(scenario())
    assert (done.error, twin.error, other.error, replay.error) == (None, None, None, None)
    assert [done.status, twin.status, other.status, replay.status] == [201, 409, 422, 201]
    assert replay.replayed and replay.body == done.body
    assert world.effects() == 1


@pytest.mark.parametrize("name", [b"Idempotency-Key", b"IDEMPOTENCY-KEY", b"idempotency-KEY"])
def test_a_server_that_keeps_header_name_case_is_keyed_all_the_same(world: World, name: bytes) -> None:
    """A server handing the header name in its wire case (not lowered as ASGI asks): still one key, so the
    retry replays and the app runs once."""
    app = middleware(world)

    async def scenario() -> list[Any]:
        headers = [*ALICE, (name, b"rev-case")]
        return [await request(app, "/pay", key=None, headers=headers) for _ in range(2)]

    first, retry = asyncio.run(scenario())
    assert first.status == retry.status == 201 and retry.replayed and retry.body == first.body
    assert world.effects() == 1


@pytest.mark.hostile
@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"   ",
        b"k" * 10_000,
        b"a\x00b",
        b"caf\xc3\xa9",
        b"a\r\nSet-Cookie: x=1",
        b'"unterminated',
        b"a, b",
    ],
    ids=["empty", "blank", "10kB", "NUL", "utf8", "crlf", "bad-sf", "joined"],
)
def test_hostile_keys_run_nothing_and_store_nothing(world: World, value: bytes) -> None:
    """Each hostile key is a 400 problem with no header derived from it; the app does not run and no
    key row is written."""
    app = middleware(world)
    answer = asyncio.run(request(app, "/pay", key=value, headers=ALICE))
    assert answer.status == 400 and answer.header(b"content-type") == b"application/problem+json"
    assert all(b"\n" not in v and b"\r" not in v for _, v in answer.headers)
    assert all(k.lower() != b"set-cookie" for k, _ in answer.headers)
    assert world.effects() == 0 and world.key_rows() == []


@pytest.mark.limits
def test_a_large_binary_request_in_many_chunks_and_its_binary_response_replay_exactly(world: World) -> None:
    """A 1 MiB body sent in 1 kB chunks, answered with every byte value and repeated headers: the replay
    has the very status, header pairs (order and repeats) and body bytes of the first answer."""
    app = middleware(world, max_body=1024 * 1024)
    body = bytes(range(256)) * 4096
    chunks = [body[i : i + 1024] for i in range(0, len(body), 1024)]

    async def scenario() -> list[Any]:
        headers = [*ALICE, (b"content-type", b"application/octet-stream")]
        return [
            await request(app, "/binary", key=b"rev-big", headers=headers, chunks=chunks) for _ in range(2)
        ]

    first, retry = asyncio.run(scenario())
    assert first.status == retry.status == 200 and retry.replayed
    assert first.body == retry.body == BINARY_BODY
    assert first.headers == BINARY_HEADERS
    assert retry.headers == [*BINARY_HEADERS, (b"idempotency-replayed", b"true")]
    assert world.effects() == 1


@pytest.mark.parametrize("method", ["GET", "HEAD", "PUT", "DELETE"])
def test_other_methods_with_a_key_are_neither_claimed_nor_replayed(world: World, method: str) -> None:
    """A key on GET, HEAD, PUT or DELETE (not keyed by default) is ignored: the app runs every time and no
    key row is written."""
    app = middleware(world)

    async def scenario() -> list[Any]:
        return [await request(app, "/pay", key=b"rev-get", method=method, headers=ALICE) for _ in range(2)]

    first, second = asyncio.run(scenario())
    assert first.status == second.status == 201 and not second.replayed
    assert world.effects() == 2 and world.key_rows() == []


@contextlib.contextmanager
def _slow_statement(engine: Engine, prefix: str, reached: threading.Event, pause: float) -> Iterator[None]:
    """Hold the worker thread for ``pause`` seconds after each statement starting with ``prefix``."""

    def after(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().startswith(prefix):
            reached.set()
            time.sleep(pause)

    event.listen(engine, "after_cursor_execute", after)
    try:
        yield
    finally:
        event.remove(engine, "after_cursor_execute", after)


@pytest.mark.cancel
def test_a_request_cancelled_while_its_response_is_recorded_is_replayed_not_run_again(
    world: World, backend: Backend
) -> None:
    """The app answered whole; the client goes away while the answer is being recorded: the record
    finishes, and the retry gets the stored answer without running the app again."""
    app = middleware(world, lease=timedelta(seconds=30))
    reached = threading.Event()

    async def scenario() -> Any:
        with _slow_statement(backend.engine, "UPDATE stateguard_idempotency_keys", reached, 0.5):
            task = asyncio.create_task(request(app, "/pay", key=b"rev-cancel-settle", headers=ALICE))
            deadline = time.monotonic() + 30
            while not reached.is_set():
                assert time.monotonic() < deadline, "the record's UPDATE was never seen"
                await asyncio.sleep(0.005)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return await request(app, "/pay", key=b"rev-cancel-settle", headers=ALICE)

    retry = asyncio.run(scenario())
    assert retry.status == 201 and retry.replayed, (retry.status, retry.body, _statuses(world))
    assert world.effects() == 1


@pytest.mark.failing_observer
def test_a_heartbeat_keeps_the_key_under_raising_observers(world: World) -> None:
    """lease 1 s, heartbeat every 0.2 s, a handler of 2.5 s, and a listener that raises on every event
    (each beat included): the twin at 2 s is still 409, and the retry afterwards replays."""
    app = middleware(world, lease=timedelta(seconds=1), heartbeat_every=timedelta(seconds=0.2))

    def bad_listener(_event: Any) -> None:
        raise RuntimeError("listener broke")

    remove = on_event(bad_listener)
    try:

        async def scenario() -> list[Any]:
            world.entered, world.gate = asyncio.Event(), asyncio.Event()
            first = asyncio.create_task(request(app, "/wait", key=b"rev-beat", headers=ALICE))
            await asyncio.wait_for(world.entered.wait(), 30)
            await asyncio.sleep(2)
            twin = await request(app, "/wait", key=b"rev-beat", headers=ALICE)
            await asyncio.sleep(0.5)
            world.gate.set()
            done = await first
            return [done, twin, await request(app, "/wait", key=b"rev-beat", headers=ALICE)]

        done, twin, retry = asyncio.run(scenario())
    finally:
        remove()
    assert [done.status, twin.status, retry.status] == [201, 409, 201] and retry.replayed
    assert retry.body == done.body and world.effects() == 1
