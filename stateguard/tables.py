"""Every table stateguard owns, on one ``MetaData``: the transition log, the
counter ledger, the stripes of striped counters, idempotency keys, consumed messages, one-time tokens,
worker leases, the outbox, and the column types they share.

Create them with the alembic revisions in ``stateguard/migrations/`` (branch
label ``stateguard``) or, without alembic, with :func:`create_tables`.  A
test compares these definitions with what the migrations create.

This module imports no feature module: the algorithms (in
:mod:`stateguard.machine`, :mod:`stateguard.counters`,
:mod:`stateguard.idempotency`, :mod:`stateguard.tokens`, :mod:`stateguard.ids`)
import their tables from here.

Times in the key tables are integer milliseconds since the Unix epoch (UTC):
integers compare the same way on every backend, with no time zone or
fractional-second precision quirks (MariaDB's ``DATETIME`` drops fractions
unless declared ``DATETIME(6)``; SQLite has no date type at all).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Final

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Connection,
    DateTime,
    Dialect,
    Engine,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    func,
    select,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.types import TypeDecorator, TypeEngine

from . import _sql, _write
from ._async import dual_connectable
from .exceptions import LockNotAcquired

__all__ = [
    "DIGEST_PREFIX",
    "MAX_KEY",
    "MAX_REF",
    "MAX_REQUEST_ID",
    "MAX_SCOPE",
    "ROW_KEY_LENGTH",
    "ExactString",
    "Utf8Text",
    "consumed_messages",
    "counter_ledger",
    "counter_stripes",
    "create_tables",
    "drop_tables",
    "exact_string",
    "fences",
    "idempotency_keys",
    "long_text",
    "metadata",
    "migrations_location",
    "outbox",
    "row_key",
    "tokens",
    "transition_log",
    "worker_leases",
]

#: The MetaData holding every stateguard table.
metadata = MetaData()

#: Longest idempotency key, message id or token accepted (characters).
MAX_KEY: Final = 255
#: Longest scope or consumer name accepted (characters).
MAX_SCOPE: Final = 200
#: Longest counter ``ref`` accepted (characters).
MAX_REF: Final = 200
#: Longest transition ``request_id`` accepted (characters).
MAX_REQUEST_ID: Final = 200


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


class Utf8Text(TypeDecorator[str]):
    """TEXT that stores any Unicode on every backend (``long=True``: more than MariaDB's 64 KiB TEXT).

    On MariaDB/MySQL a column without a charset takes the database's
    default, and a latin1 database refuses emoji and CJK (error 1366), so
    this declares ``utf8mb4`` (binary collation: stored text is compared as
    written).  Like :class:`ExactString`, stateguard's migrations use this
    type, so its DDL must never change.
    """

    impl = Text
    cache_ok = True

    def __init__(self, long: bool = False) -> None:
        super().__init__()
        self.long = long

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name in ("mysql", "mariadb"):
            kind = mysql.LONGTEXT if self.long else mysql.TEXT
            return kind(charset="utf8mb4", collation="utf8mb4_bin")
        # Not dialect.type_descriptor(Text()): that adapts TEXT to the dialect's String (VARCHAR).
        return Text()


def long_text() -> Utf8Text:
    """TEXT that holds more than MariaDB's 64 KiB ``TEXT``, in utf8mb4 there (:class:`Utf8Text`)."""
    return Utf8Text(long=True)


#: Length of the ``row_key`` columns of the transition log and the counter ledger (characters).
ROW_KEY_LENGTH: Final = 255
#: How :func:`row_key` marks a key stored as a digest (no JSON text starts with ``#``).
DIGEST_PREFIX: Final = "#sha256:"


def row_key(key: tuple[Any, ...]) -> str:
    """A primary key as stored in the log and the ledger: JSON of the key (a list for composite keys).

    Every key fits the ``row_key`` columns: the JSON with ASCII escapes
    (what stateguard always stored, so existing rows still match), else the
    JSON without escapes (a 60-character CJK code is 62 characters, not
    362), else, for keys that long, ``#sha256:`` and the hex digest of that
    JSON.  The transition log only compares row keys; the counter ledger
    reads its keys back (``release``), so a ref'd counter call refuses a key
    of the digest form (:func:`ledger_key`).
    """
    value: Any = key[0] if len(key) == 1 else list(key)
    text = json.dumps(value, separators=(",", ":"), default=str, sort_keys=True)
    if len(text) <= ROW_KEY_LENGTH:
        return text
    text = json.dumps(value, separators=(",", ":"), default=str, sort_keys=True, ensure_ascii=False)
    # A lone surrogate cannot be stored unescaped (no UTF-8 for it): digest it.
    if len(text) <= ROW_KEY_LENGTH and not _has_surrogate(text):
        return text
    return DIGEST_PREFIX + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _serial() -> Any:
    # SQLite only autoincrements an INTEGER PRIMARY KEY (a rowid alias), not a BIGINT one.
    return BigInteger().with_variant(Integer, "sqlite")


# --------------------------------------------------------------------------
# State machines: the transition log (machine/history.py)
# --------------------------------------------------------------------------

transition_log = Table(
    "stateguard_transition_log",
    metadata,
    Column("id", _serial(), primary_key=True, autoincrement=True),
    Column("model", exact_string(200), nullable=False),
    Column("machine", exact_string(100), nullable=False),
    Column("row_key", exact_string(255), nullable=False),
    Column("trigger", exact_string(100), nullable=False),
    Column("source", exact_string(100), nullable=False),
    Column("dest", exact_string(100), nullable=False),
    Column("version", Integer, nullable=True),
    Column("at", DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()),
    Column("request_id", exact_string(MAX_REQUEST_ID), nullable=True),
    Column("meta", JSON, nullable=True),
    Index("ix_stateguard_transition_log_row", "model", "machine", "row_key", "id"),
    Index(
        "uq_stateguard_transition_log_request",
        "model",
        "machine",
        "row_key",
        "trigger",
        "request_id",
        unique=True,
    ),
)

# --------------------------------------------------------------------------
# Counters: the ledger of ref'd changes (counters.py)
# --------------------------------------------------------------------------

counter_ledger = Table(
    "stateguard_counter_ledger",
    metadata,
    Column("id", _serial(), primary_key=True, autoincrement=True),
    # Byte-exact on MariaDB too: its default collation would make 'order-A' and 'order-a ' one ref.
    Column("ref", exact_string(MAX_REF), nullable=False),
    Column("table_name", exact_string(200), nullable=False),
    Column("row_key", exact_string(255), nullable=False),
    Column("column_name", exact_string(100), nullable=False),
    # The delta as exact decimal text: no float rounding on any backend.
    Column("delta", exact_string(60), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()),
    Column("released_at", DateTime(timezone=True), nullable=True),
    UniqueConstraint("ref", "table_name", "row_key", "column_name", name="uq_stateguard_counter_ledger_ref"),
)

# --------------------------------------------------------------------------
# Striped counters: one item's amount split over several rows (striped.py)
# --------------------------------------------------------------------------

counter_stripes = Table(
    "stateguard_counter_stripes",
    metadata,
    # The StripedCounter's name: several counters (stock, coupons) share the table.
    Column("counter", exact_string(100), primary_key=True),
    Column("item", exact_string(200), primary_key=True),
    # The stripe's place, spread over [0, 2**20) (stripe i of K is i * 2**20 // K), so a random
    # number in that range picks each stripe with the same chance whatever K is.
    Column("stripe", Integer, primary_key=True, autoincrement=False),
    # How many stripes the item has (the same on every row of the item): a reader whose
    # snapshot predates a restripe sees the count disagree and reads again.
    Column("stripes", Integer, nullable=False),
    Column("amount", BigInteger, nullable=False),
)

# --------------------------------------------------------------------------
# Keys: idempotency keys, consumed messages, one-time tokens, worker leases
# --------------------------------------------------------------------------

idempotency_keys = Table(
    "stateguard_idempotency_keys",
    metadata,
    Column("scope", exact_string(MAX_SCOPE), primary_key=True),
    Column("idem_key", exact_string(MAX_KEY), primary_key=True),
    # 'in_progress', 'completed' or 'failed'.
    Column("status", exact_string(16), nullable=False),
    # SHA-256 (hex) of the canonical request fingerprint; NULL when none was given.
    Column("fingerprint", exact_string(64), nullable=True),
    # The current claimant; every later write is conditional on it.
    Column("owner", exact_string(32), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("locked_until_ms", BigInteger, nullable=True),
    Column("expires_ms", BigInteger, nullable=False),
    Column("response", long_text(), nullable=True),
    Column("checkpoint_name", exact_string(100), nullable=True),
    Column("checkpoint_data", long_text(), nullable=True),
    Column("error", Utf8Text(), nullable=True),
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
    Column("token_hash", exact_string(64), primary_key=True),
    Column("scope", exact_string(MAX_SCOPE), nullable=False),
    Column("expires_ms", BigInteger, nullable=False),
    Column("consumed_ms", BigInteger, nullable=True),
    Column("created_ms", BigInteger, nullable=False),
    # The consuming call's request_id: its retry after a lost COMMIT learns it consumed the token.
    Column("consumed_by", exact_string(MAX_REQUEST_ID), nullable=True),
    Index("ix_stateguard_tokens_expires", "expires_ms"),
)

worker_leases = Table(
    "stateguard_worker_leases",
    metadata,
    Column("namespace", exact_string(100), primary_key=True),
    Column("worker_id", Integer, primary_key=True, autoincrement=False),
    Column("owner", exact_string(64), nullable=True),
    Column("lease_expires_ms", BigInteger, nullable=False),
    # At least the highest timestamp (the holder's clock) its ids have used or
    # can use before its next renewal (the exact one after close()): a new
    # holder starts after it, so ids never go backwards across a handover.
    Column("last_ms", BigInteger, nullable=False),
)


# --------------------------------------------------------------------------
# Fencing tokens of Redis locks, taken from the database (redis.py, ``fences=``)
# --------------------------------------------------------------------------

fences = Table(
    "stateguard_fences",
    metadata,
    # The lock's name, byte-exact: MariaDB's default collation would make 'Payout' and 'payout ' one lock.
    Column("name", exact_string(MAX_KEY), primary_key=True),
    # The last fencing token handed out for the name: it only ever grows, whatever Redis loses.
    Column("fence", BigInteger, nullable=False),
)


# --------------------------------------------------------------------------
# The transactional outbox (outbox.py): events stored with the transaction that caused them
# --------------------------------------------------------------------------

outbox = Table(
    "stateguard_outbox",
    metadata,
    # The event's id: its order of insertion, and the order a key's events are published in.
    Column("id", _serial(), primary_key=True, autoincrement=True),
    Column("topic", exact_string(200), nullable=False),
    # Events of one key are published in id order; NULL: no order with any other event.
    Column("key", exact_string(MAX_KEY), nullable=True),
    # The payload as JSON text written by stateguard: it reads back exactly as written on every backend.
    Column("payload", long_text(), nullable=False),
    # The database's clock (_sql.db_now_ms), like every time a lease is judged against.
    Column("created_ms", BigInteger, nullable=False),
    # A relay's claim: its token and lease end (database clock); NULL or past: free to claim.
    Column("claimed_until_ms", BigInteger, nullable=True),
    Column("claimed_by", exact_string(64), nullable=True),
    # When a relay's sink accepted the event; NULL: not published yet.
    Column("published_ms", BigInteger, nullable=True),
    # How many times a relay claimed it (more than 1: it was handed to a sink again).
    Column("attempts", Integer, nullable=False),
    # How many times the sink refused it (relay.py counts them); max_attempts of them: parked dead.
    Column("refusals", Integer, nullable=False, server_default="0"),
    # When it was parked dead (database clock): no relay claims it until requeue_dead(); NULL: alive.
    Column("dead_ms", BigInteger, nullable=True),
    # The sink's last refusal, "ErrorType: message" cut to 500 characters, for stateguard inspect.
    Column("last_error", exact_string(500), nullable=True),
    # The relay's pick: unpublished events in id order; and a key's earliest unpublished event.
    Index("ix_stateguard_outbox_pending", "published_ms", "id"),
    Index("ix_stateguard_outbox_key", "key", "published_ms", "id"),
    # Consumers deduplicate by event id: SQLite must never hand a purged event's id out again
    # (a plain INTEGER PRIMARY KEY reuses the largest rowid once its rows are deleted).
    sqlite_autoincrement=True,
)


# --------------------------------------------------------------------------
# Creating them
# --------------------------------------------------------------------------


def migrations_location() -> str:
    """The absolute path of stateguard's alembic revisions (branch label ``stateguard``).

    Add it to your alembic ``version_locations`` and run
    ``alembic upgrade stateguard@head``::

        cfg.set_main_option(
            "version_locations", f"{here}/versions {stateguard.migrations_location()}"
        )
    """
    from importlib.resources import files

    return str(files("stateguard.migrations").joinpath("versions"))


#: The lock concurrent :func:`create_tables` calls take turns on: a ``GET_LOCK`` name, and the
#: PostgreSQL advisory key derived from it the way :func:`stateguard.advisory_key` derives keys.
_CREATE_LOCK: Final = "stateguard.create_tables"
_CREATE_LOCK_KEY: Final = int.from_bytes(
    hashlib.sha256(_CREATE_LOCK.encode()).digest()[:8], "big", signed=True
)
#: Seconds a create_tables() call waits for another one's DDL (MariaDB/MySQL ``GET_LOCK``).
_CREATE_LOCK_WAIT: Final = 300


@dual_connectable
def create_tables(bind: Engine | Connection) -> None:
    """Create every stateguard table that does not exist yet (no alembic needed)::

        stateguard.create_tables(engine)              # an Engine or a Connection
        await stateguard.create_tables(async_engine)  # an AsyncEngine or AsyncConnection: awaited

    Idempotent, and safe to call from many processes at once (every worker of
    ``uvicorn --workers 4`` at start-up): the calls take turns on a lock of
    the database, and each creates what is still missing when its turn
    comes.  PostgreSQL: ``pg_advisory_xact_lock`` in the transaction of the
    DDL (all of it in one transaction; a ``Connection`` holds the lock until
    its transaction ends).  MariaDB/MySQL: ``GET_LOCK`` on the connection
    around the DDL (``LockNotAcquired`` after 300 seconds of waiting).
    SQLite: the database's write lock (``BEGIN IMMEDIATE``).
    """
    if isinstance(bind, Connection):
        _create_in_turn(bind)
        return
    with bind.connect() as conn:
        if _sql.backend(conn.dialect).named_locks == "transaction":
            # The catalog must be read after the lock is granted: at REPEATABLE READ the
            # snapshot taken by the lock's own SELECT would miss the tables the previous
            # holder committed, and the CREATE would collide with them.
            conn.execution_options(isolation_level="READ COMMITTED")
        _create_in_turn(conn)
        conn.commit()


def _create_in_turn(conn: Connection) -> None:
    """``create_all(checkfirst=True)`` under a lock that other creators of these tables take too.

    Without it, two calls both find a table missing and both CREATE it: PostgreSQL
    refuses the second with ``UniqueViolation`` on ``pg_type_typname_nsp_index`` (or
    ``DuplicateTable``), MariaDB with error 1050, SQLite with "table ... already exists".
    """
    named_locks = _sql.backend(conn.dialect).named_locks
    if named_locks == "transaction":
        if conn.get_isolation_level() == "AUTOCOMMIT":
            # Each statement is its own transaction: a transaction-level lock would end at once.
            conn.execute(select(func.pg_advisory_lock(_CREATE_LOCK_KEY)))
            try:
                metadata.create_all(conn, checkfirst=True)
            finally:
                conn.execute(select(func.pg_advisory_unlock(_CREATE_LOCK_KEY)))
            return
        # Held until this transaction ends, i.e. until the tables it creates are committed.
        conn.execute(select(func.pg_advisory_xact_lock(_CREATE_LOCK_KEY)))
        metadata.create_all(conn, checkfirst=True)
    elif named_locks == "connection":
        # DDL is not transactional here (each CREATE commits): the lock belongs to the connection.
        got = conn.execute(select(func.get_lock(_CREATE_LOCK, _CREATE_LOCK_WAIT))).scalar()
        if got != 1:
            raise LockNotAcquired(
                f"create_tables() waited {_CREATE_LOCK_WAIT} seconds for another create_tables() call "
                f"(GET_LOCK({_CREATE_LOCK!r}) returned {got!r}); find the session holding it, or retry"
            )
        try:
            metadata.create_all(conn, checkfirst=True)
        finally:
            conn.execute(select(func.release_lock(_CREATE_LOCK)))
    else:
        # SQLite: one writer at a time; hold the write lock before the first existence check.
        _write.sqlite_write_lock(conn)
        metadata.create_all(conn, checkfirst=True)


@dual_connectable
def drop_tables(bind: Engine | Connection) -> None:
    """Drop every stateguard table (for tests and teardown).

    On an Engine or a Connection it runs at once; on an AsyncEngine or AsyncConnection it is
    awaited::

        stateguard.drop_tables(engine)
        await stateguard.drop_tables(async_engine)
    """
    metadata.drop_all(bind, checkfirst=True)
