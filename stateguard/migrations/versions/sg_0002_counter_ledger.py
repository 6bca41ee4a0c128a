"""stateguard: counter ledger

Revision ID: sg_0002
Revises: sg_0001
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from stateguard.tables import ExactString

revision = "sg_0002"
down_revision = "sg_0001"
branch_labels = None
depends_on = None


def _exact(length: int) -> sa.types.TypeEngine[str]:
    # Byte-exact keys on MariaDB/MySQL too (see ExactString); the type's DDL never changes.
    return ExactString(length)


def upgrade() -> None:
    op.create_table(
        "stateguard_counter_ledger",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True
        ),
        sa.Column("ref", _exact(200), nullable=False),
        sa.Column("table_name", sa.String(200), nullable=False),
        sa.Column("row_key", _exact(255), nullable=False),
        sa.Column("column_name", sa.String(100), nullable=False),
        sa.Column("delta", sa.String(60), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.func.current_timestamp(),
        ),
        sa.Column("released_at", sa.DateTime(timezone=True), nullable=True),
        sa.UniqueConstraint(
            "ref", "table_name", "row_key", "column_name", name="uq_stateguard_counter_ledger_ref"
        ),
    )


def downgrade() -> None:
    op.drop_table("stateguard_counter_ledger")
