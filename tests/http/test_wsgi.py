"""WSGIIdempotencyMiddleware on a real Flask app under gunicorn (2 workers, threads): duplicate requests
racing on one key run the handler once, a worker SIGKILLed mid-request frees its key when the lease ends,
and the draft's 400 / 409 / 422 answers come through a real WSGI server."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from stateguard.tables import metadata as stateguard_metadata
from tests.conftest import Backend
from tests.http._flask_app import Base, Charge

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A gunicorn master (started by the test, stopped by its pid) and its base URL."""

    process: subprocess.Popen[bytes]
    url: str

    def post(self, path: str, body: dict[str, Any], key: str | None = None, **kw: Any) -> httpx.Response:
        headers = {"Idempotency-Key": key} if key is not None else {}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=60, **kw)


def _serve(backend: Backend, lease: float, log: Path) -> Iterator[Server]:
    backend.create(stateguard_metadata, Base.metadata)
    port = _free_port()
    env = dict(os.environ, SG_DATABASE_URL=backend.url, SG_LEASE=str(lease), SG_GATE=str(log.parent / "gate"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
    command = [sys.executable, "-m", "gunicorn", "--workers", "2", "--worker-class", "gthread",
               "--threads", "6", "--bind", f"127.0.0.1:{port}", "--graceful-timeout", "2",
               "--timeout", "120", "tests.http._flask_app:app"]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    server = Server(process, f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                pytest.fail(f"gunicorn exited with {process.returncode}:\n{log.read_text()}")
            try:
                httpx.get(server.url + "/", timeout=2)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    pytest.fail(f"gunicorn did not answer within 60 s:\n{log.read_text()}")
                time.sleep(0.1)
        yield server
    finally:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=20)


@pytest.fixture
def server(backend: Backend, tmp_path: Path) -> Iterator[Server]:
    """The shop under gunicorn on a private port, on each backend, with a 60 s lease."""
    yield from _serve(backend, 60, tmp_path / "gunicorn.log")


@pytest.fixture
def short_lease_server(backend: Backend, tmp_path: Path) -> Iterator[Server]:
    """The same with a 3 s lease, so a dead worker's key frees quickly."""
    yield from _serve(backend, 3, tmp_path / "gunicorn.log")


def _charges(backend: Backend, key: str) -> list[Charge]:
    with backend.engine.connect() as conn:
        return list(conn.execute(select(Charge).where(Charge.key == key)).all())  # type: ignore[arg-type]


def test_concurrent_duplicates_run_the_handler_once(server: Server, backend: Backend) -> None:
    """Twelve identical requests racing on one key through two workers: one charge, the rest 409 or replay."""
    barrier = threading.Barrier(12)
    answers: list[httpx.Response] = []
    lock = threading.Lock()

    def send() -> None:
        barrier.wait()
        answer = server.post("/charges", {"amount": 7, "hold": 0.5}, key="race-1")
        with lock:
            answers.append(answer)

    threads = [threading.Thread(target=send) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(answers) == 12
    ran = [a for a in answers if a.status_code == 201 and "idempotency-replayed" not in a.headers]
    assert len(ran) == 1, [(a.status_code, a.headers.get("idempotency-replayed")) for a in answers]
    for a in answers:
        if a is not ran[0]:
            busy = a.status_code == 409 and int(a.headers["retry-after"]) >= 1
            replayed = a.status_code == 201 and a.headers.get("idempotency-replayed") == "true"
            assert busy or (replayed and a.json() == ran[0].json()), (a.status_code, a.text)
    assert len(_charges(backend, "race-1")) == 1
    again = server.post("/charges", {"amount": 7, "hold": 0.5}, key="race-1")
    assert again.headers["idempotency-replayed"] == "true" and again.json() == ran[0].json()


def test_the_drafts_answers_through_a_wsgi_server(server: Server, backend: Backend) -> None:
    """Missing or doubled key 400, in flight 409, other body 422, a refusal 409 forgets the key."""
    assert server.post("/charges", {"amount": 1}).status_code == 400  # a required path
    doubled = httpx.post(
        server.url + "/charges",
        json={"amount": 1},
        headers=[("Idempotency-Key", "a"), ("Idempotency-Key", "b")],
        timeout=60,
    )
    assert doubled.status_code == 400 and doubled.headers["content-type"] == "application/problem+json"
    assert server.post("/charges", {"amount": 1}, key='""').status_code == 400  # blank
    with httpx.Client(timeout=60) as client:
        slow = threading.Thread(
            target=lambda: client.post(
                server.url + "/charges", json={"amount": 2, "hold": 2}, headers={"Idempotency-Key": "k"}
            )
        )
        slow.start()
        deadline = time.monotonic() + 30
        while not _charges(backend, "k"):
            assert time.monotonic() < deadline, "the first request never reached the handler"
            time.sleep(0.05)
        busy = server.post("/charges", {"amount": 2, "hold": 2}, key="k")
        assert busy.status_code == 409 and 1 <= int(busy.headers["retry-after"]) <= 60
        reused = server.post("/charges", {"amount": 3}, key="k")  # another body, while in flight
        assert reused.status_code == 422
        slow.join(60)
    replay = server.post("/charges", {"amount": 2, "hold": 2}, key="k")
    assert replay.status_code == 201 and replay.headers["idempotency-replayed"] == "true"
    assert server.post("/charges", {"amount": 9}, key="k").status_code == 422
    assert len(_charges(backend, "k")) == 1
    refused = server.post("/refuse", {"sku": "x"}, key="r")
    assert refused.status_code == 409 and "idempotency-replayed" not in refused.headers
    corrected = server.post("/refuse", {"sku": "y"}, key="r")  # forgotten: another body may use it
    assert corrected.status_code == 409 and "idempotency-replayed" not in corrected.headers


def _raw_post(server: Server, target: str, body: bytes, headers: dict[str, str]) -> int:
    """POST ``target`` byte for byte (an HTTP client would normalise ``//charges``); the status code."""
    host, port = server.url.removeprefix("http://").split(":")
    lines = [f"POST {target} HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
             f"Content-Length: {len(body)}", "Connection: close"]  # fmt: skip
    lines += [f"{name}: {value}" for name, value in headers.items()]
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    return int(reply.split(b" ", 2)[1])


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("target", "headers"),
    [("//charges", {}), ("///charges", {}), ("/apicharges", {"SCRIPT_NAME": "/api"})],
    ids=["double-slash", "triple-slash", "script-name-not-a-segment"],
)
def test_a_required_path_needs_its_key_however_gunicorn_spells_it(
    server: Server, backend: Backend, target: str, headers: dict[str, str]
) -> None:
    """Flask routes ``//charges`` (werkzeug strips the leading slashes) and, behind a proxy that sets
    ``SCRIPT_NAME: /api``, ``/apicharges`` (gunicorn cuts SCRIPT_NAME off as a string: PATH_INFO is
    ``charges``) to ``/charges``, which requires a key: without one it is 400 and nothing is charged."""
    status = _raw_post(server, target, b'{"amount": 3}', headers)
    assert status == 400 and _charges(backend, "") == [], (status, _charges(backend, ""))


@pytest.mark.restart
def test_a_worker_killed_mid_request_frees_its_key_when_the_lease_ends(
    short_lease_server: Server, backend: Backend, tmp_path: Path
) -> None:
    """SIGKILL the worker running a request: its retry is 409 during the lease, then runs and is stored."""
    server = short_lease_server
    body = {"amount": 5, "hold": 60}
    first = threading.Thread(target=lambda: _swallow(lambda: server.post("/charges", body, key="kill-1")))
    first.start()
    deadline = time.monotonic() + 30
    while not (rows := _charges(backend, "kill-1")):
        assert time.monotonic() < deadline, "the first request never reached the handler"
        time.sleep(0.05)
    victim = rows[0].pid
    os.kill(victim, signal.SIGKILL)
    first.join(60)
    early = server.post("/charges", body, key="kill-1")  # the same request: its lease is still live
    assert early.status_code == 409 and 1 <= int(early.headers["retry-after"]) <= 3, early.text
    assert server.post("/charges", body | {"amount": 6}, key="kill-1").status_code == 422
    (tmp_path / "gate").touch()  # from now on the handler answers at once
    deadline = time.monotonic() + 30
    while (answer := server.post("/charges", body, key="kill-1")).status_code == 409:
        assert time.monotonic() < deadline, "the dead worker's key never freed"
        time.sleep(0.3)
    assert answer.status_code == 201 and "idempotency-replayed" not in answer.headers, answer.text
    assert answer.json()["pid"] != victim
    again = server.post("/charges", body, key="kill-1")
    assert again.headers["idempotency-replayed"] == "true" and again.json() == answer.json()
    assert [c.pid for c in _charges(backend, "kill-1")] == [victim, answer.json()["pid"]]


def _swallow(fn: Any) -> None:
    with contextlib.suppress(httpx.TransportError):  # the worker serving it was killed
        fn()
