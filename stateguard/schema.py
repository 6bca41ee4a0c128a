"""Read the database back for a declared :class:`StateMachine`.

Shared by :mod:`stateguard.alembic` (autogenerate) and ``stateguard check``:

* the machines mapped onto a table (:func:`machines_for_table`, recorded by
  :mod:`stateguard.machine.ddl` when the mapper is built) or found in a module
  (:func:`machines_in_module`);
* the set a reflected CHECK constraint allows (:func:`parse_check_states`,
  :func:`reflect_check_states`), compared with the declared states as sets,
  because PostgreSQL hands the constraint back as
  ``((status)::text = ANY ((ARRAY['pending'::character varying, ...])::text[]))``
  and MariaDB as ``` `status` in ('pending',...)```;
* rows holding undeclared states (:func:`undeclared_rows`);
* the PostgreSQL legal-edges triggers on a table (:func:`reflect_legal_edges`,
  :func:`legal_edges_current`).

What the database *should* hold (the CHECK constraint, the legal-edges DDL,
the states as stored) is :mod:`stateguard.machine.ddl`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Final

from sqlalchemy import Connection, String, cast, column, func, select, table, text
from sqlalchemy.sql.elements import ColumnClause

from . import _kernel
from .machine import StateMachine, machines_of
from .machine.ddl import LEGAL_EDGES_VERSION, legal_edges_name, machines_for_table, read_legal_edges_marker

__all__ = [
    "LegalEdges",
    "legal_edges_current",
    "machines_for_table",
    "machines_in_module",
    "parse_check_states",
    "reflect_check_states",
    "reflect_legal_edges",
    "undeclared_rows",
]


# --------------------------------------------------------------------------
# Finding machines
# --------------------------------------------------------------------------


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
            escapes = _kernel.backend(conn.dialect).backslash_escapes
            return True, parse_check_states(str(ck.get("sqltext") or ""), backslash_escapes=escapes)
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
    if not _kernel.backend(conn.dialect).trigger_functions:
        return {}
    found: dict[str, LegalEdges] = {}
    for tgname, proname, prosrc in conn.execute(_REFLECT_TRIGGERS, {"table": table_name, "schema": schema}):
        marker = read_legal_edges_marker(str(prosrc or ""))
        if marker is not None:
            col, edges, version = marker
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
        found.version == LEGAL_EDGES_VERSION
        and set(found.edges) == set(edges)
        and found.trigger == name
        and found.function == name
    )
