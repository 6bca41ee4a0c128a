"""Snowflake's arguments and lifecycle: namespaces differing only in case, space or normalisation are
separate, hostile namespaces and bad leases or epochs are InvalidArgument and write nothing, a
Session where the Engine belongs is refused, and close() is idempotent and frees every worker id."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session, sessionmaker

from stateguard import (
    InvalidArgument,
    Snowflake,
)
from stateguard.tables import worker_leases
from tests._support.snowflake_clocks import (
    WAIT,
    _parse,
    _row,
    _rows,
)


def _lease_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(worker_leases)).scalar_one())


# --------------------------------------------------------------------------
# namespaces and hostile input
# --------------------------------------------------------------------------


@pytest.mark.hostile
def test_namespaces_that_differ_only_in_case_space_or_normalisation_are_separate(engine: Engine) -> None:
    """Each namespace is its own worker-id space, compared exactly (no case folding, no trimming)."""
    names = ["orders", "Orders", "ORDERS", "orders ", " orders", "ordérs", "orde\u0301rs", "🦄" * 100]
    gens = [Snowflake(engine, namespace=n, heartbeat=False) for n in names]
    assert [g.worker_id for g in gens] == [0] * len(names)
    second = [Snowflake(engine, namespace=n, heartbeat=False) for n in names]
    assert [g.worker_id for g in second] == [1] * len(names)
    for n in names:
        rows = _rows(engine, n)
        assert [(r.namespace, r.worker_id) for r in rows] == [(n, 0), (n, 1)]
    for g in gens + second:
        g.close()
    assert _lease_count(engine) == 2 * len(names)


@pytest.mark.hostile
@pytest.mark.parametrize(
    "namespace",
    [
        "",
        " \t\n",
        "x" * 101,
        "🦄" * 101,
        "a\x00b",
        "\x00",
        "ns\ud800",
        "\udfff",
        b"orders",
        None,
        7,
        ["orders"],
    ],
    ids=[
        "empty",
        "blank",
        "101",
        "101emoji",
        "nul",
        "only-nul",
        "hi-surrogate",
        "lo-surrogate",
        "bytes",
        "none",
        "int",
        "list",
    ],
)
def test_hostile_namespaces_are_invalid_argument_and_write_nothing(engine: Engine, namespace: Any) -> None:
    with pytest.raises(InvalidArgument):
        Snowflake(engine, namespace=namespace, heartbeat=False)
    assert _lease_count(engine) == 0
    with Snowflake(engine, namespace="after", heartbeat=False) as ids:  # nothing left broken
        assert ids.worker_id == 0 and ids.next_id() > 0


@pytest.mark.hostile
def test_a_session_or_connection_where_the_engine_belongs_is_invalid_argument(engine: Engine) -> None:
    with Session(engine) as session:
        with pytest.raises(InvalidArgument):
            Snowflake(session, heartbeat=False)  # type: ignore[arg-type]
    with engine.connect() as conn, pytest.raises(InvalidArgument):
        Snowflake(conn, heartbeat=False)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        Snowflake(sessionmaker(engine), heartbeat=False)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        Snowflake(None, heartbeat=False)  # type: ignore[arg-type]
    assert _lease_count(engine) == 0


@pytest.mark.hostile
@pytest.mark.parametrize(
    "kwargs",
    [
        {"lease": timedelta(seconds=-60)},
        {"lease": timedelta(0)},
        {"lease": 60.0},
        {"lease": None},
        {"epoch_ms": -1},
        {"epoch_ms": True},
        {"epoch_ms": 1.5e12},
    ],
)
def test_bad_leases_and_epochs_are_invalid_argument(engine: Engine, kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        Snowflake(engine, heartbeat=False, **kwargs)
    assert _lease_count(engine) == 0


@pytest.mark.hostile
@pytest.mark.limits
def test_a_huge_lease_either_is_refused_or_works(engine: Engine) -> None:
    """``lease=timedelta.max``: InvalidArgument up front, or a generator whose heartbeat keeps running."""
    errors: list[Any] = []
    previous = threading.excepthook
    threading.excepthook = errors.append
    try:
        try:
            ids = Snowflake(engine, namespace="huge", lease=timedelta.max)
        except InvalidArgument:
            return
        try:
            assert ids.next_id() > 0
            assert ids._thread is not None
            ids._thread.join(0.2)
            assert ids._thread.is_alive(), f"the heartbeat thread died: {errors}"
        finally:
            ids.close()
    finally:
        threading.excepthook = previous
    assert errors == []


@pytest.mark.hostile
def test_close_is_idempotent_and_a_closed_generator_issues_nothing(engine: Engine) -> None:
    with Snowflake(engine, namespace="closed") as ids:
        last = ids.next_id()
    ids.close()
    ids.close()
    for _ in range(2):
        with pytest.raises(InvalidArgument):
            ids.next_id()
    row = _row(engine, "closed", ids.worker_id)
    assert row.owner is None
    # the exact last millisecond is kept for the next holder
    assert row.last_ms == _parse(last)[0]
    with Snowflake(engine, namespace="closed", heartbeat=False) as again:
        assert again.worker_id == ids.worker_id and again.next_id() > last


@pytest.mark.hostile
def test_closing_many_generators_concurrently_releases_every_worker_id(engine: Engine) -> None:
    """32 generators closed at the same moment from 32 threads (each twice): every row released."""
    n = 32
    gens = [Snowflake(engine, namespace="bulkclose") for _ in range(n)]
    barrier = threading.Barrier(n)

    def close(g: Snowflake) -> None:
        g.next_id()
        barrier.wait(WAIT)
        g.close()
        g.close()

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(close, gens))
    rows = _rows(engine, "bulkclose")
    assert len(rows) == n and all(r.owner is None for r in rows)
    again = [Snowflake(engine, namespace="bulkclose", heartbeat=False) for _ in range(n)]
    assert sorted(g.worker_id for g in again) == list(range(n))
    for g in again:
        g.close()
