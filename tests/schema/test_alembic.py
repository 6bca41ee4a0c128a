"""stateguard.alembic: autogenerate follows the declared states (and legal edges) in a real alembic env.

Each test builds a throwaway alembic environment in ``tmp_path`` (``env.py``
imports ``stateguard.alembic`` and a model module the test writes), changes
the model, autogenerates, reads the generated script, upgrades, and then
proves with raw SQL what the database now accepts and refuses.
"""

from __future__ import annotations

import importlib
import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, String, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import mysql, postgresql
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import stateguard.alembic as sg_alembic
from stateguard import Outcome, StateMachine
from stateguard.machine.ddl import legal_edges_ddl
from stateguard.schema import parse_check_states
from tests.conftest import Backend, backends_with

ENV_PY = """
import importlib

from alembic import context
from sqlalchemy import create_engine

import stateguard.alembic  # noqa: F401

config = context.config
models = importlib.import_module(config.attributes["models"])
prefix = config.attributes["prefix"]


def include_name(name, type_, parent_names):
    return type_ != "table" or name.startswith(prefix)


engine = create_engine(config.attributes["url"])
try:
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=models.Base.metadata,
            include_name=include_name,
            version_table=prefix + "_version",
        )
        with context.begin_transaction():
            context.run_migrations()
finally:
    engine.dispose()
"""

MODEL = """
from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from stateguard import StateMachine, version_column


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = {table!r}
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    status: Mapped[str] = mapped_column(String(20), default="pending")
{version}
    flow = StateMachine(
        "status",
        states={states!r},
        transitions={transitions!r},
        legal_edges={legal!r},
    )
"""

STATES = ["pending", "paid", "shipped", "cancelled"]
FLOW = [
    ["pay", "pending", "paid"],
    ["ship", "paid", "shipped"],
    ["cancel", ["pending", "paid"], "cancelled"],
]


class AlembicEnv:
    """A throwaway alembic environment whose model module the test rewrites."""

    def __init__(self, tmp_path: Path, backend: Backend) -> None:
        self.backend = backend
        self.prefix = f"sga_{uuid.uuid4().hex[:8]}"
        self.table = f"{self.prefix}_orders"
        self.models_dir = tmp_path / "models"
        self.models_dir.mkdir()
        script = tmp_path / "migrations"
        (script / "versions").mkdir(parents=True)
        (script / "env.py").write_text(ENV_PY)
        template = Path(command.__file__).parent / "templates" / "generic" / "script.py.mako"
        (script / "script.py.mako").write_text(template.read_text())
        self.cfg = Config()
        self.cfg.set_main_option("script_location", str(script))
        self.cfg.attributes["url"] = backend.url
        self.cfg.attributes["prefix"] = self.prefix
        self.engine: Engine = backend.new_engine(pool_size=2, max_overflow=2)
        self.versions = 0
        self.module: ModuleType | None = None
        sys.path.insert(0, str(self.models_dir))

    def model(
        self,
        *,
        states: list[str] = STATES,
        transitions: list[Any] = FLOW,
        version: bool = False,
        legal: bool = False,
    ) -> Any:
        """Write the next version of the model module, point env.py at it, return its Order class."""
        self.versions += 1
        name = f"{self.prefix}_v{self.versions}"
        version_line = "    version: Mapped[int] = version_column()" if version else ""
        source = MODEL.format(
            table=self.table, states=states, transitions=transitions, legal=legal, version=version_line
        )
        (self.models_dir / f"{name}.py").write_text(source)
        importlib.invalidate_caches()
        self.module = importlib.import_module(name)
        self.cfg.attributes["models"] = name
        return self.module.Order

    def revision(self, message: str) -> tuple[str, str]:
        """Autogenerate a revision; return its (upgrade, downgrade) bodies."""
        script = command.revision(self.cfg, message=message, autogenerate=True)
        assert script is not None and not isinstance(script, list)
        source = Path(script.path).read_text()
        upgrade = source.split("def upgrade()")[1].split("def downgrade()")[0]
        downgrade = source.split("def downgrade()")[1]
        return upgrade, downgrade

    def upgrade(self, target: str = "head") -> None:
        command.upgrade(self.cfg, target)

    def current(self) -> str | None:
        with self.engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"version_table": f"{self.prefix}_version"})
            return ctx.get_current_revision()

    def head(self) -> str | None:
        return ScriptDirectory.from_config(self.cfg).get_current_head()

    def diffs(self, **opts: Any) -> list[Any]:
        """What autogenerate would do now (compare_metadata with env.py's filters)."""
        assert self.module is not None
        with self.engine.connect() as conn:
            ctx = MigrationContext.configure(
                conn,
                opts={
                    "include_name": lambda n, t, p: t != "table" or n.startswith(self.prefix),
                    "version_table": f"{self.prefix}_version",
                    **opts,
                },
            )
            return list(compare_metadata(ctx, self.module.Base.metadata))

    def assert_no_churn(self) -> None:
        """compare_metadata finds nothing and ``alembic check`` passes."""
        assert self.diffs() == []
        command.check(self.cfg)

    def execute(self, sql: str, **params: Any) -> int:
        with self.engine.begin() as conn:
            return int(conn.execute(text(sql), params).rowcount)

    def status(self, row_id: int) -> str:
        with self.engine.connect() as conn:
            return str(
                conn.execute(text(f"SELECT status FROM {self.table} WHERE id = {row_id}")).scalar_one()
            )

    def refused(self, sql: str, name: str) -> None:
        """``sql`` fails, and the error names ``name`` (the constraint or trigger that refused it)."""
        with pytest.raises((sa_exc.IntegrityError, sa_exc.OperationalError)) as caught:
            self.execute(sql)
        assert name in str(caught.value)

    def close(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(text(f"DROP TABLE IF EXISTS {self.table}"))
            conn.execute(text(f"DROP TABLE IF EXISTS {self.prefix}_version"))
            if self.engine.dialect.name == "postgresql":
                conn.execute(text(f"DROP FUNCTION IF EXISTS sg_{self.table}_status_edges()"))
        self.engine.dispose()
        sys.path.remove(str(self.models_dir))


@pytest.fixture
def env(backend: Backend, tmp_path: Path) -> Iterator[AlembicEnv]:
    """An alembic environment on ``backend``; a test using it runs on the backends with
    ``alter_constraints`` (alembic cannot ALTER constraints on SQLite without batch mode)."""
    e = AlembicEnv(tmp_path, backend)
    yield e
    e.close()


@pytest.fixture
def pg_env(pg: Backend, tmp_path: Path) -> Iterator[AlembicEnv]:
    e = AlembicEnv(tmp_path, pg)
    yield e
    e.close()


# --------------------------------------------------------------------------
# CHECK constraint and version column through autogenerate
# --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", backends_with("alter_constraints"), indirect=True)
def test_states_follow_the_declaration_through_autogenerate(env: AlembicEnv) -> None:
    """Create, add a state and a version column, remove a held state: each migration does exactly that."""
    ck = f"ck_{env.table}_status_states"
    t = env.table

    # 1. A new table carries its CHECK constraint.
    env.model()
    up, _ = env.revision("create orders")
    assert f"op.create_table('{t}'" in up
    assert (
        f"sa.CheckConstraint(\"status IN ('pending', 'paid', 'shipped', 'cancelled')\", name=op.f('{ck}'))"
        in up
    )
    env.upgrade()
    env.execute(
        f"INSERT INTO {t} (id, status) VALUES (1, 'pending'), (2, 'paid'), (3, 'cancelled'), (4, 'cancelled')"
    )
    env.refused(f"UPDATE {t} SET status = 'bogus' WHERE id = 1", ck)
    env.assert_no_churn()

    # 2. A new state and a version column: the constraint is replaced, the column gets a server default.
    order = env.model(
        states=[*STATES, "refunded"], transitions=[*FLOW, ["refund", "paid", "refunded"]], version=True
    )
    up, down = env.revision("refunds and versions")
    assert f"op.drop_constraint(op.f('{ck}'), '{t}', type_='check')" in up
    assert (
        f"op.create_check_constraint(op.f('{ck}'), '{t}', "
        f"\"status IN ('pending', 'paid', 'shipped', 'cancelled', 'refunded')\")"
    ) in up
    version = "sa.Column('version', sa.Integer(), server_default=sa.text('0'), nullable=False)"
    assert f"op.add_column('{t}', {version})" in up
    assert "stateguard_held" not in up, "adding a state refuses no row: no guard"
    assert "stateguard_held" in down, "the downgrade removes 'refunded': it is guarded"
    assert up.index("create_check_constraint") < up.index("add_column")
    env.upgrade()
    with env.engine.connect() as conn:
        assert conn.execute(text(f"SELECT id, version FROM {t} ORDER BY id")).all() == [
            (1, 0),
            (2, 0),
            (3, 0),
            (4, 0),
        ]
    with Session(env.engine) as session, session.begin():
        result = order.flow.refund(session, 2)
    assert result.outcome is Outcome.APPLIED and result.version == 1
    env.refused(f"UPDATE {t} SET status = 'bogus' WHERE id = 1", ck)
    env.assert_no_churn()

    # 3. Removing a state two rows hold: warned, counted in the script, and the upgrade stops untouched.
    env.model(
        states=["pending", "paid", "shipped", "refunded"],
        transitions=[*FLOW[:2], ["refund", "paid", "refunded"]],
        version=True,
    )
    before = env.current()
    with pytest.warns(sg_alembic.StatesInUseWarning, match=r"2 row\(s\) of .* \('cancelled': 2\)"):
        up, down = env.revision("no more cancelling")
    assert "# (at autogenerate time 2 row(s) did: 'cancelled': 2);" in up
    assert "stateguard_held" in up and up.index("stateguard_held") < up.index("drop_constraint")
    assert "-'cancelled'" in up
    with pytest.raises(RuntimeError, match=r"hold states no longer declared: \{'cancelled': 2\}"):
        env.upgrade()
    assert env.current() == before
    env.execute(f"UPDATE {t} SET status = 'cancelled' WHERE id = 1")  # the old constraint is intact
    env.refused(f"UPDATE {t} SET status = 'bogus' WHERE id = 1", ck)

    # Moving the rows lets it through; now 'cancelled' is refused.
    assert env.execute(f"UPDATE {t} SET status = 'pending' WHERE status = 'cancelled'") == 3
    env.upgrade()
    assert env.current() == env.head()
    env.refused(f"UPDATE {t} SET status = 'cancelled' WHERE id = 1", ck)
    env.assert_no_churn()

    # 4. The downgrade brings 'cancelled' back.
    command.downgrade(env.cfg, "-1")
    env.execute(f"UPDATE {t} SET status = 'cancelled' WHERE id = 1")
    assert env.status(1) == "cancelled"
    env.refused(f"UPDATE {t} SET status = 'bogus' WHERE id = 1", ck)


@pytest.mark.parametrize("backend", backends_with("alter_constraints"), indirect=True)
def test_checkconstraint_byname_plugin_needs_include_object(env: AlembicEnv) -> None:
    """With alembic's by-name CHECK plugin, stateguard's filter stops a missing constraint added twice."""
    env.model()
    env.revision("create")
    env.upgrade()
    ck = f"ck_{env.table}_status_states"
    with env.engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {env.table} DROP CONSTRAINT {ck}"))
    plugins = ["alembic.autogenerate.*", "alembic.ext.checkconstraint_byname"]
    unfiltered = [d[0] for d in env.diffs(autogenerate_plugins=plugins)]
    assert sorted(unfiltered) == ["add_constraint", "stateguard_states"]
    filtered = env.diffs(autogenerate_plugins=plugins, include_object=sg_alembic.include_object)
    assert [d[0] for d in filtered] == ["stateguard_states"]
    assert filtered[0][2:] == (env.table, "status", None, tuple(STATES))


@pytest.mark.parametrize("backend", backends_with("alter_constraints"), indirect=True)
def test_machine_added_to_existing_table_counts_rows_it_would_refuse(env: AlembicEnv) -> None:
    """Turning the CHECK on for a table that holds an undeclared state warns and guards the upgrade."""
    env.model()
    env.revision("create")
    env.upgrade()
    with env.engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {env.table} DROP CONSTRAINT ck_{env.table}_status_states"))
        conn.execute(text(f"INSERT INTO {env.table} (id, status) VALUES (1, 'lost'), (2, 'paid')"))
    with pytest.warns(sg_alembic.StatesInUseWarning, match=r"'lost': 1"):
        up, down = env.revision("constraint back")
    assert "CHECK constraint added" in up and "op.drop_constraint" not in up
    assert "op.drop_constraint" in down and "stateguard_held" not in down
    with pytest.raises(RuntimeError, match=r"\{'lost': 1\}"):
        env.upgrade()
    env.execute(f"DELETE FROM {env.table} WHERE status = 'lost'")
    env.upgrade()
    env.refused(f"UPDATE {env.table} SET status = 'lost' WHERE id = 2", f"ck_{env.table}_status_states")
    env.assert_no_churn()


def test_legal_edges_are_ignored_off_postgresql(mariadb: Backend, tmp_path: Path) -> None:
    """On MariaDB ``legal_edges=True`` generates no trigger, and nothing churns."""
    e = AlembicEnv(tmp_path, mariadb)
    try:
        e.model(legal=True)
        up, _ = e.revision("create")
        assert "TRIGGER" not in up and "op.create_table" in up
        e.upgrade()
        e.execute(f"INSERT INTO {e.table} (id, status) VALUES (1, 'pending')")
        e.execute(f"UPDATE {e.table} SET status = 'shipped' WHERE id = 1")  # undeclared edge, declared state
        e.assert_no_churn()
    finally:
        e.close()


# --------------------------------------------------------------------------
# Legal edges (PostgreSQL)
# --------------------------------------------------------------------------


def test_legal_edges_trigger_follows_the_declared_edges(pg_env: AlembicEnv) -> None:
    """The trigger refuses raw skips (pending -> shipped), follows a new edge, and goes with the flag."""
    e = pg_env
    t = e.table
    trigger = f"sg_{t}_status_edges"
    order = e.model(legal=True)
    up, down = e.revision("create with legal edges")
    assert "op.create_table" in up and "CREATE TRIGGER" in up and "CREATE OR REPLACE FUNCTION" in up
    assert "DROP FUNCTION IF EXISTS" in down
    assert up.index("op.create_table") < up.index("CREATE TRIGGER")
    e.upgrade()
    e.execute(f"INSERT INTO {t} (id, status) VALUES (1, 'pending'), (2, 'pending'), (3, 'pending')")
    e.refused(f"UPDATE {t} SET status = 'shipped' WHERE id = 1", "is not a declared transition")
    e.refused(f"UPDATE {t} SET status = 'shipped' WHERE id = 1", trigger)
    e.execute(f"UPDATE {t} SET status = 'paid' WHERE id = 1")
    e.execute(f"UPDATE {t} SET status = 'shipped' WHERE id = 1")
    e.execute(f"UPDATE {t} SET status = status WHERE id = 1")  # unchanged state always passes
    e.refused(f"UPDATE {t} SET status = 'paid' WHERE id = 1", trigger)  # no way back
    with Session(e.engine) as session, session.begin():
        assert order.flow.pay(session, 2).outcome is Outcome.APPLIED
        assert order.flow.ship(session, 2).outcome is Outcome.APPLIED
    e.assert_no_churn()

    # A new edge replaces the function; the skip becomes legal.
    e.model(transitions=[*FLOW, ["rush", "pending", "shipped"]], legal=True)
    up, _ = e.revision("rush orders")
    assert "replace the legal-edges trigger" in up and "('pending', 'shipped')" in up
    e.upgrade()
    e.execute(f"UPDATE {t} SET status = 'shipped' WHERE id = 3")
    e.assert_no_churn()

    # Dropping the flag drops the trigger and its function.
    e.model(transitions=[*FLOW, ["rush", "pending", "shipped"]])
    up, down = e.revision("no legal edges")
    assert f"DROP TRIGGER IF EXISTS {trigger} ON {t}" in up and f"DROP FUNCTION IF EXISTS {trigger}()" in up
    assert "CREATE TRIGGER" in down
    e.upgrade()
    e.execute(f"UPDATE {t} SET status = 'pending' WHERE id = 3")
    with e.engine.connect() as conn:
        assert (
            conn.execute(text("SELECT count(*) FROM pg_proc WHERE proname = :n"), {"n": trigger}).scalar()
            == 0
        )
    e.assert_no_churn()


class _LegalBase(DeclarativeBase):
    pass


class LegalParcel(_LegalBase):
    __tablename__ = "sg_test_legal_parcels"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    status: Mapped[str] = mapped_column(String(20), default="pending")
    note: Mapped[str | None] = mapped_column(String(20))

    flow = StateMachine(
        "status",
        states=["pending", "paid", "shipped", "it's:odd"],
        transitions=[
            ["pay", "pending", "paid"],
            ["ship", "paid", "shipped"],
            ["oddify", "pending", "it's:odd"],
        ],
        legal_edges=True,
    )


def test_create_all_creates_the_legal_edges_trigger(pg: Backend) -> None:
    """``create_all`` installs the trigger (odd state names included); ``drop_all`` removes its function."""
    engine = pg.create(_LegalBase.metadata)
    t = LegalParcel.__tablename__
    with engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {t} (id, status) VALUES (1, 'pending'), (2, 'pending')"))
    with pytest.raises(sa_exc.IntegrityError, match="is not a declared transition"), engine.begin() as conn:
        conn.execute(text(f"UPDATE {t} SET status = 'shipped' WHERE id = 1"))
    with engine.begin() as conn:
        conn.execute(
            text(f"UPDATE {t} SET note = 'x' WHERE id = 1")
        )  # other columns are not the trigger's business
        conn.execute(text(f"UPDATE {t} SET status = 'paid' WHERE id = 1"))
        conn.execute(text(f"UPDATE {t} SET status = :s WHERE id = 2"), {"s": "it's:odd"})
    with pytest.raises(sa_exc.IntegrityError, match="it''s:odd"), engine.begin() as conn:
        conn.execute(text(f"UPDATE {t} SET status = 'pending' WHERE id = 2"))
    _LegalBase.metadata.drop_all(engine)
    with engine.connect() as conn:
        gone = conn.execute(
            text("SELECT count(*) FROM pg_proc WHERE proname = :n"), {"n": f"sg_{t}_status_edges"}
        )
        assert gone.scalar() == 0


# --------------------------------------------------------------------------
# Statement text (no database)
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sqltext", "backslashes", "expected"),
    [
        (
            "((status)::text = ANY ((ARRAY['pending'::character varying, "
            "'paid'::character varying])::text[]))",
            False,
            {"pending", "paid"},
        ),
        ("((status)::text = 'paid'::text)", False, {"paid"}),
        ("`status` in ('pending','paid','it\\'s')", True, {"pending", "paid", "it's"}),
        ("status IN ('pending', 'it''s', 'a\\b')", False, {"pending", "it's", "a\\b"}),
        ("kind IN (1, 2, -3)", False, {"1", "2", "-3"}),
        ("x IS NOT NULL", False, None),
    ],
)
def test_parse_check_states(sqltext: str, backslashes: bool, expected: set[str] | None) -> None:
    """Reflected CHECK text of every backend is read as the set of literal states it allows."""
    found = parse_check_states(sqltext, backslash_escapes=backslashes)
    assert found == (None if expected is None else frozenset(expected))


def test_legal_edges_ddl_is_plain_postgresql() -> None:
    """The trigger DDL quotes names and literals, has no % and reads back its own edges from a marker."""
    create_fn, drop_trigger, create_trigger = legal_edges_ddl(
        "Orders", "select", [("a", "it's"), ("b", "c")], schema="shop"
    )
    assert create_fn.startswith('CREATE OR REPLACE FUNCTION shop."sg_Orders_select_edges"() RETURNS trigger')
    assert "(OLD.\"select\"::text, NEW.\"select\"::text) IN (('a', 'it''s'), ('b', 'c'))" in create_fn
    assert (
        '-- stateguard legal_edges {"v": 1, "column": "select", "edges": [["a", "it\'s"], ["b", "c"]]}'
        in create_fn
    )
    assert "%" not in create_fn
    assert drop_trigger == 'DROP TRIGGER IF EXISTS "sg_Orders_select_edges" ON shop."Orders"'
    assert 'WHEN (OLD."select" IS DISTINCT FROM NEW."select")' in create_trigger
    long = legal_edges_ddl("t" * 60, "status", [])[2]
    name = re.search(r"CREATE TRIGGER (\S+)", long)
    assert name is not None and len(name.group(1)) <= 63


def test_rendered_constraint_sql_per_dialect() -> None:
    """The recreated constraint is compiled for the target dialect's quoting."""
    from alembic.autogenerate import render_python_code
    from alembic.operations import ops

    op = sg_alembic.StatesCheckOp("t", "order", "ck_t_order_states", states=["a"], previous=["a", "b"])
    for dialect, quoted in ((postgresql.dialect(), '"order"'), (mysql.dialect(), "`order`")):
        ctx = MigrationContext.configure(dialect=dialect)
        rendered = render_python_code(ops.UpgradeOps(ops=[op]), migration_context=ctx)
        assert repr(f"{quoted} IN ('a')") in rendered
        assert "op.drop_constraint(op.f('ck_t_order_states'), 't', type_='check')" in rendered
    assert op.reverse().states == ["a", "b"] and op.reverse().previous == ["a"]
