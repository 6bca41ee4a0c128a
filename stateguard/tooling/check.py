"""``stateguard check``: a linter of declared state machines and of what the database holds.

:func:`check_declaration` needs no database (unreachable states, dead ends,
triggers that can never apply ...); :func:`check_database` compares one
machine with its table (the states CHECK constraint, rows holding
undeclared states, PostgreSQL's legal-edges trigger).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import Connection

from .._kernel import backend
from ..machine import StateMachine
from ..machine.ddl import stored_edges, stored_states
from ..schema import legal_edges_current, reflect_check_states, reflect_legal_edges, undeclared_rows
from ..versioning import column_role

__all__ = ["PROBLEM", "WARNING", "Finding", "check_database", "check_declaration"]

# --------------------------------------------------------------------------
# Checks (``stateguard check``)
# --------------------------------------------------------------------------

PROBLEM: Final = "problem"
WARNING: Final = "warning"


@dataclass(frozen=True)
class Finding:
    """One thing ``stateguard check`` found about a machine.

    ``level`` is ``"problem"`` (exit code 1) or ``"warning"``; ``code`` is a
    stable identifier for scripts (``unreachable_state``, ``undeclared_rows``,
    ...); ``state``, ``trigger`` and ``rows`` are set where they apply::

        Finding("problem", "undeclared_rows", "Order", "flow", "orders", "status",
                "2 row(s) hold 'lost', which is not declared", state="lost", rows=2)
    """

    level: str
    code: str
    model: str
    machine: str
    table: str
    column: str
    message: str
    state: str | None = None
    trigger: str | None = None
    rows: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The finding as a JSON-ready dict (keys that do not apply are left out).

        ::

            json.dumps([f.as_dict() for f in check_declaration(Order.flow)])
        """
        data = {
            "level": self.level,
            "code": self.code,
            "model": self.model,
            "machine": self.machine,
            "table": self.table,
            "column": self.column,
            "message": self.message,
            "state": self.state,
            "trigger": self.trigger,
            "rows": self.rows,
        }
        return {k: v for k, v in data.items() if v is not None}


def _where(machine: StateMachine[Any]) -> tuple[str, str, str, str]:
    model = machine.model.__name__ if machine.model is not None else "?"
    col = machine.state_column
    return model, machine.name, str(getattr(col.table, "name", "?")), str(col.name)


def _finals(machine: StateMachine[Any]) -> tuple[set[str], list[str]]:
    declared = getattr(machine.model, "__stateguard_final__", None)
    if declared is None:
        return set(), []
    if isinstance(declared, dict):
        declared = declared.get(machine.name, ())
    if isinstance(declared, str):
        declared = (declared,)
    names = [machine.codec.name(s) if not isinstance(s, str) else s for s in declared]
    known = {machine.codec.name(s) for s in machine.states}
    return {n for n in names if n in known}, [n for n in names if n not in known]


def check_declaration(machine: StateMachine[Any]) -> list[Finding]:
    """What is wrong with a declared graph, without a database.

    Problems: states that cannot be reached from the initial state, triggers
    none of whose sources can be reached, names in ``__stateguard_final__``
    that are not states.  Warnings: states with no way out that are not
    listed as final in the model's ``__stateguard_final__`` (a collection of
    state names, or ``{machine name: names}``)::

        class Order(Base):
            __stateguard_final__ = ("shipped", "cancelled")
            ...

        check_declaration(Order.flow)   # []
    """
    model, mname, tname, cname = _where(machine)

    def finding(level: str, code: str, message: str, **kw: Any) -> Finding:
        return Finding(level, code, model, mname, tname, cname, message, **kw)

    name = machine.codec.name
    states = [name(s) for s in machine.states]
    initial = str(machine.graph.initial)
    outgoing: dict[str, set[str]] = {s: set() for s in states}
    for trigger in machine.triggers.values():
        for edge in trigger.edges:
            for src in edge.sources:
                outgoing[name(src)].add(name(edge.dest))
    reachable = {initial}
    todo = [initial]
    while todo:
        for nxt in outgoing[todo.pop()]:
            if nxt not in reachable:
                reachable.add(nxt)
                todo.append(nxt)
    found: list[Finding] = []
    for s in states:
        if s not in reachable:
            found.append(
                finding(
                    PROBLEM, "unreachable_state", f"state {s!r} cannot be reached from {initial!r}", state=s
                )
            )
    for trigger in machine.triggers.values():
        sources = [name(src) for edge in trigger.edges for src in edge.sources]
        if not any(src in reachable for src in sources):
            found.append(
                finding(
                    PROBLEM,
                    "trigger_never_fires",
                    f"trigger {trigger.name!r} has no reachable source state (sources: {', '.join(sources)})",
                    trigger=trigger.name,
                )
            )
    finals, unknown = _finals(machine)
    for n in unknown:
        found.append(
            finding(
                PROBLEM, "unknown_final", f"__stateguard_final__ names {n!r}, which is not a state", state=n
            )
        )
    for s in states:
        exits = outgoing[s] - {s}
        if not exits and s not in finals:
            found.append(
                finding(
                    WARNING,
                    "no_way_out",
                    f"state {s!r} has no way out (final?); list it in __stateguard_final__ to say so",
                    state=s,
                )
            )
        elif exits and s in finals:
            found.append(
                finding(WARNING, "final_has_exits", f"final state {s!r} has transitions out", state=s)
            )
    return found


def check_database(conn: Connection, machine: StateMachine[Any]) -> list[Finding]:
    """How a live database differs from what ``machine`` declares.

    Problems: a missing table or column, a missing or outdated states CHECK
    constraint, a missing version or fence column, rows holding undeclared
    states (with counts), a missing or outdated legal-edges trigger on
    PostgreSQL.  Warnings: ``legal_edges`` on a database other than
    PostgreSQL, a CHECK constraint stateguard cannot read::

        with engine.connect() as conn:
            check_database(conn, Order.flow)   # [] when the schema is current
    """
    from sqlalchemy import inspect as sa_inspect

    model, mname, tname, cname = _where(machine)
    tbl = machine.state_column.table
    schema_name = getattr(tbl, "schema", None)

    def finding(level: str, code: str, message: str, **kw: Any) -> Finding:
        return Finding(level, code, model, mname, tname, cname, message, **kw)

    insp = sa_inspect(conn)
    if not insp.has_table(tname, schema=schema_name):
        return [finding(PROBLEM, "missing_table", f"table {tname!r} does not exist")]
    columns = {c["name"] for c in insp.get_columns(tname, schema=schema_name)}
    found: list[Finding] = []
    if cname not in columns:
        return [finding(PROBLEM, "missing_column", f"state column {tname}.{cname} does not exist")]
    for col in getattr(tbl, "columns", ()):
        role = column_role(col)
        if role in ("version", "fence") and col.name not in columns:
            found.append(
                finding(
                    PROBLEM,
                    f"missing_{role}_column",
                    f"{role} column {tname}.{col.name} does not exist (autogenerate a migration to add it)",
                )
            )
    dialect = conn.dialect
    declared = stored_states(machine, dialect)
    if machine.check_constraint:
        name = machine.check_constraint_name()
        present, states = reflect_check_states(conn, tname, name, schema=schema_name, inspector=insp)
        if not present:
            found.append(finding(PROBLEM, "missing_check_constraint", f"CHECK constraint {name} is missing"))
        elif states is None:
            found.append(
                finding(WARNING, "unreadable_check_constraint", f"cannot read CHECK constraint {name}")
            )
        elif set(states) != set(declared):
            extra = sorted(states - set(declared))
            missing = [s for s in declared if s not in states]
            found.append(
                finding(
                    PROBLEM,
                    "outdated_check_constraint",
                    f"CHECK constraint {name} is outdated: it lacks {missing or 'nothing'} and "
                    f"still allows {extra or 'nothing more'}",
                )
            )
    for state, count in undeclared_rows(conn, tname, cname, declared, schema=schema_name).items():
        found.append(
            finding(
                PROBLEM,
                "undeclared_rows",
                f"{count} row(s) hold {state!r}, which {model}.{mname} does not declare",
                state=state,
                rows=count,
            )
        )
    # Where the legal-edges trigger can live (PL/pgSQL: PostgreSQL; CockroachDB has none to check).
    if backend(dialect).trigger_functions:
        current = reflect_legal_edges(conn, tname, schema=schema_name).get(cname)
        if machine.legal_edges and not legal_edges_current(current, tname, stored_edges(machine, dialect)):
            code = "missing_legal_edges" if current is None else "outdated_legal_edges"
            what = "missing" if current is None else "outdated"
            found.append(finding(PROBLEM, code, f"the legal-edges trigger of {tname}.{cname} is {what}"))
        elif not machine.legal_edges and current is not None:
            found.append(
                finding(
                    WARNING,
                    "unexpected_legal_edges",
                    f"a legal-edges trigger on {tname}.{cname} remains, but {model}.{mname} "
                    f"does not declare legal_edges=True",
                )
            )
    elif machine.legal_edges:
        found.append(
            finding(
                WARNING,
                "legal_edges_unsupported",
                f"legal_edges=True is enforced on PostgreSQL only, not on {backend(dialect).name}",
            )
        )
    return found
