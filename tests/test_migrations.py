"""stateguard's own alembic revisions: upgrade, match the metadata, downgrade, ship in the wheel."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from sqlalchemy import inspect

import stateguard
from stateguard.tables import metadata

from .conftest import Backend

ROOT = Path(__file__).resolve().parent.parent

ENV_PY = """
from alembic import context
from sqlalchemy import create_engine

config = context.config
engine = create_engine(config.get_main_option("sqlalchemy.url"))
with engine.connect() as connection:
    context.configure(connection=connection, target_metadata=None)
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
"""


def _config(tmp_path: Path, url: str) -> Config:
    script = tmp_path / "alembic"
    (script / "versions").mkdir(parents=True)
    (script / "env.py").write_text(ENV_PY)
    (script / "script.py.mako").write_text("")
    cfg = Config()
    cfg.set_main_option("script_location", str(script))
    cfg.set_main_option("path_separator", "os")
    cfg.set_main_option(
        "version_locations", os.pathsep.join([str(script / "versions"), stateguard.migrations_location()])
    )
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def test_upgrade_creates_exactly_the_metadata_tables_and_downgrade_removes_them(
    backend: Backend, tmp_path: Path
) -> None:
    """Upgrading stateguard@head creates tables matching stateguard's metadata; downgrading drops them."""
    cfg = _config(tmp_path, backend.url)
    command.upgrade(cfg, "stateguard@head")
    try:
        with backend.engine.connect() as conn:
            names = set(inspect(conn).get_table_names())
            assert {t.name for t in metadata.sorted_tables} <= names
            diffs = compare_metadata(
                MigrationContext.configure(conn, opts={"compare_type": True}),
                metadata,
            )
            ours = [d for d in diffs if "stateguard_" in repr(d)]
            assert ours == [], ours
    finally:
        command.downgrade(cfg, "stateguard@base")
    with backend.engine.connect() as conn:
        assert not {t.name for t in metadata.sorted_tables} & set(inspect(conn).get_table_names())


def test_revisions_are_on_the_stateguard_branch_with_sg_ids() -> None:
    """Every shipped revision is labelled for the stateguard branch and has an sg_ id."""
    from alembic.script import ScriptDirectory

    cfg = Config()
    cfg.set_main_option("script_location", str(ROOT / "migrations"))
    cfg.set_main_option("path_separator", "os")
    cfg.set_main_option("version_locations", stateguard.migrations_location())
    scripts = ScriptDirectory.from_config(cfg)
    revisions = list(scripts.walk_revisions())
    assert revisions
    assert all(r.revision.startswith("sg_") for r in revisions)
    bases = [r for r in revisions if r.down_revision is None]
    assert len(bases) == 1 and bases[0].branch_labels == {"stateguard"}


@pytest.mark.slow
def test_wheel_ships_the_migrations(tmp_path: Path) -> None:
    """The built wheel contains py.typed and the revision files under stateguard/migrations."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        timeout=300,
    )
    wheel = next(tmp_path.glob("stateguard-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "stateguard/py.typed" in names
    assert "stateguard/migrations/versions/sg_0001_transition_log.py" in names
