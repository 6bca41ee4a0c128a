"""Workers for tests/test_tokens.py (importable by spawned processes)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from stateguard import RedisTokens, consume_token


def make_engine(name: str, url: str) -> Any:
    kw: dict[str, Any] = {"pool_size": 2}
    if name == "sqlite":
        kw["connect_args"] = {"timeout": 60}
    return create_engine(url, **kw)


def consume_sql(name: str, url: str, token: str, scope: str, barrier: Any) -> str:
    """Consume ``token`` once after the barrier, in its own transaction; the outcome's name."""
    engine = make_engine(name, url)
    try:
        with Session(engine) as session:
            session.connection()  # connect before the barrier, so the race is the UPDATE's
            barrier.wait()
            outcome = consume_token(session, token, scope=scope).outcome.name
            session.commit()
        return outcome
    finally:
        engine.dispose()


def consume_sql_with_engine(engine: Any, token: str, scope: str, barrier: Any) -> str:
    """Like :func:`consume_sql`, on a shared engine (for threads)."""
    with Session(engine) as session:
        session.connection()
        barrier.wait()
        outcome = consume_token(session, token, scope=scope).outcome.name
        session.commit()
    return outcome


def consume_redis(redis_url: str, token: str, scope: str, barrier: Any) -> str:
    """Consume ``token`` in Redis once after the barrier; the outcome's name."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        tokens = RedisTokens(client)
        client.ping()
        barrier.wait()
        return tokens.consume(token, scope=scope).outcome.name
    finally:
        client.close()
