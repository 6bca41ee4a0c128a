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

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Dialect,
    Engine,
    Index,
    Integer,
    String,
    Table,
    Text,
    bindparam,
    delete,
    insert,
    literal_column,
    select,
    tuple_,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.orm import Session
from sqlalchemy.types import TypeDecorator, TypeEngine

from . import _sql
from .exceptions import InvalidArgument
from .tables import metadata

__all__ = [
    "MAX_KEY",
    "MAX_SCOPE",
    "ExactString",
    "NewRowInsert",
    "check_batch",
    "check_text",
    "consumed_messages",
    "duration_ms",
    "exact_string",
    "idempotency_keys",
    "long_text",
    "now_ms",
    "purge_expired_rows",
    "purge_statement",
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


# --------------------------------------------------------------------------
# Helpers shared by the key modules (idempotency, tokens, ids)
# --------------------------------------------------------------------------


def now_ms() -> int:
    """The application's clock in integer epoch milliseconds."""
    return time.time_ns() // 1_000_000


def check_text(value: Any, what: str, limit: int) -> str:
    """``value`` if it is a non-blank str of at most ``limit`` characters without NUL, else InvalidArgument.

    Keys are stored as given (no stripping, no case folding), so ``"a"`` and
    ``"a "`` are two keys; a blank key is almost always a client bug.
    """
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be a str, got {type(value).__name__}")
    if not value.strip():
        raise InvalidArgument(f"{what} must not be blank, got {value!r}")
    if len(value) > limit:
        raise InvalidArgument(f"{what} is {len(value)} characters long; the limit is {limit}")
    if "\x00" in value:
        raise InvalidArgument(f"{what} must not contain NUL characters")
    return value


def duration_ms(value: Any, what: str) -> int:
    """A positive :class:`~datetime.timedelta` as whole milliseconds, else InvalidArgument."""
    if not isinstance(value, timedelta):
        raise InvalidArgument(f"{what} must be a datetime.timedelta, got {value!r}")
    ms = value // timedelta(milliseconds=1)
    if ms < 1:
        raise InvalidArgument(f"{what} must be at least 1 millisecond, got {value!r}")
    return ms


def check_batch(batch: Any) -> int:
    """``batch`` if it is a positive int, else InvalidArgument."""
    if type(batch) is not int or batch < 1:
        raise InvalidArgument(f"batch must be a positive int, got {batch!r}")
    return batch


_purges: dict[tuple[str, str, int], Any] = {}


def purge_statement(table: Table, backend: _sql.Backend, batch: int) -> Any:
    """The batched DELETE of ``table``'s expired rows (``expires_ms <= :sg_now``) for one backend."""
    cache_key = (table.name, backend.name, batch if backend.last_insert_id else 0)
    found = _purges.get(cache_key)
    if found is not None:
        return found
    expired = table.c.expires_ms <= bindparam("sg_now")
    cols = list(table.primary_key.columns)
    pk: Any = tuple_(*cols) if len(cols) > 1 else cols[0]
    stmt: Any
    if backend.name == "postgresql":
        # SKIP LOCKED: rows a claimant holds right now are left for the next
        # batch instead of making the purge wait behind it (and making the
        # claimant wait behind the purge).  The outer WHERE repeats the
        # expiry: a row updated meanwhile is re-checked before it is deleted.
        victims = (
            select(*table.primary_key.columns)
            .where(expired)
            .limit(bindparam("sg_batch"))
            .with_for_update(skip_locked=True)
        )
        stmt = delete(table).where(expired, pk.in_(victims))
    elif backend.last_insert_id:
        # MySQL/MariaDB: no LIMIT inside an IN subquery and no subquery on the
        # table being deleted from, but DELETE itself takes a LIMIT (a literal
        # in SQLAlchemy, hence one statement per batch size).
        stmt = delete(table).where(expired).with_dialect_options(mysql_limit=batch)
    else:
        rowid: Any = literal_column("rowid")
        victims = select(rowid).select_from(table).where(expired).limit(bindparam("sg_batch"))
        stmt = delete(table).where(expired, rowid.in_(victims.scalar_subquery()))
    if len(_purges) < 64:
        _purges[cache_key] = stmt
    return stmt


def purge_expired_rows(
    table: Table, bind: Engine | Connection | Session, batch: Any, clock: Callable[[], int]
) -> int:
    """Delete at most ``batch`` rows of ``table`` whose ``expires_ms`` has passed; return how many.

    With an Engine the batch runs in its own short transaction; with a
    Connection or Session in the caller's.
    """
    params = {"sg_now": clock(), "sg_batch": check_batch(batch)}
    if isinstance(bind, Engine):
        with bind.begin() as conn:
            return _purge(table, conn, params)
    conn = bind.connection() if isinstance(bind, Session) else bind
    return _purge(table, conn, params)


def _purge(table: Table, conn: Connection, params: dict[str, Any]) -> int:
    stmt = purge_statement(table, _sql.backend(conn.dialect), params["sg_batch"])
    return int(_sql.execute(conn, stmt, params).rowcount)


_MYSQL_DUPLICATE_KEY = 1062


class NewRowInsert:
    """An INSERT that reports whether it created the row or found its unique key taken.

    PostgreSQL and SQLite: ``INSERT ... ON CONFLICT DO NOTHING RETURNING``;
    the returned row, not the row count (psycopg reports -1 for a skipped
    insert), says which.  MariaDB has no exact single-statement form
    (``INSERT IGNORE`` also swallows strict-mode errors), but InnoDB rolls
    back only the failing statement on a duplicate key (error 1062), so a
    plain INSERT is tried and the transaction stays usable.  Built once per
    table and values; every value is a bound parameter.
    """

    __slots__ = ("_on_conflict", "_plain")

    def __init__(self, table: Table, values: dict[str, Any]) -> None:
        first_pk = next(iter(table.primary_key.columns))
        self._on_conflict = {
            "postgresql": postgresql.insert(table)
            .values(values)
            .on_conflict_do_nothing()
            .returning(first_pk),
            "sqlite": sqlite.insert(table).values(values).on_conflict_do_nothing().returning(first_pk),
        }
        self._plain = insert(table).values(values)

    def __call__(self, conn: Connection, params: Any) -> bool:
        """Run it; ``True`` when this statement inserted the row."""
        stmt = self._on_conflict.get(conn.dialect.name)
        if stmt is not None:
            return _sql.execute(conn, stmt, params).first() is not None
        try:
            _sql.execute(conn, self._plain, params)
        except sa_exc.IntegrityError as error:
            args = getattr(error.orig, "args", ())
            if args and args[0] == _MYSQL_DUPLICATE_KEY:
                return False
            raise
        return True
