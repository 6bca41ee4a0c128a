"""stateguard: idempotency keys, consumed messages, one-time tokens, worker leases

Revision ID: sg_0003
Revises: sg_0002
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

from stateguard.tables import ExactString

revision = "sg_0003"
down_revision = "sg_0002"
branch_labels = None
depends_on = None


def _exact(length: int) -> sa.types.TypeEngine[str]:
    # Byte-exact keys on MariaDB/MySQL too (see ExactString); the type's DDL never changes.
    return ExactString(length)


def _long_text() -> sa.types.TypeEngine[str]:
    return sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")


def upgrade() -> None:
    op.create_table(
        "stateguard_idempotency_keys",
        sa.Column("scope", _exact(200), primary_key=True),
        sa.Column("idem_key", _exact(255), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=True),
        sa.Column("owner", sa.String(32), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("locked_until_ms", sa.BigInteger, nullable=True),
        sa.Column("expires_ms", sa.BigInteger, nullable=False),
        sa.Column("response", _long_text(), nullable=True),
        sa.Column("checkpoint_name", sa.String(100), nullable=True),
        sa.Column("checkpoint_data", _long_text(), nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("created_ms", sa.BigInteger, nullable=False),
        sa.Column("updated_ms", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_stateguard_idempotency_keys_expires", "stateguard_idempotency_keys", ["expires_ms"])
    op.create_table(
        "stateguard_consumed_messages",
        sa.Column("consumer", _exact(200), primary_key=True),
        sa.Column("message_id", _exact(255), primary_key=True),
        sa.Column("consumed_ms", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "stateguard_tokens",
        sa.Column("token_hash", sa.String(64), primary_key=True),
        sa.Column("scope", _exact(200), nullable=False),
        sa.Column("expires_ms", sa.BigInteger, nullable=False),
        sa.Column("consumed_ms", sa.BigInteger, nullable=True),
        sa.Column("created_ms", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_stateguard_tokens_expires", "stateguard_tokens", ["expires_ms"])
    op.create_table(
        "stateguard_worker_leases",
        sa.Column("namespace", _exact(100), primary_key=True),
        sa.Column("worker_id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("owner", sa.String(64), nullable=True),
        sa.Column("lease_expires_ms", sa.BigInteger, nullable=False),
        sa.Column("last_ms", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("stateguard_worker_leases")
    op.drop_index("ix_stateguard_tokens_expires", table_name="stateguard_tokens")
    op.drop_table("stateguard_tokens")
    op.drop_table("stateguard_consumed_messages")
    op.drop_index("ix_stateguard_idempotency_keys_expires", table_name="stateguard_idempotency_keys")
    op.drop_table("stateguard_idempotency_keys")
