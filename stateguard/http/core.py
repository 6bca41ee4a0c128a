"""What the ``Idempotency-Key`` middleware decides, whatever the protocol (ASGI or WSGI) carries it.

Everything here is protocol-independent and synchronous: the options and
their checks (made when a middleware is built, never at the first request),
route matching, the request's idempotency scope (from its principal,
:mod:`stateguard.http.principal`), the encoding of stored responses, and the
claim / settle / replay steps of one keyed request (:class:`KeyedRequest`),
which run on a :class:`~sqlalchemy.orm.Session`.  The key's parsing is
:mod:`stateguard.http.keys`', the request's fingerprint
:mod:`stateguard.http.fingerprint`'s.  The faces, :mod:`stateguard.http.asgi`
and :mod:`stateguard.http.wsgi`, only move bytes: they read the request,
hand these steps a session (in a worker thread, through
``AsyncSession.run_sync``, or directly) and send what they return.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import Any, Literal, TypeAlias

from sqlalchemy import Engine
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_scoped_session, async_sessionmaker
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from ..exceptions import (
    ConfigurationError,
    IdempotencyKeyReused,
    InvalidArgument,
    LeaseLost,
    RequestInProgress,
    SerializationConflict,
)
from ..idempotency import IdempotentCall
from ..idempotency.api import idempotent_with
from ..idempotency.options import IdempotencyOptions, duration_ms, options_of
from ..tables import MAX_SCOPE
from .fingerprint import request_fingerprint as request_fingerprint
from .keys import KEY_HEADER as KEY_HEADER
from .keys import BadKey as BadKey
from .keys import parse_key as parse_key
from .principal import Anonymous, PrincipalFn, app_principal, check_anonymous, check_session_cookies
from .principal import principal as principal
from .principal import scope_from_principal as scope_from_principal
from .request import Headers, HttpRequest, Native
from .request import digest as digest
from .responses import CREDENTIAL_HEADERS as CREDENTIAL_HEADERS
from .responses import HOP_BY_HOP as HOP_BY_HOP
from .responses import REPLAYED_HEADER as REPLAYED_HEADER
from .responses import Response as Response
from .responses import replay_of, unstored
from .responses import stored_headers as stored_headers

__all__ = [
    "CREDENTIAL_HEADERS",
    "REFUSED_BEFORE_EXECUTION",
    "RouteOptions",
    "default_store_status",
]


ScopeFn: TypeAlias = Callable[[Native], str]
RoutesFn: TypeAlias = Callable[[Native], "RouteOptions | None"]

#: 4xx answers that mean the request was refused before it ran: not stored by default (Stripe saves
#: no result "if incoming parameters failed validation, or the request conflicted with another that
#: was executing concurrently").  Malformed or invalid (400, 422), not authenticated or not allowed
#: (401, 403), no such route or method (404, 405), a conflict with the resource's current state
#: (409), a body the app does not take (413, 415), and "try again later" (408, 425, 429): storing
#: them would turn the retry they ask for (or a corrected request) into a replay of the refusal.
REFUSED_BEFORE_EXECUTION = frozenset({400, 401, 403, 404, 405, 408, 409, 413, 415, 422, 425, 429})

_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")

#: Tries of the write that records a response (the first, and two after a conflict or lost connection).
FINISH_ATTEMPTS = 3


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


# --------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------


def check_scope(scope: Any) -> None:
    if callable(scope):
        return
    if not isinstance(scope, str) or not scope.strip():
        raise InvalidArgument(f"scope must be a non-blank string or a callable of the request, got {scope!r}")
    if len(scope) > MAX_SCOPE or "\x00" in scope:
        raise InvalidArgument(
            f"scope must be at most {MAX_SCOPE} characters without NUL, got {len(scope)} characters"
        )


def check_methods(methods: Any) -> frozenset[str]:
    if isinstance(methods, str):
        raise InvalidArgument(f"methods must be a list of HTTP methods, not the string {methods!r}")
    out: set[str] = set()
    for method in _iterable(methods, "methods"):
        if not isinstance(method, str) or not method or not set(method) <= _TOKEN_CHARS:
            raise InvalidArgument(f"not an HTTP method: {method!r}")
        out.add(method.upper())
    if not out:
        raise InvalidArgument("methods must name at least one HTTP method, e.g. ['POST', 'PATCH']")
    return frozenset(out)


def _iterable(value: Any, what: str) -> list[Any]:
    try:
        return list(value)
    except TypeError:
        raise InvalidArgument(f"{what} must be a list, got {value!r}") from None


def check_duration(name: str, value: Any) -> None:
    """A lease, ttl or heartbeat interval, checked as :func:`stateguard.idempotent` checks it."""
    duration_ms(value, name)


def check_store_status(value: Any) -> None:
    if not callable(value):
        raise InvalidArgument(f"store_status must be a callable of the status code, got {value!r}")


def check_max_body(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"max_body must be a whole number of bytes >= 0, got {value!r}")


def check_pattern(pattern: Any, what: str) -> str:
    """A path pattern: ``/payments`` (that path) or ``/payments/*`` (a prefix); refused when built."""
    if not isinstance(pattern, str) or not pattern.startswith("/"):
        raise InvalidArgument(f"{what} entries must be paths starting with '/', got {pattern!r}")
    if "*" in pattern[:-1]:
        prefix = pattern[: pattern.index("*")]
        raise InvalidArgument(
            f"{what} entry {pattern!r}: '*' is allowed only at the end, as a prefix match; use "
            f"{prefix + '*'!r} (every path under it), list the full paths, or pass routes= a callable "
            "of the request that returns RouteOptions(required=True) where your own rule matches"
        )
    return pattern


def matches(pattern: str, path: str) -> bool:
    """``/payments`` matches itself only; ``/payments/*`` (or ``/payments*``) matches by prefix."""
    if pattern.endswith("*"):
        return path.startswith(pattern[:-1])
    return path == pattern


SessionKind: TypeAlias = Literal["sync", "async"]


def check_session_factory(factory: Any, *, allow_async: bool, where: str) -> SessionKind:
    """Whether ``factory`` makes a Session or an AsyncSession; a wrong object is refused now.

    A ``sessionmaker`` / ``async_sessionmaker`` (scoped or not) is known by
    its type; any other callable is called once and its session closed (a
    new session opens no connection until it is used).
    """
    sync_fix = "pass sessionmaker(engine)"
    fix = f"{sync_fix}, or async_sessionmaker(async_engine)" if allow_async else sync_fix
    if isinstance(factory, AsyncEngine | Engine):
        kind = "an AsyncEngine" if isinstance(factory, AsyncEngine) else "an Engine"
        raise InvalidArgument(f"{where}: session_factory is {kind}, not a session factory: {fix}")
    if isinstance(factory, Session | AsyncSession):
        raise InvalidArgument(
            f"{where}: session_factory is one {type(factory).__name__}, shared by every request: {fix} "
            "(the middleware opens a session per request)"
        )
    kind_found: SessionKind
    if isinstance(factory, sessionmaker | scoped_session):
        kind_found = "sync"
    elif isinstance(factory, async_sessionmaker | async_scoped_session):
        kind_found = "async"
    elif callable(factory):
        try:
            made = factory()
        except Exception as error:
            raise InvalidArgument(
                f"{where}: session_factory() raised {error!r}; it must return a new Session: {fix}"
            ) from error
        if isinstance(made, AsyncSession):
            kind_found = "async"
        elif isinstance(made, Session):
            kind_found = "sync"
        else:
            raise InvalidArgument(f"{where}: session_factory() returned {made!r}, not a Session: {fix}")
        made.close() if isinstance(made, Session) else made.sync_session.close()
    else:
        raise InvalidArgument(
            f"{where}: session_factory must be a callable returning a Session (a sessionmaker), "
            f"got {factory!r}: {fix}"
        )
    if kind_found == "async" and not allow_async:
        raise InvalidArgument(
            f"{where}: session_factory makes AsyncSessions, which a WSGI server cannot await: "
            "pass sessionmaker(engine) on a synchronous engine (the same database URL with a sync driver)"
        )
    return kind_found


@dataclass(frozen=True, slots=True)
class RouteOptions:
    """Per-route settings of the middleware; ``None`` keeps the middleware's value.

    ::

        app.add_middleware(
            IdempotencyMiddleware,
            session_factory=SessionLocal,
            routes={
                "/payments": RouteOptions(required=True, lease=timedelta(minutes=5)),
                "/uploads/*": {"max_body": 50_000_000},      # a dict works too
                "/webhooks/*": RouteOptions(enabled=False),  # never look at the header there
                "/signup": RouteOptions(anonymous="shared"),  # no account yet: one namespace
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
    anonymous: Anonymous | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise InvalidArgument(f"RouteOptions.enabled must be True or False, got {self.enabled!r}")
        if self.required is not None and not isinstance(self.required, bool):
            raise InvalidArgument(f"RouteOptions.required must be True, False or None, got {self.required!r}")
        if self.scope is not None:
            check_scope(self.scope)
        if self.methods is not None:
            object.__setattr__(self, "methods", check_methods(self.methods))
        for name in ("lease", "ttl", "heartbeat_every"):
            value = getattr(self, name)
            if value is not None:
                check_duration(name, value)
        if self.max_body is not None:
            check_max_body(self.max_body)
        if self.store_status is not None:
            check_store_status(self.store_status)
        if self.anonymous is not None:
            check_anonymous(self.anonymous, "RouteOptions")


@dataclass(frozen=True, slots=True)
class Settings:
    """The effective settings for one request."""

    required: bool
    #: ``None``: derived from the request's principal (:func:`request_scope`).
    scope: str | ScopeFn | None
    methods: frozenset[str]
    #: The claim's lease, ttl and heartbeat (``mode="separate"``), checked as idempotent() checks them.
    idempotency: IdempotencyOptions
    max_body: int
    store_status: Callable[[int], bool]
    anonymous: Anonymous


def _idempotency(
    lease: timedelta, ttl: timedelta, heartbeat_every: timedelta | None, where: str
) -> IdempotencyOptions:
    """The claim options of a route (always ``mode="separate"``); an error names where they came from."""
    try:
        return options_of(lease, ttl, "separate", None, heartbeat_every, ())
    except InvalidArgument as error:
        raise InvalidArgument(f"{where}: {error}") from None


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


class Options:
    """Every option of one middleware, checked once when it is built.

    ``principal`` (the application's) replaces the principal derived from
    the request (:func:`stateguard.http.principal.principal`, which reads
    ``session_cookies``); ``anonymous`` says what a request naming no client
    gets when the scope is derived (no ``scope=``).
    """

    def __init__(
        self,
        *,
        where: str,
        session_factory: Any,
        allow_async: bool,
        scope: str | ScopeFn | None,
        principal: PrincipalFn | None,
        session_cookies: Iterable[str] = (),
        anonymous: Anonymous = "refuse",
        required_paths: Iterable[str],
        methods: Iterable[str],
        lease: timedelta,
        ttl: timedelta,
        max_body: int,
        routes: Mapping[str, RouteOptions | Mapping[str, Any]] | RoutesFn | None,
        store_status: Callable[[int], bool],
        heartbeat_every: timedelta | None,
        documentation: str | None,
    ) -> None:
        self.session_kind = check_session_factory(session_factory, allow_async=allow_async, where=where)
        self.session_factory = session_factory
        if principal is not None:
            if not callable(principal):
                raise InvalidArgument(
                    f"{where}: principal must be a callable of the request returning a unique name "
                    f"for the client (or None without credentials), got {principal!r}"
                )
            if scope is not None:
                raise InvalidArgument(
                    f"{where}: pass principal= (the default scope built from it) or scope=, not both; "
                    "call your principal inside your scope callable"
                )
        if scope is not None:
            check_scope(scope)
        self.session_cookies = check_session_cookies(session_cookies, where)
        self.anonymous = check_anonymous(anonymous, where)
        #: A keyed request refused as anonymous was logged (once per middleware: the fix is the app's).
        self.warned_anonymous = False
        if isinstance(required_paths, str):
            raise InvalidArgument(
                f"required_paths must be a list of paths, not the string {required_paths!r}"
            )
        idempotency = _idempotency(lease, ttl, heartbeat_every, where)
        check_max_body(max_body)
        check_store_status(store_status)
        if documentation is not None and not isinstance(documentation, str):
            raise InvalidArgument(f"documentation must be a URL string, got {documentation!r}")
        self.principal = principal
        self.required_paths = tuple(
            check_pattern(p, "required_paths") for p in _iterable(required_paths, "required_paths")
        )
        self.store_status = store_status
        self.documentation = documentation
        self.defaults = Settings(
            required=False,
            scope=scope,
            methods=check_methods(methods),
            idempotency=idempotency,
            max_body=max_body,
            store_status=store_status,
            anonymous=self.anonymous,
        )
        self.routes_fn: RoutesFn | None = None
        self.routes: list[tuple[str, RouteOptions]] = []
        if callable(routes):
            self.routes_fn = routes
        elif routes is not None:
            if not isinstance(routes, Mapping):
                raise InvalidArgument(
                    f"routes must be a dict of path -> RouteOptions or a callable, got {routes!r}"
                )
            table = [(check_pattern(p, "routes"), _route_options(o, p)) for p, o in routes.items()]
            # Longest pattern first: the most specific route wins.
            self.routes = sorted(table, key=lambda item: len(item[0]), reverse=True)
        for pattern, options in self.routes:
            self.merge(options, required=False, where=f"routes[{pattern!r}]")

    def settings_for(self, path: str, native: Native) -> Settings | None:
        """The effective settings for a request, or ``None`` when its route is disabled."""
        route: RouteOptions | None
        if self.routes_fn is not None:
            route = self.routes_fn(native)
            if route is not None and not isinstance(route, RouteOptions):
                raise InvalidArgument(f"the routes callable must return RouteOptions or None, got {route!r}")
        else:
            route = next((o for p, o in self.routes if matches(p, path)), None)
        required = any(matches(p, path) for p in self.required_paths)
        if route is None:
            return replace(self.defaults, required=required)
        where = "routes" if self.routes_fn is None else "the RouteOptions of the routes callable"
        return self.merge(route, required=required, where=where)

    def merge(self, route: RouteOptions, *, required: bool, where: str) -> Settings | None:
        """``route``'s settings over the middleware's; ``None`` for a disabled route."""
        if not route.enabled:
            return None
        base = self.defaults
        idempotency = base.idempotency
        if route.lease or route.ttl or route.heartbeat_every:
            idempotency = _idempotency(
                route.lease or idempotency.lease,
                route.ttl or idempotency.ttl,
                route.heartbeat_every or idempotency.heartbeat_every,
                where,
            )
        return Settings(
            required=required if route.required is None else route.required,
            scope=base.scope if route.scope is None else route.scope,
            methods=base.methods if route.methods is None else frozenset(route.methods),
            idempotency=idempotency,
            max_body=base.max_body if route.max_body is None else route.max_body,
            store_status=route.store_status or base.store_status,
            anonymous=route.anonymous or base.anonymous,
        )

    def problem(
        self, status: int, title: str, detail: str, extra: Headers | None = None
    ) -> tuple[int, Headers, bytes]:
        """An RFC 9457 problem response: ``(status, headers, body)``."""
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
        return status, headers, body


def request_scope(
    options: Options, settings: Settings, request: HttpRequest, log: logging.Logger
) -> str | None:
    """The idempotency scope of a keyed request, or ``None`` when it is refused as anonymous.

    ``scope=`` (a string, or the callable's answer) is taken as given.  Otherwise
    ``"http:"`` + the principal (the application's ``principal=``, else the one
    the request carries); a request that names no client is in no namespace of
    its own, so with ``anonymous="refuse"`` (the default) it gets none: the
    caller answers :func:`anonymous_refused`, and nothing is run or stored.
    ``anonymous="shared"`` puts every such request in ``"http"``.
    """
    scope = settings.scope
    if isinstance(scope, str):
        return scope
    if scope is not None:
        named = scope(request.native)
        try:
            check_scope(named)
        except InvalidArgument as error:
            raise ConfigurationError(f"the scope= callable returned {named!r:.80}: {error}") from None
        if not isinstance(named, str):
            raise ConfigurationError(f"the scope= callable must return a string, got {named!r:.80}")
        return named
    if options.principal is not None:
        found = app_principal(options.principal, request.native)
    else:
        found = principal(request, options.session_cookies)
    if found is not None or settings.anonymous == "shared":
        return scope_from_principal(found)
    if not options.warned_anonymous:
        options.warned_anonymous = True
        log.warning(
            "%s %s: a request with an Idempotency-Key names no client (no authenticated user, REMOTE_USER, "
            "Authorization header or session cookie) and was answered 400; keys are kept per client. "
            "Name your clients (principal=, or session_cookies=['<your session cookie>']), or pass "
            "anonymous='shared' (the middleware or a RouteOptions) to put every anonymous client in one "
            "namespace, where one receives another's stored response by sending its key and body",
            request.method, request.path,
        )  # fmt: skip
    return None


def anonymous_refused(options: Options, request: HttpRequest) -> Response:
    """The 400 for a keyed request that names no client (see :func:`request_scope`)."""
    return options.problem(
        400,
        "Idempotency-Key needs an identified client",
        f"{request.method} {request.path}: this server keeps Idempotency-Keys per client, and the request "
        "names none (no credentials): send it with your credentials; it was not run",
    )


def missing_key(options: Options, request: HttpRequest) -> Response:
    return options.problem(
        400,
        "Idempotency-Key is missing",
        f"{request.method} {request.path} requires an Idempotency-Key header (a unique value per "
        "operation, e.g. a UUID)",
    )


def too_large(options: Options, settings: Settings) -> Response:
    return options.problem(
        413,
        "Request body too large",
        f"requests with an Idempotency-Key may carry at most {settings.max_body} bytes",
    )


# --------------------------------------------------------------------------
# One keyed request: claim, then settle (store / forget / release) or fail
# --------------------------------------------------------------------------


class KeyedRequest:
    """The key record of one request, from its claim to its settlement.

    Every method is synchronous and takes the request's own Session; the
    ASGI face runs them in a worker thread (a Session) or through
    ``AsyncSession.run_sync`` (an AsyncSession), the WSGI face directly.
    The claim commits in its own transaction (``mode="separate"``) before the
    app runs, because the app works with its own sessions.
    """

    def __init__(
        self,
        options: Options,
        settings: Settings,
        request: HttpRequest,
        key: str,
        body: bytes,
        log: logging.Logger,
        *,
        scope: str,
        heartbeat_thread: bool = True,
    ) -> None:
        self.options = options
        self.settings = settings
        self.key = key
        self.log = log
        self.scope = scope
        self.fingerprint = request_fingerprint(request, body)
        self.heartbeat_thread = heartbeat_thread
        self.manager: Any = None
        self.call: IdempotentCall[Session] | None = None
        #: The key record is settled (or given up): the manager was exited.
        self.exited = False

    def claim(self, session: Session) -> Response | None:
        """Claim the key: ``None`` when this request owns it now, else the answer to send.

        The answer is the stored response (a replay) or a problem: 409 while
        another request holds the key, 422 for a reused key, 503 when the
        database cannot be reached (nothing claimed, the app must not run).
        """
        options = self.settings.idempotency
        if not self.heartbeat_thread:
            options = options.without_heartbeat()
        manager = idempotent_with(
            session, options, scope=self.scope, key=self.key, fingerprint=self.fingerprint
        )
        problem = self.options.problem
        try:
            call = manager.__enter__()
        except RequestInProgress as error:
            retry_after = max(1, math.ceil(error.retry_after.total_seconds()))
            return problem(409, "Request in progress",
                           "a request with this Idempotency-Key is still being processed; retry later",
                           [(b"retry-after", str(retry_after).encode("ascii"))])  # fmt: skip
        except SerializationConflict:
            # Also DeadlockDetected: the claim kept losing races against other requests with this key
            # (after idempotent()'s own retries).  Nothing was claimed; the client's retry decides.
            return problem(409, "Request in progress",
                           "concurrent requests with this Idempotency-Key kept changing it; retry later",
                           [(b"retry-after", b"1")])  # fmt: skip
        except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError):
            # The database is unreachable (or the pool has no connection to give): nothing was
            # claimed and the app did not run.
            self.log.warning(
                "idempotency key %r in scope %r could not be claimed; answered 503", self.key, self.scope,
                exc_info=True,
            )  # fmt: skip
            return problem(503, "Idempotency store unavailable",
                           "the request was not run: its Idempotency-Key could not be recorded (the "
                           "database is unreachable); retry later with the same key",
                           [(b"retry-after", b"1")])  # fmt: skip
        except IdempotencyKeyReused:
            return problem(422, "Idempotency-Key reused",
                           "this Idempotency-Key was already used for a different request "
                           "(method, path, query or body); use a new key for a new request")  # fmt: skip
        if call.replayed:
            manager.__exit__(None, None, None)
            self.exited = True
            return replay_of(call.response)
        self.manager, self.call = manager, call
        return None

    def heartbeat(self, _session: Session) -> None:
        """Extend this request's lease (for a face that beats from its own task)."""
        if self.call is not None and not self.exited:
            self.call.heartbeat()

    def settle(
        self, _session: Session, status: int, headers: Iterable[tuple[bytes, bytes]], body: bytes
    ) -> None:
        """The app's whole response: store it, or forget / release the key, as ``store_status`` says.

        Called before the response is sent, so a client that sees a response can always get it
        again.  A database failure here is logged and the key released: the response is sent all
        the same (the app ran).
        """
        response: dict[str, Any] | None = None
        reason: str | None = None
        forget = False
        if self.settings.store_status(status):
            response = {
                "status": status,
                "headers": stored_headers(headers),
                "body": base64.b64encode(body).decode("ascii"),
            }
        else:
            # A 4xx not stored was refused before it ran: forget the key, so that the
            # corrected request may use it (not only a byte-identical retry).
            reason, forget = f"HTTP {status}, not stored", 400 <= status < 500
        try:
            self._finish(response, reason, forget)
        except Exception as error:
            # The database failed at the end (it is unreachable, say): the app ran and answered, so
            # its answer is sent all the same.  The key is released, or, if the release fails too,
            # stays in progress until its lease ends.
            self.log.error(
                "could not record the response of idempotency key %r in scope %r; the app's response is "
                "sent unrecorded", self.key, self.scope, exc_info=True,
            )  # fmt: skip
            self.fail(_session, error)
            return
        self._exit(None)

    def incomplete(self, _session: Session) -> None:
        """The app streamed its response, or returned without a whole one: nothing to replay."""
        try:
            self._finish(None, "the response was streamed or incomplete", False)
        except BaseException as error:
            self.fail(_session, error)
            raise
        self._exit(None)

    def fail(self, _session: Session, error: BaseException) -> None:
        """The app raised before its whole response: release the key (the face re-raises the error)."""
        if not self.exited:
            self._exit(error)

    def _exit(self, error: BaseException | None) -> None:
        self.exited = True
        if error is None:
            self.manager.__exit__(None, None, None)
        else:
            self.manager.__exit__(type(error), error, error.__traceback__)

    def _finish(self, response: dict[str, Any] | None, reason: str | None, forget: bool) -> None:
        """Store ``response``, or release the key (``forget``: delete this request's record).

        A response the database cannot hold (larger than MariaDB's ``max_allowed_packet``) is
        stored as a problem response saying so: the app ran, so a retry must not run it again.
        A conflict or lost connection is tried again twice (the claim is this request's own).
        """
        call = self.call
        if call is None:
            raise InvalidArgument("_finish before a successful claim")
        for attempt in range(1, FINISH_ATTEMPTS + 1):
            try:
                if response is None:
                    call.release(reason, forget=forget)
                else:
                    try:
                        call.complete(response)
                    except InvalidArgument as error:
                        self.log.warning(
                            "the response of idempotency key %r in scope %r cannot be stored (%s); its "
                            "replays answer 500 instead", call.key, call.scope, error,
                        )  # fmt: skip
                        call.complete(unstored(response, str(error)))
                return
            except LeaseLost:
                # The lease expired while the app ran and another request took the key over: its
                # record wins.  This response is still sent.
                self.log.warning(
                    "idempotency key %r in scope %r was taken over while the app ran; raise the lease "
                    "(or set heartbeat_every) above the slowest handler", call.key, call.scope,
                )  # fmt: skip
                return
            except (SerializationConflict, sa_exc.OperationalError, sa_exc.InterfaceError):
                if attempt == FINISH_ATTEMPTS:
                    raise
                time.sleep(0.05 * attempt)
