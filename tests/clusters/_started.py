"""What the cluster suites share: bringing a cluster up once per module and down by pid after, and
fresh tables on its primary for each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

from sqlalchemy import MetaData, create_engine

import stateguard

from ..conftest import unavailable


class Startable(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


C = TypeVar("C", bound=Startable)


def started(what: str, why_not: Callable[[], str | None], make: Callable[[], C]) -> Iterator[C]:
    """Yield ``make()`` started; stop it afterwards, whatever the tests did to it.

    ``why_not()`` says why the cluster cannot run here (``None``: it can).  That,
    or a start that fails, skips loudly on a laptop and fails under ``CI=true``
    (:func:`tests.conftest.unavailable`), never passing quietly.
    """
    why = why_not()
    if why is not None:
        unavailable(what, RuntimeError(why))
    cluster = make()
    try:
        cluster.start()
    except Exception as exc:  # pragma: no cover - reported as skip (laptop) or failure (CI)
        cluster.stop()
        unavailable(what, exc)
    try:
        yield cluster
    finally:
        cluster.stop()


def fresh_tables(url: str, *metadata: MetaData) -> None:
    """Drop and create the tables of ``metadata`` and stateguard's own on the database at ``url``."""
    made = create_engine(url)
    try:
        for tables in metadata:
            tables.drop_all(made)
            tables.create_all(made)
        stateguard.drop_tables(made)
        stateguard.create_tables(made)
    finally:
        made.dispose()
