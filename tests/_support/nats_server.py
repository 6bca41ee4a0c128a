"""A NATS server with JetStream that a test starts, kills and starts again itself, on a private port.

The shared NATS (127.0.0.1:4222) must never be restarted by a test; a test that needs one to die
mid-stream starts its own::

    with NATSServer() as server:                  # nats-server -a 127.0.0.1 -p P -js -sd <dir>
        ...                                       # server.url: nats://127.0.0.1:P
        server.kill()                             # SIGKILL by pid
        server.start()                            # the same port and store: streams, consumers and
                                                  # unacknowledged messages survive

The process is stopped by its pid, never by name; its store directory is removed at the end.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from types import TracebackType

from tests.conftest import IN_CI

from .redis_server import free_port, stop_by_pid

NATS_SERVER = "/usr/sbin/nats-server"


def nats_server_binary() -> str:
    """The path of ``nats-server``; skip the test loudly (fail in CI) when it is not installed."""
    import pytest

    path = shutil.which("nats-server") or (NATS_SERVER if shutil.which(NATS_SERVER) else None)
    if path is None:
        message = "nats-server is not installed"
        if IN_CI:
            pytest.fail(f"{message}; in CI the private-NATS tests must run", pytrace=False)
        pytest.skip(f"!!! SKIPPED: {message}; install it to run these tests")
    return path


class NATSServer:
    """One ``nats-server -js`` on 127.0.0.1:``port`` with a file store that survives :meth:`kill`."""

    host = "127.0.0.1"

    def __init__(self) -> None:
        self.binary = nats_server_binary()
        self.port = free_port()
        self.store = tempfile.mkdtemp(prefix="sg-nats-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> None:
        """Start the server on its port and store; return once it accepts connections."""
        assert self.process is None or self.process.poll() is not None, "already running"
        self.process = subprocess.Popen(
            [self.binary, "-a", self.host, "-p", str(self.port), "-js", "-sd", self.store],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection((self.host, self.port), timeout=1) as sock:
                    if sock.makefile("rb").readline().startswith(b"INFO "):
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nats-server on port {self.port} did not start")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the server (by its pid) and reap it."""
        stop_by_pid(self.process)

    def __enter__(self) -> NATSServer:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.kill()
        shutil.rmtree(self.store, ignore_errors=True)
