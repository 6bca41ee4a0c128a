"""``stateguard demo``: a storm of retried, redelivered and double-clicked requests.

The demo works in its own namespace (:mod:`.namespace`: a PostgreSQL schema,
a MariaDB/MySQL database or a SQLite file, dropped after the run unless
``--keep``), creates its tables there (:mod:`.models` and stateguard's own),
then fires each logical request 2-4 times from many worker threads
(:mod:`.storm`), first through the code people usually write, then through
stateguard.  Each scheme is one module of :mod:`.scenarios`; the result table
is :mod:`.render`'s.  The invariant, counted in the database afterwards:
*side effects == APPLIED, at most one per (order, trigger)*.  How the storm
and the scenarios work, and how to add one: ``docs/explanation/demo.md``::

    report = run_demo(namespace.engine, orders=50)
    print(render(report))
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine, create_engine

from ..._kernel import backend
from ..terminal import Progress
from . import scenarios as scenarios
from .models import DemoBase, DemoInbox, DemoOrder, DemoPlainInbox, DemoSideEffect, DemoStock
from .namespace import (
    DEFAULT_SCHEMA,
    MARKER_TABLE,
    DemoNamespace,
    DemoNamespaceTaken,
    check_schema_name,
    namespace_url,
    open_namespace,
)
from .render import COLUMNS, damage_text, explanations, render
from .results import HAND_WRITTEN, STATEGUARD, Delivery, DemoReport, Request, SchemeRow, Tally
from .scenarios.http_retry_storm import DEMO_KEY_SCOPE, HttpAnswer, asgi_request
from .scenarios.outbox_pipeline import PIPELINE_SCOPE, PIPELINE_TOPICS
from .storm import SCENARIOS, DemoRun, Scenario, scenario

__all__ = [
    "COLUMNS",
    "DEFAULT_SCHEMA",
    "DEMO_KEY_SCOPE",
    "HAND_WRITTEN",
    "MARKER_TABLE",
    "PIPELINE_SCOPE",
    "PIPELINE_TOPICS",
    "SCENARIOS",
    "STATEGUARD",
    "Delivery",
    "DemoBase",
    "DemoInbox",
    "DemoNamespace",
    "DemoNamespaceTaken",
    "DemoOrder",
    "DemoPlainInbox",
    "DemoReport",
    "DemoRun",
    "DemoSideEffect",
    "DemoStock",
    "HttpAnswer",
    "Progress",
    "Request",
    "Scenario",
    "SchemeRow",
    "Tally",
    "asgi_request",
    "check_schema_name",
    "damage_text",
    "explanations",
    "hand_written_engine",
    "namespace_url",
    "open_namespace",
    "render",
    "run_demo",
    "scenario",
]


def run_demo(
    engine: Engine,
    *,
    workers: int = 8,
    orders: int = 120,
    seed: int | None = None,
    progress: Progress | None = None,
    scenarios: Sequence[Scenario] | None = None,
    redis: Any = None,
) -> DemoReport:
    """Drop and create the ``sg_demo_*`` tables on ``engine`` and run every scenario.

    ``engine`` should see only the demo's own namespace (:func:`open_namespace`;
    ``stateguard demo`` does that): the scenarios also create stateguard's
    tables there::

        report = run_demo(sqlite_engine("sqlite:///demo.db"), orders=50)
        print(render(report))
        if not report.ok:
            raise SystemExit(1)
    """
    if workers < 1 or orders < 1:
        raise ValueError("workers and orders must be at least 1")
    if seed is None:
        seed = random.SystemRandom().randrange(1, 100_000)
    progress = progress or Progress()
    chosen = list(SCENARIOS if scenarios is None else scenarios)
    started = time.monotonic()
    DemoBase.metadata.drop_all(engine)
    DemoBase.metadata.create_all(engine)
    naive = hand_written_engine(engine, workers)
    run = DemoRun(engine, workers, orders, random.Random(seed), progress, redis=redis, naive_engine=naive)
    rows: list[SchemeRow] = []
    try:
        for i, sc in enumerate(chosen, 1):
            progress.begin(i, len(chosen), sc.title)
            new = sc.fn(run)
            progress.end(new)
            rows.extend(new)
    finally:
        if naive is not None:
            naive.dispose()
    progress.done()
    here = backend(engine.dialect)
    return DemoReport(
        rows=rows,
        seed=seed,
        workers=workers,
        orders=orders,
        url=engine.url.render_as_string(hide_password=True),
        elapsed=time.monotonic() - started,
        notes=run.notes,
        # The MySQL family's notes are MariaDB's (the server the demo is run on).
        dialect="mariadb" if here.family == "mysql" else here.name,
    )


def hand_written_engine(engine: Engine, workers: int) -> Engine | None:
    """The engine of the hand-written variants: on SQLite a plain ``create_engine()``, else ``None``.

    On SQLite most applications use SQLAlchemy's default engine, where the
    driver (pysqlite) opens the transaction only at the first write: the
    ``SELECT`` of a load-check-save reads outside the transaction that
    writes, as it does on PostgreSQL at READ COMMITTED.  stateguard runs on
    the demo's :func:`~stateguard.sqlite_engine` (real BEGINs), on which the
    same hand-written code is refused at its first write whenever its read
    went stale, and re-run.
    """
    if not backend(engine.dialect).driver_begins_lazily:
        return None
    return create_engine(engine.url, pool_size=workers, max_overflow=workers, connect_args={"timeout": 60})
