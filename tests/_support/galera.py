"""A private MariaDB Galera cluster for the tests: N nodes on localhost, private ports, stopped by pid.

Each node is a ``mariadbd`` of Debian's ``mariadb-server`` with the ``galera-4`` provider, its own
data directory (``mariadb-install-db``) and option file; the first node bootstraps the cluster
(``--wsrep-new-cluster``), the others join it by rsync SST.  Nothing is stopped by name: every
process is killed by the pid it was started with, and the directory removed afterwards.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .private_server import Started

PROVIDER = "/usr/lib/galera/libgalera_smm.so"
MARIADBD = "/usr/sbin/mariadbd"
INSTALL_DB = "/usr/bin/mariadb-install-db"
USER = "mysql"


def available() -> str | None:
    """Why a cluster cannot start here (``None``: it can)."""
    for path in (PROVIDER, MARIADBD, INSTALL_DB):
        if not os.path.exists(path):
            return f"{path} is missing (apt install mariadb-server galera-4 rsync)"
    if shutil.which("rsync") is None:
        return "rsync is missing (apt install rsync)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Node:
    """One Galera node: its ports, directory and process."""

    index: int
    port: int
    gcomm_port: int
    ist_port: int
    sst_port: int
    root: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def datadir(self) -> Path:
        return self.root / "data"

    @property
    def socket(self) -> Path:
        return self.root / "mysqld.sock"

    @property
    def url(self) -> str:
        return f"mysql+pymysql://root@127.0.0.1:{self.port}/test"

    @property
    def log(self) -> Path:
        return self.root / "error.log"


@dataclass
class GaleraCluster(Started):
    """``with GaleraCluster(3) as cluster:`` starts the nodes; ``cluster.urls`` for engines."""

    size: int = 3
    startup_timeout: float = 90.0
    nodes: list[Node] = field(default_factory=list)
    base: Path | None = None

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def _address(self, *, bootstrap: bool = False) -> str:
        if bootstrap:
            return "gcomm://"
        return "gcomm://" + ",".join(f"127.0.0.1:{n.gcomm_port}" for n in self.nodes)

    def start(self) -> None:
        why = available()
        if why is not None:
            raise RuntimeError(why)
        self.base = Path(tempfile.mkdtemp(prefix="sg-galera-"))
        # The nodes run as the mysql user: the joiner's rsync daemon, started by a root mariadbd,
        # would switch to nobody and be refused the data directory.
        self.base.chmod(0o755)
        for i in range(self.size):
            root = self.base / f"node{i}"
            root.mkdir()
            node = Node(i, _free_port(), _free_port(), _free_port(), _free_port(), root)
            self.nodes.append(node)
        try:
            for node in self.nodes:
                self._install(node)
                self._own(node)
            self._launch(self.nodes[0], bootstrap=True)
            self._wait_ready(self.nodes[0], size=1)
            with self._connect(self.nodes[0]) as conn:
                cur = conn.cursor()
                cur.execute("CREATE DATABASE IF NOT EXISTS test")
            for node in self.nodes[1:]:
                self._launch(node)
                self._wait_ready(node, size=node.index + 1)
        except BaseException:
            self.stop()
            raise

    def _install(self, node: Node) -> None:
        node.datadir.mkdir()
        subprocess.run(
            [
                INSTALL_DB,
                "--no-defaults",
                f"--datadir={node.datadir}",
                f"--user={USER}",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        (node.root / "my.cnf").write_text(
            "\n".join(
                [
                    "[mysqld]",
                    f"datadir={node.datadir}",
                    f"socket={node.socket}",
                    f"port={node.port}",
                    "bind-address=127.0.0.1",
                    f"pid-file={node.root / 'mysqld.pid'}",
                    f"log-error={node.log}",
                    f"user={USER}",
                    "skip-name-resolve",
                    "binlog_format=ROW",
                    "default_storage_engine=InnoDB",
                    "innodb_autoinc_lock_mode=2",
                    "innodb_buffer_pool_size=64M",
                    "innodb_log_file_size=16M",
                    "innodb_flush_log_at_trx_commit=2",
                    "performance_schema=OFF",
                    "max_connections=300",
                    "wsrep_on=ON",
                    f"wsrep_provider={PROVIDER}",
                    "wsrep_cluster_name=stateguard_tests",
                    f"wsrep_node_name=node{node.index}",
                    "wsrep_node_address=127.0.0.1",
                    "wsrep_sst_method=rsync",
                    f"wsrep_sst_receive_address=127.0.0.1:{node.sst_port}",
                    "wsrep_provider_options="
                    f"'base_port={node.gcomm_port};ist.recv_addr=127.0.0.1:{node.ist_port};"
                    "gcache.size=32M;evs.suspect_timeout=PT3S;evs.inactive_timeout=PT6S;"
                    "evs.install_timeout=PT5S'",
                    "",
                ]
            )
        )

    def _own(self, node: Node) -> None:
        subprocess.run(["chown", "-R", f"{USER}:{USER}", str(node.root)], check=True, timeout=60)

    def _launch(self, node: Node, *, bootstrap: bool = False) -> None:
        args = [
            MARIADBD,
            f"--defaults-file={node.root / 'my.cnf'}",
            f"--wsrep-cluster-address={self._address(bootstrap=bootstrap)}",
        ]
        if bootstrap:
            args.append("--wsrep-new-cluster")
        out = open(node.root / "stdout.log", "ab")  # noqa: SIM115 - handed to the process
        node.process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()

    def _connect(self, node: Node, timeout: float = 5.0):  # type: ignore[no-untyped-def]
        import pymysql

        return contextlib.closing(
            pymysql.connect(
                host="127.0.0.1", port=node.port, user="root", connect_timeout=timeout, autocommit=True
            )
        )

    def status(self, node: Node) -> dict[str, str]:
        """The node's ``wsrep_%`` status variables."""
        with self._connect(node) as conn:
            cur = conn.cursor()
            cur.execute("SHOW STATUS LIKE 'wsrep_%'")
            return {k: v for k, v in cur.fetchall()}

    def _wait_ready(self, node: Node, *, size: int | None = None) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last: object = None
        while time.monotonic() < deadline:
            if node.process is not None and node.process.poll() is not None:
                raise RuntimeError(f"galera node{node.index} exited: {self._tail(node)}")
            try:
                st = self.status(node)
            except Exception as exc:  # not up yet
                last = exc
            else:
                last = st.get("wsrep_local_state_comment"), st.get("wsrep_cluster_size")
                if (
                    st.get("wsrep_ready") == "ON"
                    and st.get("wsrep_local_state_comment") == "Synced"
                    and (size is None or int(st.get("wsrep_cluster_size", "0")) >= size)
                ):
                    return
            time.sleep(0.3)
        raise RuntimeError(
            f"galera node{node.index} not ready after {self.startup_timeout}s ({last}): {self._tail(node)}"
        )

    def _tail(self, node: Node) -> str:
        with contextlib.suppress(OSError):
            return node.log.read_text(errors="replace")[-1500:]
        return "(no log)"

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Kill node ``index`` by its pid (SIGKILL: a crash; SIGSTOP: a frozen node)."""
        node = self.nodes[index]
        if node.process is not None and node.process.poll() is None:
            os.kill(node.process.pid, sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                node.process.wait(timeout=60)

    def restart(self, index: int) -> None:
        """Start node ``index`` again after :meth:`kill`: it rejoins the cluster (IST or SST)."""
        node = self.nodes[index]
        self.kill(index)
        self._launch(node)
        self._wait_ready(node, size=self.size)

    def heal(self) -> None:
        """Every node running and synced: a frozen one resumed, a dead one started again (it rejoins).

        The cluster outlives a module (tests/clusters/conftest.py), so a test that failed between
        :meth:`kill` and :meth:`restart` must not leave the next one a node short.
        """
        for node in self.nodes:
            proc = node.process
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)  # harmless on a running node
            else:
                self._launch(node)
        for node in self.nodes:
            self._wait_ready(node, size=self.size)

    def stop(self) -> None:
        for node in reversed(self.nodes):
            proc = node.process
            if proc is None or proc.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
                os.kill(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        if self.base is not None:
            shutil.rmtree(self.base, ignore_errors=True)
            self.base = None
