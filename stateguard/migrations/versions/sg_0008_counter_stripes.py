"""stateguard: the stripes of striped counters

``StripedCounter`` splits an item's amount over several rows of this table,
so several buyers can take stock of one hot item at once.

Revision ID: sg_0008
Revises: sg_0007
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from stateguard.tables import ExactString

revision = "sg_0008"
down_revision = "sg_0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stateguard_counter_stripes",
        sa.Column("counter", ExactString(100), primary_key=True),
        sa.Column("item", ExactString(200), primary_key=True),
        sa.Column("stripe", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("stripes", sa.Integer, nullable=False),
        sa.Column("amount", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("stateguard_counter_stripes")
