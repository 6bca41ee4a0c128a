"""stateguard: transition log

Revision ID: sg_0001
Revises:
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "sg_0001"
down_revision = None
branch_labels = ("stateguard",)
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stateguard_transition_log",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True
        ),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("machine", sa.String(100), nullable=False),
        sa.Column("row_key", sa.String(255), nullable=False),
        sa.Column("trigger", sa.String(100), nullable=False),
        sa.Column("source", sa.String(100), nullable=False),
        sa.Column("dest", sa.String(100), nullable=False),
        sa.Column("version", sa.Integer, nullable=True),
        sa.Column(
            "at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.current_timestamp()
        ),
        sa.Column("request_id", sa.String(200), nullable=True),
        sa.Column("meta", sa.JSON, nullable=True),
    )
    op.create_index(
        "ix_stateguard_transition_log_row",
        "stateguard_transition_log",
        ["model", "machine", "row_key", "id"],
    )
    op.create_index(
        "uq_stateguard_transition_log_request",
        "stateguard_transition_log",
        ["model", "machine", "row_key", "trigger", "request_id"],
        unique=True,
    )


def downgrade() -> None:
    op.drop_index("uq_stateguard_transition_log_request", table_name="stateguard_transition_log")
    op.drop_index("ix_stateguard_transition_log_row", table_name="stateguard_transition_log")
    op.drop_table("stateguard_transition_log")
