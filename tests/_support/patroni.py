"""A Patroni pair on a private ZooKeeper for the tests: two PostgreSQL 15 nodes, each run by its Patroni.

Patroni (PyPI ``patroni[zookeeper,psycopg3]``) must run as the ``postgres`` OS user, like the server
it starts, so it lives in a venv made with Debian's /usr/bin/python3 at a path that user can read
(:data:`VENV`, made by ``.ci/run``).  The DCS is one standalone :class:`ZooKeeperServer` started
here; every port (ZooKeeper, each PostgreSQL, each Patroni REST API) is a free one on 127.0.0.1,
every directory is under one temporary directory, removed at the end.

Timings are Patroni's smallest: ``ttl`` 20 s (Patroni raises anything lower to 20), ``loop_wait``
1 s, ``retry_timeout`` 3 s.  Patroni asks ZooKeeper for a session of ``ttl`` seconds; the private
server caps sessions at :data:`SESSION_MS`, so the leader's ephemeral key, and with it the
leadership, ends that long after its Patroni stops answering: that bounds how fast a failover
starts.  There is no watchdog (``watchdog.mode: off``): no /dev/watchdog exists in this
container, so nothing stops a primary whose Patroni died.

Processes are stopped by pid: each Patroni runs in a session of its own (its pid is its process
group), and Patroni starts its postmaster in a session of its own (``setsid()``), so the process
group of the postmaster's pid (read from ``postmaster.pid``) holds every backend and nothing else.
:meth:`PatroniPair.kill_node` ends both like a crashed machine; :meth:`PatroniPair.kill_patroni`
ends only Patroni and leaves a writable primary behind.  :meth:`PatroniPair.repair` remakes a dead
or deposed node as a fresh replica (its data directory removed, Patroni started again: it clones
the leader with pg_basebackup), which is faster here than a rewind or a ``reinit`` of a diverged
timeline.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import pg_cluster
from .pg_cluster import BIN, DATABASE, USER, PgNode, as_postgres, own
from .private_server import Started
from .redis_server import free_port
from .zookeeper_server import ZooKeeperServer, zookeeper_available

__all__ = ["SESSION_MS", "VENV", "PatroniNode", "PatroniPair", "available"]

#: The venv with Patroni, readable by the postgres user (``STATEGUARD_PATRONI_VENV`` overrides it).
VENV = Path(os.environ.get("STATEGUARD_PATRONI_VENV", "/opt/stateguard-patroni"))
PATRONI = VENV / "bin" / "patroni"
#: The longest ZooKeeper session the private server grants: a dead leader's key lasts this long.
SESSION_MS = 5000
SCOPE = "sg-pair"
NAMESPACE = "/sg-patroni/"
TTL, LOOP_WAIT, RETRY_TIMEOUT = 20, 1, 3

#: pg_cluster's server settings, less the ones Patroni sets itself (listen address, port, socket).
PARAMETERS = {
    k: v for k, v in pg_cluster.SETTINGS.items() if k not in ("listen_addresses", "unix_socket_directories")
} | {"max_replication_slots": "4", "max_wal_senders": "4"}

HBA = [
    "local all all trust",
    "host all all 127.0.0.1/32 trust",
    "host replication all 127.0.0.1/32 trust",
]


def available() -> str | None:
    """Why a Patroni pair cannot start here (``None``: it can)."""
    why = pg_cluster.available()
    if why is not None:
        return why
    if not zookeeper_available():
        return "java or the ZooKeeper server jar is missing (apt install zookeeperd)"
    if not PATRONI.exists():
        return (
            f"{PATRONI} is missing: make the venv as .ci/run does (/usr/bin/python3 -m venv {VENV} && "
            f"{VENV}/bin/pip install 'patroni[zookeeper,psycopg3]' 'psycopg[binary]')"
        )
    try:
        done = subprocess.run([str(PATRONI), "--version"], capture_output=True, timeout=60, **as_postgres())
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{PATRONI} cannot run as {USER}: {exc}"
    if done.returncode != 0:
        return f"{PATRONI} --version failed as {USER}: {done.stderr.decode(errors='replace')[-500:]}"
    return None


def _alive(pid: int | None) -> bool:
    """Whether process ``pid`` exists and is not a zombie waiting to be reaped."""
    if pid is None:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _killpg(pid: int | None) -> None:
    """SIGKILL the process group of ``pid`` (a session Patroni or we started), if it is there.

    Patroni's postmaster runs in the session of a short-lived launcher that called ``setsid()``:
    its process group is that launcher's pid, shared with every backend and nothing else.
    """
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        group = os.getpgid(pid)
        if group == os.getpgrp():  # never our own group
            os.kill(pid, signal.SIGKILL)
        else:
            os.killpg(group, signal.SIGKILL)


@dataclass
class PatroniNode(PgNode):
    """One member: its PostgreSQL (port, data directory) and the Patroni process that runs it."""

    rest_port: int = 0
    patroni: subprocess.Popen[bytes] | None = None

    @property
    def config(self) -> Path:
        return self.root / "patroni.yml"

    @property
    def patroni_log(self) -> Path:
        return self.root / "patroni.log"

    @property
    def postmaster_pid(self) -> int | None:
        """The postmaster Patroni started (first line of ``postmaster.pid``), when it runs."""
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int((self.datadir / "postmaster.pid").read_text().splitlines()[0])
            # A stale file's pid may since belong to another process: only ours runs on this datadir.
            if _alive(pid) and str(self.datadir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        return None

    @property
    def running(self) -> bool:
        """Whether this node's postmaster runs (whatever its Patroni is doing)."""
        return self.postmaster_pid is not None

    @property
    def patroni_running(self) -> bool:
        return self.patroni is not None and self.patroni.poll() is None

    def rest(self, path: str, method: str = "GET", body: Any = None, timeout: float = 2.0) -> tuple[int, Any]:
        """Call this node's Patroni REST API: (HTTP status, decoded JSON or text); (0, error) when down."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.rest_port}{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                status, raw = answer.status, answer.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        except OSError as exc:
            return 0, str(exc)
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def writable(self) -> bool:
        """Whether this node's PostgreSQL answers and is not in recovery (a primary)."""
        try:
            with self.connect(timeout=1, dbname="postgres") as conn:
                row = conn.execute("SELECT NOT pg_is_in_recovery()").fetchone()
                return row is not None and row[0] is True
        except Exception:  # down, starting, or shutting down
            return False

    def tail(self) -> str:
        parts = []
        for log in (self.patroni_log,):
            with contextlib.suppress(OSError):
                parts.append(f"--- {log.name}:\n" + log.read_text(errors="replace")[-2500:])
        return "\n".join(parts) or "(no log)"


class PatroniPair(Started):
    """``with PatroniPair() as pair:`` two Patroni-run PostgreSQL nodes on a private ZooKeeper.

    :attr:`primary` and :attr:`standby` are the nodes as the tests last saw them (re-read with
    :meth:`refresh`); a node that was killed or deposed is remade by :meth:`repair`.
    """

    def __init__(self, startup_timeout: float = 90.0) -> None:
        self.startup_timeout = startup_timeout
        self.base: Path | None = None
        self.zookeeper: ZooKeeperServer | None = None
        self.nodes: list[PatroniNode] = []
        self.primary: PatroniNode | None = None
        self.standby: PatroniNode | None = None
        self.synchronous = False

    # -- set-up ------------------------------------------------------------------------------

    def start(self) -> None:
        why = available()
        if why is not None:
            raise RuntimeError(why)
        self.base = Path(tempfile.mkdtemp(prefix="sg-patroni-"))
        self.base.chmod(0o755)
        try:
            self.zookeeper = ZooKeeperServer(max_session_ms=SESSION_MS)
            self.zookeeper.start()
            for i in (1, 2):
                root = self.base / f"node{i}"
                root.mkdir()
                own(root)
                node = PatroniNode(f"node{i}", free_port(), root, rest_port=free_port())
                self._write_config(node)
                self.nodes.append(node)
            first, second = self.nodes
            self._launch(first)  # it bootstraps (initdb) and becomes the leader
            self._wait(lambda: first.writable(), "node1 to bootstrap as the leader", first)
            with first.connect(dbname="postgres") as conn:
                conn.execute(f"CREATE DATABASE {DATABASE}")
            self._launch(second)  # it clones the leader
            self.primary, self.standby = first, second
            self.wait_streaming()
        except BaseException:
            self.stop()
            raise

    def _write_config(self, node: PatroniNode) -> None:
        assert self.zookeeper is not None
        config = {
            "scope": SCOPE,
            "namespace": NAMESPACE,
            "name": node.name,
            "log": {"level": "INFO", "format": "%(asctime)s %(levelname)s: %(message)s"},
            "restapi": {
                "listen": f"127.0.0.1:{node.rest_port}",
                "connect_address": f"127.0.0.1:{node.rest_port}",
            },
            "zookeeper": {"hosts": [self.zookeeper.hosts]},
            "bootstrap": {
                "dcs": {
                    "ttl": TTL,
                    "loop_wait": LOOP_WAIT,
                    "retry_timeout": RETRY_TIMEOUT,
                    "maximum_lag_on_failover": 16 * 1024 * 1024,
                    "synchronous_mode": False,
                    "postgresql": {"use_pg_rewind": False, "use_slots": True, "parameters": PARAMETERS},
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}, "no-sync"],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{node.port}",
                "connect_address": f"127.0.0.1:{node.port}",
                "data_dir": str(node.datadir),
                "bin_dir": str(BIN),
                "pgpass": str(node.root / "pgpass"),
                "authentication": {"superuser": {"username": USER}, "replication": {"username": USER}},
                "parameters": {"unix_socket_directories": str(node.root)},
                "pg_hba": HBA,
                "basebackup": [{"checkpoint": "fast"}],
            },
            "watchdog": {"mode": "off"},
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False, "nosync": False},
        }
        node.config.write_text(json.dumps(config, indent=1))  # JSON is YAML
        own(node.config)

    def _launch(self, node: PatroniNode) -> None:
        out = open(node.patroni_log, "ab")  # noqa: SIM115 - handed to the process
        own(node.patroni_log)
        env = {"PATH": f"{VENV / 'bin'}:/usr/bin:/bin", "HOME": str(node.root), "LC_ALL": "C.UTF-8"}
        # A session of its own: Patroni's pid is its process group (the postmaster has its own).
        node.patroni = subprocess.Popen(
            [str(PATRONI), str(node.config)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=node.root,
            env=env,
            start_new_session=True,
            **as_postgres(),
        )
        out.close()

    def _wait(
        self, check: Any, what: str, node: PatroniNode | None = None, timeout: float | None = None
    ) -> float:
        """Poll ``check()`` until true; the seconds it took.  RuntimeError with the logs on time-out."""
        started = time.monotonic()
        deadline = started + (timeout or self.startup_timeout)
        while time.monotonic() < deadline:
            if check():
                return time.monotonic() - started
            if node is not None and node.patroni is not None and node.patroni.poll() is not None:
                raise RuntimeError(f"Patroni {node.name} exited while waiting for {what}:\n{node.tail()}")
            time.sleep(0.05)
        logs = "\n".join(n.tail() for n in self.nodes)
        raise RuntimeError(f"no {what} after {timeout or self.startup_timeout}s:\n{logs}")

    # -- state ------------------------------------------------------------------------------------

    def other(self, node: PatroniNode) -> PatroniNode:
        return self.nodes[1] if node is self.nodes[0] else self.nodes[0]

    def leader(self) -> PatroniNode | None:
        """The node the DCS names leader (asked of any answering Patroni), or ``None``."""
        for node in self.nodes:
            status, cluster = node.rest("/cluster")
            if status == 200 and isinstance(cluster, dict):
                for member in cluster.get("members", []):
                    if member.get("role") in ("leader", "primary", "master"):
                        return next((n for n in self.nodes if n.name == member.get("name")), None)
        return None

    def replication(self, node: PatroniNode) -> tuple[str | None, str | None]:
        """(state, sync_state) of the primary ``node``'s walsender to the other node."""
        try:
            with node.connect() as conn:
                row = conn.execute(
                    "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = %s",
                    (self.other(node).name,),
                ).fetchone()
        except Exception:
            return None, None
        return (None, None) if row is None else (row[0], row[1])

    def _member_role(self, name: str) -> str | None:
        assert self.primary is not None
        status, cluster = self.primary.rest("/cluster")
        if status != 200 or not isinstance(cluster, dict):
            return None
        return next((m.get("role") for m in cluster.get("members", []) if m.get("name") == name), None)

    def wait_streaming(self, timeout: float | None = None) -> None:
        """Wait until the primary streams to the standby, as ``synchronous`` wants (and the DCS agrees)."""
        assert self.primary is not None and self.standby is not None
        primary, standby = self.primary, self.standby
        want = "sync" if self.synchronous else "async"
        role = "sync_standby" if self.synchronous else "replica"

        def streaming() -> bool:
            return (
                self.replication(primary) == ("streaming", want) and self._member_role(standby.name) == role
            )

        self._wait(streaming, f"{standby.name} streaming ({want}) from {primary.name}", standby, timeout)

    def wait_replayed(self, timeout: float = 30.0) -> None:
        """Wait until the standby has replayed everything the primary has written so far."""
        assert self.primary is not None and self.standby is not None
        standby = self.standby
        target = self.primary.scalar("SELECT pg_current_wal_lsn()::text")

        def replayed() -> bool:
            return standby.scalar("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", target) is True

        self._wait(replayed, f"{standby.name} replaying up to {target}", standby, timeout)

    @property
    def healthy(self) -> bool:
        """Both Patronis and postmasters run, and the primary streams to the standby as configured."""
        if self.primary is None or self.standby is None:
            return False
        if not all(n.patroni_running and n.running for n in self.nodes):
            return False
        want = "sync" if self.synchronous else "async"
        return self.leader() is self.primary and self.replication(self.primary) == ("streaming", want)

    # -- the knobs the tests turn ---------------------------------------------------------------

    def set_synchronous(self, on: bool) -> None:
        """Patroni's ``synchronous_mode`` on or off (``PATCH /config``); wait until the standby is so."""
        assert self.primary is not None
        if on != self.synchronous:
            status, answer = self.primary.rest("/config", "PATCH", {"synchronous_mode": on}, timeout=10)
            if status != 200:
                raise RuntimeError(f"PATCH /config synchronous_mode={on}: {status} {answer}")
            self.synchronous = on
        self.wait_streaming()

    def kill_node(self) -> float:
        """Crash the primary's machine: SIGKILL its Patroni and its postmaster's process group.

        Returns the ``time.monotonic()`` of the kill.
        """
        assert self.primary is not None
        node = self.primary
        postmaster = node.postmaster_pid
        killed = time.monotonic()
        _killpg(node.patroni.pid if node.patroni is not None else None)
        _killpg(postmaster)
        if node.patroni is not None:
            node.patroni.wait(timeout=30)
        self._wait(lambda: not node.running, f"{node.name}'s postmaster to die", timeout=30)
        return killed

    def kill_patroni(self) -> float:
        """SIGKILL only the primary's Patroni: its PostgreSQL goes on as a writable primary."""
        assert self.primary is not None and self.primary.patroni is not None
        killed = time.monotonic()
        _killpg(self.primary.patroni.pid)
        self.primary.patroni.wait(timeout=30)
        return killed

    def restart_patroni(self, node: PatroniNode) -> None:
        """Start ``node``'s Patroni again (after :meth:`kill_patroni`), as a service manager would."""
        assert not node.patroni_running, f"Patroni {node.name} is running"
        self._launch(node)

    def wait_demoted(self, node: PatroniNode, timeout: float = 60.0) -> float:
        """Seconds until ``node``'s PostgreSQL no longer takes writes (stopped or in recovery)."""
        return self._wait(lambda: not node.writable(), f"{node.name} to stop taking writes", timeout=timeout)

    def wait_promoted(self, timeout: float = 60.0) -> PatroniNode:
        """Wait until the standby is a writable primary; it becomes :attr:`primary` (the old one is dead)."""
        assert self.standby is not None
        new = self.standby
        self._wait(new.writable, f"{new.name} to be promoted", new, timeout)
        self.primary, self.standby = new, self.other(new)
        return new

    def repair(self) -> None:
        """Make the pair whole: every node that is not the running leader becomes a fresh replica."""
        leader = self.leader()
        if leader is None or not leader.running:
            # No leader at all (both killed?): the survivor, if any, is promoted by its Patroni.
            alive = [n for n in self.nodes if n.patroni_running and n.running]
            if not alive:
                raise RuntimeError("no Patroni node is left to repair the pair from")

            def led() -> bool:
                found = self.leader()
                return found in alive and found is not None and found.writable()

            self._wait(led, "a leader")
            leader = self.leader()
        assert leader is not None
        self.primary, self.standby = leader, self.other(leader)
        follower = self.standby
        if not (follower.patroni_running and follower.running and self.replication(leader)[0] == "streaming"):
            self.remake(follower)
        self.wait_streaming()

    def remake(self, node: PatroniNode) -> None:
        """Stop ``node`` (Patroni and postmaster, by pid), remove its data, start it as a new replica."""
        self._stop_node(node, remove=False)
        shutil.rmtree(node.datadir, ignore_errors=True)
        self._launch(node)

    # -- tear-down ----------------------------------------------------------------------------

    def _stop_node(self, node: PatroniNode, *, remove: bool) -> None:
        shm = pg_cluster.postmaster_segment(node.datadir)
        postmaster = node.postmaster_pid
        _killpg(node.patroni.pid if node.patroni is not None else None)
        if node.patroni is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.patroni.wait(timeout=30)
        _killpg(postmaster)
        deadline = time.monotonic() + 30
        while _alive(postmaster) and time.monotonic() < deadline:
            time.sleep(0.02)
        pg_cluster.release_segment(shm, postmaster)
        if remove:
            shutil.rmtree(node.root, ignore_errors=True)

    def stop(self) -> None:
        for node in self.nodes:
            self._stop_node(node, remove=True)
        self.nodes.clear()
        self.primary = self.standby = None
        if self.zookeeper is not None:
            self.zookeeper.stop()
            self.zookeeper = None
        if self.base is not None:
            shutil.rmtree(self.base, ignore_errors=True)
            self.base = None
