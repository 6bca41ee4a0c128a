"""The demo's own namespace: a PostgreSQL schema, a MariaDB/MySQL database or a SQLite file.

:func:`open_namespace` creates it (``--schema``) and returns a
:class:`DemoNamespace` whose engine sees only it; a marker table
(:data:`MARKER_TABLE`) says the demo made it, so the demo drops only what
it made and refuses (:class:`DemoNamespaceTaken`) a namespace of that name
it did not make.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, event, insert, text
from sqlalchemy.engine import URL

from ...exceptions import InvalidArgument

__all__ = [
    "DEFAULT_SCHEMA",
    "MARKER_TABLE",
    "DemoNamespace",
    "DemoNamespaceTaken",
    "check_schema_name",
    "namespace_url",
    "open_namespace",
]

#: The table that marks a namespace as made by ``stateguard demo`` (only such a namespace is ever dropped).
MARKER_TABLE = "sg_demo_namespace"
#: ``--schema`` default.
DEFAULT_SCHEMA = "sg_demo"
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,47}\Z")
#: Outside DemoBase: run_demo drops and creates DemoBase's tables, never the marker.
_marker = Table(MARKER_TABLE, MetaData(), Column("id", Integer, primary_key=True), Column("note", String(80)))


class DemoNamespaceTaken(InvalidArgument):
    """The demo's namespace (``--schema``) already exists and was not made by the demo.

    The demo never writes into, nor drops, a schema, database or file it did
    not create: pass another ``--schema NAME``.
    """


@dataclass
class DemoNamespace:
    """Where the demo writes: its own PostgreSQL schema, MariaDB/MySQL database or SQLite file.

    ``engine`` sees only that namespace (every table the demo creates,
    stateguard's own tables included, lands there); :meth:`drop` removes it
    all.  Made by :func:`open_namespace`::

        namespace = open_namespace(make_url("postgresql+psycopg://app@db/app"), "sg_demo", connect)
        try:
            report = run_demo(namespace.engine)
        finally:
            namespace.drop()
    """

    name: str
    #: ``'PostgreSQL schema "sg_demo"'``, ``'MariaDB database `sg_demo`'``, ``'SQLite file /x/a.sg_demo.db'``.
    where: str
    engine: Engine
    #: How to get rid of it by hand (``DROP SCHEMA ... CASCADE``, ``rm ...``), printed with ``--keep``.
    drop_hint: str
    _drop: Callable[[], None]
    #: The engine on the database ``--db`` names (PostgreSQL, MariaDB), which drops the namespace.
    admin: Engine | None = None

    def drop(self) -> None:
        """Dispose of the engines and drop the whole namespace (schema, database or file)."""
        self.engine.dispose()
        try:
            self._drop()
        finally:
            self.close()

    def close(self) -> None:
        """Dispose of the engines and keep the namespace (``--keep``)."""
        self.engine.dispose()
        if self.admin is not None:
            self.admin.dispose()


def namespace_url(url: URL, name: str) -> URL:
    """The URL of the demo's namespace ``name`` on the database ``url`` names.

    * PostgreSQL: ``url`` itself (the schema is chosen by ``search_path``);
    * MariaDB/MySQL: the database ``name`` on the same server;
    * SQLite: the file ``<stem>.<name>.db`` next to ``url``'s file (an
      attached database would not hide the user's same-named tables: SQLite
      looks unqualified names up in ``main`` first).

    ::

        namespace_url(make_url("sqlite:///shop.db"), "sg_demo")   # sqlite:///shop.sg_demo.db
    """
    check_schema_name(name)
    backend = url.get_backend_name()
    if backend == "sqlite":
        database = url.database or ""
        if database in ("", ":memory:") or database.startswith("file:"):
            raise InvalidArgument(f"the demo needs a SQLite file path, got {database!r}")
        path = Path(database)
        return url.set(database=str(path.with_name(f"{path.stem}.{name}.db")))
    if backend in ("mysql", "mariadb"):
        return url.set(database=name)
    return url


def check_schema_name(name: str) -> str:
    """``name`` if it is a valid ``--schema`` (lower-case letters, digits, ``_``; 48 at most).

    Anything else raises :class:`~stateguard.InvalidArgument`::

        check_schema_name("sg_demo")
    """
    if not _SCHEMA_NAME.match(name):
        raise InvalidArgument(
            f"--schema must be lower-case letters, digits and _ (not starting with a digit, "
            f"48 characters at most), got {name!r}"
        )
    return name


def open_namespace(url: URL, name: str, connect: Callable[[URL], Engine]) -> DemoNamespace:
    """Create the demo's namespace ``name`` on ``url`` and return an engine that sees only it.

    ``connect(url)`` makes a connected engine (the CLI's ``open_engine``).
    A namespace of that name left by an earlier ``--keep`` or interrupted
    run (it has the :data:`MARKER_TABLE`) is dropped and made again; one
    that exists without the marker raises :class:`DemoNamespaceTaken` and
    nothing is written.  See :func:`namespace_url` for what a namespace is
    on each backend.
    """
    check_schema_name(name)
    backend = url.get_backend_name()
    if backend == "sqlite":
        namespace = _sqlite_namespace(url, name, connect)
    else:
        namespace = _server_namespace(url, name, connect)
    try:
        with namespace.engine.begin() as conn:
            _marker.create(conn)
            conn.execute(
                insert(_marker), [{"id": 1, "note": "made by stateguard demo; dropped after the run"}]
            )
    except BaseException:
        namespace.drop()
        raise
    return namespace


def _server_namespace(url: URL, name: str, connect: Callable[[URL], Engine]) -> DemoNamespace:
    backend = url.get_backend_name()
    admin = connect(url)
    try:
        if backend == "postgresql":
            namespace = _pg_namespace(admin, url, name, connect)
        elif backend in ("mysql", "mariadb"):
            namespace = _mysql_namespace(admin, url, name, connect)
        else:
            raise InvalidArgument(f"the demo runs on PostgreSQL, MariaDB/MySQL and SQLite, not {backend}")
    except BaseException:
        admin.dispose()
        raise
    return namespace


def _taken(where: str) -> DemoNamespaceTaken:
    return DemoNamespaceTaken(
        f"{where} already exists and was not made by stateguard demo (it has no {MARKER_TABLE} table); "
        "the demo never writes into it: pass another --schema NAME"
    )


def _pg_namespace(admin: Engine, url: URL, name: str, connect: Callable[[URL], Engine]) -> DemoNamespace:
    where = f'PostgreSQL schema "{name}"'
    with admin.connect() as conn, conn.begin():
        exists = conn.scalar(text("SELECT 1 FROM pg_namespace WHERE nspname = :n"), {"n": name})
        if exists:
            if conn.scalar(text("SELECT to_regclass(:t)"), {"t": f'"{name}".{MARKER_TABLE}'}) is None:
                raise _taken(where)
            conn.execute(text(f'DROP SCHEMA "{name}" CASCADE'))
        conn.execute(text(f'CREATE SCHEMA "{name}"'))
    engine = connect(url)

    @event.listens_for(engine, "connect", insert=True)
    def search_path(dbapi_connection: Any, record: Any) -> None:
        autocommit = dbapi_connection.autocommit
        dbapi_connection.autocommit = True
        cursor = dbapi_connection.cursor()
        cursor.execute(f'SET search_path TO "{name}"')
        cursor.close()
        dbapi_connection.autocommit = autocommit

    engine.dispose()  # the connection open_engine tested predates the listener

    def drop() -> None:
        with admin.connect() as conn, conn.begin():
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))

    return DemoNamespace(name, where, engine, f'DROP SCHEMA "{name}" CASCADE', drop, admin)


def _mysql_namespace(admin: Engine, url: URL, name: str, connect: Callable[[URL], Engine]) -> DemoNamespace:
    kind = "MariaDB" if getattr(admin.dialect, "is_mariadb", False) else "MySQL"
    where = f"{kind} database `{name}`"
    with admin.connect() as conn:
        exists = conn.scalar(
            text("SELECT 1 FROM information_schema.schemata WHERE schema_name = :n"), {"n": name}
        )
        if exists:
            marked = conn.scalar(
                text("SELECT 1 FROM information_schema.tables WHERE table_schema = :n AND table_name = :t"),
                {"n": name, "t": MARKER_TABLE},
            )
            if not marked:
                raise _taken(where)
            conn.execute(text(f"DROP DATABASE `{name}`"))
        conn.execute(text(f"CREATE DATABASE `{name}`"))
        conn.commit()
    engine = connect(url.set(database=name))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))
            conn.commit()

    return DemoNamespace(name, where, engine, f"DROP DATABASE `{name}`", drop, admin)


def _sqlite_files(path: Path) -> list[Path]:
    return [path, *(path.with_name(path.name + suffix) for suffix in ("-wal", "-shm", "-journal"))]


def _sqlite_namespace(url: URL, name: str, connect: Callable[[URL], Engine]) -> DemoNamespace:
    import sqlite3

    ns_url = namespace_url(url, name)
    path = Path(ns_url.database or "").resolve()
    where = f"SQLite file {path}"
    if path.exists():
        # Read-only look (a plain connect would create nothing, but must not change anything either).
        probe = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            marked = probe.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (MARKER_TABLE,)
            ).fetchone()
        except sqlite3.DatabaseError as error:
            raise DemoNamespaceTaken(
                f"{where} exists and is not a SQLite database ({error}): pass another --schema NAME"
            ) from error
        finally:
            probe.close()
        if not marked:
            raise _taken(where)
        for file in _sqlite_files(path):
            file.unlink(missing_ok=True)
    engine = connect(ns_url)

    def drop() -> None:
        for file in _sqlite_files(path):
            file.unlink(missing_ok=True)

    return DemoNamespace(name, where, engine, f"rm {path}", drop)
