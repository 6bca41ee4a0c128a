"""The Idempotency-Key header: other methods pass through even on a required path, hostile key bytes
are a 400 problem+json, a quoted key of 255 characters is accepted, a comma belongs to a key only
when quoted, and a body of exactly max_body is accepted while one more byte is a 413."""

from __future__ import annotations

import asyncio
import json

import pytest
from sqlalchemy.orm import sessionmaker

from stateguard.tables import metadata as stateguard_metadata
from tests._support.raw_asgi import (
    Answer,
    World,
    _Base,
    middleware,
    request,
)
from tests.conftest import Backend


@pytest.fixture
def world(backend: Backend) -> World:
    backend.create(stateguard_metadata, _Base.metadata)
    return World(sessionmaker(backend.engine))


# --------------------------------------------------------------------------
# Methods the header is ignored on, key values, body sizes
# --------------------------------------------------------------------------


@pytest.mark.hostile
@pytest.mark.parametrize("method", ["HEAD", "OPTIONS", "PUT", "DELETE"])
def test_other_methods_pass_through_even_on_a_required_path(world: World, method: str) -> None:
    """The header is honoured only on POST and PATCH: elsewhere no 400 without a key, no claim, no replay."""
    app = middleware(world, required_paths=["/*"])

    async def scenario() -> list[Answer]:
        return [
            await request(app, "/pay", key=None, method=method),
            await request(app, "/pay", key=b"m", method=method),
            await request(app, "/pay", key=b"m", method=method),
        ]

    answers = asyncio.run(scenario())
    assert [a.status for a in answers] == [201, 201, 201]
    assert not any(a.replayed for a in answers)
    assert world.calls == 3 and world.key_rows() == []


@pytest.mark.hostile
@pytest.mark.parametrize(
    "value",
    [
        b"nul\x00inside",
        b"\xed\xa0\x80",  # a UTF-8-encoded lone surrogate
        b"\xff\xfe",  # not UTF-8 at all
        b"del\x7f",
        b"k" * 100_000,  # huge
        b'"' + b"k" * 256 + b'"',  # a quoted key that is one character too long once unquoted
        b'"   "',  # a quoted blank
        b"\t",
        b"key-a, key-b",  # two headers a proxy joined into one line
        b'"key-a", "key-b"',  # the same, quoted
    ],
    ids=[
        "nul",
        "surrogate",
        "not-utf8",
        "del",
        "huge",
        "quoted-oversize",
        "quoted-blank",
        "tab",
        "joined",
        "joined-quoted",
    ],
)
def test_hostile_key_bytes_are_400_problem_json(world: World, value: bytes) -> None:
    """Key values no database should see are answered 400 problem+json, and nothing runs or is stored."""
    app = middleware(world)
    answer = asyncio.run(request(app, key=value))
    assert answer.error is None and answer.status == 400
    assert answer.header(b"content-type") == b"application/problem+json"
    assert json.loads(answer.body)["title"] == "Invalid Idempotency-Key"
    assert world.calls == 0 and world.key_rows() == []


@pytest.mark.hostile
@pytest.mark.limits
def test_a_quoted_key_of_255_characters_is_accepted(world: World) -> None:
    """The 255-character limit applies to the key, not to the quoted header value (257 bytes)."""
    app = middleware(world)

    async def scenario() -> tuple[Answer, Answer]:
        return await request(app, key=b'"' + b"q" * 255 + b'"'), await request(app, key=b"q" * 255)

    first, replay = asyncio.run(scenario())
    assert first.status == 201 and replay.replayed and world.calls == 1


@pytest.mark.hostile
def test_a_comma_is_a_key_character_only_when_quoted(world: World) -> None:
    """A bare ``a,b`` is two joined headers (400); the Structured Field string ``"a,b"`` is one key."""
    app = middleware(world)

    async def scenario() -> tuple[Answer, Answer]:
        return await request(app, key=b'"a,b"'), await request(app, key=b'"a,b"')

    first, replay = asyncio.run(scenario())
    assert first.status == 201 and replay.replayed and world.calls == 1
    assert [r.idem_key for r in world.key_rows()] == ["a,b"]


@pytest.mark.hostile
@pytest.mark.limits
def test_a_body_of_exactly_max_body_in_many_chunks_is_accepted_and_one_more_byte_is_413(world: World) -> None:
    """max_body counts the whole body across chunks: exactly the limit runs, one byte over is 413."""
    app = middleware(world, max_body=1000)
    exact = [b"x" * 100] * 10
    over = [*exact, b"y"]

    async def scenario() -> tuple[Answer, Answer]:
        return await request(app, "/echo", key=b"a", chunks=exact), await request(
            app, "/echo", key=b"b", chunks=over
        )

    ok, too_big = asyncio.run(scenario())
    assert ok.status == 200 and ok.body == b"x" * 1000
    assert too_big.status == 413 and too_big.header(b"content-type") == b"application/problem+json"
    assert world.calls == 1
    assert [r.idem_key for r in world.key_rows()] == ["a"]
