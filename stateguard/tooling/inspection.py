"""``stateguard inspect``: what a live database holds, and what is stuck in it.

Read-only.  Per declared state machine, the rows in each state (one
``GROUP BY`` per machine); from stateguard's own tables, the work that is
stuck or waiting: idempotency keys in progress past their lease, expired keys
and tokens not purged yet, worker-id leases, the outbox backlog.  Every
"past", "expired" and "age" is judged on the database's clock
(:func:`stateguard._kernel.db_now_ms`, inside the reading statement), as the
claims themselves are, so an application server whose clock is off reports
the same.  A missing stateguard table is reported, not an error::

    with engine.connect() as conn:
        report = inspect_database(conn, [Order.flow])
    report.stuck          # ['2 idempotency keys in progress past their lease', ...]
    report.as_dict()      # the --json shape (README "stateguard inspect")
"""

from __future__ import annotations

import datetime
import decimal
import io
import itertools
import json
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final, TextIO

from sqlalchemy import Connection, Engine, String, and_, case, cast, func, inspect, literal, select
from sqlalchemy.orm import Session

from .._kernel import db_now_ms, is_galera
from ..machine import StateMachine
from ..machine.ddl import stored_states
from ..tables import (
    counter_ledger,
    idempotency_keys,
    metadata,
    outbox,
    tokens,
    worker_leases,
)
from .terminal import isatty

__all__ = [
    "DEFAULT_LIMIT",
    "DEFAULT_STALE_MS",
    "Inspection",
    "MachineCounts",
    "RowKeyError",
    "ScanProgress",
    "count_states",
    "inspect_database",
    "ledger_of",
    "parse_row_key",
    "render_text",
    "row_report",
]

#: Stuck examples listed per kind (``--limit``).
DEFAULT_LIMIT: Final = 20
#: An unpublished outbox event older than this is stuck (``--stale``, 5 minutes).
DEFAULT_STALE_MS: Final = 300_000


# --------------------------------------------------------------------------
# Progress on stderr while a statement scans a large table
# --------------------------------------------------------------------------


class ScanProgress:
    """One line on a terminal naming the statement running and for how long, redrawn in place.

    Drawn only once a step has run longer than ``delay`` seconds (a
    ``GROUP BY`` over millions of rows), from a background thread, since one
    statement gives no progress of its own; cleared when the step ends,
    whatever happens.  Silent when the stream is no terminal or ``enabled``
    is false (``--json``)::

        progress = ScanProgress(sys.stderr)
        with progress.step("counting orders.status"):
            conn.execute(...)
    """

    def __init__(
        self, stream: TextIO, *, enabled: bool = True, delay: float = 0.5, interval: float = 0.1
    ) -> None:
        self.stream = stream
        self.active = enabled and isatty(stream)
        self.delay = delay
        self.interval = interval
        self.index = 0
        self.count = 0

    @contextmanager
    def step(self, title: str) -> Iterator[None]:
        """Run the body as step ``title``; the line is drawn while it runs and cleared when it ends."""
        self.index += 1
        if not self.active:
            yield
            return
        done = threading.Event()
        drawn = threading.Event()
        lock = threading.Lock()
        started = time.monotonic()
        where = f"[{self.index}/{self.count}] " if self.count else ""

        def tick() -> None:
            spinner = itertools.cycle("|/-\\")
            if done.wait(self.delay):
                return
            while not done.is_set():
                with lock:
                    if done.is_set():
                        return
                    elapsed = time.monotonic() - started
                    self.stream.write(
                        f"\r\x1b[Kstateguard inspect: {where}{title} {next(spinner)} {elapsed:.1f}s"
                    )
                    self.stream.flush()
                    drawn.set()
                done.wait(self.interval)

        thread = threading.Thread(target=tick, name="stateguard-inspect-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            with lock:
                done.set()
                if drawn.is_set():
                    self.stream.write("\r\x1b[K")
                    self.stream.flush()
            thread.join()


def _quiet() -> ScanProgress:
    return ScanProgress(io.StringIO(), enabled=False)


# --------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------


@dataclass
class MachineCounts:
    """Rows per state of one machine's table; ``table_missing`` when the table is not there.

    ``states`` lists every declared state in declaration order (0 included);
    ``undeclared`` the stored values no state matches (``stateguard check``
    explains those); ``null`` rows without a state::

        MachineCounts("Order", "flow", "orders", "status", {"pending": 3, "paid": 12}, {}, 0)
    """

    model: str
    machine: str
    table: str
    column: str
    states: dict[str, int]
    undeclared: dict[str, int]
    null: int
    table_missing: bool = False
    drawing: str | None = None
    file: str | None = None

    @property
    def total(self) -> int:
        """Every row of the table."""
        return sum(self.states.values()) + sum(self.undeclared.values()) + self.null

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` form (``drawing``/``file`` only when drawn)."""
        data: dict[str, Any] = {
            "model": self.model,
            "machine": self.machine,
            "table": self.table,
            "column": self.column,
            "table_missing": self.table_missing,
            "total": self.total,
            "states": dict(self.states),
            "undeclared": dict(self.undeclared),
            "null": self.null,
        }
        if self.drawing is not None:
            data["drawing"] = self.drawing
        if self.file is not None:
            data["file"] = self.file
        return data


@dataclass
class Inspection:
    """What :func:`inspect_database` found; ``stuck`` lists why the command exits 1 (empty: 0).

    Sections (``idempotency``, ``tokens``, ``worker_leases``, ``outbox``) are
    ``None`` when their table is missing; ``row`` and ``ledger`` are filled by
    ``--row`` and ``--ref``::

        report = inspect_database(conn, [Order.flow])
        if report.stuck:
            print("; ".join(report.stuck))
    """

    database: str
    db_now_ms: int
    tables_present: list[str]
    tables_missing: list[str]
    machines: list[MachineCounts] = field(default_factory=list)
    idempotency: dict[str, Any] | None = None
    tokens: dict[str, Any] | None = None
    worker_leases: dict[str, Any] | None = None
    outbox: dict[str, Any] | None = None
    stuck: list[str] = field(default_factory=list)
    row: dict[str, Any] | None = None
    ledger: dict[str, Any] | None = None
    #: What the server is, as far as stateguard's behaviour depends on it: the dialect's name,
    #: and "Galera cluster node" where GET_LOCK is local and conflicts surface at COMMIT.
    server: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` shape: every key always present (``null`` for a section not read)::

        {"ok", "stuck", "database", "server", "db_now_ms", "tables": {"present", "missing"},
         "machines", "idempotency", "tokens", "worker_leases", "outbox", "row", "ledger"}
        """
        return {
            "ok": not self.stuck,
            "stuck": list(self.stuck),
            "database": self.database,
            "server": self.server,
            "db_now_ms": self.db_now_ms,
            "tables": {"present": list(self.tables_present), "missing": list(self.tables_missing)},
            "machines": [m.as_dict() for m in self.machines],
            "idempotency": self.idempotency,
            "tokens": self.tokens,
            "worker_leases": self.worker_leases,
            "outbox": self.outbox,
            "row": self.row,
            "ledger": self.ledger,
        }


def _model_name(machine: StateMachine[Any]) -> str:
    return machine.model.__name__ if machine.model is not None else "?"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).isoformat(timespec="milliseconds")


# --------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------

#: stateguard's tables ``inspect`` reads or lists, in report order.
_TABLES: Final = tuple(t.name for t in metadata.sorted_tables)


def count_states(conn: Connection, machine: StateMachine[Any]) -> MachineCounts:
    """Rows per state of ``machine``'s table: one ``SELECT state, COUNT(*) ... GROUP BY state``.

    The column is compared as text, so native enum columns work too::

        count_states(conn, Order.flow).states   # {'pending': 3, 'paid': 12, ...}
    """
    col = machine.state_column
    table = col.table
    names = [machine.codec.name(s) for s in machine.states]
    result = MachineCounts(
        _model_name(machine), machine.name, str(table.name), str(col.name), dict.fromkeys(names, 0), {}, 0
    )
    if not inspect(conn).has_table(str(table.name), schema=getattr(table, "schema", None)):
        result.table_missing = True
        return result
    by_stored = dict(zip(stored_states(machine, conn.dialect), names, strict=True))
    as_text = cast(col, String())
    stmt = select(as_text, func.count()).select_from(table).group_by(as_text)
    for value, count in conn.execute(stmt).all():
        if value is None:
            result.null += int(count)
        elif value in by_stored:
            result.states[by_stored[value]] += int(count)
        else:
            result.undeclared[str(value)] = int(count)
    return result


def _now(conn: Connection) -> int:
    return int(conn.execute(select(db_now_ms())).scalar_one())


def _sum(condition: Any) -> Any:
    return func.coalesce(func.sum(case((condition, 1), else_=0)), 0)


def _idempotency(conn: Connection, limit: int) -> dict[str, Any]:
    t = idempotency_keys
    now = db_now_ms()
    alive = t.c.expires_ms > now
    in_progress = and_(alive, t.c.status == "in_progress")
    lease = func.coalesce(t.c.locked_until_ms, 0)
    past_lease = and_(in_progress, lease <= now)
    row = conn.execute(
        select(
            func.count().label("total"),
            _sum(and_(in_progress, lease > now)).label("live"),
            _sum(and_(past_lease, lease > 0)).label("lapsed"),
            _sum(and_(past_lease, lease == 0)).label("released"),
            _sum(and_(alive, t.c.status == "completed")).label("completed"),
            _sum(and_(alive, t.c.status == "failed")).label("failed"),
            _sum(t.c.expires_ms <= now).label("expired"),
            now.label("now"),
        ).select_from(t)
    ).one()
    examples = conn.execute(
        select(
            t.c.scope,
            t.c.idem_key,
            t.c.owner,
            t.c.attempt,
            t.c.locked_until_ms,
            t.c.updated_ms,
            t.c.expires_ms,
            t.c.checkpoint_name,
            now.label("now"),
        )
        .where(past_lease)
        .order_by(lease, t.c.scope, t.c.idem_key)
        .limit(limit)
    ).all()
    return {
        "total": int(row.total),
        "in_progress": int(row.live) + int(row.lapsed) + int(row.released),
        "live": int(row.live),
        "past_lease": int(row.lapsed) + int(row.released),
        "released": int(row.released),
        "completed": int(row.completed),
        "failed": int(row.failed),
        "expired": int(row.expired),
        "stuck": [
            {
                "scope": r.scope,
                "key": r.idem_key,
                "owner": r.owner,
                "attempt": int(r.attempt),
                "released": not r.locked_until_ms,
                "lease_ended_ms_ago": int(r.now - r.locked_until_ms) if r.locked_until_ms else None,
                "last_update_ms_ago": int(r.now - r.updated_ms),
                "expires_in_ms": int(r.expires_ms - r.now),
                "checkpoint": r.checkpoint_name,
            }
            for r in examples
        ],
    }


def _tokens(conn: Connection) -> dict[str, Any]:
    t = tokens
    now = db_now_ms()
    alive = t.c.expires_ms > now
    row = conn.execute(
        select(
            func.count().label("total"),
            _sum(and_(alive, t.c.consumed_ms.is_(None))).label("live"),
            _sum(and_(alive, t.c.consumed_ms.is_not(None))).label("consumed"),
            _sum(t.c.expires_ms <= now).label("expired"),
            func.min(case((t.c.expires_ms <= now, t.c.expires_ms), else_=None)).label("oldest"),
            now.label("now"),
        ).select_from(t)
    ).one()
    return {
        "total": int(row.total),
        "live": int(row.live),
        "consumed": int(row.consumed),
        "expired": int(row.expired),
        "oldest_expired_ms_ago": None if row.oldest is None else int(row.now - row.oldest),
    }


def _leases(conn: Connection, limit: int) -> dict[str, Any]:
    t = worker_leases
    now = db_now_ms()
    # ids.py: a lease is free when it has no owner or its end is past (lease_expires_ms < db_now).
    state = case(
        (t.c.owner.is_(None), literal("free")),
        (t.c.lease_expires_ms < now, literal("expired")),
        else_=literal("live"),
    )
    counts = {"live": 0, "expired": 0, "free": 0}
    namespaces: dict[str, dict[str, int]] = {}
    for namespace, kind, n in conn.execute(
        select(t.c.namespace, state, func.count()).group_by(t.c.namespace, state).order_by(t.c.namespace)
    ):
        counts[str(kind)] += int(n)
        namespaces.setdefault(str(namespace), {"live": 0, "expired": 0, "free": 0})[str(kind)] = int(n)
    rows = conn.execute(
        select(t.c.namespace, t.c.worker_id, t.c.owner, t.c.lease_expires_ms, state.label("state"), now)
        .where(t.c.owner.is_not(None))
        .order_by(t.c.namespace, t.c.worker_id)
        .limit(limit)
    ).all()
    return {
        **counts,
        "namespaces": namespaces,
        "leases": [
            {
                "namespace": r.namespace,
                "worker_id": int(r.worker_id),
                "owner": r.owner,
                "state": r.state,
                "expires_in_ms": int(r.lease_expires_ms - r[5]),
            }
            for r in rows
        ],
    }


def _outbox(conn: Connection, stale_ms: int, limit: int) -> dict[str, Any]:
    t = outbox
    now = db_now_ms()
    pending = t.c.published_ms.is_(None)
    dead = and_(pending, t.c.dead_ms.is_not(None))
    alive = and_(pending, t.c.dead_ms.is_(None))
    row = conn.execute(
        select(
            func.count().label("total"),
            _sum(pending).label("unpublished"),
            _sum(and_(alive, t.c.claimed_until_ms > now)).label("leased"),
            _sum(and_(alive, t.c.attempts > 1)).label("retried"),
            _sum(and_(alive, t.c.created_ms <= now - stale_ms)).label("stale"),
            _sum(dead).label("dead"),
            func.min(case((pending, t.c.created_ms), else_=None)).label("oldest"),
            now.label("now"),
        ).select_from(t)
    ).one()
    topics = {
        str(topic): int(n)
        for topic, n in conn.execute(
            select(t.c.topic, func.count()).where(pending).group_by(t.c.topic).order_by(t.c.topic)
        )
    }
    dead_events = [
        {
            "id": int(r.id),
            "topic": r.topic,
            "key": r.key,
            "refusals": int(r.refusals),
            "dead_ms_ago": int(r.sg_now - r.dead_ms),
            "last_error": r.last_error,
        }
        for r in conn.execute(
            select(t.c.id, t.c.topic, t.c.key, t.c.refusals, t.c.dead_ms, t.c.last_error, now.label("sg_now"))
            .where(dead)
            .order_by(t.c.id)
            .limit(limit)
        )
    ]
    return {
        "total": int(row.total),
        "unpublished": int(row.unpublished),
        "dead": int(row.dead),
        "dead_events": dead_events,
        "published": int(row.total) - int(row.unpublished),
        "leased": int(row.leased),
        "retried": int(row.retried),
        "oldest_unpublished_ms_ago": None if row.oldest is None else int(row.now - row.oldest),
        "stale_after_ms": stale_ms,
        "stale": int(row.stale),
        "unpublished_by_topic": topics,
    }


def describe_server(conn: Connection) -> str:
    """The server as stateguard treats it: ``"postgresql"``, ``"mariadb"``, or ``"mariadb (Galera
    cluster node, 3 nodes)"`` where advisory_lock is refused and conflicts surface at COMMIT::

        with engine.connect() as conn:
            describe_server(conn)   # 'sqlite'
    """
    name = conn.dialect.name
    if not is_galera(conn):
        return name
    row = conn.exec_driver_sql("SHOW GLOBAL STATUS LIKE 'wsrep_cluster_size'").first()
    size = f", {row[1]} nodes" if row is not None else ""
    return f"{name} (Galera cluster node{size})"


def inspect_database(
    conn: Connection,
    machines: Sequence[StateMachine[Any]] = (),
    *,
    limit: int = DEFAULT_LIMIT,
    stale_ms: int = DEFAULT_STALE_MS,
    progress: ScanProgress | None = None,
    database: str = "",
) -> Inspection:
    """Read the rows per state of ``machines`` and the state of stateguard's tables.

    Sections of missing tables stay ``None`` (their names are in
    ``tables_missing``).  ``stuck`` says what makes ``stateguard inspect``
    exit 1: idempotency keys in progress past their lease (the worker died,
    or released the key and no retry came), outbox events unpublished for
    ``stale_ms`` or longer::

        with engine.connect() as conn:
            report = inspect_database(conn, [Order.flow], stale_ms=60_000)
        [m.states for m in report.machines]   # [{'pending': 3, 'paid': 12, ...}]
    """
    progress = progress or _quiet()
    checker = inspect(conn)
    present = [name for name in _TABLES if checker.has_table(name)]
    missing = [name for name in _TABLES if name not in present]
    readers: list[tuple[str, str, Any]] = []
    if idempotency_keys.name in present:
        readers.append(("idempotency", idempotency_keys.name, lambda: _idempotency(conn, limit)))
    if tokens.name in present:
        readers.append(("tokens", tokens.name, lambda: _tokens(conn)))
    if worker_leases.name in present:
        readers.append(("worker_leases", worker_leases.name, lambda: _leases(conn, limit)))
    if outbox.name in present:
        readers.append(("outbox", outbox.name, lambda: _outbox(conn, stale_ms, limit)))
    progress.count = progress.index + len(machines) + len(readers)
    report = Inspection(database, _now(conn), present, missing, server=describe_server(conn))
    for machine in machines:
        col = machine.state_column
        with progress.step(f"counting {col.table.name}.{col.name}"):
            report.machines.append(count_states(conn, machine))
    for attr, table_name, read in readers:
        with progress.step(f"reading {table_name}"):
            setattr(report, attr, read())
    if report.idempotency is not None and report.idempotency["past_lease"]:
        keys = report.idempotency
        released = f" ({keys['released']} released, no retry yet)" if keys["released"] else ""
        their = "its" if keys["past_lease"] == 1 else "their"
        report.stuck.append(
            f"{_plural(keys['past_lease'], 'idempotency key')} in progress past {their} lease{released}"
        )
    if report.outbox is not None and report.outbox["stale"]:
        report.stuck.append(
            f"{_plural(report.outbox['stale'], 'outbox event')} unpublished for "
            f"{stale_ms / 1000:g} s or longer"
        )
    if report.outbox is not None and report.outbox["dead"]:
        report.stuck.append(
            f"{_plural(report.outbox['dead'], 'outbox event')} dead (refused by the sink max_attempts "
            f"times; requeue with `stateguard outbox requeue` or stateguard.requeue_dead())"
        )
    return report


# --------------------------------------------------------------------------
# One row's history, one ref's ledger
# --------------------------------------------------------------------------


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
    t = counter_ledger
    rows = conn.execute(
        select(t.c.table_name, t.c.row_key, t.c.column_name, t.c.delta, t.c.created_at, t.c.released_at)
        .where(t.c.ref == ref)
        .order_by(t.c.id)
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


# --------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------


def _ago(ms: int | None) -> str:
    if ms is None:
        return "-"
    seconds = ms / 1000
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def render_text(report: Inspection, *, color: bool = False) -> str:
    """The human report of ``stateguard inspect`` (what ``--json`` holds, as lines).

    ::

        print(render_text(inspect_database(conn, [Order.flow]), color=sys.stdout.isatty()))
    """
    red, green, off = ("\x1b[31m", "\x1b[32m", "\x1b[0m") if color else ("", "", "")
    head = f"{report.server}, " if report.server else ""
    lines = [f"stateguard inspect: {report.database} ({head}database clock {_iso(report.db_now_ms)})"]
    for m in report.machines:
        where = f"{m.model}.{m.machine} ({m.table}.{m.column})"
        if m.table_missing:
            lines.append(f"\n{where}: {red}table {m.table} is missing{off}")
            continue
        lines.append(f"\n{where}: {_plural(m.total, 'row')}")
        width = max([len(s) for s in [*m.states, *m.undeclared]] + [4])
        for state, n in m.states.items():
            lines.append(f"  {state:<{width}} {n:>10}")
        for state, n in m.undeclared.items():
            lines.append(f"  {state:<{width}} {n:>10}  {red}undeclared (see stateguard check){off}")
        if m.null:
            lines.append(f"  {'NULL':<{width}} {m.null:>10}")
        if m.file is not None:
            lines.append(f"  drawn to {m.file}")
        elif m.drawing is not None:
            lines.append("")
            lines += ["  " + line if line else "" for line in m.drawing.rstrip("\n").splitlines()]
    if report.tables_missing:
        lines.append(
            f"\nstateguard tables missing (their sections are skipped): {', '.join(report.tables_missing)}"
        )
    if report.idempotency is not None:
        k = report.idempotency
        lines.append(
            f"\nidempotency keys: {k['total']}: {k['in_progress']} in progress ({k['live']} live, "
            f"{k['past_lease']} past their lease, {k['released']} of them released), "
            f"{k['completed']} completed, {k['failed']} failed, {k['expired']} expired (not purged yet)"
        )
        for s in k["stuck"]:
            why = (
                "released, waiting for a retry"
                if s["released"]
                else f"lease ended {_ago(s['lease_ended_ms_ago'])} ago"
            )
            checkpoint = f", checkpoint {s['checkpoint']}" if s["checkpoint"] else ""
            lines.append(
                f"  {red}stuck{off} {s['scope']} / {s['key']}: attempt {s['attempt']}, {why}, "
                f"last update {_ago(s['last_update_ms_ago'])} ago{checkpoint}"
            )
        if len(k["stuck"]) < k["past_lease"]:
            lines.append(f"  ... and {k['past_lease'] - len(k['stuck'])} more (--limit)")
    if report.tokens is not None:
        t = report.tokens
        oldest = f", the oldest {_ago(t['oldest_expired_ms_ago'])} ago" if t["expired"] else ""
        lines.append(
            f"\none-time tokens: {t['total']}: {t['live']} live, {t['consumed']} consumed, "
            f"{t['expired']} expired (not purged yet{oldest})"
        )
    if report.worker_leases is not None:
        w = report.worker_leases
        lines.append(f"\nworker-id leases: {w['live']} live, {w['expired']} expired, {w['free']} free")
        for lease in w["leases"]:
            when = (
                f"ends in {_ago(lease['expires_in_ms'])}"
                if lease["state"] == "live"
                else f"ended {_ago(-lease['expires_in_ms'])} ago"
            )
            lines.append(f"  {lease['namespace']} #{lease['worker_id']}: {lease['state']}, {when}")
    if report.outbox is not None:
        o = report.outbox
        backlog = (
            f" (the oldest {_ago(o['oldest_unpublished_ms_ago'])} old, {o['leased']} leased by a relay, "
            f"{o['retried']} handed to a sink before, "
            f"{o['stale']} older than {o['stale_after_ms'] / 1000:g} s)"
            if o["unpublished"]
            else ""
        )
        lines.append(f"\noutbox: {o['unpublished']} unpublished{backlog}, {o['published']} published")
        for topic, n in o["unpublished_by_topic"].items():
            lines.append(f"  {topic}: {n}")
        if o["dead"]:
            lines.append(f"  dead: {o['dead']} (refused by the sink, never claimed until requeued)")
        for e in o["dead_events"]:
            lines.append(
                f"    #{e['id']} {e['topic']} key={e['key']!r}: {e['refusals']} refusals, dead for "
                f"{_ago(e['dead_ms_ago'])}: {e['last_error']}"
            )
    if report.row is not None:
        lines += _row_lines(report.row)
    if report.ledger is not None:
        entries = report.ledger["entries"]
        count = f"{len(entries)} {'entry' if len(entries) == 1 else 'entries'}"
        if report.ledger.get("table_missing"):
            count = f"{red}stateguard_counter_ledger is missing{off}"
        lines.append(f"\ncounter ledger of ref {report.ledger['ref']!r}: {count}")
        for e in entries:
            released = f", released {e['released_at']}" if e["released_at"] else ""
            lines.append(
                f"  {e['table']} {e['row_key']} {e['column']} {e['delta']} at {e['created_at']}{released}"
            )
    verdict = f"{red}stuck: {'; '.join(report.stuck)}{off}" if report.stuck else f"{green}nothing stuck{off}"
    lines.append(f"\n{verdict}")
    return "\n".join(lines) + "\n"


def _row_lines(row: dict[str, Any]) -> list[str]:
    key = row["key"][0] if len(row["key"]) == 1 else row["key"]
    found = "" if row["found"] else " (no such row now)"
    lines = [f"\n{row['model']} {key} ({row['table']}){found}"]
    for m in row["machines"]:
        lines.append(f"  {m['machine']}: {m['state'] if row['found'] else '-'}")
        if not m["history_kept"]:
            lines.append("    no history kept (declare the machine with history=True)")
        elif m["history"] is None:
            lines.append("    stateguard_transition_log is missing")
        elif not m["history"]:
            lines.append("    no transitions logged")
        for h in m["history"] or ():
            extra = "".join(f" {name}={h[name]}" for name in ("request_id", "version") if h[name] is not None)
            meta = f" {json.dumps(h['metadata'], sort_keys=True)}" if h["metadata"] is not None else ""
            lines.append(f"    {h['at']}  {h['trigger']}: {h['source']} -> {h['dest']}{extra}{meta}")
    return lines
