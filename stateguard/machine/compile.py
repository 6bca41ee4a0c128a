"""The statements a trigger runs, built once per backend and call variant.

Each trigger compiles to::

    UPDATE t SET <values>, version = version + 1, state = :dest
    WHERE pk = :pk AND state IN (:sources) [AND <where guard>] [AND version = :expected]
          [AND (fence IS NULL OR fence <= :fence)]

and the affected-row count decides the outcome (``docs/explanation/schemes.md``).
Built statements are kept in :data:`stateguard._write.memo`, keyed by the
trigger, the interned :class:`~stateguard._sql.Backend` and the call variant
(which values are set, whether a version or fence is checked), so an
application with an engine per tenant builds each statement once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import ColumnElement, Update, and_, case, literal, or_, select, update
from sqlalchemy.schema import Column

from .. import _sql, _write
from ..exceptions import InvalidArgument

if TYPE_CHECKING:
    from .declaration import StateMachine
    from .trigger import Trigger

__all__ = ["Plan", "build", "lock_statement", "parts", "plan", "read_statement"]

Items = tuple[tuple[str, Column[Any], Any], ...]


class Plan:
    """A compiled trigger statement for one backend and one call variant.

    ``returning``: the UPDATE hands back a ``RETURNING`` row (the version
    and, for a trigger with several destinations, the new state); otherwise
    the affected-row count decides, and with ``uses_last_insert_id`` MySQL's
    ``LAST_INSERT_ID`` carries the new version.
    """

    __slots__ = ("returning", "returns_state", "stmt", "uses_last_insert_id")

    def __init__(self, stmt: Update, returns_state: bool, returns_version: bool, lid: bool) -> None:
        self.stmt = stmt
        self.returns_state = returns_state
        self.uses_last_insert_id = lid
        self.returning = returns_state or (returns_version and not lid)


def _needed(column: Column[Any] | None, info: _sql.ModelInfo, role: str) -> Column[Any]:
    """The model's version or fence column; InvalidArgument when a call needs one the model lacks."""
    if column is None:
        raise InvalidArgument(f"{info.model.__name__} has no {role} column; declare one with {role}_column()")
    return column


def parts(
    trigger: Trigger,
    backend: _sql.Backend | None,
    items: Items,
    *,
    embed: bool,
    fence: bool = False,
    bound: Mapping[str, Any] | None = None,
    last_insert_id: bool = True,
) -> tuple[list[tuple[Any, Any]], ColumnElement[bool], bool]:
    """The SET pairs and the state condition shared by single and bulk statements.

    Returns ``(pairs, condition, uses_last_insert_id)``.
    """
    m = trigger.machine
    info = m.info
    state_col = m.state_column
    model = info.model
    to_db = m.codec.to_db
    edges = trigger.edges
    conds: list[ColumnElement[bool]] = []
    for edge in edges:
        sources = [to_db(s) for s in edge.sources]
        # One source: a plain equality, whose compiled form SQLAlchemy
        # caches; IN takes an expanding parameter that is rendered again
        # at every execution (measurably slower on the hot path).
        cond: ColumnElement[bool] = state_col == sources[0] if len(sources) == 1 else state_col.in_(sources)
        if edge.where is not None:
            cond = and_(cond, edge.where(model))
        conds.append(cond)
    single = len(edges) == 1
    pairs: list[tuple[Any, Any]] = []
    # Declared per-edge values, then call-time values.  MySQL evaluates SET
    # assignments left to right with the *new* values of earlier columns,
    # so the state is assigned last: every expression sees the old state.
    declared: dict[Column[Any], list[tuple[ColumnElement[bool], Any]]] = {}
    for edge, cond in zip(edges, conds, strict=True):
        for attr, value in edge.values.items():
            declared.setdefault(info.column_by_attr[attr], []).append((cond, value))
    call_cols = {col for _, col, _ in items}
    for col, whens in declared.items():
        if col in call_cols:
            continue
        if single:
            pairs.append((col, whens[0][1]))
        else:
            pairs.append((col, case(*whens, else_=col)))
    pairs.extend(_sql.set_clause(items, embed=embed))
    vcol = info.version_column
    lid = False
    if vcol is not None:
        if backend is None or not last_insert_id:
            pairs.append((vcol, vcol + 1))
        else:
            pairs.append((vcol, _sql.version_increment(vcol, backend)))
            lid = backend.last_insert_id
    if fence:
        fcol = _needed(info.fence_column, info, "fence")
        fence_value = None if bound is None else bound["sg_fence"]
        pairs.append((fcol, _sql.bindparam("sg_fence", fence_value, type_=fcol.type)))
    if single:
        pairs.append((state_col, to_db(edges[0].dest)))
    else:
        # Typed as the column: a raw Enum member is no value SQLite or MariaDB can bind.
        whens_state = [(c, literal(to_db(e.dest), state_col.type)) for c, e in zip(conds, edges, strict=True)]
        pairs.append((state_col, case(*whens_state, else_=state_col)))
    return pairs, conds[0] if single else or_(*conds), lid


def build(
    trigger: Trigger,
    backend: _sql.Backend | None,
    items: Items,
    expected: bool,
    embed: bool,
    bound: Mapping[str, Any] | None = None,
    fence: bool = False,
) -> Plan:
    """The trigger's UPDATE for ``backend`` (``None``: the portable statement)."""
    m = trigger.machine
    info = m.info
    state_col = m.state_column
    single = len(trigger.edges) == 1
    vcol = info.version_column
    fcol = info.fence_column
    pairs, state_cond, lid = parts(trigger, backend, items, embed=embed, fence=fence, bound=bound)
    pk_where = info.pk_where if bound is None else info.bound_pk_where(bound)
    where = [pk_where, state_cond]
    if expected:
        vcol = _needed(vcol, info, "version")
        expected_value = None if bound is None else bound["sg_expected"]
        where.append(vcol == _sql.bindparam("sg_expected", expected_value, type_=vcol.type))
    if fence:
        fcol = _needed(fcol, info, "fence")
        where.append(_sql.fence_condition(fcol, None if bound is None else bound["sg_fence"]))
    stmt = update(info.table).where(*where).ordered_values(*pairs)
    returning: list[Column[Any]] = []
    returns_state = not single
    returns_version = vcol is not None
    if backend is not None and backend.returning:
        if vcol is not None:
            returning.append(vcol)
        if returns_state:
            returning.append(state_col)
        stmt = stmt.returning(*returning)
    elif backend is not None:
        returns_state = False
        returns_version = lid
    return Plan(stmt, returns_state, returns_version, lid)


def plan(
    trigger: Trigger, backend: _sql.Backend, items: Items, has_sql: bool, expected: bool, fence: bool
) -> Plan:
    """The memoised :class:`Plan` for one call variant (built afresh when a SQL value cannot be cached)."""
    variant = _sql.variant_key(items, has_sql) if items else ()
    if variant is None:
        return build(trigger, backend, items, expected, embed=False, fence=fence)
    key = (trigger, backend, variant, expected, fence)
    found: Plan | None = _write.memo.get(key)
    if found is None:
        found = _write.memo.put(key, build(trigger, backend, items, expected, embed=False, fence=fence))
    return found


def lock_statement(machine: StateMachine[Any], backend: _sql.Backend) -> Any:
    """``SELECT state, version ... FOR UPDATE`` (plain on SQLite, which has one writer)."""
    key = ("machine.lock", machine, backend.row_locks)
    stmt = _write.memo.get(key)
    if stmt is None:
        info = machine.info
        cols = [machine.state_column]
        if info.version_column is not None:
            cols.append(info.version_column)
        stmt = select(*cols).where(info.pk_where)
        if backend.row_locks:
            stmt = stmt.with_for_update()
        stmt = _write.memo.put(key, stmt)
    return stmt


def read_statement(machine: StateMachine[Any], backend: _sql.Backend) -> Any:
    """``SELECT state, version, fence WHERE pk``: what a 0-row UPDATE found (``FOR UPDATE`` on InnoDB)."""
    return _write.read_back(machine.info, machine._read_columns, backend)
