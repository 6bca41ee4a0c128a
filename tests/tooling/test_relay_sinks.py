"""``stateguard relay --sink rabbitmq|nats``: events published to a real RabbitMQ exchange or JetStream
stream until SIGTERM, and every option of the wrong sink, missing URL or broker set-up refused with exit 2."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from stateguard import create_tables, drop_tables, emit
from stateguard.tables import outbox
from stateguard.tooling.cli import EXIT_OK, EXIT_USAGE
from tests._support import brokers as _brokers
from tests._support.brokers import NATS_URL, RABBITMQ_URL
from tests.conftest import Backend
from tests.tooling._helpers import run


@pytest.fixture
def db(sqlite: Backend) -> Iterator[Backend]:
    """A SQLite database with stateguard's tables, dropped afterwards."""
    drop_tables(sqlite.engine)
    create_tables(sqlite.engine)
    yield sqlite
    drop_tables(sqlite.engine)


def _emit(engine: Engine, topic: str, n: int) -> list[int]:
    with Session(engine) as session, session.begin():
        return [emit(session, topic, {"i": i}, key=f"k{i % 3}") for i in range(n)]


def _unpublished(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).where(outbox.c.published_ms.is_(None))) or 0)


def _relay_until(argv: list[str], done: Callable[[], bool]) -> tuple[int, str]:
    """Run ``stateguard relay ARGV`` in a subprocess until ``done()``, then SIGTERM it: exit code, stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "stateguard", "relay", "--idle", "0.1", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not done():
            if proc.poll() is not None:
                pytest.fail(f"the relay exited {proc.returncode}: {proc.communicate()}")
            assert time.monotonic() < deadline, "the relay did not publish in 60 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


def test_relay_to_rabbitmq_publishes_every_event_and_stops_on_sigterm(db: Backend) -> None:
    """--sink rabbitmq --url --exchange --key-routing: every event in the queue once, marked, exit 0."""
    with _brokers.rabbit_queue(dead_letters=False) as mq:
        ids = _emit(db.engine, "order.paid", 12)
        argv = ["--db", db.url, "--sink", "rabbitmq", "--url", RABBITMQ_URL, "--exchange", mq.exchange]
        got: list[_brokers.Delivered] = []

        def done() -> bool:
            got.extend(mq.drain())
            return len(got) >= 12 and _unpublished(db.engine) == 0

        code, err = _relay_until([*argv, "--key-routing", "--batch", "5"], done)
        assert code == EXIT_OK, err
        assert f"publishing to the RabbitMQ exchange {mq.exchange!r}" in err
        assert "stopped by SIGTERM: 12 events published" in err and "Traceback" not in err
        assert sorted(int(m.properties.message_id) for m in got) == ids
        assert {m.routing_key for m in got} == {"k0", "k1", "k2"}
        assert all(m.properties.delivery_mode == 2 for m in got)


def test_relay_to_nats_publishes_every_event_and_stops_on_sigterm(db: Backend) -> None:
    """--sink nats --url --stream: every event stored once with its Nats-Msg-Id, marked, exit 0."""
    with _brokers.nats_stream() as js:
        ids = _emit(db.engine, js.topic(), 9)
        argv = ["--db", db.url, "--sink", "nats", "--url", NATS_URL, "--stream", js.name]
        code, err = _relay_until(argv, lambda: _unpublished(db.engine) == 0)
        assert code == EXIT_OK, err
        assert f"publishing to the JetStream stream {js.name!r}" in err
        assert "stopped by SIGTERM: 9 events published" in err and "Traceback" not in err
        assert sorted(int(m.headers["Nats-Msg-Id"]) for m in js.messages()) == ids


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sink", "kafka"], "invalid choice: 'kafka'"),
        (["--sink", "rabbitmq"], "required: --url for --sink rabbitmq"),
        (["--sink", "nats", "--url", NATS_URL], "required: --stream (JetStream) for --sink nats"),
        (
            ["--sink", "nats", "--url", NATS_URL, "--stream", "S", "--exchange", "x"],
            "--exchange is an option",
        ),
        (
            ["--sink", "rabbitmq", "--url", RABBITMQ_URL, "--stream", "s"],
            "--stream is an option of --sink redis",
        ),
        (
            ["--sink", "rabbitmq", "--url", RABBITMQ_URL, "--maxlen", "5"],
            "--maxlen is an option of --sink redis",
        ),
        (
            ["--sink", "rabbitmq", "--redis", "redis://127.0.0.1:6379/0"],
            "--redis is an option of --sink redis",
        ),
        (["--url", "redis://127.0.0.1:6379/0", "--subject", "a"], "--subject is an option of --sink nats"),
        (["--redis", "redis://127.0.0.1:6379/0", "--url", "redis://x"], "give the Redis URL once"),
        (["--sink", "rabbitmq", "--url", "redis://127.0.0.1:6379/0"], "needs an AMQP URL"),
        (
            ["--sink", "rabbitmq", "--url", RABBITMQ_URL, "--exchange", "é" * 200],
            "longer than 255 UTF-8 bytes",
        ),
        (["--sink", "nats", "--url", "amqp://x", "--stream", "S"], "servers must be a NATS URL"),
        (["--sink", "nats", "--url", NATS_URL, "--stream", "S", "--subject", "a.*"], "not a NATS subject"),
    ],
)
@pytest.mark.hostile
def test_relay_refuses_bad_sink_options_with_exit_2(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A wrong or missing sink option is one line and exit 2, before any database or broker is opened."""
    absent = f"sqlite:///{tmp_path / 'never-created.db'}"
    code, out, err = run(["relay", "--db", absent, *argv], capsys)
    assert code == EXIT_USAGE and out == ""
    assert message in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "never-created.db").exists()


def test_relay_refuses_an_unusable_broker_with_exit_2(
    db: Backend, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unreachable broker, a missing exchange or stream, a lease over the duplicate window: exit 2, one
    line naming the problem, nothing published."""
    base = ["relay", "--db", db.url]
    _emit(db.engine, "order.paid", 2)
    with _brokers.nats_stream(duplicate_window=10) as js:
        cases = [
            (
                ["--sink", "rabbitmq", "--url", "amqp://guest:s3cret@127.0.0.1:1/%2F"],
                "cannot connect to RabbitMQ",
            ),
            (
                ["--sink", "rabbitmq", "--url", RABBITMQ_URL, "--exchange", "sgtest-none"],
                "no exchange 'sgtest-none'",
            ),
            (["--sink", "nats", "--url", NATS_URL, "--stream", "SGTEST_NONE"], "no stream 'SGTEST_NONE'"),
            (
                ["--sink", "nats", "--url", NATS_URL, "--stream", js.name, "--lease", "30"],
                "lease (30 s) is longer than the duplicate_window",
            ),
        ]
        for argv, message in cases:
            code, out, err = run([*base, *argv], capsys)
            assert code == EXIT_USAGE and out == "" and message in err, err
            assert len(err.splitlines()) == 1 and "s3cret" not in err, err
        assert js.messages() == []
    assert _unpublished(db.engine) == 2
