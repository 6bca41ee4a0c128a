"""The striped counter's refs: how the counter ledger names an item, and what a release gives back.

A change with ``ref=`` claims a row of ``stateguard_counter_ledger`` (the
table name ``stateguard_counter_stripes``, the counter's name as column, the
item as row key) in the same transaction, as the guarded counters do
(:mod:`stateguard.counters`; the claims and the release algorithm are
:mod:`stateguard._ledger`): a ref applies once, whatever happens, and is
REPEATED on redelivery; a release undoes what its ref's rows record.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final

from sqlalchemy import Connection

from .._ledger import Shortfall
from ..result import Outcome
from ..tables import DIGEST_PREFIX, row_key
from .pick import Pick
from .take import add_to_stripe_0, take

#: Marks a ledger ``row_key`` that holds an item as given rather than as JSON (see :func:`ledger_key`).
AS_GIVEN: Final = "="


def ledger_key(item: str) -> str:
    """The ledger's ``row_key`` of ``item``: its JSON when that fits the column, else ``=`` and the item.

    The JSON form is what every ledger row held before the second form existed, so a ref
    redelivered after an upgrade still finds its row.  200 characters of quotes, backslashes or
    control characters escape to more JSON than the column's 255 characters hold (``row_key``
    would store a digest, which ``release`` cannot read back); the item itself (at most
    MAX_ITEM characters, stored as given in the stripes table already) always fits.  No JSON
    text and no digest starts with ``=``, so the two forms never name the same item.
    """
    stored = row_key((item,))
    return AS_GIVEN + item if stored.startswith(DIGEST_PREFIX) else stored


def item_of(stored: str) -> str:
    """The item a ledger ``row_key`` written by :func:`ledger_key` names."""
    if stored.startswith(AS_GIVEN):
        return stored[len(AS_GIVEN) :]
    item: str = json.loads(stored)
    return item


def undo_entries(rows: Sequence[Any]) -> list[tuple[Any, Any]]:
    """A ref's unreleased ledger rows (``row_key``, ``delta``) as ``(item, amount to add)`` in item order."""
    undo: dict[str, int] = {}
    for row in rows:
        item = item_of(row.row_key)
        undo[item] = undo.get(item, 0) - int(row.delta)
    return sorted(undo.items())


def give_back(
    pick: Pick, conn: Connection, counter: str, item: str, delta: int, label: str
) -> Shortfall | None:
    """Add ``delta`` back to ``item``: a free stripe if any, else stripe 0.

    A released increment (``delta < 0``) takes its units back as a decrement does: from one
    free stripe holding them, else from as many stripes as needed (never below zero); a
    :class:`~stateguard._ledger.Shortfall` when the item has less in all.

    :raises InvalidArgument: no stripe has room for ``delta`` below 2**63 - 1.
    """
    if delta > 0 and not pick.fast(conn, counter, item, delta, 1):
        add_to_stripe_0(pick, conn, counter, item, delta, label)
    elif delta < 0:
        outcome, value = take(pick, conn, counter, item, -delta)
        if outcome is Outcome.INSUFFICIENT:
            return Shortfall(item, value)
    return None
