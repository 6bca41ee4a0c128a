"""A server process that a test starts, kills and starts again itself, on a private port.

The shared servers must never be restarted by a test; a test that needs one to
crash starts its own.  :class:`PrivateServer` is what the private Redis, NATS
and ZooKeeper servers share: the process runs in a process group of its own
(a Ctrl-C of the test run does not reach it), its output goes to
``server.log`` in its own temporary directory, it is stopped by its pid,
never by name, and the directory is removed when it stops::

    class EchoServer(PrivateServer):
        name = "echo-server"

        def command(self) -> list[str]:
            return ["echo-server", "--port", str(self.port)]

        def serving(self) -> bool:
            ...                                   # the server answers on self.port

    with EchoServer() as server:                  # started, and serving
        server.restart()                          # SIGKILL by pid, then started again on the same port
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
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Self

from tests.conftest import IN_CI

__all__ = ["PrivateServer", "Started", "free_port", "installed_or_skip", "stop_by_pid"]


def installed_or_skip(path: str | None, message: str, *, needed_by: str) -> str:
    """``path``; when it is ``None`` (not installed), skip the test loudly with ``message``, or fail in CI.

    ``needed_by`` names the tests that must run in CI (``"the private-Redis tests"``).
    """
    import pytest

    if path is None:
        if IN_CI:
            pytest.fail(f"{message}; in CI {needed_by} must run", pytrace=False)
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


def stop_by_pid(process: subprocess.Popen[bytes] | None, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to a server process the tests started and reap it (SIGKILL after 20 s)."""
    if process is None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(sig)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=20)


class Started:
    """A context that calls :meth:`start` on entering and :meth:`stop` on leaving, and also when the
    start failed half-way (what did start is stopped): one server, or a group of them."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
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


class PrivateServer(Started):
    """One server process on 127.0.0.1:``port``, in its own process group and temporary directory.

    A subclass gives its :attr:`name`, its :meth:`command` and :meth:`serving`.

    :param port: the port (a free one when ``None``); it stays the same across restarts.
    :param directory: the server's directory (a temporary one, removed by :meth:`stop`, when ``None``).
    """

    host = "127.0.0.1"
    #: The server's name in errors (``"redis-server"``).
    name: ClassVar[str]
    #: The signal :meth:`stop` sends (SIGKILL: the directory is removed anyway).
    stop_signal: ClassVar[int] = signal.SIGKILL

    def __init__(self, port: int | None = None, *, directory: str | None = None) -> None:
        self.port = port or free_port()
        self._own_dir = directory is None
        self.directory = directory or tempfile.mkdtemp(prefix=f"sg-{self.name}-{self.port}-")
        self.process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        """The server's command line."""
        raise NotImplementedError

    def serving(self) -> bool:
        """Whether the server answers on its port right now."""
        raise NotImplementedError

    @property
    def log_path(self) -> Path:
        """Where the server's output goes."""
        return Path(self.directory, "server.log")

    def log_tail(self) -> str:
        """The last 2,000 characters of the server's output."""
        path = self.log_path
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def launch(self) -> None:
        """Start the process without waiting for it to serve (an ensemble member waits for its quorum)."""
        if self.process is not None:
            raise RuntimeError(f"{self.name} on port {self.port} is already running")
        log = open(self.log_path, "ab")  # noqa: SIM115 (handed to the child)
        try:
            self.process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.directory,
                start_new_session=True,
            )
        finally:
            log.close()

    def wait_serving(self, timeout: float) -> None:
        """Wait until :meth:`serving`; :class:`RuntimeError` when the process exits or the time is up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                self.process = None
                raise RuntimeError(f"{self.name} on port {self.port} exited at start:\n{self.log_tail()}")
            if self.serving():
                return
            time.sleep(0.05)
        tail = self.log_tail()
        raise RuntimeError(f"{self.name} on port {self.port} is not serving after {timeout}s:\n{tail}")

    def start(self, timeout: float = 30.0) -> None:
        """Start the server and wait until it serves (killed again if it does not)."""
        self.launch()
        try:
            self.wait_serving(timeout)
        except BaseException:
            self.kill()
            raise

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Stop the process by its pid (SIGKILL: a crash).  The directory stays."""
        process, self.process = self.process, None
        stop_by_pid(process, sig)

    def restart(self) -> None:
        """Crash the server (SIGKILL) and start it again on the same port, in the same directory."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """Stop the server by its pid and remove its temporary directory."""
        self.kill(self.stop_signal)
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)
