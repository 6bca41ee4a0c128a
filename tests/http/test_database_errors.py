"""IdempotencyMiddleware when the database fails: down before the claim the app never runs and the
client gets a typed 503 problem; lost after the app ran it is not a double execution within the
lease; a response too large to store is still answered and not run twice."""

from __future__ import annotations

import socket
from datetime import timedelta

import anyio.to_thread
import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from stateguard.asgi import IdempotencyMiddleware
from stateguard.tables import metadata as stateguard_metadata
from tests._support.faultproxy import FaultProxy, through
from tests._support.raw_asgi import (
    World,
    _Base,
)
from tests.conftest import Backend, backends_with


@pytest.fixture
def world(backend: Backend) -> World:
    backend.create(stateguard_metadata, _Base.metadata)
    return World(sessionmaker(backend.engine))


# --------------------------------------------------------------------------
# The database: down before the claim, gone after the app ran, too small for the response
# --------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.restart
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


@pytest.mark.restart
@pytest.mark.parametrize("dialect", ["postgresql+psycopg", "mysql+pymysql"])
def test_database_down_is_a_typed_503_problem(dialect: str) -> None:
    """README: "Errors are application/problem+json".  A database outage before the claim is a 503 problem
    with Retry-After, and the app does not run.

    Regression: the driver's OperationalError escaped the middleware (a bare text/plain 500 from the
    server)."""
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


@pytest.mark.restart
@pytest.mark.lost_reply
@pytest.mark.parametrize("backend", backends_with("tcp_server"), indirect=True)
def test_database_lost_after_the_app_ran_is_not_a_double_execution_within_the_lease(
    backend: Backend,
) -> None:
    """The database goes away after the claim, while the app runs: the response cannot be stored.  The key
    must stay held (409) for the rest of the lease once the database is back, not run the app again."""
    backend.create(stateguard_metadata, _Base.metadata)
    direct = World(sessionmaker(backend.engine))
    proxy = FaultProxy("127.0.0.1", make_url(backend.url).port or 0)
    proxied: Engine = create_engine(through(backend.url, proxy), pool_pre_ping=False)
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


@pytest.mark.restart
@pytest.mark.limits
def test_a_response_too_large_to_store_is_still_answered_and_not_run_twice(mariadb: Backend) -> None:
    """MariaDB: a 13 MB response (about 17 MB as base64) exceeds max_allowed_packet (16 MB), so it cannot be
    stored.  The app ran and answered 200; the client gets that 200, and its retry is told (a replayed 500
    problem naming the original status) instead of running the app a second time.

    Regression: complete()'s InvalidArgument released the key and discarded the 200: the client got a 500 and
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
