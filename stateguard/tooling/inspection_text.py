"""``stateguard inspect`` as text: what :func:`~.inspection.inspect_database` found, as lines.

:func:`render_text` is the human report (the ``--json`` shape is
:meth:`~stateguard.tooling.inspection.Inspection.as_dict`): rows per state of
each machine, stateguard's tables and what is stuck in them, ``--row``'s
history and ``--ref``'s ledger, then the verdict.  Times are shown as ages
on the database's clock, which the report was read on.
"""

from __future__ import annotations

import datetime
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .inspection import Inspection

__all__ = ["plural", "render_text"]


def plural(n: int, word: str) -> str:
    """``"1 row"``, ``"3 rows"``."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def _iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).isoformat(timespec="milliseconds")


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
        lines.append(f"\n{where}: {plural(m.total, 'row')}")
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
