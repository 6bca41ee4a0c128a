"""Stored responses of the ``Idempotency-Key`` middleware: what is kept for a replay, and how it is sent.

A stored response keeps its status, body and headers, except hop-by-hop
headers (and those its ``Connection`` names) and :data:`CREDENTIAL_HEADERS`
(``Set-Cookie`` ...): a replay must not hand one client's session or token to
whoever sends the key.  A replay carries ``Idempotency-Replayed: true``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping
from typing import Any, TypeAlias

from .request import Headers

__all__ = [
    "CREDENTIAL_HEADERS",
    "HOP_BY_HOP",
    "REPLAYED_HEADER",
    "Response",
    "replay_of",
    "stored_headers",
    "unstored",
]

#: ``(status, headers, body)``: an answer a face sends as it is.
Response: TypeAlias = tuple[int, Headers, bytes]

#: The replay marker.
REPLAYED_HEADER = b"idempotency-replayed"

#: Hop-by-hop headers (RFC 9110 section 7.6.1) describe one connection, not the response: never stored.
HOP_BY_HOP = frozenset(
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


def stored_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[list[str]]:
    """The response headers a replay may carry: no hop-by-hop, credential or replay header."""
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
        if k not in HOP_BY_HOP and k not in CREDENTIAL_HEADERS and k not in named and k != REPLAYED_HEADER
    ]


def replay_of(stored: Any) -> Response:
    """The stored response as sent again, with ``Idempotency-Replayed: true``."""
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in stored["headers"]]
    headers.append((REPLAYED_HEADER, b"true"))
    return int(stored["status"]), headers, base64.b64decode(stored["body"])


def unstored(response: Mapping[str, Any], why: str) -> dict[str, Any]:
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
