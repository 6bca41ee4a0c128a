"""On a MariaDB database whose default charset is latin1, stateguard's tables store any Unicode.

Columns declared without a charset take the database's default; on latin1
a response with emoji, a CJK request id or an exception message with emoji
failed with raw error 1366.  Every text column of stateguard's tables now
declares utf8mb4, through create_tables() and through the migrations.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from stateguard import Outcome, consume_once, create_tables, idempotent
from stateguard.tables import metadata
from tests._support.models import Base, Invoice
from tests.conftest import Backend

UNICODE = "注文-🎉-Ωμέγα"


@pytest.fixture
def latin1(mariadb: Backend) -> Iterator[Engine]:
    """A throwaway MariaDB database created with DEFAULT CHARACTER SET latin1."""
    name = f"sgt_latin1_{uuid.uuid4().hex[:8]}"
    admin = mariadb.engine
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE `{name}` CHARACTER SET latin1 COLLATE latin1_swedish_ci"))
    url = make_url(mariadb.url).set(database=name)
    engine = create_engine(url)
    try:
        yield engine
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))


def _non_utf8mb4_columns(engine: Engine) -> list[tuple[str, str, str]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT table_name, column_name, character_set_name FROM information_schema.columns "
                "WHERE table_schema = DATABASE() AND table_name LIKE 'stateguard\\_%' "
                "AND character_set_name IS NOT NULL AND character_set_name <> 'utf8mb4'"
            )
        ).all()
    return [tuple(r) for r in rows]  # type: ignore[misc]


def test_create_tables_declares_utf8mb4_on_every_text_column(latin1: Engine) -> None:
    """No text column of stateguard's tables takes the latin1 default."""
    create_tables(latin1)
    assert _non_utf8mb4_columns(latin1) == []


def test_migrations_declare_utf8mb4_on_every_text_column(latin1: Engine, tmp_path: Path) -> None:
    """alembic upgrade stateguard@head leaves no latin1 text column either (sg_0005 converts sg_0001..3's)."""
    from alembic import command

    from tests.schema.test_migrations import _config

    cfg = _config(tmp_path, latin1.url.render_as_string(hide_password=False))
    command.upgrade(cfg, "stateguard@sg_0004")
    assert _non_utf8mb4_columns(latin1) != []  # what older revisions left on a latin1 database
    command.upgrade(cfg, "stateguard@head")
    assert _non_utf8mb4_columns(latin1) == []
    assert {t.name for t in metadata.sorted_tables} <= set(
        latin1.connect().execute(text("SHOW TABLES")).scalars().all()
    )
    command.downgrade(cfg, "stateguard@base")


def test_unicode_responses_request_ids_and_messages_are_stored(latin1: Engine) -> None:
    """Emoji and CJK in an idempotent response, a request id, metadata and a message id round-trip."""
    create_tables(latin1)
    Base.metadata.create_all(latin1)
    with Session(latin1) as s, s.begin():
        s.add(Invoice(id=1))
    with Session(latin1) as s, s.begin():
        with idempotent(s, scope=UNICODE, key=UNICODE) as call:
            call.complete({"message": UNICODE})
        r = Invoice.flow.fire(s, "send", 1, request_id=UNICODE, metadata={"note": UNICODE})
        assert r.outcome is Outcome.APPLIED
        assert consume_once(s, UNICODE, UNICODE).outcome is Outcome.APPLIED
    with Session(latin1) as s, s.begin():
        with idempotent(s, scope=UNICODE, key=UNICODE) as call:
            assert call.replayed and call.response == {"message": UNICODE}
        assert Invoice.flow.fire(s, "send", 1, request_id=UNICODE).same_request
        [entry] = Invoice.flow.history(s, 1)
        assert entry.request_id == UNICODE and entry.metadata == {"note": UNICODE}
    Base.metadata.drop_all(latin1)


def test_the_latin1_fixture_really_is_latin1(latin1: Engine) -> None:
    """The database's default charset is latin1, so the tests above test something."""
    with latin1.connect() as conn:
        assert conn.execute(text("SELECT @@character_set_database")).scalar_one() == "latin1"
