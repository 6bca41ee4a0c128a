"""``WSGIIdempotencyMiddleware``: the ``Idempotency-Key`` HTTP header for WSGI apps (Flask, Django ...).

The same middleware as :class:`stateguard.http.asgi.IdempotencyMiddleware`
(the same options, answers, stored-status policy, per-client scopes, tables
and fingerprints: the decisions are :mod:`stateguard.http.core`'s), for any
PEP 3333 application.  It imports no framework::

    from flask import Flask
    from stateguard.http.wsgi import WSGIIdempotencyMiddleware

    app = Flask(__name__)
    app.wsgi_app = WSGIIdempotencyMiddleware(app.wsgi_app, session_factory=SessionLocal,
                                             required_paths=["/payments"])

It wraps ``app.wsgi_app``, so it runs before Flask: the principal comes from
the WSGI environ (``REMOTE_USER``, else a credential digest), and several
worker processes may serve one key (one runs the app, the others get 409,
then the replay).  A response of several chunks keeps its key in progress
until the server closes it.  See ``docs/how-to/http.md``.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Callable, Iterable, Iterator
from http import HTTPStatus
from typing import Any, ClassVar, TypeAlias

from sqlalchemy.orm import Session

from ..exceptions import ConfigurationError
from .core import Admitted, KeyedRequest, MiddlewareCore, admit, too_large
from .principal import principal, scope_from_principal
from .request import HttpRequest
from .responses import Response

__all__ = ["WSGIIdempotencyMiddleware", "default_scope", "principal_of"]

log = logging.getLogger("stateguard.wsgi")

Environ: TypeAlias = dict[str, Any]
StartResponse: TypeAlias = Callable[..., Callable[[bytes], object]]
WSGIApp: TypeAlias = Callable[[Environ, StartResponse], Iterable[bytes]]


def _request(environ: Environ) -> HttpRequest:
    headers = [
        (name[5:].replace("_", "-").lower().encode("latin-1"), str(value).encode("latin-1"))
        for name, value in environ.items()
        if name.startswith("HTTP_")
    ]
    for name, header in (("CONTENT_TYPE", b"content-type"), ("CONTENT_LENGTH", b"content-length")):
        if environ.get(name):
            headers.append((header, str(environ[name]).encode("latin-1")))
    return HttpRequest(
        method=str(environ.get("REQUEST_METHOD", "")).upper(),
        path=str(environ.get("SCRIPT_NAME", "")) + str(environ.get("PATH_INFO", "")),
        query=str(environ.get("QUERY_STRING", "")).encode("latin-1"),
        headers=headers,
        native=environ,
        remote_user=environ.get("REMOTE_USER") or None,
    )


def principal_of(environ: Environ, *, session_cookies: Iterable[str] = ()) -> str | None:
    """Who sent the request (an opaque string of digests), or ``None`` when nothing in it names the client.

    ``"remote_user:"`` + SHA-256 of ``REMOTE_USER`` (the user the server or
    an auth middleware authenticated: a client cannot set it), else
    ``"authorization:"`` + SHA-256 of that header, else ``"cookie:"`` +
    SHA-256 of the cookies named in ``session_cookies`` (no other cookie is
    read)::

        WSGIIdempotencyMiddleware(app.wsgi_app, session_factory=SessionLocal,
                                  scope=lambda e: f"payments:{principal_of(e, session_cookies=['session'])}")
    """
    return principal(_request(environ), session_cookies)


def default_scope(environ: Environ, *, session_cookies: Iterable[str] = ()) -> str:
    """``"http:"`` + :func:`principal_of`, or ``"http"`` without one (as the ASGI face)."""
    return scope_from_principal(principal_of(environ, session_cookies=session_cookies))


def _status_line(status: int) -> str:
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} Unknown"


class _TooLarge(Exception):
    pass


def _read_body(environ: Environ, limit: int) -> bytes | None:
    """The whole request body (``None``: the client sent less than it announced), or :class:`_TooLarge`."""
    stream = environ.get("wsgi.input")
    length_text = str(environ.get("CONTENT_LENGTH") or "").strip()
    if length_text:
        try:
            length = int(length_text)
        except ValueError:
            return None
        if length > limit:
            raise _TooLarge
        want = length
    elif environ.get("wsgi.input_terminated"):
        want = limit + 1  # chunked: read to the end, at most one byte over the limit
    else:
        return b""  # PEP 3333: without CONTENT_LENGTH there is no body to read
    chunks: list[bytes] = []
    got = 0
    while stream is not None and got < want:
        chunk = stream.read(want - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    if got > limit:
        raise _TooLarge
    if length_text and got < want:
        return None
    return b"".join(chunks)


def _route_path(environ: Environ) -> str:
    """The path the app routes on, as werkzeug (Flask) routes it: ``PATH_INFO`` from UTF-8, one
    leading slash.

    ``required_paths`` and ``routes`` name the app's own routes, and PATH_INFO is already without
    SCRIPT_NAME.  But PEP 3333 hands its bytes as latin-1 (``/zahlungen/über`` arrives as
    ``/zahlungen/Ã¼ber``), and werkzeug routes ``//payments`` and ``payments`` (what gunicorn leaves
    of ``/apipayments`` under ``SCRIPT_NAME=/api``) to ``/payments``: matched as they came, those
    keyless requests ran a required route.  A framework that does not strip them answers 404 there;
    a key required for a 404 costs nothing.
    """
    path = str(environ.get("PATH_INFO", ""))
    with contextlib.suppress(UnicodeEncodeError):  # not latin-1: a server that already decoded it
        path = path.encode("latin-1").decode("utf-8", "replace")
    return "/" + path.lstrip("/")


class WSGIIdempotencyMiddleware(MiddlewareCore["WSGIApp", "Callable[[], Session]"]):
    """Make POST and PATCH requests with an ``Idempotency-Key`` header run once and replay after (WSGI).

    The options are :class:`~stateguard.http.asgi.IdempotencyMiddleware`'s;
    the callables (``scope``, ``principal``, ``routes``) receive the WSGI
    environ.  ``session_factory`` must make synchronous Sessions (a
    ``sessionmaker``): an ``async_sessionmaker`` or an Engine is refused
    when the middleware is built.  A Flask app that logs users in with its
    session cookie names it in ``session_cookies``; a keyed request that
    names no client is answered 400 unless ``anonymous="shared"``.  Path
    patterns match ``PATH_INFO`` as Flask routes it: decoded from UTF-8, its
    leading slashes as one (``//payments`` is ``/payments``)::

        app.wsgi_app = WSGIIdempotencyMiddleware(
            app.wsgi_app,
            session_factory=sessionmaker(engine),
            required_paths=["/payments"],
            session_cookies=["session"],          # Flask's session cookie identifies a client
        )

    :raises InvalidArgument: a wrong option, when built.
    """

    where: ClassVar[str] = "WSGIIdempotencyMiddleware"
    allow_async: ClassVar[bool] = False

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        settings = self.options.settings_for(_route_path(environ), environ)
        method = str(environ.get("REQUEST_METHOD", "")).upper()
        if settings is None or method not in settings.methods:
            return self.app(environ, start_response)
        request = _request(environ)
        admitted = admit(self.options, settings, request, log)
        if admitted is None:
            return self.app(environ, start_response)
        if not isinstance(admitted, Admitted):
            return _answer(start_response, admitted)
        try:
            body = _read_body(environ, settings.max_body)
        except _TooLarge:
            return _answer(start_response, too_large(self.options, settings))
        if body is None:
            short = "the request body is shorter than its Content-Length"
            return _answer(start_response, self.options.problem(400, "Incomplete request body", short))
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))
        keyed = KeyedRequest(self.options, settings, request, admitted.key, body, log, scope=admitted.scope)
        session = self.session_factory()
        if not isinstance(session, Session):
            raise ConfigurationError(f"session_factory() returned {session!r}, not a Session")
        try:
            answer = keyed.claim(session)
            if answer is None:
                result = self._run(environ, start_response, session, keyed)
            else:  # a replay, 409, 422 or 503: the app does not run, and the session is closed below
                result = _answer(start_response, answer)
        except BaseException:
            session.close()
            raise
        if not isinstance(result, _Stream):
            session.close()
        return result  # a stream settles the key and closes the session when the server closes it

    def _run(
        self, environ: Environ, start_response: StartResponse, session: Session, keyed: KeyedRequest
    ) -> Iterable[bytes]:
        started: list[tuple[str, list[tuple[str, str]]]] = []
        chunks: list[bytes] = []
        forwarding = False

        def capture(
            status: str, headers: list[tuple[str, str]], exc_info: Any = None
        ) -> Callable[[bytes], object]:
            if forwarding:
                return start_response(status, headers, exc_info)
            started[:] = [(status, list(headers))]
            return write

        def write(data: bytes) -> None:
            if data:
                chunks.append(bytes(data))

        result: Iterable[bytes] | None = None
        try:
            result = self.app(environ, capture)
            iterator = iter(result)
            exhausted = False
            while len(chunks) <= 1:
                chunk = next(iterator, None)
                if chunk is None:
                    exhausted = True
                    break
                write(chunk)
            if not started:
                raise RuntimeError("the WSGI app returned without calling start_response")
        except BaseException as error:
            keyed.fail(session, error)
            _close(result)
            raise
        status_text, headers = started[0]
        if exhausted:
            # The whole response, in one piece: recorded before it is sent.
            body = b"".join(chunks)
            try:
                status = int(status_text.split(None, 1)[0])
                raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
            except (ValueError, IndexError, UnicodeEncodeError) as error:
                keyed.fail(session, error)
                _close(result)
                raise
            keyed.settle(session, status, raw, body)
            _close(result)  # after the record, as the ASGI face before Starlette's background tasks
            start_response(status_text, headers)
            return [body]
        # Several chunks: a stream, passed on as it comes and never stored.  The key stays in
        # progress while the server sends it (a twin is 409, as on the ASGI face) and is released
        # when the server closes the iterable (PEP 3333: at the end, or when the client went away).
        forwarding = True
        try:
            start_response(status_text, headers)
        except BaseException as error:
            keyed.fail(session, error)
            _close(result)
            raise
        return _Stream(chunks, iterator, result, lambda: keyed.incomplete(session), session)


class _Stream:
    """The rest of a streamed response after the chunks already read.

    ``close()`` reaches the app's, then releases the key and closes the
    middleware's session; a server that never closes it leaves the key to
    its lease.
    """

    def __init__(
        self,
        head: list[bytes],
        rest: Iterator[bytes],
        result: Iterable[bytes],
        settle: Callable[[], None],
        session: Session,
    ) -> None:
        self._head = head
        self._rest = rest
        self._result = result
        self._settle: Callable[[], None] | None = settle
        self._session = session

    def __iter__(self) -> Iterator[bytes]:
        yield from self._head
        yield from self._rest

    def close(self) -> None:
        settle, self._settle = self._settle, None
        if settle is None:
            return
        try:
            _close(self._result)
        finally:
            try:
                settle()
            finally:
                self._session.close()


def _close(result: Iterable[bytes] | None) -> None:
    close = getattr(result, "close", None)
    if close is not None:
        close()


def _answer(start_response: StartResponse, response: Response) -> list[bytes]:
    status, headers, body = response
    start_response(_status_line(status), [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers])
    return [body]
