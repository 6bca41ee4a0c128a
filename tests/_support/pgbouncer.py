"""A private PgBouncer for tests: transaction pooling on a free 127.0.0.1 port, its own
ini and userlist in a temporary directory, stopped by pid.

::

    with PgBouncer(dbname="test", search_path="sgt_1") as bouncer:
        engine = create_engine(bouncer.url(), connect_args={"prepare_threshold": None})

PgBouncer refuses to run as root; as root it is started with ``-u postgres`` (the
directory is handed to that user). ``search_path`` is set on every server connection
with ``connect_query`` (a client's ``options`` startup parameter cannot pass through a
pooler, and a ``SET`` would not outlive the transaction in transaction pooling).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

__all__ = ["PgBouncer", "pgbouncer_binary"]

#: The database name clients use; PgBouncer maps it to the real one.
ALIAS = "sgbouncer"


def pgbouncer_binary() -> str | None:
    """The pgbouncer executable (Debian puts it in /usr/sbin, often not on PATH), or None."""
    found = shutil.which("pgbouncer")
    if found:
        return found
    return "/usr/sbin/pgbouncer" if os.access("/usr/sbin/pgbouncer", os.X_OK) else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class PgBouncer:
    """One pgbouncer process in front of a PostgreSQL server.

    :param server_host: the PostgreSQL server's host.
    :param server_port: its port.
    :param dbname: the real database name.
    :param user: the server login (PgBouncer logs in as this user; clients use it too).
    :param search_path: a schema put on every server connection (``connect_query``).
    :param pool_mode: ``"transaction"`` (default), ``"session"`` or ``"statement"``.
    :param pool_size: server connections per (database, user) pool.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        *,
        server_host: str = "127.0.0.1",
        server_port: int = 5432,
        dbname: str = "test",
        user: str = "postgres",
        search_path: str | None = None,
        pool_mode: str = "transaction",
        pool_size: int = 20,
    ) -> None:
        binary = pgbouncer_binary()
        if binary is None:
            raise FileNotFoundError("pgbouncer is not installed (Debian: apt-get install -y pgbouncer)")
        self.binary = binary
        self.server = (server_host, server_port)
        self.dbname = dbname
        self.user = user
        self.search_path = search_path
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="sg_pgbouncer_"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> str:
        """PgBouncer's log so far (for failure messages)."""
        try:
            return (self.dir / "pgbouncer.log").read_text(errors="replace")
        except OSError:
            return ""

    def url(self, driver: str = "postgresql+psycopg") -> str:
        """A SQLAlchemy URL reaching the database through this PgBouncer (plain TCP)."""
        return f"{driver}://{self.user}@{self.host}:{self.port}/{ALIAS}?sslmode=disable"

    def conninfo(self) -> str:
        """A libpq connection string for psycopg.connect()."""
        return f"host={self.host} port={self.port} dbname={ALIAS} user={self.user} sslmode=disable"

    def _write_config(self) -> Path:
        db = f"host={self.server[0]} port={self.server[1]} dbname={self.dbname} user={self.user}"
        if self.search_path is not None:
            db += f" connect_query='SET search_path TO {self.search_path}'"
        ini = self.dir / "pgbouncer.ini"
        ini.write_text(
            "\n".join(
                [
                    "[databases]",
                    f"{ALIAS} = {db}",
                    "[pgbouncer]",
                    f"listen_addr = {self.host}",
                    f"listen_port = {self.port}",
                    "unix_socket_dir =",
                    "auth_type = trust",
                    f"auth_file = {self.dir / 'userlist.txt'}",
                    f"pool_mode = {self.pool_mode}",
                    f"default_pool_size = {self.pool_size}",
                    "max_client_conn = 500",
                    "ignore_startup_parameters = extra_float_digits",
                    f"logfile = {self.dir / 'pgbouncer.log'}",
                    f"pidfile = {self.dir / 'pgbouncer.pid'}",
                    "",
                ]
            )
        )
        (self.dir / "userlist.txt").write_text(f'"{self.user}" ""\n')
        return ini

    def start(self, timeout: float = 20.0) -> PgBouncer:
        """Start pgbouncer and wait until it answers a query."""
        ini = self._write_config()
        command = [self.binary]
        if os.geteuid() == 0:
            # "PgBouncer should not run as root": drop to the server's user.
            account = pwd.getpwnam("postgres")
            for path in [self.dir, *self.dir.iterdir()]:
                os.chown(path, account.pw_uid, account.pw_gid)
            command += ["-u", account.pw_name]
        command.append(str(ini))
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                stderr = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                self.stop()
                raise RuntimeError(f"pgbouncer exited with {self.process.returncode}: {stderr}{self.log}")
            try:
                self._ping()
                return self
            except Exception as error:  # not listening yet, or the server is not there
                last = error
                time.sleep(0.1)
        log = self.log
        self.stop()
        raise RuntimeError(f"pgbouncer did not answer within {timeout}s ({last!r}): {log}")

    def _ping(self) -> None:
        import psycopg

        with psycopg.connect(self.conninfo(), connect_timeout=2, prepare_threshold=None) as conn:
            conn.execute("SELECT 1")

    def restart(self, timeout: float = 20.0) -> None:
        """Kill pgbouncer (SIGKILL: every client and server connection drops at once, as in a
        crash) and start it again on the same port; returns once it answers a query."""
        process, self.process = self.process, None
        if process is not None:
            self._end(process, kill=True)
        (self.dir / "pgbouncer.pid").unlink(missing_ok=True)  # left behind by the kill
        self.start(timeout)

    def _end(self, process: subprocess.Popen[bytes], *, kill: bool = False) -> None:
        if process.poll() is None:
            if kill:
                process.kill()
            else:
                process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        if process.stderr is not None:
            process.stderr.close()

    def stop(self) -> None:
        """Stop pgbouncer (SIGTERM by pid, SIGKILL if it lingers) and remove its directory."""
        process, self.process = self.process, None
        if process is not None:
            self._end(process)
        with contextlib.suppress(OSError):
            shutil.rmtree(self.dir)

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
