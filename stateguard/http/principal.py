"""Who sent a keyed request: the principal whose namespace (idempotency scope) its key lives in.

Clients choose keys, so keys are kept per client: a client that sends
another's key and body must get its own execution, never the other's stored
response.  The principal is only ever something that names one client: an
authenticated user's ``identity`` or ``id`` (never a display name), the
server's ``REMOTE_USER``, the ``Authorization`` header, or the cookies the
application names as its session cookies (``session_cookies=``).  Other
cookies (``lang=en``, a consent banner's) are sent alike by many clients and
are not a principal.  A request with none of them is *anonymous*: its key is
refused (400) unless the application chose one namespace for all anonymous
clients (``anonymous="shared"``) or names its clients itself
(``principal=``).  Only SHA-256 digests reach the database.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeAlias

from ..exceptions import ConfigurationError, InvalidArgument
from .request import HttpRequest, Native, digest

__all__ = [
    "ANONYMOUS_POLICIES",
    "Anonymous",
    "PrincipalFn",
    "app_principal",
    "check_anonymous",
    "check_session_cookies",
    "principal",
    "scope_from_principal",
]

PrincipalFn: TypeAlias = Callable[[Native], "str | None"]

#: What a keyed request without a principal gets: ``"refuse"`` (400, nothing run or stored) or
#: ``"shared"`` (the one namespace ``"http"`` for every anonymous client, as before 0.2).
Anonymous: TypeAlias = Literal["refuse", "shared"]
ANONYMOUS_POLICIES: tuple[Anonymous, ...] = ("refuse", "shared")

#: The attributes of an authenticated user object that name it uniquely, in order.  Never
#: ``display_name`` (two people may share one) nor ``username`` (Starlette's ``SimpleUser`` is
#: built from whatever the auth backend passed): say what names your users with ``principal=``.
UNIQUE_USER_ATTRIBUTES = ("identity", "id")

_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


def check_anonymous(value: Any, where: str) -> Anonymous:
    """``anonymous=`` is ``"refuse"`` or ``"shared"``; anything else is refused when built."""
    if value == "refuse":
        return "refuse"
    if value == "shared":
        return "shared"
    raise InvalidArgument(
        f"{where}: anonymous must be 'refuse' (a keyed request naming no client is answered 400) or "
        f"'shared' (every anonymous client in one namespace), got {value!r}"
    )


def check_session_cookies(value: Any, where: str) -> tuple[str, ...]:
    """Cookie names (RFC 6265 tokens): the cookies that identify a client, e.g. ``["session"]``."""
    if isinstance(value, str | bytes):
        raise InvalidArgument(f"{where}: session_cookies must be a list of cookie names, not {value!r}")
    try:
        names = tuple(value)
    except TypeError:
        raise InvalidArgument(
            f"{where}: session_cookies must be a list of cookie names, got {value!r}"
        ) from None
    for name in names:
        if not isinstance(name, str) or not name or not set(name) <= _TOKEN_CHARS:
            raise InvalidArgument(f"{where}: session_cookies: not a cookie name: {name!r}")
    return names


def user_identity(user: Any) -> tuple[bool, str | None]:
    """``(authenticated, unique name or None)`` of a user object an auth middleware set."""
    try:
        if getattr(user, "is_authenticated", False) is not True:
            return False, None
    except NotImplementedError:
        return False, None
    for attribute in UNIQUE_USER_ATTRIBUTES:
        try:
            value = getattr(user, attribute, None)
        except NotImplementedError:  # Starlette's BaseUser.identity
            continue
        if isinstance(value, str | int) and not isinstance(value, bool) and str(value):
            return True, str(value)
    return True, None


def _session_cookies(request: HttpRequest, names: Iterable[str]) -> list[bytes]:
    """``name=value`` of the named cookies the request carries (every ``Cookie`` header, in order)."""
    wanted = {name.encode("ascii") for name in names}
    found: list[bytes] = []
    for header in request.header(b"cookie"):
        for pair in header.split(b";"):
            name, sep, value = pair.partition(b"=")
            name, value = name.strip(), value.strip()
            if sep and name in wanted and value:
                found.append(name + b"=" + value)
    return found


def credential_principal(request: HttpRequest, session_cookies: Iterable[str] = ()) -> str | None:
    """``"authorization:"`` + SHA-256 of that header, else ``"cookie:"`` + SHA-256 of the named
    session cookies, or ``None`` without either."""
    values = request.header(b"authorization")
    if values:
        return f"authorization:{digest(*values)}"
    cookies = _session_cookies(request, session_cookies)
    if cookies:
        return f"cookie:{digest(*cookies)}"
    return None


def principal(request: HttpRequest, session_cookies: Iterable[str] = ()) -> str | None:
    """Who sent ``request``, as an opaque string of digests, or ``None`` when nothing names the client.

    1. an authenticated user with a unique name (:data:`UNIQUE_USER_ATTRIBUTES`):
       ``"user:"`` + its digest;  ``REMOTE_USER`` (WSGI): ``"remote_user:"`` + its digest;
    2. else the ``Authorization`` header's digest, else the digest of the ``session_cookies``
       the request carries (a credential names one client; other cookies do not);
    3. an authenticated user with neither is a :class:`ConfigurationError`: guessing (a display
       name) could put two clients in one namespace, so nothing is stored.
    """
    if request.user is not None:
        authenticated, identity = user_identity(request.user)
        if identity is not None:
            return f"user:{digest(identity.encode('utf-8'))}"
        if authenticated:
            found = credential_principal(request, session_cookies)
            if found is not None:
                return found
            raise ConfigurationError(
                f"scope['user'] ({type(request.user).__name__}) is authenticated but has no identity or id "
                "to keep its idempotency keys apart from other clients' (a display_name or username is "
                "not taken: two users may share it), and the request carries no Authorization header or "
                "session cookie; give the user class an identity, or pass the middleware principal=, a "
                "callable of the request returning a unique name for the client (e.g. lambda s: "
                "s['user'].username if your usernames are unique logins)"
            )
    if request.remote_user:
        return f"remote_user:{digest(request.remote_user.encode('utf-8'))}"
    return credential_principal(request, session_cookies)


def scope_from_principal(found: str | None) -> str:
    """The default idempotency scope: ``"http:"`` + the principal, or ``"http"`` without one."""
    return "http" if found is None else f"http:{found}"


def app_principal(fn: PrincipalFn, native: Native) -> str | None:
    """The principal the application's ``principal=`` callable names, as a digest."""
    value = fn(native)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigurationError(
            f"the principal= callable must return a non-empty string naming the client, or None for "
            f"a request that names no client; got {value!r}"
        )
    return f"app:{digest(value.encode('utf-8'))}"
