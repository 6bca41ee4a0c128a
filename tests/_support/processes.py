"""Worker processes for the tests' races: forks of one fork server that imported their modules once.

A spawned worker is a fresh interpreter that imports SQLAlchemy, the drivers and
stateguard again (about half a second of CPU each, for 4 to 8 workers per storm);
a plain fork would copy the test process's pooled connections and threads.  The fork
server is a clean process started once per test run: each worker is a fork of it,
ready in milliseconds.  What a race measures starts at its barrier either way.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import BaseContext

#: What the workers import.  The server imports these once; a name that fails to import is
#: skipped by multiprocessing (the worker then imports it itself, as a spawned one would).
PRELOAD = [
    "sqlalchemy",
    "sqlalchemy.orm",
    "psycopg",
    "pymysql",
    "stateguard",
    "stateguard.redis",
    "tests._support.counter_workers",
    "tests._support.id_workers",
    "tests._support.idem_workers",
    "tests._support.lock_workers",
    "tests._support.outbox_workers",
    "tests._support.stock_workers",
    "tests._support.striped_workers",
    "tests._support.token_workers",
    "tests._support.workers",
    "tests._support.zk_workers",
    "tests.reliability._idem_storm",
    "tests.reliability._pipeline_workers",
    "tests.reliability._storm",
]


def worker_context() -> BaseContext:
    """The multiprocessing context every test that races processes starts them with."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
