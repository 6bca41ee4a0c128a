"""Running a relay to the end in the sink tests: the outbox rows, a relay drained, every event published."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from sqlalchemy import Engine, select

from stateguard import PublishFailed, Relay
from stateguard.tables import outbox


def outbox_rows(engine: Engine) -> dict[int, Any]:
    """Every outbox row by id."""
    with engine.connect() as conn:
        return {r.id: r for r in conn.execute(select(outbox))}


def drain_relay(relay: Relay) -> int:
    """Run the relay until a cycle publishes nothing; how many it published."""
    total = 0
    while (published := relay.run_once()) > 0:
        total += published
    return total


def publish_all(relay: Relay, engine: Engine) -> None:
    """Run the relay until every event is marked published (a batch the sink refused comes again)."""
    deadline = time.monotonic() + 60
    while any(r.published_ms is None for r in outbox_rows(engine).values()):
        assert time.monotonic() < deadline, "the relay did not publish every event within 60 s"
        with contextlib.suppress(PublishFailed):
            if relay.run_once() == 0:
                time.sleep(0.1)
