"""The ``Idempotency-Key`` HTTP middleware: one core, an ASGI face and a WSGI face.

- :mod:`stateguard.http.options`: the options and their checks, route
  matching and the per-request settings, checked when a middleware is built;
- :mod:`stateguard.http.core`: what happens to one keyed request (the scope,
  the claim / settle / replay steps), on :mod:`~stateguard.http.request` (one request),
  :mod:`~stateguard.http.keys` (the header's value),
  :mod:`~stateguard.http.principal` (who sent it: keys are per client),
  :mod:`~stateguard.http.fingerprint` (which requests are the same) and
  :mod:`~stateguard.http.responses` (what a replay carries);
- :mod:`stateguard.http.asgi`: :class:`IdempotencyMiddleware` (Starlette,
  FastAPI, any ASGI app; Session or AsyncSession factories);
- :mod:`stateguard.http.wsgi`: :class:`WSGIIdempotencyMiddleware` (Flask,
  any PEP 3333 app).

Neither face imports a web framework::

    from stateguard.http import IdempotencyMiddleware, WSGIIdempotencyMiddleware
"""

from __future__ import annotations

from .asgi import IdempotencyMiddleware, default_scope, principal_of
from .options import REFUSED_BEFORE_EXECUTION, RouteOptions, default_store_status
from .responses import CREDENTIAL_HEADERS
from .wsgi import WSGIIdempotencyMiddleware

__all__ = [
    "CREDENTIAL_HEADERS",
    "REFUSED_BEFORE_EXECUTION",
    "IdempotencyMiddleware",
    "RouteOptions",
    "WSGIIdempotencyMiddleware",
    "default_scope",
    "default_store_status",
    "principal_of",
]
