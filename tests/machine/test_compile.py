"""The SQL each trigger compiles to, per dialect, without a database: one UPDATE that
sets the version and the state, guards on key and source states, and binds every value."""

from __future__ import annotations

import re
from typing import Any

import pytest
from sqlalchemy import Update, func
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import Dialect

from stateguard import InvalidArgument
from tests._support.models import Color, Lamp, Order, Shipment, Ticket

DIALECTS = {
    "postgresql": postgresql.dialect,
    "sqlite": sqlite.dialect,
    "mysql": mysql.dialect,
}


def _compile(stmt: Update, dialect: Dialect) -> tuple[str, dict[str, Any]]:
    """SQL text with IN lists expanded into placeholders, and the bound parameters."""
    compiled = stmt.compile(dialect=dialect, compile_kwargs={"render_postcompile": True})
    sql = " ".join(str(compiled).split())
    params = compiled.construct_params()
    return sql, dict(params)


def _set_items(sql: str) -> list[str]:
    """The assignments of the SET clause, in order (top-level commas only)."""
    body = sql.split(" SET ", 1)[1].split(" WHERE ", 1)[0]
    items, depth, current = [], 0, ""
    for ch in body:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += ch
    items.append(current.strip())
    return items


def _where(sql: str) -> str:
    return sql.split(" WHERE ", 1)[1].split(" RETURNING ", 1)[0]


@pytest.fixture(params=sorted(DIALECTS))
def dialect(request: pytest.FixtureRequest) -> Dialect:
    return DIALECTS[request.param]()


def test_portable_statement_without_a_dialect() -> None:
    """Without a dialect, statement() is an UPDATE with the key, the one source as equality, version + 1."""
    sql = " ".join(str(Order.flow.pay.statement(5)).split())
    assert sql.startswith("UPDATE orders SET ")
    assert "version=(orders.version + :version_1)" in sql
    assert "WHERE orders.id = :sg_pk0 AND orders.status = :status_1" in sql
    assert "RETURNING" not in sql


def test_statement_is_an_update(dialect: Dialect) -> None:
    """statement() returns a SQLAlchemy Update on the model's table."""
    stmt = Order.flow.pay.statement(1, dialect=dialect)
    assert isinstance(stmt, Update)
    assert stmt.table is Order.__table__


def test_version_is_incremented_and_the_state_assigned_last(dialect: Dialect) -> None:
    """SET version = version + 1 comes before the state, which is assigned last."""
    sql, params = _compile(Order.flow.pay.statement(1, dialect=dialect), dialect)
    items = _set_items(sql)
    assert re.match(r"status ?=", items[-1]), items
    assert any(re.match(r"version ?=", i) and "orders.version +" in i for i in items[:-1]), items
    assert len(items) == 2
    assert params["version_1"] == 1


def test_values_are_set_before_the_state(dialect: Dialect) -> None:
    """values= columns are assigned before the state, so MySQL's left-to-right SET sees the old state."""
    stmt = Order.flow.pay.statement(1, values={"note": "n", "paid_at": func.now()}, dialect=dialect)
    items = _set_items(_compile(stmt, dialect)[0])
    names = [re.split(r" ?=", i, maxsplit=1)[0] for i in items]
    assert names[-1] == "status"
    assert set(names) == {"note", "paid_at", "version", "status"}


def test_where_has_the_key_and_the_source_states(dialect: Dialect) -> None:
    """WHERE requires the primary key and the state IN the trigger's sources."""
    sql, params = _compile(Order.flow.cancel.statement(1, dialect=dialect), dialect)
    where = _where(sql)
    assert "orders.id = " in where and "orders.status IN (" in where
    assert " AND " in where
    found = re.search(r"orders\.status IN \((.*?)\)(?: |$)", where)
    assert found is not None and found.group(1).count(",") == 1, where  # two sources: pending, paid
    assert sorted(v for v in params.values() if v in ("pending", "paid")) == ["paid", "pending"]


def test_expected_version_adds_a_version_condition(dialect: Dialect) -> None:
    """expected_version adds version = :expected to the WHERE, bound."""
    sql, params = _compile(Order.flow.pay.statement(1, expected_version=41, dialect=dialect), dialect)
    assert "orders.version = " in _where(sql)
    assert params["sg_expected"] == 41
    assert "41" not in sql


def test_where_guard_is_anded_in(dialect: Dialect) -> None:
    """Ticket.close's guard (priority < 5) is part of the WHERE, its literal bound."""
    sql, params = _compile(Ticket.flow.close.statement(1, dialect=dialect), dialect)
    where = _where(sql)
    assert "tickets.priority < " in where and "tickets.state = " in where
    assert 5 in params.values() and " 5" not in where


def test_no_version_column_no_version_assignment(dialect: Dialect) -> None:
    """A model without a version column only sets the state."""
    sql, _ = _compile(Ticket.flow.touch.statement(1, dialect=dialect), dialect)
    assert [re.split(r" ?=", i, maxsplit=1)[0] for i in _set_items(sql)] == ["state"]
    assert "RETURNING" not in sql


@pytest.mark.parametrize("name", ["postgresql", "sqlite"])
def test_returning_on_postgresql_and_sqlite(name: str) -> None:
    """On PostgreSQL and SQLite the UPDATE returns the new version in the same round trip."""
    dialect = DIALECTS[name]()
    sql, _ = _compile(Order.flow.pay.statement(1, dialect=dialect), dialect)
    assert re.search(r"RETURNING (orders\.)?version$", sql), sql
    assert "last_insert_id" not in sql.lower()


def test_last_insert_id_on_mysql() -> None:
    """On MySQL/MariaDB the version is SET through LAST_INSERT_ID(version + 1), with no RETURNING."""
    dialect = mysql.dialect()
    sql, _ = _compile(Order.flow.pay.statement(1, dialect=dialect), dialect)
    assert "RETURNING" not in sql
    version_item = next(i for i in _set_items(sql) if i.startswith("version"))
    assert re.fullmatch(r"version=last_insert_id\(orders\.version \+ %s\)", version_item), version_item


def test_mariadb_dialect_uses_last_insert_id_too() -> None:
    """The MariaDB flavour of the MySQL dialect also uses LAST_INSERT_ID and no RETURNING."""
    dialect = mysql.dialect(is_mariadb=True)
    sql, _ = _compile(Order.flow.pay.statement(1, dialect=dialect), dialect)
    assert "last_insert_id(" in sql.lower() and "RETURNING" not in sql


def test_multi_destination_trigger_uses_case(dialect: Dialect) -> None:
    """advance (new->packed, packed->sent) sets the state with a CASE over the sources and ORs the sources."""
    sql, params = _compile(Shipment.flow.advance.statement(("north", 7), dialect=dialect), dialect)
    last = _set_items(sql)[-1]
    assert last.startswith("stage") and "CASE WHEN" in last and "ELSE shipments.stage END" in last
    where = _where(sql)
    assert "shipments.warehouse = " in where and "shipments.number = " in where and " OR " in where
    assert {"packed", "sent"} <= set(params.values())
    if dialect.name != "mysql":
        assert sql.endswith("RETURNING shipments.version, shipments.stage") or sql.endswith(
            "RETURNING version, stage"
        )


@pytest.mark.limits
def test_declared_per_edge_values_use_case_with_several_edges() -> None:
    """A trigger whose edges declare different values for one column picks the value with a CASE."""
    from tests.machine.test_trigger import Doc

    dialect = postgresql.dialect()
    sql, params = _compile(Doc.flow.archive.statement(1, dialect=dialect), dialect)
    note = next(i for i in _set_items(sql) if i.startswith("note"))
    assert "CASE WHEN" in note and "ELSE sg_machine_docs.note END" in note
    assert {"from draft", "from published"} <= set(params.values())
    assert "from draft" not in sql


def test_state_names_and_keys_are_bound_parameters(dialect: Dialect) -> None:
    """State names, keys and values appear only as bound parameters, never in the SQL text."""
    nasty_key = "x'; DROP TABLE shipments; --"
    stmt = Shipment.flow.advance.statement((nasty_key, 31337), dialect=dialect)
    sql, params = _compile(stmt, dialect)
    for literal in ("new", "packed", "sent", "DROP", "31337"):
        assert literal not in sql.replace("shipments", ""), (literal, sql)
    assert nasty_key in params.values() and 31337 in params.values()
    sql2, params2 = _compile(
        Order.flow.pay.statement(1, values={"note": "'); DELETE FROM orders; --"}, dialect=dialect), dialect
    )
    assert "DELETE" not in sql2 and "'pending'" not in sql2 and "'paid'" not in sql2
    assert "'); DELETE FROM orders; --" in params2.values()
    assert {"pending", "paid"} <= set(params2.values())


def test_enum_states_are_bound_as_members(dialect: Dialect) -> None:
    """Enum states are bound parameters (members), rendered by the column type, never inlined."""
    sql, params = _compile(Lamp.flow.go.statement(1, dialect=dialect), dialect)
    assert "RED" not in sql and "GREEN" not in sql and "red" not in sql
    assert Color.GREEN in params.values() and Color.RED in params.values()


def test_statement_takes_a_key_and_refuses_a_transient_instance() -> None:
    """statement(3) binds key 3; a transient instance (no identity yet) is InvalidArgument."""
    with pytest.raises(InvalidArgument):
        Order.flow.pay.statement(Order(id=3))
    _, params = _compile(Order.flow.pay.statement(3, dialect=sqlite.dialect()), sqlite.dialect())
    assert params["sg_pk0"] == 3


def test_statement_needs_no_database_or_session() -> None:
    """Compiling statements for every dialect works with no engine at all."""
    for make in DIALECTS.values():
        d = make()
        for trigger in (Order.flow.pay, Order.flow.cancel, Ticket.flow.close, Lamp.flow.stop):
            sql, _ = _compile(trigger.statement(1, dialect=d), d)
            assert sql.startswith("UPDATE ")
