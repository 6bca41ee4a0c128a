"""What a declared machine adds to its table's DDL, and the state values it is written in.

* the states CHECK constraint ``ck_<table>_<column>_states`` (:func:`add_states_check`),
  so the database refuses an undeclared state even from raw SQL;
* on PostgreSQL, the trigger behind ``StateMachine(..., legal_edges=True)``
  that refuses an UPDATE of the state along an undeclared edge
  (:func:`legal_edges_ddl`), created by ``metadata.create_all`` through a DDL
  event on the table (:func:`attach`) and by ``stateguard.alembic``;
* the states and edges as the state column stores them
  (:func:`stored_states`, :func:`stored_edges`);
* which machines live on a table (:func:`machines_for_table`), recorded when the
  mapper is constructed.

Reading all this back from a live database is :mod:`stateguard.schema`.
"""

from __future__ import annotations

import hashlib
import json
import re
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy import Connection, event, text
from sqlalchemy.engine import Dialect
from sqlalchemy.schema import CheckConstraint, Table
from sqlalchemy.sql.elements import conv

from .. import _kernel

if TYPE_CHECKING:
    from .declaration import StateMachine

__all__ = [
    "LEGAL_EDGES_VERSION",
    "add_states_check",
    "attach",
    "escape_for_text",
    "is_stateguard_check",
    "legal_edges_ddl",
    "legal_edges_drop_ddl",
    "legal_edges_function_ddl",
    "legal_edges_name",
    "machines_for_table",
    "read_legal_edges_marker",
    "stored_edges",
    "stored_states",
]

#: PostgreSQL's identifier limit (NAMEDATALEN - 1).
_PG_MAX_IDENTIFIER: Final = 63

#: Bumped when the generated trigger function changes shape, so autogenerate replaces old ones.
LEGAL_EDGES_VERSION: Final = 1
_MARKER: Final = "-- stateguard legal_edges "

_machines_by_table: weakref.WeakKeyDictionary[Table, list[StateMachine[Any]]] = weakref.WeakKeyDictionary()


# --------------------------------------------------------------------------
# Machines by table
# --------------------------------------------------------------------------


def attach(machine: StateMachine[Any]) -> None:
    """Record a bound machine on its table, with the legal-edges DDL events when it asks for them."""
    tbl = machine.state_column.table
    if not isinstance(tbl, Table):
        return
    known = _machines_by_table.setdefault(tbl, [])
    if machine in known:
        return
    known.append(machine)
    if machine.legal_edges:
        _attach_legal_edges_ddl(tbl, machine)


def machines_for_table(tbl: Table) -> list[StateMachine[Any]]:
    """The bound machines whose state column lives in ``tbl``, in declaration order.

    ::

        machines_for_table(Order.__table__)   # [<StateMachine Order.flow on 'status': 3 triggers>]
    """
    return list(_machines_by_table.get(tbl, ()))


# --------------------------------------------------------------------------
# States and edges as stored
# --------------------------------------------------------------------------


def _stored(machine: StateMachine[Any], dialect: Dialect | None, state: Any) -> str:
    value = machine.codec.to_db(state)
    if dialect is not None:
        # An Enum column stores the member's name (or its value with
        # values_callable): its bind processor knows which.
        proc = machine.state_column.type.bind_processor(dialect)
        if proc is not None:
            value = proc(value)
    elif hasattr(value, "name") and not isinstance(value, str | int):
        value = value.name
    return str(value)


def stored_states(machine: StateMachine[Any], dialect: Dialect | None = None) -> list[str]:
    """The declared states as the state column stores them, in declaration order.

    ::

        stored_states(Order.flow)            # ['pending', 'paid', 'shipped', 'cancelled']
        stored_states(Lamp.flow, dialect)    # ['RED', 'GREEN', 'BLUE'] (an Enum column stores names)
    """
    return [_stored(machine, dialect, s) for s in machine.states]


def stored_edges(machine: StateMachine[Any], dialect: Dialect | None = None) -> list[tuple[str, str]]:
    """The declared ``(source, dest)`` pairs as stored, sorted, without self-loops.

    An unchanged state is always allowed, so self-loops add nothing::

        stored_edges(Order.flow)
        # [('paid', 'cancelled'), ('paid', 'shipped'), ('pending', 'cancelled'), ('pending', 'paid')]
    """
    pairs: set[tuple[str, str]] = set()
    for trigger in machine.triggers.values():
        for edge in trigger.edges:
            dest = _stored(machine, dialect, edge.dest)
            for src in edge.sources:
                source = _stored(machine, dialect, src)
                if source != dest:
                    pairs.add((source, dest))
    return sorted(pairs)


# --------------------------------------------------------------------------
# The states CHECK constraint
# --------------------------------------------------------------------------


def add_states_check(machine: StateMachine[Any]) -> None:
    """Add ``ck_<table>_<column>_states`` (the declared states) to the state column's table, once."""
    # The database refuses an undeclared state even from raw SQL.  conv()
    # keeps a metadata naming convention from renaming the constraint, so
    # the alembic comparator (stateguard.alembic) can find it by name.
    col = machine.state_column
    table = col.table
    name = machine.check_constraint_name()
    for existing in getattr(table, "constraints", ()):
        if isinstance(existing, CheckConstraint) and existing.name == name:
            return
    values = [machine.codec.to_db(s) for s in machine.states]
    table.append_constraint(
        CheckConstraint(col.in_(values), name=conv(name), info={_kernel.INFO_KEY: "states"})
    )


def is_stateguard_check(constraint: Any) -> bool:
    """Whether a constraint is the states CHECK a :class:`StateMachine` added (or a copy of it).

    Copies lose ``info`` (alembic rebuilds constraints from their SQL), so
    the name of any known machine's constraint counts too::

        is_stateguard_check(next(c for c in Order.__table__.constraints if c.name.endswith("_states")))
    """
    if constraint is None:
        return False
    info = getattr(constraint, "info", None) or {}
    if info.get(_kernel.INFO_KEY) == "states":
        return True
    name = getattr(constraint, "name", None)
    if not isinstance(name, str):
        return False
    return any(
        m.check_constraint and m.check_constraint_name() == name
        for machines in list(_machines_by_table.values())
        for m in machines
    )


# --------------------------------------------------------------------------
# PostgreSQL legal-edges trigger
# --------------------------------------------------------------------------


def legal_edges_name(table_name: str, column_name: str) -> str:
    """``sg_<table>_<column>_edges``: the trigger's and its function's name (shortened past 63 characters).

    ::

        legal_edges_name("orders", "status")   # 'sg_orders_status_edges'
    """
    name = f"sg_{table_name}_{column_name}_edges"
    if len(name) <= _PG_MAX_IDENTIFIER:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    return f"{name[: _PG_MAX_IDENTIFIER - 11]}_{digest}"


def _quote(dialect: Dialect, name: str) -> str:
    return dialect.identifier_preparer.quote(name)


def _qualified(dialect: Dialect, name: str, schema: str | None) -> str:
    return f"{_quote(dialect, schema)}.{_quote(dialect, name)}" if schema else _quote(dialect, name)


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _pg_dialect() -> Dialect:
    from sqlalchemy.dialects import postgresql

    return postgresql.dialect()  # type: ignore[no-untyped-call]


def legal_edges_function_ddl(
    table_name: str, column_name: str, edges: Sequence[tuple[str, str]], *, schema: str | None = None
) -> str:
    """``CREATE OR REPLACE FUNCTION``: the trigger function that refuses undeclared edges.

    ::

        print(legal_edges_function_ddl("orders", "status", [("pending", "paid")]))
    """
    d = _pg_dialect()
    name = legal_edges_name(table_name, column_name)
    col = _quote(d, column_name)
    marker = json.dumps(
        {"v": LEGAL_EDGES_VERSION, "column": column_name, "edges": [list(e) for e in edges]},
        ensure_ascii=True,
    )
    where = f"{table_name}.{column_name}"
    if edges:
        pairs = ", ".join(f"({_literal(s)}, {_literal(t)})" for s, t in edges)
        allowed = f"COALESCE((OLD.{col}::text, NEW.{col}::text) IN ({pairs}), false)"
        hint = "declared transitions: " + ", ".join(f"{s} -> {t}" for s, t in edges)
    else:
        allowed = "false"
        hint = "no transition changes the state"
    # No % (offline SQL output would show it doubled) and quote_nullable for
    # NULL states; check_violation makes it an IntegrityError like the CHECK.
    return (
        f"CREATE OR REPLACE FUNCTION {_qualified(d, name, schema)}() RETURNS trigger\n"
        f"LANGUAGE plpgsql AS $stateguard$\n"
        f"{_MARKER}{marker}\n"
        f"BEGIN\n"
        f"    IF NOT {allowed} THEN\n"
        f"        RAISE EXCEPTION USING\n"
        f"            ERRCODE = 'check_violation',\n"
        f"            CONSTRAINT = {_literal(name)},\n"
        f"            MESSAGE = 'stateguard: ' || quote_nullable(OLD.{col}::text) || ' -> ' "
        f"|| quote_nullable(NEW.{col}::text) || ' is not a declared transition of ' || "
        f"{_literal(where)},\n"
        f"            HINT = {_literal(hint)};\n"
        f"    END IF;\n"
        f"    RETURN NEW;\n"
        f"END\n"
        f"$stateguard$"
    )


def read_legal_edges_marker(source: str) -> tuple[str, tuple[tuple[str, str], ...], int] | None:
    """``(column, edges, version)`` from the marker comment in a legal-edges function's body, or ``None``."""
    found = None
    for line in source.splitlines():
        if not line.startswith(_MARKER):
            continue
        try:
            data = json.loads(line[len(_MARKER) :])
            found = str(data["column"]), tuple((str(s), str(t)) for s, t in data["edges"]), int(data["v"])
        except (ValueError, KeyError, TypeError):
            continue
    return found


def legal_edges_ddl(
    table_name: str, column_name: str, edges: Sequence[tuple[str, str]], *, schema: str | None = None
) -> list[str]:
    """The statements that create the legal-edges function and its trigger (PostgreSQL).

    The trigger fires only when the state changes (``WHEN (OLD.s IS DISTINCT
    FROM NEW.s)``), so other updates of the row pay nothing::

        for sql in legal_edges_ddl("orders", "status", stored_edges(Order.flow)):
            conn.execute(text(sql))
    """
    d = _pg_dialect()
    name = legal_edges_name(table_name, column_name)
    col = _quote(d, column_name)
    return [
        legal_edges_function_ddl(table_name, column_name, edges, schema=schema),
        f"DROP TRIGGER IF EXISTS {_quote(d, name)} ON {_qualified(d, table_name, schema)}",
        f"CREATE TRIGGER {_quote(d, name)} BEFORE UPDATE ON {_qualified(d, table_name, schema)}\n"
        f"FOR EACH ROW WHEN (OLD.{col} IS DISTINCT FROM NEW.{col})\n"
        f"EXECUTE FUNCTION {_qualified(d, name, schema)}()",
    ]


def legal_edges_drop_ddl(table_name: str, column_name: str, *, schema: str | None = None) -> list[str]:
    """The statements that drop the legal-edges trigger and its function (PostgreSQL).

    ::

        legal_edges_drop_ddl("orders", "status")
        # ['DROP TRIGGER IF EXISTS sg_orders_status_edges ON orders',
        #  'DROP FUNCTION IF EXISTS sg_orders_status_edges()']
    """
    d = _pg_dialect()
    name = legal_edges_name(table_name, column_name)
    return [
        f"DROP TRIGGER IF EXISTS {_quote(d, name)} ON {_qualified(d, table_name, schema)}",
        f"DROP FUNCTION IF EXISTS {_qualified(d, name, schema)}()",
    ]


_BIND_LIKE: Final = re.compile(r"(?<![:\w\\]):(?=\w)")


def escape_for_text(sql: str) -> str:
    """Escape colons that :func:`sqlalchemy.text` would read as bind parameters (``'a:b'``).

    ::

        conn.execute(text(escape_for_text("SELECT 'a:b'")))
    """
    return _BIND_LIKE.sub(r"\\:", sql)


def _attach_legal_edges_ddl(tbl: Table, machine: StateMachine[Any]) -> None:
    col_name = machine.state_column.name

    def after_create(target: Table, connection: Connection, **kw: Any) -> None:
        if not _kernel.backend(connection.dialect).trigger_functions:
            return
        edges = stored_edges(machine, connection.dialect)
        for sql in legal_edges_ddl(target.name, col_name, edges, schema=target.schema):
            connection.execute(text(escape_for_text(sql)))

    def after_drop(target: Table, connection: Connection, **kw: Any) -> None:
        # The trigger went with the table; the function would outlive it.
        if not _kernel.backend(connection.dialect).trigger_functions:
            return
        name = legal_edges_name(target.name, col_name)
        d = connection.dialect
        connection.execute(text(f"DROP FUNCTION IF EXISTS {_qualified(d, name, target.schema)}()"))

    event.listen(tbl, "after_create", after_create)
    event.listen(tbl, "after_drop", after_drop)
