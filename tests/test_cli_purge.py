"""`stateguard purge`: batched deletes of expired idempotency keys and tokens on every backend."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import Engine, func, insert, select

from stateguard import drop_tables
from stateguard.tables import idempotency_keys, tokens
from stateguard.tooling.cli import EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, main

from .conftest import Backend


def _fill(engine: Engine, expired: int, live: int) -> None:
    now = time.time_ns() // 1_000_000
    keys = [
        {
            "scope": "s",
            "idem_key": f"k-{i}",
            "status": "completed",
            "owner": "o",
            "attempt": 1,
            "expires_ms": now - 1000 if i < expired else now + 3_600_000,
            "created_ms": now,
            "updated_ms": now,
        }
        for i in range(expired + live)
    ]
    toks = [
        {
            "token_hash": f"{i:064x}",
            "scope": "s",
            "expires_ms": now - 1000 if i < expired else now + 3_600_000,
            "created_ms": now,
        }
        for i in range(expired + live)
    ]
    with engine.begin() as conn:
        conn.execute(insert(idempotency_keys), keys)
        conn.execute(insert(tokens), toks)


def _count(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        return (
            conn.execute(select(func.count()).select_from(idempotency_keys)).scalar_one(),
            conn.execute(select(func.count()).select_from(tokens)).scalar_one(),
        )


def test_purge_deletes_every_expired_row_in_batches_and_keeps_live_ones(
    backend: Backend, engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """25 expired rows per table go in batches of 10 (3 batches); the 5 live rows stay."""
    _fill(engine, expired=25, live=5)
    assert main(["purge", "--db", backend.url, "--batch", "10", "--pause", "0"]) == EXIT_OK
    assert _count(engine) == (5, 5)
    out = capsys.readouterr().out
    assert "expired idempotency keys: 25 deleted in 3 batches" in out
    assert "expired one-time tokens: 25 deleted in 3 batches" in out


def test_purge_only_and_max_batches_limit_the_work(
    backend: Backend, engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """--only picks a table; --max-batches stops early."""
    _fill(engine, expired=25, live=0)
    assert main(["purge", "--db", backend.url, "--only", "keys", "--batch", "10", "--max-batches", "1"]) == 0
    assert _count(engine) == (15, 25)
    assert "tokens" not in capsys.readouterr().out


def test_purge_without_tables_says_how_to_create_them(
    backend: Backend, capsys: pytest.CaptureFixture[str]
) -> None:
    """A database without stateguard's tables is a reported problem (exit 1) with the fix."""
    drop_tables(backend.engine)
    assert main(["purge", "--db", backend.url]) == EXIT_PROBLEMS
    assert "alembic upgrade stateguard@head" in capsys.readouterr().err


def test_purge_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """Missing --db, a bad batch or an unreachable database exit 2 with one line."""
    assert main(["purge"]) == EXIT_USAGE
    assert main(["purge", "--db", "sqlite:///x.db", "--batch", "0"]) == EXIT_USAGE
    assert main(["purge", "--db", "postgresql+psycopg://nobody@127.0.0.1:1/none"]) == EXIT_USAGE
    assert "cannot connect" in capsys.readouterr().err
