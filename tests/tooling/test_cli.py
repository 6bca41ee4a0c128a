"""The ``stateguard`` command line: arguments, help, exit codes, opening databases, ``purge``,
and which commands import the demo."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select
from sqlalchemy.orm import Session

import stateguard.outbox.sinks.redis_streams
from stateguard import create_tables, drop_tables, emit
from stateguard.outbox.sinks.redis_streams import RedisStreamSink
from stateguard.tables import consumed_messages, idempotency_keys, outbox, tokens
from stateguard.tooling import cli
from stateguard.tooling.cli import EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, main
from tests.conftest import REDIS_URL, Backend
from tests.tooling._helpers import DEMO, MULTI, run

# --------------------------------------------------------------------------
# Arguments, help, exit codes
# --------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"]])
def test_help_exits_zero_and_documents_exit_codes(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--help`` on every command prints usage and the exit codes, and returns 0."""
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: stateguard")
    assert "exit codes" in out and "0  ok" in out and "an invariant was violated" in out
    assert "2  usage error" in out


@pytest.mark.parametrize(
    ("command", "codes", "one"),
    [
        ("demo", ["0", "1", "2"], "an invariant was violated"),
        ("graph", ["0", "2"], None),
        ("check", ["0", "1", "2"], "problems were found"),
        ("purge", ["0", "2"], None),
        ("relay", ["0", "2"], None),
    ],
)
def test_each_command_help_lists_only_its_own_exit_codes(
    command: str, codes: list[str], one: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A command's --help lists the exit codes that command can return, and no other's meaning of 1."""
    assert cli.main([command, "--help"]) == 0
    epilog = capsys.readouterr().out.split("exit codes:", 1)[1]
    listed = [line.split()[0] for line in epilog.splitlines() if line[:3].strip().isdigit()]
    assert listed == codes
    other = {"an invariant was violated", "problems were found"} - {one}
    assert not any(text in epilog for text in other), epilog
    if one is not None:
        assert f"1  {one}" in epilog


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    """``--version`` prints the package version and returns 0."""
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == "stateguard 0.1.0"


@pytest.mark.parametrize(
    "argv",
    [[], ["nope"], ["demo", "--workers", "0"], ["demo", "--orders", "x"], ["demo", "--bogus"]],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A missing or unknown command and bad options return 2 with a usage message."""
    assert cli.main(argv) == 2
    assert "usage: stateguard" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["graph", "stateguard.tooling.demo"], "expected MODULE:Model"),
        (["graph", "no_such_module_sg:Order"], "cannot import no_such_module_sg: ModuleNotFoundError"),
        (["graph", "stateguard.tooling.demo:Nope"], "stateguard.tooling.demo has no class 'Nope'"),
        (["graph", "stateguard.tooling.demo:DemoSideEffect"], "declares no StateMachine"),
        (["graph", DEMO, "--format", "gif"], "invalid choice: 'gif'"),
        (["graph", "bad name:Order"], "not a module name"),
        (["check", "no_such_module_sg"], "cannot import no_such_module_sg"),
        (["check", "stateguard.result"], "no StateMachine found in stateguard.result"),
        (["check", "stateguard.tooling.demo", "--db", "nonsense://x"], "unknown database URL scheme"),
        (["check", "stateguard.tooling.demo", "--db", "sqlite://"], "stateguard check needs a SQLite file"),
    ],
)
def test_graph_and_check_usage_errors_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bad targets, formats and URLs return 2 with one line saying what is wrong."""
    code, out, err = run(argv, capsys)
    assert code == 2 and out == ""
    assert message in err


@pytest.mark.parametrize("command", ["graph", "check"])
def test_help_documents_exit_codes(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--help`` of graph and check prints usage and the exit codes, and returns 0."""
    code, out, _ = run([command, "--help"], capsys)
    assert code == 0
    assert out.startswith(f"usage: stateguard {command}")
    assert "exit codes:" in out and "2  usage error" in out


# --------------------------------------------------------------------------
# Errors before the demo starts
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://postgres@127.0.0.1:1/test",
        "mysql+pymysql://root@127.0.0.1:1/test",
        "sqlite:////nonexistent-stateguard-dir/demo.db",
    ],
)
def test_unreachable_db_exits_2_with_one_line(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """An unreachable database gives one clear line on stderr, no traceback, and exit code 2."""
    assert cli.main(["demo", "--db", url]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("stateguard demo: cannot connect to ")


def test_missing_driver_names_the_extra(capsys: pytest.CaptureFixture[str]) -> None:
    """A URL naming a driver that is not installed says how to install one, exit code 2."""
    assert importlib.util.find_spec("pg8000") is None, "this test needs pg8000 to be absent"
    assert cli.main(["demo", "--db", "postgresql+pg8000://postgres@127.0.0.1/test"]) == 2
    err = capsys.readouterr().err
    assert "pg8000 driver for postgresql is not installed" in err
    assert "pip install 'stateguard[postgres]'" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("sqlite://", "needs a SQLite file"),
        ("sqlite:///:memory:", "needs a SQLite file"),
        ("not a url", "not a database URL"),
        ("nosuchdb://x/y", "unknown database URL scheme"),
    ],
)
def test_unusable_urls_exit_2(url: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """URLs the demo cannot use are usage errors with a one-line reason."""
    assert cli.main(["demo", "--db", url]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1


# --------------------------------------------------------------------------
# purge
# --------------------------------------------------------------------------


def _fill(engine: Engine, expired: int, live: int) -> None:
    now = time.time_ns() // 1_000_000
    keys = [
        {
            "scope": "s",
            "idem_key": f"k-{i}",
            "status": "completed",
            "owner": "o",
            "attempt": 1,
            "expires_ms": now - 1000 if i < expired else now + 3_600_000,
            "created_ms": now,
            "updated_ms": now,
        }
        for i in range(expired + live)
    ]
    toks = [
        {
            "token_hash": f"{i:064x}",
            "scope": "s",
            "expires_ms": now - 1000 if i < expired else now + 3_600_000,
            "created_ms": now,
        }
        for i in range(expired + live)
    ]
    with engine.begin() as conn:
        conn.execute(insert(idempotency_keys), keys)
        conn.execute(insert(tokens), toks)


def _count(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        return (
            conn.execute(select(func.count()).select_from(idempotency_keys)).scalar_one(),
            conn.execute(select(func.count()).select_from(tokens)).scalar_one(),
        )


def test_purge_deletes_every_expired_row_in_batches_and_keeps_live_ones(
    backend: Backend, engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """25 expired rows per table go in batches of 10 (3 batches); the 5 live rows stay."""
    _fill(engine, expired=25, live=5)
    assert main(["purge", "--db", backend.url, "--batch", "10", "--pause", "0"]) == EXIT_OK
    assert _count(engine) == (5, 5)
    out = capsys.readouterr().out
    assert "expired idempotency keys: 25 deleted in 3 batches" in out
    assert "expired one-time tokens: 25 deleted in 3 batches" in out


def test_purge_only_and_max_batches_limit_the_work(
    backend: Backend, engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """--only picks a table; --max-batches stops early."""
    _fill(engine, expired=25, live=0)
    assert main(["purge", "--db", backend.url, "--only", "keys", "--batch", "10", "--max-batches", "1"]) == 0
    assert _count(engine) == (15, 25)
    assert "tokens" not in capsys.readouterr().out


def test_purge_deletes_published_outbox_events_older_than_the_retention(
    backend: Backend, engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """--outbox-retention 2 (hours): events published 3 h ago go, recent and unpublished ones stay."""
    now = time.time_ns() // 1_000_000
    rows = [
        {"topic": "t", "payload": "{}", "created_ms": now, "attempts": 1, "published_ms": published}
        for published in [now - 3 * 3_600_000] * 3 + [now - 60_000, None]
    ]
    with engine.begin() as conn:
        conn.execute(insert(outbox), rows)
    argv = ["purge", "--db", backend.url, "--only", "outbox", "--outbox-retention", "2", "--batch", "2"]
    assert main([*argv, "--pause", "0"]) == EXIT_OK
    assert "published outbox events: 3 deleted in 2 batches" in capsys.readouterr().out
    with engine.connect() as conn:
        left = conn.execute(select(outbox.c.published_ms).order_by(outbox.c.id)).scalars().all()
    assert left == [now - 60_000, None]
    assert main(["purge", "--db", backend.url, "--outbox-retention", "0"]) == EXIT_USAGE


def test_purge_deletes_consumed_records_only_with_a_retention(
    backend: Backend, engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """consume_once() records go only with --consumed-retention (hours), and only the older ones;
    --only consumed without it is a usage error, and the default run keeps them."""
    now = time.time_ns() // 1_000_000
    rows = [
        {"consumer": "billing", "message_id": f"m{i}", "consumed_ms": consumed}
        for i, consumed in enumerate([now - 5 * 3_600_000] * 3 + [now - 60_000])
    ]
    with engine.begin() as conn:
        conn.execute(insert(consumed_messages), rows)

    def left() -> list[str]:
        with engine.connect() as conn:
            return sorted(conn.execute(select(consumed_messages.c.message_id)).scalars())

    assert main(["purge", "--db", backend.url, "--pause", "0"]) == EXIT_OK
    assert "consumed" not in capsys.readouterr().out and len(left()) == 4
    assert main(["purge", "--db", backend.url, "--only", "consumed"]) == EXIT_USAGE
    assert "--consumed-retention" in capsys.readouterr().err and len(left()) == 4
    argv = ["purge", "--db", backend.url, "--consumed-retention", "4", "--batch", "2", "--pause", "0"]
    assert main(argv) == EXIT_OK
    assert "consumed-message records: 3 deleted in 2 batches" in capsys.readouterr().out
    assert left() == ["m3"]


def test_purge_without_tables_says_how_to_create_them(
    backend: Backend, capsys: pytest.CaptureFixture[str]
) -> None:
    """A database without stateguard's tables is a usage error (exit 2, not 1 "problems") with the fix."""
    drop_tables(backend.engine)
    assert main(["purge", "--db", backend.url]) == EXIT_USAGE
    assert "alembic upgrade stateguard@head" in capsys.readouterr().err


def _missing_sqlite_urls(tmp_path: Path) -> list[tuple[str, Path]]:
    """SQLite URLs naming files that do not exist, with the file each would create."""
    return [
        (f"sqlite:///{tmp_path / 'absent.db'}", tmp_path / "absent.db"),
        ("sqlite:///relative-absent.db", tmp_path / "relative-absent.db"),
        ("sqlite:///file:uri-absent.db?uri=true", tmp_path / "uri-absent.db"),
        (f"sqlite:///{tmp_path / 'no-such-dir' / 'x.db'}", tmp_path / "no-such-dir"),
    ]


@pytest.mark.parametrize("command", [["purge", "--pause", "0"], ["check", "stateguard.tooling.demo"]])
def test_check_and_purge_never_create_a_missing_sqlite_file(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """check and purge on a SQLite path or URL that does not exist exit 2, say so, and create no file."""
    monkeypatch.chdir(tmp_path)
    for url, created in _missing_sqlite_urls(tmp_path):
        code, out, err = run([*command, "--db", url], capsys)
        assert code == EXIT_USAGE, (url, out, err)
        assert out == "" and len(err.splitlines()) == 1, err
        assert "no SQLite database at" in err and "does not create one" in err, err
        assert not created.exists(), url
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [["purge", "--pause", "0"], ["check", "stateguard.tooling.demo"]])
def test_check_and_purge_on_an_unreadable_database_exit_2(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A database error while reading (a file that is not a SQLite database) is exit 2, not 1 "problems"."""
    path = tmp_path / "not-a-database.db"
    path.write_bytes(b"this is not a SQLite database, just text" * 100)
    code, _, err = run([*command, "--db", f"sqlite:///{path}"], capsys)
    assert code == EXIT_USAGE, err
    assert "file is not a database" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not-a-database.db"]


def test_check_and_purge_still_work_on_an_existing_sqlite_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An existing SQLite file is opened as before: purge exits 0, check reports the missing table (1)."""
    from stateguard import create_tables, sqlite_engine

    url = f"sqlite:///{tmp_path / 'app.db'}"
    engine = sqlite_engine(url)
    create_tables(engine)
    engine.dispose()
    assert run(["purge", "--db", url, "--pause", "0"], capsys)[0] == EXIT_OK
    code, out, _ = run(["check", "stateguard.tooling.demo", "--db", url], capsys)
    assert code == EXIT_PROBLEMS and "missing_table" in out


def test_purge_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """Missing --db, a bad batch or an unreachable database exit 2 with one line."""
    assert main(["purge"]) == EXIT_USAGE
    assert main(["purge", "--db", "sqlite:///x.db", "--batch", "0"]) == EXIT_USAGE
    assert main(["purge", "--db", "postgresql+psycopg://nobody@127.0.0.1:1/none"]) == EXIT_USAGE
    assert "cannot connect" in capsys.readouterr().err


# --------------------------------------------------------------------------
# Which commands import the demo
# --------------------------------------------------------------------------

#: Runs ``cli.main`` for each argv in a fresh interpreter and records, after each one,
#: its exit code and whether the demo module has been imported by then.
LAZY_DEMO = """
import json, sys
from stateguard import create_tables, sqlite_engine
from stateguard.tooling import cli

url, commands, report = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
engine = sqlite_engine(url)
create_tables(engine)
engine.dispose()
seen = []
for argv in commands:
    seen.append([cli.main(argv), "stateguard.tooling.demo" in sys.modules])
with open(report, "w") as f:
    json.dump(seen, f)
"""


def test_only_the_demo_command_imports_the_demo(tmp_path: Path) -> None:
    """--help, purge, graph and check run without importing the demo's mapped models (DemoBase ...)."""
    module = f"sgmod_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(MULTI.format(table=f"jobs_{uuid.uuid4().hex[:6]}"))
    db = f"sqlite:///{tmp_path / 'lazy.db'}"
    # Each command and the exit code it should give (check --db: Job's table is missing).
    expected = [
        (["--help"], 0),
        (["demo", "--help"], 0),
        (["purge", "--help"], 0),
        (["purge", "--db", db, "--pause", "0"], 0),
        (["graph", f"{module}:Job", "--machine", "run"], 0),
        (["check", module], 0),
        (["check", module, "--db", db], 1),
        (["graph", DEMO], 0),
    ]
    commands = [argv for argv, _ in expected]
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-c", LAZY_DEMO, db, json.dumps(commands), str(report)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(report.read_text())
    # The last command, drawing the demo's own model, is the control: it does import the demo.
    assert seen == [[code, argv[-1] == DEMO] for argv, code in expected]


# --------------------------------------------------------------------------
# relay
# --------------------------------------------------------------------------


def _emit_events(engine: Engine, n: int, *, start: int = 0) -> list[int]:
    """``n`` committed outbox events over 5 keys; their ids."""
    with Session(engine) as session, session.begin():
        return [emit(session, "order.paid", {"i": i}, key=f"order-{i % 5}") for i in range(start, start + n)]


def _stream_ids(redis_client: Any, stream: str) -> list[int]:
    return [int(fields[b"id"]) for _, fields in redis_client.xrange(stream)]


@pytest.fixture
def stream(redis_client: Any) -> Iterator[str]:
    """A Redis stream name unique to the test, deleted afterwards."""
    name = f"sgtest-relay-{uuid.uuid4().hex[:12]}"
    yield name
    redis_client.delete(name)


def _start_relay(url: str, stream: str, *extra: str) -> subprocess.Popen[str]:
    argv = ["relay", "--db", url, "--redis", REDIS_URL, "--stream", stream, "--idle", "0.1", *extra]
    return subprocess.Popen(
        [sys.executable, "-m", "stateguard", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_for(redis_client: Any, stream: str, n: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while redis_client.xlen(stream) < n:
        if proc.poll() is not None:
            pytest.fail(f"the relay exited {proc.returncode}: {proc.communicate()}")
        assert time.monotonic() < deadline, f"{redis_client.xlen(stream)} of {n} events in the stream"
        time.sleep(0.05)


def test_relay_publishes_every_event_once_and_stops_cleanly_on_sigterm(
    backend: Backend, engine: Engine, redis_client: Any, stream: str
) -> None:
    """`stateguard relay` XADDs every event once, marks it, picks up new ones, and exits 0 on SIGTERM."""
    ids = _emit_events(engine, 40)
    proc = _start_relay(backend.url, stream, "--batch", "7")
    try:
        _wait_for(redis_client, stream, 40, proc)
        ids += _emit_events(engine, 15, start=40)  # committed while it runs
        _wait_for(redis_client, stream, 55, proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == EXIT_OK, err
    assert "Traceback" not in err
    assert "stopped by SIGTERM: 55 events published" in err
    published = _stream_ids(redis_client, stream)
    assert sorted(published) == sorted(ids)  # every event, exactly once
    for key in range(5):  # and each key in id order
        of_key = [i for i in published if (ids.index(i) % 5) == key]
        assert of_key == sorted(of_key)
    with engine.connect() as conn:
        unpublished = conn.scalar(
            select(func.count()).select_from(outbox).where(outbox.c.published_ms.is_(None))
        )
    assert unpublished == 0


def test_relay_stops_on_sigint_too(sqlite: Backend, redis_client: Any, stream: str) -> None:
    """SIGINT (Ctrl-C) is a clean stop as well: exit 0, no traceback, the events published once."""
    drop_tables(sqlite.engine)
    create_tables(sqlite.engine)
    try:
        ids = _emit_events(sqlite.engine, 12)
        proc = _start_relay(sqlite.url, stream)
        try:
            _wait_for(redis_client, stream, 12, proc)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == EXIT_OK and "stopped by SIGINT: 12 events published" in err, err
        assert "Traceback" not in err and "interrupted" not in err
        assert sorted(_stream_ids(redis_client, stream)) == ids
    finally:
        drop_tables(sqlite.engine)


def test_relay_finishes_the_batch_in_hand_on_sigterm(
    sqlite: Backend,
    redis_client: Any,
    stream: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SIGTERM while a batch is being published: that batch is published and marked, no next one starts."""
    drop_tables(sqlite.engine)
    create_tables(sqlite.engine)
    publishing = threading.Event()

    class SlowSink(RedisStreamSink):
        """The Redis sink, slow enough for the signal to arrive mid-batch."""

        def publish(self, events: Any) -> Any:
            publishing.set()
            time.sleep(0.5)
            return super().publish(events)

    monkeypatch.setattr(stateguard.outbox.sinks.redis_streams, "RedisStreamSink", SlowSink)
    handler_before = signal.getsignal(signal.SIGTERM)

    def terminate() -> None:
        if publishing.wait(30):
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        ids = _emit_events(sqlite.engine, 20)
        killer = threading.Thread(target=terminate)
        killer.start()
        argv = ["relay", "--db", sqlite.url, "--redis", REDIS_URL, "--stream", stream, "--batch", "5"]
        code, _, err = run(argv, capsys)
        killer.join()
        assert code == EXIT_OK, err
        assert "stopped by SIGTERM: 5 events published" in err
        assert _stream_ids(redis_client, stream) == ids[:5]
        with sqlite.engine.connect() as conn:
            marked = conn.scalars(select(outbox.c.id).where(outbox.c.published_ms.is_not(None))).all()
        assert sorted(marked) == ids[:5]
        assert signal.getsignal(signal.SIGTERM) == handler_before  # the relay's handler is taken down
    finally:
        drop_tables(sqlite.engine)


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["relay", "--redis", REDIS_URL], "the following arguments are required: --db"),
        (["relay", "--db", "sqlite:///x.db"], "the following arguments are required: --redis"),
        (["relay", "--db", "sqlite:///x.db", "--redis", REDIS_URL, "--batch", "0"], "must be at least 1"),
        (["relay", "--db", "sqlite:///x.db", "--redis", REDIS_URL, "--lease", "-1"], "at least 0.001"),
        (["relay", "--db", "sqlite:///x.db", "--redis", REDIS_URL, "--bogus"], "unrecognized arguments"),
    ],
)
def test_relay_bad_arguments_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Missing --db or --redis and bad numbers are usage errors: exit 2 with the reason."""
    code, out, err = run(argv, capsys)
    assert code == EXIT_USAGE and out == ""
    assert message in err


def test_relay_unusable_database_or_redis_exit_2(
    sqlite: Backend, tmp_path: Path, redis_client: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing SQLite file, missing tables, an unreachable Redis or a bad batch: one line, exit 2."""
    drop_tables(sqlite.engine)
    base = ["--redis", REDIS_URL, "--stream", "sgtest-never-written"]
    cases = [
        (["--db", f"sqlite:///{tmp_path / 'absent.db'}", *base], "no SQLite database at"),
        (["--db", "postgresql+psycopg://nobody@127.0.0.1:1/none", *base], "cannot connect"),
        (["--db", sqlite.url, *base], "run `alembic upgrade stateguard@head`"),
    ]
    for argv, message in cases:
        code, out, err = run(["relay", *argv], capsys)
        assert code == EXIT_USAGE and out == "" and message in err, err
        assert len(err.splitlines()) == 1, err
    create_tables(sqlite.engine)
    try:
        for redis_url, message in [
            ("redis://127.0.0.1:1/0", "cannot connect to Redis at redis://127.0.0.1:1/0"),
            ("http://127.0.0.1:6379", "not a Redis URL"),
            ("redis://app:s3cret@127.0.0.1:1/0", "cannot connect to Redis at redis://app:***@127.0.0.1:1/0"),
        ]:
            code, _, err = run(["relay", "--db", sqlite.url, "--redis", redis_url], capsys)
            assert code == EXIT_USAGE and message in err and len(err.splitlines()) == 1, err
            assert "s3cret" not in err
        code, _, err = run(["relay", "--db", sqlite.url, "--redis", REDIS_URL, "--batch", "10001"], capsys)
        assert code == EXIT_USAGE and "batch must be at most 10000" in err, err
    finally:
        drop_tables(sqlite.engine)
    assert redis_client.exists("sgtest-never-written") == 0
