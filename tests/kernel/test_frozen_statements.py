"""``_kernel.frozen``: a statement whose SQL cache key is computed once must still run as itself.

Two frozen statements come from the same lambda (one code object); if they
shared a compiled form, the second would run the first one's SQL.  They must
also pick up each execution's parameter values and a connection's
``schema_translate_map``, as the statement they wrap does.
"""

from __future__ import annotations

import contextlib
from typing import Any

from sqlalchemy import (
    Column,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    bindparam,
    event,
    insert,
    select,
    update,
)

from stateguard import _kernel
from tests.conftest import Backend

_meta = MetaData()
_items = Table(
    "sg_frozen_items",
    _meta,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("name", String(40), nullable=False),
)


def test_two_frozen_statements_never_share_a_compiled_form(backend: Backend) -> None:
    backend.create(_meta)
    eng: Engine = backend.engine
    put = _kernel.frozen(insert(_items).values(id=bindparam("i"), name=bindparam("n")))
    rename = _kernel.frozen(update(_items).where(_items.c.id == bindparam("i")).values(name=bindparam("n")))
    by_id = _kernel.frozen(select(_items.c.name).where(_items.c.id == bindparam("i")))
    by_name = _kernel.frozen(select(_items.c.id).where(_items.c.name == bindparam("n")))
    with eng.begin() as conn:
        for i, name in ((1, "one"), (2, "two"), (3, "three")):
            conn.execute(put, {"i": i, "n": name})
        assert conn.execute(rename, {"i": 2, "n": "deux"}).rowcount == 1
        # Each run with its own values, each statement its own SQL.
        assert [conn.execute(by_id, {"i": i}).scalar() for i in (1, 2, 3)] == ["one", "deux", "three"]
        assert [conn.execute(by_name, {"n": n}).scalar() for n in ("three", "deux", "one")] == [3, 2, 1]
        assert conn.execute(by_id, {"i": 4}).first() is None


def test_a_frozen_statement_follows_schema_translate_map(backend: Backend) -> None:
    backend.create(_meta)
    eng: Engine = backend.engine
    stmt = _kernel.frozen(select(_items.c.name).where(_items.c.id == bindparam("i")))
    with eng.begin() as conn:
        conn.execute(insert(_items), [{"id": 1, "name": "here"}])
    # The same statement, rendered for a schema that does not exist: the map is applied per run.
    seen: list[str] = []

    def capture(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        seen.append(statement)

    with eng.connect() as conn:
        assert conn.execute(stmt, {"i": 1}).scalar() == "here"
        moved = conn.execution_options(schema_translate_map={None: "sg_nowhere"})
        event.listen(eng, "before_cursor_execute", capture)
        try:
            with contextlib.suppress(Exception):  # the schema is missing: only the SQL sent matters
                moved.execute(stmt, {"i": 1})
        finally:
            event.remove(eng, "before_cursor_execute", capture)
        conn.rollback()
    assert seen and "sg_nowhere" in seen[-1]
