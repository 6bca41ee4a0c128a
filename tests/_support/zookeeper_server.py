"""ZooKeeper servers that a test starts, restarts and stops itself, on private ports.

Nothing here touches a system ZooKeeper: each server is a JVM started from the
Debian ``zookeeperd`` jars with its own temporary data directory and ports,
and stopped by its pid::

    with ZooKeeperServer() as server:             # one standalone server
        zk = KazooClient(hosts=server.hosts); zk.start()
        server.restart()                          # SIGKILL, then start again: the data directory stays

    with ZooKeeperEnsemble(3) as ensemble:        # three servers on localhost, one quorum
        leader = ensemble.leader()                # asks each server ``srvr`` (Mode: leader)
        leader.kill()                             # the others elect a new leader

:func:`zookeeper_command` finds ``java`` and the ZooKeeper jar or skips the test
loudly (fails under ``CI=true``, like every missing server).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from types import TracebackType

from tests._support.private_server import PrivateServer, Started, free_port, installed_or_skip

__all__ = ["Gate", "ZooKeeperEnsemble", "ZooKeeperServer", "zookeeper_available", "zookeeper_command"]

#: Where Debian's ``zookeeperd`` (package ``zookeeper``) puts the server jar; its
#: manifest's Class-Path names the other jars it needs.
_JARS = ("/usr/share/java/zookeeper.jar",)
_MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"

#: Short ticks keep elections and session expiry fast; sessions may ask for 0.4 to 30 s.
TICK_MS = 200


def _jar() -> str | None:
    return os.environ.get("STATEGUARD_ZOOKEEPER_JAR") or next((j for j in _JARS if Path(j).exists()), None)


def zookeeper_available() -> bool:
    """Whether ``java`` and the ZooKeeper server jar are installed (a plain answer, for the benchmarks)."""
    return shutil.which("java") is not None and _jar() is not None


def zookeeper_command() -> list[str]:
    """``java ... QuorumPeerMain`` without the config path; skip loudly (fail in CI) when not installed."""
    java = shutil.which("java")
    jar = _jar()
    missing = "java" if java is None else "the ZooKeeper server jar (/usr/share/java/zookeeper.jar)"
    installed_or_skip(
        None if java is None or jar is None else jar,
        f"{missing} is not installed (Debian package zookeeperd)",
        needed_by="the ZooKeeper tests",
    )
    assert java is not None and jar is not None
    return [
        java,
        "-Xmx128m",
        "-XX:+UseSerialGC",
        "-XX:TieredStopAtLevel=1",
        "-Dzookeeper.admin.enableServer=false",
        "-cp",
        jar,
        _MAIN,
    ]


def four_letter(host: str, port: int, word: str, timeout: float = 1.0) -> str:
    """The answer of a four-letter command (``srvr``, ``ruok`` ...), or ``""`` when the server is down."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(word.encode())
            chunks = []
            while True:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                chunks.append(chunk)
            return b"".join(chunks).decode(errors="replace")
    except OSError:
        return ""


class ZooKeeperServer(PrivateServer):
    """One ZooKeeper server process (standalone, or member ``myid`` of an ensemble).

    :param port: the client port (a free one when ``None``); it stays the same across restarts.
    :param peers: for an ensemble, ``server.N=host:peer:election`` lines shared by all members.
    :param myid: this member's id in ``peers``.
    :param max_session_ms: the longest session a client may negotiate (a longer ask is cut to it).
    """

    name = "zookeeper"

    def __init__(
        self,
        port: int | None = None,
        *,
        peers: list[str] | None = None,
        myid: int = 0,
        max_session_ms: int = 30000,
    ) -> None:
        self.zk_command = zookeeper_command()
        self.max_session_ms = max_session_ms
        super().__init__(port)
        self.peers = list(peers or [])
        self.myid = myid
        self._write_config()

    @property
    def hosts(self) -> str:
        """``127.0.0.1:<port>``, for ``KazooClient(hosts=...)``."""
        return f"{self.host}:{self.port}"

    def _write_config(self) -> None:
        data = Path(self.directory, "data")
        data.mkdir(exist_ok=True)
        lines = [
            f"tickTime={TICK_MS}",
            "initLimit=20",
            "syncLimit=10",
            f"dataDir={data}",
            f"clientPort={self.port}",
            f"clientPortAddress={self.host}",
            "minSessionTimeout=400",
            f"maxSessionTimeout={self.max_session_ms}",
            "4lw.commands.whitelist=srvr,ruok",
            "admin.enableServer=false",
            "maxClientCnxns=0",
        ]
        if self.peers:
            Path(data, "myid").write_text(f"{self.myid}\n")
            lines += self.peers
        Path(self.directory, "zoo.cfg").write_text("\n".join(lines) + "\n")

    def command(self) -> list[str]:
        return [*self.zk_command, str(Path(self.directory, "zoo.cfg"))]

    def mode(self) -> str | None:
        """``leader``, ``follower`` or ``standalone`` while serving; ``None`` when down or not serving."""
        for line in four_letter(self.host, self.port, "srvr").splitlines():
            if line.startswith("Mode:"):
                return line.split(":", 1)[1].strip()
        return None

    def serving(self) -> bool:
        """Whether the server answers ``srvr`` with a mode (it has a quorum)."""
        return self.mode() is not None

    def start(self, timeout: float = 60.0) -> None:
        """Start the server and wait until it serves."""
        super().start(timeout)


class ZooKeeperEnsemble(Started):
    """``size`` ZooKeeper servers on localhost forming one quorum."""

    def __init__(self, size: int = 3) -> None:
        ports = [(free_port(), free_port(), free_port()) for _ in range(size)]
        peers = [f"server.{i}=127.0.0.1:{peer}:{election}" for i, (_, peer, election) in enumerate(ports, 1)]
        self.servers = [
            ZooKeeperServer(client, peers=peers, myid=i) for i, (client, _, _) in enumerate(ports, 1)
        ]

    @property
    def hosts(self) -> str:
        """Every member's ``host:port``, comma-separated, for ``KazooClient(hosts=...)``."""
        return ",".join(s.hosts for s in self.servers)

    def start(self, timeout: float = 60.0) -> None:
        for server in self.servers:
            server.launch()
        for server in self.servers:
            server.wait_serving(timeout)

    def leader(self, timeout: float = 30.0) -> ZooKeeperServer:
        """The member that says ``Mode: leader`` (waits for an election to end)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for server in self.servers:
                if server.process is not None and server.mode() == "leader":
                    return server
            time.sleep(0.1)
        raise RuntimeError(f"no ZooKeeper leader after {timeout}s")

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


class Gate:
    """A TCP forwarder to one server that a test can shut and open again on the same port.

    Shut, it closes every forwarded connection and every new one at once: a
    ZooKeeper client behind it is cut off (SUSPENDED) and cannot reconnect,
    while its session lives on in the server until the session timeout
    ends.  Opened again, the client reconnects to its session, or learns it
    expired (LOST)::

        with Gate(server.port) as gate:
            zk = KazooClient(hosts=gate.hosts, timeout=2.0)
            gate.shut(); ...; gate.open()
    """

    host = "127.0.0.1"

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server((self.host, 0))
        self.port: int = self._listener.getsockname()[1]
        self._is_open = True
        self._closed = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def hosts(self) -> str:
        return f"{self.host}:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if not self._is_open or self._closed:
                    client.close()
                    continue
                try:
                    server = socket.create_connection((self.host, self.target_port), timeout=5)
                except OSError:
                    client.close()
                    continue
                server.settimeout(None)
                self._sockets += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def shut(self) -> None:
        """Cut every connection now and refuse new ones until :meth:`open`."""
        with self._lock:
            self._is_open = False
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def open(self) -> None:
        """Forward new connections again."""
        with self._lock:
            self._is_open = True

    def close(self) -> None:
        self._closed = True
        self.shut()
        self._listener.close()

    def __enter__(self) -> Gate:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
