"""``IdempotencyMiddleware``: the ``Idempotency-Key`` HTTP header for ASGI apps (Starlette, FastAPI ...).

A pure ASGI middleware (it imports no framework) following the IETF draft
"The Idempotency-Key HTTP Header Field"; the decisions are
:mod:`stateguard.http.core`'s, shared with the WSGI face
(:class:`stateguard.http.wsgi.WSGIIdempotencyMiddleware`)::

    from fastapi import FastAPI
    from stateguard.asgi import IdempotencyMiddleware

    app = FastAPI()
    app.add_middleware(
        IdempotencyMiddleware,
        session_factory=SessionLocal,           # a sessionmaker or an async_sessionmaker
        required_paths=["/payments"],           # 400 without a key there
    )

A keyed POST or PATCH claims its key in its own transaction before the app
runs (the handler uses its own sessions); a retry of the same request gets
the stored response, one in flight 409 with ``Retry-After``, another request
under the key 422.  Keys are per client (:func:`default_scope`,
:func:`principal_of`), and stored responses never carry
:data:`CREDENTIAL_HEADERS`.  The answers, the stored-status policy and what
happens when the database fails are in ``docs/how-to/http.md``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from datetime import timedelta
from typing import Any, ClassVar, TypeAlias, TypeVar

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from ..exceptions import ConfigurationError, LeaseLost
from .core import Admitted, KeyedRequest, MiddlewareCore, admit, too_large
from .options import (
    REFUSED_BEFORE_EXECUTION,
    RouteOptions,
    Settings,
    default_store_status,
)
from .principal import principal, scope_from_principal
from .request import HttpRequest
from .responses import CREDENTIAL_HEADERS

__all__ = [
    "CREDENTIAL_HEADERS",
    "REFUSED_BEFORE_EXECUTION",
    "IdempotencyMiddleware",
    "RouteOptions",
    "default_scope",
    "default_store_status",
    "principal_of",
]

log = logging.getLogger("stateguard.asgi")

Scope: TypeAlias = MutableMapping[str, Any]
Message: TypeAlias = MutableMapping[str, Any]
Receive: TypeAlias = Callable[[], Awaitable[Message]]
Send: TypeAlias = Callable[[Message], Awaitable[None]]
ASGIApp: TypeAlias = Callable[[Scope, Receive, Send], Awaitable[None]]

_T = TypeVar("_T")


def _request(scope: Scope) -> HttpRequest:
    return HttpRequest(
        method=str(scope.get("method", "")).upper(),
        path=str(scope.get("path", "")),
        query=bytes(scope.get("query_string", b"")),
        headers=[(bytes(k).lower(), bytes(v)) for k, v in scope.get("headers", ())],
        native=scope,
        user=scope.get("user"),
    )


def _route_paths(scope: Scope) -> tuple[str, ...]:
    """The paths the app may route on: as Starlette, then as werkzeug (Quart) routes, if other.

    ``required_paths`` and ``routes`` name the app's own routes.  Under uvicorn's ``--root-path
    /api`` (and in an app mounted with Starlette's ``Mount``) ``path`` is ``/api/payments`` and
    ``root_path`` ``/api``, while the app's route is ``/payments``: Starlette routes on the
    difference (``starlette._utils.get_route_path``), only where ``root_path`` is whole segments
    of ``path``.  A ``path`` that does not start with ``root_path`` (servers that strip it) is the
    route path itself.  Quart cuts ``root_path`` off as a string and werkzeug strips the leading
    slashes: ``//payments``, ``/apipayments`` under ``/api`` and ``/api/payments`` under ``/api/``
    are its ``/payments``, so that path is a second candidate (a key required where Starlette
    answers 404 costs nothing).
    """
    path = str(scope.get("path", ""))
    root_path = str(scope.get("root_path", "") or "")
    starlette = path
    if root_path and path.startswith(root_path):
        rest = path[len(root_path) :]
        starlette = "/" if not rest else rest if rest.startswith("/") else path
        path = rest
    werkzeug = "/" + path.lstrip("/")
    return (starlette,) if werkzeug == starlette else (starlette, werkzeug)


def principal_of(scope: Scope, *, session_cookies: Iterable[str] = ()) -> str | None:
    """Who sent the request, as an opaque string, or ``None`` when nothing in it names the client.

    In this order:

    1. ``scope["user"]`` when an auth middleware that runs before this one
       authenticated it (Starlette's ``AuthenticationMiddleware`` and the
       like): ``"user:"`` + SHA-256 of its ``identity``, else of its ``id``.
       Stable across token refreshes.  Never its ``display_name`` (two
       people may share one) nor ``username``: Starlette's ``SimpleUser``
       has only those, so it falls through to 2 (pass the middleware
       ``principal=`` to keep a user's keys across token refreshes).
    2. the ``Authorization`` header: ``"authorization:"`` + SHA-256 of its
       value.  This middleware runs before the app checks the credential, so
       the whole credential must match, not only the user it names.
    3. the cookies named in ``session_cookies`` (your session cookie):
       ``"cookie:"`` + SHA-256 of their ``name=value``.  Other cookies are
       not read: many clients send the same ``lang=en``.

    Only digests, never a credential, reach the database::

        IdempotencyMiddleware(app, session_factory=SessionLocal,
                              scope=lambda s: f"payments:{principal_of(s, session_cookies=['sid'])}")

    :raises ConfigurationError: ``scope["user"]`` is authenticated, has no
        identity or id, and the request has no credential header: nothing
        tells this client apart, so nothing may be stored for it.
    """
    return principal(_request(scope), session_cookies)


def default_scope(scope: Scope, *, session_cookies: Iterable[str] = ()) -> str:
    """The default idempotency scope: ``"http:"`` + :func:`principal_of`, or ``"http"`` without one.

    Keys are chosen by clients, so each client gets its own namespace: a
    client that sends another's key gets its own execution, never the other's
    response, and never a 422 for the other's request.  ``"http"`` is the one
    namespace of requests naming no client; the middleware uses it only with
    ``anonymous="shared"`` (by default such a keyed request is answered 400).
    """
    return scope_from_principal(principal_of(scope, session_cookies=session_cookies))


async def _in_thread(fn: Callable[..., _T], *args: Any) -> _T:
    """Run blocking database work off the event loop (anyio's thread pool when anyio is there)."""
    try:
        import anyio.to_thread
    except ImportError:  # pragma: no cover - anyio comes with starlette
        return await asyncio.to_thread(fn, *args)
    return await anyio.to_thread.run_sync(fn, *args)


class _Session:
    """The request's session and how to run :class:`KeyedRequest` steps on it without blocking the loop.

    A Session's steps run in a worker thread; an AsyncSession's through
    ``run_sync`` (SQLAlchemy's greenlet bridge, on the loop).
    """

    def __init__(self, made: Session | AsyncSession) -> None:
        if not isinstance(made, Session | AsyncSession):
            raise ConfigurationError(f"session_factory() returned {made!r}, not a Session or an AsyncSession")
        self.made = made

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        if isinstance(self.made, AsyncSession):
            return await self.made.run_sync(fn, *args)
        return await self.run_to_end(fn, *args)

    async def run_to_end(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run a step to its end even if the task is cancelled meanwhile, then deliver the cancellation.

        A worker thread is not stopped by a cancellation: a native ``task.cancel()`` (an
        ``asyncio.wait_for`` or ``asyncio.timeout`` around the app) is not held off by anyio's
        shield either, so the awaiting task went on (releasing the key on this very Session, from
        another thread) while the thread was still recording the response: the record was lost
        and a retry ran the app again.  A recording on an AsyncSession is not cut half-way either.
        """
        if isinstance(self.made, AsyncSession):
            return await _uncut(self.made.run_sync(fn, *args))
        return await _uncut(_in_thread(fn, self.made, *args))

    async def run_uncut(self, fn: Callable[..., None], *args: Any) -> None:
        """Run a step that must finish although the task is being cancelled (the key's release)."""
        if isinstance(self.made, Session):
            fn(self.made, *args)  # the thread pool may refuse new work now: finish it here
            return
        await _uncut(self.made.run_sync(fn, *args))

    async def close(self) -> None:
        if isinstance(self.made, AsyncSession):
            # Not cut either: a close interrupted mid-ROLLBACK leaves its connection out of the pool.
            await _uncut(self.made.close())
        else:
            await _in_thread(self.made.close)


async def _uncut(step: Awaitable[_T]) -> _T:
    """Await ``step`` in a task of its own to its end, then deliver any cancellation that came meanwhile.

    ``asyncio.shield`` alone returns at the next cancellation (anyio's cancel scopes cancel again and
    again) while the step still runs: the session's close then ran beside the release on one
    connection (aiomysql: "readexactly() called while another coroutine is already waiting"), the
    release failed, and the key stayed in progress for its whole lease.
    """
    task = asyncio.ensure_future(step)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError as error:
            if task.done():
                break
            cancelled = error
    if cancelled is not None:
        if not task.cancelled() and task.exception() is not None:
            log.warning("a step finished while its request was cancelled failed", exc_info=task.exception())
        raise cancelled
    return task.result()


class _Heartbeat:
    """Extends an AsyncSession claim's lease from a task on the loop (idempotent()'s thread cannot)."""

    def __init__(self, session: _Session, keyed: KeyedRequest, every: timedelta) -> None:
        self._stop = asyncio.Event()
        self._task = asyncio.ensure_future(self._beat(session, keyed, every.total_seconds()))

    async def _beat(self, session: _Session, keyed: KeyedRequest, every: float) -> None:
        while True:
            try:
                await asyncio.wait_for(self._stop.wait(), every)
                return
            except TimeoutError:
                pass
            try:
                await session.run(keyed.heartbeat)
            except LeaseLost:
                return
            except Exception:
                log.warning("heartbeat of idempotency key %r failed; trying again", keyed.key, exc_info=True)

    async def stop(self) -> None:
        # Never cancelled mid-statement: the session is left usable for the settlement.
        self._stop.set()
        await asyncio.shield(self._task)


class IdempotencyMiddleware(MiddlewareCore["ASGIApp", "Callable[[], Session] | Callable[[], AsyncSession]"]):
    """Make POST and PATCH requests with an ``Idempotency-Key`` header run once and replay after.

    :param app: the wrapped ASGI app (Starlette's ``add_middleware`` passes it).
    :param session_factory: a ``sessionmaker`` or an ``async_sessionmaker``
        (or a callable returning a new Session or AsyncSession); the
        middleware opens one per keyed request for the key record only and
        closes it afterwards.  An Engine or any other object is refused when
        the middleware is built (Starlette builds it at startup).
    :param scope: the idempotency scope: a string, or a callable of the ASGI
        scope returning one.  Keys are chosen by clients, so it must tell
        clients apart.  The default, :func:`default_scope`, derives it from
        the request's principal (:func:`principal_of`).  A fixed string puts
        every client in one namespace: one client then receives another's
        stored response when it sends the other's key and body.
    :param principal: a callable of the ASGI scope returning a unique name of
        the client (or ``None`` when the request names none), used by the
        default scope instead of :func:`principal_of`, e.g.
        ``lambda s: s["user"].username`` when usernames are unique logins.
        Not together with ``scope``.
    :param session_cookies: the names of the cookies that identify a client
        (your session cookie, e.g. ``["session"]``): their digest is the
        principal of a request without an authenticated user or an
        ``Authorization`` header.  No other cookie is read.
    :param anonymous: a keyed request whose principal is ``None`` (no user,
        credential or session cookie) is answered 400 and not run
        (``"refuse"``, the default), or put in the one namespace ``"http"``
        shared by every anonymous client (``"shared"``: one of them sending
        another's key and body receives the other's stored response).  Also
        per route (:class:`RouteOptions`).  Not used with ``scope``.
    :param required_paths: paths (``/payments``, or prefixes ``/payments/*``)
        where a request without a key is answered 400.  These and ``routes``
        patterns are the app's route paths: under a ``root_path`` (uvicorn
        ``--root-path``, a Starlette ``Mount``) they match the path without it,
        as Starlette and as Quart route it (``//payments`` is ``/payments``).
    :param methods: the methods the header is honoured on (default POST, PATCH).
    :param lease: how long a claim stays "in progress" before another request
        may take it over (a worker that died); longer than your slowest handler.
    :param ttl: how long a completed response is kept and replayed.
    :param max_body: largest request body read (bytes); larger ones get 413.
    :param routes: per-route overrides: ``{"/path" or "/prefix/*": RouteOptions | dict}``
        (the longest matching pattern wins), or a callable of the ASGI scope
        returning a :class:`RouteOptions` or ``None``.
    :param store_status: which final statuses are stored (default:
        :func:`default_store_status`).  A 4xx that is not stored forgets the
        key; any other status that is not stored releases it.
    :param heartbeat_every: extend the lease in the background this often
        while the app runs (for handlers that may outlive ``lease``).
    :param documentation: a URL about your idempotency rules; error answers
        link to it (``Link: <url>; rel="describedby"`` and the problem ``type``).

    Errors are answered as RFC 9457 problem details (``application/problem+json``)::

        app.add_middleware(IdempotencyMiddleware, session_factory=SessionLocal,
                           required_paths=["/payments"], scope="shop")

    :raises InvalidArgument: a wrong option (an Engine for ``session_factory``,
        ``"/orders/*/pay"`` in ``required_paths``...), when built.

    Stateguard's tables must exist (``stateguard.create_tables(engine)`` or
    the alembic revisions).
    """

    where: ClassVar[str] = "IdempotencyMiddleware"
    allow_async: ClassVar[bool] = True

    def _settings_for(self, scope: Scope) -> Settings | None:
        """The effective settings for a request, or ``None`` when its route is disabled."""
        return self.options.settings_for(_route_paths(scope), scope)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        settings = self._settings_for(scope)
        if settings is None or str(scope["method"]).upper() not in settings.methods:
            await self.app(scope, receive, send)
            return
        request = _request(scope)
        admitted = admit(self.options, settings, request, log)
        if admitted is None:
            await self.app(scope, receive, send)
            return
        if not isinstance(admitted, Admitted):
            await _send_response(send, *admitted)
            return
        try:
            body = await _read_body(receive, settings.max_body)
        except _TooLarge:
            await _send_response(send, *too_large(self.options, settings))
            return
        if body is None:
            return  # the client went away before sending its body
        is_async = self.options.session_kind == "async"
        key, key_scope = admitted.key, admitted.scope
        keyed = KeyedRequest(
            self.options, settings, request, key, body, log, scope=key_scope, heartbeat_thread=not is_async
        )
        session = _Session(self.session_factory())
        try:
            await self._keyed(scope, _replaying_receive(body, receive), send, session, keyed)
        finally:
            await session.close()

    async def _keyed(
        self, scope: Scope, receive: Receive, send: Send, session: _Session, keyed: KeyedRequest
    ) -> None:
        try:
            answer = await session.run(keyed.claim)
        except BaseException as error:
            # Cancelled while the claim was written (a Session's claim is finished first): the key
            # was claimed for an app that will not run, so it is released at once, not left in
            # progress for its whole lease.
            if keyed.call is not None and not keyed.exited:
                await session.run_uncut(keyed.fail, error)
            raise
        if answer is not None:
            await _send_response(send, *answer)
            return
        beat: _Heartbeat | None = None
        every = keyed.settings.idempotency.heartbeat_every
        if every is not None and isinstance(session.made, AsyncSession):
            beat = _Heartbeat(session, keyed, every)

        async def stop_beat() -> None:
            nonlocal beat
            if beat is not None:
                await beat.stop()
                beat = None

        async def settle(start: Message, body: bytes) -> None:
            # The app's whole response: record the key (store, forget or release), then send it.
            await stop_beat()
            await session.run_to_end(keyed.settle, int(start["status"]), start.get("headers", ()), body)
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": False})

        recorder = _Recorder(send, settle)
        try:
            await self.app(scope, receive, recorder)
        except Exception as error:
            # Before the whole response was recorded: the key is released and the error re-raised.
            # After it (a background task failed, the client went away while it was sent): the key
            # is recorded already and the error is the server's to log.
            await stop_beat()
            if not keyed.exited:
                await session.run(keyed.fail, error)
            raise
        except BaseException as error:
            # Cancelled: the release must finish all the same.
            if beat is not None:
                beat._stop.set()
            if not keyed.exited:
                await session.run_uncut(keyed.fail, error)
            raise
        if keyed.exited:
            return
        # Streamed, or the app returned without a whole response: nothing to replay.
        await stop_beat()
        await session.run(keyed.incomplete)
        if not recorder.streaming and recorder.start is not None:
            # A start without its final body message: sent, with the chunk it held to end it.
            await send(recorder.start)
            await send({"type": "http.response.body", "body": recorder.held, "more_body": False})


class _TooLarge(Exception):
    pass


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, ``None`` when the client went away, or :class:`_TooLarge`."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        if message["type"] != "http.request":
            continue
        chunk = bytes(message.get("body", b""))
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replaying_receive(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the buffered body once, then the real channel (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class _Recorder:
    """Buffers the app's response; switches to pass-through when it turns out to stream.

    Once the app sent its whole response, ``settle`` is awaited with it (the middleware records the
    key, then sends the response), right then: not after the app returns, which with Starlette is
    after the response's background tasks.  "Whole" counts non-empty body chunks, as the WSGI face
    does: one chunk among empty ones (Starlette's ``BaseHTTPMiddleware`` sends a response as its one
    chunk and an empty final one) is a whole response; a second non-empty chunk before the end makes
    a stream, passed on from there (the first chunk waits for the second, as on the WSGI face).
    """

    def __init__(self, send: Send, settle: Callable[[Message, bytes], Awaitable[None]]) -> None:
        self._send = send
        self._settle = settle
        self.start: Message | None = None
        #: The one non-empty body chunk received so far (not sent yet), or ``b""``.
        self.held = b""
        self.streaming = False
        #: The whole response was handed to ``settle``.
        self.settled = False

    async def __call__(self, message: Message) -> None:
        if self.streaming or self.settled:
            await self._send(message)
            return
        kind = message["type"]
        if kind == "http.response.start" and self.start is None:
            self.start = message
            if message.get("trailers", False):
                await self._stream()
            return
        if kind == "http.response.body" and self.start is not None:
            chunk = bytes(message.get("body", b""))
            if not message.get("more_body", False):
                if not (chunk and self.held):
                    self.settled = True
                    await self._settle(self.start, self.held or chunk)
                    return
            elif not chunk:
                return  # an empty chunk changes nothing
            elif not self.held:
                self.held = chunk
                return
        # A second non-empty chunk, trailers, pathsend, ...: a streaming
        # response.  It is passed on as it comes and never stored.
        await self._stream()
        await self._send(message)

    async def _stream(self) -> None:
        self.streaming = True
        if self.start is not None:
            await self._send(self.start)
        if self.held:
            await self._send({"type": "http.response.body", "body": self.held, "more_body": True})


async def _send_response(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
