"""``stateguard demo`` on every backend: the storm machinery, the scenarios' invariant checks,
the result table, and ``python -m stateguard demo`` as a real process."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select, update
from sqlalchemy.orm import Session

import stateguard.asgi
from stateguard import Outcome, Result
from stateguard.tables import idempotency_keys, outbox
from stateguard.tooling import cli, demo
from stateguard.tooling.demo import DemoBase, DemoOrder, DemoRun, DemoSideEffect, Request, SchemeRow

from ..conftest import REDIS_URL, Backend

SCHEMES = (
    "state machine",
    "optimistic version",
    "insert-once",
    "flash sale",
    "http retry storm",
    "outbox pipeline",
)
ROW = re.compile(
    r"^(?P<scheme>[a-z][a-z -]*?)\s{2,}(?P<attempts>\d+)\s+(?P<applied>\d+)\s+(?P<repeated>\d+)\s+"
    r"(?P<rejected>\d+)\s+(?P<retried>\d+)\s+(?P<effects>\d+)\s+(?P<invariant>ok|VIOLATED)\b"
)


def table(out: str) -> dict[str, dict[str, str]]:
    """The demo's result rows by scheme."""
    rows = {}
    for line in out.splitlines():
        m = ROW.match(line)
        if m:
            rows[m["scheme"]] = m.groupdict()
    return rows


# --------------------------------------------------------------------------
# The demo on every backend
# --------------------------------------------------------------------------


def test_demo_on_backend(backend: Backend, capsys: pytest.CaptureFixture[str]) -> None:
    """The demo exits 0, prints one row per scheme with invariant "ok", and the database agrees."""
    backend.create(DemoBase.metadata)  # dropped again after the test
    code = cli.main(["demo", "--db", backend.url, "--orders", "30", "--workers", "8", "--seed", "11"])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    assert "Traceback" not in captured.err
    assert "\x1b[" not in captured.out  # not a terminal: no colour
    rows = table(captured.out)
    assert sorted(rows) == sorted(SCHEMES), captured.out
    with Session(backend.engine) as s:
        for scheme, row in rows.items():
            assert row["invariant"] == "ok"
            applied = int(row["applied"])
            total = int(row["applied"]) + int(row["repeated"]) + int(row["rejected"])
            if scheme == "flash sale":  # sold-out purchases are INSUFFICIENT (not a column)
                assert int(row["attempts"]) > total, row
            else:
                assert int(row["attempts"]) == total, row
            assert applied > 0 and int(row["repeated"]) > 0, row
            assert int(row["effects"]) == applied, row
            effects = s.scalar(
                select(func.count()).select_from(DemoSideEffect).where(DemoSideEffect.scheme == scheme)
            )
            doubles = s.execute(
                select(DemoSideEffect.order_id, DemoSideEffect.action)
                .where(DemoSideEffect.scheme == scheme)
                .group_by(DemoSideEffect.order_id, DemoSideEffect.action)
                .having(func.count() > 1)
            ).all()
            assert effects == applied and doubles == []
    # 30 orders, a pay and a follow-up each, every request delivered at least twice.
    assert int(rows["state machine"]["attempts"]) >= 2 * 2 * 30
    assert "invariant held" in captured.out
    _check_http_storm(backend, rows["http retry storm"], captured.out, orders=30)
    _check_pipeline(backend, rows["outbox pipeline"], captured.out)


def _check_pipeline(backend: Backend, row: dict[str, str], out: str) -> None:
    """The pipeline's numbers agree: an event and an effect per APPLIED transition, duplicates dropped."""
    also = re.search(
        r"^outbox pipeline: also deduplicated (\d+), published (\d+), redelivered (\d+)$", out, re.M
    )
    assert also is not None, out
    deduplicated, published, redelivered = (int(n) for n in also.groups())
    assert published == int(row["applied"]) == int(row["effects"]), (row, also[0])
    assert redelivered > 0 and deduplicated >= redelivered, also[0]  # every 4th acknowledgement was lost
    with backend.engine.connect() as conn:
        events = conn.execute(
            select(outbox.c.published_ms).where(outbox.c.topic.in_(demo.PIPELINE_TOPICS))
        ).all()
    assert len(events) == published and all(p is not None for (p,) in events)


def _check_http_storm(backend: Backend, row: dict[str, str], out: str, *, orders: int) -> None:
    """The HTTP scenario's row, notes and key records agree: one execution per key, 422s, 409s, 503s."""
    assert int(row["applied"]) == int(row["effects"]) == orders, row
    assert int(row["rejected"]) == max(1, orders // 10), row  # every reused key refused with 422
    assert f"executions per key: min 1, max 1 over {orders} keys" in out
    also = re.search(r"^http retry storm: also 409 in progress (\d+), 503 released (\d+)$", out, re.M)
    assert also is not None, out
    assert int(also[1]) > 0 and int(also[2]) == max(1, orders // 10)
    assert int(row["retried"]) == int(also[1]) + int(also[2])
    with backend.engine.connect() as conn:
        keys = conn.execute(
            select(idempotency_keys.c.status, idempotency_keys.c.attempt).where(
                idempotency_keys.c.scope.startswith(demo.DEMO_KEY_SCOPE)
            )
        ).all()
    # The keys of the 503 answers were released and taken over once by a retry (attempt 2).
    assert Counter(keys) == {("completed", 1): orders - int(also[2]), ("completed", 2): int(also[2])}


def test_demo_reruns_on_the_default_sqlite_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --db the demo uses stateguard-demo.db in the current folder, and a rerun works."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["demo", "--orders", "10", "--seed", "1"]) == 0
    assert cli.main(["demo", "--orders", "12", "--seed", "2"]) == 0
    assert (tmp_path / "stateguard-demo.db").exists()
    out = capsys.readouterr().out
    assert "sqlite:///stateguard-demo.db" in out
    engine = create_engine(f"sqlite:///{tmp_path / 'stateguard-demo.db'}")
    try:
        with engine.connect() as conn:
            # Tables were dropped and recreated: only the second run's orders are there.
            assert conn.scalar(select(func.count()).select_from(DemoOrder)) == len(SCHEMES) * 12
    finally:
        engine.dispose()


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
    from stateguard import create_tables, drop_tables

    _pipeline_only(monkeypatch)
    create_tables(backend.engine)
    backend.create(DemoBase.metadata)
    try:
        argv = ["demo", "--db", backend.url, "--orders", "20", "--seed", "8", "--redis", REDIS_URL]
        code = cli.main(argv)
        out = capsys.readouterr().out
        assert code == 0, out
        stream = re.search(r"the broker is the Redis stream '([^']+)' \(deleted after the run\)", out)
        assert stream is not None, out
        assert redis_client.exists(stream[1]) == 0
        _check_pipeline(backend, table(out)["outbox pipeline"], out)
    finally:
        drop_tables(backend.engine)


def test_demo_with_an_unreachable_redis_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--redis naming a server that does not answer is a one-line usage error before any scenario runs."""
    db = f"sqlite:///{tmp_path / 'r.db'}"
    assert cli.main(["demo", "--db", db, "--redis", "redis://127.0.0.1:1/0"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "cannot connect to Redis at redis://127.0.0.1:1/0" in captured.err
