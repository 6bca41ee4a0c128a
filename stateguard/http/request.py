"""One HTTP request as the ``Idempotency-Key`` middleware's decisions see it, whatever the protocol.

The faces (:mod:`stateguard.http.asgi`, :mod:`stateguard.http.wsgi`) build an
:class:`HttpRequest` from the ASGI scope or the WSGI environ; the principal,
the key, the fingerprint and the claim read only this.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, TypeAlias

__all__ = ["Headers", "HttpRequest", "Native", "digest"]

#: The request as the face's framework knows it (the ASGI scope, the WSGI environ): what the
#: user's ``scope=``, ``routes=`` and ``principal=`` callables receive.
Native: TypeAlias = Any
Headers: TypeAlias = list[tuple[bytes, bytes]]


def digest(*parts: bytes) -> str:
    """SHA-256 (hex) of ``parts`` joined by newlines: what reaches the database instead of a credential."""
    return hashlib.sha256(b"\n".join(parts)).hexdigest()


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """One request, protocol-independent: what the decisions below read."""

    method: str
    path: str
    query: bytes
    headers: Headers
    #: The framework's own view of the request, handed to the user's callables.
    native: Native
    #: An authenticated user object (ASGI ``scope["user"]``), or ``None``.
    user: Any = None
    #: The server's ``REMOTE_USER`` (WSGI), or ``None``.
    remote_user: str | None = None

    def header(self, name: bytes) -> list[bytes]:
        return [v for k, v in self.headers if k == name]
