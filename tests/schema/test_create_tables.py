"""create_tables() called by many threads and processes at once, on a fresh database, succeeds in every
one of them and creates each table once (on an Engine, a Connection and an AsyncEngine, every backend)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest
from sqlalchemy import create_engine, inspect, make_url, text

from stateguard.tables import metadata
from tests import conftest
from tests._support.processes import worker_context
from tests.conftest import BACKENDS, unavailable
from tests.schema import _race

OURS = {t.name for t in metadata.sorted_tables}
THREADS = 8
PROCESSES = 4
ROUNDS = 3


@pytest.fixture(params=BACKENDS)
def fresh(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[tuple[str, Any]]:
    """A factory of fresh private namespaces on one backend (a new schema, database or file per round)."""
    name: str = request.param
    made: list[str] = []
    admin = None
    if name == "postgresql":
        admin = create_engine(conftest.PG_URL, isolation_level="AUTOCOMMIT")
    elif name == "mariadb":
        admin = create_engine(conftest.MYSQL_URL, isolation_level="AUTOCOMMIT")
    if admin is not None:
        try:
            admin.connect().close()
        except Exception as error:
            unavailable(name, error)

    def new() -> str:
        tag = f"sgct_{uuid.uuid4().hex[:12]}"
        if name == "sqlite":
            return f"sqlite:///{tmp_path}/{tag}.db"
        assert admin is not None
        with admin.connect() as conn:
            if name == "postgresql":
                # A new schema on the search path: the tables' row types land in pg_type there, where
                # two CREATE TABLEs of one name collide (pg_type_typname_nsp_index).
                conn.execute(text(f'CREATE SCHEMA "{tag}"'))
                made.append(f'DROP SCHEMA IF EXISTS "{tag}" CASCADE')
                url = make_url(conftest.PG_URL).update_query_dict({"options": f"-csearch_path={tag}"})
            else:
                conn.execute(text(f"CREATE DATABASE `{tag}`"))
                made.append(f"DROP DATABASE IF EXISTS `{tag}`")
                url = make_url(conftest.MYSQL_URL).set(database=tag)
        return url.render_as_string(hide_password=False)

    yield name, new
    if admin is not None:
        with admin.connect() as conn:
            for drop in made:
                conn.execute(text(drop))
        admin.dispose()


@pytest.fixture(scope="module")
def pool() -> Iterator[tuple[Any, ProcessPoolExecutor]]:
    """Separate worker processes and a manager whose barrier threads and processes share."""

    ctx = worker_context()
    with ctx.Manager() as manager, ProcessPoolExecutor(PROCESSES, mp_context=ctx) as executor:
        yield manager, executor


def _table_count(name: str, url: str) -> dict[str, int]:
    """How many tables of each of our names the namespace holds (information_schema / sqlite_master)."""
    engine = _race.sync_engine(name, url)
    try:
        with engine.connect() as conn:
            if name == "sqlite":
                rows = conn.execute(text("SELECT name FROM sqlite_master WHERE type = 'table'")).scalars()
            else:
                schema = inspect(conn).default_schema_name
                rows = conn.execute(
                    text("SELECT table_name FROM information_schema.tables WHERE table_schema = :s"),
                    {"s": schema},
                ).scalars()
            found: dict[str, int] = {}
            for table in rows:
                found[table] = found.get(table, 0) + 1
            return {t: n for t, n in found.items() if t in OURS}
    finally:
        engine.dispose()


def _in_thread(errors: list[str | None], i: int, name: str, url: str, mode: str, barrier: Any) -> None:
    errors[i] = _race.create(name, url, mode, barrier)


@pytest.mark.parametrize("mode", ["sync", "connection", "async"])
def test_concurrent_create_tables_all_succeed_on_a_fresh_database(
    fresh: tuple[str, Any], pool: tuple[Any, ProcessPoolExecutor], mode: str
) -> None:
    """8 threads and 4 processes call create_tables() at once, each round: all succeed, each table once."""
    name, new_namespace = fresh
    manager, executor = pool
    for round_ in range(ROUNDS):
        url = new_namespace()
        barrier = manager.Barrier(THREADS + PROCESSES, timeout=120)
        futures = [executor.submit(_race.create, name, url, mode, barrier) for _ in range(PROCESSES)]
        errors: list[str | None] = [None] * THREADS

        threads = [
            threading.Thread(target=_in_thread, args=(errors, i, name, url, mode, barrier))
            for i in range(THREADS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        failures = [e for e in errors + [f.result(timeout=300) for f in futures] if e is not None]
        assert not failures, (
            f"round {round_}: {len(failures)} of {THREADS + PROCESSES} failed:\n{failures[0]}"
        )
        assert _table_count(name, url) == dict.fromkeys(OURS, 1)
