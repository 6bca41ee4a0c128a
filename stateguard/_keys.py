"""Table definitions of stateguard's key tables (idempotency keys, consumed
messages, one-time tokens, worker leases) and the column types they share.

The algorithms live in :mod:`stateguard.idempotency`, :mod:`stateguard.tokens`
and :mod:`stateguard.ids`; the tables are declared here, on
:data:`stateguard.tables.metadata`, so the alembic revision ``sg_0003`` and
:func:`stateguard.create_tables` agree with them (a test compares the two).

Times are stored as integer milliseconds since the Unix epoch (UTC) taken
from the application's clock: integers compare the same way on every backend,
with no time zone or fractional-second precision quirks (MariaDB's
``DATETIME`` drops fractions unless declared ``DATETIME(6)``; SQLite has no
date type at all).  Leases are tens of seconds, far above the clock skew of
NTP-synchronised hosts.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import BigInteger, Column, Dialect, Index, Integer, String, Table, Text
from sqlalchemy.dialects import mysql
from sqlalchemy.types import TypeDecorator, TypeEngine

from .tables import metadata

__all__ = [
    "MAX_KEY",
    "MAX_SCOPE",
    "ExactString",
    "consumed_messages",
    "exact_string",
    "idempotency_keys",
    "long_text",
    "tokens",
    "worker_leases",
]

#: Longest idempotency key, message id or token accepted (characters).
MAX_KEY = 255
#: Longest scope or consumer name accepted (characters).
MAX_SCOPE = 200


class ExactString(TypeDecorator[str]):
    """A VARCHAR that compares byte-exact on every backend.

    MariaDB's default collations ignore case, and its ``_bin`` collations
    still ignore trailing spaces (PAD SPACE), so ``'order-A'``, ``'order-a'``
    and ``'order-A '`` would be one unique key.  ``utf8mb4_nopad_bin``
    (MariaDB) and ``utf8mb4_0900_bin`` (MySQL 8) compare code points with no
    padding.  PostgreSQL (deterministic collations, VARCHAR keeps trailing
    spaces significant) and SQLite (``BINARY``) already compare exactly.

    A TypeDecorator rather than ``with_variant``: under a ``mysql://`` URL a
    MariaDB server is still the ``mysql`` dialect, and only the connected
    dialect knows which server it is.  stateguard's migrations use this type,
    so its DDL must never change.
    """

    impl = String
    cache_ok = True

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.length = length

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name in ("mysql", "mariadb"):
            collation = "utf8mb4_nopad_bin" if getattr(dialect, "is_mariadb", False) else "utf8mb4_0900_bin"
            return dialect.type_descriptor(mysql.VARCHAR(self.length, charset="utf8mb4", collation=collation))
        return dialect.type_descriptor(String(self.length))


def exact_string(length: int) -> ExactString:
    """A byte-exact VARCHAR(``length``); see :class:`ExactString`."""
    return ExactString(length)


def long_text() -> Any:
    """TEXT that holds more than MariaDB's 64 KiB ``TEXT``."""
    return Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")


idempotency_keys = Table(
    "stateguard_idempotency_keys",
    metadata,
    Column("scope", exact_string(MAX_SCOPE), primary_key=True),
    Column("idem_key", exact_string(MAX_KEY), primary_key=True),
    # 'in_progress', 'completed' or 'failed'.
    Column("status", String(16), nullable=False),
    # SHA-256 (hex) of the canonical request fingerprint; NULL when none was given.
    Column("fingerprint", String(64), nullable=True),
    # The current claimant; every later write is conditional on it.
    Column("owner", String(32), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("locked_until_ms", BigInteger, nullable=True),
    Column("expires_ms", BigInteger, nullable=False),
    Column("response", long_text(), nullable=True),
    Column("checkpoint_name", String(100), nullable=True),
    Column("checkpoint_data", long_text(), nullable=True),
    Column("error", Text, nullable=True),
    Column("created_ms", BigInteger, nullable=False),
    Column("updated_ms", BigInteger, nullable=False),
    Index("ix_stateguard_idempotency_keys_expires", "expires_ms"),
)

consumed_messages = Table(
    "stateguard_consumed_messages",
    metadata,
    Column("consumer", exact_string(MAX_SCOPE), primary_key=True),
    Column("message_id", exact_string(MAX_KEY), primary_key=True),
    Column("consumed_ms", BigInteger, nullable=False),
)

tokens = Table(
    "stateguard_tokens",
    metadata,
    # SHA-256 (hex) of the token: a leaked table does not leak usable tokens.
    Column("token_hash", String(64), primary_key=True),
    Column("scope", exact_string(MAX_SCOPE), nullable=False),
    Column("expires_ms", BigInteger, nullable=False),
    Column("consumed_ms", BigInteger, nullable=True),
    Column("created_ms", BigInteger, nullable=False),
    Index("ix_stateguard_tokens_expires", "expires_ms"),
)

worker_leases = Table(
    "stateguard_worker_leases",
    metadata,
    Column("namespace", exact_string(100), primary_key=True),
    Column("worker_id", Integer, primary_key=True, autoincrement=False),
    Column("owner", String(64), nullable=True),
    Column("lease_expires_ms", BigInteger, nullable=False),
    # The highest timestamp a holder has used: a new holder starts after it,
    # so ids never go backwards across a handover.
    Column("last_ms", BigInteger, nullable=False),
)
