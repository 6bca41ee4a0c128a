"""``from stateguard.asgi import IdempotencyMiddleware`` keeps working: it lives in :mod:`stateguard.http`.

The ASGI face is :mod:`stateguard.http.asgi`, the WSGI face (Flask and any
PEP 3333 app) :mod:`stateguard.http.wsgi`, both built on
:mod:`stateguard.http.core`.  This module re-exports their public names::

    from stateguard.asgi import IdempotencyMiddleware, WSGIIdempotencyMiddleware
"""

from __future__ import annotations

from .http.asgi import (
    ASGIApp,
    IdempotencyMiddleware,
    Message,
    Receive,
    Scope,
    Send,
    default_scope,
    principal_of,
)
from .http.core import CREDENTIAL_HEADERS, REFUSED_BEFORE_EXECUTION, RouteOptions, default_store_status
from .http.core import stored_headers as _stored_headers  # noqa: F401  (tests of 0.1 read it)
from .http.wsgi import WSGIIdempotencyMiddleware

__all__ = [
    "CREDENTIAL_HEADERS",
    "REFUSED_BEFORE_EXECUTION",
    "ASGIApp",
    "IdempotencyMiddleware",
    "Message",
    "Receive",
    "RouteOptions",
    "Scope",
    "Send",
    "WSGIIdempotencyMiddleware",
    "default_scope",
    "default_store_status",
    "principal_of",
]
