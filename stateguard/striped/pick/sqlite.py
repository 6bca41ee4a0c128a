"""SQLite: one writer, so the pick needs no locks and striping buys nothing, but stays correct.

Every write holds the whole database until COMMIT, so the PostgreSQL
statement without ``FOR UPDATE`` picks and changes a stripe, the sweep reads
the stripes plainly, and a restripe takes the write lock up front (that lock
is its gate).  A SQLite older than 3.35 has no ``UPDATE ... RETURNING``:
there the pick is a SELECT, then the UPDATE of the stripe it found.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from sqlalchemy import Connection

from ... import _kernel
from ..limits import MAX_AMOUNT, SPACE
from ..statements import item_params, pick_one, sweep_named
from .base import OneStatementPick, Taken


class SQLitePick(OneStatementPick):
    """The pick of SQLite: the one-statement pick without row locks."""

    has_gate: ClassVar[bool] = False

    def __init__(self, backend: _kernel.Backend) -> None:
        super().__init__(backend, locks=False)
        self.named_sweep = sweep_named(locks=False)

    def hold_gate(self, conn: Connection, params: Mapping[str, Any]) -> None:
        # A read-then-write holds the write lock from the read on: the gate of every restripe.
        _kernel.sqlite_write_lock(conn)

    def guard_sweep(self, conn: Connection, sweep: Callable[[], Taken]) -> Taken:
        """No savepoint: with one writer, no sweep waits for another's stripes."""
        return sweep()


class SQLiteWithoutReturningPick(SQLitePick):
    """SQLite before 3.35 (no ``UPDATE ... RETURNING``): pick with a SELECT, then UPDATE."""

    def __init__(self, backend: _kernel.Backend) -> None:
        super().__init__(backend)
        self.picks = {
            sign: tuple(pick_one(skip_locked=False, wrap=wrap, sign=sign) for wrap in (False, True))
            for sign in (-1, 1)
        }

    def fast(self, conn: Connection, counter: str, item: str, by: int, sign: int) -> bool:
        params = item_params(
            counter, item, sg_by=by, sg_room=MAX_AMOUNT - by, sg_start=random.randrange(SPACE)
        )
        for stmt in self.picks[sign]:
            stripe = _kernel.execute(conn, stmt, params).scalar()
            if stripe is not None:
                return self.change_picked(conn, params, stripe, sign)
        return False
