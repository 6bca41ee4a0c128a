"""A NATS server with JetStream that a test starts, kills and starts again itself, on a private port.

The shared NATS (127.0.0.1:4222) must never be restarted by a test; a test that needs one to die
mid-stream starts its own::

    with NATSServer() as server:                  # nats-server -a 127.0.0.1 -p P -js -sd <dir>
        ...                                       # server.url: nats://127.0.0.1:P
        server.kill()                             # SIGKILL by pid
        server.start()                            # the same port and store: streams, consumers and
                                                  # unacknowledged messages survive

The process is stopped by its pid, never by name (:class:`~tests._support.private_server.PrivateServer`);
its store directory is removed at the end.
"""

from __future__ import annotations

import shutil
import socket

from .private_server import PrivateServer, installed_or_skip

NATS_SERVER = "/usr/sbin/nats-server"


def nats_server_binary() -> str:
    """The path of ``nats-server``; skip the test loudly (fail in CI) when it is not installed."""
    return installed_or_skip(
        shutil.which("nats-server") or (NATS_SERVER if shutil.which(NATS_SERVER) else None),
        "nats-server is not installed",
        needed_by="the private-NATS tests",
    )


class NATSServer(PrivateServer):
    """One ``nats-server -js`` on 127.0.0.1:``port``; its file store (its directory) survives :meth:`kill`."""

    name = "nats-server"

    def __init__(self) -> None:
        self.binary = nats_server_binary()
        super().__init__()

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [self.binary, "-a", self.host, "-p", str(self.port), "-js", "-sd", self.directory]

    def serving(self) -> bool:
        """Whether the server greets a connection with its ``INFO`` line."""
        try:
            with socket.create_connection((self.host, self.port), timeout=1) as sock:
                return sock.makefile("rb").readline().startswith(b"INFO ")
        except OSError:
            return False

    def start(self, timeout: float = 15.0) -> None:
        """Start the server on its port and store; return once it accepts connections."""
        super().start(timeout)
