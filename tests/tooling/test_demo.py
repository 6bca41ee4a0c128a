"""``stateguard demo`` on every backend: the storm machinery, the scenarios' invariant checks,
the result table, and ``python -m stateguard demo`` as a real process."""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, func, insert, select, text, update
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

import stateguard.asgi
from stateguard import Outcome, Result
from stateguard.tables import idempotency_keys, outbox
from stateguard.tooling import cli, demo
from stateguard.tooling.demo import (
    DemoBase,
    DemoOrder,
    DemoRun,
    DemoSideEffect,
    DemoStock,
    Request,
    SchemeRow,
)
from tests.conftest import IN_CI, REDIS_URL, Backend, capable

SCHEMES = (
    "state machine",
    "optimistic version",
    "insert-once",
    "flash sale",
    "http retry storm",
    "outbox pipeline",
)
ROW = re.compile(
    r"^(?P<scheme>[a-z][a-z -]*?)\s{2,}(?P<code>hand-written|stateguard)\s+(?P<attempts>\d+)\s+"
    r"(?P<applied>\d+)\s+(?P<repeated>\d+)\s+(?P<rejected>\d+)\s+(?P<retried>\d+)\s+(?P<effects>\d+)\s+"
    r"(?P<invariant>ok|VIOLATED)\s+(?P<damage>.*)$"
)
DAMAGE = re.compile(r"(\d+) ([a-z ]+?)(?:,|\)|$)")


def table(out: str, code: str = "stateguard") -> dict[str, dict[str, str]]:
    """The demo's result rows of one variant (``stateguard`` or ``hand-written``) by scheme."""
    rows = {}
    for line in out.splitlines():
        m = ROW.match(line)
        if m and m["code"] == code:
            rows[m["scheme"]] = m.groupdict()
    return rows


def damage(row: dict[str, str]) -> dict[str, int]:
    """``{"double charges": 12, ...}`` from a row's damage cell (``none (0 ..., 0 ...)`` gives zeros)."""
    return {kind: int(n) for n, kind in DAMAGE.findall(row["damage"])}


def schema_name() -> str:
    return f"sgd_{uuid.uuid4().hex[:10]}"


def namespace_engine(backend: Backend, schema: str) -> Engine:
    """An engine on the demo's namespace ``schema`` (kept by ``--keep``) on ``backend``'s server."""
    url = demo.namespace_url(make_url(backend.url), schema)
    if backend.name == "postgresql":
        url = url.update_query_dict({"options": f"-csearch_path={schema}"})
    return create_engine(url)


def namespace_exists(backend: Backend, schema: str) -> bool:
    """Whether the demo's namespace ``schema`` (or any file of it) is still there."""
    if backend.name == "sqlite":
        path = Path(demo.namespace_url(make_url(backend.url), schema).database or "")
        return any(Path(f"{path}{suffix}").exists() for suffix in ("", "-wal", "-shm", "-journal"))
    query = {
        "postgresql": "SELECT count(*) FROM pg_namespace WHERE nspname = :n",
        "mariadb": "SELECT count(*) FROM information_schema.schemata WHERE schema_name = :n",
    }[backend.name]
    with backend.engine.connect() as conn:
        return bool(conn.scalar(text(query), {"n": schema}))


def drop_namespace(backend: Backend, schema: str) -> None:
    """Remove a namespace a test kept with ``--keep``."""
    if backend.name == "sqlite":
        path = Path(demo.namespace_url(make_url(backend.url), schema).database or "")
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        return
    statement = (
        f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'
        if backend.name == "postgresql"
        else (f"DROP DATABASE IF EXISTS `{schema}`")
    )
    with backend.engine.begin() as conn:
        conn.execute(text(statement))


# --------------------------------------------------------------------------
# The demo on every backend
# --------------------------------------------------------------------------


def test_demo_on_backend(backend: Backend, capsys: pytest.CaptureFixture[str]) -> None:
    """Each scheme runs hand-written and through stateguard on the same storm; the database agrees.

    stateguard's rows hold the invariant with zero damage; the hand-written rows' damage is what
    the tables say, recounted here with SQL in the kept namespace.
    """
    schema = schema_name()
    argv = ["demo", "--db", backend.url, "--orders", "30", "--workers", "8", "--seed", "11"]
    try:
        code = cli.main([*argv, "--schema", schema, "--keep"])
        captured = capsys.readouterr()
        assert code == 0, captured.out + captured.err
        assert "Traceback" not in captured.err
        assert "\x1b[" not in captured.out  # not a terminal: no colour
        rows, naive = table(captured.out), table(captured.out, "hand-written")
        assert sorted(rows) == sorted(naive) == sorted(SCHEMES), captured.out
        engine = namespace_engine(backend, schema)
        try:
            _check_rows(engine, rows, naive)
            _check_http_storm(engine, rows["http retry storm"], captured.out, orders=30)
            _check_pipeline(engine, rows["outbox pipeline"], captured.out)
        finally:
            engine.dispose()
    finally:
        drop_namespace(backend, schema)
    # 30 orders, a pay and a follow-up each, every request delivered at least twice.
    assert int(rows["state machine"]["attempts"]) >= 2 * 2 * 30
    assert "stateguard: invariant held in every scheme" in captured.out
    _check_explanations(backend, captured.out, rows)
    if capable(backend, "concurrent_writers"):
        # Real races, nothing slowed down: read-check-write code loses to its own twins.
        raced = ("state machine", "optimistic version", "insert-once", "flash sale")
        assert sum(sum(damage(naive[s]).values()) for s in raced) > 0, captured.out


def _check_explanations(backend: Backend, out: str, rows: dict[str, dict[str, str]]) -> None:
    """Every column is explained under the table, with this backend's meaning of "retried"."""
    text_ = " ".join(line.strip() for line in out.splitlines())  # the explanations are wrapped
    here = {"sqlite": "here (SQLite): SQLITE_BUSY", "postgresql": "here (PostgreSQL): serialization failures",
            "mariadb": "here (MariaDB/MySQL): deadlocks"}[backend.name]  # fmt: skip
    assert (
        f"retried = deliveries re-run whole by retry_on_conflict because the database refused them; {here}"
        in text_
    )
    assert "the optimistic row adds its STALE re-runs" in text_ and "the HTTP row counts 409" in text_
    assert "optimistic version: REJECTED = pay and cancel exclude each other" in out
    applied = rows["insert-once"]["applied"]
    assert (
        f"insert-once: APPLIED = messages processed the first time: {applied} messages for 30 orders" in out
    )
    assert "damage = counted with SQL in the tables afterwards" in text_
    assert "nothing widens the race windows: no sleeps in the hand-written code" in text_
    assert ("on SQLite the hand-written code runs on a plain create_engine()" in text_) == (
        backend.name == "sqlite"
    )


def _check_rows(engine: Engine, rows: dict[str, dict[str, str]], naive: dict[str, dict[str, str]]) -> None:
    with Session(engine) as s:
        for scheme in SCHEMES:
            for code, row in (("stateguard", rows[scheme]), ("hand-written", naive[scheme])):
                key = DemoRun.key(scheme, code)
                total = int(row["applied"]) + int(row["repeated"]) + int(row["rejected"])
                if scheme == "flash sale":  # sold-out purchases are INSUFFICIENT (not a column)
                    assert int(row["attempts"]) >= total, row
                else:
                    assert int(row["attempts"]) == total, row
                effects = s.scalar(
                    select(func.count()).select_from(DemoSideEffect).where(DemoSideEffect.scheme == key)
                )
                doubles = s.execute(
                    select(DemoSideEffect.order_id, DemoSideEffect.action, func.count())
                    .where(DemoSideEffect.scheme == key)
                    .group_by(DemoSideEffect.order_id, DemoSideEffect.action)
                    .having(func.count() > 1)
                ).all()
                assert int(row["effects"]) == effects, row
                extra = sum(n - 1 for _, _, n in doubles)
                found = damage(row)
                twice = sum(n for kind, n in found.items() if "twice" in kind or "double" in kind)
                assert twice == extra, (row, doubles)
                if code == "stateguard":
                    assert row["invariant"] == "ok" and sum(found.values()) == 0, row
                    assert int(row["applied"]) > 0 and int(row["repeated"]) > 0, row
                    assert effects == int(row["applied"]) and doubles == []
                else:
                    assert row["invariant"] == ("VIOLATED" if doubles else "ok"), row
    # Deliveries that double-charge no matter the backend: the handler without the middleware,
    # the consumer without consume_once.
    assert damage(naive["http retry storm"])["double charges"] > 0
    assert sum(damage(naive["outbox pipeline"]).values()) > 0
    # The flash sale's hand-written damage, recounted from the stock row.
    with engine.connect() as conn:
        stock = {i: n for i, n in conn.execute(select(DemoStock.id, DemoStock.amount))}
        sold = int(
            conn.scalar(
                select(func.count())
                .select_from(DemoSideEffect)
                .where(DemoSideEffect.scheme == DemoRun.key("flash sale", "hand-written"))
            )
            or 0
        )
    initial = max(1, 30 // 4)
    found = damage(naive["flash sale"])
    assert found["oversold units"] == max(0, sold - initial)
    assert found["lost updates"] == max(0, sold - (initial - stock[2]))
    assert stock[1] == initial - int(rows["flash sale"]["applied"]) == 0


def _check_pipeline(engine: Engine, row: dict[str, str], out: str) -> None:
    """The pipeline's numbers agree: an event and an effect per APPLIED transition, duplicates dropped."""
    also = re.search(
        r"^outbox pipeline: also deduplicated (\d+), published (\d+), redelivered (\d+)$", out, re.M
    )
    assert also is not None, out
    deduplicated, published, redelivered = (int(n) for n in also.groups())
    assert published == int(row["applied"]) == int(row["effects"]), (row, also[0])
    assert redelivered > 0 and deduplicated >= redelivered, also[0]  # every 4th acknowledgement was lost
    with engine.connect() as conn:
        events = conn.execute(
            select(outbox.c.published_ms).where(outbox.c.topic.in_(demo.PIPELINE_TOPICS))
        ).all()
    # Both variants' events, every one published.
    naive = re.search(r"^outbox pipeline \[hand-written\]: also published (\d+), redelivered \d+$", out, re.M)
    assert naive is not None, out
    assert len(events) == published + int(naive[1]) and all(p is not None for (p,) in events)


def _check_http_storm(engine: Engine, row: dict[str, str], out: str, *, orders: int) -> None:
    """The HTTP scenario's row, notes and key records agree: one execution per key, 422s, 409s, 503s."""
    assert int(row["applied"]) == int(row["effects"]) == orders, row
    assert int(row["rejected"]) == max(1, orders // 10), row  # every reused key refused with 422
    assert f"executions per key: min 1, max 1 over {orders} keys" in out
    also = re.search(r"^http retry storm: also 409 in progress (\d+), 503 released (\d+)$", out, re.M)
    assert also is not None, out
    assert int(also[1]) > 0 and int(also[2]) == max(1, orders // 10)
    assert int(row["retried"]) == int(also[1]) + int(also[2])
    with engine.connect() as conn:
        keys = conn.execute(
            select(idempotency_keys.c.status, idempotency_keys.c.attempt).where(
                idempotency_keys.c.scope.startswith(demo.DEMO_KEY_SCOPE)
            )
        ).all()
    # The keys of the 503 answers were released and taken over once by a retry (attempt 2).
    assert Counter(keys) == {("completed", 1): orders - int(also[2]), ("completed", 2): int(also[2])}


def test_demo_leaves_tables_it_did_not_create_alone(
    backend: Backend, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same-named tables of the user's (the demo's and stateguard's) keep their rows.

    Nothing the demo made remains after the run (its namespace is gone)."""
    from stateguard import consume_once, create_tables, drop_tables, emit

    backend.create(DemoBase.metadata)
    create_tables(backend.engine)
    try:
        with backend.engine.begin() as conn:
            conn.execute(insert(DemoOrder), [{"id": 1, "status": "paid"}, {"id": 2, "status": "pending"}])
            conn.execute(insert(DemoStock), [{"id": 1, "amount": 5}])
        with Session(backend.engine) as s, s.begin():
            # The user's own stateguard rows: an outbox event and a consumed message.
            emit(s, "app.invoice", {"id": 1}, key="invoice-1")
            consume_once(s, "app-consumer", "message-1")
        before = _user_rows(backend.engine)
        schema = schema_name()
        code = cli.main(["demo", "--db", backend.url, "--orders", "8", "--seed", "3", "--schema", schema])
        out = capsys.readouterr().out
        assert code == 0, out
        assert _user_rows(backend.engine) == before
        assert not namespace_exists(backend, schema), schema
        assert "dropped the " in out and schema in out
    finally:
        drop_tables(backend.engine)


def _user_rows(engine: Engine) -> dict[str, list[tuple[Any, ...]]]:
    from stateguard.tables import consumed_messages

    with engine.connect() as conn:
        return {
            table.name: sorted(tuple(r) for r in conn.execute(select(table)))
            for table in (
                *DemoBase.metadata.sorted_tables,
                outbox,
                idempotency_keys,
                consumed_messages,
            )
        }


def test_demo_reruns_on_the_default_sqlite_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --db the demo works in stateguard-demo.sg_demo.db here; --keep keeps it, a rerun replaces it,
    and a run without --keep leaves the folder as it found it."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["demo", "--orders", "4", "--seed", "1", "--keep"]) == 0
    kept = tmp_path / "stateguard-demo.sg_demo.db"
    assert kept.exists()
    assert cli.main(["demo", "--orders", "6", "--seed", "2", "--keep"]) == 0
    out = capsys.readouterr().out
    assert f"kept the SQLite file {kept} for inspection (drop it: rm {kept})" in out
    engine = create_engine(f"sqlite:///{kept}")
    try:
        with engine.connect() as conn:
            # The kept namespace of the first run was dropped: only the second run's orders (two variants).
            assert conn.scalar(select(func.count()).select_from(DemoOrder)) == 2 * len(SCHEMES) * 6
    finally:
        engine.dispose()
    assert cli.main(["demo", "--orders", "3", "--seed", "3"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert f"dropped the SQLite file {kept}" in capsys.readouterr().out


def test_demo_refuses_a_namespace_it_did_not_make(
    backend: Backend, capsys: pytest.CaptureFixture[str]
) -> None:
    """--schema naming an existing schema/database/file without the demo's marker is exit 2.

    What was there stays as it was, and the demo's marker table was not added."""
    schema = schema_name()
    if backend.name == "sqlite":
        import sqlite3

        path = demo.namespace_url(make_url(backend.url), schema).database
        with contextlib.closing(sqlite3.connect(str(path))) as mine:
            mine.execute("CREATE TABLE sg_demo_orders (id INTEGER PRIMARY KEY)")
            mine.execute("INSERT INTO sg_demo_orders VALUES (7)")
            mine.commit()
        setup: list[str] = []
        check = f"sqlite:///{path}"
    elif backend.name == "postgresql":
        setup = [f'CREATE SCHEMA "{schema}"',
                 f'CREATE TABLE "{schema}".sg_demo_orders (id INTEGER PRIMARY KEY)',
                 f'INSERT INTO "{schema}".sg_demo_orders VALUES (7)']  # fmt: skip
        check = (
            make_url(backend.url)
            .update_query_dict({"options": f"-csearch_path={schema}"})
            .render_as_string(hide_password=False)
        )
    else:
        setup = [f"CREATE DATABASE `{schema}`",
                 f"CREATE TABLE `{schema}`.sg_demo_orders (id INTEGER PRIMARY KEY)",
                 f"INSERT INTO `{schema}`.sg_demo_orders VALUES (7)"]  # fmt: skip
        check = make_url(backend.url).set(database=schema).render_as_string(hide_password=False)
    with backend.engine.connect() as conn:
        for statement in setup:
            conn.execute(text(statement))
        conn.commit()
    try:
        assert cli.main(["demo", "--db", backend.url, "--orders", "5", "--schema", schema]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert "already exists and was not made by stateguard demo" in captured.err, captured.err
        assert "pass another --schema NAME" in captured.err
        engine = create_engine(check)
        try:
            with engine.connect() as conn:
                assert conn.execute(text("SELECT id FROM sg_demo_orders")).all() == [(7,)]
                assert "sg_demo_namespace" not in sa_inspect(conn).get_table_names()
        finally:
            engine.dispose()
    finally:
        drop_namespace(backend, schema)


@pytest.mark.hostile
@pytest.mark.parametrize("name", ["Upper", "1st", "a-b", "x" * 49, "a;drop"])
def test_demo_refuses_a_bad_schema_name(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--schema is an identifier the demo can quote safely on every backend, or exit 2."""
    assert cli.main(["demo", "--db", f"sqlite:///{tmp_path / 'a.db'}", "--schema", name]) == 2
    assert "--schema must be lower-case letters" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_progress_on_a_pipe_ends_at_100_percent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """stderr that is not a terminal gets a line per scenario with the share done, the last at 100%."""
    assert cli.main(["demo", "--db", f"sqlite:///{tmp_path / 'p.db'}", "--orders", "5", "--seed", "9"]) == 0
    lines = capsys.readouterr().err.splitlines()
    done = [line for line in lines if re.match(r"stateguard demo: \[\d/\d\] \d+% ", line)]
    count = len(demo.SCENARIOS)
    assert [int(re.findall(r"\] (\d+)%", line)[0]) for line in done] == [
        100 * i // count for i in range(1, count + 1)
    ]
    assert lines[-1].startswith("stateguard demo: 100%: "), lines
    assert "\r" not in "".join(lines) and "\x1b[" not in "".join(lines)


def _side_effect_first(run: DemoRun) -> list[SchemeRow]:
    """A broken consumer: it runs the side effect before looking at the outcome."""
    ids = run.create_orders(run.orders)

    def deliver(session: Session, request: Request, worker: str) -> Result:
        result = DemoOrder.flow.pay(session, request.order_id)
        run.side_effect(session, "broken", request, worker)
        return result

    tally = run.fire(run.plan([[[Request(i, "pay")] for i in ids]]), deliver)
    return [run.row("broken", "side effect before the outcome", tally)]


def test_violated_invariant_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A scenario whose side effects run for duplicates too is reported VIOLATED and exits 1."""
    monkeypatch.setattr(demo, "SCENARIOS", [demo.Scenario("broken", _side_effect_first)])
    code = cli.main(["demo", "--db", f"sqlite:///{tmp_path / 'broken.db'}", "--orders", "10"])
    out = capsys.readouterr().out
    assert code == 1
    row = table(out)["broken"]
    assert row["invariant"] == "VIOLATED"
    assert int(row["effects"]) > int(row["applied"]) == 10
    assert "side effects ran for 10 APPLIED calls" in out
    assert "'pay' side effect ran" in out and "INVARIANT VIOLATED" in out


class _PassThrough:
    """A stand-in for IdempotencyMiddleware that ignores the header (what an app without it does)."""

    def __init__(self, app: Any, **options: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


def test_http_storm_without_the_middleware_is_violated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The HTTP scenario's checks catch a handler that runs for every retry: VIOLATED, exit 1."""
    monkeypatch.setattr(stateguard.asgi, "IdempotencyMiddleware", _PassThrough)
    monkeypatch.setattr(demo, "SCENARIOS", [s for s in demo.SCENARIOS if s.title == "http retry storm"])
    code = cli.main(["demo", "--db", f"sqlite:///{tmp_path / 'plain.db'}", "--orders", "20", "--seed", "4"])
    out = capsys.readouterr().out
    assert code == 1, out
    row = table(out)["http retry storm"]
    assert row["invariant"] == "VIOLATED" and int(row["repeated"]) == 0
    assert "'pay' side effect ran" in out
    assert "0 of 20 idempotency keys are completed" in out
    assert "0 of 2 keys reused for another amount were refused with 422" in out
    assert "INVARIANT VIOLATED" in out


def test_http_storm_is_skipped_with_a_note_without_starlette(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without starlette the other scenarios run and a note says how to get the HTTP one; exit 0."""
    for name in [m for m in sys.modules if m == "starlette" or m.startswith("starlette.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "starlette", None)
    code = cli.main(["demo", "--db", f"sqlite:///{tmp_path / 'bare.db'}", "--orders", "5", "--seed", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert sorted(table(out)) == sorted(set(SCHEMES) - {"http retry storm"})
    assert "http retry storm: skipped: it needs starlette" in out
    assert "pip install 'stateguard[demo]'" in out


def test_asgi_request_collects_a_streamed_response() -> None:
    """The demo's in-process transport hands the app the body once and joins the response chunks."""
    import anyio

    received: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        received.append((scope["method"], scope["path"], dict(scope["headers"])[b"idempotency-key"]))
        received.append(await receive())
        await send({"type": "http.response.start", "status": 207, "headers": [(b"X-One", b"1")]})
        await send({"type": "http.response.body", "body": b"ab", "more_body": True})
        await send({"type": "http.response.body", "body": b"c", "more_body": False})
        received.append(await receive())

    answer = anyio.run(demo.asgi_request, app, "POST", "/p", [(b"idempotency-key", b"k")], b"{}")
    assert answer == demo.HttpAnswer(207, {"x-one": "1"}, b"abc")
    assert received == [
        ("POST", "/p", b"k"),
        {"type": "http.request", "body": b"{}", "more_body": False},
        {"type": "http.disconnect"},
    ]


def test_invariant_check_sees_a_double_side_effect_it_did_not_cause(backend: Backend) -> None:
    """A side-effect row added behind the demo's back turns a correct scheme's row into a violation."""
    engine = backend.create(DemoBase.metadata)
    run = DemoRun(backend.engine, 4, 5, random.Random(3))
    ids = run.create_orders(2)
    with Session(engine) as s, s.begin():
        r = DemoOrder.flow.pay(s, ids[0])
        run.side_effect(s, "manual", Request(ids[0], "pay"), "w0")
        run.side_effect(s, "manual", Request(ids[0], "pay"), "w1")
    tally = demo.Tally(attempts=1)
    tally.outcomes[r.outcome] += 1
    row = run.row("manual", "by hand", tally)
    assert not row.ok and row.side_effects == 2 and row.applied == 1
    assert any("ran 2 times" in p for p in row.problems)


# --------------------------------------------------------------------------
# The storm machinery: plans and simultaneous twins
# --------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 3, 8])
def test_plan_sends_every_request_two_to_four_times(workers: int) -> None:
    """Each request is delivered 2-4 times, some as simultaneous twins, in groups no bigger than the pool."""
    run = DemoRun(create_engine("sqlite://"), workers, 100, random.Random(5))
    requests = [Request(i, "pay") for i in range(200)]
    plan = run.plan([[[r] for r in requests[:100]], [[r] for r in requests[100:]]])
    counts = {r: 0 for r in requests}
    for group in plan:
        assert 1 <= len(group) <= workers
        for r in group:
            counts[r] += 1
    assert all(2 <= n <= 4 for n in counts.values())
    twins = [g for g in plan if len(g) > 1 and len(set(g)) < len(g)]
    assert bool(twins) == (workers > 1)


def test_twins_really_run_at_the_same_time(tmp_path: Path) -> None:
    """Members of a group are released together by a barrier and overlap in time, without deadlock."""
    engine = create_engine(f"sqlite:///{tmp_path / 'twins.db'}")
    run = DemoRun(engine, 2, 0, random.Random(1))
    plan = [[Request(i, "pay"), Request(i, "pay")] for i in range(6)] + [[Request(99, "ship")]]
    spans: dict[int, list[tuple[float, float]]] = {}
    lock = threading.Lock()

    def deliver(session: Session, request: Request, worker: str) -> Result:
        start = time.monotonic()
        time.sleep(0.05)
        with lock:
            spans.setdefault(request.order_id, []).append((start, time.monotonic()))
        return Result(Outcome.APPLIED, model=DemoOrder, key=request.order_id)

    tally = run.fire(plan, deliver)
    engine.dispose()
    assert tally.attempts == 13 and tally.outcomes[Outcome.APPLIED] == 13 and not tally.errors
    for order_id in range(6):
        (a0, a1), (b0, b1) = spans[order_id]
        assert a0 < b1 and b0 < a1, f"the twins of {order_id} did not overlap"


def test_unexpected_errors_are_reported_not_raised(tmp_path: Path) -> None:
    """A delivery that raises is counted as an error and makes the row fail; the storm continues."""
    engine = create_engine(f"sqlite:///{tmp_path / 'errors.db'}")
    DemoBase.metadata.create_all(engine)
    run = DemoRun(engine, 4, 0, random.Random(1))

    def deliver(session: Session, request: Request, worker: str) -> Result:
        if request.order_id == 3:
            raise RuntimeError("boom\nsecond line")
        return Result(Outcome.REPEATED, model=DemoOrder, key=request.order_id)

    tally = run.fire([[Request(i, "pay")] for i in range(5)], deliver)
    row = run.row("errors", "raising", tally)
    engine.dispose()
    assert tally.attempts == 5 and tally.outcomes[Outcome.REPEATED] == 4
    assert tally.errors == ["3:pay: RuntimeError: boom"]
    assert not row.ok and row.other == {"errors": 1}


def test_state_machine_scenario_counts_outcomes_of_real_triggers(backend: Backend) -> None:
    """A pay that is redelivered after the order was cancelled is REJECTED and records no side effect."""
    engine = backend.create(DemoBase.metadata)
    run = DemoRun(engine, 4, 3, random.Random(2))
    ids = run.create_orders(1)
    with engine.begin() as conn:
        conn.execute(update(DemoOrder).where(DemoOrder.id == ids[0]).values(status="cancelled"))

    def deliver(session: Session, request: Request, worker: str) -> Result:
        result = DemoOrder.flow.fire(session, request.action, request.order_id)
        if result.applied:
            run.side_effect(session, "late", request, worker)
        return result

    tally = run.fire([[Request(ids[0], "pay"), Request(ids[0], "pay")], [Request(ids[0], "cancel")]], deliver)
    row = run.row("late", "late pay", tally)
    assert tally.outcomes == {Outcome.REJECTED: 2, Outcome.REPEATED: 1}
    assert row.ok and row.side_effects == 0


# --------------------------------------------------------------------------
# The result table
# --------------------------------------------------------------------------


def test_render_colours_the_verdict_only_when_asked() -> None:
    """render() emits ANSI codes only with color=True, green for ok and red for a violation."""
    good = SchemeRow("a", "x", 4, 1, 3, 0, 0, 1)
    bad = SchemeRow("b", "y", 4, 1, 3, 0, 0, 2, problems=["b: 2 side effects ran for 1 APPLIED calls"])
    report = demo.DemoReport([good, bad], seed=1, workers=2, orders=1, url="sqlite:///x.db", elapsed=0.1)
    plain = demo.render(report)
    coloured = demo.render(report, color=True)
    assert "\x1b[" not in plain
    assert "\x1b[32mok" in coloured and "\x1b[1;31mVIOLATED" in coloured
    assert table(plain)["a"]["invariant"] == "ok" and table(plain)["b"]["invariant"] == "VIOLATED"


# --------------------------------------------------------------------------
# A real process
# --------------------------------------------------------------------------


def test_python_m_stateguard_demo_in_a_subprocess(tmp_path: Path) -> None:
    """``python -m stateguard demo`` runs in a real process, prints the table and exits 0."""
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    db = f"sqlite:///{tmp_path / 'sub.db'}"
    proc = subprocess.run(
        [sys.executable, "-m", "stateguard", "demo", "--db", db, "--orders", "20"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    rows = table(proc.stdout)
    assert sorted(rows) == sorted(SCHEMES)
    assert all(row["invariant"] == "ok" for row in rows.values())
    assert "\x1b[" not in proc.stdout + proc.stderr  # pipes, not terminals


# --------------------------------------------------------------------------
# The outbox pipeline
# --------------------------------------------------------------------------


def _pipeline_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "SCENARIOS", [s for s in demo.SCENARIOS if s.title == "outbox pipeline"])


def test_pipeline_leaves_the_applications_own_events_alone(
    sqlite: Backend, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's relays publish only the demo's topics: an application's pending event stays unpublished."""
    from stateguard import create_tables, drop_tables, emit

    _pipeline_only(monkeypatch)
    create_tables(sqlite.engine)
    sqlite.create(DemoBase.metadata)
    try:
        with Session(sqlite.engine) as s, s.begin():
            mine = emit(s, "app.invoice", {"id": 1}, key="invoice-1")
        code = cli.main(["demo", "--db", sqlite.url, "--orders", "20", "--seed", "5"])
        out = capsys.readouterr().out
        assert code == 0, out
        assert table(out)["outbox pipeline"]["invariant"] == "ok"
        with sqlite.engine.connect() as conn:
            row = conn.execute(
                select(outbox.c.published_ms, outbox.c.attempts).where(outbox.c.id == mine)
            ).one()
        assert tuple(row) == (None, 0)
    finally:
        drop_tables(sqlite.engine)


def test_pipeline_without_consume_once_is_violated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A consumer that does not deduplicate applies redelivered events again: VIOLATED, exit 1."""
    import stateguard.inserts

    def forgetful(session: Session, consumer: str, message_id: str) -> Result:
        return Result(Outcome.APPLIED, model=DemoOrder, key=message_id)

    _pipeline_only(monkeypatch)
    monkeypatch.setattr(stateguard.inserts, "consume_once", forgetful)
    code = cli.main(["demo", "--db", f"sqlite:///{tmp_path / 'dup.db'}", "--orders", "20", "--seed", "6"])
    out = capsys.readouterr().out
    assert code == 1, out
    row = table(out)["outbox pipeline"]
    assert row["invariant"] == "VIOLATED" and int(row["effects"]) > int(row["applied"]), out
    assert "side effect ran 2 times" in out or "side effect ran 3 times" in out, out


def test_pipeline_through_a_redis_stream(
    backend: Backend, redis_client: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With --redis the pipeline goes through a fresh Redis stream, holds its invariant, and deletes it."""
    _pipeline_only(monkeypatch)
    schema = schema_name()
    try:
        argv = ["demo", "--db", backend.url, "--orders", "20", "--seed", "8", "--redis", REDIS_URL]
        code = cli.main([*argv, "--schema", schema, "--keep"])
        out = capsys.readouterr().out
        assert code == 0, out
        stream = re.search(r"the broker is the Redis stream '([^']+)' \(deleted after the run\)", out)
        assert stream is not None, out
        assert redis_client.exists(stream[1]) == 0
        engine = namespace_engine(backend, schema)
        try:
            _check_pipeline(engine, table(out)["outbox pipeline"], out)
        finally:
            engine.dispose()
    finally:
        drop_namespace(backend, schema)


def test_demo_with_an_unreachable_redis_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--redis naming a server that does not answer is a one-line usage error before any scenario runs."""
    db = f"sqlite:///{tmp_path / 'r.db'}"
    assert cli.main(["demo", "--db", db, "--redis", "redis://127.0.0.1:1/0"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "cannot connect to Redis at redis://127.0.0.1:1/0" in captured.err


# --------------------------------------------------------------------------
# --html, rendered by a real headless browser
# --------------------------------------------------------------------------


def _chromium() -> str:
    """The Chromium binary (Debian's ``chromium``); skip loudly on a laptop, fail under CI without it."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    message = "chromium is not installed (apt-get install -y chromium): the HTML report is not rendered"
    if IN_CI:
        pytest.fail(f"{message}; .ci/run installs it", pytrace=False)
    pytest.skip(f"!!! SKIPPED: {message}")


def test_html_report_renders_in_headless_chromium(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--html writes one self-contained page; Chromium renders it without console errors, the DOM has
    every row's numbers and damage, and the screenshot shows both variants' bars."""
    from PIL import Image

    browser = _chromium()
    page = tmp_path / "report.html"
    db = f"sqlite:///{tmp_path / 'h.db'}"
    assert cli.main(["demo", "--db", db, "--orders", "8", "--seed", "12", "--html", str(page)]) == 0
    out = capsys.readouterr().out
    rows = {
        (r["scheme"], r["code"]): r
        for code in ("stateguard", "hand-written")
        for r in table(out, code).values()
    }
    assert len(rows) == 2 * len(SCHEMES)
    source = page.read_text(encoding="utf-8")
    # Self-contained: no script, no external stylesheet, image, font or frame.
    assert "<script" not in source.lower()
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", source), "external asset"
    assert "@import" not in source and "url(" not in source

    common = [
        browser,
        "--headless",
        "--disable-gpu",
        "--no-sandbox",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    dumped = subprocess.run(
        [*common, "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    console = [line for line in dumped.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert console == [], console
    dom = dumped.stdout
    assert '<table id="results">' in dom and 'id="verdict"' in dom
    assert "What the numbers mean" in dom and "optimistic version: REJECTED = pay and cancel" in dom
    for (scheme, code), row in rows.items():
        tr = re.search(rf'<tr data-scheme="{re.escape(scheme)}" data-code="{code}">(.*?)</tr>', dom, re.S)
        assert tr is not None, (scheme, code)
        cells = re.findall(r"<td[^>]*>(.*?)</td>", tr[1], re.S)
        numbers = [re.sub(r"<[^>]+>", "", c) for c in cells[2:8]]
        assert numbers == [
            row[k] for k in ("attempts", "applied", "repeated", "rejected", "retried", "effects")
        ]
        assert cells[8] == row["invariant"]
        assert cells[9] == row["damage"].replace("'", "&#x27;"), (cells[9], row["damage"])
        total = sum(damage(row).values())
        bar = re.search(
            rf'data-scheme="{re.escape(scheme)}" data-code="{code}" data-metric="damage" data-value="(\d+)"',
            dom,
        )
        assert bar is not None and int(bar[1]) == total, (scheme, code)
    # stateguard's zeros and the hand-written damage of the two schemes that double-charge on any backend.
    assert sum(damage(rows[("http retry storm", "hand-written")]).values()) > 0
    assert all(sum(damage(r).values()) == 0 for (_, code), r in rows.items() if code == "stateguard")

    shot = tmp_path / "report.png"
    taken = subprocess.run(
        [*common, "--hide-scrollbars", "--window-size=1280,2400", f"--screenshot={shot}", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert taken.returncode == 0 and shot.exists(), taken.stderr[-2000:]
    with Image.open(shot) as image:
        colours = Counter({colour: n for n, colour in image.convert("RGB").getcolors(1 << 24) or []})
    # The bars of both variants were drawn (hand-written #d9534f, stateguard #2e8b57).
    assert colours[(0xD9, 0x53, 0x4F)] > 200 and colours[(0x2E, 0x8B, 0x57)] > 200, colours.most_common(8)
