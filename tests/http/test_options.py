"""The middleware's options are checked when it is built, and a refusal says what to pass instead."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import sessionmaker

from stateguard import InvalidArgument
from stateguard.asgi import IdempotencyMiddleware


async def _app(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("never called")


def _wsgi_app(environ: Any, start_response: Any) -> Any:
    raise AssertionError("never called")


def _wsgi() -> Any:
    from stateguard.http.wsgi import WSGIIdempotencyMiddleware

    return WSGIIdempotencyMiddleware


ENGINE = create_engine("sqlite://")


@pytest.mark.parametrize("face", ["asgi", "wsgi"])
@pytest.mark.parametrize("pattern", ["/orders/*/pay", "/*/pay", "orders/*"])
def test_a_path_pattern_with_a_star_inside_is_refused_when_built(face: str, pattern: str) -> None:
    """required_paths and routes patterns fail at construction, naming the prefix form and routes=."""
    make: Any = IdempotencyMiddleware if face == "asgi" else _wsgi()
    app: Any = _app if face == "asgi" else _wsgi_app
    for options in ({"required_paths": [pattern]}, {"routes": {pattern: {"required": True}}}):
        with pytest.raises(InvalidArgument) as caught:
            make(app, session_factory=sessionmaker(ENGINE), **options)
        if "*" in pattern[:-1] and pattern.startswith("/"):
            assert f"'{pattern[: pattern.index('*') + 1]}'" in str(caught.value)
            assert "routes= a callable" in str(caught.value)


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("factory", "fix"),
    [
        (ENGINE, "sessionmaker(engine)"),
        (create_async_engine("sqlite+aiosqlite://"), "async_sessionmaker"),
        (lambda: 42, "not a Session"),
        (lambda: ENGINE, "not a Session"),
        (sessionmaker(ENGINE)(), "one Session"),
        ("sqlite://", "sessionmaker(engine)"),
    ],
    ids=["engine", "async-engine", "returns-int", "returns-engine", "a-session", "a-url"],
)
def test_a_wrong_session_factory_is_refused_when_built(factory: Any, fix: str) -> None:
    """An Engine, a Session, a URL or a callable returning something else: InvalidArgument naming the fix."""
    with pytest.raises(InvalidArgument, match="session_factory") as caught:
        IdempotencyMiddleware(_app, session_factory=factory)
    assert fix in str(caught.value)


def test_the_wsgi_face_refuses_an_async_session_factory_when_built() -> None:
    """A WSGI server cannot await: an async_sessionmaker is refused, naming sessionmaker(engine)."""
    factory = async_sessionmaker(create_async_engine("sqlite+aiosqlite://"))
    with pytest.raises(InvalidArgument, match=r"sessionmaker\(engine\)"):
        _wsgi()(_wsgi_app, session_factory=factory)


def test_both_session_factory_kinds_are_accepted_by_the_asgi_face() -> None:
    """sessionmaker, async_sessionmaker and a plain callable returning a session are all fine."""
    async_engine = create_async_engine("sqlite+aiosqlite://")
    for factory in (sessionmaker(ENGINE), async_sessionmaker(async_engine), lambda: sessionmaker(ENGINE)()):
        IdempotencyMiddleware(_app, session_factory=factory)


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"required_paths": None}, "required_paths must be a list"),
        ({"required_paths": "/payments"}, "not the string"),
        ({"methods": None}, "methods must be a list"),
        ({"principal": "user"}, "principal must be a callable"),
        ({"principal": lambda s: "x", "scope": "shop"}, "not both"),
    ],
)
def test_other_wrong_options_are_refused_when_built(options: dict[str, Any], message: str) -> None:
    """Wrong containers and contradicting options: InvalidArgument when built (not a TypeError later)."""
    faces: list[tuple[Any, Any]] = [(IdempotencyMiddleware, _app), (_wsgi(), _wsgi_app)]
    for make, app in faces:
        with pytest.raises(InvalidArgument, match=message):
            make(app, session_factory=sessionmaker(ENGINE), **options)


def test_each_face_signature_names_its_own_app_and_factory_types() -> None:
    """help() and the docs show a face's real parameters: its app and factory types, no type variable."""
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

    from stateguard.http.asgi import ASGIApp
    from stateguard.http.wsgi import WSGIApp, WSGIIdempotencyMiddleware

    asgi, wsgi = inspect.signature(IdempotencyMiddleware), inspect.signature(WSGIIdempotencyMiddleware)
    assert asgi.parameters["app"].annotation == ASGIApp
    assert asgi.parameters["session_factory"].annotation == Callable[[], Session] | Callable[[], AsyncSession]
    assert wsgi.parameters["app"].annotation == WSGIApp
    assert wsgi.parameters["session_factory"].annotation == Callable[[], Session]
    assert list(asgi.parameters) == list(wsgi.parameters)
    assert "lease" in asgi.parameters and "self" not in asgi.parameters
    assert "_App" not in str(asgi) + str(wsgi) and "_Factory" not in str(asgi) + str(wsgi)
