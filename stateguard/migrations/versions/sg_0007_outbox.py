"""stateguard: the transactional outbox

``emit()`` (and state machines with ``events=True``) store an event in the
transaction that caused it; a ``Relay`` claims, publishes and marks it.

Revision ID: sg_0007
Revises: sg_0006
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from stateguard.tables import ExactString, Utf8Text

revision = "sg_0007"
down_revision = "sg_0006"
branch_labels = None
depends_on = None


def _serial() -> sa.types.TypeEngine[int]:
    # SQLite only autoincrements an INTEGER PRIMARY KEY (a rowid alias), not a BIGINT one.
    return sa.BigInteger().with_variant(sa.Integer, "sqlite")


def upgrade() -> None:
    op.create_table(
        "stateguard_outbox",
        sa.Column("id", _serial(), primary_key=True, autoincrement=True),
        sa.Column("topic", ExactString(200), nullable=False),
        sa.Column("key", ExactString(255), nullable=True),
        sa.Column("payload", Utf8Text(long=True), nullable=False),
        sa.Column("created_ms", sa.BigInteger, nullable=False),
        sa.Column("claimed_until_ms", sa.BigInteger, nullable=True),
        sa.Column("claimed_by", ExactString(64), nullable=True),
        sa.Column("published_ms", sa.BigInteger, nullable=True),
        sa.Column("attempts", sa.Integer, nullable=False),
        # Consumers deduplicate by event id: SQLite must never reuse a purged event's id.
        sqlite_autoincrement=True,
    )
    op.create_index("ix_stateguard_outbox_pending", "stateguard_outbox", ["published_ms", "id"])
    op.create_index("ix_stateguard_outbox_key", "stateguard_outbox", ["key", "published_ms", "id"])


def downgrade() -> None:
    op.drop_index("ix_stateguard_outbox_key", table_name="stateguard_outbox")
    op.drop_index("ix_stateguard_outbox_pending", table_name="stateguard_outbox")
    op.drop_table("stateguard_outbox")
