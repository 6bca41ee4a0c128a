"""Workers for the outbox relay tests (importable by spawned processes).

A relay worker runs a :class:`~stateguard.Relay` whose sink records every
batch it gets, as the outside world would see it, in a shared (manager)
list: ``(relay name, event id, key, time.time_ns())`` per event.
"""

from __future__ import annotations

import random
import time
from datetime import timedelta
from typing import Any

from sqlalchemy import create_engine, func, select

from stateguard import CallableSink, Relay
from stateguard.tables import outbox


def make_engine(name: str, url: str) -> Any:
    kw: dict[str, Any] = {"pool_size": 2}
    if name == "sqlite":
        kw["connect_args"] = {"timeout": 60}
    return create_engine(url, **kw)


def recording_sink(seen: Any, relay_name: str, jitter_s: float = 0.0) -> CallableSink:
    """A sink that records each batch in ``seen`` (one list per batch) and takes up to ``jitter_s``."""

    def publish(events: Any) -> None:
        if jitter_s:
            time.sleep(random.uniform(0, jitter_s))  # interleaving, not security
        seen.append([(relay_name, e.id, e.key, time.time_ns()) for e in events])

    return CallableSink(publish)


def pending(engine: Any) -> int:
    """How many events are not published yet."""
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).where(outbox.c.published_ms.is_(None))).scalar_one())


def relay_until_done(
    engine: Any,
    barrier: Any,
    seen: Any,
    relay_name: str,
    batch: int,
    jitter_s: float,
    hold: str | None = None,
) -> int:
    """Wait at the barrier, then run batches until no event is left unpublished; return its count."""
    relay = Relay(
        engine,
        recording_sink(seen, relay_name, jitter_s),
        batch=batch,
        lease=timedelta(seconds=60),
        hold=hold,
    )
    barrier.wait()
    total = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        published = relay.run_once()
        total += published
        if published == 0:
            if pending(engine) == 0:
                return total
            time.sleep(0.005)
    raise TimeoutError(f"{relay_name}: events still unpublished after 120 s")


def relay_in_process(
    name: str,
    url: str,
    barrier: Any,
    seen: Any,
    relay_name: str,
    batch: int,
    jitter_s: float,
    hold: str | None = None,
) -> int:
    """:func:`relay_until_done` in a spawned process, with its own engine."""
    engine = make_engine(name, url)
    try:
        return relay_until_done(engine, barrier, seen, relay_name, batch, jitter_s, hold)
    finally:
        engine.dispose()


def publish_then_hang(
    name: str, url: str, lease_s: float, seen: Any, published: Any, hold: str | None = None
) -> None:
    """Claim and publish one batch, then hang before marking it (the test SIGKILLs this process)."""
    engine = make_engine(name, url)

    def publish(events: Any) -> None:
        seen.append([("doomed", e.id, e.key, time.time_ns()) for e in events])
        published.set()
        time.sleep(600)

    Relay(engine, CallableSink(publish), lease=timedelta(seconds=lease_s), hold=hold).run_once()
