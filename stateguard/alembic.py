"""Alembic autogenerate support: the schema follows the declared state graphs.

Import it in your ``env.py`` and autogenerate as usual::

    # migrations/env.py
    import stateguard.alembic  # noqa: F401  (registers the comparator)
    from myapp.models import Base

    target_metadata = Base.metadata

``alembic revision --autogenerate`` then also compares, for every
:class:`~stateguard.StateMachine` on a table, the SET of states its CHECK
constraint ``ck_<table>_<column>_states`` allows (read from the reflected
text, which PostgreSQL and MariaDB spell very differently) with the declared
states, and renders ``op.drop_constraint`` + ``op.create_check_constraint``
when they differ; rows still holding a removed state are counted
(:class:`StatesInUseWarning`) and a guard rendered *before* the constraint is
touched stops the upgrade until they are moved.  On PostgreSQL it keeps the
``legal_edges=True`` trigger in step the same way.  With alembic's
``checkconstraint_byname`` plugin, pass
``include_object=stateguard.alembic.include_object``.  See
``docs/how-to/alembic.md``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from alembic.autogenerate import comparators, renderers
from alembic.autogenerate.api import AutogenContext
from alembic.autogenerate.render import render_op
from alembic.operations import ops
from sqlalchemy import column as sa_column
from sqlalchemy.sql.elements import conv

from . import _sql
from .machine import StateMachine
from .machine.ddl import (
    escape_for_text,
    is_stateguard_check,
    legal_edges_ddl,
    legal_edges_drop_ddl,
    stored_edges,
    stored_states,
)
from .schema import (
    LegalEdges,
    legal_edges_current,
    machines_for_table,
    reflect_check_states,
    reflect_legal_edges,
    undeclared_rows,
)

__all__ = ["LegalEdgesOp", "StatesCheckOp", "StatesGuardOp", "StatesInUseWarning", "include_object"]

log = logging.getLogger(__name__)

_CONTINUE: Any
try:  # alembic >= 1.18 dispatches by priority and reads the result
    from alembic.util import PriorityDispatchResult

    _CONTINUE = PriorityDispatchResult.CONTINUE
except ImportError:  # pragma: no cover - older alembic ignores the result
    _CONTINUE = None


class StatesInUseWarning(UserWarning):
    """Autogenerate found rows holding states the new CHECK constraint would refuse.

    The generated upgrade stops with the counts until those rows are moved to
    a declared state (add an ``op.execute("UPDATE ...")`` before the guard)::

        warnings.simplefilter("error", StatesInUseWarning)   # make CI fail instead
    """


def _held_text(held: dict[str, int]) -> str:
    return ", ".join(f"{state!r}: {count}" for state, count in sorted(held.items()))


# --------------------------------------------------------------------------
# Operations
# --------------------------------------------------------------------------


def _diff_tuple(
    kind: str, op: StatesCheckOp | LegalEdgesOp, before: Sequence[Any] | None, after: Sequence[Any] | None
) -> tuple[Any, ...]:
    """What ``compare_metadata`` reports for an operation on one state column: ``before -> after``."""
    return (
        kind,
        op.schema,
        op.table_name,
        op.column_name,
        None if before is None else tuple(before),
        None if after is None else tuple(after),
    )


@dataclass(eq=False)
class StatesCheckOp(ops.MigrateOperation):
    """Replace, create or drop the states CHECK constraint of one state column.

    ``states`` is what the constraint allows after the operation (``None``:
    no constraint); ``previous`` what it allowed before (``None``: there was
    none).  Rendered as alembic's own ``drop_constraint`` and
    ``create_check_constraint``::

        StatesCheckOp("orders", "status", "ck_orders_status_states",
                      states=["pending", "paid"], previous=["pending", "paid", "cancelled"])
    """

    table_name: str
    column_name: str
    constraint_name: str
    _: KW_ONLY
    states: list[str] | None
    previous: list[str] | None
    schema: str | None = None
    #: Rows per state the new constraint would refuse (what autogenerate found).
    held: dict[str, int] = field(default_factory=dict)

    def reverse(self) -> StatesCheckOp:
        return StatesCheckOp(
            self.table_name,
            self.column_name,
            self.constraint_name,
            states=self.previous,
            previous=self.states,
            schema=self.schema,
        )

    def to_diff_tuple(self) -> tuple[Any, ...]:
        return _diff_tuple("stateguard_states", self, self.previous, self.states)


@dataclass(eq=False)
class StatesGuardOp(ops.OpContainer):
    """Stop the migration while rows hold states the new CHECK constraint would refuse.

    Rendered first among the table's operations, so nothing has changed yet
    when it stops.  It comes in pairs: an ``active`` one at the start of the
    upgrade and an inactive twin at the end, which becomes the active guard
    at the start of the downgrade (alembic reverses the order).  As an empty
    container it adds nothing to ``compare_metadata`` diffs::

        StatesGuardOp("orders", "status", allowed=["pending", "paid"],
                      previous=["pending", "paid", "cancelled"], active=True, held={"cancelled": 2})
    """

    table_name: str
    column_name: str
    _: KW_ONLY
    allowed: list[str] | None
    previous: list[str] | None
    active: bool
    schema: str | None = None
    held: dict[str, int] = field(default_factory=dict)
    #: The container's operations (always empty: alembic's OpContainer needs the list).
    ops: list[ops.MigrateOperation] = field(default_factory=list, init=False, repr=False)

    @property
    def needed(self) -> bool:
        """Whether the new constraint can refuse a row the old one accepted."""
        if not self.active or self.allowed is None:
            return False
        return self.previous is None or not set(self.previous) <= set(self.allowed)

    def reverse(self) -> StatesGuardOp:
        return StatesGuardOp(
            self.table_name,
            self.column_name,
            allowed=self.previous,
            previous=self.allowed,
            active=not self.active,
            schema=self.schema,
        )


@dataclass(eq=False)
class LegalEdgesOp(ops.MigrateOperation):
    """Create, replace or drop the PostgreSQL legal-edges trigger of one state column.

    ``edges`` are the ``(source, dest)`` pairs allowed after the operation
    (``None``: no trigger); ``previous`` before it.  Rendered as
    ``op.execute`` of the SQL itself::

        LegalEdgesOp("orders", "status", edges=[("pending", "paid")], previous=None)
    """

    table_name: str
    column_name: str
    _: KW_ONLY
    edges: list[tuple[str, str]] | None
    previous: list[tuple[str, str]] | None
    schema: str | None = None

    def reverse(self) -> LegalEdgesOp:
        return LegalEdgesOp(
            self.table_name, self.column_name, edges=self.previous, previous=self.edges, schema=self.schema
        )

    def to_diff_tuple(self) -> tuple[Any, ...]:
        return _diff_tuple("stateguard_legal_edges", self, self.previous, self.edges)


# --------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------


def _describe(previous: list[str] | None, states: list[str] | None) -> str:
    if states is None:
        return "CHECK constraint dropped"
    if previous is None:
        return "CHECK constraint added: " + ", ".join(states)
    added = [s for s in states if s not in previous]
    removed = [s for s in previous if s not in states]
    parts = [f"+{s!r}" for s in added] + [f"-{s!r}" for s in removed]
    return "states " + " ".join(parts)


@renderers.dispatch_for(StatesCheckOp)
def _render_states_check(autogen_context: AutogenContext, op: StatesCheckOp) -> list[str]:
    lines = [f"# stateguard: {op.table_name}.{op.column_name}: {_describe(op.previous, op.states)}"]
    name = conv(op.constraint_name)
    if op.previous is not None:
        lines.extend(
            render_op(
                autogen_context, ops.DropConstraintOp(name, op.table_name, type_="check", schema=op.schema)
            )
        )
    if op.states is not None:
        condition = sa_column(op.column_name).in_(op.states)
        lines.extend(
            render_op(
                autogen_context,
                ops.CreateCheckConstraintOp(name, op.table_name, condition, schema=op.schema),
            )
        )
    return lines


@renderers.dispatch_for(StatesGuardOp)
def _render_states_guard(autogen_context: AutogenContext, op: StatesGuardOp) -> list[str]:
    if not op.needed or op.allowed is None:
        return []
    sa = "sa."
    table_args = repr(op.table_name) + (f", schema={op.schema!r}" if op.schema else "")
    where = f"{op.table_name}.{op.column_name}"
    lines = [
        f"# stateguard: stop before changing {where}'s CHECK constraint if rows hold a state it would refuse",
    ]
    if op.held:
        total = sum(op.held.values())
        lines.append(f"# (at autogenerate time {total} row(s) did: {_held_text(op.held)});")
        lines.append('# move them to a declared state here first, e.g. op.execute("UPDATE ...")')
    lines += [
        f"stateguard_state = {sa}cast({sa}column({op.column_name!r}), {sa}String())",
        "stateguard_held = [] if op.get_context().as_sql else op.get_bind().execute(",
        f"    {sa}select(stateguard_state, {sa}func.count())",
        f"    .select_from({sa}table({table_args}))",
        f"    .where(stateguard_state.not_in({list(op.allowed)!r}))",
        "    .group_by(stateguard_state)",
        ").all()",
        "if stateguard_held:",
        "raise RuntimeError(",
        f"    {'stateguard: rows of ' + where + ' hold states no longer declared: '!r}",
        "    f'{dict(stateguard_held)} (state: rows); move them to a declared state first'",
        ")",
        "",
    ]
    return lines


@renderers.dispatch_for(LegalEdgesOp)
def _render_legal_edges(autogen_context: AutogenContext, op: LegalEdgesOp) -> list[str]:
    where = f"{op.table_name}.{op.column_name}"
    if op.edges is None:
        lines = [f"# stateguard: drop the legal-edges trigger of {where}"]
        statements = legal_edges_drop_ddl(op.table_name, op.column_name, schema=op.schema)
    else:
        verb = "create" if op.previous is None else "replace"
        lines = [f"# stateguard: {verb} the legal-edges trigger of {where} (PostgreSQL)"]
        statements = legal_edges_ddl(op.table_name, op.column_name, op.edges, schema=op.schema)
    for sql in statements:
        sql_lines = escape_for_text(sql).split("\n")
        if len(sql_lines) == 1:
            lines.append(f"op.execute({sql_lines[0]!r})")
            continue
        lines.append("op.execute(")
        for i, part in enumerate(sql_lines):
            lines.append(f"    {part + ('' if i == len(sql_lines) - 1 else chr(10))!r}")
        lines.append(")")
    return lines


# --------------------------------------------------------------------------
# Comparing
# --------------------------------------------------------------------------


def _ordered(found: frozenset[str], declared: list[str]) -> list[str]:
    return [s for s in declared if s in found] + sorted(found - set(declared))


def _compare_check(
    autogen_context: AutogenContext,
    modify_table_ops: ops.ModifyTableOps,
    schema: str | None,
    tname: str,
    conn_table: Any,
    machine: StateMachine[Any],
) -> None:
    conn = autogen_context.connection
    if conn is None:  # offline (--sql) autogenerate: there is no database to compare with
        return
    dialect = autogen_context.dialect
    col = machine.state_column.name
    name = machine.check_constraint_name()
    found, reflected = reflect_check_states(
        conn, tname, name, schema=schema, inspector=autogen_context.inspector
    )
    if found and reflected is None:
        log.warning("stateguard: cannot read CHECK constraint %r on %r; leaving it as it is", name, tname)
        return
    declared = stored_states(machine, dialect)
    previous = _ordered(reflected, declared) if found and reflected is not None else None
    if not machine.check_constraint:
        if previous is not None:
            modify_table_ops.ops.append(
                StatesCheckOp(tname, col, name, states=None, previous=previous, schema=schema)
            )
        return
    if previous is not None and set(previous) == set(declared):
        return
    column_exists = col in conn_table.c
    held = undeclared_rows(conn, tname, col, declared, schema=schema) if column_exists else {}
    if held:
        message = (
            f"stateguard: {sum(held.values())} row(s) of {tname} hold states that {machine.qualname} "
            f"does not declare ({_held_text(held)}); the generated upgrade stops until they are "
            f"moved to a declared state"
        )
        log.warning(message)
        warnings.warn(StatesInUseWarning(message), stacklevel=2)
    check = StatesCheckOp(tname, col, name, states=declared, previous=previous, schema=schema, held=held)
    if not column_exists:
        # The column is added by this very migration: after its add_column.
        modify_table_ops.ops.append(check)
        return
    # Guard and constraint first, before any other change to the table, so a
    # guard that stops finds the table untouched (MariaDB DDL commits at once).
    guard = StatesGuardOp(
        tname, col, allowed=declared, previous=previous, active=True, schema=schema, held=held
    )
    # Inactive now; reversed (downgrade) it guards the return to ``previous``.
    twin = StatesGuardOp(tname, col, allowed=declared, previous=previous, active=False, schema=schema)
    modify_table_ops.ops[0:0] = [guard, check]
    modify_table_ops.ops.append(twin)


def _compare_table(
    autogen_context: AutogenContext,
    modify_table_ops: ops.ModifyTableOps,
    schema: str | None,
    tname: str,
    conn_table: Any,
    metadata_table: Any,
) -> Any:
    conn = autogen_context.connection
    dialect = autogen_context.dialect
    if conn is None or dialect is None:  # pragma: no cover - autogenerate always has both
        return _CONTINUE
    machines = machines_for_table(metadata_table) if metadata_table is not None else []
    with_triggers = _sql.backend(dialect).trigger_functions
    existing: dict[str, LegalEdges] = {}
    if with_triggers and conn_table is not None:
        existing = reflect_legal_edges(conn, tname, schema=schema)
    for machine in machines:
        col = machine.state_column.name
        current = existing.pop(col, None)
        if not with_triggers:
            continue
        if machine.legal_edges:
            edges = stored_edges(machine, dialect)
            if not legal_edges_current(current, tname, edges):
                previous = list(current.edges) if current is not None else None
                modify_table_ops.ops.append(
                    LegalEdgesOp(tname, col, edges=edges, previous=previous, schema=schema)
                )
        elif current is not None:
            modify_table_ops.ops.append(
                LegalEdgesOp(tname, col, edges=None, previous=list(current.edges), schema=schema)
            )
    for leftover in existing.values():
        # A machine (or its legal_edges) that is gone, or a table being dropped:
        # its function would outlive the trigger.
        modify_table_ops.ops.append(
            LegalEdgesOp(tname, leftover.column, edges=None, previous=list(leftover.edges), schema=schema)
        )
    if conn_table is not None:
        # Last, so each guard's twin ends the table's operations (and starts its downgrade).
        # A new table's CreateTableOp already carries the CHECK constraint.
        for machine in machines:
            _compare_check(autogen_context, modify_table_ops, schema, tname, conn_table, machine)
    return _CONTINUE


def include_object(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    """An ``include_object`` hook that keeps other CHECK comparators off stateguard's constraints.

    Only needed with alembic's opt-in ``alembic.ext.checkconstraint_byname``
    plugin, which would add a missing states constraint a second time::

        context.configure(..., include_object=stateguard.alembic.include_object,
                          autogenerate_plugins=["alembic.autogenerate.*",
                                                "alembic.ext.checkconstraint_byname"])
    """
    if type_ != "check_constraint":
        return True
    return not (is_stateguard_check(obj) or is_stateguard_check(compare_to))


def _register() -> None:
    try:
        comparators.dispatch_for("table", subgroup="stateguard")(_compare_table)
    except TypeError:  # pragma: no cover - alembic < 1.18 has no subgroups
        comparators.dispatch_for("table")(_compare_table)


_register()
