"""A tiny run of every benchmark scenario, so the harness cannot rot (the real runs are on demand)."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from bench.__main__ import RUNNERS, SIZES, main, markdown, report, run
from tests.conftest import IN_CI, Backend, capable


def test_every_scenario_runs_with_tiny_sizes(backend: Backend) -> None:
    """Each scenario produces its table; stateguard never double-applies, oversells or errs."""
    out = io.StringIO()
    tables = run([backend.url], None, quick=True, out=out)
    assert len(tables) == len(RUNNERS)
    by_number = {t.title.split(" ")[0]: t for t in tables}
    assert set(by_number) == {
        *("1.", "2.", "3.", "3b.", "4.", "5a.", "5b.", "5c."),
        *("6.", "6b.", "6c.", "7.", "8."),
    }

    single = {r["variant"]: r for r in by_number["1."].rows}
    # MariaDB: the first guarded call of an engine also asks the server once whether it is a
    # Galera node (SHOW GLOBAL VARIABLES LIKE 'wsrep_on'): 1 statement more over the --quick run.
    quick_calls = SIZES["single"][1]["n"]
    once = 1 / quick_calls if backend.name == "mariadb" else 0.0
    assert single["stateguard"]["stmts_per_call"] == pytest.approx(1.0 + once, abs=0.005)
    assert single["ORM load-check-save"]["stmts_per_call"] == 2.0

    guarded = [r for r in by_number["2."].rows if r["variant"] == "stateguard"]
    assert [r["workers"] for r in guarded] == ["3 threads", "3 processes"]
    for row in guarded:
        assert (row["applied"], row["repeated"]) == (20, 40)
        assert row["double_applications"] == 0 and row["errors"] == 0

    striped = {r["variant"]: r for r in by_number["3b."].rows}
    assert len(striped) == 4
    # Not FOR UPDATE: SQLite has none (SQLAlchemy drops it), that variant is the naive code there.
    for name in ("striped decrement", "single-row decrement", "ceiling: own row per worker"):
        row = striped[name]
        assert (row["sold"], row["oversell"], row["lost"], row["gave_up"]) == (15, 0, 0, 0), row

    flash = [
        r
        for r in by_number["3."].rows
        if r["variant"] in ("stateguard decrement", "conditional UPDATE (hand-written)")
    ]
    assert sorted(r["workers"] for r in flash) == ["3 processes", "3 processes", "3 threads", "3 threads"]
    for row in flash:
        assert (row["sold"], row["oversell"], row["lost_updates"]) == (10, 0, 0)
        assert row["gave_up"] == 0 and row["errors"] == 0

    # Idempotency keys: every variant at both sizes, with the statements the
    # README documents (no SAVEPOINT; a replay is one statement on PostgreSQL).
    idem = by_number["4."].rows
    assert sorted({r["keys"] for r in idem}) == [1000, 10_000]
    replay = 1.0 if capable(backend, "writable_cte") else 2.0
    expected = {
        "PK SELECT (Core, baseline)": 1.0,
        "Core INSERT (floor for a first call)": 1.0,
        "Core INSERT + UPDATE (two-statement floor)": 2.0,
        "first call": 2.0,
        "replay": replay,
        "first call, mode='separate'": 2.0,
        "replay, mode='separate'": replay,
    }
    for size in (1000, 10_000):
        assert {r["variant"]: r["stmts_per_call"] for r in idem if r["keys"] == size} == expected
    assert all(r["median_us"] > 0 and r["p99_us"] >= r["median_us"] for r in idem)
    assert any(n.startswith("target latency flat") for n in by_number["4."].notes)

    assert [r["rows_in_table"] for r in by_number["5c."].rows] == [100, 1000]

    # Relay: every variant published all its events (checked in the stream) at some positive rate.
    relay = {r["variant"]: r for r in by_number["6."].rows}
    assert set(relay) == {
        f"{kind}, batch {batch}" for kind in ("stateguard Relay", "hand-written loop") for batch in (100, 500)
    }
    assert all(r["events_per_s"] > 0 and r["x_baseline"] > 0 for r in relay.values())
    events = {r["variant"]: r["stmts_per_call"] for r in by_number["6b."].rows}
    assert events == {
        "events=True (transition + outbox event)": 1 if capable(backend, "writable_cte") else 2,
        "no events": 1,
    }
    # Locks (PostgreSQL only): every lock applied every increment, none lost; ZooKeeper ran
    # too when it is installed (CI installs zookeeperd).
    locks = {r["variant"]: r for r in by_number["7."].rows}
    if backend.name == "postgresql":
        expected_locks = {"advisory_lock", "RedisLock(fences=engine)", "RedisLock (Redis fence)"}
        if not any("ZooKeeperLock left out" in n for n in by_number["7."].notes):
            expected_locks.add("ZooKeeperLock")
        elif IN_CI:
            raise AssertionError("the ZooKeeper variant must run in CI: " + str(by_number["7."].notes))
        assert set(locks) == expected_locks
        for row in locks.values():
            assert (row["applied"], row["lost_updates"], row["errors"], row["stale"]) == (6, 0, 0, 0), row
            assert row["ops_per_s"] > 0 and row["p99_ms"] >= row["median_ms"] > 0
    else:
        assert locks == {}
    # Outcome events: every variant ran and the reporting test was timed.
    observed = {r["variant"] for r in by_number["8."].rows}
    assert {"no listener", "bridge bypassed", "a no-op listener"} <= observed
    assert any(n.startswith("target: with no listener") for n in by_number["8."].notes)
    assert "variant" in out.getvalue()


def test_main_writes_json_and_report(sqlite: Backend, tmp_path: Path) -> None:
    """`python -m bench run --quick --only load` writes its table, machine and server versions as JSON."""
    target = tmp_path / "r.json"
    assert main(["run", "--quick", "--only", "load", "--db", sqlite.url, "--json", str(target)]) == 0
    data = json.loads(target.read_text())
    assert data["meta"]["sqlalchemy"] and data["meta"]["servers"][sqlite.url].startswith("SQLite")
    assert [t["title"].split(" ")[0] for t in data["tables"]] == ["5a."]
    text = markdown(data)
    assert "| stateguard model |" in text and "#### 5a." in text


def test_set_replaces_a_size_of_the_scenarios_run(sqlite: Backend, tmp_path: Path) -> None:
    """`--set calls=3 --set 'sizes=[1000]'` runs the idempotency scenario with those sizes; a name no
    scenario run takes, or a value that is not JSON, stops before anything runs."""
    target = tmp_path / "r.json"
    argv = ["run", "--only", "idempotency", "--db", sqlite.url, "--json", str(target), "--quick"]
    assert main([*argv, "--set", "calls=3", "--set", "sizes=[1000]"]) == 0
    [table] = json.loads(target.read_text())["tables"]
    assert "1000 pre-filled keys, 3 calls each" in table["title"]
    assert {r["keys"] for r in table["rows"]} == {1000}
    for bad, message in (
        ("stock=5", "not a size of idempotency"),
        ("calls=x", "must be JSON"),
        ("calls", "name=value"),
    ):
        with pytest.raises(SystemExit, match=message):
            main([*argv, "--set", bad])


def test_idempotency_breakdown_adds_stateguards_statements_written_by_hand(backend: Backend) -> None:
    """`--set breakdown=true`: three more variants, stateguard's own two statements sent by hand
    without and with the block's savepoint (the same statements as a first call's), and with the
    claim's bare INSERT instead of the claim (an INSERT and the UPDATE, two statements too)."""
    from bench.idempotency import BREAKDOWN, BY_HAND_BARE, FIRST, idempotency_keys_scenario

    table = idempotency_keys_scenario(backend.url, [1000], 3, breakdown=True)
    rows = {r["variant"]: r for r in table.rows}
    assert set(BREAKDOWN) <= set(rows)
    shapes = next(n for n in table.notes if n.startswith("statements counted"))
    first = shapes.split(f"{FIRST}: ", 1)[1].split(";", 1)[0]
    for variant in BREAKDOWN:
        assert rows[variant]["stmts_per_call"] == rows[FIRST]["stmts_per_call"]
        assert f"{variant}: {first if variant != BY_HAND_BARE else 'INSERT UPDATE'}" in shapes
    assert not set(BREAKDOWN) & {r["variant"] for r in idempotency_keys_scenario(backend.url, [1000], 1).rows}


def test_report_writes_png_charts(sqlite: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench report --plots DIR` draws one real PNG per table and links it; without matplotlib, no charts."""
    from PIL import Image

    results = tmp_path / "r.json"
    scenarios = ["--only", "single", "--only", "load"]
    assert main(["run", "--quick", *scenarios, "--db", sqlite.url, "--json", str(results)]) == 0
    out = io.StringIO()
    assert report(results, tmp_path / "plots", tmp_path, out=out) == 0
    pngs = sorted((tmp_path / "plots").glob("*.png"))
    assert [p.name for p in pngs] == [
        "1-single-transition-no-contention-sqlite.png",
        "5a-loading-100-rows-sqlite.png",
    ]
    for png in pngs:
        with Image.open(png) as image:
            image.verify()  # a whole, valid PNG, not just a header
        with Image.open(png) as image:
            assert image.format == "PNG" and image.width > 600 and image.height > 150
            colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
            assert colours is not None and len(colours) > 10  # bars and text drawn, not a blank page
        assert f"](plots/{png.name})" in out.getvalue()

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    plain = io.StringIO()
    assert report(results, None, tmp_path, out=plain) == 0
    assert "#### 1. single transition" in plain.getvalue() and "![" not in plain.getvalue()
    assert report(results, tmp_path / "none", tmp_path, out=io.StringIO()) == 2
    assert not (tmp_path / "none").exists()


def test_committed_charts_are_drawn_from_the_committed_results(tmp_path: Path) -> None:
    """bench/plots holds exactly the charts of bench/plots/results.json, each linked from the docs page."""
    from PIL import Image

    from bench.plots import file_names, write_plots

    plots = Path(__file__).resolve().parents[2] / "bench" / "plots"
    data = json.loads((plots / "results.json").read_text())
    names = file_names(data)
    committed = sorted(p.name for p in plots.glob("*.png"))
    assert sorted(names.values()) == committed
    page = (plots.parent.parent / "docs" / "development" / "benchmarks.md").read_text()
    assert all(f"(../../bench/plots/{name})" in page for name in committed)
    flash = next(title for title in names if title.startswith("3. flash sale (postgresql)"))
    [redrawn] = write_plots(data, tmp_path, only={flash}).values()
    with Image.open(plots / names[flash]) as old, Image.open(redrawn) as new:
        assert old.size == new.size
