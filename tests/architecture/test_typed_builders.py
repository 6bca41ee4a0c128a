"""Statement builders return typed SQLAlchemy constructs, never ``Any`` (ARCHITECTURE.md, issue #34).

A function in ``stateguard/`` annotated ``-> Any`` (or ``Any | None``) is a
*builder* when its name says it builds SQL (``_claim_statement``,
``_insert``, ``lease_clause``...) or when what it returns is SQL: a call of a
construct imported from SQLAlchemy (``select``, ``update``, ``insert``,
``delete``, ``text``, ``exists``, ``or_``, ``func.*``, ``bindparam``...), a
method chain on one (``.where(...).values(...).returning(...)``), a column
(``table.c.x``) or a comparison of one, a memoised statement
(``memo.get_or_build``, ``frozen``), or a local name assigned any of those.
A builder must name its real type (``Select[...]``, ``Update``,
``ReturningUpdate[...]``, ``ColumnElement[bool]``, ``TextClause``...).  What
stays ``-> Any`` is a value whose type is really open: a user's function
result, decoded JSON, a key part, a state, an untyped client's object.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent.parent / "stateguard"

#: SQLAlchemy's constructors of statements and clauses (the names as SQLAlchemy spells them).
CONSTRUCTORS = frozenset(
    {
        "select",
        "update",
        "insert",
        "delete",
        "text",
        "exists",
        "union",
        "union_all",
        "intersect",
        "except_",
        "lambda_stmt",
        "and_",
        "or_",
        "not_",
        "case",
        "cast",
        "type_coerce",
        "literal",
        "literal_column",
        "bindparam",
        "any_",
        "all_",
        "tuple_",
        "column",
        "table",
        "values",
        "null",
        "true",
        "false",
        "func",
        "over",
        "distinct",
        "between",
        "extract",
        "collate",
        "asc",
        "desc",
        "nulls_first",
        "nulls_last",
        "alias",
        "join",
        "outerjoin",
    }
)

#: Methods that turn a statement or clause into another one.
CHAIN = frozenset(
    {
        "where",
        "filter",
        "filter_by",
        "values",
        "returning",
        "with_for_update",
        "order_by",
        "group_by",
        "having",
        "limit",
        "offset",
        "cte",
        "subquery",
        "scalar_subquery",
        "alias",
        "label",
        "prefix_with",
        "suffix_with",
        "select_from",
        "join",
        "outerjoin",
        "on_conflict_do_nothing",
        "on_conflict_do_update",
        "on_duplicate_key_update",
        "in_",
        "not_in",
        "is_",
        "is_not",
        "like",
        "ilike",
        "between",
        "correlate",
        "execution_options",
        "add_columns",
        "with_only_columns",
        "union",
        "union_all",
        "bindparams",
        "columns",
        "inline",
        "from_select",
    }
)

#: Calls whose result is a built statement whatever they are given.
STATEMENT_CALLS = frozenset({"get_or_build", "frozen"})

#: Function names that say the function builds SQL.
BUILDER_NAME = re.compile(
    r"(^|_)(statements?|stmts?|clauses?|query|queries|ctes?|select|insert|update|delete|upsert)($|_)"
)


def _is_any(annotation: ast.expr | None) -> bool:
    """Whether a return annotation is ``Any``, ``typing.Any``, ``"Any"`` or a union with it."""
    if annotation is None:
        return False
    if isinstance(annotation, ast.Name):
        return annotation.id == "Any"
    if isinstance(annotation, ast.Attribute):
        return annotation.attr == "Any"
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            return _is_any(ast.parse(annotation.value, mode="eval").body)
        except SyntaxError:
            return False
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return _is_any(annotation.left) or _is_any(annotation.right)
    if isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name | ast.Attribute):
        head = annotation.value.id if isinstance(annotation.value, ast.Name) else annotation.value.attr
        if head in ("Optional", "Union"):
            items = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
            return any(_is_any(item) for item in items)
    return False


class _Module:
    """The names by which one module reaches SQLAlchemy's constructors."""

    def __init__(self, tree: ast.Module) -> None:
        #: Local names of SQLAlchemy's constructors (``from sqlalchemy[...] import x [as y]``).
        self.constructors: set[str] = set()
        #: Local names of ``import sqlalchemy [as sa]``.
        self.modules: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sqlalchemy":
                for alias in node.names:
                    if alias.name in CONSTRUCTORS:
                        self.constructors.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "sqlalchemy":
                        self.modules.add(alias.asname or alias.name.split(".")[0])

    def builds(self, expr: ast.expr | None, sql_names: set[str]) -> bool:
        """Whether ``expr`` evaluates to a SQLAlchemy construct."""
        if expr is None:
            return False
        if isinstance(expr, ast.Name):
            return expr.id in sql_names
        if isinstance(expr, ast.Call):
            func = expr.func
            if isinstance(func, ast.Name):
                return func.id in self.constructors or func.id in STATEMENT_CALLS
            if isinstance(func, ast.Attribute):
                if func.attr in STATEMENT_CALLS:
                    return True
                root = func.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and (root.id == "func" and "func" in self.constructors):
                    return True  # func.now(), func.coalesce(...)
                if isinstance(root, ast.Name) and root.id in self.modules:
                    return func.attr in CONSTRUCTORS or _is_func_attribute(func)
                return func.attr in CHAIN and self.builds(func.value, sql_names)
            return False
        if isinstance(expr, ast.Attribute):
            # table.c.name, alias.c.name: a column.
            return isinstance(expr.value, ast.Attribute) and expr.value.attr == "c"
        if isinstance(expr, ast.Compare):
            return any(self.builds(part, sql_names) for part in (expr.left, *expr.comparators))
        if isinstance(expr, ast.BinOp):
            return self.builds(expr.left, sql_names) or self.builds(expr.right, sql_names)
        if isinstance(expr, ast.UnaryOp):
            return self.builds(expr.operand, sql_names)
        if isinstance(expr, ast.IfExp):
            return self.builds(expr.body, sql_names) or self.builds(expr.orelse, sql_names)
        return False


def _is_func_attribute(func: ast.Attribute) -> bool:
    """``sa.func.now``: an attribute chain through ``func``."""
    node: ast.expr = func.value
    while isinstance(node, ast.Attribute):
        if node.attr == "func":
            return True
        node = node.value
    return False


def _own_nodes(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[ast.AST]:
    """The nodes of ``fn``'s body, not those of the functions and lambdas defined in it."""
    nested = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef
    stack: list[ast.AST] = [node for node in fn.body if not isinstance(node, nested)]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(child for child in ast.iter_child_nodes(node) if not isinstance(child, nested))


def _returns_sql(fn: ast.FunctionDef | ast.AsyncFunctionDef, module: _Module) -> bool:
    """Whether one of ``fn``'s ``return`` statements returns SQL (through local names too)."""
    nodes = list(_own_nodes(fn))
    sql_names: set[str] = set()
    changed = True
    while changed:  # a name assigned from a name assigned SQL is SQL too
        changed = False
        for node in nodes:
            targets: list[ast.expr] = []
            value: ast.expr | None = None
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign | ast.AugAssign | ast.NamedExpr):
                targets, value = [node.target], node.value
            for target in targets:
                if (
                    isinstance(target, ast.Name)
                    and target.id not in sql_names
                    and module.builds(value, sql_names)
                ):
                    sql_names.add(target.id)
                    changed = True
    return any(isinstance(node, ast.Return) and module.builds(node.value, sql_names) for node in nodes)


def untyped_builders(source: str, filename: str = "<source>") -> list[str]:
    """``file:line name`` of each statement builder annotated ``-> Any`` in ``source``."""
    tree = ast.parse(source, filename)
    module = _Module(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or not _is_any(node.returns):
            continue
        if BUILDER_NAME.search(node.name) or _returns_sql(node, module):
            found.append(f"{filename}:{node.lineno} {node.name}")
    return found


def _names(found: list[str]) -> set[str]:
    return {entry.split(" ")[1] for entry in found}


PLANTED = textwrap.dedent(
    """
    import json
    from typing import Any, Optional

    import sqlalchemy as sa
    from selectors import select as select_fd
    from sqlalchemy import Select, bindparam, func, or_, select, update
    from sqlalchemy.dialects.postgresql import insert as pg_insert

    from . import _kernel
    from .tables import outbox


    def heads(backend) -> Any:
        def build() -> Any:
            stmt = select(outbox.c.id).where(outbox.c.dead_ms.is_(None))
            if backend.row_locks:
                stmt = stmt.with_for_update(skip_locked=True)
            return stmt

        return _kernel.memo.get_or_build(("heads", backend), build)


    def mark(backend) -> "Any":
        stmt = update(outbox).values(published_ms=func.now())
        return stmt.returning(outbox.c.id) if backend.returning else stmt


    def lease_free() -> Optional[Any]:
        return or_(outbox.c.claimed_until_ms.is_(None), outbox.c.claimed_until_ms <= 5)


    def ids_in() -> Any | None:
        return outbox.c.id == sa.any_(bindparam("sg_ids"))


    def now() -> Any:
        return func.now()


    def upsert_row(values) -> Any:
        return pg_insert(outbox).values(**values).on_conflict_do_nothing()


    def _requeue_statement(backend) -> Any:
        return make_it(backend)


    def raw() -> Any:
        return sa.text("SELECT 1")


    class Sink:
        async def frozen_claim(self) -> Any:
            return _kernel.frozen(self.stmt)


    # --- not builders ----------------------------------------------------------


    def typed(backend) -> Select[Any]:
        return select(outbox.c.id)


    def user_result(fn) -> Any:
        return fn()


    def decoded(text) -> Any:
        return json.loads(text)


    def row_lock(session, model, key) -> Any:
        base = select(model).with_for_update()
        found = session.scalars(base.where(model.id == key)).all()
        return found[0] if found else None


    def first_ready(fds) -> Any:
        return select_fd(fds, [], [])


    def helper_inside(backend) -> Any:
        def build() -> Select[Any]:
            return select(outbox.c.id)

        return len(build().selected_columns)
    """
)


def test_the_finder_finds_every_planted_builder_and_nothing_else() -> None:
    """Each planted ``-> Any`` builder is found (SQL returned, memoised, through a local name, by
    its name, async, in a class); typed builders and ``-> Any`` functions returning open values are not."""
    found = untyped_builders(PLANTED, "planted.py")
    assert _names(found) == {
        "build",
        "heads",
        "mark",
        "lease_free",
        "ids_in",
        "now",
        "upsert_row",
        "_requeue_statement",
        "raw",
        "frozen_claim",
    }
    assert "planted.py:14 heads" in found


def test_a_builder_turned_typed_is_no_longer_found() -> None:
    """Annotating the planted builder with its SQLAlchemy type clears it: the finder reads the annotation."""
    source = "from sqlalchemy import Update, update\n\ndef claim(t) -> Update:\n    return update(t)\n"
    assert untyped_builders(source) == []
    assert untyped_builders(source.replace("-> Update", "-> Any")) == ["<source>:3 claim"]


def test_no_statement_builder_in_stateguard_returns_any() -> None:
    """Every function of stateguard that builds SQL names its SQLAlchemy type (``Select``, ``Update``,
    ``ColumnElement[bool]``...), not ``Any``."""
    found: list[str] = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        relative = path.relative_to(PACKAGE_DIR.parent).as_posix()
        found += untyped_builders(path.read_text(encoding="utf-8"), relative)
    assert found == [], "statement builders annotated -> Any (name their SQLAlchemy type):\n" + "\n".join(
        found
    )
