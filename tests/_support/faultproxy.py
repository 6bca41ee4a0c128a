"""A fault-injecting TCP proxy for tests: a command reaches the server, its reply never
reaches the client.

``FaultProxy(host, port)`` listens on 127.0.0.1 on a free port and forwards every
connection both ways, byte for byte (no protocol knowledge: Redis, PostgreSQL with
``sslmode=disable`` and MariaDB all work through it). Two faults can be injected:

* :meth:`FaultProxy.cut_after_next_request` arms a one-shot cut: the next client -> server
  chunk (optionally only one containing ``match``, e.g. ``b"COMMIT"`` or ``b"EVALSHA"``) is
  forwarded to the server; as soon as the server answers, the answer is dropped and both
  sockets of that connection are closed. The command ran on the server; the client never
  learns it (it sees a dropped connection, the "lost reply" fault class).
* :meth:`FaultProxy.cut_all` closes every live connection now.

::

    with FaultProxy("127.0.0.1", 6379) as proxy:
        client = redis.Redis(port=proxy.port, retry=None)
        proxy.cut_after_next_request(b"INCR")
        with pytest.raises(redis.ConnectionError):
            client.incr("n")  # ran on the server, the reply was dropped
        assert proxy.cuts == 1
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from sqlalchemy import URL, Engine, create_engine
from sqlalchemy.engine import make_url

__all__ = ["COMMIT", "FaultProxy", "commit_of", "proxied_engine", "through"]

#: What a COMMIT looks like on the wire, per server, for ``cut_after_next_request``: a plain
#: ``b"COMMIT"`` would also match MariaDB's ``SET AUTOCOMMIT = 0`` sent by every new PyMySQL
#: connection. PostgreSQL: a simple Query message, NUL-terminated; MariaDB: COM_QUERY (0x03).
COMMIT = {"postgresql": b"COMMIT\x00", "mariadb": b"\x03COMMIT"}

_CHUNK = 65536


class _Link:
    """One proxied connection: the client's socket and ours to the server."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        # Set when the request that must lose its reply has been forwarded: the next bytes
        # from the server are dropped and the link is closed.
        self.drop_reply = threading.Event()
        self.closed = False
        self.done = threading.Event()
        self.lock = threading.Lock()

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        self.done.set()
        for sock in (self.client, self.server):
            # shutdown wakes the pump thread blocked in recv() on this socket.
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class FaultProxy:
    """A threaded TCP proxy on 127.0.0.1 that can lose a reply on purpose.

    :param target_host: the server's host.
    :param target_port: the server's port.
    :param reply_timeout: seconds to wait for the server's answer to a cut request before
        closing the link anyway (then :attr:`cuts_without_reply` counts it).

    Attributes: :attr:`port` (the proxy's port), :attr:`host` (``"127.0.0.1"``),
    :attr:`cuts` (requests forwarded whose reply was dropped), :attr:`cuts_without_reply`
    (cut requests the server never answered within ``reply_timeout``), :attr:`cut_all_count`
    (links closed by :meth:`cut_all`), :attr:`connections` (links accepted so far).
    """

    host = "127.0.0.1"

    def __init__(self, target_host: str, target_port: int, *, reply_timeout: float = 10.0) -> None:
        self.target = (target_host, target_port)
        self.reply_timeout = reply_timeout
        self.cuts = 0
        self.cuts_without_reply = 0
        self.cut_all_count = 0
        self.connections = 0
        self._lock = threading.Lock()
        self._armed = False
        self._match: bytes | None = None
        self._cut_done = threading.Event()
        self._links: set[_Link] = set()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((self.host, 0))
        self._listener.listen(128)
        self.port: int = self._listener.getsockname()[1]
        self._stopped = False
        self._accepter = threading.Thread(target=self._accept_loop, name="faultproxy-accept", daemon=True)
        self._accepter.start()

    # -- public API -------------------------------------------------------------------

    @property
    def address(self) -> str:
        """``"127.0.0.1:<port>"``, for URLs."""
        return f"{self.host}:{self.port}"

    def cut_after_next_request(self, match: bytes | None = None) -> None:
        """Arm a one-shot cut: the next client -> server chunk (containing ``match`` if
        given) is forwarded, then the server's reply is dropped and the link closed.

        :param match: bytes the chunk must contain (``b"COMMIT"``, ``b"EVALSHA"``...);
            ``None`` cuts after whatever the next chunk is.
        """
        with self._lock:
            self._armed = True
            self._match = match
            self._cut_done.clear()

    def disarm(self) -> None:
        """Cancel an armed cut that has not happened yet."""
        with self._lock:
            self._armed = False
            self._match = None

    @property
    def armed(self) -> bool:
        """True while a cut is armed and has not been triggered."""
        with self._lock:
            return self._armed

    def wait_cut(self, timeout: float = 10.0) -> bool:
        """Wait until the armed cut has closed its link; True if it did within ``timeout``."""
        return self._cut_done.wait(timeout)

    def cut_all(self) -> int:
        """Close every live connection now; returns how many were closed."""
        with self._lock:
            links = list(self._links)
            self._links.clear()
        for link in links:
            link.close()
        with self._lock:
            self.cut_all_count += len(links)
        return len(links)

    def close(self) -> None:
        """Stop listening and close every live connection."""
        self._stopped = True
        # shutdown (not close alone) wakes the thread blocked in accept() on Linux.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._listener.close()
        self.cut_all()
        self._accepter.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the pumps -----------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(client, server)
            with self._lock:
                if self._stopped:
                    link.close()
                    return
                self._links.add(link)
                self.connections += 1
            threading.Thread(target=self._upstream, args=(link,), daemon=True).start()
            threading.Thread(target=self._downstream, args=(link,), daemon=True).start()

    def _claim_cut(self, chunk: bytes) -> bool:
        with self._lock:
            if not self._armed or (self._match is not None and self._match not in chunk):
                return False
            self._armed = False
            self._match = None
            return True

    def _upstream(self, link: _Link) -> None:
        """client -> server."""
        try:
            while True:
                chunk = link.client.recv(_CHUNK)
                if not chunk:
                    break
                if link.drop_reply.is_set():
                    # The link is about to be cut: nothing more reaches the server.
                    continue
                if self._claim_cut(chunk):
                    link.drop_reply.set()
                    link.server.sendall(chunk)
                    threading.Thread(target=self._reply_deadline, args=(link,), daemon=True).start()
                    continue
                link.server.sendall(chunk)
        except OSError:
            pass
        self._finish(link)

    def _downstream(self, link: _Link) -> None:
        """server -> client; drops the reply of a cut request and closes the link."""
        try:
            while True:
                chunk = link.server.recv(_CHUNK)
                if not chunk:
                    break
                if link.drop_reply.is_set():
                    # The server answered: the command ran. The client never sees it.
                    with self._lock:
                        self.cuts += 1
                    self._finish(link)
                    self._cut_done.set()
                    return
                link.client.sendall(chunk)
        except OSError:
            pass
        self._finish(link)

    def _reply_deadline(self, link: _Link) -> None:
        if not link.done.wait(self.reply_timeout):
            with self._lock:
                self.cuts_without_reply += 1
            self._finish(link)
            self._cut_done.set()

    def _finish(self, link: _Link) -> None:
        with self._lock:
            self._links.discard(link)
        link.close()


def through(url: str | URL, proxy: FaultProxy) -> URL:
    """``url`` with its host and port replaced by the proxy's (plain TCP for PostgreSQL: the proxy
    forwards bytes, a TLS handshake through it would work but hide the COMMIT)."""
    u = make_url(url).set(host=proxy.host, port=proxy.port)
    if u.get_backend_name() == "postgresql":
        u = u.update_query_dict({"sslmode": "disable"})
    return u


def commit_of(engine: Engine) -> bytes:
    """What a COMMIT of this engine looks like on the wire (:data:`COMMIT` of its server)."""
    return COMMIT["postgresql" if engine.dialect.name == "postgresql" else "mariadb"]


@contextlib.contextmanager
def proxied_engine(url: str, **engine_kw: Any) -> Iterator[tuple[Engine, FaultProxy]]:
    """A :class:`FaultProxy` in front of the database server of ``url`` and an engine reaching the
    server through it (``create_engine(..., **engine_kw)``, disposed at the end)::

        with proxied_engine(backend.url) as (engine, proxy):
            proxy.cut_after_next_request(commit_of(engine))
    """
    target = make_url(url)
    default = 5432 if target.get_backend_name() == "postgresql" else 3306
    with FaultProxy(target.host or "127.0.0.1", target.port or default) as proxy:
        engine = create_engine(through(target, proxy), **engine_kw)
        try:
            yield engine, proxy
        finally:
            engine.dispose()


@contextlib.contextmanager
def proxied_with_tables(backend: Any, *metadatas: Any) -> Iterator[tuple[Engine, FaultProxy]]:
    """stateguard's tables (made afresh) and ``metadatas``' on a test's ``backend``, and
    :func:`proxied_engine` to its server; stateguard's tables dropped at the end."""
    from stateguard import create_tables, drop_tables

    direct = backend.create(*metadatas)
    drop_tables(direct)
    create_tables(direct)
    try:
        with proxied_engine(backend.url) as made:
            yield made
    finally:
        drop_tables(direct)
