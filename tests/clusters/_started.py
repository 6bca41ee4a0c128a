"""One way for a cluster suite to bring its cluster up once per module and down by pid after."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

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
