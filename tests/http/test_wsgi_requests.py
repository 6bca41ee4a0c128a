"""The WSGI face, called as a PEP 3333 server calls it: twins at one
instant, repeated response headers, iterables with ``close()``, streams that break, chunked and lying
request bodies, hostile keys, huge responses and raising observers, against docs/how-to/http.md."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ClassVar

import pytest
from flask import Flask, Response, abort, request
from sqlalchemy.orm import Session, sessionmaker
from werkzeug.test import EnvironBuilder

from stateguard.http.wsgi import WSGIIdempotencyMiddleware
from stateguard.observe import on_event
from stateguard.tables import metadata as stateguard_metadata
from tests._support.failing_observers import raising_listener_and_span
from tests._support.raw_asgi import World, _Base
from tests.conftest import Backend

pytestmark = pytest.mark.parametrize("backend", ["sqlite", "postgresql"], indirect=True)

ALICE = {"Authorization": "Bearer rev-wsgi-alice"}
BIG = bytes(range(256)) * (8 * 4096)  # 8 MiB, every byte value


@pytest.fixture
def world(backend: Backend) -> World:
    """stateguard's tables and the effect table on the backend, and a World on them."""
    backend.create(stateguard_metadata, _Base.metadata)
    return World(sessionmaker(backend.engine))


@dataclass
class Served:
    """What a PEP 3333 server sent for one request, and whether the app's iterable was closed."""

    status: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    error: BaseException | None = None

    @property
    def code(self) -> int:
        return int(self.status.split()[0]) if self.status else 0

    def header(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]

    @property
    def replayed(self) -> bool:
        return self.header("Idempotency-Replayed") == ["true"]


def serve(app: Callable[..., Iterable[bytes]], environ: dict[str, Any]) -> Served:
    """Call ``app`` as a WSGI server does: start_response, iterate, and always close()."""
    out = Served()

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        out.status, out.headers = status, list(headers)
        return lambda data: None

    result: Iterable[bytes] | None = None
    chunks: list[bytes] = []
    try:
        result = app(environ, start_response)
        for chunk in result:
            chunks.append(chunk)
    except Exception as error:  # what the server would log and answer 500 to
        out.error = error
    finally:
        close = getattr(result, "close", None)
        if close is not None:
            try:
                close()
            except Exception as error:
                out.error = out.error or error
    out.body = b"".join(chunks)
    return out


def environ(
    path: str = "/pay",
    *,
    key: str | None = "rev-k",
    body: bytes = b'{"amount": 5}',
    method: str = "POST",
    content_type: str = "application/json",
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    all_headers = dict(ALICE, **(headers or {}))
    if key is not None:
        all_headers["Idempotency-Key"] = key
    return EnvironBuilder(
        method=method, path=path, data=body, content_type=content_type, headers=all_headers
    ).get_environ()


def flask_app(world: World, **options: Any) -> WSGIIdempotencyMiddleware:
    app = Flask(__name__)
    app.config["gate"] = threading.Event()
    app.config["entered"] = threading.Event()

    @app.post("/pay")
    def pay() -> Any:
        n = world.effect("pay")
        return {"payment": n, "amount": request.get_json()["amount"]}, 201

    @app.post("/wait")
    def wait() -> Any:
        app.config["entered"].set()
        assert app.config["gate"].wait(30)
        n = world.effect("wait")
        return {"payment": n}, 201

    @app.post("/cookies")
    def cookies() -> Any:
        n = world.effect("cookies")
        response = Response(b'{"ok": %d}' % n, status=201, content_type="application/json")
        response.headers.add("Set-Cookie", "sid=secret-1; HttpOnly")
        response.headers.add("X-Multi", "one")
        response.headers.add("Set-Cookie", "csrf=secret-2")
        response.headers.add("X-Multi", "two")
        response.headers.add("X-Empty", "")
        return response

    @app.post("/big")
    def big() -> Any:
        world.effect("big")
        return Response(BIG, status=200, content_type="application/octet-stream")

    @app.post("/invalid")
    def invalid() -> Any:
        if request.get_json().get("amount", 0) <= 0:
            abort(400)
        n = world.effect("invalid")
        return {"payment": n}, 201

    @app.route("/read", methods=["GET", "HEAD", "PUT", "DELETE"])
    def read() -> Any:
        world.effect("read")
        return {"read": True}

    options.setdefault("session_factory", world.session_factory)
    return WSGIIdempotencyMiddleware(app.wsgi_app, **options)


def test_eight_threads_at_one_instant_run_the_handler_once(world: World) -> None:
    """Eight same-key, same-body requests released by one barrier: one runs, the seven others get 409
    with Retry-After while it holds the key, and every later retry replays its exact response."""
    app = flask_app(world, lease=timedelta(seconds=30))
    gate: threading.Event = app.app.__self__.config["gate"]  # type: ignore[attr-defined]
    barrier = threading.Barrier(8)
    answers: list[Served] = []
    lock = threading.Lock()

    def one() -> None:
        barrier.wait()
        served = serve(app, environ("/wait", key="rev-twins"))
        with lock:
            answers.append(served)
            if sum(a.code == 409 for a in answers) == 7:
                gate.set()

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    gate.set()
    assert sorted(a.code for a in answers) == [201] + [409] * 7, [(a.code, a.body) for a in answers]
    assert all(1 <= int(a.header("Retry-After")[0]) <= 30 for a in answers if a.code == 409)
    first = next(a for a in answers if a.code == 201)
    retries = [serve(app, environ("/wait", key="rev-twins")) for _ in range(3)]
    for r in retries:
        # The status code, not Werkzeug's reason phrase ("201 CREATED" is replayed as "201 Created").
        assert (r.code, r.body) == (first.code, first.body) and r.replayed
        assert [h for h in r.headers if h[0].lower() != "idempotency-replayed"] == [
            (k.lower(), v) for k, v in first.headers
        ]
    assert world.effects() == 1


def test_repeated_headers_replay_in_order_and_both_cookies_reach_only_the_first_client(world: World) -> None:
    """Set-Cookie twice and X-Multi twice: the first answer carries all four; the replay carries both
    X-Multi in order, the empty header, and neither cookie."""
    app = flask_app(world)
    first = serve(app, environ("/cookies", key="rev-cookies"))
    retry = serve(app, environ("/cookies", key="rev-cookies"))
    assert first.header("Set-Cookie") == ["sid=secret-1; HttpOnly", "csrf=secret-2"]
    assert retry.code == 201 and retry.replayed and retry.body == first.body
    assert retry.header("Set-Cookie") == []
    assert retry.header("X-Multi") == ["one", "two"] and retry.header("X-Empty") == [""]
    assert retry.header("Content-Length") == first.header("Content-Length")
    assert world.effects() == 1


@pytest.mark.limits
def test_an_eight_mib_response_replays_byte_for_byte(world: World) -> None:
    """A response of 8 MiB holding every byte value is stored and replayed exactly, the app run once."""
    app = flask_app(world)
    first = serve(app, environ("/big", key="rev-big"))
    retry = serve(app, environ("/big", key="rev-big"))
    assert first.code == retry.code == 200 and retry.replayed
    assert first.body == BIG and retry.body == BIG
    assert world.effects() == 1


def test_a_400_from_the_handler_stores_nothing_and_the_corrected_request_uses_the_key(world: World) -> None:
    """Flask's abort(400) on a bad amount is a refusal: the key is forgotten, so the corrected body with
    the same key runs (not 422), and then replays."""
    app = flask_app(world)
    refused = serve(app, environ("/invalid", key="rev-fix", body=b'{"amount": 0}'))
    assert refused.code == 400 and world.key_rows() == []
    fixed = serve(app, environ("/invalid", key="rev-fix", body=b'{"amount": 7}'))
    again = serve(app, environ("/invalid", key="rev-fix", body=b'{"amount": 7}'))
    assert fixed.code == 201 and again.code == 201 and again.replayed and again.body == fixed.body
    assert world.effects() == 1


# --------------------------------------------------------------------------
# Iterables with close(), streams that break
# --------------------------------------------------------------------------


class Body:
    """A WSGI response iterable that counts its close() calls and may break after ``fail_after`` chunks."""

    def __init__(self, chunks: list[bytes], fail_after: int | None = None, close_fails: bool = False) -> None:
        self.chunks = chunks
        self.fail_after = fail_after
        self.close_fails = close_fails
        self.closed = 0

    def __iter__(self) -> Iterator[bytes]:
        for i, chunk in enumerate(self.chunks):
            if self.fail_after is not None and i == self.fail_after:
                raise RuntimeError("the stream broke")
            yield chunk

    def close(self) -> None:
        self.closed += 1
        if self.close_fails:
            raise RuntimeError("close() broke")


def raw_wsgi(world: World, make: Callable[[], Body]) -> tuple[Callable[..., Iterable[bytes]], list[Body]]:
    bodies: list[Body] = []

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        world.effect("raw")
        start_response("201 Created", [("Content-Type", "text/plain")])
        body = make()
        bodies.append(body)
        return body

    return app, bodies


@pytest.mark.parametrize(
    "chunks", [[b"whole"], [b"", b"whole", b""], [b"a", b"b", b"c"]], ids=["one", "one-with-empties", "three"]
)
def test_the_apps_iterable_is_closed_exactly_once(world: World, chunks: list[bytes]) -> None:
    """Whatever the number of chunks, the server's one close() reaches the app's iterable exactly once, and
    the body arrives whole."""
    inner, bodies = raw_wsgi(world, lambda: Body(list(chunks)))
    app = WSGIIdempotencyMiddleware(inner, session_factory=world.session_factory)
    served = serve(app, environ("/raw", key="rev-close"))
    assert served.error is None and served.code == 201 and served.body == b"".join(chunks)
    assert [b.closed for b in bodies] == [1]


@pytest.mark.parametrize("fail_after", [0, 1, 3])
def test_a_stream_that_breaks_releases_the_key_and_keeps_it_bound(world: World, fail_after: int) -> None:
    """The app's iterable raises on its first, second or fourth chunk: its iterable is closed once, the
    same request runs again, and another body with the key is 422."""
    inner, bodies = raw_wsgi(world, lambda: Body([b"a", b"b", b"c", b"d", b"e"], fail_after=fail_after))
    app = WSGIIdempotencyMiddleware(inner, session_factory=world.session_factory)
    broken = serve(app, environ("/raw", key="rev-break"))
    assert isinstance(broken.error, RuntimeError)
    assert [b.closed for b in bodies] == [1]
    other = serve(app, environ("/raw", key="rev-break", body=b'{"amount": 6}'))
    assert other.code == 422 and world.effects() == 1
    again = serve(app, environ("/raw", key="rev-break"))
    assert isinstance(again.error, RuntimeError) and world.effects() == 2


def test_a_close_that_raises_after_a_whole_response_does_not_run_the_app_again(world: World) -> None:
    """The app's one-chunk iterable raises in close(): the retry gets the stored response and the app
    does not run a second time."""
    inner, bodies = raw_wsgi(world, lambda: Body([b"paid"], close_fails=True))
    app = WSGIIdempotencyMiddleware(inner, session_factory=world.session_factory)
    serve(app, environ("/raw", key="rev-close-fails"))
    retry = serve(app, environ("/raw", key="rev-close-fails"))
    assert retry.code == 201 and retry.replayed and retry.body == b"paid"
    assert world.effects() == 1 and [b.closed for b in bodies] == [1]


# --------------------------------------------------------------------------
# Request bodies: chunked, lying, too large
# --------------------------------------------------------------------------


def _chunked(body: bytes, key: str) -> dict[str, Any]:
    env = environ("/pay", key=key, body=b"")
    env.pop("CONTENT_LENGTH", None)
    env["wsgi.input"] = io.BytesIO(body)
    env["wsgi.input_terminated"] = True
    return env


@pytest.mark.limits
def test_a_chunked_body_over_max_body_is_413_and_stores_nothing(world: World) -> None:
    """A chunked request (no Content-Length) one byte over max_body is 413, not run, no key row; one of
    exactly max_body runs and replays."""
    app = flask_app(world, max_body=1000)
    payload = b'{"amount": 5, "pad": "' + b"x" * 1000
    over = serve(app, _chunked(payload[:1001], "rev-chunked"))
    assert over.code == 413 and world.effects() == 0 and world.key_rows() == []
    exact = b'{"amount": 5, "pad": "' + b"x" * (1000 - 24) + b'"}'
    assert len(exact) == 1000
    first = serve(app, _chunked(exact, "rev-chunked"))
    retry = serve(app, _chunked(exact, "rev-chunked"))
    assert first.code == 201 and retry.code == 201 and retry.replayed and retry.body == first.body
    assert world.effects() == 1


@pytest.mark.hostile
def test_a_body_shorter_than_its_content_length_runs_nothing_and_stores_nothing(world: World) -> None:
    """Content-Length says 100, the client sent 13 bytes and went away: 400, not run, no key row."""
    app = flask_app(world)
    env = environ("/pay", key="rev-short")
    env["CONTENT_LENGTH"] = "100"
    short = serve(app, env)
    assert short.code == 400 and world.effects() == 0 and world.key_rows() == []


@pytest.mark.hostile
@pytest.mark.parametrize(
    "value",
    ["", "   ", "k" * 10_000, "a\x00b", "caf\xe9", "caf\xc3\xa9", "a\r\nSet-Cookie: x=1", '"open', "a, b"],
    ids=["empty", "blank", "10kB", "NUL", "latin1", "utf8-as-latin1", "crlf", "bad-sf", "joined"],
)
def test_hostile_keys_in_the_environ_run_nothing_and_store_nothing(world: World, value: str) -> None:
    """Each hostile key (as a WSGI server would put it in the environ) is a 400 problem: not run, no key
    row, and no response header carries a line break."""
    app = flask_app(world)
    env = environ("/pay", key=None)
    env["HTTP_IDEMPOTENCY_KEY"] = value
    served = serve(app, env)
    assert served.code == 400 and served.header("Content-Type") == ["application/problem+json"]
    assert all("\n" not in v and "\r" not in v for _, v in served.headers)
    assert world.effects() == 0 and world.key_rows() == []


@pytest.mark.parametrize("method", ["GET", "HEAD", "PUT", "DELETE"])
def test_other_methods_with_a_key_are_neither_claimed_nor_replayed(world: World, method: str) -> None:
    """A key on GET, HEAD, PUT or DELETE is ignored: the handler runs every time, no key row."""
    app = flask_app(world)
    for _ in range(2):
        served = serve(app, environ("/read", key="rev-get", method=method, body=b""))
        assert served.code == 200 and not served.replayed
    assert world.effects() == 2 and world.key_rows() == []


def test_a_json_body_sent_as_text_is_another_request_than_the_same_json(world: World) -> None:
    """The canonical JSON of one request and the very same bytes sent as text/plain are two requests:
    the second is 422, not a replay of the first (its handler reads it otherwise)."""
    app = flask_app(world)
    first = serve(app, environ("/pay", key="rev-ct", body=b'{"amount": 5}'))
    assert first.code == 201
    plain = serve(app, environ("/pay", key="rev-ct", body=b'{"amount":5}', content_type="text/plain"))
    assert plain.code == 422 and not plain.replayed
    assert world.effects() == 1


@pytest.mark.failing_observer
@pytest.mark.parametrize("where", ["factory", "enter", "exit"])
def test_raising_observers_change_no_answer(world: World, where: str) -> None:
    """A raising listener and a raising span: the first answer, its replay, the 422 of another body and a
    refusal's forgotten key are as without them."""

    app = flask_app(world)
    with raising_listener_and_span(where):
        first = serve(app, environ("/pay", key="rev-obs"))
        retry = serve(app, environ("/pay", key="rev-obs"))
        other = serve(app, environ("/pay", key="rev-obs", body=b'{"amount": 9}'))
        refused = serve(app, environ("/invalid", key="rev-obs-2", body=b'{"amount": 0}'))
        rows = world.key_rows()
    assert (first.error, retry.error, other.error, refused.error) == (None, None, None, None)
    assert [first.code, retry.code, other.code, refused.code] == [201, 201, 422, 400]
    assert retry.replayed and retry.body == first.body
    assert len(rows) == 1 and world.effects() == 1


def test_sixteen_threads_with_two_bodies_at_one_instant_answer_409_or_422_as_documented(world: World) -> None:
    """Sixteen same-key requests released by one barrier, eight of each of two bodies: one runs; while
    it holds the key its same-body twins get 409 and the other body's requests 422 (never 503 or a
    second run); afterwards its twins replay it and the other body stays 422."""
    app = flask_app(world, lease=timedelta(seconds=30))
    gate: threading.Event = app.app.__self__.config["gate"]  # type: ignore[attr-defined]
    barrier = threading.Barrier(16)
    answers: list[tuple[bytes, Served]] = []
    lock = threading.Lock()
    bodies = [b'{"amount": 1}'] * 8 + [b'{"amount": 2}'] * 8

    def one(body: bytes) -> None:
        barrier.wait()
        served = serve(app, environ("/wait", key="rev-mixed", body=body))
        with lock:
            answers.append((body, served))
            if len(answers) == 15:
                gate.set()

    threads = [threading.Thread(target=one, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    gate.set()
    (winner_body, winner), *_ = [(b, s) for b, s in answers if s.code == 201]
    codes = sorted((b == winner_body, s.code) for b, s in answers if s is not winner)
    assert codes == [(False, 422)] * 8 + [(True, 409)] * 7, [(b, s.code, s.body[:80]) for b, s in answers]
    assert world.effects() == 1
    twin = serve(app, environ("/wait", key="rev-mixed", body=winner_body))
    other = serve(app, environ("/wait", key="rev-mixed", body=b'{"amount": 3}'))
    assert twin.code == 201 and twin.replayed and twin.body == winner.body and other.code == 422


class _CountedSession(Session):
    """A Session that counts the sessions made and closed, to see the middleware close each one."""

    made: ClassVar[list[_CountedSession]] = []

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.closes = 0
        _CountedSession.made.append(self)

    def close(self) -> None:
        self.closes += 1
        super().close()


def test_every_session_the_middleware_opens_is_closed_whatever_it_answers(
    world: World, backend: Backend
) -> None:
    """The reference: the middleware "opens one [session] per keyed request for the key record only and
    closes it afterwards", on the run, the replay, the 409 of a twin and the 422 of another body."""
    _CountedSession.made = []
    counted = sessionmaker(backend.engine, class_=_CountedSession)
    app = flask_app(world, session_factory=counted, lease=timedelta(seconds=30))
    gate: threading.Event = app.app.__self__.config["gate"]  # type: ignore[attr-defined]
    entered: threading.Event = app.app.__self__.config["entered"]  # type: ignore[attr-defined]
    answers: list[Served] = []
    holder = threading.Thread(target=lambda: answers.append(serve(app, environ("/wait", key="rev-close-s"))))
    holder.start()
    assert entered.wait(30)
    twin = serve(app, environ("/wait", key="rev-close-s"))
    other = serve(app, environ("/wait", key="rev-close-s", body=b'{"amount": 2}'))
    gate.set()
    holder.join(30)
    replay = serve(app, environ("/wait", key="rev-close-s"))
    assert [answers[0].code, twin.code, other.code, replay.code] == [201, 409, 422, 201] and replay.replayed
    assert len(_CountedSession.made) == 4
    assert [s.closes >= 1 for s in _CountedSession.made] == [True] * 4


@pytest.mark.failing_observer
def test_a_heartbeat_keeps_a_wsgi_key_under_a_raising_listener(world: World) -> None:
    """lease 1 s, heartbeat every 0.2 s, a handler held 2.5 s, a listener raising on every event (each
    beat included): the twin at 2 s is 409, and the retry afterwards replays the one run."""
    app = flask_app(world, lease=timedelta(seconds=1), heartbeat_every=timedelta(seconds=0.2))
    gate: threading.Event = app.app.__self__.config["gate"]  # type: ignore[attr-defined]
    entered: threading.Event = app.app.__self__.config["entered"]  # type: ignore[attr-defined]

    def bad_listener(_event: Any) -> None:
        raise RuntimeError("listener broke")

    remove = on_event(bad_listener)
    try:
        answers: list[Served] = []
        holder = threading.Thread(target=lambda: answers.append(serve(app, environ("/wait", key="rev-beat"))))
        holder.start()
        assert entered.wait(30)
        time.sleep(2)
        twin = serve(app, environ("/wait", key="rev-beat"))
        time.sleep(0.5)
        gate.set()
        holder.join(30)
        retry = serve(app, environ("/wait", key="rev-beat"))
    finally:
        remove()
    assert [answers[0].code, twin.code, retry.code] == [201, 409, 201] and retry.replayed
    assert retry.body == answers[0].body and world.effects() == 1
