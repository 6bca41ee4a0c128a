"""``stateguard inspect``: what a live database holds, and what is stuck in it.

Read-only.  Per declared state machine, the rows in each state (one
``GROUP BY`` per machine); from stateguard's own tables, the work that is
stuck or waiting: idempotency keys in progress past their lease, expired keys
and tokens not purged yet, worker-id leases, the outbox backlog.  Every
"past", "expired" and "age" is judged on the database's clock
(:func:`stateguard._kernel.db_now_ms`, inside the reading statement), as the
claims themselves are, so an application server whose clock is off reports
the same.  A missing stateguard table is reported, not an error.  The text
report is :mod:`~stateguard.tooling.inspection_text`'s, ``--row`` and
``--ref`` are :mod:`~stateguard.tooling.history`'s; both are re-exported
here::

    with engine.connect() as conn:
        report = inspect_database(conn, [Order.flow])
    report.stuck          # ['2 idempotency keys in progress past their lease', ...]
    report.as_dict()      # the --json shape (README "stateguard inspect")
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from sqlalchemy import ColumnElement, Connection, String, and_, case, cast, func, inspect, literal, select

from .._kernel import backend, db_now_ms, is_galera
from .._kernel.execute import CAUSAL_BITS
from ..machine import StateMachine
from ..machine.ddl import stored_states
from ..tables import idempotency_keys, metadata, outbox, tokens, worker_leases
from .history import RowKeyError, ledger_of, parse_row_key, row_report
from .inspection_text import plural, render_text
from .terminal import ScanProgress

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
    #: and "Galera cluster node" where GET_LOCK is local, conflicts surface at COMMIT and
    #: stateguard raises ``wsrep_sync_wait`` so a lagging node does not misclassify a 0-row write.
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


def _sum(condition: ColumnElement[bool]) -> ColumnElement[int]:
    """``SUM(CASE WHEN condition THEN 1 ELSE 0 END)``, 0 on an empty table."""
    return func.coalesce(func.sum(case((condition, 1), else_=0)), 0)


def _idempotency(conn: Connection, limit: int) -> dict[str, Any]:
    now = db_now_ms()
    alive = idempotency_keys.c.expires_ms > now
    in_progress = and_(alive, idempotency_keys.c.status == "in_progress")
    lease = func.coalesce(idempotency_keys.c.locked_until_ms, 0)
    past_lease = and_(in_progress, lease <= now)
    row = conn.execute(
        select(
            func.count().label("total"),
            _sum(and_(in_progress, lease > now)).label("live"),
            _sum(and_(past_lease, lease > 0)).label("lapsed"),
            _sum(and_(past_lease, lease == 0)).label("released"),
            _sum(and_(alive, idempotency_keys.c.status == "completed")).label("completed"),
            _sum(and_(alive, idempotency_keys.c.status == "failed")).label("failed"),
            _sum(idempotency_keys.c.expires_ms <= now).label("expired"),
            now.label("now"),
        ).select_from(idempotency_keys)
    ).one()
    examples = conn.execute(
        select(
            idempotency_keys.c.scope,
            idempotency_keys.c.idem_key,
            idempotency_keys.c.owner,
            idempotency_keys.c.attempt,
            idempotency_keys.c.locked_until_ms,
            idempotency_keys.c.updated_ms,
            idempotency_keys.c.expires_ms,
            idempotency_keys.c.checkpoint_name,
            now.label("now"),
        )
        .where(past_lease)
        .order_by(lease, idempotency_keys.c.scope, idempotency_keys.c.idem_key)
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
    now = db_now_ms()
    alive = tokens.c.expires_ms > now
    row = conn.execute(
        select(
            func.count().label("total"),
            _sum(and_(alive, tokens.c.consumed_ms.is_(None))).label("live"),
            _sum(and_(alive, tokens.c.consumed_ms.is_not(None))).label("consumed"),
            _sum(tokens.c.expires_ms <= now).label("expired"),
            func.min(case((tokens.c.expires_ms <= now, tokens.c.expires_ms), else_=None)).label("oldest"),
            now.label("now"),
        ).select_from(tokens)
    ).one()
    return {
        "total": int(row.total),
        "live": int(row.live),
        "consumed": int(row.consumed),
        "expired": int(row.expired),
        "oldest_expired_ms_ago": None if row.oldest is None else int(row.now - row.oldest),
    }


def _leases(conn: Connection, limit: int) -> dict[str, Any]:
    now = db_now_ms()
    # ids.py: a lease is free when it has no owner or its end is past (lease_expires_ms < db_now).
    state = case(
        (worker_leases.c.owner.is_(None), literal("free")),
        (worker_leases.c.lease_expires_ms < now, literal("expired")),
        else_=literal("live"),
    )
    counts = {"live": 0, "expired": 0, "free": 0}
    namespaces: dict[str, dict[str, int]] = {}
    for namespace, kind, n in conn.execute(
        select(worker_leases.c.namespace, state, func.count())
        .group_by(worker_leases.c.namespace, state)
        .order_by(worker_leases.c.namespace)
    ):
        counts[str(kind)] += int(n)
        namespaces.setdefault(str(namespace), {"live": 0, "expired": 0, "free": 0})[str(kind)] = int(n)
    rows = conn.execute(
        select(
            worker_leases.c.namespace,
            worker_leases.c.worker_id,
            worker_leases.c.owner,
            worker_leases.c.lease_expires_ms,
            state.label("state"),
            now,
        )
        .where(worker_leases.c.owner.is_not(None))
        .order_by(worker_leases.c.namespace, worker_leases.c.worker_id)
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
    now = db_now_ms()
    pending = outbox.c.published_ms.is_(None)
    dead = and_(pending, outbox.c.dead_ms.is_not(None))
    alive = and_(pending, outbox.c.dead_ms.is_(None))
    row = conn.execute(
        select(
            func.count().label("total"),
            _sum(pending).label("unpublished"),
            _sum(and_(alive, outbox.c.claimed_until_ms > now)).label("leased"),
            _sum(and_(alive, outbox.c.attempts > 1)).label("retried"),
            _sum(and_(alive, outbox.c.created_ms <= now - stale_ms)).label("stale"),
            _sum(dead).label("dead"),
            func.min(case((pending, outbox.c.created_ms), else_=None)).label("oldest"),
            now.label("now"),
        ).select_from(outbox)
    ).one()
    topics = {
        str(topic): int(n)
        for topic, n in conn.execute(
            select(outbox.c.topic, func.count())
            .where(pending)
            .group_by(outbox.c.topic)
            .order_by(outbox.c.topic)
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
            select(
                outbox.c.id,
                outbox.c.topic,
                outbox.c.key,
                outbox.c.refusals,
                outbox.c.dead_ms,
                outbox.c.last_error,
                now.label("sg_now"),
            )
            .where(dead)
            .order_by(outbox.c.id)
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
    cluster node, 3 nodes, causal: wsrep_sync_wait raised to 7)"`` where advisory_lock is refused,
    conflicts surface at COMMIT and stateguard's connections wait for the cluster's earlier
    writes before they write::

        with engine.connect() as conn:
            describe_server(conn)   # 'sqlite'
    """
    name = backend(conn.dialect).name
    if not is_galera(conn):
        return name
    row = conn.exec_driver_sql("SHOW GLOBAL STATUS LIKE 'wsrep_cluster_size'").first()
    size = f", {row[1]} nodes" if row is not None else ""
    return f"{name} (Galera cluster node{size}, causal: wsrep_sync_wait raised to {CAUSAL_BITS})"


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
    readers: list[tuple[str, str, Callable[[], dict[str, Any]]]] = []
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
            f"{plural(keys['past_lease'], 'idempotency key')} in progress past {their} lease{released}"
        )
    if report.outbox is not None and report.outbox["stale"]:
        report.stuck.append(
            f"{plural(report.outbox['stale'], 'outbox event')} unpublished for "
            f"{stale_ms / 1000:g} s or longer"
        )
    if report.outbox is not None and report.outbox["dead"]:
        report.stuck.append(
            f"{plural(report.outbox['dead'], 'outbox event')} dead (refused by the sink max_attempts "
            f"times; requeue with `stateguard outbox requeue` or stateguard.requeue_dead())"
        )
    return report
