"""One row's history and one ref's counter ledger, for ``stateguard inspect --row`` and ``--ref``.

:func:`parse_row_key` reads a primary key written on the command line
(:class:`RowKeyError` says why one does not fit); :func:`row_report` gives
the row's current states and the logged transitions of every machine with
``history=True`` (the log outlives the row); :func:`ledger_of` the counter
ledger entries written under one ref.  Read-only, like the rest of
``stateguard inspect``.
"""

from __future__ import annotations

import datetime
import decimal
import json
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Engine, and_, inspect, select
from sqlalchemy.orm import Session

from ..machine import StateMachine
from ..tables import counter_ledger

__all__ = ["RowKeyError", "ledger_of", "parse_row_key", "row_report"]


class RowKeyError(ValueError):
    """A ``--row`` key that does not fit the model's primary key (the message says why).

    ::

        try:
            parse_row_key(Order, "abc")
        except RowKeyError as error:
            print(error)   # Order.id is int: 'abc' is not one (...)
    """


def parse_row_key(model: type[Any], text: str) -> tuple[Any, ...]:
    """The primary key of ``model`` written as ``text``: ``42``, ``a-1``, or ``[1, "x"]`` for a composite key.

    Each value is converted to its column's Python type (int, Decimal, UUID, ...)::

        parse_row_key(Order, "42")        # (42,)
        parse_row_key(Line, '[7, "b"]')   # (7, 'b')
    """
    columns = inspect(model).primary_key
    if len(columns) == 1:
        values: list[Any] = [text]
    else:
        try:
            loaded = json.loads(text)
        except ValueError:
            loaded = None
        if not isinstance(loaded, list) or len(loaded) != len(columns):
            names = ", ".join(str(c.name) for c in columns)
            raise RowKeyError(
                f"{model.__name__} has a composite primary key ({names}): write it as a JSON list, "
                f"e.g. {model.__name__}:'[1, \"a\"]'"
            )
        values = loaded
    key = []
    for column, value in zip(columns, values, strict=True):
        try:
            kind: type[Any] | None = column.type.python_type
        except NotImplementedError:
            kind = None
        try:
            if kind is None or isinstance(value, kind):
                key.append(value)
            elif kind is bool:
                raise ValueError("booleans are not keys")
            elif kind in (int, float, decimal.Decimal, uuid.UUID, str):
                key.append(kind(str(value)))
            else:
                key.append(value)
        except (ValueError, decimal.InvalidOperation, TypeError) as error:
            what = kind.__name__ if kind is not None else "value"
            raise RowKeyError(
                f"{model.__name__}.{column.name} is {what}: {value!r} is not one ({error})"
            ) from None
    return tuple(key)


def _json_ready(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return str(value)


def row_report(
    engine: Engine | Connection,
    model: type[Any],
    machines: Sequence[StateMachine[Any]],
    key: tuple[Any, ...],
    *,
    log_present: bool = True,
) -> dict[str, Any]:
    """One row's current states and the logged transitions of each machine with ``history=True``.

    The history is read with :meth:`StateMachine.history`, oldest first; it
    outlives the row, so a deleted row still shows it (``found`` false)::

        row_report(engine, Order, [Order.flow], (42,))
        # {'model': 'Order', 'table': 'orders', 'key': [42], 'found': True,
        #  'machines': [{'machine': 'flow', 'state': 'paid', 'history_kept': True, 'history': [...]}]}
    """
    mapper = inspect(model)
    table = mapper.local_table
    pk = list(mapper.primary_key)
    with Session(engine) as session:
        condition = and_(*(c == v for c, v in zip(pk, key, strict=True)))
        current = session.execute(select(*(m.state_column for m in machines)).where(condition)).first()
        out_machines = []
        for i, machine in enumerate(machines):
            entry: dict[str, Any] = {
                "machine": machine.name,
                "state": None if current is None else _state_name(machine, current[i]),
                "history_kept": bool(machine.history_enabled),
                "history": None,
            }
            if machine.history_enabled and log_present:
                entry["history"] = [
                    {
                        "trigger": h.trigger,
                        "source": machine.codec.name(h.source),
                        "dest": machine.codec.name(h.dest),
                        "at": _json_ready(h.at),
                        "request_id": h.request_id,
                        "version": h.version,
                        "metadata": _json_ready(h.metadata),
                    }
                    for h in machine.history(session, key)
                ]
            out_machines.append(entry)
    return {
        "model": model.__name__,
        "table": str(getattr(table, "name", "?")),
        "key": [_json_ready(v) for v in key],
        "found": current is not None,
        "transition_log_missing": not log_present,
        "machines": out_machines,
    }


def _state_name(machine: StateMachine[Any], value: Any) -> str | None:
    if value is None:
        return None
    return machine.codec.name(machine.codec.from_db(value))


def ledger_of(conn: Connection, ref: str) -> dict[str, Any]:
    """The counter ledger entries written under ``ref``, in the order they were written.

    ::

        ledger_of(conn, "order-42")["entries"]
        # [{'table': 'stock', 'row_key': '"sku-1"', 'column': 'quantity', 'delta': '-2',
        #   'created_at': '...', 'released_at': None}]
    """
    rows = conn.execute(
        select(
            counter_ledger.c.table_name,
            counter_ledger.c.row_key,
            counter_ledger.c.column_name,
            counter_ledger.c.delta,
            counter_ledger.c.created_at,
            counter_ledger.c.released_at,
        )
        .where(counter_ledger.c.ref == ref)
        .order_by(counter_ledger.c.id)
    ).all()
    return {
        "ref": ref,
        "entries": [
            {
                "table": r.table_name,
                "row_key": r.row_key,
                "column": r.column_name,
                "delta": r.delta,
                "created_at": _json_ready(r.created_at),
                "released_at": _json_ready(r.released_at),
            }
            for r in rows
        ],
    }
