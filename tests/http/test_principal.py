"""Who a request's keys belong to: two clients never share a namespace, whatever their user objects say."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask, jsonify, request
from sqlalchemy import select
from sqlalchemy.orm import sessionmaker
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, BaseUser
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from werkzeug.test import Client as WerkzeugClient

from stateguard import ConfigurationError
from stateguard.asgi import IdempotencyMiddleware, principal_of
from stateguard.tables import idempotency_keys
from stateguard.tables import metadata as stateguard_metadata
from tests.conftest import Backend

#: Two customers with the same name: tokens name the account, the display name does not.
ACCOUNTS = {"tok-1": ("ACC-1001", 5_000), "tok-2": ("ACC-2002", 12)}


class Customer(BaseUser):
    """A user class as applications write them: a display name, no identity (BaseUser leaves it out)."""

    def __init__(self, account: str) -> None:
        self.account = account

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def display_name(self) -> str:
        return "Alice Martin"


class Numbered(Customer):
    """The same with an ``id``: a unique name the middleware may use."""

    @property
    def id(self) -> str:
        return self.account


class Tokens(AuthenticationBackend):
    """``Authorization: Bearer tok-N`` or ``X-Api-Key: tok-N`` names an account."""

    def __init__(self, user_cls: type[Customer]) -> None:
        self.user_cls = user_cls

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, BaseUser] | None:
        token = conn.headers.get("authorization", "").removeprefix("Bearer ") or conn.headers.get("x-api-key")
        if token not in ACCOUNTS:
            return None
        return AuthCredentials(["authenticated"]), self.user_cls(ACCOUNTS[token][0])


@pytest.fixture
def factory(sqlite: Backend) -> sessionmaker[Any]:
    """stateguard's tables on SQLite and a sessionmaker for them."""
    sqlite.create(stateguard_metadata)
    return sessionmaker(sqlite.engine)


def _asgi(factory: sessionmaker[Any], user_cls: type[Customer], runs: list[str], **options: Any) -> Starlette:
    async def balance(req: Request) -> JSONResponse:
        await req.body()
        runs.append(req.user.account)
        return JSONResponse({"account": req.user.account, "balance": ACCOUNTS_BY_ID[req.user.account]}, 201)

    app = Starlette(routes=[Route("/statements", balance, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, session_factory=factory, **options)
    app.add_middleware(AuthenticationMiddleware, backend=Tokens(user_cls))  # added last: runs first
    return app


ACCOUNTS_BY_ID = dict(ACCOUNTS.values())


def test_two_users_with_one_display_name_never_get_each_others_response(factory: sessionmaker[Any]) -> None:
    """Alice Martin (ACC-2002) sending the other Alice Martin's key and body runs her own request."""
    runs: list[str] = []
    with TestClient(_asgi(factory, Customer, runs)) as client:
        key = {"Idempotency-Key": "statement-1"}
        first = client.post("/statements", json={}, headers=key | {"Authorization": "Bearer tok-1"})
        second = client.post("/statements", json={}, headers=key | {"Authorization": "Bearer tok-2"})
    assert first.json() == {"account": "ACC-1001", "balance": 5_000}
    assert "idempotency-replayed" not in second.headers
    assert second.json() == {"account": "ACC-2002", "balance": 12}
    assert runs == ["ACC-1001", "ACC-2002"]


def test_a_user_with_an_id_keeps_its_keys_across_credentials(factory: sessionmaker[Any]) -> None:
    """A user's id is unique: the same user through another credential replays; the other user runs."""
    runs: list[str] = []
    with TestClient(_asgi(factory, Numbered, runs)) as client:
        key = {"Idempotency-Key": "statement-2"}
        first = client.post("/statements", json={}, headers=key | {"Authorization": "Bearer tok-1"})
        same_user = client.post("/statements", json={}, headers=key | {"X-Api-Key": "tok-1"})
        other = client.post("/statements", json={}, headers=key | {"Authorization": "Bearer tok-2"})
    assert same_user.headers["idempotency-replayed"] == "true" and same_user.json() == first.json()
    assert other.json()["account"] == "ACC-2002" and "idempotency-replayed" not in other.headers
    assert runs == ["ACC-1001", "ACC-2002"]


@pytest.mark.hostile
def test_an_unnamed_user_without_a_credential_header_is_refused_not_guessed(
    factory: sessionmaker[Any], sqlite: Backend
) -> None:
    """No identity, no id, no Authorization or Cookie: ConfigurationError (500), nothing stored or run."""
    runs: list[str] = []
    with TestClient(_asgi(factory, Customer, runs)) as client:
        with pytest.raises(ConfigurationError, match="principal="):
            client.post("/statements", json={}, headers={"Idempotency-Key": "s3", "X-Api-Key": "tok-1"})
    assert runs == []
    with sqlite.engine.connect() as conn:
        assert conn.execute(select(idempotency_keys)).all() == []


def test_principal_names_the_client_for_the_default_scope(factory: sessionmaker[Any]) -> None:
    """principal= (the application's unique name) keeps users apart and their keys across credentials."""
    runs: list[str] = []
    app = _asgi(factory, Customer, runs, principal=lambda s: s["user"].account if "user" in s else None)
    with TestClient(app) as client:
        key = {"Idempotency-Key": "statement-4"}
        first = client.post("/statements", json={}, headers=key | {"X-Api-Key": "tok-1"})
        again = client.post("/statements", json={}, headers=key | {"Authorization": "Bearer tok-1"})
        other = client.post("/statements", json={}, headers=key | {"X-Api-Key": "tok-2"})
    assert again.headers["idempotency-replayed"] == "true" and again.json() == first.json()
    assert other.json()["account"] == "ACC-2002" and runs == ["ACC-1001", "ACC-2002"]


def test_principal_of_never_reads_a_display_name() -> None:
    """principal_of gives two users who share a display name two principals (their credentials)."""
    one = principal_of({"headers": [(b"authorization", b"Bearer tok-1")], "user": Customer("ACC-1001")})
    two = principal_of({"headers": [(b"authorization", b"Bearer tok-2")], "user": Customer("ACC-2002")})
    assert one is not None and two is not None and one != two and one.startswith("authorization:")


# --------------------------------------------------------------------------
# WSGI: the same rules for a Flask app
# --------------------------------------------------------------------------


@pytest.fixture
def flask_client(factory: sessionmaker[Any]) -> Iterator[tuple[WerkzeugClient, list[str]]]:
    """A Flask app whose own auth reads the token (after the middleware), wrapped in the WSGI face."""
    from stateguard.http.wsgi import WSGIIdempotencyMiddleware

    runs: list[str] = []
    app = Flask(__name__)

    @app.post("/statements")
    def statements() -> Any:
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        if token.startswith("Basic"):
            token = base64.b64decode(token.removeprefix("Basic ")).decode().split(":")[0]
        account = ACCOUNTS.get(token) or ACCOUNTS[request.environ.get("REMOTE_USER", "")]
        runs.append(account[0])
        return jsonify(account=account[0], balance=account[1], display_name="Alice Martin"), 201

    app.wsgi_app = WSGIIdempotencyMiddleware(app.wsgi_app, session_factory=factory)  # type: ignore[method-assign]
    yield WerkzeugClient(app), runs


def test_wsgi_two_clients_with_one_name_never_get_each_others_response(
    flask_client: tuple[WerkzeugClient, list[str]],
) -> None:
    """Under Flask too, the second Alice Martin sending the first's key and body gets her own account."""
    client, runs = flask_client
    key = {"Idempotency-Key": "statement-1"}
    first = client.post("/statements", json={}, headers=key | {"Authorization": "Bearer tok-1"})
    second = client.post("/statements", json={}, headers=key | {"Authorization": "Bearer tok-2"})
    retry = client.post("/statements", json={}, headers=key | {"Authorization": "Bearer tok-1"})
    assert first.json is not None and second.json is not None
    assert first.json["account"] == "ACC-1001" and second.json["account"] == "ACC-2002"
    assert "Idempotency-Replayed" not in second.headers
    assert retry.headers["Idempotency-Replayed"] == "true" and retry.json == first.json
    assert runs == ["ACC-1001", "ACC-2002"]


def test_wsgi_remote_user_is_the_principal(flask_client: tuple[WerkzeugClient, list[str]]) -> None:
    """REMOTE_USER (set by the server, never by a client) names the client ahead of its headers."""
    client, runs = flask_client
    key = {"Idempotency-Key": "statement-5"}
    first = client.post("/statements", json={}, headers=key, environ_overrides={"REMOTE_USER": "tok-1"})
    again = client.post("/statements", json={}, headers=key | {"Cookie": "s=1"},
                        environ_overrides={"REMOTE_USER": "tok-1"})  # fmt: skip
    other = client.post("/statements", json={}, headers=key, environ_overrides={"REMOTE_USER": "tok-2"})
    assert again.headers["Idempotency-Replayed"] == "true" and again.json == first.json
    assert other.json is not None and other.json["account"] == "ACC-2002" and runs == ["ACC-1001", "ACC-2002"]
