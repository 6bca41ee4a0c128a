"""What makes two requests with one key "the same request": method, path, query string and body.

A JSON body counts by its canonical form (:func:`stateguard.fingerprint_of`),
any other body, and JSON with no single meaning (duplicate keys, NaN, an
inexact number, nesting deeper than Python parses), by its bytes.  Only
SHA-256 digests are stored.
"""

from __future__ import annotations

import hashlib
import json
import math
from decimal import Decimal, InvalidOperation
from typing import Any, NoReturn

from ..idempotency import fingerprint_of
from .request import HttpRequest

__all__ = ["request_fingerprint"]


def _is_json(request: HttpRequest) -> bool:
    """``Content-Type: application/json`` or any ``+json`` type (RFC 6839), parameters ignored."""
    values = request.header(b"content-type")
    if len(values) != 1:
        return False
    media = values[0].split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (b"/" in media and media.endswith(b"+json"))


def _no_constant(name: str) -> NoReturn:
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


def request_fingerprint(request: HttpRequest, body: bytes) -> dict[str, str]:
    """What makes two requests "the same": method, path, query string and the body.

    A JSON body (``application/json`` or ``+json``) counts by its canonical
    form, as :func:`stateguard.idempotent` compares fingerprints: the same
    object with its keys in another order or other whitespace is the same
    request.  Any other body, and a JSON body that does not parse, counts
    by its bytes.
    """
    out = {"method": request.method.upper(), "path": request.path, "query": request.query.decode("latin-1")}
    found = _json_digest(body) if _is_json(request) else None
    if found is not None:
        out["json_sha256"] = found
    else:
        out["body_sha256"] = hashlib.sha256(body).hexdigest()
    return out
