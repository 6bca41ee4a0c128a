"""``stateguard inspect``: rows per state, stuck work in stateguard's tables, one row's history and one
ref's ledger, on every backend, through ``main(argv)``."""

from __future__ import annotations

import io
import json
import random
import re
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from sqlalchemy import Engine, insert
from sqlalchemy.orm import Session

from stateguard import _kernel, create_tables, decrement, drop_tables, release
from stateguard._kernel import db_now_ms
from stateguard.tables import idempotency_keys, metadata, outbox, tokens, worker_leases
from stateguard.tooling.graph import GRAPHVIZ_HINT, graphviz_available
from stateguard.tooling.inspection import ScanProgress
from tests.conftest import Backend
from tests.tooling._helpers import Terminal, run, write_module

MODELS = """
from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from stateguard import StateMachine


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "{table}_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="pending")

    flow = StateMachine(
        "status",
        states=["pending", "paid", "shipped", "cancelled"],
        transitions=[
            ["pay", "pending", "paid"],
            ["ship", "paid", "shipped"],
            ["cancel", ["pending", "paid"], "cancelled"],
        ],
        history=True,
    )


class Ticket(Base):
    # No history and no CHECK constraint: a state nobody declared can be stored.
    __tablename__ = "{table}_tickets"
    id: Mapped[str] = mapped_column(String(20), primary_key=True)
    phase: Mapped[str] = mapped_column(String(20), default="open")

    life = StateMachine(
        "phase", states=["open", "closed"], transitions=[["close", "open", "closed"]], check_constraint=False
    )


class Stock(Base):
    __tablename__ = "{table}_stock"
    id: Mapped[str] = mapped_column(String(20), primary_key=True)
    amount: Mapped[int]
"""

#: The keys of ``--json`` at the top level, and of each machine.
TOP_KEYS = {
    "ok",
    "stuck",
    "database",
    "server",
    "db_now_ms",
    "tables",
    "machines",
    "idempotency",
    "tokens",
    "worker_leases",
    "outbox",
    "row",
    "ledger",
}
MACHINE_KEYS = {
    "model",
    "machine",
    "table",
    "column",
    "table_missing",
    "total",
    "states",
    "undeclared",
    "null",
}


@pytest.fixture
def app(
    engine: Engine, backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, ModuleType, Backend]:
    """A model module (Order with history, Ticket, Stock) whose tables exist, and stateguard's tables."""
    name = write_module(tmp_path, monkeypatch, MODELS.format(table=f"i{uuid.uuid4().hex[:6]}"))
    module = __import__(name)
    backend.create(module.Base.metadata)
    return name, module, backend


def inspect_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any], str]:
    code, out, err = run(["inspect", *argv, "--json"], capsys)
    assert out, err
    return code, json.loads(out), err


def _orders(module: ModuleType, engine: Engine, seed: int) -> Counter[str]:
    """Random orders moved through the real triggers; the count per state each ended in."""
    rng = random.Random(seed)
    Order = module.Order
    with Session(engine) as session, session.begin():
        session.add_all([Order(id=i) for i in range(1, 41)])
    ended: Counter[str] = Counter()
    with Session(engine) as session, session.begin():
        for i in range(1, 41):
            path = rng.choice([[], ["pay"], ["pay", "ship"], ["cancel"], ["pay", "cancel"]])
            for trigger in path:
                assert getattr(Order.flow, trigger)(session, i).applied
            ended[
                {(): "pending", ("pay",): "paid", ("pay", "ship"): "shipped"}.get(tuple(path), "cancelled")
            ] += 1
    return ended


def test_counts_per_state_match_the_rows(
    app: tuple[str, ModuleType, Backend], capsys: pytest.CaptureFixture[str]
) -> None:
    """Each machine's counts are the rows in each state (0 for none), undeclared values apart."""
    name, module, backend = app
    ended = _orders(module, backend.engine, seed=7)
    with Session(backend.engine) as session, session.begin():
        session.add_all([module.Ticket(id=f"t{i}") for i in range(3)])
        session.add(module.Ticket(id="odd", phase="lost"))
    with Session(backend.engine) as session, session.begin():
        assert module.Ticket.life.close(session, "t0").applied
    code, report, err = inspect_json(capsys, "--db", backend.url, "--models", f"{name}:Base")
    assert (code, err) == (0, "")
    assert set(report) == TOP_KEYS and all(set(m) == MACHINE_KEYS for m in report["machines"])
    assert isinstance(report["db_now_ms"], int) and abs(report["db_now_ms"] / 1000 - time.time()) < 600
    assert report["row"] is None and report["ledger"] is None and report["stuck"] == []
    by_model = {m["model"]: m for m in report["machines"]}
    assert set(by_model) == {"Order", "Ticket"}
    order = by_model["Order"]
    assert order["states"] == {s: ended.get(s, 0) for s in ("pending", "paid", "shipped", "cancelled")}
    assert order["total"] == 40 and order["undeclared"] == {} and not order["table_missing"]
    ticket = by_model["Ticket"]
    assert ticket["states"] == {"open": 2, "closed": 1}
    assert ticket["undeclared"] == {"lost": 1} and ticket["total"] == 4
    code, out, err = run(["inspect", "--db", backend.url, "--models", f"{name}:Order"], capsys)
    assert (code, err) == (0, "")
    assert f"Order.flow ({module.Order.__tablename__}.status): 40 rows" in out
    assert f"  {'paid':<9} {ended['paid']:>10}\n" in out  # names padded to the longest, 'cancelled'
    assert "Ticket" not in out and out.rstrip().endswith("nothing stuck")


def test_counts_drawn_on_the_graph(
    app: tuple[str, ModuleType, Backend], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--format mermaid/dot puts each state's count on the graph; svg/png go to files in --output."""
    name, module, backend = app
    ended = _orders(module, backend.engine, seed=3)
    code, out, _ = run(
        ["inspect", "--db", backend.url, "--models", f"{name}:Order", "--format", "mermaid"], capsys
    )
    assert code == 0
    for state in ("pending", "paid", "shipped", "cancelled"):
        n = ended.get(state, 0)
        assert f'state "{state} ({n} row{"" if n == 1 else "s"})" as {state}' in out
    folder = tmp_path / "drawn"
    code, out, _ = run(
        ["inspect", "--db", backend.url, "--models", name, "--format", "dot", "-o", str(folder)], capsys
    )
    assert code == 0
    dot = (folder / "Order.flow.dot").read_text()
    assert f'"paid" [label="paid ({ended["paid"]} row' in dot
    assert (folder / "Ticket.life.dot").exists() and f"drawn to {folder / 'Order.flow.dot'}" in out
    code, out, err = run(["inspect", "--db", backend.url, "--models", name, "--format", "svg"], capsys)
    assert code == 2
    if graphviz_available():
        assert "name a folder with --output DIR" in err
        code, _, err = run(
            ["inspect", "--db", backend.url, "--models", name, "--format", "svg", "-o", str(folder)], capsys
        )
        assert code == 0, err
        assert f">paid ({ended['paid']} row" in (folder / "Order.flow.svg").read_text()
    else:
        assert err == f"stateguard inspect: {GRAPHVIZ_HINT}\n"


# -- stuck work --------------------------------------------------------------

HOUR = 3_600_000


def _key(conn: Any, key: str, status: str, lease_ms: int | None, expires_ms: int) -> None:
    """An idempotency record as idempotency.py writes it; times relative to the database's clock."""
    now = db_now_ms()
    conn.execute(
        insert(idempotency_keys).values(
            scope="pay",
            idem_key=key,
            status=status,
            owner=uuid.uuid4().hex,
            attempt=1,
            locked_until_ms=None if lease_ms is None else (0 if lease_ms == 0 else now + lease_ms),
            expires_ms=now + expires_ms,
            created_ms=now - 60_000,
            updated_ms=now - 30_000,
        )
    )


def _stuck_and_not(engine: Engine) -> None:
    """One of each: stuck keys and events, and their healthy neighbours."""
    now = db_now_ms()
    with engine.begin() as conn:
        _key(conn, "live", "in_progress", 60_000, HOUR)  # being worked on
        _key(conn, "lapsed", "in_progress", -5_000, HOUR)  # its worker died 5 s ago: stuck
        _key(conn, "released", "in_progress", 0, HOUR)  # released, no retry came: stuck
        _key(conn, "done", "completed", None, HOUR)
        _key(conn, "gave-up", "failed", None, HOUR)
        _key(conn, "old", "in_progress", -5_000, -1_000)  # expired: reclaimed as new, only purge-worthy
        _key(conn, "old-done", "completed", None, -1_000)
        for i, (expires, consumed) in enumerate(
            [(HOUR, False), (HOUR, True), (-2_000, False), (-9_000, True)]
        ):
            conn.execute(
                insert(tokens).values(
                    token_hash=f"{i:064x}",
                    scope="login",
                    expires_ms=now + expires,
                    consumed_ms=now - 1 if consumed else None,
                    created_ms=now - 10_000,
                )
            )
        for worker, owner, lease in [(1, "a", 30_000), (2, "b", -30_000), (3, None, 0)]:
            conn.execute(
                insert(worker_leases).values(
                    namespace="ids", worker_id=worker, owner=owner, lease_expires_ms=now + lease, last_ms=now
                )
            )
        for topic, age, published, claimed in [
            ("order.paid", 1_000, False, None),  # fresh
            ("order.paid", 20 * 60_000, False, None),  # 20 min unpublished: stuck
            ("order.shipped", 2_000, False, 20_000),  # a relay holds it
            ("order.paid", 60 * 60_000, True, None),  # published long ago
        ]:
            conn.execute(
                insert(outbox).values(
                    topic=topic,
                    key="k",
                    payload="{}",
                    created_ms=now - age,
                    claimed_until_ms=None if claimed is None else now + claimed,
                    claimed_by=None if claimed is None else "relay-1",
                    published_ms=now - 1 if published else None,
                    attempts=2 if claimed else 1,
                )
            )


def _check_verdict(code: int, report: dict[str, Any]) -> None:
    assert code == 1 and report["ok"] is False
    keys = report["idempotency"]
    assert {k: keys[k] for k in ("total", "in_progress", "live", "past_lease", "released")} == {
        "total": 7,
        "in_progress": 3,
        "live": 1,
        "past_lease": 2,
        "released": 1,
    }
    assert (keys["completed"], keys["failed"], keys["expired"]) == (1, 1, 2)
    stuck = {s["key"]: s for s in keys["stuck"]}
    assert set(stuck) == {"lapsed", "released"}
    assert stuck["released"]["released"] and stuck["released"]["lease_ended_ms_ago"] is None
    assert 4_000 <= stuck["lapsed"]["lease_ended_ms_ago"] < 60_000
    assert report["tokens"] == {
        "total": 4,
        "live": 1,
        "consumed": 1,
        "expired": 2,
        "oldest_expired_ms_ago": report["tokens"]["oldest_expired_ms_ago"],
    }
    assert 8_000 <= report["tokens"]["oldest_expired_ms_ago"] < 60_000
    leases = report["worker_leases"]
    assert (leases["live"], leases["expired"], leases["free"]) == (1, 1, 1)
    assert {(lease["worker_id"], lease["state"]) for lease in leases["leases"]} == {
        (1, "live"),
        (2, "expired"),
    }
    box = report["outbox"]
    assert (box["unpublished"], box["published"], box["leased"], box["retried"], box["stale"]) == (
        3,
        1,
        1,
        1,
        1,
    )
    assert box["unpublished_by_topic"] == {"order.paid": 2, "order.shipped": 1}
    assert 20 * 60_000 <= box["oldest_unpublished_ms_ago"] < 25 * 60_000
    assert report["stuck"] == [
        "2 idempotency keys in progress past their lease (1 released, no retry yet)",
        "1 outbox event unpublished for 300 s or longer",
    ]


def test_stuck_work_found_and_healthy_work_not(
    engine: Engine, backend: Backend, capsys: pytest.CaptureFixture[str]
) -> None:
    """Keys past their lease and an old unpublished event are stuck (exit 1); live, done, expired ones not."""
    _stuck_and_not(engine)
    code, report, _ = inspect_json(capsys, "--db", backend.url)
    _check_verdict(code, report)
    code, out, _ = run(["inspect", "--db", backend.url], capsys)
    assert code == 1
    assert "  stuck pay / lapsed: attempt 1, lease ended " in out
    assert "  stuck pay / released: attempt 1, released, waiting for a retry" in out
    assert "pay / live" not in out and "pay / old" not in out
    assert "worker-id leases: 1 live, 1 expired, 1 free" in out
    assert out.rstrip().endswith(
        "stuck: 2 idempotency keys in progress past their lease (1 released, no retry yet); "
        "1 outbox event unpublished for 300 s or longer"
    )
    code, report, _ = inspect_json(capsys, "--db", backend.url, "--stale", "3600")
    assert code == 1 and report["outbox"]["stale"] == 0 and len(report["stuck"]) == 1
    with engine.begin() as conn:
        conn.execute(idempotency_keys.delete().where(idempotency_keys.c.idem_key.in_(["lapsed", "released"])))
    code, report, _ = inspect_json(capsys, "--db", backend.url, "--stale", "3600")
    assert (code, report["ok"], report["stuck"]) == (0, True, [])


@pytest.mark.clock
@pytest.mark.parametrize("skew_hours", [3, -3])
def test_application_clock_skew_changes_no_verdict(
    skew_hours: int,
    engine: Engine,
    backend: Backend,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the application's clock hours ahead or behind, leases and ages are judged as before."""
    _stuck_and_not(engine)
    real_time, real_now_ms = time.time, _kernel.now_ms
    offset = skew_hours * 3600
    monkeypatch.setattr(time, "time", lambda: real_time() + offset)
    monkeypatch.setattr(_kernel, "now_ms", lambda: real_now_ms() + offset * 1000)
    assert abs(time.time() - real_time() - offset) < 1
    code, report, _ = inspect_json(capsys, "--db", backend.url)
    _check_verdict(code, report)


def test_tables_missing_are_reported_not_an_error(
    backend: Backend, capsys: pytest.CaptureFixture[str]
) -> None:
    """A database without stateguard's tables: exit 0, each missing table named, its section null."""
    drop_tables(backend.engine)
    code, report, err = inspect_json(capsys, "--db", backend.url)
    assert (code, err) == (0, "")
    assert report["tables"] == {"present": [], "missing": sorted(t.name for t in metadata.sorted_tables)}
    assert report["idempotency"] is report["tokens"] is report["worker_leases"] is report["outbox"] is None
    with backend.engine.begin() as conn:
        idempotency_keys.create(conn)
    try:
        code, out, _ = run(["inspect", "--db", backend.url, "--ref", "r-1"], capsys)
        assert code == 0
        assert "stateguard tables missing (their sections are skipped): " in out
        assert "stateguard_outbox" in out and "idempotency keys: 0: " in out
        assert "stateguard_counter_ledger is missing" in out
    finally:
        with backend.engine.begin() as conn:
            idempotency_keys.drop(conn)


# -- one row, one ref ----------------------------------------------------------


def test_row_history(app: tuple[str, ModuleType, Backend], capsys: pytest.CaptureFixture[str]) -> None:
    """``--row Order:7`` shows the row's state and its logged transitions, oldest first, even once deleted."""
    name, module, backend = app
    Order = module.Order
    with Session(backend.engine) as session, session.begin():
        session.add_all([Order(id=7), Order(id=8)])
    with Session(backend.engine) as session, session.begin():
        assert Order.flow.pay(session, 7, request_id="req-1", metadata={"by": "alice"}).applied
    with Session(backend.engine) as session, session.begin():
        assert Order.flow.ship(session, 7).applied
        assert Order.flow.cancel(session, 8).applied
    code, report, _ = inspect_json(
        capsys, "--db", backend.url, "--models", f"{name}:Base", "--row", "Order:7"
    )
    assert code == 0
    row = report["row"]
    assert (row["model"], row["key"], row["found"]) == ("Order", [7], True)
    (flow,) = row["machines"]
    assert (flow["machine"], flow["state"], flow["history_kept"]) == ("flow", "shipped", True)
    assert [(h["trigger"], h["source"], h["dest"], h["request_id"]) for h in flow["history"]] == [
        ("pay", "pending", "paid", "req-1"),
        ("ship", "paid", "shipped", None),
    ]
    assert flow["history"][0]["metadata"] == {"by": "alice"}
    code, out, _ = run(["inspect", "--db", backend.url, "--models", name, "--row", "Order:7"], capsys)
    assert code == 0
    assert f"\nOrder 7 ({Order.__tablename__})\n  flow: shipped\n" in out
    assert "  pay: pending -> paid request_id=req-1" in out and ' {"by": "alice"}' in out
    assert out.index("pay: pending -> paid") < out.index("ship: paid -> shipped")
    with Session(backend.engine) as session, session.begin():
        session.delete(session.get(Order, 7))
    code, report, _ = inspect_json(capsys, "--db", backend.url, "--models", name, "--row", "Order:7")
    assert report["row"]["found"] is False and len(report["row"]["machines"][0]["history"]) == 2
    code, out, _ = run(["inspect", "--db", backend.url, "--models", name, "--row", "Ticket:none"], capsys)
    assert (
        code == 0
        and "\nTicket none " in out
        and "no history kept (declare the machine with history=True)" in out
    )


def test_ref_ledger(app: tuple[str, ModuleType, Backend], capsys: pytest.CaptureFixture[str]) -> None:
    """``--ref order-42`` lists that ref's ledger entries (and their release), and no other ref's."""
    _, module, backend = app
    Stock = module.Stock
    with Session(backend.engine) as session, session.begin():
        session.add_all([Stock(id="a", amount=9), Stock(id="b", amount=9)])
    with Session(backend.engine) as session, session.begin():
        assert decrement(session, Stock.amount, "a", by=2, ref="order-42").applied
        assert decrement(session, Stock.amount, "b", by=1, ref="order-42").applied
        assert decrement(session, Stock.amount, "a", by=5, ref="order-43").applied
    with Session(backend.engine) as session, session.begin():
        release(session, Stock.amount, "order-42")
    code, report, _ = inspect_json(capsys, "--db", backend.url, "--ref", "order-42")
    assert code == 0
    ledger = report["ledger"]
    assert ledger["ref"] == "order-42" and ledger["table_missing"] is False
    assert [(e["table"], e["row_key"], e["column"], e["delta"]) for e in ledger["entries"]] == [
        (Stock.__tablename__, '"a"', "amount", "-2"),
        (Stock.__tablename__, '"b"', "amount", "-1"),
    ]
    assert all(e["released_at"] is not None for e in ledger["entries"])
    code, out, _ = run(["inspect", "--db", backend.url, "--ref", "order-43"], capsys)
    assert f"counter ledger of ref 'order-43': 1 entry\n  {Stock.__tablename__} \"a\" amount -5 at " in out
    code, out, _ = run(["inspect", "--db", backend.url, "--ref", "order-44"], capsys)
    assert "counter ledger of ref 'order-44': 0 entries" in out


# -- usage errors ------------------------------------------------------------


def test_usage_errors_exit_2(
    app: tuple[str, ModuleType, Backend], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bad --models, --row and databases are exit 2 with one line saying what was wrong."""
    name, _, backend = app
    db = backend.url
    cases = [
        (
            ["--db", db, "--models", "no_such_module_xyz"],
            "cannot import no_such_module_xyz: ModuleNotFoundError",
        ),
        (
            ["--db", db, "--models", f"{name}:Nope"],
            f"{name}.Nope is not a declarative Base or a mapped model",
        ),
        (["--db", db, "--models", "json"], "no StateMachine found in json"),
        (["--db", db, "--row", "Order:1"], "--row needs --models"),
        (["--db", db, "--models", name, "--row", "Order"], "expected --row Model:KEY, got 'Order'"),
        (["--db", db, "--models", name, "--row", "Nope:1"], "no model 'Nope' with a StateMachine"),
        (["--db", db, "--models", name, "--row", "Order:abc"], "Order.id is int: 'abc' is not one"),
        (
            ["--db", "postgresql+psycopg://nobody@127.0.0.1:1/none"],
            "cannot connect to postgresql+psycopg://nobody@127.0.0.1:1/none",
        ),
        (["--db", f"sqlite:///{tmp_path}/absent.db"], "does not create one"),
        (["--db", "not a url"], "not a database URL"),
    ]
    for argv, message in cases:
        code, out, err = run(["inspect", *argv], capsys)
        assert (code, out) == (2, ""), (argv, err)
        assert err.startswith("stateguard inspect: ") and message in err, (argv, err)
        assert err.count("\n") == 1, err
    assert not (tmp_path / "absent.db").exists()


# -- progress ----------------------------------------------------------------


def test_progress_drawn_on_a_terminal_while_a_scan_runs_and_cleared() -> None:
    """On a terminal a slow step is drawn while it runs and cleared when it ends, even when it fails."""
    stream = Terminal()
    progress = ScanProgress(stream, delay=0.05, interval=0.02)
    progress.count = 2
    with progress.step("counting orders.status"):
        time.sleep(0.3)
    drawn = stream.getvalue()
    assert "\r\x1b[Kstateguard inspect: [1/2] counting orders.status " in drawn
    assert drawn.endswith("\r\x1b[K")
    with pytest.raises(RuntimeError), progress.step("reading stateguard_outbox"):
        time.sleep(0.3)
        raise RuntimeError("database gone")
    assert "[2/2] reading stateguard_outbox" in stream.getvalue() and stream.getvalue().endswith("\r\x1b[K")
    quick = Terminal()
    with ScanProgress(quick, delay=5).step("fast"):
        pass
    assert quick.getvalue() == ""


def test_progress_is_quiet_off_a_terminal_and_with_json() -> None:
    """Not a terminal, or disabled (--json): nothing on the stream, however long the step."""
    for stream, enabled in [(io.StringIO(), True), (Terminal(), False)]:
        progress = ScanProgress(stream, enabled=enabled, delay=0.0, interval=0.01)
        with progress.step("counting"):
            time.sleep(0.1)
        assert stream.getvalue() == ""


def test_inspect_help_lists_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    """``stateguard inspect --help`` documents its exit codes."""
    code, out, _ = run(["inspect", "--help"], capsys)
    assert code == 0
    assert "  1  stuck work was found" in out and "  2  usage error" in out


def _keys(value: Any, found: set[str]) -> set[str]:
    """Every dict key anywhere in ``value``, apart from those of the free-form maps."""
    if isinstance(value, dict):
        for key, item in value.items():
            found.add(key)
            if key in ("states", "undeclared", "namespaces", "unpublished_by_topic", "metadata"):
                if key == "namespaces":
                    for counts in item.values():
                        _keys(counts, found)
                continue
            _keys(item, found)
    elif isinstance(value, list):
        for item in value:
            _keys(item, found)
    return found


def test_readme_documents_the_json_shape(
    app: tuple[str, ModuleType, Backend], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every key ``--json`` prints (each section filled) is in the CLI page's shape, and nothing else is."""
    from tests.tooling._helpers import ROOT

    name, module, backend = app
    _stuck_and_not(backend.engine)
    with backend.engine.begin() as conn:  # a dead event, so that its listing's keys show
        now = db_now_ms()
        conn.execute(
            insert(outbox).values(
                topic="order.paid",
                key="d",
                payload="{}",
                created_ms=now,
                attempts=3,
                refusals=3,
                dead_ms=now,
                last_error="RuntimeError: refused",
            )
        )
    with Session(backend.engine) as session, session.begin():
        session.add(module.Order(id=1))
        session.add(module.Stock(id="a", amount=3))
    with Session(backend.engine) as session, session.begin():
        assert module.Order.flow.pay(session, 1).applied
        assert decrement(session, module.Stock.amount, "a", by=1, ref="r").applied
    seen: set[str] = set()
    for extra in (["--format", "mermaid"], ["--format", "dot", "-o", str(tmp_path / "d")]):
        code, report, _ = inspect_json(
            capsys, "--db", backend.url, "--models", name, "--row", "Order:1", "--ref", "r", *extra
        )
        assert code == 1
        _keys(report, seen)
    readme = (ROOT / "docs" / "reference" / "cli.md").read_text()
    block = readme.split("<!-- stateguard inspect --json shape -->\n```text\n", 1)[1].split("```", 1)[0]
    documented = set(re.findall(r'"(\w+)"', block))
    assert seen == documented


@pytest.fixture
def sqlite_app(
    sqlite: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, ModuleType, Backend]]:
    """The ``app`` fixture on SQLite only, for what does not depend on the backend."""
    drop_tables(sqlite.engine)
    create_tables(sqlite.engine)
    name = write_module(tmp_path, monkeypatch, MODELS.format(table=f"s{uuid.uuid4().hex[:6]}"))
    module = __import__(name)
    sqlite.create(module.Base.metadata)
    yield name, module, sqlite
    drop_tables(sqlite.engine)


def test_inspect_as_a_real_subprocess(sqlite_app: tuple[str, ModuleType, Backend]) -> None:
    """``python -m stateguard inspect --json`` exits 1 on stuck work, prints the report, nothing on stderr."""
    import subprocess
    import sys

    from tests.tooling._helpers import ROOT

    _, _, backend = sqlite_app
    _stuck_and_not(backend.engine)
    done = subprocess.run(
        [sys.executable, "-m", "stateguard", "inspect", "--db", backend.url, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert (done.returncode, done.stderr) == (1, "")
    _check_verdict(done.returncode, json.loads(done.stdout))


def test_progress_through_the_command_on_a_terminal(
    sqlite_app: tuple[str, ModuleType, Backend],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A slow count draws its step on a terminal's stderr and clears it; with --json stderr stays empty."""
    from stateguard.tooling import cli, inspection

    name, module, backend = sqlite_app
    real = inspection.count_states

    def slow(conn: Any, machine: Any) -> Any:
        time.sleep(0.8)  # longer than the progress line's delay (0.5 s)
        return real(conn, machine)

    monkeypatch.setattr(inspection, "count_states", slow)
    for argv, drawn in ([[], True], [["--json"], False]):
        terminal = Terminal()
        monkeypatch.setattr("sys.stderr", terminal)
        assert cli.main(["inspect", "--db", backend.url, "--models", f"{name}:Order", *argv]) == 0
        err = terminal.getvalue()
        if drawn:
            table = module.Order.__tablename__
            assert f"\r\x1b[Kstateguard inspect: [1/5] counting {table}.status " in err
            assert err.endswith("\r\x1b[K") and "\n" not in err
        else:
            assert err == ""
    assert capsys.readouterr().err == ""


def test_machine_table_missing(
    engine: Engine,
    backend: Backend,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A model whose table does not exist is reported as missing, not an error."""
    name = write_module(tmp_path, monkeypatch, MODELS.format(table=f"m{uuid.uuid4().hex[:6]}"))
    code, report, err = inspect_json(capsys, "--db", backend.url, "--models", f"{name}:Order")
    assert (code, err) == (0, "")
    (order,) = report["machines"]
    assert order["table_missing"] is True and order["total"] == 0
    code, out, _ = run(
        ["inspect", "--db", backend.url, "--models", f"{name}:Order", "--format", "mermaid"], capsys
    )
    assert code == 0
    assert (
        f"({order['table']}.status): table {order['table']} is missing" in out and "stateDiagram" not in out
    )
