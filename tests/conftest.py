"""Shared fixtures: one ``backend`` fixture parametrized over SQLite, PostgreSQL
and MariaDB, each test run in a private namespace (a PostgreSQL schema, a
MariaDB database, a SQLite file) so parallel runs and leftovers of a crashed
run never collide.

A server that cannot be reached makes its tests skip loudly on a laptop; with
``CI=true`` it fails them instead, so CI can never pass without exercising
every backend.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import uuid
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
from sqlalchemy import Engine, MetaData, create_engine, event, text
from sqlalchemy.engine import make_url

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

PG_URL = os.environ.get("STATEGUARD_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
MYSQL_URL = os.environ.get("STATEGUARD_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test")
REDIS_URL = os.environ.get("STATEGUARD_REDIS_URL", "redis://127.0.0.1:6379/0")

BACKENDS = ("sqlite", "postgresql", "mariadb")

# What each test backend can do, for tests about a capability rather than one dialect's quirk
# (as SQLAlchemy's ``requires.*``): ``capable(backend, "row_locks")`` in a test body, or
# ``@pytest.mark.requires("row_locks")`` to skip the backends that lack it.
CAPABILITIES: dict[str, frozenset[str]] = {
    # update_returning: UPDATE ... RETURNING (SQLite >= 3.35); one-statement writes
    # row_locks: SELECT ... FOR UPDATE and named locks (SQLite locks the whole file instead)
    # skip_locked: SELECT ... FOR UPDATE SKIP LOCKED (PostgreSQL, MariaDB >= 10.6)
    # concurrent_writers: two connections write at once (SQLite serializes writers)
    # writable_cte: a data-modifying WITH statement (PostgreSQL): stateguard's claim, or a
    #   transition and its outbox event, is one statement
    # isolation_levels: a connection can be set to REPEATABLE READ / SERIALIZABLE (SQLite is
    #   serializable already and takes no isolation_level of that name)
    # snapshot_conflicts: at REPEATABLE READ, writing a row changed since the snapshot fails with a
    #   serialization error (PostgreSQL 40001; InnoDB writes the latest version)
    # update_rechecks_where: at READ COMMITTED a waiting UPDATE re-checks its WHERE against the row
    #   its blocker committed, so a loser matches 0 rows instead of failing (PostgreSQL)
    # error_aborts_transaction: after a failed statement the transaction refuses every other one
    #   until it is rolled back, to a savepoint or whole (PostgreSQL)
    # int32_integer: INTEGER is 32 bits, 2**31 does not fit (SQLite's INTEGER holds 64)
    # deadlock_rolls_back_transaction: a deadlock victim loses its whole transaction, savepoints
    #   included (InnoDB); PostgreSQL fails the statement, and a savepoint can be rolled back
    # duplicate_inserts_deadlock: INSERTs of one unique key that wait on an uncommitted holder
    #   can deadlock among themselves (InnoDB's next-key locks on the duplicate)
    # savepoint_releases_locks: ROLLBACK TO SAVEPOINT releases the row locks taken after it, so
    #   another session can write the row while this one goes on (PostgreSQL; InnoDB keeps them)
    # inexact_keys: the default collation matches 'SKU-A' and 'sku-a ' to 'sku-a' (MariaDB:
    #   case-insensitive, PAD SPACE)
    # legal_edges: stateguard installs its legal-edges trigger (PostgreSQL; elsewhere a warning)
    "sqlite": frozenset({"update_returning"}),
    "postgresql": frozenset(
        {
            "update_returning",
            "row_locks",
            "skip_locked",
            "concurrent_writers",
            "writable_cte",
            "isolation_levels",
            "snapshot_conflicts",
            "update_rechecks_where",
            "error_aborts_transaction",
            "int32_integer",
            "savepoint_releases_locks",
            "legal_edges",
        }
    ),
    "mariadb": frozenset(
        {
            "row_locks",
            "skip_locked",
            "concurrent_writers",
            "isolation_levels",
            "int32_integer",
            "deadlock_rolls_back_transaction",
            "duplicate_inserts_deadlock",
            "inexact_keys",
        }
    ),
}


def capable(backend: Backend | str, capability: str) -> bool:
    """Whether the backend (or backend name) has ``capability`` (a key of :data:`CAPABILITIES`)."""
    name = backend if isinstance(backend, str) else backend.name
    if not any(capability in caps for caps in CAPABILITIES.values()):
        raise ValueError(f"unknown capability {capability!r}; add it to CAPABILITIES")
    return capability in CAPABILITIES[name]


def backends_with(*capabilities: str) -> list[str]:
    """The backends that have every one of ``capabilities``, in :data:`BACKENDS` order.

    For a file that exists only for those backends (the others are not collected, rather than
    skipped)::

        pytestmark = pytest.mark.parametrize("backend", backends_with("inexact_keys"), indirect=True)
    """
    return [name for name in BACKENDS if all(capable(name, c) for c in capabilities)]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.requires(*capabilities)``: skip, at collection, the ``backend`` params that
    lack one of them (with the missing capabilities as the reason)."""
    for item in items:
        markers = list(item.iter_markers("requires"))
        if not markers:
            continue
        callspec = getattr(item, "callspec", None)
        name = callspec.params.get("backend") if callspec is not None else None
        if name is None:
            raise pytest.UsageError(f"{item.nodeid}: requires() needs the backend or engine fixture")
        try:
            missing = [c for marker in markers for c in marker.args if not capable(name, c)]
        except ValueError as error:  # a misspelt capability
            raise pytest.UsageError(f"{item.nodeid}: {error}") from None
        if missing:
            item.add_marker(pytest.mark.skip(reason=f"{name} lacks {', '.join(missing)}"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak",
        action="store_true",
        default=False,
        help="run tests/reliability with sizes multiplied for long runs (also STATEGUARD_SOAK=1 or =N)",
    )


def unavailable(what: str, error: BaseException) -> None:
    """Skip (laptop) or fail (CI) because a server is unreachable."""
    message = f"{what} is unreachable ({type(error).__name__}: {error})"
    if IN_CI:
        pytest.fail(f"{message}; in CI every backend must run", pytrace=False)
    pytest.skip(f"!!! SKIPPED: {message}; start it to run these tests")


@dataclass
class Backend:
    """A database to test against: ``url`` works from other processes too."""

    name: str
    url: str
    engine: Engine
    _metadatas: list[MetaData] = field(default_factory=list)

    def create(self, *metadatas: MetaData) -> Engine:
        """Create the tables of ``metadatas`` now and drop them after the test."""
        for md in metadatas:
            md.drop_all(self.engine)
            md.create_all(self.engine)
            self._metadatas.append(md)
        return self.engine

    def new_engine(self, **kw: Any) -> Engine:
        """A separate engine (own pool) on the same private namespace."""
        return make_engine(self.name, self.url, **kw)

    def _drop(self) -> None:
        while self._metadatas:
            self._metadatas.pop().drop_all(self.engine)


def make_engine(name: str, url: str, **kw: Any) -> Engine:
    kw.setdefault("pool_size", 24)
    kw.setdefault("max_overflow", 8)
    if name == "sqlite":
        kw.setdefault("connect_args", {"timeout": 60})
    return create_engine(url, **kw)


class _Namespaces:
    """Private per-run namespaces on each server, created on first use."""

    def __init__(self, tmp_dir: str) -> None:
        self.tmp_dir = tmp_dir
        self.tag = f"sgt_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.urls: dict[str, str] = {}
        self.errors: dict[str, BaseException] = {}
        self.cleanups: list[Any] = []

    def url(self, name: str) -> str:
        if name in self.errors:
            unavailable(name, self.errors[name])
        if name not in self.urls:
            try:
                self.urls[name] = self._create(name)
            except Exception as error:  # connection refused, auth, ...
                self.errors[name] = error
                unavailable(name, error)
        return self.urls[name]

    def _create(self, name: str) -> str:
        if name == "sqlite":
            return f"sqlite:///{self.tmp_dir}/{self.tag}.db"
        if name == "postgresql":
            admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT", pool_pre_ping=True)
            with admin.connect() as conn:
                conn.execute(text(f'CREATE SCHEMA "{self.tag}"'))
            self.cleanups.append(lambda: _drop_pg(admin, self.tag))
            url = make_url(PG_URL).update_query_dict({"options": f"-csearch_path={self.tag}"})
            return url.render_as_string(hide_password=False)
        if name == "mariadb":
            admin = create_engine(MYSQL_URL, isolation_level="AUTOCOMMIT", pool_pre_ping=True)
            with admin.connect() as conn:
                conn.execute(text(f"CREATE DATABASE `{self.tag}`"))
            self.cleanups.append(lambda: _drop_mysql(admin, self.tag))
            return make_url(MYSQL_URL).set(database=self.tag).render_as_string(hide_password=False)
        raise ValueError(name)


def _drop_pg(admin: Engine, tag: str) -> None:
    with admin.connect() as conn:
        conn.execute(text(f'DROP SCHEMA IF EXISTS "{tag}" CASCADE'))
    admin.dispose()


def _drop_mysql(admin: Engine, tag: str) -> None:
    with admin.connect() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS `{tag}`"))
    admin.dispose()


@pytest.fixture(scope="session")
def namespaces(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Namespaces]:
    ns = _Namespaces(str(tmp_path_factory.mktemp("sqlite")))
    yield ns
    for cleanup in reversed(ns.cleanups):
        with contextlib.suppress(Exception):
            cleanup()


_engines: dict[str, Engine] = {}


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, namespaces: _Namespaces) -> Iterator[Backend]:
    """Each backend in turn; the test creates its tables with ``backend.create``.

    ``@pytest.mark.requires("row_locks", ...)`` skips the backends without those capabilities
    (:func:`pytest_collection_modifyitems`)."""
    yield from _only(request.param, namespaces)


@pytest.fixture(scope="session", autouse=True)
def _dispose_engines() -> Iterator[None]:
    yield
    for engine in _engines.values():
        engine.dispose()


def _only(name: str, namespaces: _Namespaces) -> Iterator[Backend]:
    url = namespaces.url(name)
    engine = _engines.get(name)
    if engine is None:
        engine = _engines[name] = make_engine(name, url)
    b = Backend(name, url, engine)
    yield b
    b._drop()


@pytest.fixture
def engine(backend: Backend, request: pytest.FixtureRequest) -> Iterator[Engine]:
    """The backend's engine with stateguard's tables and the test's own, dropped afterwards.

    The only ``engine`` fixture of the suite.  A module (or test) names its tables with the
    ``tables`` marker::

        pytestmark = pytest.mark.tables(Base.metadata, seed=_seed, stateguard=False)

    * ``seed(session)`` adds rows in one committed transaction before the test;
    * ``stateguard=False`` leaves stateguard's own tables out (whatever an earlier test left);
      ``stateguard="dropped"`` makes sure they do not exist (tests of a missing table);
    * ``sqlite_engine=True`` (or a dict of its options, ``{"busy_timeout": 60}``): on SQLite
      the engine is a separate :func:`stateguard.sqlite_engine` on the same file (real BEGINs
      around SAVEPOINTs, ``BEGIN IMMEDIATE`` for locks), disposed afterwards; the other
      backends keep theirs.
    """
    from sqlalchemy.orm import Session

    from stateguard import create_tables, drop_tables, sqlite_engine

    marker = request.node.get_closest_marker("tables")
    metadatas, options = (marker.args, marker.kwargs) if marker else ((), {})
    unknown = set(options) - {"seed", "stateguard", "sqlite_engine"}
    if unknown:
        pytest.fail(f"unknown tables() option(s): {', '.join(sorted(unknown))}", pytrace=False)
    ours = options.get("stateguard", True)
    if ours not in (True, False, "dropped"):
        pytest.fail(f"tables(stateguard=...) is True, False or 'dropped', not {ours!r}", pytrace=False)
    create = ours != "dropped" and bool(ours)
    eng = backend.create(*metadatas)
    if ours:
        drop_tables(eng)
    if create:
        create_tables(eng)
    private = options.get("sqlite_engine", False)
    if private and backend.name == "sqlite":
        eng = sqlite_engine(backend.url, **(private if isinstance(private, dict) else {}))
    seed = options.get("seed")
    if seed is not None:
        with Session(eng) as session, session.begin():
            seed(session)
    yield eng
    if eng is not backend.engine:
        eng.dispose()
    if create:
        drop_tables(backend.engine)


@pytest.fixture(scope="module")
def procs() -> Iterator[tuple[Any, ProcessPoolExecutor]]:
    """Four spawned worker processes and a manager for barriers, events and lists, shared by the module."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, ProcessPoolExecutor(4, mp_context=ctx) as pool:
        yield manager, pool


@pytest.fixture
def redis_client() -> Iterator[Any]:
    """A client of the test Redis server (skip locally / fail in CI when it is down)."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError as error:
        client.close()
        unavailable("redis", error)
    yield client
    client.close()


@pytest.fixture
def lock_name(redis_client: Any) -> Iterator[str]:
    """A Redis lock name unique to the test; the lock's keys (fence, markers) are deleted afterwards."""
    name = f"sgt-lock-{uuid.uuid4().hex[:12]}"
    yield name
    keys = list(redis_client.scan_iter(match=f"stateguard:lock:{{{name}*"))
    if keys:
        redis_client.delete(*keys)


@pytest.fixture
def pg(namespaces: _Namespaces) -> Iterator[Backend]:
    """PostgreSQL only (for behaviour that exists only there)."""
    yield from _only("postgresql", namespaces)


@pytest.fixture
def sqlite(namespaces: _Namespaces) -> Iterator[Backend]:
    """SQLite only (a file database)."""
    yield from _only("sqlite", namespaces)


@pytest.fixture
def mariadb(namespaces: _Namespaces) -> Iterator[Backend]:
    """MariaDB only."""
    yield from _only("mariadb", namespaces)


class StatementCounter:
    """Records every statement sent to the driver while active."""

    def __init__(self) -> None:
        self.statements: list[str] = []

    def __len__(self) -> int:
        return len(self.statements)

    def clear(self) -> None:
        self.statements.clear()

    def _on_execute(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        self.statements.append(statement)


@contextlib.contextmanager
def count_statements(engine: Engine) -> Iterator[StatementCounter]:
    """``with count_statements(engine) as c: ...; assert len(c) == 1``."""
    counter = StatementCounter()
    event.listen(engine, "before_cursor_execute", counter._on_execute)
    try:
        yield counter
    finally:
        event.remove(engine, "before_cursor_execute", counter._on_execute)
