"""Models and helpers of the one-time token and consume_once tests:
parcels, sweep orders, threads released together."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import DeclarativeBase, Session

from stateguard import (
    consume_token,
    issue_token,
)
from stateguard.tables import tokens

HOUR = timedelta(hours=1)
SHORT = timedelta(milliseconds=150)


class TokenBase(DeclarativeBase): ...


def _issue(engine: Engine, scope: str, ttl: timedelta = HOUR) -> str:
    with Session(engine) as session, session.begin():
        return issue_token(session, scope=scope, ttl=ttl)


def _consume(engine: Engine, token: str, scope: str, **kw: Any) -> Any:
    with Session(engine) as session, session.begin():
        return consume_token(session, token, scope=scope, **kw)


def _token_rows(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(tokens)).scalar_one())


def _run_threads(n: int, target: Callable[[int], Any]) -> list[Any]:
    """Run ``target(i)`` in ``n`` threads; each result, or the exception it raised."""
    results: list[Any] = [None] * n

    def run(i: int) -> None:
        try:
            results[i] = target(i)
        except BaseException as error:  # recorded: the test asserts on it
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a racing thread hung"
    return results


def _outcomes(results: list[Any]) -> Counter[str]:
    return Counter(r.outcome.name if hasattr(r, "outcome") else f"{type(r).__name__}: {r}" for r in results)
