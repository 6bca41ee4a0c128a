"""stateguard: every text column stores any Unicode on MariaDB/MySQL (utf8mb4, byte-exact)

On MariaDB/MySQL, columns created by sg_0001..sg_0003 without a charset took
the database's default; on a latin1 database they refused emoji and CJK
(error 1366) in responses, request ids, state names and keys.  This revision
declares utf8mb4 on each of them (ExactString / Utf8Text, as tables.py does),
which also makes request ids and row keys compare byte-exact there.  Other
databases are untouched.

Revision ID: sg_0005
Revises: sg_0004
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

from stateguard._kernel import backend
from stateguard.tables import ExactString, Utf8Text

revision = "sg_0005"
down_revision = "sg_0004"
branch_labels = None
depends_on = None

#: (table, column, length or "text"/"longtext", nullable) of every column this revision converts.
_COLUMNS: list[tuple[str, str, int | str, bool]] = [
    ("stateguard_transition_log", "model", 200, False),
    ("stateguard_transition_log", "machine", 100, False),
    ("stateguard_transition_log", "row_key", 255, False),
    ("stateguard_transition_log", "trigger", 100, False),
    ("stateguard_transition_log", "source", 100, False),
    ("stateguard_transition_log", "dest", 100, False),
    ("stateguard_transition_log", "request_id", 200, True),
    ("stateguard_counter_ledger", "table_name", 200, False),
    ("stateguard_counter_ledger", "column_name", 100, False),
    ("stateguard_counter_ledger", "delta", 60, False),
    ("stateguard_idempotency_keys", "status", 16, False),
    ("stateguard_idempotency_keys", "fingerprint", 64, True),
    ("stateguard_idempotency_keys", "owner", 32, False),
    ("stateguard_idempotency_keys", "response", "longtext", True),
    ("stateguard_idempotency_keys", "checkpoint_name", 100, True),
    ("stateguard_idempotency_keys", "checkpoint_data", "longtext", True),
    ("stateguard_idempotency_keys", "error", "text", True),
    ("stateguard_tokens", "token_hash", 64, False),
    ("stateguard_worker_leases", "owner", 64, True),
]


def _mysql() -> bool:
    # A text column without a declared charset takes the database's (MySQL/MariaDB).
    return backend(op.get_context().dialect).column_charsets


def upgrade() -> None:
    if not _mysql():
        return
    for table, column, size, nullable in _COLUMNS:
        new: sa.types.TypeEngine[str] = (
            ExactString(size) if isinstance(size, int) else Utf8Text(long=size == "longtext")
        )
        op.alter_column(table, column, type_=new, existing_nullable=nullable)


def downgrade() -> None:
    if not _mysql():
        return
    for table, column, size, nullable in _COLUMNS:
        old: sa.types.TypeEngine[str]
        if isinstance(size, int):
            old = sa.String(size)
        else:
            old = mysql.LONGTEXT() if size == "longtext" else sa.Text()
        op.alter_column(table, column, type_=old, existing_nullable=nullable)
