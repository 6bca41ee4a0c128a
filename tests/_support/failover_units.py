"""Acknowledged units run against a PostgreSQL primary across a failover, and the count of what was lost.

One unit is one transaction that completes an idempotency key (``idempotent()``), consumes a message
(``consume_once``) and consumes a one-time token (``consume_token``); it is *acknowledged* when
``commit()`` returned.  After the failover every acknowledged unit runs again on the new primary
(:func:`count_losses`): one that survived answers replayed / REPEATED / REPEATED, one that was lost
answers APPLIED a second time (its token consumed twice).  Shared by the primary/standby tests and
the Patroni tests (tests/clusters/).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, create_engine, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from stateguard import Outcome, ReplicationTimeout, consume_once, consume_token, idempotent, issue_token

TOKEN_SCOPE = "pay"
LEASE = timedelta(seconds=30)
#: What a writer sees when its primary dies under it (the unit is then in doubt, not acknowledged).
CONNECTION_LOST = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.PendingRollbackError)


def multi_host_url(ports: list[int], database: str) -> str:
    """A libpq multi-host URL over ``ports`` of 127.0.0.1 that keeps the first host accepting writes."""
    hosts = "&".join(f"host=127.0.0.1:{port}" for port in ports)
    return f"postgresql+psycopg://postgres@/{database}?{hosts}&target_session_attrs=read-write"


def routing_engine(url: str, *, remote_apply: bool = False, local: bool = False) -> Engine:
    """An engine that connects to whichever listed host accepts writes."""
    connect_args: dict[str, Any] = {"connect_timeout": 3}
    if remote_apply:
        # The application asks for it: COMMIT returns once the synchronous standby has applied it.
        connect_args["options"] = "-c synchronous_commit=remote_apply"
    if local:
        # Only durable calls wait for the standby: every other COMMIT is acknowledged by the primary.
        connect_args["options"] = "-c synchronous_commit=local"
    return create_engine(url, pool_size=8, max_overflow=2, pool_pre_ping=True, connect_args=connect_args)


def server_port(engine: Engine) -> int:
    with engine.connect() as conn:
        port: int = conn.execute(text("SELECT inet_server_port()")).scalar_one()
        assert conn.execute(text("SELECT pg_is_in_recovery()")).scalar_one() is False
        return port


def issue_tokens(engine: Engine, n: int) -> list[str]:
    with Session(engine) as s, s.begin():
        return [issue_token(s, scope=TOKEN_SCOPE, ttl=timedelta(hours=1)) for _ in range(n)]


def unit(engine: Engine, n: int, token: str) -> None:
    """One acknowledged unit: an idempotency key completed, a message consumed once, a token consumed."""
    with Session(engine) as s:
        with idempotent(s, scope="charges", key=f"k{n}", lease=LEASE) as call:
            assert not call.replayed, f"unit {n} was replayed on its first run"
            assert consume_once(s, "billing", f"m{n}").applied
            assert consume_token(s, token, scope=TOKEN_SCOPE).outcome is Outcome.APPLIED
            call.complete({"n": n})
        s.commit()


def rerun(engine: Engine, n: int, token: str) -> tuple[bool, Outcome, Outcome]:
    """Unit ``n`` again: (replayed, consume_once outcome, consume_token outcome); committed."""
    with Session(engine) as s:
        with idempotent(s, scope="charges", key=f"k{n}", lease=LEASE) as call:
            replayed = call.replayed
            if not replayed:
                call.complete({"n": n})
        message = consume_once(s, "billing", f"m{n}").outcome
        consumed = consume_token(s, token, scope=TOKEN_SCOPE).outcome
        s.commit()
    return replayed, message, consumed


@dataclass
class Measured:
    """What a failover did to the acknowledged units."""

    acknowledged: list[int] = field(default_factory=list)
    in_doubt: int = 0
    lost: int = 0
    tokens_twice: int = 0
    messages_twice: int = 0
    blocks_twice: int = 0

    def line(self, scenario: str, label: str = "pg-replication") -> str:
        return (
            f"{label} | {scenario} | acknowledged {len(self.acknowledged)} | lost {self.lost} | "
            f"tokens consumed twice {self.tokens_twice} | messages twice {self.messages_twice} | "
            f"idempotent blocks twice {self.blocks_twice} | in doubt {self.in_doubt}"
        )


def storm(engine: Engine, tokens: list[str], *, writers: int, kill_after: int, kill: Any) -> Measured:
    """``writers`` threads run units until ``kill()`` (called after ``kill_after`` acks) ends the primary."""
    measured = Measured()
    lock = threading.Lock()
    killed = threading.Event()
    numbers = iter(range(len(tokens)))
    barrier = threading.Barrier(writers + 1)
    errors: list[BaseException] = []

    def write() -> None:
        barrier.wait()
        while True:
            with lock:
                n = next(numbers, None)
            if n is None:
                return
            try:
                unit(engine, n, tokens[n])
            except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.PendingRollbackError) as exc:
                if not killed.is_set():
                    errors.append(exc)
                with lock:
                    measured.in_doubt += 1  # the primary died before or while it answered
                return
            except BaseException as exc:  # reported by the test
                errors.append(exc)
                return
            with lock:
                measured.acknowledged.append(n)

    threads = [threading.Thread(target=write) for _ in range(writers)]
    for t in threads:
        t.start()
    barrier.wait()
    deadline = time.monotonic() + 60
    while len(measured.acknowledged) < kill_after and time.monotonic() < deadline and not errors:
        time.sleep(0.005)
    killed.set()
    kill()
    for t in threads:
        t.join(timeout=60)
    assert errors == [], errors
    assert len(measured.acknowledged) >= kill_after, "the writers ran out of units before the kill"
    return measured


def count_losses(engine: Engine, tokens: list[str], measured: Measured) -> Measured:
    """Rerun every acknowledged unit on the new primary; each one survived whole or was lost whole."""
    for n in measured.acknowledged:
        replayed, message, consumed = rerun(engine, n, tokens[n])
        kept = (True, Outcome.REPEATED, Outcome.REPEATED)
        gone = (False, Outcome.APPLIED, Outcome.APPLIED)
        assert (replayed, message, consumed) in (kept, gone), (
            f"unit {n} survived in part: {message, consumed}"
        )
        if (replayed, message, consumed) == gone:
            measured.lost += 1
            measured.tokens_twice += 1
            measured.messages_twice += 1
            measured.blocks_twice += 1
    return measured


@dataclass
class Timed:
    """Units of a storm that ran for a while: (unit number, when its transaction began, when acked)."""

    acknowledged: list[tuple[int, float, float]] = field(default_factory=list)
    in_doubt: int = 0
    #: Units whose commit raised ReplicationTimeout: committed on the primary, not acknowledged.
    unconfirmed: list[int] = field(default_factory=list)


def timed_storm(
    engine: Engine,
    tokens: list[str],
    *,
    writers: int,
    stop: threading.Event,
    errors: list[BaseException],
    pause: float = 0.03,
) -> tuple[Timed, Callable[[], None]]:
    """Start ``writers`` threads running units until ``stop`` is set; returns (record, join).

    Each writer waits ``pause`` seconds between its units, so the tokens last however long the
    storm runs on a fast machine and the reruns that count the losses stay few.

    A writer whose unit fails to connect or loses its connection counts it in doubt and goes on
    (the primary it reached may be gone; the next unit connects anew); a unit whose commit the
    standby did not confirm (ReplicationTimeout) is counted unconfirmed.  Any other error is put in
    ``errors`` for the test to report.
    """
    timed = Timed()
    lock = threading.Lock()
    numbers = iter(range(len(tokens)))

    def write() -> None:
        while not stop.is_set():
            with lock:
                n = next(numbers, None)
            if n is None:
                return
            began = time.monotonic()
            try:
                unit(engine, n, tokens[n])
            except CONNECTION_LOST:
                with lock:
                    timed.in_doubt += 1
                time.sleep(0.02)
                continue
            except ReplicationTimeout:
                with lock:
                    timed.unconfirmed.append(n)
                continue
            except BaseException as exc:  # reported by the test
                errors.append(exc)
                return
            with lock:
                timed.acknowledged.append((n, began, time.monotonic()))
            time.sleep(pause)

    threads = [threading.Thread(target=write, daemon=True) for _ in range(writers)]
    for t in threads:
        t.start()

    def join() -> None:
        stop.set()
        for t in threads:
            t.join(timeout=60)

    return timed, join
