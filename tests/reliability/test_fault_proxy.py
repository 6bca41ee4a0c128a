"""The fault-injecting proxy itself: a cut command really ran on the server, its client
never got the reply, and everything else passes through unchanged (Redis, PostgreSQL,
MariaDB)."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from sqlalchemy import create_engine, exc, text

from tests._support.faultproxy import COMMIT, FaultProxy, through
from tests.conftest import MYSQL_URL, PG_URL, REDIS_URL, unavailable

redis = pytest.importorskip("redis")


def _target(url: str, default_port: int) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or default_port


@pytest.fixture
def redis_proxy() -> Iterator[tuple[FaultProxy, object]]:
    """A proxy in front of the test Redis and a direct client to check the server's state."""
    host, port = _target(REDIS_URL, 6379)
    direct = redis.Redis.from_url(REDIS_URL)
    try:
        direct.ping()
    except redis.ConnectionError as error:
        unavailable("redis", error)
    with FaultProxy(host, port) as proxy:
        yield proxy, direct
    direct.close()


def test_redis_passes_through(redis_proxy: tuple[FaultProxy, redis.Redis]) -> None:
    """Commands and replies go through the proxy unchanged when no cut is armed."""
    proxy, direct = redis_proxy
    key = f"fp:{uuid.uuid4().hex}"
    client = redis.Redis(host=proxy.host, port=proxy.port, retry=None)
    try:
        client.set(key, b"x" * 200_000)
        assert client.get(key) == b"x" * 200_000
        assert proxy.cuts == 0
    finally:
        direct.delete(key)
        client.close()


def test_redis_cut_incr_ran_on_server(redis_proxy: tuple[FaultProxy, redis.Redis]) -> None:
    """An INCR whose reply is cut raises ConnectionError in the client, yet ran once on the server."""
    proxy, direct = redis_proxy
    key = f"fp:{uuid.uuid4().hex}"
    client = redis.Redis(host=proxy.host, port=proxy.port, retry=None)
    try:
        assert client.incr(key) == 1
        proxy.cut_after_next_request(b"INCR")
        with pytest.raises(redis.ConnectionError):
            client.incr(key)
        assert proxy.wait_cut()
        assert proxy.cuts == 1
        assert int(direct.get(key)) == 2  # the lost-reply INCR did run
        assert client.incr(key) == 3  # a new connection works again
    finally:
        direct.delete(key)
        client.close()


def test_redis_match_skips_other_commands(redis_proxy: tuple[FaultProxy, redis.Redis]) -> None:
    """A cut armed for INCR lets other commands through and hits the first INCR."""
    proxy, direct = redis_proxy
    key = f"fp:{uuid.uuid4().hex}"
    client = redis.Redis(host=proxy.host, port=proxy.port, retry=None)
    try:
        proxy.cut_after_next_request(b"INCR")
        client.set(key, 10)
        assert client.get(key) == b"10"
        assert proxy.armed
        with pytest.raises(redis.ConnectionError):
            client.incr(key)
        assert not proxy.armed
        assert int(direct.get(key)) == 11
    finally:
        direct.delete(key)
        client.close()


def test_redis_cut_all(redis_proxy: tuple[FaultProxy, redis.Redis]) -> None:
    """cut_all closes every live connection: its client reads end-of-stream, a new one connects."""
    proxy, _direct = redis_proxy
    with socket.create_connection((proxy.host, proxy.port)) as raw:
        raw.sendall(b"PING\r\n")
        assert raw.recv(100) == b"+PONG\r\n"
        assert proxy.cut_all() == 1
        assert raw.recv(100) == b""
    assert proxy.cut_all_count == 1
    client = redis.Redis(host=proxy.host, port=proxy.port, retry=None)
    try:
        assert client.ping()
        assert proxy.connections == 2
    finally:
        client.close()


@pytest.mark.parametrize("server", ["postgresql", "mariadb"])
def test_sql_cut_commit_ran_on_server(server: str) -> None:
    """A COMMIT whose reply is cut raises a DBAPI error in the client, yet the row is committed."""
    url, port = (PG_URL, 5432) if server == "postgresql" else (MYSQL_URL, 3306)
    direct = create_engine(url)
    table = f"fp_{uuid.uuid4().hex[:12]}"
    try:
        with direct.begin() as conn:
            conn.execute(text(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY)"))
    except Exception as error:
        unavailable(server, error)
    try:
        with FaultProxy(*_target(url, port)) as proxy:
            engine = create_engine(through(url, proxy))
            try:
                with engine.begin() as conn:
                    conn.execute(text(f"INSERT INTO {table} VALUES (1)"))
                proxy.cut_after_next_request(COMMIT[server])
                conn2 = engine.connect()
                conn2.execute(text(f"INSERT INTO {table} VALUES (2)"))
                with pytest.raises(exc.DBAPIError):
                    conn2.commit()
                conn2.close()
                assert proxy.wait_cut()
                assert proxy.cuts == 1
            finally:
                engine.dispose()
        with direct.connect() as conn:
            assert conn.execute(text(f"SELECT id FROM {table} ORDER BY id")).scalars().all() == [1, 2]
    finally:
        with direct.begin() as conn:
            conn.execute(text(f"DROP TABLE {table}"))
        direct.dispose()
