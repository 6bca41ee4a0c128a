"""A Redis server that a test starts, restarts and stops itself, on a private port.

The shared test Redis (``REDIS_URL``) must never be restarted by a test; a test
that needs a Redis to lose everything starts its own::

    with RedisServer() as server:                 # redis-server --port P --save "" ...
        client = redis.Redis(port=server.port)
        ...
        server.restart()                          # SIGKILL, then start again on P: no data survives

No persistence (``--save ""``, ``--appendonly no``, a private ``--dir``), so a
restart is a Redis that crashed and came back empty.  The process is stopped
by its pid, never by name.  :class:`LocalCluster` starts a Redis Cluster of
such servers (3 masters + 3 replicas by default) and can kill a master and
wait for its replica to take over.  :func:`redis_server_binary` finds ``redis-server``
or skips the test loudly (fails under ``CI=true``, like every missing server).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from typing import Any

from .private_server import PrivateServer, Started, free_port, installed_or_skip, stop_by_pid

__all__ = ["LocalCluster", "RedisServer", "free_port", "redis_server_binary", "stop_by_pid"]


def redis_server_binary() -> str:
    """The path of ``redis-server``; skip the test loudly (fail in CI) when it is not installed."""
    return installed_or_skip(
        shutil.which("redis-server"),
        "redis-server is not installed (Debian package redis-server)",
        needed_by="the private-Redis tests",
    )


class RedisServer(PrivateServer):
    """One ``redis-server`` process on 127.0.0.1:``port`` without persistence.

    :param port: the port (a free one when ``None``); it stays the same across restarts.
    :param args: more ``redis-server`` arguments (``["--cluster-enabled", "yes"]`` ...).
    :param directory: the server's ``--dir`` (a temporary directory removed by :meth:`stop`
        when ``None``).
    """

    name = "redis-server"
    #: Nothing is saved either way.
    stop_signal = signal.SIGTERM

    def __init__(
        self, port: int | None = None, *, args: Sequence[str] = (), directory: str | None = None
    ) -> None:
        self.binary = redis_server_binary()
        super().__init__(port or free_port(cluster="--cluster-enabled" in args), directory=directory)
        self.args = list(args)
        self.restarts = 0

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://{self.host}:{self.port}/0"

    def command(self) -> list[str]:
        return [
            self.binary,
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "no",
            "--dir", self.directory,
            "--daemonize", "no",
            *self.args,
        ]  # fmt: skip

    def serving(self) -> bool:
        return self.ping()

    def start(self, timeout: float = 20.0) -> None:
        """Start the server and wait until it answers PING."""
        super().start(timeout)

    def ping(self) -> bool:
        """Whether the server answers ``PING`` with ``+PONG`` right now (raw socket, no client)."""
        try:
            with socket.create_connection((self.host, self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def pause(self) -> None:
        """SIGSTOP the process by its pid: a server that stalls (a replica falling behind its master)."""
        if self.process is not None:
            self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the process by its pid after :meth:`pause`."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Crash the server (SIGKILL) and start it again on the same port, empty."""
        super().restart()
        self.restarts += 1


def redis_cli_binary() -> str:
    """The path of ``redis-cli``; skip loudly (fail in CI) when it is not installed."""
    return installed_or_skip(
        shutil.which("redis-cli"),
        "redis-cli is not installed (Debian package redis-tools)",
        needed_by="the Redis Cluster tests",
    )


class LocalCluster(Started):
    """A Redis Cluster on 127.0.0.1: ``masters`` masters with ``replicas`` replicas each, on private ports.

    ::

        with LocalCluster() as cluster:                     # 3 masters + 3 replicas
            client = redis.cluster.RedisCluster(port=cluster.port)
            victim = cluster.master_of(b"some-key")
            cluster.kill(victim)                             # SIGKILL by pid
            promoted = cluster.wait_for_failover(victim)     # its replica, now a master

    ``--cluster-node-timeout`` is ``node_timeout_ms`` (short, so a failover takes a few seconds).
    """

    def __init__(self, masters: int = 3, replicas: int = 1, *, node_timeout_ms: int = 2000) -> None:
        self.masters = masters
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.servers: list[RedisServer] = []

    @property
    def port(self) -> int:
        """The port of a live node (a startup node for clients)."""
        return self.live()[0].port

    def live(self) -> list[RedisServer]:
        """The nodes whose process runs."""
        return [s for s in self.servers if s.process is not None]

    def start(self) -> None:
        """Start every node, join them (``redis-cli --cluster create``), wait until the cluster is ok."""
        cli = redis_cli_binary()
        for _ in range(self.masters * (1 + self.replicas)):
            server = RedisServer(
                args=[
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(self.node_timeout_ms),
                    "--repl-diskless-sync-delay", "0",  # a replica syncs at once (default: after 5 s)
                ]
            )  # fmt: skip
            self.servers.append(server)  # stopped (and its directory removed) even if it fails to start
            server.start()
        subprocess.run(
            [
                cli, "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in self.servers),
                "--cluster-replicas", str(self.replicas), "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )  # fmt: skip
        self.wait_until_ok(expect_replicas=True)

    def _client(self, server: RedisServer) -> Any:
        import redis

        return redis.Redis(host=server.host, port=server.port, socket_timeout=2, decode_responses=True)

    def nodes(self) -> list[dict[str, Any]]:
        """``CLUSTER NODES`` as seen by a live node: port, id, flags, master id, slots, of each node."""
        for server in self.live():
            found = self.nodes_seen_by(server)
            if found is not None:
                return found
        raise RuntimeError("no cluster node answers CLUSTER NODES")

    def nodes_seen_by(self, server: RedisServer) -> list[dict[str, Any]] | None:
        """``CLUSTER NODES`` of ``server`` (``None`` if it does not answer)."""
        client = self._client(server)
        try:
            text = client.execute_command("CLUSTER", "NODES")
        except Exception:
            return None
        finally:
            client.close()
        if isinstance(text, dict):  # some redis-py versions parse the reply
            raise RuntimeError("CLUSTER NODES came back parsed; expected its text")
        found = []
        for line in str(text).splitlines():
            fields = line.split()
            found.append(
                {
                    "id": fields[0],
                    "port": int(fields[1].split("@")[0].rsplit(":", 1)[1]),
                    "flags": set(fields[2].split(",")),
                    "master": fields[3],
                    "slots": fields[8:],
                }
            )
        return found

    def server(self, port: int) -> RedisServer:
        return next(s for s in self.servers if s.port == port)

    def master_of(self, key: str | bytes) -> RedisServer:
        """The master that serves ``key``'s slot now."""
        from redis.crc import key_slot

        slot = key_slot(key.encode() if isinstance(key, str) else key)
        for node in self.nodes():
            if "master" not in node["flags"] or "fail" in node["flags"]:
                continue
            for span in node["slots"]:
                if span.startswith("["):  # a slot being migrated
                    continue
                low, _, high = span.partition("-")
                if int(low) <= slot <= int(high or low):
                    return self.server(node["port"])
        raise RuntimeError(f"no live master serves slot {slot}")

    def replica_of(self, master: RedisServer) -> RedisServer:
        """A replica of ``master``."""
        nodes = self.nodes()
        master_id = next(n["id"] for n in nodes if n["port"] == master.port)
        return self.server(next(n["port"] for n in nodes if n["master"] == master_id))

    def kill(self, server: RedisServer) -> None:
        """SIGKILL the node by its pid (a crash: what it had not sent to its replica is gone)."""
        server.kill(signal.SIGKILL)

    def wait_for_failover(self, killed: RedisServer, timeout: float = 30.0) -> RedisServer:
        """Wait until a replica of ``killed`` serves slots as a master and every live node is ok."""
        killed_id = next(n["id"] for n in self.nodes() if n["port"] == killed.port)
        replicas = self._former_replicas(killed_id)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            promoted = [
                n["port"] for n in self.nodes()
                if n["port"] in replicas and "master" in n["flags"]
                and "fail" not in n["flags"] and n["slots"]
            ]  # fmt: skip
            if promoted and self._all_ok():
                return self.server(promoted[0])
            time.sleep(0.1)
        raise RuntimeError(f"no replica of port {killed.port} was promoted within {timeout}s: {self.nodes()}")

    def _former_replicas(self, master_id: str) -> set[int]:
        return self._replicas_by_master.get(master_id, set())

    def remember_replicas(self) -> None:
        """Note which node replicates which master (before a kill: a promoted replica forgets its master)."""
        self._replicas_by_master: dict[str, set[int]] = {}
        for node in self.nodes():
            if node["master"] != "-":
                self._replicas_by_master.setdefault(node["master"], set()).add(node["port"])

    def _all_ok(self) -> bool:
        for server in self.live():
            client = self._client(server)
            try:
                if "cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                    return False
            except Exception:
                return False
            finally:
                client.close()
        return True

    def wait_until_ok(self, *, expect_replicas: bool = False, timeout: float = 40.0) -> None:
        """Wait until every live node says cluster_state:ok (and, if asked, each master has a replica)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._all_ok() and (not expect_replicas or self._replicas_synced()):
                self.remember_replicas()
                return
            time.sleep(0.1)
        raise RuntimeError(f"the test cluster did not reach cluster_state:ok in {timeout}s: {self.nodes()}")

    def _replicas_synced(self) -> bool:
        # Every live node must already see every node, none failing, each replica with its master.
        bad = {"fail", "fail?", "handshake", "noaddr"}
        for server in self.live():
            seen = self.nodes_seen_by(server)
            if seen is None or len(seen) != len(self.live()) or any(n["flags"] & bad for n in seen):
                return False
            if sum(1 for n in seen if n["master"] != "-") != self.masters * self.replicas:
                return False
        masters = [n for n in self.nodes() if "master" in n["flags"] and n["slots"]]
        if len(masters) < self.masters:
            return False
        for node in masters:
            client = self._client(self.server(node["port"]))
            try:
                info = client.info("replication")
            except Exception:
                return False
            finally:
                client.close()
            online = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
            if sum(1 for v in online if v.get("state") == "online") < self.replicas:
                return False
        return True

    def revive(self, server: RedisServer) -> None:
        """Start a killed node again (its nodes.conf survives: it rejoins, as a replica of its successor)."""
        server.start()
        server.restarts += 1
        self.wait_until_ok(expect_replicas=True)

    def stop(self) -> None:
        """Stop every node by its pid and remove their directories."""
        for server in self.servers:
            server.stop()
