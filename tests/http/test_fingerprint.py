"""Request identity: JSON numbers that differ only beyond float precision are another request."""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy.orm import sessionmaker

from stateguard.asgi import IdempotencyMiddleware
from stateguard.tables import metadata as stateguard_metadata
from tests._support.raw_asgi import (
    Answer,
    World,
    _Base,
    _body,
    request,
)
from tests.conftest import Backend


@pytest.fixture
def world(backend: Backend) -> World:
    backend.create(stateguard_metadata, _Base.metadata)
    return World(sessionmaker(backend.engine))


# --------------------------------------------------------------------------
# Request identity
# --------------------------------------------------------------------------


def test_json_numbers_that_differ_only_beyond_float_precision_are_another_request(world: World) -> None:
    """Two JSON bodies whose amounts differ (as a Decimal-parsing handler sees them) are two requests: the
    second is 422, never a replay of the first one's response for a different amount.  Numbers a double
    holds exactly still count by value (1.50 is 1.5).

    Regression: bodies were parsed into floats, so 12345678901234567890.5 and 12345678901234567891.5 (one
    double) were one request and the second client got a replay for another amount."""
    seen: list[Decimal] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = await _body(receive)
        amount = json.loads(body or b"", parse_float=Decimal)["amount"]
        seen.append(amount)
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": str(amount).encode()})

    mw = IdempotencyMiddleware(app, session_factory=world.session_factory, anonymous="shared")

    async def scenario() -> tuple[Answer, Answer]:
        first = await request(mw, key=b"dec", body=b'{"amount": 12345678901234567890.5}')
        other = await request(mw, key=b"dec", body=b'{"amount": 12345678901234567891.5}')
        return first, other

    first, other = asyncio.run(scenario())
    assert first.status == 201 and first.body == b"12345678901234567890.5"
    assert other.status == 422, (other.status, other.body, other.replayed)

    async def exact() -> tuple[Answer, Answer]:
        first = await request(mw, key=b"exact", body=b'{"amount": 1.50, "fee": 0.1}')
        same = await request(mw, key=b"exact", body=b'{"fee":1e-1,"amount":1.5}')
        return first, same

    first, same = asyncio.run(exact())
    assert first.status == 201 and same.status == 201 and same.replayed and same.body == first.body
    assert seen == [Decimal("12345678901234567890.5"), Decimal("1.50")]
