"""Keyed requests that name no client: refused, never one namespace for strangers, unless the app opts in."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask, jsonify, request
from sqlalchemy import select
from sqlalchemy.orm import sessionmaker
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from werkzeug.test import Client as WerkzeugClient

from stateguard import ConfigurationError, InvalidArgument
from stateguard.asgi import IdempotencyMiddleware, RouteOptions, principal_of
from stateguard.http.wsgi import WSGIIdempotencyMiddleware
from stateguard.tables import idempotency_keys
from stateguard.tables import metadata as stateguard_metadata
from tests.conftest import Backend


class Signups:
    """An anonymous signup endpoint whose answer holds a secret made for its caller."""

    def __init__(self) -> None:
        self.runs: list[str] = []
        self._tokens = itertools.count(1)

    def answer(self, email: str) -> dict[str, str]:
        self.runs.append(email)
        return {"email": email, "api_token": f"secret-{next(self._tokens)}"}


def _asgi(factory: sessionmaker[Any], signups: Signups, **options: Any) -> Starlette:
    async def signup(req: Request) -> JSONResponse:
        return JSONResponse(signups.answer((await req.json())["email"]), 201)

    async def donate(req: Request) -> JSONResponse:
        return JSONResponse(signups.answer((await req.json())["email"]), 201)

    routes = [Route("/signup", signup, methods=["POST"]), Route("/donate", donate, methods=["POST"])]
    app = Starlette(routes=routes)
    app.add_middleware(IdempotencyMiddleware, session_factory=factory, **options)
    return app


def _key_rows(backend: Backend) -> list[Any]:
    with backend.engine.connect() as conn:
        return list(conn.execute(select(idempotency_keys)).all())


@pytest.fixture
def factory(backend: Backend) -> sessionmaker[Any]:
    """stateguard's tables on each backend and a sessionmaker for them."""
    backend.create(stateguard_metadata)
    return sessionmaker(backend.engine)


@pytest.mark.hostile
def test_two_anonymous_clients_never_get_each_others_response(
    factory: sessionmaker[Any], backend: Backend
) -> None:
    """Two clients without credentials sending one key and body: both 400, nothing run, nothing stored."""
    signups = Signups()
    with TestClient(_asgi(factory, signups)) as client:
        first = client.post("/signup", json={"email": "a@x"}, headers={"Idempotency-Key": "1"})
        second = client.post("/signup", json={"email": "a@x"}, headers={"Idempotency-Key": "1"})
    for answer in (first, second):
        assert answer.status_code == 400 and answer.headers["content-type"] == "application/problem+json"
        assert "identified client" in answer.json()["title"] and "secret" not in answer.text
        assert "idempotency-replayed" not in answer.headers
    assert signups.runs == [] and _key_rows(backend) == []


@pytest.mark.hostile
def test_a_cookie_many_clients_share_is_not_a_principal(factory: sessionmaker[Any], backend: Backend) -> None:
    """Clients whose only cookie is lang=en name no client: refused, not one namespace for all of them."""
    signups = Signups()
    headers = {"Idempotency-Key": "1", "Cookie": "lang=en; consent=yes"}
    with TestClient(_asgi(factory, signups)) as client:
        first = client.post("/signup", json={"email": "a@x"}, headers=headers)
        second = client.post("/signup", json={"email": "a@x"}, headers=headers)
    assert first.status_code == second.status_code == 400 and "secret" not in second.text
    assert signups.runs == [] and _key_rows(backend) == []


def test_session_cookies_name_the_client(factory: sessionmaker[Any], backend: Backend) -> None:
    """session_cookies=["sid"]: the sid cookie is the principal, whatever other cookies come with it."""
    signups = Signups()
    with TestClient(_asgi(factory, signups, session_cookies=["sid"])) as client:

        def send(cookie: str) -> Any:
            return client.post(
                "/signup", json={"email": "a@x"}, headers={"Idempotency-Key": "1", "Cookie": cookie}
            )

        alice = send("lang=en; sid=alice-session")
        bob = send("lang=en; sid=bob-session")
        again = send("sid=alice-session; theme=dark; lang=fr")  # the same session, other cookies
        stranger = send("lang=en")
    assert alice.status_code == bob.status_code == 201 and bob.json() != alice.json()
    assert again.headers["idempotency-replayed"] == "true" and again.json() == alice.json()
    assert stranger.status_code == 400
    assert signups.runs == ["a@x", "a@x"]
    scopes = [row.scope for row in _key_rows(backend)]
    assert len(set(scopes)) == 2 and all(s.startswith("http:cookie:") and "session" not in s for s in scopes)


def test_anonymous_shared_is_one_namespace_by_choice(factory: sessionmaker[Any], backend: Backend) -> None:
    """anonymous="shared" (middleware or route) puts every anonymous client in "http", as the app asked."""
    signups = Signups()
    app = _asgi(factory, signups, routes={"/donate": RouteOptions(anonymous="shared")})
    with TestClient(app) as client:
        key = {"Idempotency-Key": "d-1"}
        first = client.post("/donate", json={"email": "a@x"}, headers=key)
        again = client.post("/donate", json={"email": "a@x"}, headers=key)
        refused = client.post("/signup", json={"email": "a@x"}, headers=key)  # no such route option there
        signed = client.post("/signup", json={"email": "a@x"}, headers=key | {"Authorization": "Bearer t"})
    assert first.status_code == 201 and again.headers["idempotency-replayed"] == "true"
    assert refused.status_code == 400 and signed.status_code == 201
    assert sorted(row.scope[:18] for row in _key_rows(backend)) == ["http", "http:authorization"]
    assert signups.runs == ["a@x", "a@x"]


def test_principal_returning_none_is_anonymous(factory: sessionmaker[Any], backend: Backend) -> None:
    """principal= answering None (no client) is refused like a request without credentials."""
    signups = Signups()
    app = _asgi(
        factory, signups, principal=lambda s: dict(s["headers"]).get(b"x-account", b"").decode() or None
    )
    with TestClient(app) as client:
        nobody = client.post("/signup", json={"email": "a@x"}, headers={"Idempotency-Key": "1"})
        named = client.post(
            "/signup", json={"email": "a@x"}, headers={"Idempotency-Key": "1", "X-Account": "7"}
        )
    assert nobody.status_code == 400 and named.status_code == 201 and signups.runs == ["a@x"]
    assert [row.scope[:9] for row in _key_rows(backend)] == ["http:app:"]


def test_the_refusal_is_logged_once_with_the_fix(
    factory: sessionmaker[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The first refused anonymous request logs one warning naming principal=, session_cookies=, anonymous."""
    with (
        caplog.at_level(logging.WARNING, logger="stateguard.asgi"),
        TestClient(_asgi(factory, Signups())) as client,
    ):
        for _ in range(3):
            client.post("/signup", json={"email": "a@x"}, headers={"Idempotency-Key": "1"})
    [record] = [r for r in caplog.records if r.name == "stateguard.asgi"]
    for fix in ("principal=", "session_cookies=", "anonymous='shared'"):
        assert fix in record.getMessage()


def test_a_scope_callable_returning_none_is_an_error_not_an_anonymous_request(
    factory: sessionmaker[Any], backend: Backend
) -> None:
    """scope= answering None is the app's mistake: ConfigurationError (500), nothing run or stored."""
    signups = Signups()
    with TestClient(_asgi(factory, signups, scope=lambda s: None)) as client:
        with pytest.raises(ConfigurationError, match="scope= callable"):
            client.post("/signup", json={"email": "a@x"}, headers={"Idempotency-Key": "1"})
    assert signups.runs == [] and _key_rows(backend) == []


def test_principal_of_reads_only_the_named_session_cookies() -> None:
    """principal_of ignores cookies not named in session_cookies, and digests the named ones."""
    headers = [(b"cookie", b"lang=en; sid=abc")]
    assert principal_of({"headers": headers}) is None
    named = principal_of({"headers": headers}, session_cookies=["sid"])
    assert named == principal_of({"headers": [(b"cookie", b"sid=abc")]}, session_cookies=["sid"])
    assert named is not None and named.startswith("cookie:") and "abc" not in named
    assert principal_of({"headers": [(b"cookie", b"sid=")]}, session_cookies=["sid"]) is None


@pytest.mark.hostile
@pytest.mark.parametrize(
    "options",
    [{"anonymous": "allow"}, {"anonymous": None}, {"session_cookies": "sid"}, {"session_cookies": ["a b"]}],
)
def test_wrong_anonymous_options_are_refused_when_built(
    factory: sessionmaker[Any], options: dict[str, Any]
) -> None:
    """anonymous= not "refuse"/"shared", or session_cookies= not a list of cookie names: InvalidArgument."""

    async def app(scope: Any, receive: Any, send: Any) -> None: ...

    with pytest.raises(InvalidArgument, match=r"anonymous|session_cookies"):
        IdempotencyMiddleware(app, session_factory=factory, **options)
    with pytest.raises(InvalidArgument, match=r"anonymous|session_cookies"):
        WSGIIdempotencyMiddleware(lambda e, s: [], session_factory=factory, **options)
    if options.get("anonymous") is not None:  # None in a RouteOptions keeps the middleware's
        with pytest.raises(InvalidArgument, match="anonymous"):
            RouteOptions(**options)


# --------------------------------------------------------------------------
# WSGI: the same rules for a Flask app
# --------------------------------------------------------------------------


@pytest.fixture
def flask_client(factory: sessionmaker[Any]) -> Iterator[tuple[Flask, Signups]]:
    """A Flask signup endpoint behind WSGIIdempotencyMiddleware."""
    signups = Signups()
    app = Flask(__name__)

    @app.post("/signup")
    def signup() -> Any:
        return jsonify(signups.answer(request.get_json()["email"])), 201

    yield app, signups


@pytest.mark.hostile
def test_wsgi_anonymous_clients_are_refused(flask_client: tuple[Flask, Signups], backend: Backend) -> None:
    """Under Flask, two anonymous clients with one key and body: 400 each, the handler never runs."""
    app, signups = flask_client
    app.wsgi_app = WSGIIdempotencyMiddleware(app.wsgi_app, session_factory=sessionmaker(backend.engine))  # type: ignore[method-assign]
    client = WerkzeugClient(app, use_cookies=False)  # the Cookie header as sent, no cookie jar
    first = client.post(
        "/signup", json={"email": "a@x"}, headers={"Idempotency-Key": "1", "Cookie": "lang=en"}
    )
    second = client.post(
        "/signup", json={"email": "a@x"}, headers={"Idempotency-Key": "1", "Cookie": "lang=en"}
    )
    assert first.status_code == second.status_code == 400 and b"secret" not in second.data
    assert signups.runs == [] and _key_rows(backend) == []


def test_wsgi_session_cookies_name_the_client(flask_client: tuple[Flask, Signups], backend: Backend) -> None:
    """Under Flask, session_cookies=["session"] keeps two browsers apart and replays each one's retry."""
    app, signups = flask_client
    app.wsgi_app = WSGIIdempotencyMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, session_factory=sessionmaker(backend.engine), session_cookies=["session"]
    )
    client = WerkzeugClient(app, use_cookies=False)  # the Cookie header as sent, no cookie jar

    def send(cookie: str) -> Any:
        return client.post(
            "/signup", json={"email": "a@x"}, headers={"Idempotency-Key": "1", "Cookie": cookie}
        )

    alice, bob, again = send("session=alice"), send("session=bob"), send("lang=en; session=alice")
    assert alice.status_code == bob.status_code == 201 and alice.json != bob.json
    assert again.headers["Idempotency-Replayed"] == "true" and again.json == alice.json
    assert signups.runs == ["a@x", "a@x"]
