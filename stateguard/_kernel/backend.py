"""What stateguard knows about a database: one :class:`Backend` of named capabilities per dialect.

Every dialect difference a guarded write makes is a field here, computed once
per dialect by one constructor per dialect family (:meth:`Backend.for_postgresql`,
:meth:`~Backend.for_mysql`, :meth:`~Backend.for_sqlite`, :meth:`~Backend.for_other`),
so the rest of stateguard asks ``backend.row_locks``, never ``dialect.name``.
Facts that depend on the server rather than the dialect (a MariaDB Galera
node, the server version's ``FOR UPDATE`` options, a column type's integer
range there) are read here too, once per engine.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, fields
from typing import Any, Final

from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.schema import Column
from sqlalchemy.sql import sqltypes
from sqlalchemy.types import TypeDecorator

__all__ = [
    "POSTGRESQL_FAMILY",
    "Backend",
    "backend",
    "exact_collation",
    "integer_bounds",
    "is_galera",
    "numeric_digits",
    "row_lock_minimums",
]

#: Dialects that speak PostgreSQL's SQL for every statement stateguard builds.
POSTGRESQL_FAMILY: Final = ("postgresql", "cockroachdb")
#: The MySQL family: MySQL and MariaDB (a MariaDB server under a ``mysql://`` URL is ``mysql``).
_MYSQL_FAMILY: Final = ("mysql", "mariadb")


@dataclass(frozen=True, slots=True, eq=False)
class Backend:
    """What stateguard needs to know about one dialect: named capabilities, not dialect names.

    Build one with the constructor of its dialect family; :func:`backend` does,
    and interns the result: one instance exists per distinct set of fields, so
    a Backend is a cheap, identity-hashed memo key that does not grow with the
    number of engines.

    ::

        backend(engine.dialect).returning      # UPDATE ... RETURNING works here
    """

    #: The dialect's name (``"postgresql"``, ``"mysql"``, ``"mariadb"``, ``"sqlite"`` ...), for
    #: messages, observation events and SQLAlchemy's ``dialect_name=`` hints; never compared.
    name: str
    #: ``"postgresql"`` (PostgreSQL, CockroachDB), ``"mysql"`` (MySQL, MariaDB), ``"sqlite"`` or
    #: ``"other"``: where an algorithm really forks, the module of its dialect family is picked by it.
    family: str
    #: ``UPDATE ... RETURNING`` works (PostgreSQL, SQLite >= 3.35).
    returning: bool
    #: ``SET v = LAST_INSERT_ID(v + 1)`` hands the new value back in the OK packet
    #: (``cursor.lastrowid``) without another round trip (MySQL/MariaDB).
    last_insert_id: bool
    #: A plain SELECT inside a REPEATABLE READ transaction reads the transaction's snapshot
    #: (InnoDB), while an UPDATE reads the latest committed row: a read that must see what an
    #: UPDATE (or a duplicate-key INSERT) just saw is ``FOR UPDATE`` (MySQL/MariaDB).
    fresh_read_needs_lock: bool
    #: A locking read or an UPDATE locks every row its plan visits, matched or not, and the gaps
    #: between them, until COMMIT (InnoDB): statements naming rows by key are held to the primary
    #: key (``FORCE INDEX (PRIMARY)``) or name the rows one by one (MySQL/MariaDB).
    locks_scanned_rows: bool
    #: ``INSERT ... ON DUPLICATE KEY UPDATE`` is the upsert (MySQL/MariaDB).
    on_duplicate_key: bool
    #: ``INSERT ... ON CONFLICT DO NOTHING`` exists (PostgreSQL, SQLite).
    on_conflict: bool
    #: ``SELECT ... FOR UPDATE`` exists (SQLite has one writer instead).
    row_locks: bool
    #: Python's sqlite3 sends no BEGIN before a SAVEPOINT or a SELECT (legacy transaction control).
    driver_begins_lazily: bool
    #: A batched DELETE takes its LIMIT as a literal (MySQL/MariaDB: no LIMIT inside an IN subquery).
    delete_limit_literal: bool
    #: How the server's named (advisory) locks are held: ``"transaction"`` (PostgreSQL's
    #: ``pg_advisory_xact_lock``), ``"connection"`` (``GET_LOCK``), or ``""`` (none: SQLite,
    #: CockroachDB).
    named_locks: str
    #: A list of keys binds as one ARRAY parameter (PostgreSQL's ``= ANY(:keys)``), so a
    #: statement's text does not depend on how many keys it takes.
    array_params: bool
    #: ``CREATE FUNCTION ... RETURNS trigger`` (PL/pgSQL, PostgreSQL), where the legal-edges
    #: trigger of a state machine lives.
    trigger_functions: bool
    #: ``LISTEN``/``NOTIFY`` exist, delivered on commit (PostgreSQL; not CockroachDB): the outbox
    #: wakes its relays with them.
    listen_notify: bool
    #: ``synchronous_commit`` can be turned off for one transaction (PostgreSQL): the relay's
    #: claim and mark do not wait for a WAL flush.
    commit_without_flush: bool
    #: COMMIT can wait for a synchronous standby (``synchronous_commit = remote_apply`` and
    #: ``synchronous_standby_names``, PostgreSQL; not CockroachDB): ``durability="replicated"``.
    synchronous_standbys: bool
    #: String literals in reflected SQL escape quotes with a backslash (MySQL/MariaDB).
    backslash_escapes: bool
    #: An ``UPDATE``/``INSERT ... RETURNING`` may stand in a ``WITH`` clause, so two writes are
    #: one statement (PostgreSQL).
    dml_cte: bool
    #: A statement longer than the server's ``max_allowed_packet`` is refused and the connection
    #: dropped (MySQL/MariaDB): a large text is measured before it is sent.
    packet_limit: bool
    #: Default collations ignore case and trailing spaces (MySQL/MariaDB): ``'SKU-A'`` finds the
    #: row ``'sku-a'``, so a text key may have to be read back in the row's own spelling.
    folds_text: bool
    #: A text column without a declared charset takes the database's, which may not hold all of
    #: Unicode (MySQL/MariaDB): stateguard's own text columns declare ``utf8mb4``.
    column_charsets: bool
    #: Any integer is stored in up to 8 bytes whatever the declared type (SQLite): the declared
    #: type's range is applied anyway, so a model tested here refuses what production refuses.
    loose_integers: bool
    #: The server may be a node of a Galera cluster (MariaDB/MySQL with ``wsrep_on``), asked once
    #: per engine (:func:`is_galera`): there a node applies the others' writes late, and
    #: stateguard makes its connections wait for them (``wsrep_sync_wait``).
    may_be_galera: bool
    #: A statement that fails inside a transaction aborts it: every later statement is refused
    #: until ROLLBACK (PostgreSQL).  A refusal that must leave the transaction usable is asked
    #: without an error there (``row_lock(nowait=True)`` locks with SKIP LOCKED and then looks).
    errors_abort_transaction: bool

    @classmethod
    def for_postgresql(cls, name: str, *, returning: bool = True) -> Backend:
        """PostgreSQL, and dialects that speak its SQL (CockroachDB).

        CockroachDB (sqlalchemy-cockroachdb, a PGDialect subclass) speaks
        PostgreSQL's SQL for everything stateguard writes: UPDATE/INSERT ...
        RETURNING, ON CONFLICT DO NOTHING, = ANY(array), DML in a WITH clause,
        FOR UPDATE [NOWAIT | SKIP LOCKED].  It has no pg_advisory_xact_lock
        (``named_locks`` ``""``) and no PL/pgSQL trigger functions before 24.3,
        so the legal-edges trigger is not installed there.
        """
        postgres = name == "postgresql"
        return cls(
            name=name,
            family="postgresql",
            returning=returning,
            on_conflict=True,
            row_locks=True,
            named_locks="transaction" if postgres else "",
            array_params=True,
            trigger_functions=postgres,
            listen_notify=postgres,
            commit_without_flush=postgres,
            synchronous_standbys=postgres,
            dml_cte=True,
            driver_begins_lazily=False,
            loose_integers=False,
            errors_abort_transaction=True,
            **_NOT_INNODB,
        )

    @classmethod
    def for_mysql(cls, name: str) -> Backend:
        """MySQL and MariaDB (InnoDB)."""
        return cls(
            name=name,
            family="mysql",
            returning=False,
            last_insert_id=True,
            fresh_read_needs_lock=True,
            locks_scanned_rows=True,
            on_duplicate_key=True,
            on_conflict=False,
            row_locks=True,
            driver_begins_lazily=False,
            delete_limit_literal=True,
            named_locks="connection",
            array_params=False,
            trigger_functions=False,
            listen_notify=False,
            commit_without_flush=False,
            synchronous_standbys=False,
            backslash_escapes=True,
            dml_cte=False,
            packet_limit=True,
            folds_text=True,
            column_charsets=True,
            loose_integers=False,
            may_be_galera=True,
            errors_abort_transaction=False,
        )

    @classmethod
    def for_sqlite(cls, name: str = "sqlite", *, returning: bool = True) -> Backend:
        """SQLite (``returning``: the library is 3.35 or later)."""
        return cls(
            name=name,
            family="sqlite",
            returning=returning,
            on_conflict=True,
            row_locks=False,
            driver_begins_lazily=True,
            named_locks="",
            array_params=False,
            trigger_functions=False,
            listen_notify=False,
            commit_without_flush=False,
            synchronous_standbys=False,
            dml_cte=False,
            loose_integers=True,
            errors_abort_transaction=False,
            **_NOT_INNODB,
        )

    @classmethod
    def for_other(cls, name: str, *, returning: bool = False) -> Backend:
        """A dialect stateguard was not written for: only what every SQL database has."""
        return cls(
            name=name,
            family="other",
            returning=returning,
            on_conflict=False,
            row_locks=True,
            named_locks="",
            array_params=False,
            trigger_functions=False,
            listen_notify=False,
            commit_without_flush=False,
            synchronous_standbys=False,
            dml_cte=False,
            driver_begins_lazily=False,
            loose_integers=False,
            **_NOT_INNODB,
        )


#: The fields only the MySQL family sets, all off: what the other families' constructors share.
_NOT_INNODB: Final[dict[str, Any]] = {
    "last_insert_id": False,
    "fresh_read_needs_lock": False,
    "locks_scanned_rows": False,
    "on_duplicate_key": False,
    "delete_limit_literal": False,
    "backslash_escapes": False,
    "packet_limit": False,
    "folds_text": False,
    "column_charsets": False,
    "may_be_galera": False,
}


_interned: dict[tuple[Any, ...], Backend] = {}
# Weak keys: an engine (and its dialect) that the application drops leaves nothing behind.
_backends: weakref.WeakKeyDictionary[Dialect, Backend] = weakref.WeakKeyDictionary()
_backends_lock = threading.Lock()
_FIELDS: Final = tuple(f.name for f in fields(Backend))


#: The last dialect asked about and its Backend: nearly every application has one
#: engine, and a hit here skips the weak-key lookup (which builds a weakref per call).
_last: tuple[Dialect | None, Backend | None] = (None, None)


def backend(dialect: Dialect) -> Backend:
    """The :class:`Backend` for a (connected) dialect."""
    global _last
    last_dialect, last_backend = _last
    if dialect is last_dialect and last_backend is not None:
        return last_backend
    found = _backends.get(dialect)
    if found is None:
        name = dialect.name
        returning = bool(dialect.update_returning)
        if name in _MYSQL_FAMILY:
            made = Backend.for_mysql(name)
        elif name == "sqlite":
            made = Backend.for_sqlite(name, returning=returning)
        elif name in POSTGRESQL_FAMILY:
            made = Backend.for_postgresql(name, returning=returning)
        else:
            made = Backend.for_other(name, returning=returning)
        flags = tuple(getattr(made, field) for field in _FIELDS)
        with _backends_lock:
            found = _interned.get(flags)
            if found is None:
                found = _interned[flags] = made
            _backends[dialect] = found
    _last = (dialect, found)
    return found


# --------------------------------------------------------------------------
# Facts about the server, read once per dialect (one engine)
# --------------------------------------------------------------------------

_galera: weakref.WeakKeyDictionary[Dialect, bool] = weakref.WeakKeyDictionary()


def is_galera(conn: Connection) -> bool:
    """Whether ``conn`` talks to a node of a MariaDB Galera cluster (``wsrep_on`` is ``ON``).

    Read once per engine (``SHOW GLOBAL VARIABLES``, which every MySQL-family server answers,
    unlike ``@@wsrep_on``), on the first call that needs it; never asked of other databases.
    What changes on a Galera node: ``GET_LOCK`` is local to the node (advisory_lock refuses it),
    a conflicting write on another node surfaces as error 1213 at COMMIT (DeadlockDetected), and
    a node applies the others' writes late, so stateguard raises ``wsrep_sync_wait`` on the
    connections it writes through (``ensure_causal_writes`` in :mod:`.execute`).
    """
    dialect = conn.dialect
    found = _galera.get(dialect)
    if found is None:
        if dialect.name not in _MYSQL_FAMILY:
            found = False
        else:
            row = conn.exec_driver_sql("SHOW GLOBAL VARIABLES LIKE 'wsrep_on'").first()
            found = row is not None and str(row[1]).upper() == "ON"
        _galera[dialect] = found
    return found


def row_lock_minimums(dialect: Dialect) -> tuple[str, dict[str, tuple[int, ...] | None]] | None:
    """The server's name and the first version supporting each ``FOR UPDATE`` option.

    ``None`` when every option works (PostgreSQL) or the dialect has no row
    locks to configure (SQLite); a ``None`` version means "never" (MariaDB
    has no ``FOR UPDATE OF``).
    """
    if dialect.name not in _MYSQL_FAMILY:
        return None
    if getattr(dialect, "is_mariadb", False):
        return "MariaDB", {"nowait": (10, 3), "skip_locked": (10, 6), "of": None}
    return "MySQL", {"nowait": (8, 0, 1), "skip_locked": (8, 0, 1), "of": (8, 0, 1)}


def exact_collation(dialect: Dialect) -> str | None:
    """The binary ``utf8mb4`` collation that compares text as written on this server (``None``:
    the dialect's text compares exactly already).

    Read from the connected dialect: under a ``mysql://`` URL a MariaDB
    server is still the ``mysql`` dialect, and only the connection knows
    which server it is (MariaDB has no ``utf8mb4_0900_bin``, MySQL no
    ``utf8mb4_nopad_bin``).
    """
    if dialect.name not in _MYSQL_FAMILY:
        return None
    return "utf8mb4_nopad_bin" if getattr(dialect, "is_mariadb", False) else "utf8mb4_0900_bin"


def integer_bounds(column: Column[Any], dialect: Dialect) -> tuple[int, int] | None:
    """The smallest and largest integer ``column`` holds on ``dialect``, or ``None`` if it is no integer.

    The declared type decides, in the dialect's own form on the servers
    (``with_variant`` included): PostgreSQL ``INTEGER`` is 32-bit and refuses
    a wider bound parameter with an error that aborts the transaction;
    MySQL/MariaDB have 8-, 16-, 24-, 32- and 64-bit types, signed or
    ``UNSIGNED``.  SQLite stores any integer in up to 8 bytes, but a model
    tested on SQLite must refuse what its production database will refuse,
    so there the declared type's range applies too (a ``BigInteger`` with
    an ``Integer`` variant for SQLite's rowid stays 64-bit).
    """
    impl: Any = column.type if backend(dialect).loose_integers else column.type.dialect_impl(dialect)
    if isinstance(impl, TypeDecorator):
        impl = impl.impl_instance
    if not isinstance(impl, sqltypes.Integer):
        return None
    if isinstance(impl, sqltypes.BigInteger):
        bits = 64
    elif isinstance(impl, sqltypes.SmallInteger):
        bits = 16
    else:
        bits = _MYSQL_INTEGER_BITS.get(type(impl).__name__, 32)
    if getattr(impl, "unsigned", False):
        return 0, (1 << bits) - 1
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def numeric_digits(column: Column[Any]) -> tuple[int | None, int] | None:
    """``(precision, scale)`` of a fixed-point ``Numeric`` column, or ``None`` (floats and unscaled ones)."""
    impl: Any = column.type
    if isinstance(impl, TypeDecorator):
        impl = impl.impl_instance
    if not isinstance(impl, sqltypes.Numeric) or isinstance(impl, sqltypes.Float):
        return None
    scale = getattr(impl, "scale", None)
    if scale is None:
        return None
    return getattr(impl, "precision", None), int(scale)


#: MySQL's integer types narrower than INTEGER, by type name.
_MYSQL_INTEGER_BITS: Final = {"TINYINT": 8, "MEDIUMINT": 24}
