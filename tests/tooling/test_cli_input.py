"""The command line's checks of its arguments: a value the command, Python or a server cannot take
ends the command with exit 2 and one line saying what was wrong, before anything is written."""

from __future__ import annotations

import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, MetaData, create_engine, insert, select
from sqlalchemy.orm import Session

from stateguard import CallableSink, InvalidArgument, Relay, create_tables, emit
from stateguard.outbox.sinks.redis_streams import RedisStreamSink
from stateguard.tables import outbox
from stateguard.tooling.cli import EXIT_OK, EXIT_USAGE, main
from tests.conftest import Backend

pytestmark = pytest.mark.hostile

#: A Redis nobody listens on: a relay given it stops at "cannot connect" if its arguments passed.
DEAD_REDIS = "redis://127.0.0.1:1/0"
#: What ``os.fsdecode`` makes of the bytes 0x80-0xFF that are not UTF-8 (PEP 383).
SURROGATES = [chr(0xDC00 + b) for b in range(0x80, 0x100)]
BIGINT = 2**63 - 1

_TAG = uuid.uuid4().hex[:8]
#: Model modules written for this file: rows (a plain and a composite key), one calling
#: sys.exit() at import, one raising an exception with a message of several lines.
ROWS, EXITS, RAISES = f"sgcli_rows_{_TAG}", f"sgcli_exits_{_TAG}", f"sgcli_raises_{_TAG}"

_ROWS_SOURCE = f"""
from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from stateguard import StateMachine


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "sgcli_orders_{_TAG}"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="new")
    flow = StateMachine("status", states=["new", "done"], transitions=[["finish", "new", "done"]])


class Line(Base):
    __tablename__ = "sgcli_lines_{_TAG}"
    order_id: Mapped[int] = mapped_column(primary_key=True)
    part: Mapped[str] = mapped_column(String(20), primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="new")
    flow = StateMachine("status", states=["new", "done"], transitions=[["finish", "new", "done"]])
"""


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A SQLite file with stateguard's tables, the models' tables and rows a purge would delete."""
    folder = tmp_path_factory.mktemp("cli_input")
    (folder / f"{ROWS}.py").write_text(textwrap.dedent(_ROWS_SOURCE))
    (folder / f"{EXITS}.py").write_text("import sys\n\nsys.exit(3)\n")
    (folder / f"{RAISES}.py").write_text("raise RuntimeError('first line\\nsecond line')\n")
    sys.path.insert(0, str(folder))
    url = f"sqlite:///{folder / 'app.db'}"
    engine = create_engine(url)
    try:
        create_tables(engine)
        rows = __import__(ROWS)
        rows.Base.metadata.create_all(engine)
        long_ago = time.time_ns() // 1_000_000 - 400 * 24 * 3_600_000
        with engine.begin() as conn:
            conn.execute(insert(rows.Order), [{"id": 1}, {"id": 2, "status": "done"}])
            conn.execute(insert(rows.Line), [{"order_id": 1, "part": "a"}])
            conn.execute(
                insert(outbox),
                [
                    {
                        "topic": "t",
                        "payload": "{}",
                        "created_ms": long_ago,
                        "attempts": 1,
                        "published_ms": long_ago,
                    }
                ],
            )
        with Session(engine) as session, session.begin():
            emit(session, "order.paid", {"id": 1}, key="order-1")
    finally:
        engine.dispose()
    yield url
    sys.path.remove(str(folder))


def _contents(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table in the database at ``url``."""
    engine = create_engine(url)
    try:
        found = MetaData()
        found.reflect(engine)
        with engine.connect() as conn:
            return {name: sorted(map(tuple, conn.execute(select(t)))) for name, t in found.tables.items()}
    finally:
        engine.dispose()


def _complaint(command: str, err: str) -> str:
    """The one line of ``err`` saying what was wrong (argparse's usage lines before it aside)."""
    assert "Traceback" not in err, err
    lines = err.splitlines()
    if lines and lines[0].startswith("usage: "):
        # argparse: its usage (wrapped lines indented), then exactly one line with the reason.
        said = [line for line in lines[1:] if not line.startswith(" ")]
        assert len(said) == 1 and said[0] == lines[-1], err
        assert said[0].startswith(f"stateguard {command}: error: "), err
        return said[0]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"stateguard {command}: "), err
    assert "unexpected" not in lines[0], err  # the last-resort catch must not be what caught it
    return lines[0]


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], db: str) -> str:
    """Run ``stateguard ARGV``: exit 2, nothing on stdout, one line on stderr, the database as it
    was; that line."""
    before = _contents(db)
    code = main(argv)
    captured = capsys.readouterr()
    assert code == EXIT_USAGE, (code, captured)
    assert captured.out == "", captured
    line = _complaint(argv[0], captured.err)
    assert _contents(db) == before
    return line


# --------------------------------------------------------------------------
# --maxlen: what Redis's XADD takes
# --------------------------------------------------------------------------


@pytest.mark.limits
@pytest.mark.parametrize("maxlen", [str(10**23), str(BIGINT + 1), "0", "-1"])
def test_relay_refuses_a_maxlen_redis_refuses(
    maxlen: str, db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``relay --maxlen`` past 2**63-1 (Redis refuses every XADD with it) is exit 2 naming the range."""
    line = _refused(["relay", "--db", db, "--redis", DEAD_REDIS, "--maxlen", maxlen], capsys, db)
    assert "argument --maxlen" in line and "at most 9223372036854775807" in line, line


@pytest.mark.limits
def test_relay_takes_the_largest_maxlen_redis_takes(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``relay --maxlen 9223372036854775807`` passes the checks (it then stops at the dead Redis)."""
    line = _refused(["relay", "--db", db, "--redis", DEAD_REDIS, "--maxlen", str(BIGINT)], capsys, db)
    assert "cannot connect to Redis" in line, line


@pytest.mark.limits
def test_stream_sink_maxlen_is_what_redis_takes(redis_client: Any) -> None:
    """Redis takes XADD MAXLEN up to 2**63-1 and refuses more; RedisStreamSink refuses more too."""
    import redis

    stream = f"sgtest-maxlen-{uuid.uuid4().hex[:12]}"
    try:
        redis_client.xadd(stream, {"f": "v"}, maxlen=BIGINT)
        with pytest.raises(redis.ResponseError, match="out of range"):
            redis_client.xadd(stream, {"f": "v"}, maxlen=BIGINT + 1)
        for maxlen in (BIGINT + 1, 10**23):
            with pytest.raises(InvalidArgument, match="from 1 to 9223372036854775807"):
                RedisStreamSink(redis_client, stream=stream, maxlen=maxlen)
        sink = RedisStreamSink(redis_client, stream=stream, maxlen=BIGINT)
        assert sink.maxlen == BIGINT
    finally:
        redis_client.delete(stream)


# --------------------------------------------------------------------------
# URLs
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("postgresql+psycopg://postgres@127.0.0.1:notaport/test", "the port is not a number"),
        ("postgresql+psycopg://postgres@[::1/test", "the port is not a number"),
        ("mysql+pymysql://root@127.0.0.1:0/test", "the port must be from 1 to 65535"),
        ("postgresql+psycopg://postgres@127.0.0.1:65536/test", "the port must be from 1 to 65535"),
    ],
)
@pytest.mark.parametrize("command", ["purge", "inspect", "relay", "check", "demo"])
def test_a_database_url_whose_port_does_not_parse_is_refused(
    url: str, said: str, command: str, db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --db port that is not a number, or outside 1-65535, is exit 2 before connecting."""
    argv = {
        "purge": ["purge", "--db", url],
        "inspect": ["inspect", "--db", url],
        "relay": ["relay", "--db", url, "--redis", DEAD_REDIS],
        "check": ["check", ROWS, "--db", url],
        "demo": ["demo", "--db", url],
    }[command]
    line = _refused(argv, capsys, db)
    assert "not a database URL" in line and said in line, line


@pytest.mark.parametrize(
    ("query", "said"),
    [
        ("?timeout=abc", "could not convert string to float"),
        ("?check_same_thread=maybe", "not true/false"),
    ],
)
def test_a_database_url_argument_the_driver_cannot_take_is_refused(
    query: str, said: str, db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A URL query argument the dialect cannot convert is exit 2 with the driver's reason."""
    line = _refused(["purge", "--db", db + query], capsys, db)
    assert said in line, line


def test_a_sqlite_path_too_long_for_the_file_system_is_refused(
    db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A SQLite file name longer than the file system takes is exit 2, not an OSError."""
    line = _refused(["inspect", "--db", f"sqlite:///{'a' * 5000}.db"], capsys, db)
    assert "cannot use the SQLite file" in line and "too long" in line, line


@pytest.mark.parametrize(
    ("redis_url", "said"),
    [
        ("redis://127.0.0.1:1/x", "the database 'x' is not a number"),
        ("redis://[::1/0", "Invalid IPv6 URL"),
    ],
)
def test_a_redis_url_that_does_not_parse_is_refused(
    redis_url: str, said: str, db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Redis URL whose database is not a number (redis-py would use 0) or that does not split is exit 2."""
    line = _refused(["relay", "--db", db, "--redis", redis_url], capsys, db)
    assert "not a Redis URL" in line and said in line, line


# --------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------


@pytest.mark.limits
@pytest.mark.parametrize("value", ["inf", "nan", "1e12", "1e400", "1000001"])
@pytest.mark.parametrize("option", ["--outbox-retention", "--consumed-retention"])
def test_purge_retentions_past_their_range_are_refused(
    option: str, value: str, db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A retention that timedelta cannot hold (inf, 1e12 hours) or past 1,000,000 hours is exit 2."""
    line = _refused(["purge", "--db", db, option, value], capsys, db)
    assert f"argument {option}" in line and "at most 1000000 (hours)" in line, line


@pytest.mark.limits
@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "--stale", "inf"],
        ["inspect", "--stale", "1e12"],
        ["relay", "--redis", DEAD_REDIS, "--lease", "inf"],
        ["relay", "--redis", DEAD_REDIS, "--lease", "1e12"],
        ["relay", "--redis", DEAD_REDIS, "--idle", "1e12"],
        ["relay", "--redis", DEAD_REDIS, "--idle", "1000000000.5"],
        ["purge", "--pause", "1e10"],
        ["purge", "--pause", "nan"],
    ],
)
def test_durations_past_their_range_are_refused(
    argv: list[str], db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--stale, --lease, --idle and --pause past 1e9 seconds (time.sleep and threading's waits
    overflow near 9.2e9) or not finite are exit 2 naming the range."""
    line = _refused([argv[0], "--db", db, *argv[1:]], capsys, db)
    assert f"argument {argv[-2]}" in line and "at most 1000000000 (seconds)" in line, line


@pytest.mark.limits
@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "--limit", str(10**23)],
        ["purge", "--batch", str(BIGINT + 1)],
        ["purge", "--max-batches", str(10**23)],
        ["relay", "--redis", DEAD_REDIS, "--batch", str(10**23)],
        ["purge", "--batch", "9" * 5000],
    ],
)
def test_counts_past_a_bigint_are_refused(
    argv: list[str], db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--limit, --batch and --max-batches past 2**63-1 (SQLite's driver overflows) are exit 2."""
    line = _refused([argv[0], "--db", db, *argv[1:]], capsys, db)
    assert f"argument {argv[-2]}" in line, line


@pytest.mark.parametrize(("option", "value"), [("--workers", "100000"), ("--orders", str(10**7))])
def test_demo_sizes_past_their_range_are_refused(
    option: str, value: str, db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """demo --workers past 1000 and --orders past 1,000,000 are exit 2 before the demo starts."""
    # The folder does not exist: were the value taken, the demo would stop at once, not run.
    line = _refused(
        ["demo", "--db", "sqlite:////nonexistent-stateguard-dir/demo.db", option, value], capsys, db
    )
    assert f"argument {option}" in line and "at most" in line, line


@pytest.mark.limits
def test_the_largest_durations_work_on_every_database(
    backend: Backend, engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """The largest retentions, staleness and lease the CLI takes are ones each database computes with."""
    argv = ["purge", "--db", backend.url, "--outbox-retention", "1000000", "--consumed-retention", "1000000"]
    assert main(argv) == EXIT_OK, capsys.readouterr()
    assert main(["inspect", "--db", backend.url, "--stale", "1000000000", "--limit", str(BIGINT)]) == EXIT_OK
    capsys.readouterr()
    with Session(engine) as session, session.begin():
        emit(session, "t", {})
    published: list[int] = []
    relay = Relay(
        engine,
        CallableSink(lambda events: published.extend(e.id for e in events)),
        lease=timedelta(seconds=1e9),
    )
    assert relay.run_once() == 1 and len(published) == 1


# --------------------------------------------------------------------------
# Text, JSON and model modules
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "--db", "{db}", "--ref", "order-\udcff"],
        ["inspect", "--db", "{db}", "--models", ROWS, "--row", "Order:\udcfe\udcff"],
        ["inspect", "--db", "{db}", "--models", f"{ROWS}\udcff"],
        ["inspect", "--db", "{db}", "--ref", "nul\x00byte"],
        ["relay", "--db", "{db}", "--redis", DEAD_REDIS, "--stream", "s\udc80"],
        ["relay", "--db", "{db}", "--redis", DEAD_REDIS, "--topic", "t\udc80"],
        ["relay", "--db", "{db}", "--redis", "redis://127.0.0.1:1/0\udcff"],
        ["purge", "--db", "sqlite:///app\udcff.db"],
        ["graph", f"{ROWS}:Order", "-o", "flow\udcff.mmd"],
    ],
)
def test_text_that_is_not_utf8_is_refused(
    argv: list[str], db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Non-UTF-8 bytes on the command line (lone surrogates after os.fsdecode) or a NUL are exit 2."""
    line = _refused([db if a == "{db}" else a for a in argv], capsys, db)
    assert "not valid UTF-8" in line or "contains a NUL character" in line, line


def test_a_composite_row_key_nested_deeply_is_refused(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--row`` JSON nested 100,000 deep is exit 2 (json.loads raised RecursionError)."""
    line = _refused(["inspect", "--db", db, "--models", ROWS, "--row", "Line:" + "[" * 100_000], capsys, db)
    assert "nested too deeply" in line, line


@pytest.mark.limits
@pytest.mark.parametrize("row", ["Order:99999999999999999999", 'Line:[-99999999999999999999, "a"]'])
def test_a_row_key_past_the_databases_integers_is_refused(
    row: str, db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``--row`` key past SQLite's 64-bit INTEGER is exit 2 (its driver raised OverflowError)."""
    line = _refused(["inspect", "--db", db, "--models", ROWS, "--row", row], capsys, db)
    assert "database error" in line and "too large" in line, line


@pytest.mark.parametrize(
    "argv",
    [
        ["check", EXITS],
        ["inspect", "--models", EXITS],
        ["graph", f"{EXITS}:Order"],
    ],
)
def test_a_models_module_that_exits_at_import_is_refused(
    argv: list[str], db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A models module calling sys.exit(3) at import is exit 2 naming the module, not exit 3 in silence."""
    if argv[0] == "inspect":
        argv = ["inspect", "--db", db, *argv[1:]]
    line = _refused(argv, capsys, db)
    assert f"cannot import {EXITS}: it called sys.exit(3) while importing" in line, line


def test_a_models_module_failing_with_a_long_message_is_one_line(
    db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An exception of several lines at import is reported by its first line only."""
    line = _refused(["check", RAISES], capsys, db)
    assert line.endswith(f"cannot import {RAISES}: RuntimeError: first line"), line


# --------------------------------------------------------------------------
# Every command's options, hostile values
# --------------------------------------------------------------------------

_hostile_text = st.tuples(
    st.text(max_size=12), st.sampled_from([*SURROGATES, "\x00"]), st.text(max_size=12)
).map("".join)


def _hostile_numbers(least: float, most: float) -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(
            ["inf", "-inf", "nan", "-nan", "1e400", "1e12", "", "x", "1e", "0x10", "1,5", "\u0661e99"]
        ),
        st.one_of(
            st.floats(max_value=least, exclude_max=True), st.floats(min_value=most, exclude_min=True)
        ).map(repr),
        st.integers(max_value=int(least) - 1).map(str),
        st.integers(min_value=int(most) + 1).map(str),
    )


def _hostile_counts(most: int) -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(["1.5", "1e3", "inf", "nan", "", "x", "9" * 5000, str(2**64), "0"]),
        st.integers(max_value=0).map(str),
        st.integers(min_value=most + 1, max_value=10**30).map(str),
    )


_hostile_db = st.one_of(
    _hostile_text.map(lambda t: f"sqlite:///{t}.db"),
    st.sampled_from(
        [
            "postgresql+psycopg://postgres@127.0.0.1:notaport/test",
            "postgresql+psycopg://postgres@[::1/test",
            "mysql+pymysql://root@127.0.0.1:0/test",
            "postgresql+psycopg://u@h:99999/d",
            "not a url",
            "nosuchdb://x/y",
            "sqlite://",
            f"sqlite:///{'a' * 5000}.db",
            "sqlite:///no/such/folder/app.db",
        ]
    ),
)
_hostile_redis = st.one_of(
    _hostile_text.map(lambda t: f"redis://127.0.0.1:1/{t}"),
    st.sampled_from(
        [
            "redis://127.0.0.1:notaport/0",
            "redis://127.0.0.1:99999/0",
            "redis://[::1/0",
            "redis://127.0.0.1:1/x",
            "http://127.0.0.1:1",
            "",
        ]
    ),
)
_hostile_module = st.one_of(
    _hostile_text, st.sampled_from([EXITS, RAISES, "no_such_module_sg", "bad name", ""])
)
_seconds = _hostile_numbers(0.001, 1e9)
_hours = _hostile_numbers(0.001, 1e6)
_hostile_row = st.one_of(
    st.integers(1000, 100_000).map(lambda n: "Line:" + "[" * n),
    st.integers(2**63, 10**30).map(lambda n: f"Order:{n}"),
    _hostile_text.map(lambda t: f"Order:{t}"),
)

#: Per command: the arguments it needs, and a hostile value for each of its options.
COMMANDS: dict[str, tuple[list[str], dict[str, st.SearchStrategy[str]]]] = {
    "demo": (
        ["demo", "--db", "{db}"],
        {
            "--db": _hostile_db,
            "--workers": _hostile_counts(1000),
            "--orders": _hostile_counts(1_000_000),
            "--seed": st.sampled_from(["1.5", "x", "", "inf", "9" * 5000]),
            "--schema": st.one_of(_hostile_text, st.sampled_from(["Bad Name", "x" * 49, "1abc", ""])),
            "--html": _hostile_text,
            "--redis": _hostile_redis,
        },
    ),
    "graph": (
        ["graph"],
        {
            "": st.one_of(_hostile_module.map(lambda m: f"{m}:Order"), _hostile_text),
            "--machine": _hostile_text,
            "--format": st.sampled_from(["gif", "", "\udcff"]),
            "--output": _hostile_text,
        },
    ),
    "check": (["check"], {"": _hostile_module, "--db": _hostile_db}),
    "purge": (
        ["purge", "--db", "{db}"],
        {
            "--db": _hostile_db,
            "--batch": _hostile_counts(BIGINT),
            "--pause": _hostile_numbers(0.0, 1e9),
            "--max-batches": _hostile_counts(BIGINT),
            "--outbox-retention": _hours,
            "--consumed-retention": _hours,
            "--only": st.sampled_from(["nothing", "", "keys\udcff"]),
        },
    ),
    "relay": (
        ["relay", "--db", "{db}", "--redis", DEAD_REDIS],
        {
            "--db": _hostile_db,
            "--redis": _hostile_redis,
            "--topic": _hostile_text,
            "--stream": _hostile_text,
            "--maxlen": _hostile_counts(BIGINT),
            "--batch": _hostile_counts(BIGINT),
            "--lease": _seconds,
            "--idle": _seconds,
        },
    ),
    "inspect": (
        ["inspect", "--db", "{db}", "--models", ROWS],
        {
            "--db": _hostile_db,
            "--models": _hostile_module,
            "--output": _hostile_text,
            "--row": _hostile_row,
            "--ref": _hostile_text,
            "--stale": _seconds,
            "--limit": _hostile_counts(BIGINT),
            "--format": st.sampled_from(["gif", "", "\udcff"]),
        },
    ),
}


@st.composite
def hostile_argv(draw: st.DrawFn) -> list[str]:
    """A command with what it needs, then one to three of its options given a hostile value."""
    command = draw(st.sampled_from(sorted(COMMANDS)))
    base, options = COMMANDS[command]
    argv = list(base)
    picked = draw(st.lists(st.sampled_from(sorted(options)), min_size=1, max_size=3, unique=True))
    positional = "" in options and "" not in picked
    for option in picked:
        value = draw(options[option])
        argv += [value] if option == "" else [option, value]
    if positional:
        argv.insert(1, ROWS if command == "check" else f"{ROWS}:Order")
    return argv


@pytest.mark.hostile
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(argv=hostile_argv())
@example(argv=["relay", "--db", "{db}", "--redis", DEAD_REDIS, "--maxlen", str(10**23)])
@example(argv=["purge", "--db", "{db}", "--outbox-retention", "inf"])
@example(argv=["purge", "--db", "{db}", "--consumed-retention", "1e12"])
@example(argv=["inspect", "--db", "{db}", "--models", ROWS, "--stale", "1e12"])
@example(argv=["relay", "--db", "{db}", "--redis", DEAD_REDIS, "--lease", "inf"])
@example(argv=["purge", "--db", "postgresql+psycopg://postgres@127.0.0.1:notaport/test"])
@example(argv=["inspect", "--db", "{db}", "--models", ROWS, "--ref", "\udcff\udcfe"])
@example(argv=["inspect", "--db", "{db}", "--models", ROWS, "--row", "Line:" + "[" * 100_000])
@example(argv=["check", EXITS])
@example(argv=["inspect", "--db", "{db}", "--models", ROWS, "--limit", str(10**23)])
@example(argv=["relay", "--db", "{db}", "--redis", "redis://[::1/0"])
@example(argv=["purge", "--db", "sqlite:///x.db?timeout=abc"])
def test_every_hostile_option_value_is_one_line_and_exit_2(
    argv: list[str], db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Any command given hostile option values (huge, infinite, negative, not UTF-8, deeply nested,
    malformed URLs, modules that exit) ends with exit 2, one line, no traceback, nothing written."""
    _refused([db if a == "{db}" else a for a in argv], capsys, db)
