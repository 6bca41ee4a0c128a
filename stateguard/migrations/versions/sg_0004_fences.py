"""stateguard: fencing tokens of Redis locks taken from the database

Revision ID: sg_0004
Revises: sg_0003
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from stateguard.tables import ExactString

revision = "sg_0004"
down_revision = "sg_0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stateguard_fences",
        # Byte-exact lock names on MariaDB/MySQL too (see ExactString); the type's DDL never changes.
        sa.Column("name", ExactString(255), primary_key=True),
        sa.Column("fence", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("stateguard_fences")
