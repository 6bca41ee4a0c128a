"""stateguard: dead outbox events

A relay counts the sink's refusals of an event (``refusals``, with the last
error in ``last_error``) and parks an event refused ``max_attempts`` times
(``dead_ms``): no relay claims it until ``requeue_dead()`` or ``stateguard
outbox requeue`` gives it back.

Revision ID: sg_0009
Revises: sg_0008
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from stateguard.tables import ExactString

revision = "sg_0009"
down_revision = "sg_0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # SQLite adds a NOT NULL column only with a default; existing events have been refused 0 times.
    op.add_column("stateguard_outbox", sa.Column("refusals", sa.Integer, nullable=False, server_default="0"))
    op.add_column("stateguard_outbox", sa.Column("dead_ms", sa.BigInteger, nullable=True))
    op.add_column("stateguard_outbox", sa.Column("last_error", ExactString(500), nullable=True))


def downgrade() -> None:
    # SQLite 3.35+ drops a column in place (an ALTER TABLE), keeping the table's AUTOINCREMENT.
    op.drop_column("stateguard_outbox", "last_error")
    op.drop_column("stateguard_outbox", "dead_ms")
    op.drop_column("stateguard_outbox", "refusals")
