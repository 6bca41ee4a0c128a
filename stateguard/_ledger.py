"""The counter ledger: what makes a ref'd counter change apply once, shared by every counter.

A change with ``ref=`` (:mod:`stateguard.counters`, :mod:`stateguard.striped`)
inserts a row ``(ref, table, key, column, delta)`` into
``stateguard_counter_ledger`` in the same transaction, *before* its UPDATE,
and the ledger's unique key decides whether this call is the first: a
concurrent twin waits on the index, then finds the row and is REPEATED (or
:class:`~stateguard.RefConflict` for another delta).  A change that did not
apply forgets its claim again.  The INSERT is ``ON CONFLICT DO NOTHING
RETURNING id`` on PostgreSQL and SQLite; on MariaDB a plain INSERT whose
duplicate-key error (1062) InnoDB rolls back as a single statement, and a
twin that waited reads the row back with a locking read (a plain read would
see its REPEATABLE READ snapshot).  Here too: a reservation's all-or-nothing
savepoint (:func:`reserve_all`) and the one release algorithm
(:func:`ledger_release`).  A counter names where its changes land with a
:class:`LedgerTarget`; the callers supply how a key is stored and given back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from decimal import Decimal
from typing import Any, NamedTuple, TypeVar

from sqlalchemy import Connection, Delete, Update, bindparam, delete, func, select, update

from . import _kernel
from .exceptions import RefConflict, SerializationConflict
from .result import Outcome, Result
from .tables import counter_ledger

__all__ = [
    "LedgerTarget",
    "Shortfall",
    "ledger_claim",
    "ledger_forget",
    "ledger_release",
    "ledger_same_reservation",
    "reserve_all",
]

K = TypeVar("K")

_LEDGER_FIELDS = ("ref", "table_name", "row_key", "column_name", "delta")

#: Claims a ref: the ledger row's id, or ``None`` when the unique key was taken.
_LEDGER_CLAIM = _kernel.InsertOnce(
    counter_ledger,
    {name: bindparam(f"sg_{name}") for name in _LEDGER_FIELDS},
    returning=[counter_ledger.c.id],
)


def _ledger_stmt(kind: str, backend: _kernel.Backend) -> _kernel.AnySelect | Update | Delete:
    """The ledger statements, built once per backend (all parameters bound)."""
    cache_key = ("ledger", kind, backend)
    found: _kernel.AnySelect | Update | Delete | None = _kernel.memo.get(cache_key)
    if found is not None:
        return found
    ledger = counter_ledger
    same_ref = (
        ledger.c.ref == bindparam("sg_ref"),
        ledger.c.table_name == bindparam("sg_table_name"),
        ledger.c.column_name == bindparam("sg_column_name"),
    )
    stmt: _kernel.AnySelect | Update | Delete
    if kind == "find":
        stmt = select(ledger.c.delta).where(*same_ref, ledger.c.row_key == bindparam("sg_row_key"))
        if backend.fresh_read_needs_lock:
            # InnoDB: a plain SELECT reads the REPEATABLE READ snapshot, which
            # may predate the twin's row that just made our INSERT a duplicate.
            stmt = stmt.with_for_update()
    elif kind == "forget":
        stmt = delete(ledger).where(ledger.c.id == bindparam("sg_id"))
    elif kind == "entries":
        stmt = select(ledger.c.id, ledger.c.row_key, ledger.c.delta, ledger.c.released_at).where(*same_ref)
    else:
        stmt = (
            update(ledger)
            .where(ledger.c.id.in_(bindparam("sg_ids", expanding=True)), ledger.c.released_at.is_(None))
            .values(released_at=func.current_timestamp())
        )
    return _kernel.memo.put(cache_key, stmt)


class LedgerTarget(NamedTuple):
    """Where a ref'd change lands, as the ledger names it: shared with :mod:`stateguard.striped`."""

    #: ``stateguard_counter_ledger.table_name`` (a model's table, or the stripes table).
    table_name: str
    #: ``stateguard_counter_ledger.column_name`` (a model's column, or a striped counter's name).
    column_name: str
    #: How errors name it (``Stock.amount``, ``StripedCounter('stock')``).
    name: str


def ledger_claim(
    conn: Connection,
    backend: _kernel.Backend,
    target: LedgerTarget,
    stored_key: str,
    public: Any,
    ref: str,
    delta: Any,
) -> Any:
    """Insert the ledger row of ``ref``; its id, or ``None`` when this ref already applied the same delta.

    ``stored_key`` is the ledger's ``row_key`` text (:func:`~stateguard.tables.row_key`),
    ``public`` the key as errors show it.  A different delta under the same
    ref is :class:`~stateguard.RefConflict`.
    """
    params = {
        "sg_ref": ref,
        "sg_table_name": target.table_name,
        "sg_row_key": stored_key,
        "sg_column_name": target.column_name,
        "sg_delta": str(delta),
    }
    inserted = _LEDGER_CLAIM(conn, params)
    if inserted is not None:
        return inserted[0]
    existing = _kernel.execute(conn, _ledger_stmt("find", backend), params).scalar()
    if existing is None:  # pragma: no cover - the conflicting row vanished in between
        raise SerializationConflict(
            f"the ledger row of ref {ref!r} changed while this call checked it; "
            f"roll back and retry (retry_on_conflict() does this)"
        )
    if Decimal(existing) != Decimal(delta):
        raise RefConflict(
            f"ref {ref!r} already changed {target.name} of {public!r} by "
            f"{Decimal(existing).normalize()}, not {delta}; use a new ref for a different change"
        )
    return None


def ledger_same_reservation(
    conn: Connection, backend: _kernel.Backend, target: LedgerTarget, ref: str, stored_keys: Iterable[str]
) -> None:
    """A reservation found REPEATED row by row must not leave out rows its ref took.

    Every row of a basket already under ``ref`` is REPEATED, but the ref may also
    hold rows the basket leaves out (a smaller basket sent with the ref of a
    bigger one): that is another reservation, :class:`~stateguard.RefConflict`.
    One read of the ref's ledger rows, only on this REPEATED path, without
    locks (a locking range read would block other refs' inserts): at
    REPEATABLE READ on InnoDB it may not see rows a twin committed after this
    transaction's snapshot began (the claims saw them with locking reads), so
    only rows it does see outside the basket decide.
    """
    params = {"sg_ref": ref, "sg_table_name": target.table_name, "sg_column_name": target.column_name}
    held = {row.row_key for row in _kernel.execute(conn, _ledger_stmt("entries", backend), params)}
    extra = held - set(stored_keys)
    if extra:
        raise RefConflict(
            f"ref {ref!r} also reserved {len(extra)} other {target.name} row(s) than these: it names a "
            f"different reservation; use a new ref"
        )


def reserve_all(
    conn: Connection,
    backend: _kernel.Backend,
    target: LedgerTarget,
    ref: str,
    keys: Sequence[K],
    apply: Callable[[K], Result],
    stored_key: Callable[[K], str],
) -> Result | dict[Any, Any]:
    """All or nothing: ``apply`` each of ``keys`` (in the order given) inside one savepoint.

    The first INSUFFICIENT / NOT_FOUND Result rolls the savepoint back and is
    returned; otherwise every key must have had the same outcome (else
    :class:`~stateguard.RefConflict`: the ref names another reservation), a
    REPEATED basket must cover every row the ref holds
    (:func:`ledger_same_reservation`), and ``{result.key: result.value}`` of
    the applied keys is returned with the savepoint released; the outcome is
    every Result's.  What :func:`~stateguard.reserve` and ``StripedCounter.reserve`` share.
    """
    _kernel.ensure_real_transaction(conn)
    savepoint = conn.begin_nested()
    values: dict[Any, Any] = {}
    outcomes: set[Outcome] = set()
    try:
        for key in keys:
            r = apply(key)
            if r.outcome in (Outcome.INSUFFICIENT, Outcome.NOT_FOUND):
                savepoint.rollback()
                return r
            outcomes.add(r.outcome)
            if len(outcomes) > 1:
                raise RefConflict(
                    f"ref {ref!r} already reserved some but not all of these {target.name} rows "
                    f"(not {r.key!r}): it names a different reservation; use a new ref"
                )
            values[r.key] = r
        if outcomes == {Outcome.REPEATED}:
            ledger_same_reservation(conn, backend, target, ref, [stored_key(key) for key in keys])
    except BaseException:
        _kernel.abandon_savepoint(savepoint)
        raise
    savepoint.commit()
    return values


def ledger_forget(conn: Connection, backend: _kernel.Backend, ledger_id: Any) -> None:
    """Delete a claim whose change did not apply, so the same ref can apply later."""
    _kernel.execute(conn, _ledger_stmt("forget", backend), {"sg_id": ledger_id})


class Shortfall(NamedTuple):
    """Why an undo could not apply: the units an increment's ref added are gone."""

    #: The key (as errors show it) whose amount is short.
    key: Any
    #: The amount found there.
    value: Any


def ledger_release(
    conn: Connection,
    backend: _kernel.Backend,
    target: LedgerTarget,
    ref: str,
    undo_entries: Callable[[Sequence[Any]], list[tuple[Any, Any]]],
    give_back: Callable[[Any, Any], Shortfall | None],
) -> Any:
    """Undo what ``ref`` changed in ``target``, exactly once and all or nothing.

    The one release algorithm of guarded and striped counters.
    ``undo_entries`` turns the ref's unreleased ledger rows (``row_key``,
    ``delta``) into ``(key, amount)`` pairs in lock order; ``give_back``
    adds ``amount`` to ``key``; a negative amount (the undo of an increment)
    must respect floor 0 as a decrement does and returns a
    :class:`Shortfall` when the units are gone; a positive amount that would
    pass the column's range raises InvalidArgument.  Returns the pairs undone,
    the Outcome NOT_FOUND (the ref changed nothing) or REPEATED (already
    released), or a :class:`Shortfall`: then nothing changed and the ref is
    not released (the undo runs in a savepoint; so does it when an undo raises).
    """
    params = {"sg_ref": ref, "sg_table_name": target.table_name, "sg_column_name": target.column_name}
    # Read the ref's entries without locking, then mark them released by
    # primary key with "released_at IS NULL": that UPDATE decides.  A
    # concurrent release of the same ref waits on the row locks and then
    # matches nothing (PostgreSQL re-checks the WHERE of a waiting UPDATE at
    # READ COMMITTED; InnoDB's UPDATE reads the latest committed row).  A
    # locking read of the ref would instead take InnoDB next-key locks on the
    # index range, blocking unrelated refs' ledger inserts and risking
    # deadlocks with concurrent reservations.
    _kernel.sqlite_write_lock(conn)
    entries = _kernel.execute(conn, _ledger_stmt("entries", backend), params).all()
    if not entries:
        return Outcome.NOT_FOUND
    # Entries released before stay released: a ref reused after its release
    # (on another row) releases only what it took since.
    rows = [row for row in entries if row.released_at is None]
    if not rows:
        return Outcome.REPEATED
    undo = undo_entries(rows)
    # Any undo can fail: one taking units away finds them gone (a Shortfall), one giving them
    # back finds no room below the column's maximum (InvalidArgument).  Then the mark and
    # every undo before it roll back to this savepoint, whatever the caller does next.
    _kernel.ensure_real_transaction(conn)
    savepoint = conn.begin_nested()
    try:
        mark = _ledger_stmt("mark", backend)
        marked = _kernel.execute(conn, mark, {"sg_ids": [row.id for row in rows]}).rowcount
        if not marked:
            outcome: Any = Outcome.REPEATED
        elif marked != len(rows):  # pragma: no cover - a ref's entries are marked together
            raise SerializationConflict(
                f"some ledger entries of ref {ref!r} were released by another transaction meanwhile; "
                f"roll back and retry (retry_on_conflict() does this)"
            )
        else:
            outcome = undo
            for key, amount in undo:
                short = give_back(key, amount)
                if short is not None:
                    outcome = short
                    break
    except BaseException:
        _kernel.abandon_savepoint(savepoint)
        raise
    if isinstance(outcome, Shortfall):
        savepoint.rollback()
    else:
        savepoint.commit()
    return outcome
