"""What the database should hold for a declared :class:`StateMachine`, and how to read it back.

Shared by :mod:`stateguard.alembic` (autogenerate) and ``stateguard check``:

* the machines mapped onto a table (:func:`machines_for_table`) or found in a
  module (:func:`machines_in_module`);
* the states as the database stores them (:func:`stored_states`) and the set
  a reflected CHECK constraint allows (:func:`parse_check_states`), compared
  as sets, because PostgreSQL hands the constraint back as
  ``((status)::text = ANY ((ARRAY['pending'::character varying, ...])::text[]))``
  and MariaDB as ``` `status` in ('pending',...)```;
* rows holding undeclared states (:func:`undeclared_rows`);
* the PostgreSQL trigger behind ``StateMachine(..., legal_edges=True)``
  (:func:`legal_edges_ddl`, :func:`reflect_legal_edges`), also created by
  ``metadata.create_all`` through a DDL event on the table.
"""

from __future__ import annotations

import hashlib
import json
import re
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Final

from sqlalchemy import Connection, String, cast, column, event, func, select, table, text
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Mapper
from sqlalchemy.schema import Table
from sqlalchemy.sql.elements import ColumnClause

from . import _sql
from .machine import StateMachine, machines_of

__all__ = [
    "LegalEdges",
    "escape_for_text",
    "is_stateguard_check",
    "legal_edges_current",
    "legal_edges_ddl",
    "legal_edges_drop_ddl",
    "legal_edges_function_ddl",
    "legal_edges_name",
    "machines_for_table",
    "machines_in_module",
    "parse_check_states",
    "reflect_check_states",
    "reflect_legal_edges",
    "stored_edges",
    "stored_states",
    "undeclared_rows",
]

#: PostgreSQL's identifier limit (NAMEDATALEN - 1).
_PG_MAX_IDENTIFIER: Final = 63

#: Bumped when the generated trigger function changes shape, so autogenerate replaces old ones.
_LEGAL_EDGES_VERSION: Final = 1
_MARKER: Final = "-- stateguard legal_edges "

_machines_by_table: weakref.WeakKeyDictionary[Table, list[StateMachine[Any]]] = weakref.WeakKeyDictionary()


# --------------------------------------------------------------------------
# Finding machines
# --------------------------------------------------------------------------


@event.listens_for(Mapper, "after_mapper_constructed")
def _register(mapper: Mapper[Any], cls: type[Any]) -> None:
    # Registered after machine.py's own listener (this module imports it), so
    # the machines are bound by the time this runs.
    for machine in machines_of(cls):
        col = getattr(machine, "state_column", None)
        if machine.model is None or col is None or not isinstance(col.table, Table):
            continue
        tbl = col.table
        known = _machines_by_table.setdefault(tbl, [])
        if machine in known:
            continue
        known.append(machine)
        if machine.legal_edges:
            _attach_legal_edges_ddl(tbl, machine)


def machines_for_table(tbl: Table) -> list[StateMachine[Any]]:
    """The bound machines whose state column lives in ``tbl``, in declaration order.

    ::

        machines_for_table(Order.__table__)   # [<StateMachine Order.flow on 'status': 3 triggers>]
    """
    return list(_machines_by_table.get(tbl, ()))


def machines_in_module(module: ModuleType) -> list[StateMachine[Any]]:
    """Every bound machine of every mapped class reachable as a module attribute.

    A class imported into the module counts too (a ``models`` package that
    re-exports its models is checked as a whole); each machine appears once::

        import myapp.models
        [m.name for m in machines_in_module(myapp.models)]   # ['flow']
    """
    found: list[StateMachine[Any]] = []
    for value in list(vars(module).values()):
        if not isinstance(value, type):
            continue
        for machine in machines_of(value):
            if machine.model is value and machine not in found:
                found.append(machine)
    return found


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
# CHECK constraints
# --------------------------------------------------------------------------

_QUOTED: Final = re.compile(r"'((?:[^'\\]|''|\\.)*)'", re.DOTALL)
_QUOTED_STANDARD: Final = re.compile(r"'((?:[^']|'')*)'", re.DOTALL)
_NUMBER: Final = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w.])")
_BACKSLASH: Final = re.compile(r"\\(.)", re.DOTALL)


def parse_check_states(sqltext: str, *, backslash_escapes: bool = False) -> frozenset[str] | None:
    """The set of values an ``IN (...)`` CHECK constraint allows, as strings, or ``None``.

    Reads the literals out of whatever form the database reflects, so the
    comparison is about states, never about SQL spelling.
    ``backslash_escapes`` is for MySQL/MariaDB, whose reflected text escapes
    quotes as ``\\'``::

        parse_check_states("((status)::text = ANY ((ARRAY['pending'::character varying, "
                           "'paid'::character varying])::text[]))")   # frozenset({'pending', 'paid'})
        parse_check_states("`status` in ('pending','paid')", backslash_escapes=True)
        parse_check_states("((status)::text = 'paid'::text)")          # frozenset({'paid'})
    """
    pattern = _QUOTED if backslash_escapes else _QUOTED_STANDARD
    strings: list[str] = []
    for raw in pattern.findall(sqltext):
        value = raw.replace("''", "'")
        if backslash_escapes:
            value = _BACKSLASH.sub(r"\1", value)
        strings.append(value)
    if strings:
        return frozenset(strings)
    # Integer-valued states: only when there is no string literal, because a
    # cast such as ``varchar(20)`` would otherwise look like a state.
    numbers = _NUMBER.findall(pattern.sub(" ", sqltext))
    return frozenset(numbers) if numbers else None


def reflect_check_states(
    conn: Connection, table_name: str, name: str, *, schema: str | None = None, inspector: Any = None
) -> tuple[bool, frozenset[str] | None]:
    """``(found, states)`` of the CHECK constraint ``name`` on a live table.

    ``states`` is ``None`` when the constraint exists but is not an ``IN``
    list stateguard can read::

        reflect_check_states(conn, "orders", "ck_orders_status_states")
        # (True, frozenset({'pending', 'paid', 'shipped', 'cancelled'}))
    """
    from sqlalchemy import inspect as sa_inspect

    insp = inspector if inspector is not None else sa_inspect(conn)
    try:
        checks = insp.get_check_constraints(table_name, schema=schema)
    except NotImplementedError:  # pragma: no cover - every supported dialect reflects them
        return False, None
    wanted = name.lower()
    for ck in checks:
        if (ck.get("name") or "").lower() == wanted:
            mysql = conn.dialect.name in ("mysql", "mariadb")
            return True, parse_check_states(str(ck.get("sqltext") or ""), backslash_escapes=mysql)
    return False, None


def undeclared_rows(
    conn: Connection,
    table_name: str,
    column_name: str,
    declared: Iterable[str],
    *,
    schema: str | None = None,
) -> dict[str, int]:
    """How many rows hold each state outside ``declared`` (NULL is not counted, as CHECK allows it).

    One ``SELECT state, COUNT(*) ... WHERE state NOT IN (...) GROUP BY state``;
    the column is compared as text, so native enum columns work too::

        undeclared_rows(conn, "orders", "status", ["pending", "paid"])   # {'cancelled': 2}
    """
    col: ColumnClause[Any] = column(column_name)
    as_text = cast(col, String())
    tbl = table(table_name, col, schema=schema)
    values = list(declared)
    stmt = select(as_text, func.count()).select_from(tbl).where(col.is_not(None)).group_by(as_text)
    if values:
        stmt = stmt.where(as_text.not_in(values))
    return {str(state): int(count) for state, count in conn.execute(stmt).all()}


# --------------------------------------------------------------------------
# PostgreSQL legal-edges trigger
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class LegalEdges:
    """A legal-edges trigger found on a live PostgreSQL table.

    ``edges`` are the ``(source, dest)`` pairs its function allows, read back
    from the marker comment stateguard writes into the function body::

        found = reflect_legal_edges(conn, "orders")["status"]
        found.trigger, found.edges   # ('sg_orders_status_edges', (('paid', 'shipped'), ...))
    """

    table: str
    column: str
    edges: tuple[tuple[str, str], ...]
    trigger: str
    function: str
    version: int


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
        {"v": _LEGAL_EDGES_VERSION, "column": column_name, "edges": [list(e) for e in edges]},
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


_REFLECT_TRIGGERS: Final = text(
    "SELECT t.tgname, p.proname, p.prosrc FROM pg_trigger t "
    "JOIN pg_class c ON c.oid = t.tgrelid "
    "JOIN pg_namespace n ON n.oid = c.relnamespace "
    "JOIN pg_proc p ON p.oid = t.tgfoid "
    "WHERE NOT t.tgisinternal AND c.relname = :table "
    "AND n.nspname = COALESCE(:schema, current_schema()) "
    "ORDER BY t.tgname"
)


def reflect_legal_edges(
    conn: Connection, table_name: str, *, schema: str | None = None
) -> dict[str, LegalEdges]:
    """stateguard's legal-edges triggers on a live PostgreSQL table, by state column.

    Empty on other databases::

        reflect_legal_edges(conn, "orders")["status"].edges   # (('paid', 'shipped'), ...)
    """
    if conn.dialect.name != "postgresql":
        return {}
    found: dict[str, LegalEdges] = {}
    for tgname, proname, prosrc in conn.execute(_REFLECT_TRIGGERS, {"table": table_name, "schema": schema}):
        for line in str(prosrc or "").splitlines():
            if not line.startswith(_MARKER):
                continue
            try:
                data = json.loads(line[len(_MARKER) :])
                col = str(data["column"])
                edges = tuple((str(s), str(t)) for s, t in data["edges"])
                version = int(data["v"])
            except (ValueError, KeyError, TypeError):
                continue
            found[col] = LegalEdges(table_name, col, edges, str(tgname), str(proname), version)
    return found


def legal_edges_current(found: LegalEdges | None, table_name: str, edges: Sequence[tuple[str, str]]) -> bool:
    """Whether a reflected trigger allows exactly ``edges`` and is of the current shape and name.

    ::

        legal_edges_current(reflect_legal_edges(conn, "orders").get("status"), "orders",
                            stored_edges(Order.flow, conn.dialect))   # True
    """
    if found is None:
        return False
    name = legal_edges_name(table_name, found.column)
    return (
        found.version == _LEGAL_EDGES_VERSION
        and set(found.edges) == set(edges)
        and found.trigger == name
        and found.function == name
    )


def _attach_legal_edges_ddl(tbl: Table, machine: StateMachine[Any]) -> None:
    col_name = machine.state_column.name

    def after_create(target: Table, connection: Connection, **kw: Any) -> None:
        if connection.dialect.name != "postgresql":
            return
        edges = stored_edges(machine, connection.dialect)
        for sql in legal_edges_ddl(target.name, col_name, edges, schema=target.schema):
            connection.execute(text(escape_for_text(sql)))

    def after_drop(target: Table, connection: Connection, **kw: Any) -> None:
        # The trigger went with the table; the function would outlive it.
        if connection.dialect.name != "postgresql":
            return
        name = legal_edges_name(target.name, col_name)
        d = connection.dialect
        connection.execute(text(f"DROP FUNCTION IF EXISTS {_qualified(d, name, target.schema)}()"))

    event.listen(tbl, "after_create", after_create)
    event.listen(tbl, "after_drop", after_drop)


def is_stateguard_check(constraint: Any) -> bool:
    """Whether a constraint is the states CHECK a :class:`StateMachine` added (or a copy of it).

    Copies lose ``info`` (alembic rebuilds constraints from their SQL), so
    the name of any known machine's constraint counts too::

        is_stateguard_check(next(c for c in Order.__table__.constraints if c.name.endswith("_states")))
    """
    if constraint is None:
        return False
    info = getattr(constraint, "info", None) or {}
    if info.get(_sql.INFO_KEY) == "states":
        return True
    name = getattr(constraint, "name", None)
    if not isinstance(name, str):
        return False
    return any(
        m.check_constraint and m.check_constraint_name() == name
        for machines in list(_machines_by_table.values())
        for m in machines
    )
