"""A Redis server that a test starts, restarts and stops itself, on a private port.

The shared test Redis (``REDIS_URL``) must never be restarted by a test; a test
that needs a Redis to lose everything starts its own::

    with RedisServer() as server:                 # redis-server --port P --save "" ...
        client = redis.Redis(port=server.port)
        ...
        server.restart()                          # SIGKILL, then start again on P: no data survives

No persistence (``--save ""``, ``--appendonly no``, a private ``--dir``), so a
restart is a Redis that crashed and came back empty.  The process is stopped
by its pid, never by name.  :func:`redis_server_binary` finds ``redis-server``
or skips the test loudly (fails under ``CI=true``, like every missing server).
"""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from .conftest import IN_CI

__all__ = ["RedisServer", "free_port", "redis_server_binary"]


def redis_server_binary() -> str:
    """The path of ``redis-server``; skip the test loudly (fail in CI) when it is not installed."""
    import pytest

    path = shutil.which("redis-server")
    if path is None:
        message = "redis-server is not installed (Debian package redis-server)"
        if IN_CI:
            pytest.fail(f"{message}; in CI the private-Redis tests must run", pytrace=False)
        pytest.skip(f"!!! SKIPPED: {message}; install it to run these tests")
    return path


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(*, cluster: bool = False) -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    ``cluster``: also the cluster bus port (``port + 10000``) is free, and the
    port is at most 55535 (redis-server refuses a higher one in cluster mode).
    """
    if not cluster:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
            return port
    for _ in range(200):
        port = random.randint(20000, 55535)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair (port, port + 10000) for a cluster node")


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1:``port`` without persistence.

    :param port: the port (a free one when ``None``); it stays the same across restarts.
    :param args: more ``redis-server`` arguments (``["--cluster-enabled", "yes"]`` ...).
    :param directory: the server's ``--dir`` (a temporary directory removed by :meth:`stop`
        when ``None``).
    """

    host = "127.0.0.1"

    def __init__(
        self, port: int | None = None, *, args: Sequence[str] = (), directory: str | None = None
    ) -> None:
        self.binary = redis_server_binary()
        self.port = port or free_port(cluster="--cluster-enabled" in args)
        self.args = list(args)
        self._own_dir = directory is None
        self.directory = directory or tempfile.mkdtemp(prefix=f"sg-redis-{self.port}-")
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout: float = 20.0) -> None:
        """Start the server and wait until it answers PING."""
        if self.process is not None:
            raise RuntimeError(f"redis-server on port {self.port} is already running")
        log = Path(self.directory, "redis.log")
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port", str(self.port),
                "--bind", self.host,
                "--save", "",
                "--appendonly", "no",
                "--dir", self.directory,
                "--logfile", str(log),
                "--daemonize", "no",
                *self.args,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                text = log.read_text(errors="replace") if log.exists() else ""
                self.process = None
                raise RuntimeError(f"redis-server on port {self.port} exited at start:\n{text[-2000:]}")
            if self.ping():
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING within {timeout}s")

    def ping(self) -> bool:
        """Whether the server answers ``PING`` with ``+PONG`` right now (raw socket, no client)."""
        try:
            with socket.create_connection((self.host, self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Stop the process by its pid (SIGKILL: a crash; nothing is saved either way)."""
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=20)

    def restart(self) -> None:
        """Crash the server (SIGKILL) and start it again on the same port, empty."""
        self.kill()
        self.start()
        self.restarts += 1

    def stop(self) -> None:
        """Stop the server (SIGTERM by pid) and remove its temporary directory."""
        self.kill(signal.SIGTERM)
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
