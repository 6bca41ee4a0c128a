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
from tests.conftest import Backend

ROOT = Path(__file__).resolve().parents[2]

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
    cfg.set_main_option("script_location", str(ROOT / "stateguard" / "migrations"))
    cfg.set_main_option("path_separator", "os")
    cfg.set_main_option("version_locations", stateguard.migrations_location())
    scripts = ScriptDirectory.from_config(cfg)
    revisions = list(scripts.walk_revisions())
    assert revisions
    assert all(r.revision.startswith("sg_") for r in revisions)
    bases = [r for r in revisions if r.down_revision is None]
    assert len(bases) == 1 and bases[0].branch_labels == {"stateguard"}


INSTALLED_ENV_PY = """
import stateguard
from alembic import context
from sqlalchemy import create_engine

config = context.config
engine = create_engine(config.get_main_option("sqlalchemy.url"))
with engine.connect() as connection:
    context.configure(connection=connection, target_metadata=stateguard.tables.metadata)
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
"""

INSTALLED_INI = """
[alembic]
script_location = %(here)s/alembic
path_separator = os
"""


@pytest.mark.slow
def test_wheel_installs_in_a_fresh_venv_and_its_revisions_upgrade_and_downgrade(
    pg: Backend, mariadb: Backend, tmp_path: Path
) -> None:
    """The built wheel, installed in a new venv, runs `alembic upgrade stateguard@head` and back down."""
    venv = tmp_path / "venv"
    # The venv (its pip bootstrapped) is made while the wheel builds: two processes, two cores.
    making_venv = subprocess.Popen([sys.executable, "-m", "venv", str(venv)])
    try:
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
            check=True,
            timeout=300,
        )
        assert making_venv.wait(timeout=120) == 0, "python -m venv failed"
    finally:
        if making_venv.poll() is None:
            making_venv.kill()
            making_venv.wait()
    wheel = next(tmp_path.glob("stateguard-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "stateguard/py.typed" in names
    assert "stateguard/migrations/versions/sg_0003_keys.py" in names
    # The new venv's programs see only what is installed there: a PYTHONPATH exported for the
    # checkout (a worktree run) would put the source tree first and the test would check that.
    isolated = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    bin_dir = venv / "bin"
    subprocess.run(
        [str(bin_dir / "pip"), "install", "-q", f"{wheel}[postgres,mysql]"],
        check=True,
        timeout=600,
        env=isolated,
        cwd=tmp_path,
    )
    project = tmp_path / "userapp"
    (project / "alembic" / "versions").mkdir(parents=True)
    (project / "alembic" / "env.py").write_text(INSTALLED_ENV_PY)
    (project / "alembic" / "script.py.mako").write_text("")
    (project / "alembic.ini").write_text(INSTALLED_INI)
    # The user's own version folder plus the one inside the installed package.
    locations = subprocess.run(
        [str(bin_dir / "python"), "-c", "import stateguard; print(stateguard.migrations_location())"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
        env=isolated,
        cwd=tmp_path,  # not the checkout: the installed package must answer
    ).stdout.strip()
    assert locations.startswith(str(venv)), locations
    with (project / "alembic.ini").open("a") as ini:
        ini.write(f"version_locations = %(here)s/alembic/versions{os.pathsep}{locations}\n")
    for backend in (pg, mariadb):
        alembic = [str(bin_dir / "alembic")]
        env = {**isolated, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
        url_opt = ["-c", str(project / "alembic.ini")]
        ini_text = (project / "alembic.ini").read_text()
        (project / "alembic.ini").write_text(
            "\n".join(line for line in ini_text.splitlines() if not line.startswith("sqlalchemy.url"))
            + f"\nsqlalchemy.url = {backend.url.replace('%', '%%')}\n"
        )
        subprocess.run(
            [*alembic, *url_opt, "upgrade", "stateguard@head"], check=True, timeout=120, env=env, cwd=tmp_path
        )
        with backend.engine.connect() as conn:
            tables = set(inspect(conn).get_table_names())
        assert {t.name for t in metadata.sorted_tables} <= tables, (backend.name, tables)
        heads = subprocess.run(
            [*alembic, *url_opt, "current"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=tmp_path,
        ).stdout
        assert "sg_0009" in heads and "(head)" in heads, heads
        subprocess.run(
            [*alembic, *url_opt, "downgrade", "stateguard@base"],
            check=True,
            timeout=120,
            env=env,
            cwd=tmp_path,
        )
        with backend.engine.connect() as conn:
            left = set(inspect(conn).get_table_names())
        assert not {t.name for t in metadata.sorted_tables} & left, (backend.name, left)
