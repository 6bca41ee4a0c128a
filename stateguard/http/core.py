"""What the ``Idempotency-Key`` middleware does with one keyed request, whatever the protocol.

Protocol-independent and synchronous: the request's idempotency scope (from
its principal, :mod:`stateguard.http.principal`), the problem answers of a
request that cannot run, and the claim / settle / replay steps of one keyed
request (:class:`KeyedRequest`), which run on a
:class:`~sqlalchemy.orm.Session`.  The options and their checks are
:mod:`stateguard.http.options`', the key's parsing
:mod:`stateguard.http.keys`', the request's fingerprint
:mod:`stateguard.http.fingerprint`'s.  The faces, :mod:`stateguard.http.asgi`
and :mod:`stateguard.http.wsgi`, only move bytes: they read the request,
hand these steps a session (in a worker thread, through
``AsyncSession.run_sync``, or directly) and send what they return.
"""

from __future__ import annotations

import base64
import inspect
import logging
import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, Generic, TypeVar, get_args, get_origin

from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

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
from ..idempotency.options import DEFAULT_LEASE, DEFAULT_TTL
from .fingerprint import request_fingerprint as request_fingerprint
from .keys import KEY_HEADER as KEY_HEADER
from .keys import BadKey as BadKey
from .keys import parse_key as parse_key
from .options import REFUSED_BEFORE_EXECUTION as REFUSED_BEFORE_EXECUTION
from .options import Options as Options
from .options import RouteOptions as RouteOptions
from .options import RoutesFn as RoutesFn
from .options import ScopeFn as ScopeFn
from .options import Settings as Settings
from .options import check_scope
from .options import default_store_status as default_store_status
from .principal import Anonymous, PrincipalFn, app_principal
from .principal import principal as principal
from .principal import scope_from_principal as scope_from_principal
from .request import HttpRequest
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

#: Tries of the write that records a response (the first, and two after a conflict or lost connection).
FINISH_ATTEMPTS = 3

_App = TypeVar("_App")
_Factory = TypeVar("_Factory")


def _evaluated(annotation: Any, names: dict[str, Any]) -> Any:
    """A forward reference's type, evaluated in ``names``; anything else as it is."""
    source = getattr(annotation, "__forward_arg__", None)
    if source is None:
        return annotation
    try:
        return eval(source, names)  # a string of the package's own source, as get_type_hints() does
    except NameError:  # a name imported for type checking only: shown as written
        return source


class MiddlewareCore(Generic[_App, _Factory]):
    """What both faces are built from: the wrapped app, the session factory and the checked :class:`Options`.

    A face names itself in ``where`` (the name its option errors carry) and
    says with ``allow_async`` whether ``session_factory`` may make
    AsyncSessions; the options are documented on
    :class:`~stateguard.http.asgi.IdempotencyMiddleware`.

    :raises InvalidArgument: a wrong option, when built.
    """

    where: ClassVar[str]
    allow_async: ClassVar[bool]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A face's runtime signature (help(), the docs, IDEs) names its own app and factory types,
        # not this class's type variables.  A face spells them as strings in its base
        # (``MiddlewareCore["ASGIApp", ...]``, names its module imports for type checking only),
        # evaluated here in that module as typing.get_type_hints() would.
        super().__init_subclass__(**kwargs)
        for base in getattr(cls, "__orig_bases__", ()):
            if get_origin(base) is MiddlewareCore:
                names = vars(sys.modules[cls.__module__])
                app_type, factory_type = (_evaluated(t, names) for t in get_args(base))
                init = inspect.signature(MiddlewareCore.__init__)
                app, factory, *rest = list(init.parameters.values())[1:]
                app, factory = app.replace(annotation=app_type), factory.replace(annotation=factory_type)
                cls.__signature__ = init.replace(parameters=[app, factory, *rest])  # type: ignore[attr-defined]

    def __init__(
        self,
        app: _App,
        *,
        session_factory: _Factory,
        scope: str | ScopeFn | None = None,
        principal: PrincipalFn | None = None,
        session_cookies: Iterable[str] = (),
        anonymous: Anonymous = "refuse",
        required_paths: Iterable[str] = (),
        methods: Iterable[str] = ("POST", "PATCH"),
        lease: timedelta = DEFAULT_LEASE,
        ttl: timedelta = DEFAULT_TTL,
        max_body: int = 1024 * 1024,
        routes: Mapping[str, RouteOptions | Mapping[str, Any]] | RoutesFn | None = None,
        store_status: Callable[[int], bool] = default_store_status,
        heartbeat_every: timedelta | None = None,
        documentation: str | None = None,
    ) -> None:
        self.options = Options(
            where=self.where,
            session_factory=session_factory,
            allow_async=self.allow_async,
            scope=scope,
            principal=principal,
            session_cookies=session_cookies,
            anonymous=anonymous,
            required_paths=required_paths,
            methods=methods,
            lease=lease,
            ttl=ttl,
            max_body=max_body,
            routes=routes,
            store_status=store_status,
            heartbeat_every=heartbeat_every,
            documentation=documentation,
        )
        self.app = app
        self.session_factory = session_factory
        self.required_paths = self.options.required_paths
        self.store_status = store_status
        self.documentation = documentation


@dataclass(frozen=True)
class Admitted:
    """A keyed request that may be claimed: its parsed key and its idempotency scope."""

    key: str
    scope: str


def admit(
    options: Options, settings: Settings, request: HttpRequest, log: logging.Logger
) -> Admitted | Response | None:
    """What a face does with a request whose route and method honour the header, before reading its body.

    ``None``: it carries no key and none is required, so the app runs as
    without the middleware.  A :data:`Response`: the answer to send instead
    of running it (a missing or malformed key, an anonymous client refused,
    see :func:`request_scope`).  Otherwise :class:`Admitted`.
    """
    values = request.header(KEY_HEADER)
    if not values:
        return missing_key(options, request) if settings.required else None
    try:
        key = parse_key(values)
    except BadKey as error:
        return options.problem(400, "Invalid Idempotency-Key", str(error))
    key_scope = request_scope(options, settings, request, log)
    if key_scope is None:
        return anonymous_refused(options, request)
    return Admitted(key, key_scope)


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
            # corrected request may use it (not only a byte-identical retry); so was a 307 or
            # 308, whose redirected request (another path) comes with the same key.
            reason = f"HTTP {status}, not stored"
            forget = 400 <= status < 500 or status == 307 or status == 308
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
