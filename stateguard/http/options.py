"""The options of the ``Idempotency-Key`` middleware, checked when a middleware is built.

Protocol-independent and synchronous: each option's check (a wrong value is
refused when the middleware is built, never at the first request), the
per-route settings (:class:`RouteOptions`) merged over the middleware's own
into the effective :class:`Settings` of one request, route matching, the
kind of session the factory makes, the default storage policy
(:func:`default_store_status`) and the RFC 9457 problem responses.  The
claim and replay of a keyed request are :mod:`stateguard.http.core`'s.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import Any, Literal, TypeAlias

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_scoped_session, async_sessionmaker
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from ..exceptions import InvalidArgument
from ..idempotency.options import IdempotencyOptions, duration_ms, options_of
from ..tables import MAX_SCOPE
from .principal import Anonymous, PrincipalFn, check_anonymous, check_session_cookies
from .request import Headers, Native

__all__ = [
    "REFUSED_BEFORE_EXECUTION",
    "Options",
    "RouteOptions",
    "RoutesFn",
    "ScopeFn",
    "SessionKind",
    "Settings",
    "check_duration",
    "check_max_body",
    "check_methods",
    "check_pattern",
    "check_scope",
    "check_session_factory",
    "check_store_status",
    "default_store_status",
    "matches",
]


ScopeFn: TypeAlias = Callable[[Native], str]
RoutesFn: TypeAlias = Callable[[Native], "RouteOptions | None"]

#: Answers that mean the request was refused before it ran: not stored by default (Stripe saves
#: no result "if incoming parameters failed validation, or the request conflicted with another that
#: was executing concurrently").  Malformed or invalid (400, 422), not authenticated or not allowed
#: (401, 403), no such route or method (404, 405), a conflict with the resource's current state
#: (409), a body the app does not take (413, 415), and "try again later" (408, 425, 429): storing
#: them would turn the retry they ask for (or a corrected request) into a replay of the refusal.
#: And 307 and 308, "send this same request to another URL" (a router's trailing-slash redirect):
#: stored, the redirected request with the key would be another request under it (422) for good.
REFUSED_BEFORE_EXECUTION = frozenset({307, 308, 400, 401, 403, 404, 405, 408, 409, 413, 415, 422, 425, 429})

_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


def default_store_status(status: int) -> bool:
    """The default policy: store 2xx, 3xx and the 4xx answers of requests that ran.

    Not stored: 5xx (the server failed: the client retries and the app runs
    again) and :data:`REFUSED_BEFORE_EXECUTION` (400, 401, 403, 404, 405,
    408, 409, 413, 415, 422, 425, 429: the request was refused before it
    ran, so its key is forgotten and a corrected request may use it; 307
    and 308: the same request is to be sent elsewhere, with its key).
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

    def settings_for(self, path: str | tuple[str, ...], native: Native) -> Settings | None:
        """The effective settings for a request, or ``None`` when its route is disabled.

        ``path`` may be several spellings of the request's route path (the face cannot tell which
        one the app routes on): the key is required if a required pattern matches any of them, and
        the route is the first one's, else the next's.
        """
        paths = (path,) if isinstance(path, str) else path
        route: RouteOptions | None
        if self.routes_fn is not None:
            route = self.routes_fn(native)
            if route is not None and not isinstance(route, RouteOptions):
                raise InvalidArgument(f"the routes callable must return RouteOptions or None, got {route!r}")
        else:
            route = next((o for one in paths for p, o in self.routes if matches(p, one)), None)
        required = any(matches(p, one) for one in paths for p in self.required_paths)
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
