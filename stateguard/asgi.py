"""``IdempotencyMiddleware``: the ``Idempotency-Key`` HTTP header on top of :func:`stateguard.idempotent`.

A pure ASGI middleware (it works with Starlette, FastAPI and any other ASGI
framework, and imports none of them) following the IETF draft "The
Idempotency-Key HTTP Header Field"::

    from fastapi import FastAPI
    from stateguard.asgi import IdempotencyMiddleware

    app = FastAPI()
    app.add_middleware(
        IdempotencyMiddleware,
        session_factory=SessionLocal,           # your sessionmaker
        required_paths=["/payments"],           # 400 without a key there
        scope=lambda s: f"api:{s['state']['account_id']}",   # optional: see below
    )

Keys are per client: the default scope (:func:`default_scope`) is derived
from the request's principal (:func:`principal_of`: an authenticated
``scope["user"]``, else a SHA-256 of the ``Authorization`` or ``Cookie``
header; ``"http"`` for requests without credentials).  Stored responses
never carry :data:`CREDENTIAL_HEADERS` (``Set-Cookie`` ...).

For each POST or PATCH request carrying ``Idempotency-Key``:

=========================================  ====================================================
the key is ...                             the middleware answers
=========================================  ====================================================
new                                        runs the app; stores 2xx, 3xx and 4xx responses
                                           (status, headers, body), except the 4xx of a
                                           request refused before it ran (400, 401, 403, 404,
                                           405, 408, 409, 413, 415, 422, 425, 429), which
                                           forget the key (a corrected request may use it);
                                           5xx and streaming responses release it (the same
                                           request runs the app again)
completed with the same request            the stored response, plus ``Idempotency-Replayed:
                                           true``; the app does not run
being worked on (live lease)               409 with ``Retry-After``: the seconds left on
                                           that lease, rounded up
claimed, but its lease ended (the worker   runs the app again (a takeover); the first
died or outlived ``lease``)                request, if still alive, cannot store its response
reused with a different request            422 (also while the first request is in flight)
missing on a ``required_paths`` route      400
blank, too long, not printable ASCII       400
request body above ``max_body``            413
=========================================  ====================================================

"The same request" means the same method, path, query string and body: a
JSON body (``application/json`` or ``+json``) by its canonical form, the way
:func:`stateguard.idempotent` compares fingerprints (keys in any order, any
whitespace), any other body (and JSON that does not parse) by its bytes.
Only a SHA-256 is stored, never the body.

The claim uses ``mode="separate"``: it is committed in its own transaction
*before* the app runs, because the route handler works with its own sessions
and transactions, which the middleware cannot join.  So a handler that
crashes half-way is not rolled back by the middleware: the key is released
(the client may retry) and the handler must make its own writes atomic, as
without the middleware.  The response is stored (``complete``) after the
handler sent it whole (before a Starlette background task runs) and before
it is sent, so a client that sees a response can always get it again.  With
the database unreachable before the claim the answer is 503 (the app does
not run); a response the database cannot store is sent, and its replays
answer a 500 problem saying so (the app does not run again).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from decimal import Decimal, InvalidOperation
from typing import Any, TypeAlias, TypeVar

from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from .exceptions import (
    ConfigurationError,
    IdempotencyKeyReused,
    InvalidArgument,
    LeaseLost,
    RequestInProgress,
    SerializationConflict,
)
from .idempotency import IdempotentCall, fingerprint_of, idempotent
from .tables import MAX_KEY, MAX_SCOPE

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
ScopeFn: TypeAlias = Callable[[Scope], str]
RoutesFn: TypeAlias = Callable[[Scope], "RouteOptions | None"]

_T = TypeVar("_T")

#: Request header (lower case, as ASGI delivers it) and the replay marker.
KEY_HEADER = b"idempotency-key"
REPLAYED_HEADER = b"idempotency-replayed"

#: Hop-by-hop headers (RFC 9110 section 7.6.1) describe one connection, not the response: never stored.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)

#: Response headers that carry credentials or set a client's state: never stored, so a replay cannot
#: hand one client's session or token to whoever sends the key.  The live response keeps them; a
#: replay goes without (a client that lost a response with a cookie does not get the cookie again).
#: ``WWW-Authenticate`` stays: a challenge is the same for everyone and holds no secret.
CREDENTIAL_HEADERS = frozenset(
    {
        b"set-cookie",
        b"set-cookie2",
        b"authorization",
        b"proxy-authorization",
        b"cookie",
        b"authentication-info",
        b"proxy-authentication-info",
    }
)

#: 4xx answers that mean the request was refused before it ran: not stored by default (Stripe saves
#: no result "if incoming parameters failed validation, or the request conflicted with another that
#: was executing concurrently").  Malformed or invalid (400, 422), not authenticated or not allowed
#: (401, 403), no such route or method (404, 405), a conflict with the resource's current state
#: (409), a body the app does not take (413, 415), and "try again later" (408, 425, 429): storing
#: them would turn the retry they ask for (or a corrected request) into a replay of the refusal.
REFUSED_BEFORE_EXECUTION = frozenset({400, 401, 403, 404, 405, 408, 409, 413, 415, 422, 425, 429})

_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


def default_store_status(status: int) -> bool:
    """The default policy: store 2xx, 3xx and the 4xx answers of requests that ran.

    Not stored: 5xx (the server failed: the client retries and the app runs
    again) and :data:`REFUSED_BEFORE_EXECUTION` (400, 401, 403, 404, 405,
    408, 409, 413, 415, 422, 425, 429: the request was refused before it
    ran, so its key is forgotten and a corrected request may use it).
    Other 4xx (402 "card declined", 410, 412 ...) are outcomes of a request
    that ran: stored and replayed.  A handler that answers one of the
    refusal codes *after* acting must be covered by its own policy::

        def store(status: int) -> bool:
            return status == 409 or default_store_status(status)   # our 409 comes after the charge

        app.add_middleware(IdempotencyMiddleware, session_factory=SessionLocal, store_status=store)
    """
    return 200 <= status < 500 and status not in REFUSED_BEFORE_EXECUTION


def _digest(*parts: bytes) -> str:
    return hashlib.sha256(b"\n".join(parts)).hexdigest()


def _user_identity(user: Any) -> str | None:
    """``scope["user"]``'s identity when an auth middleware authenticated it, else ``None``."""
    try:
        if getattr(user, "is_authenticated", False) is not True:
            return None
    except NotImplementedError:
        return None
    for attribute in ("identity", "display_name", "username", "id"):
        try:
            value = getattr(user, attribute, None)
        except NotImplementedError:
            continue
        if isinstance(value, str | int) and not isinstance(value, bool) and str(value):
            return str(value)
    raise ConfigurationError(
        f"scope['user'] ({type(user).__name__}) is authenticated but has no identity, display_name, "
        "username or id to keep its idempotency keys apart from other clients'; give it one, or pass "
        "IdempotencyMiddleware(scope=...) a callable that returns the client's identity"
    )


def principal_of(scope: Scope) -> str | None:
    """Who sent the request, as an opaque string, or ``None`` when it carries no credentials.

    In this order:

    1. ``scope["user"]`` when an auth middleware that runs before this one
       authenticated it (Starlette's ``AuthenticationMiddleware`` and the
       like): ``"user:"`` + SHA-256 of its ``identity`` (or ``display_name``,
       ``username``, ``id``).  Stable across token refreshes.
    2. the ``Authorization`` header: ``"authorization:"`` + SHA-256 of its
       value.  This middleware runs before the app checks the credential, so
       the whole credential must match, not only the user it names.
    3. the ``Cookie`` header: ``"cookie:"`` + SHA-256 of its value.

    Only digests, never a credential, reach the database::

        IdempotencyMiddleware(app, session_factory=SessionLocal,
                              scope=lambda s: f"payments:{principal_of(s) or 'anonymous'}")

    :raises ConfigurationError: ``scope["user"]`` is authenticated but has no identity.
    """
    user = scope.get("user")
    if user is not None:
        identity = _user_identity(user)
        if identity is not None:
            return f"user:{_digest(identity.encode('utf-8'))}"
    for name in (b"authorization", b"cookie"):
        values = _header_values(scope, name)
        if values:
            return f"{name.decode('ascii')}:{_digest(*values)}"
    return None


def default_scope(scope: Scope) -> str:
    """The default idempotency scope: ``"http:"`` + :func:`principal_of`, or ``"http"`` without credentials.

    Keys are chosen by clients, so each client gets its own namespace: a
    client that sends another's key gets its own execution, never the other's
    response, and never a 422 for the other's request.  Requests without
    credentials share the namespace ``"http"``.
    """
    principal = principal_of(scope)
    return "http" if principal is None else f"http:{principal}"


@dataclass(frozen=True, slots=True)
class RouteOptions:
    """Per-route settings of :class:`IdempotencyMiddleware`; ``None`` keeps the middleware's value.

    ::

        app.add_middleware(
            IdempotencyMiddleware,
            session_factory=SessionLocal,
            routes={
                "/payments": RouteOptions(required=True, lease=timedelta(minutes=5)),
                "/uploads/*": {"max_body": 50_000_000},      # a dict works too
                "/webhooks/*": RouteOptions(enabled=False),  # never look at the header there
            },
        )

    ``enabled=False`` passes the route's requests through untouched.
    """

    enabled: bool = True
    required: bool | None = None
    scope: str | ScopeFn | None = None
    methods: Iterable[str] | None = None
    lease: timedelta | None = None
    ttl: timedelta | None = None
    max_body: int | None = None
    heartbeat_every: timedelta | None = None
    store_status: Callable[[int], bool] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise InvalidArgument(f"RouteOptions.enabled must be True or False, got {self.enabled!r}")
        if self.required is not None and not isinstance(self.required, bool):
            raise InvalidArgument(f"RouteOptions.required must be True, False or None, got {self.required!r}")
        if self.scope is not None:
            _check_scope(self.scope)
        if self.methods is not None:
            object.__setattr__(self, "methods", _check_methods(self.methods))
        for name in ("lease", "ttl", "heartbeat_every"):
            value = getattr(self, name)
            if value is not None:
                _check_duration(name, value)
        if self.max_body is not None:
            _check_max_body(self.max_body)
        if self.store_status is not None:
            _check_store_status(self.store_status)


@dataclass(frozen=True, slots=True)
class _Settings:
    """The effective settings for one request."""

    required: bool
    scope: str | ScopeFn
    methods: frozenset[str]
    lease: timedelta
    ttl: timedelta
    max_body: int
    heartbeat_every: timedelta | None
    store_status: Callable[[int], bool]


def _check_scope(scope: Any) -> None:
    if callable(scope):
        return
    if not isinstance(scope, str) or not scope.strip():
        raise InvalidArgument(
            f"scope must be a non-blank string or a callable of the ASGI scope, got {scope!r}"
        )
    if len(scope) > MAX_SCOPE or "\x00" in scope:
        raise InvalidArgument(
            f"scope must be at most {MAX_SCOPE} characters without NUL, got {len(scope)} characters"
        )


def _check_methods(methods: Iterable[str]) -> frozenset[str]:
    if isinstance(methods, str):
        raise InvalidArgument(f"methods must be a list of HTTP methods, not the string {methods!r}")
    out: set[str] = set()
    for method in methods:
        if not isinstance(method, str) or not method or not set(method) <= _TOKEN_CHARS:
            raise InvalidArgument(f"not an HTTP method: {method!r}")
        out.add(method.upper())
    if not out:
        raise InvalidArgument("methods must name at least one HTTP method, e.g. ['POST', 'PATCH']")
    return frozenset(out)


def _check_duration(name: str, value: Any) -> None:
    if not isinstance(value, timedelta) or value <= timedelta(0):
        raise InvalidArgument(f"{name} must be a positive datetime.timedelta, got {value!r}")


def _check_store_status(value: Any) -> None:
    if not callable(value):
        raise InvalidArgument(f"store_status must be a callable of the status code, got {value!r}")


def _check_max_body(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"max_body must be a whole number of bytes >= 0, got {value!r}")


def _check_timing(settings: _Settings, where: str) -> None:
    """The rules :func:`stateguard.idempotent` enforces, checked when the middleware is built."""
    lease = settings.lease
    if settings.ttl < lease:
        raise InvalidArgument(f"{where}: ttl ({settings.ttl}) must not be shorter than lease ({lease})")
    if settings.heartbeat_every is not None and settings.heartbeat_every >= lease:
        raise InvalidArgument(
            f"{where}: heartbeat_every ({settings.heartbeat_every}) must be shorter than lease ({lease})"
        )


def _check_pattern(pattern: Any, what: str) -> str:
    if not isinstance(pattern, str) or not pattern.startswith("/"):
        raise InvalidArgument(f"{what} entries must be paths starting with '/', got {pattern!r}")
    if "*" in pattern[:-1]:
        raise InvalidArgument(f"{what} entry {pattern!r}: '*' is allowed only at the end (a prefix match)")
    return pattern


def _matches(pattern: str, path: str) -> bool:
    """``/payments`` matches itself only; ``/payments/*`` (or ``/payments*``) matches by prefix."""
    if pattern.endswith("*"):
        return path.startswith(pattern[:-1])
    return path == pattern


def _route_options(value: Any, pattern: str) -> RouteOptions:
    if isinstance(value, RouteOptions):
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in fields(RouteOptions)}
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise InvalidArgument(
                f"routes[{pattern!r}]: unknown option(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        return RouteOptions(**value)
    raise InvalidArgument(
        f"routes[{pattern!r}] must be a RouteOptions or a dict of its fields, got {value!r}"
    )


async def _in_thread(fn: Callable[..., _T], *args: Any) -> _T:
    """Run blocking database work off the event loop (anyio's thread pool when anyio is there)."""
    try:
        import anyio.to_thread
    except ImportError:  # pragma: no cover - anyio comes with starlette
        return await asyncio.to_thread(fn, *args)
    return await anyio.to_thread.run_sync(fn, *args)


# --------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------


class _BadKey(Exception):
    """The header value is not a usable key (the message is the 400 detail)."""


def _parse_key(values: list[bytes]) -> str:
    """The key from the ``Idempotency-Key`` header values, or :class:`_BadKey`.

    The draft defines the value as a Structured Field string (``"abc"``,
    RFC 8941); a bare token (``abc``) is accepted too, since many clients send
    one, but not with a comma in it (that is two headers a proxy joined).  The
    key is used exactly as sent: no trimming, no case folding.
    """
    if len(values) != 1:
        raise _BadKey("send exactly one Idempotency-Key header")
    raw = values[0]
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise _BadKey("the Idempotency-Key must be printable ASCII") from None
    if text.startswith('"'):
        text = _sf_string(text)
    elif "," in text:
        # Two header lines joined by a proxy (RFC 9110 section 5.3: "a, b"): not one key.
        raise _BadKey(
            "send exactly one Idempotency-Key header (a key with a comma must be sent quoted, as a "
            'Structured Field string: "a,b")'
        )
    if not text.strip():
        raise _BadKey("the Idempotency-Key is blank")
    if any(not (" " <= c <= "~") for c in text):
        raise _BadKey("the Idempotency-Key must be printable ASCII")
    if len(text) > MAX_KEY:
        raise _BadKey(f"the Idempotency-Key is {len(text)} characters long; the limit is {MAX_KEY}")
    return text


def _sf_string(text: str) -> str:
    # RFC 8941 section 4.2.5: DQUOTE *( unescaped / "\" ( DQUOTE / "\" ) ) DQUOTE
    out: list[str] = []
    i = 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            if i + 1 >= len(text) or text[i + 1] not in '"\\':
                raise _BadKey('the Idempotency-Key is not a valid string: only \\" and \\\\ may be escaped')
            out.append(text[i + 1])
            i += 2
            continue
        if c == '"':
            if i != len(text) - 1:
                raise _BadKey("the Idempotency-Key has characters after its closing quote")
            return "".join(out)
        out.append(c)
        i += 1
    raise _BadKey("the Idempotency-Key has no closing quote")


def _header_values(scope: Scope, name: bytes) -> list[bytes]:
    return [bytes(v) for k, v in scope.get("headers", ()) if bytes(k).lower() == name]


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


def _is_json(scope: Scope) -> bool:
    """``Content-Type: application/json`` or any ``+json`` type (RFC 6839), parameters ignored."""
    values = _header_values(scope, b"content-type")
    if len(values) != 1:
        return False
    media = values[0].split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (b"/" in media and media.endswith(b"+json"))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Parsers disagree on which of two equal keys wins, so such a body has no
    # single meaning to compare: it keeps its raw bytes' fingerprint.
    out: dict[str, Any] = {}
    for name, value in pairs:
        if name in out:
            raise ValueError(f"duplicate key {name!r}")
        out[name] = value
    return out


def _exact_float(text: str) -> float:
    # A number a double holds only approximately (12345678901234567890.5 is 12345678901234567168.0)
    # has no single meaning: a handler parsing Decimals sees another amount than one parsing floats,
    # so two such bodies that round to one double must not count as one request.  The double's
    # shortest repr is compared by value: 0.1, 1.50 and 2e3 are exact in this sense; 1e400 is not.
    value = float(text)
    if not math.isfinite(value) or Decimal(text) != Decimal(repr(value)):
        raise ValueError(f"the number {text[:40]} has no exact double")
    return value


def _json_digest(body: bytes) -> str | None:
    """The body's canonical JSON fingerprint (:func:`stateguard.fingerprint_of`), or ``None`` if not JSON."""
    try:
        value = json.loads(
            body, parse_float=_exact_float, parse_constant=_no_constant, object_pairs_hook=_unique_keys
        )
        return fingerprint_of({"json": value})
    except (ValueError, RecursionError, InvalidOperation):
        # Not UTF-8 or not JSON, NaN/Infinity, a number too large or not exactly a
        # double, a lone surrogate, duplicate keys, nesting deeper than Python recurses.
        return None


def _fingerprint_of(scope: Scope, body: bytes) -> dict[str, str]:
    """What makes two requests "the same": method, path, query string and the body.

    A JSON body (``application/json`` or ``+json``) counts by its canonical
    form, as :func:`stateguard.idempotent` compares fingerprints: the same
    object with its keys in another order or other whitespace is the same
    request.  Any other body, and a JSON body that does not parse, counts
    by its bytes.
    """
    request = {
        "method": str(scope["method"]).upper(),
        "path": str(scope.get("path", "")),
        "query": bytes(scope.get("query_string", b"")).decode("latin-1"),
    }
    digest = _json_digest(body) if _is_json(scope) else None
    if digest is not None:
        request["json_sha256"] = digest
    else:
        request["body_sha256"] = hashlib.sha256(body).hexdigest()
    return request


# --------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------


class _Recorder:
    """Buffers the app's response; switches to pass-through when it turns out to stream.

    Once the app sent its whole response (one body message without ``more_body``), ``settle``
    is awaited with it (the middleware records the key, then sends the response), right then:
    not after the app returns, which with Starlette is after the response's background tasks.
    """

    def __init__(self, send: Send, settle: Callable[[Message, bytes], Awaitable[None]]) -> None:
        self._send = send
        self._settle = settle
        self.start: Message | None = None
        self.body: bytes | None = None
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
        if (
            kind == "http.response.body"
            and self.start is not None
            and self.body is None
            and not message.get("more_body", False)
        ):
            self.body = body = bytes(message.get("body", b""))
            self.settled = True
            await self._settle(self.start, body)
            return
        # More than one body chunk, trailers, pathsend, ...: a streaming
        # response.  It is passed on as it comes and never stored.
        await self._stream()
        await self._send(message)

    async def _stream(self) -> None:
        self.streaming = True
        if self.start is not None:
            await self._send(self.start)


def _stored_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[list[str]]:
    pairs = [(bytes(k).lower(), bytes(v)) for k, v in headers]
    named = {
        token.strip().lower().encode("latin-1")
        for k, v in pairs
        if k == b"connection"
        for token in v.decode("latin-1").split(",")
    }
    return [
        [k.decode("latin-1"), v.decode("latin-1")]
        for k, v in pairs
        if k not in _HOP_BY_HOP and k not in CREDENTIAL_HEADERS and k not in named and k != REPLAYED_HEADER
    ]


#: Tries of the write that records a response (the first, and two after a conflict or lost connection).
_FINISH_ATTEMPTS = 3


def _unstored(response: Mapping[str, Any], why: str) -> dict[str, Any]:
    """What a retry is answered when the app's response itself cannot be stored: a 500 problem
    saying that the request ran (so the client does not send it again under a new key)."""
    status = int(response["status"])
    problem = {
        "type": "about:blank",
        "title": "Response not stored",
        "status": 500,
        "detail": f"the request with this Idempotency-Key ran and answered HTTP {status}, but that response "
        f"could not be stored for replay ({why}); it is not run again: look its result up instead",
        "original_status": status,
    }
    body = json.dumps(problem).encode("utf-8")
    return {
        "status": 500,
        "headers": [["content-type", "application/problem+json"], ["content-length", str(len(body))]],
        "body": base64.b64encode(body).decode("ascii"),
    }


async def _send_response(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# --------------------------------------------------------------------------
# The middleware
# --------------------------------------------------------------------------


class IdempotencyMiddleware:
    """Make POST and PATCH requests with an ``Idempotency-Key`` header run once and replay after.

    :param app: the wrapped ASGI app (Starlette's ``add_middleware`` passes it).
    :param session_factory: returns a new :class:`~sqlalchemy.orm.Session`
        (your ``sessionmaker``); the middleware opens one per keyed request
        for the key record only and closes it afterwards.
    :param scope: the idempotency scope: a string, or a callable of the ASGI
        scope returning one.  Keys are chosen by clients, so it must tell
        clients apart.  The default, :func:`default_scope`, derives it from
        the request's principal (an authenticated ``scope["user"]``, else a
        digest of the ``Authorization`` or ``Cookie`` header; ``"http"``
        without credentials).  Pass your own where the client is known
        otherwise (``lambda s: f"api:{s['state']['account_id']}"``).  A fixed
        string puts every client in one namespace: one client then receives
        another's stored response when it sends the other's key and body.
    :param required_paths: paths (``/payments``, or prefixes ``/payments/*``)
        where a request without a key is answered 400.
    :param methods: the methods the header is honoured on (default POST, PATCH).
    :param lease: how long a claim stays "in progress" before another request
        may take it over (a worker that died); longer than your slowest handler.
    :param ttl: how long a completed response is kept and replayed.
    :param max_body: largest request body read (bytes); larger ones get 413.
    :param routes: per-route overrides: ``{"/path" or "/prefix/*": RouteOptions | dict}``
        (the longest matching pattern wins), or a callable of the ASGI scope
        returning a :class:`RouteOptions` or ``None``.
    :param store_status: which final statuses are stored (default:
        :func:`default_store_status`: 2xx, 3xx and 4xx but
        :data:`REFUSED_BEFORE_EXECUTION`).  A 4xx that is not stored forgets
        the key (the request was refused before it ran, so any request may
        use the key again); any other status that is not stored releases it
        (only the same request may retry).
    :param heartbeat_every: extend the lease in the background this often
        while the app runs (for handlers that may outlive ``lease``).
    :param documentation: a URL about your idempotency rules; error answers
        link to it (``Link: <url>; rel="describedby"`` and the problem ``type``).

    Errors are answered as RFC 9457 problem details (``application/problem+json``)::

        app.add_middleware(IdempotencyMiddleware, session_factory=SessionLocal,
                           required_paths=["/payments"], scope="shop")

    Stateguard's tables must exist (``stateguard.create_tables(engine)`` or
    the alembic revisions).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        session_factory: Callable[[], Session],
        scope: str | ScopeFn | None = None,
        required_paths: Iterable[str] = (),
        methods: Iterable[str] = ("POST", "PATCH"),
        lease: timedelta = timedelta(seconds=60),
        ttl: timedelta = timedelta(hours=24),
        max_body: int = 1024 * 1024,
        routes: Mapping[str, RouteOptions | Mapping[str, Any]] | RoutesFn | None = None,
        store_status: Callable[[int], bool] = default_store_status,
        heartbeat_every: timedelta | None = None,
        documentation: str | None = None,
    ) -> None:
        if not callable(session_factory):
            raise InvalidArgument(
                "session_factory must be a callable returning a Session (a sessionmaker), "
                f"got {session_factory!r}"
            )
        if scope is None:
            scope = default_scope
        _check_scope(scope)
        if isinstance(required_paths, str):
            raise InvalidArgument(
                f"required_paths must be a list of paths, not the string {required_paths!r}"
            )
        _check_duration("lease", lease)
        _check_duration("ttl", ttl)
        if heartbeat_every is not None:
            _check_duration("heartbeat_every", heartbeat_every)
        _check_max_body(max_body)
        _check_store_status(store_status)
        if documentation is not None and not isinstance(documentation, str):
            raise InvalidArgument(f"documentation must be a URL string, got {documentation!r}")
        self.app = app
        self.session_factory = session_factory
        self.required_paths = tuple(_check_pattern(p, "required_paths") for p in required_paths)
        self.store_status = store_status
        self.documentation = documentation
        self._defaults = _Settings(
            required=False,
            scope=scope,
            methods=_check_methods(methods),
            lease=lease,
            ttl=ttl,
            max_body=max_body,
            heartbeat_every=heartbeat_every,
            store_status=store_status,
        )
        self._routes_fn: RoutesFn | None = None
        self._routes: list[tuple[str, RouteOptions]] = []
        if callable(routes):
            self._routes_fn = routes
        elif routes is not None:
            if not isinstance(routes, Mapping):
                raise InvalidArgument(
                    f"routes must be a dict of path -> RouteOptions or a callable, got {routes!r}"
                )
            table = [(_check_pattern(p, "routes"), _route_options(o, p)) for p, o in routes.items()]
            # Longest pattern first: the most specific route wins.
            self._routes = sorted(table, key=lambda item: len(item[0]), reverse=True)
        _check_timing(self._defaults, "IdempotencyMiddleware")
        for pattern, options in self._routes:
            merged = self._merge(options, required=False)
            if merged is not None:
                _check_timing(merged, f"routes[{pattern!r}]")

    def settings_for(self, scope: Scope) -> _Settings | None:
        """The effective settings for a request, or ``None`` when its route is disabled."""
        path = str(scope.get("path", ""))
        route: RouteOptions | None
        if self._routes_fn is not None:
            route = self._routes_fn(scope)
            if route is not None and not isinstance(route, RouteOptions):
                raise InvalidArgument(f"the routes callable must return RouteOptions or None, got {route!r}")
        else:
            route = next((o for p, o in self._routes if _matches(p, path)), None)
        required = any(_matches(p, path) for p in self.required_paths)
        if route is None:
            base = self._defaults
            return replace(base, required=required)
        return self._merge(route, required=required)

    def _merge(self, route: RouteOptions, *, required: bool) -> _Settings | None:
        """``route``'s settings over the middleware's; ``None`` for a disabled route."""
        if not route.enabled:
            return None
        base = self._defaults
        return _Settings(
            required=required if route.required is None else route.required,
            scope=base.scope if route.scope is None else route.scope,
            methods=base.methods if route.methods is None else frozenset(route.methods),
            lease=route.lease or base.lease,
            ttl=route.ttl or base.ttl,
            max_body=base.max_body if route.max_body is None else route.max_body,
            heartbeat_every=route.heartbeat_every or base.heartbeat_every,
            store_status=route.store_status or base.store_status,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        settings = self.settings_for(scope)
        if settings is None or str(scope["method"]).upper() not in settings.methods:
            await self.app(scope, receive, send)
            return
        values = _header_values(scope, KEY_HEADER)
        if not values:
            if settings.required:
                await self._problem(send, 400, "Idempotency-Key is missing",
                                    f"{scope['method']} {scope.get('path', '')} requires an Idempotency-Key "
                                    "header (a unique value per operation, e.g. a UUID)")  # fmt: skip
                return
            await self.app(scope, receive, send)
            return
        try:
            key = _parse_key(values)
        except _BadKey as error:
            await self._problem(send, 400, "Invalid Idempotency-Key", str(error))
            return
        try:
            body = await _read_body(receive, settings.max_body)
        except _TooLarge:
            await self._problem(send, 413, "Request body too large",
                                "requests with an Idempotency-Key may carry at most "
                                f"{settings.max_body} bytes")  # fmt: skip
            return
        if body is None:
            return  # the client went away before sending its body
        idem_scope = settings.scope(scope) if callable(settings.scope) else settings.scope
        session = self.session_factory()
        try:
            await self._keyed(
                scope, _replaying_receive(body, receive), send, session, settings, idem_scope, key, body
            )
        finally:
            await _in_thread(session.close)

    async def _keyed(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        session: Session,
        settings: _Settings,
        idem_scope: str,
        key: str,
        body: bytes,
    ) -> None:
        fingerprint = _fingerprint_of(scope, body)
        manager = idempotent(
            session,
            scope=idem_scope,
            key=key,
            fingerprint=fingerprint,
            lease=settings.lease,
            ttl=settings.ttl,
            mode="separate",
            heartbeat_every=settings.heartbeat_every,
        )
        try:
            call = await _in_thread(manager.__enter__)
        except RequestInProgress as error:
            retry_after = max(1, math.ceil(error.retry_after.total_seconds()))
            await self._problem(send, 409, "Request in progress",
                                "a request with this Idempotency-Key is still being processed; retry later",
                                [(b"retry-after", str(retry_after).encode("ascii"))])  # fmt: skip
            return
        except SerializationConflict:
            # Also DeadlockDetected: the claim kept losing races against other
            # requests with this key (after idempotent()'s own retries).
            # Nothing was claimed; the client's retry decides.
            await self._problem(send, 409, "Request in progress",
                                "concurrent requests with this Idempotency-Key kept changing it; retry later",
                                [(b"retry-after", b"1")])  # fmt: skip
            return
        except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError):
            # The database is unreachable (or the pool has no connection to give): nothing was
            # claimed and the app did not run.
            log.warning(
                "idempotency key %r in scope %r could not be claimed; answered 503",
                key,
                idem_scope,
                exc_info=True,
            )
            await self._problem(send, 503, "Idempotency store unavailable",
                                "the request was not run: its Idempotency-Key could not be recorded (the "
                                "database is unreachable); retry later with the same key",
                                [(b"retry-after", b"1")])  # fmt: skip
            return
        except IdempotencyKeyReused:
            await self._problem(send, 422, "Idempotency-Key reused",
                                "this Idempotency-Key was already used for a different request "
                                "(method, path, query or body); use a new key for a new request")  # fmt: skip
            return
        if call.replayed:
            await _in_thread(manager.__exit__, None, None, None)
            await self._replay(send, call.response)
            return
        exited = False

        async def settle(start: Message, body: bytes) -> None:
            # The app's whole response: record the key (store, forget or release), then send it.
            nonlocal exited
            status = int(start["status"])
            reason: str | None = None
            forget = False
            response: dict[str, Any] | None = None
            if settings.store_status(status):
                response = {
                    "status": status,
                    "headers": _stored_headers(start.get("headers", ())),
                    "body": base64.b64encode(body).decode("ascii"),
                }
            else:
                # A 4xx not stored was refused before it ran: forget the key, so that the
                # corrected request may use it (not only a byte-identical retry).
                reason, forget = f"HTTP {status}, not stored", 400 <= status < 500
            try:
                await _in_thread(self._finish, call, response, reason, forget)
            except Exception as error:
                # The database failed at the end (it is unreachable, say): the app ran and
                # answered, so its answer is sent all the same.  The key is released, or, if
                # the release fails too, stays in progress until its lease ends.
                log.error(
                    "could not record the response of idempotency key %r in scope %r; the app's "
                    "response is sent unrecorded",
                    key,
                    idem_scope,
                    exc_info=True,
                )
                await _in_thread(manager.__exit__, type(error), error, error.__traceback__)
            else:
                await _in_thread(manager.__exit__, None, None, None)
            exited = True
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": False})

        recorder = _Recorder(send, settle)
        try:
            await self.app(scope, receive, recorder)
        except Exception as error:
            # Before the whole response was recorded: idempotent() releases the key and
            # re-raises.  After it (a background task failed, the client went away while it
            # was sent): the key is recorded already and the error is the server's to log.
            if not exited:
                await _in_thread(manager.__exit__, type(error), error, error.__traceback__)
            raise
        except BaseException as error:
            # Cancelled: the thread pool may refuse new work now, so finish the key record here.
            if not exited:
                manager.__exit__(type(error), error, error.__traceback__)
            raise
        if exited:
            return
        # Streamed, or the app returned without a whole response: nothing to replay.
        try:
            await _in_thread(self._finish, call, None, "the response was streamed or incomplete")
        except BaseException as error:
            await _in_thread(manager.__exit__, type(error), error, error.__traceback__)
            raise
        await _in_thread(manager.__exit__, None, None, None)
        if not recorder.streaming and recorder.start is not None:
            # A start without its final body message: sent, with an empty body to end it.
            await send(recorder.start)
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    def _finish(
        call: IdempotentCall[Session],
        response: dict[str, Any] | None,
        reason: str | None = None,
        forget: bool = False,
    ) -> None:
        """Store ``response``, or release the key (``forget``: delete this request's record).

        A response the database cannot hold (larger than MariaDB's ``max_allowed_packet``) is
        stored as a problem response saying so: the app ran, so a retry must not run it again.
        A conflict or lost connection is tried again twice (the claim is this request's own).
        """
        for attempt in range(1, _FINISH_ATTEMPTS + 1):
            try:
                if response is None:
                    call.release(reason, forget=forget)
                else:
                    try:
                        call.complete(response)
                    except InvalidArgument as error:
                        log.warning(
                            "the response of idempotency key %r in scope %r cannot be stored (%s); its "
                            "replays answer 500 instead",
                            call.key,
                            call.scope,
                            error,
                        )
                        call.complete(_unstored(response, str(error)))
                return
            except LeaseLost:
                # The lease expired while the app ran and another request took the
                # key over: its record wins.  This response is still sent.
                log.warning(
                    "idempotency key %r in scope %r was taken over while the app ran; raise the lease "
                    "(or set heartbeat_every) above the slowest handler",
                    call.key,
                    call.scope,
                )
                return
            except (SerializationConflict, sa_exc.OperationalError, sa_exc.InterfaceError):
                if attempt == _FINISH_ATTEMPTS:
                    raise
                time.sleep(0.05 * attempt)

    async def _replay(self, send: Send, response: Any) -> None:
        status = int(response["status"])
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response["headers"]]
        headers.append((REPLAYED_HEADER, b"true"))
        await _send_response(send, status, headers, base64.b64decode(response["body"]))

    async def _problem(
        self,
        send: Send,
        status: int,
        title: str,
        detail: str,
        extra: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        problem = {
            "type": self.documentation or "about:blank",
            "title": title,
            "status": status,
            "detail": detail,
        }
        body = json.dumps(problem).encode("utf-8")
        headers = [
            (b"content-type", b"application/problem+json"),
            (b"content-length", str(len(body)).encode("ascii")),
            *(extra or []),
        ]
        if self.documentation is not None:
            headers.append((b"link", f'<{self.documentation}>; rel="describedby"'.encode("latin-1")))
        await _send_response(send, status, headers, body)
