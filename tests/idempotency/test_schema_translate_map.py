"""idempotent() with ``schema_translate_map`` on the engine: stateguard's tables are found in the
translated schema on PostgreSQL and MariaDB."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from sqlalchemy import (
    Engine,
    insert,
    text,
)
from sqlalchemy.orm import Session

from stateguard import (
    create_tables,
    drop_tables,
    idempotent,
)
from tests._support.idem_claims import (
    Boom,
    _await_waiters,
    _claim_verb,
    _held_claim,
    _record,
    _runs,
    _statements_of,
    _unit,
    _verbs,
    ca_md,
    work,
)
from tests.conftest import Backend


@pytest.fixture
def eng(engine: Engine, backend: Backend) -> Iterator[Engine]:
    """stateguard's tables (conftest ``engine``) and ``ca_work`` on each backend, dropped afterwards."""
    backend.create(ca_md)
    yield engine


@pytest.fixture
def pg_eng(pg: Backend) -> Iterator[Engine]:
    """PostgreSQL only: stateguard's tables and ``ca_work``."""
    eng = pg.engine
    drop_tables(eng)
    create_tables(eng)
    pg.create(ca_md)
    yield eng
    drop_tables(eng)


# --------------------------------------------------------------------------- 8. schema_translate_map


def _translate_attack(backend: Backend, base: Engine) -> None:
    """Tables in two extra schemas (databases on MariaDB) reached through schema_translate_map, and in
    the default one: the same (scope, key) is three records, each run once and replayed on its own
    engine; a twin behind a translated claim replays through the re-read; a failing block's claim is
    deleted in its own schema only."""
    tag = uuid.uuid4().hex[:8]
    names = [f"ca_x_{tag}", f"ca_y_{tag}"]
    quote = '"' if backend.name == "postgresql" else "`"
    create = "CREATE SCHEMA" if backend.name == "postgresql" else "CREATE DATABASE"
    drop = "DROP SCHEMA {} CASCADE" if backend.name == "postgresql" else "DROP DATABASE {}"
    admin = backend.new_engine(pool_size=1, max_overflow=0, isolation_level="AUTOCOMMIT")
    probe = backend.new_engine(pool_size=1, max_overflow=0)
    try:
        with admin.connect() as c:
            for name in names:
                c.execute(text(f"{create} {quote}{name}{quote}"))
        engines = {name: base.execution_options(schema_translate_map={None: name}) for name in names}
        for translated in engines.values():
            create_tables(translated)
            ca_md.create_all(translated)
        everywhere = {"base": base, **engines}
        for who, e in everywhere.items():
            assert _unit(e, "ca11", "k", who, label="k") == ("ran", {"by": who}), who
        for who, e in everywhere.items():
            assert _unit(e, "ca11", "k", "again", label="k") == ("replayed", {"by": who}), who
            assert _runs(e, "k") == [who]
            assert _record(e, "ca11", "k").response == f'{{"by":"{who}"}}'

        # A twin behind a claim on the translated engine: commit, then replay via the re-read.
        x = engines[names[0]]
        claimed = threading.Event()
        out: dict[str, Any] = {}

        def first() -> None:
            with _held_claim(x, "ca11", "tw", "first", fingerprint="body") as (s, pid):
                claimed.set()
                out["waited"] = _await_waiters(backend, probe, pid, 1)
                s.commit()

        def twin() -> None:
            assert claimed.wait(10)
            with Session(x) as s, s.begin():
                with _statements_of(s.connection()) as seen:
                    out["twin"] = _unit_in(s, "tw", "twin")
                out["seen"] = list(seen)

        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(first), pool.submit(twin)]:
                f.result(timeout=60)
        assert out.get("waited"), "the twin never waited"
        assert out["twin"] == ("replayed", {"by": "first"}), out
        assert _verbs(out["seen"]) == [_claim_verb(backend), "SELECT"]
        assert all(names[0] in stmt for stmt in out["seen"]), out["seen"]
        assert _runs(x, "tw") == ["first"] and _runs(base, "tw") == []
        assert _record(base, "ca11", "tw") is None and _record(engines[names[1]], "ca11", "tw") is None

        # The same key completed in the default schema; a failing block in X deletes only X's claim.
        assert _unit(base, "ca11", "fail", "base", label="fail") == ("ran", {"by": "base"})
        with Session(x) as s, s.begin():
            with pytest.raises(Boom), idempotent(s, scope="ca11", key="fail", fingerprint="body"):
                s.execute(insert(work).values(label="fail", by="x"))
                raise Boom
        assert _record(x, "ca11", "fail") is None and _runs(x, "fail") == []
        assert _record(base, "ca11", "fail").response == '{"by":"base"}'
        assert _unit(x, "ca11", "fail", "x2", label="fail") == ("ran", {"by": "x2"})
    finally:
        with admin.connect() as c:
            for name in names:
                c.execute(text(drop.format(f"{quote}{name}{quote}")))
        admin.dispose()
        probe.dispose()


def _unit_in(s: Session, key: str, by: str) -> tuple[str, Any]:
    with idempotent(s, scope="ca11", key=key, fingerprint="body") as call:
        if call.replayed:
            return "replayed", call.response
        s.execute(insert(work).values(label=key, by=by))
        return "ran", call.complete({"by": by})


def test_schema_translate_map_on_postgresql(pg: Backend, pg_eng: Engine) -> None:
    _translate_attack(pg, pg_eng)


def test_schema_translate_map_on_mariadb(mariadb: Backend) -> None:
    base = mariadb.engine
    drop_tables(base)
    create_tables(base)
    mariadb.create(ca_md)
    try:
        _translate_attack(mariadb, base)
    finally:
        drop_tables(base)
