"""stateguard's own tables, on one ``MetaData``: the transition log and the
counter ledger, idempotency keys, consumed messages, one-time tokens and worker
leases.

Create them with the alembic revisions in ``migrations/`` (branch label
``stateguard``) or, without alembic, with :func:`create_tables`.
"""

from __future__ import annotations

from sqlalchemy import Connection, Engine, MetaData

__all__ = ["create_tables", "drop_tables", "metadata", "migrations_location"]

#: The MetaData holding every stateguard table.
metadata = MetaData()


def _load() -> None:
    # Table definitions live next to the code that uses them; importing the
    # modules registers them on ``metadata``.
    from . import _keys, counters, history  # noqa: F401


def migrations_location() -> str:
    """The absolute path of stateguard's alembic revisions (branch label ``stateguard``).

    Add it to your alembic ``version_locations`` and run
    ``alembic upgrade stateguard@head``::

        cfg.set_main_option(
            "version_locations", f"{here}/versions {stateguard.migrations_location()}"
        )
    """
    from importlib.resources import files

    return str(files("stateguard.migrations").joinpath("versions"))


def create_tables(bind: Engine | Connection) -> None:
    """Create every stateguard table that does not exist yet (no alembic needed)::

    stateguard.create_tables(engine)
    """
    _load()
    metadata.create_all(bind, checkfirst=True)


def drop_tables(bind: Engine | Connection) -> None:
    """Drop every stateguard table (for tests and teardown)."""
    _load()
    metadata.drop_all(bind, checkfirst=True)
