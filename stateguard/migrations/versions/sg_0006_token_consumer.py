"""stateguard: the request id that consumed a one-time token

``consume_token(..., request_id=...)`` stores it, so a retry after a lost
COMMIT learns that its first attempt consumed the token (REPEATED with
``same_request``).

Revision ID: sg_0006
Revises: sg_0005
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from stateguard.tables import ExactString

revision = "sg_0006"
down_revision = "sg_0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("stateguard_tokens", sa.Column("consumed_by", ExactString(200), nullable=True))


def downgrade() -> None:
    op.drop_column("stateguard_tokens", "consumed_by")
