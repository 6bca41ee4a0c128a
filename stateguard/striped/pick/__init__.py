"""Where the striped counter's dialect families differ, one module each, behind :class:`Pick`.

* :mod:`~stateguard.striped.pick.base`: the interface, and the steps every family shares;
* :mod:`~stateguard.striped.pick.postgresql`: one ``UPDATE ... (SELECT ... SKIP LOCKED)``;
* :mod:`~stateguard.striped.pick.innodb`: a ``SKIP LOCKED`` read of named stripes, then UPDATE;
* :mod:`~stateguard.striped.pick.sqlite`: one writer, no locks.

:func:`pick_for` chooses the family of a backend, once, from its capabilities.
"""

from __future__ import annotations

from ... import _kernel
from .base import DEADLOCK_SWEEPS, SWEEPS, Pick, Rows, Taken
from .innodb import InnoDBPick
from .postgresql import PostgreSQLPick
from .sqlite import SQLitePick, SQLiteWithoutReturningPick

__all__ = ["DEADLOCK_SWEEPS", "SWEEPS", "Pick", "Rows", "Taken", "pick_for"]

_picks: dict[_kernel.Backend, Pick] = {}


def pick_for(backend: _kernel.Backend) -> Pick:
    """The :class:`Pick` of ``backend``'s dialect family, made on first use and kept::

    pick = pick_for(_kernel.backend(conn.dialect))
    """
    found = _picks.get(backend)
    if found is None:
        found = _picks.setdefault(backend, _family(backend)(backend))
    return found


def _family(backend: _kernel.Backend) -> type[Pick]:
    """The one place a family is chosen: by what the database can do, not by its name."""
    if not backend.row_locks:  # one writer (SQLite)
        return SQLitePick if backend.returning else SQLiteWithoutReturningPick
    if backend.fresh_read_needs_lock:  # plain reads see the transaction's snapshot (InnoDB)
        return InnoDBPick
    return PostgreSQLPick
