"""A private PostgreSQL 15 primary with one streaming standby for the tests, stopped by pid.

The primary is made by ``initdb`` and the standby by ``pg_basebackup -R -X stream`` from it; both
run ``postgres`` from /usr/lib/postgresql/15/bin as the ``postgres`` OS user (the server refuses to
run as root) on free ports of 127.0.0.1, in directories under one temporary directory.  ``fsync``
stays on: the durability the tests measure is the servers', not the page cache's.  The standby is
synchronous or asynchronous at will (:meth:`PgReplicaPair.set_synchronous`), can be stopped,
started again and promoted; the primary is killed like a crashed machine (SIGKILL to its process
group, so no backend outlives the postmaster).  After a failover :meth:`PgReplicaPair.repair` makes
a new standby of the new primary.  Nothing is stopped by name, and the machine's own PostgreSQL on
port 5432 is never touched.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .private_server import Started

BIN = Path("/usr/lib/postgresql/15/bin")
USER = "postgres"
DATABASE = "test"
STANDBY_NAME = "standby"

#: Settings of both servers: small and fast to start, durable (fsync and full_page_writes on).
SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "unix_socket_directories": "",
    "shared_buffers": "16MB",
    "max_connections": "60",
    "wal_level": "replica",
    "max_wal_senders": "3",
    "max_replication_slots": "2",
    "wal_keep_size": "64MB",
    "hot_standby": "on",
    "fsync": "on",
    "synchronous_commit": "on",
    "wal_receiver_status_interval": "1s",
    "logging_collector": "off",
}


def available() -> str | None:
    """Why a primary/standby pair cannot start here (``None``: it can)."""
    for name in ("initdb", "postgres", "pg_basebackup", "pg_ctl"):
        if not (BIN / name).exists():
            return f"{BIN / name} is missing (apt install postgresql-15)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(USER)
        except KeyError:
            return f"there is no {USER!r} OS user to run the servers as (PostgreSQL refuses root)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _segment_creator(shmid: str) -> int | None:
    """The pid that created System V segment ``shmid`` (so only our own segment is removed)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[1] == shmid:
                return int(cols[4])
    return None


def postmaster_segment(datadir: Path) -> str | None:
    """The System V shared memory id in ``postmaster.pid`` (a SIGKILLed server leaves it behind)."""
    with contextlib.suppress(OSError, IndexError):
        # postmaster.pid's 7th line: the shared memory key and id.
        return (datadir / "postmaster.pid").read_text().splitlines()[6].split()[1]
    return None


def release_segment(shm: str | None, creator: int | None) -> None:
    """Remove segment ``shm`` if the postmaster ``creator`` made it (never another server's)."""
    if shm is not None and creator is not None and _segment_creator(shm) == creator:
        subprocess.run(["ipcrm", "-m", shm], capture_output=True, timeout=10)


def as_postgres() -> dict[str, Any]:
    """Popen arguments that run a program as the postgres user when we are root."""
    if os.geteuid() != 0:
        return {}
    return {"user": USER, "group": USER, "extra_groups": []}


def own(path: Path) -> None:
    """Give ``path`` to the postgres user when we are root (the servers write there)."""
    if os.geteuid() == 0:
        shutil.chown(path, USER, USER)


@dataclass
class PgNode:
    """One server: its port, data directory and postmaster process."""

    name: str
    port: int
    root: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def datadir(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://{USER}@127.0.0.1:{self.port}/{DATABASE}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def connect(self, timeout: float = 3.0, dbname: str = DATABASE) -> Any:
        """A psycopg connection in autocommit mode (a context manager that closes it)."""
        import psycopg

        return psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user=USER,
            dbname=dbname,
            connect_timeout=max(1, int(timeout)),
            autocommit=True,
        )

    def scalar(self, sql: str, *params: Any) -> Any:
        with self.connect() as conn:
            row = conn.execute(sql, params or None).fetchone()
            return None if row is None else row[0]


@dataclass
class PgReplicaPair(Started):
    """``with PgReplicaPair() as pair:`` a primary and its streaming standby on private ports."""

    startup_timeout: float = 60.0
    primary: PgNode | None = None
    standby: PgNode | None = None
    base: Path | None = None
    _made: int = 0
    _dead: list[PgNode] = field(default_factory=list)

    # -- set-up ------------------------------------------------------------------------------

    def start(self) -> None:
        why = available()
        if why is not None:
            raise RuntimeError(why)
        self.base = Path(tempfile.mkdtemp(prefix="sg-pgrepl-"))
        self.base.chmod(0o755)
        try:
            self.primary = self._new_node("node")
            self._run(
                # --no-sync: only the files initdb writes skip the flush; the server runs with fsync on.
                [
                    str(BIN / "initdb"),
                    "-D",
                    str(self.primary.datadir),
                    "-U",
                    USER,
                    "--auth=trust",
                    "-E",
                    "UTF8",
                    "--locale=C",
                    "--no-sync",
                    "--no-instructions",
                ],
            )
            with open(self.primary.datadir / "postgresql.conf", "a") as conf:
                conf.write("".join(f"{k} = '{v}'\n" for k, v in SETTINGS.items()))
            self._launch(self.primary)
            self._wait_accepting(self.primary, dbname="postgres")
            with self.primary.connect(dbname="postgres") as conn:
                conn.execute(f"CREATE DATABASE {DATABASE}")
            self._make_standby()
        except BaseException:
            self.stop()
            raise

    def _new_node(self, prefix: str) -> PgNode:
        assert self.base is not None
        self._made += 1
        node = PgNode(f"{prefix}{self._made}", _free_port(), self.base / f"{prefix}{self._made}")
        node.root.mkdir()
        own(node.root)
        return node

    def _run(self, args: list[str], timeout: float = 60.0) -> None:
        done = subprocess.run(args, capture_output=True, timeout=timeout, **as_postgres())
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.decode()[-1500:]}")

    def _launch(self, node: PgNode) -> None:
        out = open(node.log, "ab")  # noqa: SIM115 - handed to the process
        own(node.log)
        # A session of its own: the postmaster's pid is its process group, which kill_primary() ends.
        node.process = subprocess.Popen(
            [str(BIN / "postgres"), "-D", str(node.datadir), "-c", f"port={node.port}"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **as_postgres(),
        )
        out.close()

    def _wait_accepting(self, node: PgNode, dbname: str = DATABASE) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last: object = None
        while time.monotonic() < deadline:
            if not node.running:
                raise RuntimeError(f"postgres {node.name} exited: {self._tail(node)}")
            try:
                with node.connect(timeout=1, dbname=dbname):
                    return
            except Exception as exc:  # not up yet
                last = exc
            time.sleep(0.1)
        raise RuntimeError(
            f"postgres {node.name} not up after {self.startup_timeout}s ({last}): {self._tail(node)}"
        )

    def _make_standby(self) -> None:
        assert self.primary is not None
        node = self._new_node("node")
        conninfo = f"host=127.0.0.1 port={self.primary.port} user={USER} application_name={STANDBY_NAME}"
        self._run(
            [
                str(BIN / "pg_basebackup"),
                "-d",
                conninfo,
                "-D",
                str(node.datadir),
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
                "--no-sync",
            ],
        )
        with open(node.datadir / "postgresql.auto.conf", "a") as conf:
            # The last setting wins: the standby's name is what synchronous_standby_names refers to.
            conf.write(f"primary_conninfo = '{conninfo}'\nsynchronous_standby_names = ''\n")
        self.standby = node
        self._launch(node)
        self._wait_accepting(node)
        self.wait_streaming()

    def wait_streaming(self, sync_state: str | None = None, timeout: float = 30.0) -> None:
        """Wait until the primary streams to the standby (with ``sync_state`` 'sync' or 'async')."""
        assert self.primary is not None
        deadline = time.monotonic() + timeout
        seen: object = None
        while time.monotonic() < deadline:
            seen = self.primary.scalar(
                "SELECT sync_state FROM pg_stat_replication"
                " WHERE application_name = %s AND state = 'streaming'",
                STANDBY_NAME,
            )
            if seen is not None and (sync_state is None or seen == sync_state):
                return
            time.sleep(0.05)
        raise RuntimeError(f"the standby is not streaming ({sync_state or 'any'}) after {timeout}s: {seen}")

    # -- the knobs the tests turn ---------------------------------------------------------------

    def set_synchronous(self, on: bool) -> None:
        """Make the standby synchronous (``synchronous_standby_names``) or asynchronous, and wait for it."""
        assert self.primary is not None
        with self.primary.connect() as conn:
            conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{STANDBY_NAME if on else ''}'")
            conn.execute("SELECT pg_reload_conf()")
        if self.standby is not None and self.standby.running:
            self.wait_streaming("sync" if on else "async")

    def wait_replayed(self, timeout: float = 30.0) -> None:
        """Wait until the standby has replayed everything the primary has written so far."""
        assert self.primary is not None and self.standby is not None
        target = self.primary.scalar("SELECT pg_current_wal_lsn()::text")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.standby.scalar("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", target):
                return
            time.sleep(0.02)
        raise RuntimeError(f"the standby did not replay up to {target} in {timeout}s")

    def stop_standby(self) -> None:
        """Stop the standby (a fast shutdown, by its pid); :meth:`start_standby` starts it again."""
        node = self.standby
        if node is not None and node.process is not None and node.running:
            os.kill(node.process.pid, signal.SIGINT)
            node.process.wait(timeout=60)

    def kill_standby(self) -> None:
        """Kill the standby like a crash (SIGKILL to its process group)."""
        if self.standby is not None:
            self._kill(self.standby)

    def start_standby(self) -> None:
        """Start the stopped or killed standby again; it accepts read-only queries when this returns."""
        assert self.standby is not None
        self._launch(self.standby)
        self._wait_accepting(self.standby)

    def stop_primary(self) -> None:
        """Stop the primary cleanly (a fast shutdown, by its pid): it first sends the standby all its WAL."""
        assert self.primary is not None
        proc = self.primary.process
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
            proc.wait(timeout=60)

    def kill_primary(self) -> None:
        """Kill the primary like a crashed machine: SIGKILL to the postmaster and all its backends."""
        assert self.primary is not None
        self._kill(self.primary)

    def _kill(self, node: PgNode) -> None:
        proc = node.process
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)

    def promote(self, timeout: float = 30.0) -> None:
        """Promote the standby (``pg_ctl promote``), wait until it writes; it becomes :attr:`primary`.

        The old primary must be dead or stopped.  The new primary has no standby yet, so it stops
        waiting for one (``synchronous_standby_names = ''``) until :meth:`repair` gives it one.
        """
        assert self.standby is not None and self.primary is not None
        assert not self.primary.running, "promoting while the primary runs makes two primaries"
        self._run(
            [str(BIN / "pg_ctl"), "promote", "-D", str(self.standby.datadir), "-w", "-t", str(int(timeout))]
        )
        deadline = time.monotonic() + timeout
        while self.standby.scalar("SELECT pg_is_in_recovery()"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.standby.name} still in recovery {timeout}s after pg_ctl promote")
            time.sleep(0.05)
        old, self.primary, self.standby = self.primary, self.standby, None
        self._dead.append(old)
        with self.primary.connect() as conn:
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = ''")
            conn.execute("SELECT pg_reload_conf()")

    @property
    def healthy(self) -> bool:
        """A running primary with a running standby."""
        return (
            self.primary is not None
            and self.primary.running
            and self.standby is not None
            and self.standby.running
        )

    def repair(self) -> None:
        """After a failover or a stopped standby: a running primary streaming to a fresh standby."""
        assert self.primary is not None
        if self.standby is not None and not self.standby.running and self.primary.running:
            self.start_standby()
        if self.standby is not None and self.standby.running and self.primary.running:
            self.wait_streaming()
            return
        if not self.primary.running:  # a primary killed without a promotion: the standby takes over
            if self.standby is not None and not self.standby.running:
                self.start_standby()
            self.promote()
        for node in self._dead:
            self._forget(node)
        self._dead.clear()
        self._make_standby()

    # -- tear-down ----------------------------------------------------------------------------

    def _tail(self, node: PgNode) -> str:
        with contextlib.suppress(OSError):
            return node.log.read_text(errors="replace")[-1500:]
        return "(no log)"

    def _forget(self, node: PgNode) -> None:
        """Kill a node by its pid, free its System V segment, remove its directory."""
        shm = postmaster_segment(node.datadir)
        pid = node.process.pid if node.process is not None else None
        self._kill(node)
        release_segment(shm, pid)
        shutil.rmtree(node.root, ignore_errors=True)

    def stop(self) -> None:
        for node in (self.standby, self.primary, *self._dead):
            if node is not None:
                self._forget(node)
        self.primary = self.standby = None
        self._dead.clear()
        if self.base is not None:
            shutil.rmtree(self.base, ignore_errors=True)
            self.base = None
