"""The ``Idempotency-Key`` middleware (stateguard.asgi) through Starlette's and FastAPI's test clients.

Every test builds the same small payment API in both frameworks and runs it
against a real database on each backend: the middleware's key records and
the handler's payment rows live there, and "the handler ran once" is checked
both by counting calls and by counting payment rows.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import anyio.to_thread
import pytest
from fastapi import FastAPI
from fastapi import Request as FastAPIRequest
from pydantic import BaseModel
from sqlalchemy import String, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from starlette.applications import Starlette
from starlette.authentication import (
    AuthCredentials,
    AuthenticationBackend,
    BaseUser,
    SimpleUser,
    UnauthenticatedUser,
)
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from stateguard import ConfigurationError, InvalidArgument, LeaseLost, idempotent
from stateguard.asgi import (
    CREDENTIAL_HEADERS,
    REFUSED_BEFORE_EXECUTION,
    IdempotencyMiddleware,
    RouteOptions,
    _stored_headers,
    default_scope,
    default_store_status,
    principal_of,
)
from stateguard.tables import idempotency_keys
from stateguard.tables import metadata as stateguard_metadata
from tests.conftest import Backend, count_statements

FRAMEWORKS = ("starlette", "fastapi")


class _Base(DeclarativeBase):
    pass


class Payment(_Base):
    """What the handler writes, in its own session: one row per execution."""

    __tablename__ = "sg_test_asgi_payments"
    id: Mapped[int] = mapped_column(primary_key=True)
    amount: Mapped[int]
    note: Mapped[str] = mapped_column(String(40), default="")


class PaymentIn(BaseModel):
    """FastAPI's view of the request body."""

    amount: int
    block: bool = False
    crash: bool = False
    answer: int | None = None
    session: bool = False


# --------------------------------------------------------------------------
# The app under test, in both frameworks
# --------------------------------------------------------------------------


@dataclass
class Shop:
    """The handler logic shared by both frameworks, with call counting and a gate."""

    session_factory: sessionmaker[Session]
    calls: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    entered: threading.Event = field(default_factory=threading.Event)
    gate: threading.Event = field(default_factory=threading.Event)
    #: The next this many calls answer 503 (an upstream outage).
    failures_left: int = 0

    def pay(self, body: dict[str, Any]) -> Response:
        """Runs in a worker thread: may block on the gate, fail, crash, or write a payment."""
        with self.lock:
            self.calls["pay"] += 1
        if body.get("block"):
            self.entered.set()
            assert self.gate.wait(30), "the test never opened the gate"
        if body.get("crash"):
            raise RuntimeError("the handler crashed")
        with self.lock:
            fail = self.failures_left > 0
            self.failures_left -= fail
        if fail:
            return JSONResponse({"error": "upstream down"}, status_code=503)
        if body.get("answer") is not None:
            # The handler refuses the request with this status, before doing anything.
            return JSONResponse({"refused": body["answer"]}, status_code=int(body["answer"]))
        amount = int(body["amount"])
        if amount < 0:
            return JSONResponse({"error": "amount must be positive"}, status_code=400)
        if amount > 1000:
            # Ran (asked the bank) and was declined: an outcome, not a refusal.
            return JSONResponse({"error": "insufficient funds"}, status_code=402)
        with self.session_factory() as s, s.begin():
            payment = Payment(amount=amount)
            s.add(payment)
            s.flush()
            payment_id = payment.id
        response = JSONResponse(
            {"payment_id": payment_id, "amount": amount},
            status_code=201,
            headers={"X-Payment-Id": str(payment_id), "Location": f"/payments/{payment_id}"},
        )
        if body.get("session"):
            # Credentials for this client only: they must never be stored and replayed to another.
            response.set_cookie("session", f"secret-session-{payment_id}")
            response.set_cookie("csrf", "secret-csrf")
            response.headers["Authentication-Info"] = 'nextnonce="secret-nonce"'
        return response

    def stream(self) -> Response:
        with self.lock:
            self.calls["stream"] += 1

        async def chunks() -> Any:
            for part in (b"one,", b"two,", b"three"):
                yield part

        return StreamingResponse(chunks(), media_type="text/plain")

    def listing(self) -> Response:
        with self.lock:
            self.calls["list"] += 1
        return PlainTextResponse(f"list {self.calls['list']}")


def starlette_app(shop: Shop) -> Starlette:
    async def payments(request: Request) -> Response:
        if request.method == "GET":
            return shop.listing()
        body = await request.json()
        return await anyio.to_thread.run_sync(shop.pay, body)

    async def stream(request: Request) -> Response:
        await request.body()
        return shop.stream()

    async def other(request: Request) -> Response:
        await request.body()
        with shop.lock:
            shop.calls["other"] += 1
        return PlainTextResponse("other", status_code=201)

    return Starlette(
        routes=[
            Route("/payments", payments, methods=["GET", "POST", "PATCH"]),
            Route("/stream", stream, methods=["POST"]),
            Route("/other", other, methods=["POST"]),
        ]
    )


def fastapi_app(shop: Shop) -> FastAPI:
    app = FastAPI()

    @app.get("/payments")
    def list_payments() -> Response:
        return shop.listing()

    @app.post("/payments")
    def create_payment(body: PaymentIn) -> Response:
        # A sync route: FastAPI runs it in its thread pool.
        return shop.pay(body.model_dump())

    @app.patch("/payments")
    def patch_payment(body: PaymentIn) -> Response:
        return shop.pay(body.model_dump())

    @app.post("/stream")
    def stream() -> Response:
        return shop.stream()

    @app.post("/other")
    async def other(request: FastAPIRequest) -> Response:
        await request.body()
        with shop.lock:
            shop.calls["other"] += 1
        return PlainTextResponse("other", status_code=201)

    return app


class BearerUsers(AuthenticationBackend):
    """``Authorization: Bearer <user>.<version>``: the user stays the same when the token is refreshed."""

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, BaseUser] | None:
        scheme, _, token = conn.headers.get("authorization", "").partition(" ")
        if scheme != "Bearer" or "." not in token:
            return None
        return AuthCredentials(["authenticated"]), SimpleUser(token.split(".")[0])


@pytest.fixture(params=FRAMEWORKS)
def framework(request: pytest.FixtureRequest) -> str:
    """Starlette and FastAPI in turn."""
    return str(request.param)


@pytest.fixture
def shop(backend: Backend) -> Shop:
    """The payment table and stateguard's tables on each backend, and a Shop using them."""
    backend.create(stateguard_metadata, _Base.metadata)
    return Shop(sessionmaker(backend.engine))


@pytest.fixture
def sqlite_shop(sqlite: Backend) -> Shop:
    """The same on SQLite only, for pure HTTP behaviour that answers before any SQL."""
    sqlite.create(stateguard_metadata, _Base.metadata)
    return Shop(sessionmaker(sqlite.engine))


Client = Callable[..., TestClient]


def _clients(framework: str, shop: Shop) -> Iterator[Client]:
    opened: list[TestClient] = []

    def make(*, raise_server_exceptions: bool = True, auth: bool = False, **options: Any) -> TestClient:
        app = starlette_app(shop) if framework == "starlette" else fastapi_app(shop)
        options.setdefault("session_factory", shop.session_factory)
        options.setdefault("required_paths", ["/payments"])
        if "scope" not in options and "principal" not in options:
            # Most clients here send no credentials: they opt in to the one anonymous namespace.
            options.setdefault("anonymous", "shared")
        app.add_middleware(IdempotencyMiddleware, **options)
        if auth:
            # Added last, so it runs first: scope["user"] is set when the idempotency middleware runs.
            app.add_middleware(AuthenticationMiddleware, backend=BearerUsers())
        tc = TestClient(app, raise_server_exceptions=raise_server_exceptions)
        tc.__enter__()
        opened.append(tc)
        return tc

    yield make
    shop.gate.set()  # never leave a handler blocked by a failed test
    for tc in opened:
        tc.__exit__(None, None, None)


@pytest.fixture
def client(framework: str, shop: Shop) -> Iterator[Client]:
    """Build the app with the middleware (options from the test) and a TestClient for it, per backend."""
    yield from _clients(framework, shop)


@pytest.fixture
def sqlite_client(framework: str, sqlite_shop: Shop) -> Iterator[Client]:
    """The same on SQLite only."""
    yield from _clients(framework, sqlite_shop)


def payments_rows(shop: Shop) -> int:
    with shop.session_factory() as s:
        return int(s.scalar(select(func.count()).select_from(Payment)) or 0)


def key_rows(shop: Shop) -> list[Any]:
    with shop.session_factory() as s:
        return list(s.execute(select(idempotency_keys)).all())


def post(
    tc: TestClient,
    key: str | None,
    body: dict[str, Any],
    path: str = "/payments",
    headers: dict[str, str] | None = None,
    **kw: Any,
) -> Any:
    sent = ({"Idempotency-Key": key} if key is not None else {}) | (headers or {})
    return tc.post(path, json=body, headers=sent, **kw)


# --------------------------------------------------------------------------
# First call and replay
# --------------------------------------------------------------------------


def test_first_call_runs_and_retry_replays_status_headers_and_body(client: Client, shop: Shop) -> None:
    """The first request runs the handler; a retry gets the same status, headers and body, marked a replay."""
    tc = client()
    first = post(tc, "pay-1", {"amount": 10})
    assert first.status_code == 201
    assert "idempotency-replayed" not in first.headers
    again = post(tc, "pay-1", {"amount": 10})
    assert again.status_code == 201
    assert again.headers["idempotency-replayed"] == "true"
    assert again.content == first.content
    assert again.json() == {"payment_id": first.json()["payment_id"], "amount": 10}
    for name in ("x-payment-id", "location", "content-type", "content-length"):
        assert again.headers[name] == first.headers[name], name
    assert shop.calls["pay"] == 1 and payments_rows(shop) == 1
    [row] = key_rows(shop)
    assert (row.scope, row.idem_key, row.status) == ("http", "pay-1", "completed")


def test_patch_is_honoured_and_distinct_keys_run_separately(client: Client, shop: Shop) -> None:
    """PATCH requests are deduplicated too, and two different keys are two executions."""
    tc = client()
    a = tc.patch("/payments", json={"amount": 1}, headers={"Idempotency-Key": "a"})
    b = tc.patch("/payments", json={"amount": 1}, headers={"Idempotency-Key": "b"})
    a2 = tc.patch("/payments", json={"amount": 1}, headers={"Idempotency-Key": "a"})
    assert a.status_code == b.status_code == a2.status_code == 201
    assert a.json()["payment_id"] != b.json()["payment_id"]
    assert a2.json() == a.json() and a2.headers["idempotency-replayed"] == "true"
    assert shop.calls["pay"] == 2 and payments_rows(shop) == 2


def test_quoted_structured_field_key_is_the_same_key_as_the_bare_one(client: Client, shop: Shop) -> None:
    """``Idempotency-Key: "k-1"`` (the draft's sf-string form) and ``k-1`` name the same key."""
    tc = client()
    first = post(tc, '"k-1"', {"amount": 3})
    again = post(tc, "k-1", {"amount": 3})
    assert first.status_code == again.status_code == 201
    assert again.headers["idempotency-replayed"] == "true"
    assert shop.calls["pay"] == 1
    assert [r.idem_key for r in key_rows(shop)] == ["k-1"]


def test_keys_are_case_sensitive(client: Client, shop: Shop) -> None:
    """``Order-abc`` and ``order-ABC`` are different keys on every backend."""
    tc = client()
    assert post(tc, "Order-abc", {"amount": 1}).status_code == 201
    r = post(tc, "order-ABC", {"amount": 1})
    assert r.status_code == 201 and "idempotency-replayed" not in r.headers
    assert shop.calls["pay"] == 2


# --------------------------------------------------------------------------
# Which responses are stored
# --------------------------------------------------------------------------


def test_4xx_of_a_request_that_ran_is_stored_and_replayed(client: Client, shop: Shop) -> None:
    """A 402 (the request ran and was declined) is stored: the retry gets it without running the handler."""
    tc = client()
    first = post(tc, "big", {"amount": 5000})
    again = post(tc, "big", {"amount": 5000})
    assert first.status_code == again.status_code == 402
    assert again.json() == {"error": "insufficient funds"}
    assert again.headers["idempotency-replayed"] == "true"
    assert shop.calls["pay"] == 1 and payments_rows(shop) == 0


def test_a_validation_400_is_not_stored_and_the_corrected_request_uses_the_key(
    client: Client, shop: Shop
) -> None:
    """A 400 (refused before it ran) stores nothing: the corrected request with the same key runs once."""
    tc = client()
    refused = post(tc, "fix-me", {"amount": -5})
    assert refused.status_code == 400 and "idempotency-replayed" not in refused.headers
    assert key_rows(shop) == []  # forgotten, not merely released
    fixed = post(tc, "fix-me", {"amount": 5})
    assert fixed.status_code == 201 and "idempotency-replayed" not in fixed.headers
    replay = post(tc, "fix-me", {"amount": 5})
    assert replay.headers["idempotency-replayed"] == "true" and replay.json() == fixed.json()
    assert post(tc, "fix-me", {"amount": -5}).status_code == 422  # the key now belongs to the payment
    assert shop.calls["pay"] == 2 and payments_rows(shop) == 1


@pytest.mark.parametrize("framework", ["fastapi"])
def test_fastapis_own_422_is_not_stored(client: Client, shop: Shop) -> None:
    """FastAPI's request validation answers 422 before the route runs; the corrected request uses the key."""
    tc = client()
    refused = post(tc, "v", {"amount": "not a number"})
    assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "amount"]
    fixed = post(tc, "v", {"amount": 3})
    assert fixed.status_code == 201 and "idempotency-replayed" not in fixed.headers
    assert shop.calls["pay"] == 1 and [r.status for r in key_rows(shop)] == ["completed"]


@pytest.mark.parametrize("status", sorted(REFUSED_BEFORE_EXECUTION))
def test_every_refusal_status_forgets_the_key(sqlite_client: Client, sqlite_shop: Shop, status: int) -> None:
    """Each REFUSED_BEFORE_EXECUTION status from the handler leaves no record: any request may use the key."""
    tc = sqlite_client()
    refused = post(tc, "r", {"amount": 1, "answer": status})
    assert refused.status_code == status and refused.json() == {"refused": status}
    assert key_rows(sqlite_shop) == []
    assert post(tc, "r", {"amount": 1}).status_code == 201
    assert post(tc, "r", {"amount": 1}).headers["idempotency-replayed"] == "true"
    assert sqlite_shop.calls["pay"] == 2


def test_a_trailing_slash_redirect_is_followed_with_its_key(client: Client, shop: Shop) -> None:
    """The router's 307 for ``/payments/`` (to ``/payments``) is not stored under the key: the
    client that follows it with the same key pays once, and its retry to ``/payments`` replays the
    payment.  Stored, the redirected request (another path) was 422 under that key for good."""
    tc = client()
    headers = {"Idempotency-Key": "slash"}
    redirect = tc.post("/payments/", json={"amount": 7}, headers=headers, follow_redirects=False)
    assert redirect.status_code == 307 and redirect.headers["location"].endswith("/payments")
    assert key_rows(shop) == []  # forgotten
    paid = tc.post("/payments/", json={"amount": 7}, headers=headers, follow_redirects=True)
    assert paid.status_code == 201 and "idempotency-replayed" not in paid.headers
    again = tc.post("/payments", json={"amount": 7}, headers=headers)  # the retry, where it was redirected
    assert again.status_code == 201 and again.headers["idempotency-replayed"] == "true"
    assert again.json() == paid.json()
    # The key now belongs to the request at /payments: the one at /payments/ is another request.
    assert (
        tc.post("/payments/", json={"amount": 7}, headers=headers, follow_redirects=False).status_code == 422
    )
    assert shop.calls["pay"] == 1 and payments_rows(shop) == 1


def test_forgetting_never_deletes_a_record_taken_over_since(shop: Shop) -> None:
    """release(forget=True) deletes only its own call's record: after a takeover it is LeaseLost and the
    new owner's record stays."""
    request = {"method": "POST", "path": "/payments", "query": "", "body_sha256": "0" * 64}
    with shop.session_factory() as first_session, shop.session_factory() as second_session:
        first = idempotent(
            first_session,
            scope="http",
            key="f",
            fingerprint=request,
            mode="separate",
            lease=timedelta(seconds=1),
        )
        call = first.__enter__()
        time.sleep(1.3)  # the lease ends on the database's clock
        with idempotent(
            second_session, scope="http", key="f", fingerprint=request, mode="separate"
        ) as second:
            assert second.taken_over and second.attempt == 2
            with pytest.raises(LeaseLost):
                call.release("HTTP 400, not stored", forget=True)  # too late: the record is the retry's now
            assert [r.attempt for r in key_rows(shop)] == [2]
            second.complete({"ok": True})
        first.__exit__(None, None, None)
    assert [(r.status, r.attempt) for r in key_rows(shop)] == [("completed", 2)]


def test_forget_deletes_the_callers_own_released_record(shop: Shop) -> None:
    """release(forget=True) leaves no record: a request with another body may use the key at once."""
    with shop.session_factory() as session:
        with idempotent(session, scope="http", key="g", fingerprint={"body": 1}, mode="separate") as call:
            call.release("HTTP 400, not stored", forget=True)
        assert key_rows(shop) == []
        with idempotent(session, scope="http", key="g", fingerprint={"body": 2}, mode="separate") as call:
            assert not call.replayed and call.attempt == 1
            call.complete({"ok": True})


def test_a_route_may_store_a_refusal_status(client: Client, shop: Shop) -> None:
    """RouteOptions(store_status=...) sets the policy of its route: there a 409 is stored and replayed."""
    tc = client(routes={"/payments": RouteOptions(store_status=lambda status: status == 409 or status < 300)})
    first = post(tc, "c", {"amount": 1, "answer": 409})
    again = post(tc, "c", {"amount": 1, "answer": 409})
    assert first.status_code == again.status_code == 409
    assert again.headers["idempotency-replayed"] == "true" and shop.calls["pay"] == 1
    # 402 is not stored by this route's policy, and a 4xx that is not stored forgets the key.
    assert post(tc, "d", {"amount": 5000}).status_code == 402
    assert post(tc, "d", {"amount": 5}).status_code == 201


def test_5xx_releases_the_key_so_a_retry_runs_again(client: Client, shop: Shop) -> None:
    """A 503 is not stored: the retry runs the handler again, and then its success is stored."""
    tc = client()
    shop.failures_left = 1
    failed = post(tc, "flaky", {"amount": 7})
    assert failed.status_code == 503 and "idempotency-replayed" not in failed.headers
    assert all(r.status != "completed" and r.response is None for r in key_rows(shop))
    retried = post(tc, "flaky", {"amount": 7})
    assert retried.status_code == 201 and "idempotency-replayed" not in retried.headers
    replay = post(tc, "flaky", {"amount": 7})
    assert replay.status_code == 201 and replay.headers["idempotency-replayed"] == "true"
    assert replay.json() == retried.json()
    assert shop.calls["pay"] == 2 and payments_rows(shop) == 1


def test_5xx_releases_but_keeps_the_key_bound_to_its_request(client: Client, shop: Shop) -> None:
    """After a 503 the key is released, not forgotten: the handler may have acted, so another body is 422."""
    tc = client()
    shop.failures_left = 1
    assert post(tc, "flaky", {"amount": 7}).status_code == 503
    assert post(tc, "flaky", {"amount": 8}).status_code == 422
    assert post(tc, "flaky", {"amount": 7}).status_code == 201
    assert shop.calls["pay"] == 2


def test_an_exception_in_the_app_releases_the_key(client: Client, shop: Shop) -> None:
    """A handler that raises gives a 500 from the server and leaves the key free for a retry."""
    tc = client(raise_server_exceptions=False)
    assert post(tc, "boom", {"amount": 1, "crash": True}).status_code == 500
    assert post(tc, "boom", {"amount": 1, "crash": True}).status_code == 500
    assert shop.calls["pay"] == 2
    assert all(r.status != "completed" for r in key_rows(shop))


def test_an_exception_in_the_app_propagates_to_the_server(client: Client, shop: Shop) -> None:
    """The middleware re-raises the app's exception (the server answers 500), it does not swallow it."""
    tc = client()
    with pytest.raises(RuntimeError, match="the handler crashed"):
        post(tc, "boom", {"amount": 1, "crash": True})
    assert all(r.status != "completed" for r in key_rows(shop))


def test_streaming_response_is_passed_through_and_not_stored(client: Client, shop: Shop) -> None:
    """A streaming response reaches the client whole, is not stored, and a retry runs the handler again."""
    tc = client()
    first = post(tc, "s-1", {}, path="/stream")
    again = post(tc, "s-1", {}, path="/stream")
    assert first.status_code == again.status_code == 200
    assert first.content == again.content == b"one,two,three"
    assert "idempotency-replayed" not in again.headers
    assert shop.calls["stream"] == 2
    assert all(r.response is None for r in key_rows(shop))


# --------------------------------------------------------------------------
# In progress, reused keys
# --------------------------------------------------------------------------


def test_in_progress_409_with_retry_after_and_reused_key_422_while_in_flight(
    client: Client, shop: Shop
) -> None:
    """While the first request blocks: same body -> 409 + Retry-After, other body -> 422; then a replay."""
    tc = client(lease=timedelta(seconds=30))
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, tc, "slow", {"amount": 5, "block": True})
        assert shop.entered.wait(30), "the first request never reached the handler"
        busy = post(tc, "slow", {"amount": 5, "block": True})
        assert busy.status_code == 409
        assert 1 <= int(busy.headers["retry-after"]) <= 30
        assert busy.headers["content-type"] == "application/problem+json"
        assert busy.json()["status"] == 409
        reused = post(tc, "slow", {"amount": 6, "block": True})
        assert reused.status_code == 422 and reused.json()["title"] == "Idempotency-Key reused"
        shop.gate.set()
        done = first.result(timeout=60)
    assert done.status_code == 201
    replay = post(tc, "slow", {"amount": 5, "block": True})
    assert replay.status_code == 201 and replay.json() == done.json()
    assert replay.headers["idempotency-replayed"] == "true"
    assert shop.calls["pay"] == 1 and payments_rows(shop) == 1


def test_the_same_json_with_keys_in_another_order_is_the_same_request(client: Client, shop: Shop) -> None:
    """A JSON body is compared by its canonical form: reordered keys and other whitespace replay, not 422."""
    tc = client()
    headers = {"Idempotency-Key": "j", "Content-Type": "application/json"}
    first = tc.post("/payments", content=b'{"amount": 4, "block": false}', headers=headers)
    again = tc.post("/payments", content=b'{\n  "block":false,"amount":4}', headers=headers)
    assert first.status_code == again.status_code == 201
    assert again.headers["idempotency-replayed"] == "true" and again.json() == first.json()
    other = tc.post("/payments", content=b'{"block": false, "amount": 5}', headers=headers)
    assert other.status_code == 422  # another value is still another request
    assert shop.calls["pay"] == 1 and payments_rows(shop) == 1


@pytest.mark.parametrize(
    ("content_type", "canonical"),
    [
        ("application/json", True),
        ("Application/JSON; charset=utf-8", True),
        ("application/vnd.api+json", True),
        ("application/problem+json; charset=UTF-8", True),
        ("text/plain", False),
        ("application/x-www-form-urlencoded", False),
        ("application/jsonl", False),
        (None, False),
    ],
)
def test_which_bodies_are_compared_as_json(
    sqlite_client: Client, sqlite_shop: Shop, content_type: str | None, canonical: bool
) -> None:
    """Only application/json and +json bodies are canonicalised; any other body is compared byte for byte."""
    tc = sqlite_client()
    headers = {"Idempotency-Key": "ct"} | ({"Content-Type": content_type} if content_type else {})
    assert tc.post("/other", content=b'{"a": 1, "b": [1, 2]}', headers=headers).status_code == 201
    again = tc.post("/other", content=b'{"b":[1,2],"a":1}', headers=headers)
    assert again.status_code == (201 if canonical else 422)
    assert sqlite_shop.calls["other"] == 1


@pytest.mark.parametrize(
    ("body", "same_bytes_differently"),
    [
        (b'{"a": 1', b'{"a":1'),  # does not parse
        (b'{"a": NaN}', b'{"a":NaN}'),  # Python's json reads NaN, JSON has none
        (b'{"a": 1e999}', b'{"a":1e999}'),  # a float that overflows to inf
        (b'{"a": 1, "a": 2}', b'{"a": 2}'),  # duplicate keys: parsers disagree on which wins
        (b'{"a": "\\ud800"}', b'{"a":"\\ud800"}'),  # a lone surrogate: not UTF-8 encodable
        (b"[" * 100_000 + b"]" * 100_000, b"[ " * 100_000 + b"]" * 100_000),  # deeper than Python recurses
        (b"\xff\xfe", b"\xff\xfe "),  # not UTF-8
        (b"", b" "),
    ],
    ids=["truncated", "nan", "overflow", "duplicate-keys", "surrogate", "deep", "not-utf8", "empty"],
)
def test_json_that_does_not_parse_falls_back_to_its_bytes(
    sqlite_client: Client, sqlite_shop: Shop, body: bytes, same_bytes_differently: bytes
) -> None:
    """A JSON body without one canonical form is compared by its bytes: same bytes replay, others are 422."""
    tc = sqlite_client(max_body=1_000_000)
    headers = {"Idempotency-Key": "bad-json", "Content-Type": "application/json"}
    assert tc.post("/other", content=body, headers=headers).status_code == 201
    assert tc.post("/other", content=body, headers=headers).headers["idempotency-replayed"] == "true"
    assert tc.post("/other", content=same_bytes_differently, headers=headers).status_code == 422
    assert sqlite_shop.calls["other"] == 1


def test_reused_key_with_a_different_request_is_422(client: Client, shop: Shop) -> None:
    """A completed key sent again with another body, path, query string or method is rejected with 422."""
    tc = client()
    assert post(tc, "k", {"amount": 1}).status_code == 201
    headers = {"Idempotency-Key": "k"}
    answers = {
        "body": tc.post("/payments", json={"amount": 2}, headers=headers),
        "path": tc.post("/other", json={"amount": 1}, headers=headers),
        "query": tc.post("/payments?x=1", json={"amount": 1}, headers=headers),
        "method": tc.patch("/payments", json={"amount": 1}, headers=headers),
    }
    assert {what: r.status_code for what, r in answers.items()} == dict.fromkeys(answers, 422)
    assert all(r.headers["content-type"] == "application/problem+json" for r in answers.values())
    assert shop.calls["pay"] == 1 and shop.calls["other"] == 0
    [row] = key_rows(shop)
    assert row.status == "completed"


# --------------------------------------------------------------------------
# Bad and missing keys, other methods
# --------------------------------------------------------------------------


def test_missing_key_on_a_required_path_is_400(sqlite_client: Client, sqlite_shop: Shop) -> None:
    """POST /payments without a key is answered 400 (problem+json) and the handler does not run."""
    tc = sqlite_client(documentation="https://example.com/docs/idempotency")
    r = post(tc, None, {"amount": 1})
    assert r.status_code == 400
    problem = r.json()
    assert problem["title"] == "Idempotency-Key is missing"
    assert problem["type"] == "https://example.com/docs/idempotency"
    assert r.headers["link"] == '<https://example.com/docs/idempotency>; rel="describedby"'
    assert sqlite_shop.calls["pay"] == 0 and key_rows(sqlite_shop) == []


def test_no_key_on_an_optional_path_passes_through(sqlite_client: Client, sqlite_shop: Shop) -> None:
    """A path not in required_paths runs normally without a key, every time, and stores nothing."""
    tc = sqlite_client()
    assert tc.post("/other", content=b"x").status_code == 201
    assert tc.post("/other", content=b"x").status_code == 201
    assert sqlite_shop.calls["other"] == 2 and key_rows(sqlite_shop) == []


@pytest.mark.hostile
@pytest.mark.parametrize(
    "value",
    ["", "   ", '""', '"open', '"a"b', '"bad\\escape"', "k" * 256, "tab\there", "caf\u00e9"],
    ids=["empty", "blank", "empty-sf", "unclosed", "trailing", "escape", "oversize", "control", "latin1"],
)
def test_bad_keys_are_400_before_any_sql(sqlite_client: Client, sqlite_shop: Shop, value: str) -> None:
    """Blank, oversize, malformed and non-ASCII keys are answered 400 and nothing is stored."""
    tc = sqlite_client()
    with count_statements(sqlite_shop.session_factory.kw["bind"]) as sent:
        r = tc.post("/payments", json={"amount": 1}, headers={"Idempotency-Key": value.encode("latin-1")})
    assert r.status_code == 400, r.text
    assert len(sent) == 0
    assert r.json()["title"] == "Invalid Idempotency-Key"
    assert sqlite_shop.calls["pay"] == 0 and key_rows(sqlite_shop) == []


def test_two_key_headers_are_400(sqlite_client: Client, sqlite_shop: Shop) -> None:
    """A request carrying two Idempotency-Key headers is ambiguous: 400."""
    tc = sqlite_client()
    r = tc.post("/payments", json={"amount": 1}, headers=[("Idempotency-Key", "a"), ("Idempotency-Key", "b")])
    assert r.status_code == 400 and sqlite_shop.calls["pay"] == 0


@pytest.mark.limits
def test_longest_allowed_key_works(client: Client, shop: Shop) -> None:
    """A key of exactly 255 characters is accepted and replayed."""
    tc = client()
    key = "k" * 255
    assert post(tc, key, {"amount": 1}).status_code == 201
    assert post(tc, key, {"amount": 1}).headers["idempotency-replayed"] == "true"
    assert shop.calls["pay"] == 1


def test_get_passes_through_untouched(sqlite_client: Client, sqlite_shop: Shop) -> None:
    """GET with an Idempotency-Key runs every time, is never replayed and stores nothing."""
    tc = sqlite_client()
    first = tc.get("/payments", headers={"Idempotency-Key": "g"})
    second = tc.get("/payments", headers={"Idempotency-Key": "g"})
    assert (first.text, second.text) == ("list 1", "list 2")
    assert "idempotency-replayed" not in second.headers
    assert key_rows(sqlite_shop) == []


def test_oversize_body_is_413(sqlite_client: Client, sqlite_shop: Shop) -> None:
    """A keyed request whose body exceeds max_body is answered 413 without claiming the key."""
    tc = sqlite_client(max_body=64)
    r = tc.post("/payments", content=b"{" + b" " * 100 + b"}", headers={"Idempotency-Key": "big"})
    assert r.status_code == 413 and sqlite_shop.calls["pay"] == 0 and key_rows(sqlite_shop) == []
    assert post(tc, "small", {"amount": 1}).status_code == 201


# --------------------------------------------------------------------------
# Configuration: scope, routes, methods
# --------------------------------------------------------------------------


def test_scope_callable_keeps_clients_apart(client: Client, shop: Shop) -> None:
    """With the client identity in the scope, two clients using the same key both run."""

    def per_client(scope: Any) -> str:
        account = dict(scope["headers"]).get(b"x-account", b"anonymous").decode()
        return f"payments:{account}"

    tc = client(scope=per_client)
    a = tc.post("/payments", json={"amount": 1}, headers={"Idempotency-Key": "same", "X-Account": "alice"})
    b = tc.post("/payments", json={"amount": 1}, headers={"Idempotency-Key": "same", "X-Account": "bob"})
    a2 = tc.post("/payments", json={"amount": 1}, headers={"Idempotency-Key": "same", "X-Account": "alice"})
    assert a.status_code == b.status_code == 201 and a.json() != b.json()
    assert a2.json() == a.json() and a2.headers["idempotency-replayed"] == "true"
    assert sorted(r.scope for r in key_rows(shop)) == ["payments:alice", "payments:bob"]
    assert shop.calls["pay"] == 2


def test_two_clients_with_the_same_key_and_body_each_get_their_own_response(
    client: Client, shop: Shop
) -> None:
    """By default keys are per principal: same key and body from two clients run twice, never cross-replay."""
    tc = client()

    def send(token: str | None, body: dict[str, Any]) -> Any:
        headers = {"Idempotency-Key": "order-1"} | ({"Authorization": f"Bearer {token}"} if token else {})
        return tc.post("/payments", json=body, headers=headers)

    alice, bob = send("alice-secret", {"amount": 9}), send("bob-secret", {"amount": 9})
    assert alice.status_code == bob.status_code == 201
    assert "idempotency-replayed" not in bob.headers and bob.json() != alice.json()
    carol = send("carol-secret", {"amount": 10})  # another body under the same key: her own, not 422
    anonymous = send(None, {"amount": 9})
    assert carol.status_code == anonymous.status_code == 201
    for token, first in (("alice-secret", alice), ("bob-secret", bob), ("carol-secret", carol)):
        again = send(token, {"amount": 10 if token == "carol-secret" else 9})
        assert again.headers["idempotency-replayed"] == "true" and again.json() == first.json()
    assert shop.calls["pay"] == 4 and payments_rows(shop) == 4
    scopes = sorted(r.scope for r in key_rows(shop))
    assert len(set(scopes)) == 4 and scopes[0] == "http"
    assert all(s.startswith("http:authorization:") for s in scopes[1:])
    assert not any("secret" in str(value) for row in key_rows(shop) for value in row)  # only digests


def test_an_authenticated_user_keeps_one_scope_across_token_refresh(client: Client, shop: Shop) -> None:
    """With scope["user"] set by an auth middleware, the user (not the token) is the scope."""
    tc = client(auth=True)

    def send(token: str) -> Any:
        return post(tc, "k", {"amount": 2}, headers={"Authorization": f"Bearer {token}"})

    first = send("alice.v1")
    refreshed = send("alice.v2")  # the same user with a new token: a retry, so a replay
    bob = send("bob.v1")
    assert refreshed.headers["idempotency-replayed"] == "true" and refreshed.json() == first.json()
    assert bob.status_code == 201 and "idempotency-replayed" not in bob.headers
    scopes = {r.scope for r in key_rows(shop)}
    assert len(scopes) == 2 and all(s.startswith("http:user:") and "alice" not in s for s in scopes)
    assert shop.calls["pay"] == 2


def test_cookie_clients_are_kept_apart(sqlite_client: Client, sqlite_shop: Shop) -> None:
    """Without Authorization, the named session cookie is the principal: two sessions are two namespaces."""
    tc = sqlite_client(session_cookies=["session"])
    a = post(tc, "c", {"amount": 1}, headers={"Cookie": "session=a"})
    b = post(tc, "c", {"amount": 1}, headers={"Cookie": "session=b"})
    assert a.status_code == b.status_code == 201 and "idempotency-replayed" not in b.headers
    assert post(tc, "c", {"amount": 1}, headers={"Cookie": "session=a"}).json() == a.json()
    assert sqlite_shop.calls["pay"] == 2


def test_an_explicit_string_scope_is_one_namespace_for_everyone(
    sqlite_client: Client, sqlite_shop: Shop
) -> None:
    """scope="shop" is taken literally: every client shares it (which is why it is not the default)."""
    tc = sqlite_client(scope="shop")
    alice = post(tc, "s", {"amount": 1}, headers={"Authorization": "Bearer alice"})
    bob = post(tc, "s", {"amount": 1}, headers={"Authorization": "Bearer bob"})
    assert bob.headers["idempotency-replayed"] == "true" and bob.json() == alice.json()
    assert [r.scope for r in key_rows(sqlite_shop)] == ["shop"]


def test_principal_of_reads_user_then_authorization_then_cookie() -> None:
    """The principal is an authenticated scope["user"], else Authorization, else a session cookie: digests."""
    auth = [(b"authorization", b"Bearer t"), (b"cookie", b"s=1")]
    assert principal_of({"headers": []}) is None and default_scope({"headers": []}) == "http"
    assert str(principal_of({"headers": [(b"cookie", b"s=1")]}, session_cookies=["s"])).startswith("cookie:")
    by_header = principal_of({"headers": auth})
    assert str(by_header).startswith("authorization:") and "Bearer" not in str(by_header)
    assert principal_of({"headers": auth, "user": UnauthenticatedUser()}) == by_header
    by_user = principal_of({"headers": auth, "user": SimpleUser("alice")})
    assert by_user == principal_of({"headers": [], "user": SimpleUser("alice")}) != by_header
    assert default_scope({"headers": [], "user": SimpleUser("alice")}) == f"http:{by_user}"
    assert len(default_scope({"headers": [(b"authorization", b"x" * 10_000)]})) <= 200


def test_an_authenticated_user_without_identity_is_a_configuration_error() -> None:
    """An authenticated scope["user"] with nothing to identify it fails loudly instead of mixing clients."""

    class Nameless(BaseUser):
        @property
        def is_authenticated(self) -> bool:
            return True

    with pytest.raises(ConfigurationError, match="has no identity"):
        principal_of({"headers": [], "user": Nameless()})


def test_stored_responses_never_carry_cookies_or_credentials(client: Client, shop: Shop) -> None:
    """The first response sets its cookies; the stored copy and every replay carry none of them."""
    tc = client()
    headers = {"Authorization": "Bearer alice"}
    first = post(tc, "login", {"amount": 1, "session": True}, headers=headers)
    assert first.status_code == 201 and "secret-session" in first.headers["set-cookie"]
    assert first.headers["authentication-info"] == 'nextnonce="secret-nonce"'
    tc.cookies.clear()
    replay = post(tc, "login", {"amount": 1, "session": True}, headers=headers)
    assert replay.headers["idempotency-replayed"] == "true" and replay.json() == first.json()
    assert "set-cookie" not in replay.headers and "authentication-info" not in replay.headers
    assert replay.headers["location"] == first.headers["location"]
    [row] = key_rows(shop)
    assert "secret" not in row.response and "cookie" not in row.response.lower()


def test_route_overrides_from_a_dict(client: Client, shop: Shop) -> None:
    """routes= requires a key on one path, disables another, and overrides scope and methods."""
    tc = client(
        required_paths=[],
        routes={
            "/other": {"required": True, "scope": "others", "methods": ["POST"]},
            "/stream*": RouteOptions(enabled=False),
        },
    )
    assert tc.post("/other", content=b"x").status_code == 400
    assert tc.post("/other", content=b"x", headers={"Idempotency-Key": "o"}).status_code == 201
    replay = tc.post("/other", content=b"x", headers={"Idempotency-Key": "o"})
    assert replay.headers["idempotency-replayed"] == "true"
    # Disabled: the header is ignored, the handler runs both times.
    assert post(tc, "s", {}, path="/stream").status_code == 200
    assert post(tc, "s", {}, path="/stream").status_code == 200
    assert shop.calls == Counter({"other": 1, "stream": 2})
    assert [(r.scope, r.idem_key) for r in key_rows(shop)] == [("others", "o")]
    # /payments is no longer required.
    assert post(tc, None, {"amount": 1}).status_code == 201


def test_route_overrides_from_a_callable(client: Client, shop: Shop) -> None:
    """A routes callable decides per request; returning None keeps the middleware's settings."""

    def routes(scope: Any) -> RouteOptions | None:
        return RouteOptions(enabled=False) if scope["path"] == "/payments" else None

    tc = client(routes=routes, required_paths=["/payments", "/other"])
    assert post(tc, "p", {"amount": 1}).status_code == 201
    assert post(tc, "p", {"amount": 1}).status_code == 201  # disabled: runs again
    assert tc.post("/other", content=b"x").status_code == 400  # still required
    assert shop.calls["pay"] == 2 and key_rows(shop) == []


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"session_factory": None}, "session_factory"),
        ({"scope": ""}, "scope"),
        ({"scope": "s" * 201}, "scope"),
        ({"required_paths": "/payments"}, "required_paths"),
        ({"required_paths": ["payments"]}, "starting with '/'"),
        ({"methods": []}, "at least one"),
        ({"methods": ["PO ST"]}, "not an HTTP method"),
        ({"lease": timedelta(0)}, "lease"),
        ({"ttl": 5}, "ttl"),
        ({"max_body": -1}, "max_body"),
        ({"routes": {"/x": {"lease_seconds": 5}}}, "unknown option"),
        ({"routes": {"/x": 5}}, "RouteOptions"),
        ({"routes": {"/a*b": {}}}, "only at the end"),
        ({"ttl": timedelta(seconds=30), "lease": timedelta(seconds=60)}, "ttl .* shorter than lease"),
        ({"heartbeat_every": timedelta(seconds=60)}, "heartbeat_every .* shorter than lease"),
        ({"routes": {"/x": {"lease": timedelta(hours=25)}}}, r"routes\['/x'\]: ttl"),
        (
            {"heartbeat_every": timedelta(seconds=5), "routes": {"/x": {"lease": timedelta(seconds=5)}}},
            r"routes\['/x'\]: heartbeat_every",
        ),
    ],
)
def test_bad_configuration_is_refused(options: dict[str, Any], message: str) -> None:
    """Every option is checked when the middleware is built, with an error naming it."""

    async def app(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover - never called
        pass

    kwargs: dict[str, Any] = {"session_factory": sessionmaker()}
    kwargs.update(options)
    with pytest.raises(InvalidArgument, match=message):
        IdempotencyMiddleware(app, **kwargs)


def test_stored_headers_drop_hop_by_hop_connection_named_and_credential_headers() -> None:
    """Connection-scoped headers, those the Connection header names, and credential headers are dropped."""
    headers = [
        (b"content-type", b"application/json"),
        (b"Connection", b"close, X-Private"),
        (b"x-private", b"1"),
        (b"transfer-encoding", b"chunked"),
        (b"keep-alive", b"timeout=5"),
        (b"Set-Cookie", b"a=1"),
        (b"set-cookie", b"b=2"),
        (b"set-cookie2", b"c=3"),
        (b"Authorization", b"Bearer t"),
        (b"proxy-authorization", b"Basic eDp5"),
        (b"cookie", b"d=4"),
        (b"authentication-info", b'nextnonce="n"'),
        (b"proxy-authentication-info", b'nextnonce="p"'),
        (b"proxy-authenticate", b"Basic"),
        (b"www-authenticate", b'Bearer realm="api"'),
        (b"location", b"/payments/1"),
    ]
    assert _stored_headers(headers) == [
        ["content-type", "application/json"],
        ["www-authenticate", 'Bearer realm="api"'],
        ["location", "/payments/1"],
    ]
    assert frozenset({b"set-cookie", b"authorization", b"authentication-info"}) <= CREDENTIAL_HEADERS


def test_default_store_policy() -> None:
    """2xx, 3xx and 4xx outcomes are stored; refusals before execution (307 and 308: the same
    request to be sent elsewhere) and 5xx never."""
    stored = [s for s in (200, 201, 204, 301, 302, 303, 402, 410, 412, 418) if default_store_status(s)]
    assert stored == [200, 201, 204, 301, 302, 303, 402, 410, 412, 418]
    refused = (307, 308, 400, 401, 403, 404, 405, 408, 409, 413, 415, 422, 425, 429)
    assert frozenset(refused) == REFUSED_BEFORE_EXECUTION
    assert not any(default_store_status(s) for s in (*refused, 100, 500, 502, 503, 504))


# --------------------------------------------------------------------------
# Concurrency
# --------------------------------------------------------------------------


def test_sixteen_threads_same_key_run_the_handler_once(client: Client, shop: Shop) -> None:
    """16 simultaneous requests with one key: one execution; every other answer is a replay or a 409."""
    tc = client()
    barrier = threading.Barrier(16)

    def send() -> Any:
        barrier.wait(30)
        return post(tc, "storm", {"amount": 42})

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: send(), range(16)))
    executed = [a for a in answers if a.status_code == 201 and "idempotency-replayed" not in a.headers]
    replayed = [
        a for a in answers if a.status_code == 201 and a.headers.get("idempotency-replayed") == "true"
    ]
    busy = [a for a in answers if a.status_code == 409]
    assert len(executed) == 1, [a.status_code for a in answers]
    assert len(executed) + len(replayed) + len(busy) == 16
    assert all(a.json() == executed[0].json() for a in replayed)
    assert shop.calls["pay"] == 1 and payments_rows(shop) == 1
    # Afterwards every retry is a replay.
    assert post(tc, "storm", {"amount": 42}).headers["idempotency-replayed"] == "true"


# --------------------------------------------------------------------------
# Leases: Retry-After, takeover and heartbeat (short real leases on the database's clock)
# --------------------------------------------------------------------------


def test_retry_after_is_the_remaining_lease_not_the_whole_lease(client: Client, shop: Shop) -> None:
    """A 409's Retry-After is the ceiling of the seconds left on the live lease, not the full lease."""
    lease = 4
    tc = client(lease=timedelta(seconds=lease))
    body = {"amount": 5, "block": True}
    with ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        first = pool.submit(post, tc, "short", body)
        assert shop.entered.wait(30), "the first request never reached the handler"
        t1 = time.monotonic()  # the claim was committed between t0 and t1
        time.sleep(2.2)
        sent = time.monotonic()
        busy = post(tc, "short", body)
        t2 = time.monotonic()  # the lease was judged between sent and t2
        shop.gate.set()
        assert first.result(timeout=60).status_code == 201
    assert busy.status_code == 409
    retry_after = int(busy.headers["retry-after"])
    # The remaining lease was between lease - (t2 - t0) and lease - (sent - t1) seconds; the
    # database's clock ticks in milliseconds, hence the small allowance.
    assert max(1, math.ceil(lease - (t2 - t0) - 0.01)) <= retry_after <= math.ceil(lease - (sent - t1) + 0.01)
    assert retry_after < lease


def test_a_request_outliving_its_lease_is_taken_over_and_cannot_store_its_response(
    client: Client, shop: Shop, caplog: pytest.LogCaptureFixture
) -> None:
    """After the lease ends a retry runs the handler again; the late first one answers but stores nothing."""
    tc = client(lease=timedelta(seconds=1))
    body = {"amount": 5, "block": True}
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, tc, "late", body)
        assert shop.entered.wait(30), "the first request never reached the handler"
        shop.entered.clear()
        assert post(tc, "late", body).status_code == 409  # lease still live
        time.sleep(1.2)  # the first worker looks dead now
        second = pool.submit(post, tc, "late", body)
        assert shop.entered.wait(30), "the retry never took the key over"
        with caplog.at_level(logging.WARNING, logger="stateguard.asgi"):
            shop.gate.set()
            late, winner = first.result(timeout=60), second.result(timeout=60)
    assert late.status_code == winner.status_code == 201
    assert "idempotency-replayed" not in late.headers and "idempotency-replayed" not in winner.headers
    assert late.json() != winner.json()
    assert "was taken over while the app ran" in caplog.text
    replay = post(tc, "late", body)
    assert replay.headers["idempotency-replayed"] == "true" and replay.json() == winner.json()
    [row] = key_rows(shop)
    assert (row.status, row.attempt) == ("completed", 2)
    assert shop.calls["pay"] == 2 and payments_rows(shop) == 2


def test_heartbeat_keeps_a_long_request_in_progress(client: Client, shop: Shop) -> None:
    """With heartbeat_every, a request running past its first lease still answers retries with 409."""
    tc = client(lease=timedelta(seconds=1), heartbeat_every=timedelta(milliseconds=200))
    body = {"amount": 8, "block": True}
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, tc, "long", body)
        assert shop.entered.wait(30), "the first request never reached the handler"
        time.sleep(1.5)  # past the first lease: without a heartbeat a retry would take over
        busy = post(tc, "long", body)
        shop.gate.set()
        done = first.result(timeout=60)
    assert busy.status_code == 409 and done.status_code == 201
    [row] = key_rows(shop)
    assert (row.status, row.attempt) == ("completed", 1)
    assert shop.calls["pay"] == 1 and payments_rows(shop) == 1
