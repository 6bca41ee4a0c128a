"""RedisStreamSink: one stream entry per event carrying its id, topic, key and payload, in id order;
awaited on a redis.asyncio client by AsyncRelay."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncSession

from stateguard import AsyncRelay, InvalidArgument, RedisStreamSink, Relay, create_tables, drop_tables, emit
from tests._support.async_helpers import AsyncTarget

from ...conftest import REDIS_URL, Backend
from .._events import emit_one


def test_redis_stream_sink_xadds_each_event_with_its_id(
    backend: Backend, engine: Engine, redis_client: Any
) -> None:
    """Each event becomes one stream entry carrying id, topic, key and payload, in id order."""
    stream = f"sg-test-outbox-{uuid.uuid4().hex}"
    try:
        ids = [
            emit_one(engine, "order.paid", {"n": n, "s": "✓"}, key=None if n == 2 else "o-1")
            for n in range(4)
        ]
        assert Relay(engine, RedisStreamSink(redis_client, stream=stream)).run_once() == 4
        entries = redis_client.xrange(stream)
        fields = [{k.decode(): v.decode() for k, v in f.items()} for _, f in entries]
        assert fields == [
            {
                "id": str(i),
                "topic": "order.paid",
                "key": "" if n == 2 else "o-1",
                "payload": json.dumps({"n": n, "s": "✓"}, ensure_ascii=False, separators=(",", ":")),
            }
            for n, i in enumerate(ids)
        ]
    finally:
        redis_client.delete(stream)


def test_redis_stream_sink_refuses_bad_options(redis_client: Any) -> None:
    """No client, a blank stream or a zero maxlen are InvalidArgument."""
    for args, kwargs in [
        ((None,), {"stream": "s"}),
        ((redis_client,), {"stream": " "}),
        ((redis_client,), {"stream": "s", "maxlen": 0}),
    ]:
        with pytest.raises(InvalidArgument):
            RedisStreamSink(*args, **kwargs)


def test_async_relay_publishes_to_a_redis_stream_through_redis_asyncio(
    target: AsyncTarget, redis_client: Any
) -> None:
    """AsyncRelay awaits RedisStreamSink's pipeline on a redis.asyncio client: an entry per event in order."""
    import redis.asyncio

    stream = f"sg-test-outbox-async-{uuid.uuid4().hex}"

    async def main() -> list[str]:
        engine = target.engine()
        client = redis.asyncio.Redis.from_url(REDIS_URL)
        try:
            await drop_tables(engine)
            await create_tables(engine)
            async with AsyncSession(engine) as session, session.begin():
                ids = [await emit(session, "t", {"n": n}, key="k") for n in range(4)]
            relay = AsyncRelay(engine, RedisStreamSink(client, stream=stream), batch=3)
            assert await relay.run_once() == 3
            assert await relay.run_once() == 1
            await drop_tables(engine)
            return [str(i) for i in ids]
        finally:
            await client.aclose()
            await engine.dispose()

    try:
        ids = asyncio.run(main())
        assert [f[b"id"].decode() for _, f in redis_client.xrange(stream)] == ids
    finally:
        redis_client.delete(stream)
