"""The middleware's path patterns (``required_paths``, ``routes``) under an ASGI ``root_path``, as uvicorn
``--root-path /api`` (behind a proxy that strips the prefix) or a Starlette ``Mount`` hand it: they must
mean what the app's own routes mean, or a payment route's options silently stop applying."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from flask import Flask, jsonify, request
from sqlalchemy.orm import sessionmaker
from starlette.applications import Starlette
from starlette.routing import Mount
from werkzeug.exceptions import NotFound
from werkzeug.routing import Map, Rule
from werkzeug.test import Client

from stateguard.asgi import IdempotencyMiddleware, RouteOptions, default_store_status
from stateguard.http.wsgi import WSGIIdempotencyMiddleware
from stateguard.tables import metadata as stateguard_metadata
from tests.conftest import Backend

pytestmark = pytest.mark.parametrize("backend", ["sqlite", "postgresql"], indirect=True)

ALICE = {"Authorization": "Bearer rev-root-alice"}


def _payments(charges: list[int], extra: str | None = None) -> FastAPI:
    """A payments app whose handler charges first and may then find a conflict (409 after acting);
    ``extra`` is a second path to it."""
    app = FastAPI()

    @app.post("/payments")
    @app.post(extra or "/payments")
    def pay(body: dict[str, Any]) -> JSONResponse:
        charges.append(body["amount"])  # psp.charge(...)
        if body.get("conflict"):
            return JSONResponse({"charged": len(charges), "error": "order changed"}, status_code=409)
        return JSONResponse({"charged": len(charges)}, status_code=201)

    return app


def _middleware(app: Any, backend: Backend, also: str | None = None) -> IdempotencyMiddleware:
    backend.create(stateguard_metadata)
    return IdempotencyMiddleware(
        app,
        session_factory=sessionmaker(backend.engine),
        required_paths=["/payments", *([also] if also else [])],
        # the how-to's advice for a handler that answers 409 after it acted
        routes={"/payments": RouteOptions(store_status=lambda s: s == 409 or default_store_status(s))},
    )


async def _post(app: Any, url: str, root_path: str, **kw: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, root_path=root_path)
    async with httpx.AsyncClient(transport=transport, base_url="http://shop") as client:
        return await client.post(url, **kw)


def _served_under_root_path(backend: Backend, charges: list[int]) -> tuple[Any, str, str]:
    """uvicorn --root-path /api: scope["path"] is "/api/payments", scope["root_path"] "/api"."""
    return _middleware(_payments(charges), backend), "http://shop/api/payments", "/api"


def _plain(backend: Backend, charges: list[int]) -> tuple[Any, str, str]:
    """The control: no root path."""
    return _middleware(_payments(charges), backend), "http://shop/payments", ""


def _mounted(backend: Backend, charges: list[int]) -> tuple[Any, str, str]:
    """The middleware on a sub-app mounted at /v1 (Starlette's Mount sets root_path "/v1")."""
    return (
        Starlette(routes=[Mount("/v1", app=_middleware(_payments(charges), backend))]),
        "http://shop/v1/payments",
        "",
    )


def _mounted_twice(backend: Backend, charges: list[int]) -> tuple[Any, str, str]:
    """A Mount inside a Mount (root_path "/shop/v1" by the time the middleware runs)."""
    inner = Starlette(routes=[Mount("/v1", app=_middleware(_payments(charges), backend))])
    return Starlette(routes=[Mount("/shop", app=inner)]), "http://shop/shop/v1/payments", ""


def _mounted_under_root_path(backend: Backend, charges: list[int]) -> tuple[Any, str, str]:
    """uvicorn --root-path /api in front of a Mount at /v1 (root_path "/api/v1")."""
    app = Starlette(routes=[Mount("/v1", app=_middleware(_payments(charges), backend))])
    return app, "http://shop/api/v1/payments", "/api"


SERVED = [_plain, _served_under_root_path, _mounted, _mounted_twice, _mounted_under_root_path]
SERVED_IDS = ["plain", "root-path", "mount", "mount-in-mount", "mount-under-root-path"]


@pytest.mark.parametrize("serve", SERVED, ids=SERVED_IDS)
def test_a_required_path_needs_its_key_under_a_root_path(backend: Backend, serve: Any) -> None:
    """POST /payments without a key is 400 and charges nothing, whether or not the app is served
    under a root path."""
    charges: list[int] = []
    app, url, root_path = serve(backend, charges)
    response = asyncio.run(_post(app, url, root_path, json={"amount": 5}, headers=ALICE))
    assert response.status_code == 400 and charges == [], (response.status_code, response.text)


@pytest.mark.parametrize("serve", SERVED, ids=SERVED_IDS)
def test_a_routes_store_status_applies_under_a_root_path(backend: Backend, serve: Any) -> None:
    """The route stores its 409-after-charging, so the retry replays the 409 instead of charging again,
    under a root path as without one."""
    charges: list[int] = []
    app, url, root_path = serve(backend, charges)
    headers = {**ALICE, "Idempotency-Key": "rev-root-1"}
    body = {"amount": 5, "conflict": True}

    async def scenario() -> list[httpx.Response]:
        return [await _post(app, url, root_path, json=body, headers=headers) for _ in range(2)]

    first, retry = asyncio.run(scenario())
    assert first.status_code == 409 and retry.status_code == 409
    assert retry.headers.get("idempotency-replayed") == "true" and charges == [5], charges


# (root_path, URL path) as uvicorn hands them (its scope path is root_path + the request's path, so
# --root-path "/" or "/api/" doubles a slash), as a proxy that strips the prefix, or hypercorn, hands
# them (path without root_path), and hostile ones: a root_path that is not a whole segment of the
# path, equal to the path, longer than it, of another case, non-ASCII.  Starlette routes the first
# ones to /payments; the next ones it answers 404, but an app that routes as werkzeug does (below)
# reaches /payments there, so the key is required; the last ones reach no route at all.
ASGI_SPELLINGS = [
    ("/", "//payments", 400),
    ("/api/", "/api//payments", 400),
    ("/api", "/payments", 400),
    ("/café", "/caf%C3%A9/payments", 400),
    ("/café", "/caf%C3%A9/zahlungen/%C3%BCber", 400),
    ("", "//payments", 400),
    ("/api", "/api//payments", 400),
    ("/api", "/apipayments", 400),
    ("/api", "/apiary/payments", 404),
    ("/api/payments", "/api/payments", 404),
    ("/api", "/API/payments", 404),
    ("/api/payments/x", "/api/payments", 404),
]


@pytest.mark.hostile
@pytest.mark.parametrize(("root_path", "path", "status"), ASGI_SPELLINGS)
def test_a_required_path_needs_its_key_however_the_root_path_is_spelled(
    backend: Backend, root_path: str, path: str, status: int
) -> None:
    """The patterns mean what Starlette's routes mean under any root_path: a keyless POST that reaches
    a required route is 400, and none charges."""
    charges: list[int] = []
    app = _middleware(_payments(charges, extra="/zahlungen/über"), backend, also="/zahlungen/über")
    response = asyncio.run(_post(app, "http://shop" + path, root_path, json={"amount": 5}, headers=ALICE))
    assert response.status_code == status and charges == [], (response.status_code, response.text)


def _werkzeug_routed(charges: list[int]) -> Any:
    """The payments route of an ASGI app that routes as Quart (Flask's ASGI twin) does: ``root_path``
    cut off ``path`` as a string, then werkzeug's ``Map``, which strips the leading slashes."""
    routes = Map([Rule("/payments", endpoint="pay", methods=["POST"])])

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        path, root_path = scope["path"], scope.get("root_path", "")
        if root_path:  # quart.asgi._normalise_path
            path = " " if path == root_path or not path.startswith(root_path) else path[len(root_path) :]
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            routes.bind("shop").match(path, method=scope["method"])
            charges.append(json.loads(body)["amount"])  # psp.charge(...)
            status, answer = 201, b'{"charged": true}'
        except NotFound:
            status, answer = 404, b"{}"
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": answer})

    return app


# Where the werkzeug-routed app reaches /payments: leading slashes, a root_path cut off mid-segment
# ("/api" off "/apipayments") or with its trailing slash ("/api/" off "/api/payments").
WERKZEUG_SPELLINGS = [
    ("", "//payments"),
    ("/api", "/api//payments"),
    ("/api", "/apipayments"),
    ("/api/", "/api/payments"),
]


@pytest.mark.hostile
@pytest.mark.parametrize(("root_path", "path"), WERKZEUG_SPELLINGS)
def test_a_required_path_needs_its_key_in_an_app_that_routes_as_werkzeug(
    backend: Backend, root_path: str, path: str
) -> None:
    """The ASGI face in front of a Quart-style app: a keyless POST that its router takes to
    /payments is 400 and charges nothing."""
    charges: list[int] = []
    app = _middleware(_werkzeug_routed(charges), backend)
    response = asyncio.run(_post(app, "http://shop" + path, root_path, json={"amount": 5}, headers=ALICE))
    assert response.status_code == 400 and charges == [], (response.status_code, response.text)


def _flask_payments(backend: Backend, charges: list[int]) -> Client:
    """The same payments app in Flask, behind the WSGI face with the same patterns; a non-ASCII route too."""
    backend.create(stateguard_metadata)
    app = Flask(__name__)

    @app.post("/payments")
    @app.post("/zahlungen/über")
    def pay() -> Any:
        body = request.get_json()
        charges.append(body["amount"])  # psp.charge(...)
        status = 409 if body.get("conflict") else 201
        return jsonify(charged=len(charges)), status

    app.wsgi_app = WSGIIdempotencyMiddleware(  # type: ignore[method-assign]
        app.wsgi_app,
        session_factory=sessionmaker(backend.engine),
        required_paths=["/payments", "/zahlungen/über"],
        routes={"/payments": RouteOptions(store_status=lambda s: s == 409 or default_store_status(s))},
    )
    return Client(app)


# PATH_INFO as gunicorn hands it (PEP 3333: the request path's bytes, percent-decoded, as latin-1), for
# spellings Flask routes to a required route: leading slashes (werkzeug strips them), SCRIPT_NAME cut
# off as a string (gunicorn: SCRIPT_NAME "/api", request "/apipayments"), and UTF-8 bytes.
WSGI_SPELLINGS = [
    ("", "//payments"),
    ("/api", "payments"),
    ("/api", "//payments"),
    ("", "/zahlungen/über".encode().decode("latin-1")),
]
WSGI_IDS = ["double-slash", "script-name-not-a-segment", "script-name-double-slash", "utf-8"]


@pytest.mark.hostile
@pytest.mark.parametrize(("script_name", "path_info"), WSGI_SPELLINGS, ids=WSGI_IDS)
def test_a_required_path_needs_its_key_however_the_wsgi_server_spells_it(
    backend: Backend, script_name: str, path_info: str
) -> None:
    """A keyless POST that Flask routes to a required route is 400 and charges nothing."""
    charges: list[int] = []
    client = _flask_payments(backend, charges)
    environ = {"SCRIPT_NAME": script_name, "PATH_INFO": path_info}
    response = client.post("/", json={"amount": 5}, headers=ALICE, environ_overrides=environ)
    assert response.status_code == 400 and charges == [], (response.status_code, response.text)


@pytest.mark.hostile
def test_a_routes_store_status_applies_however_the_wsgi_server_spells_it(backend: Backend) -> None:
    """The 409-after-charging of /payments, requested as //payments, is stored and replayed: the
    retry does not charge again."""
    charges: list[int] = []
    client = _flask_payments(backend, charges)
    headers = {**ALICE, "Idempotency-Key": "rev-root-wsgi-1"}
    environ = {"PATH_INFO": "//payments"}
    first, retry = (
        client.post("/", json={"amount": 5, "conflict": True}, headers=headers, environ_overrides=environ)
        for _ in range(2)
    )
    assert first.status_code == 409 and retry.status_code == 409
    assert retry.headers.get("idempotency-replayed") == "true" and charges == [5], charges
