"""The ``Idempotency-Key`` header's value: one key, or the reason it is refused (a 400).

The IETF draft defines the value as a Structured Field string (RFC 8941);
a bare token is accepted too.  Two header lines (or a bare value with a
comma, which is how a proxy joins two) are refused, and so are blank,
non-ASCII and over-long keys.  The key is used exactly as sent.
"""

from __future__ import annotations

from ..tables import MAX_KEY

__all__ = ["KEY_HEADER", "BadKey", "parse_key"]

#: The request header, lower case (ASGI servers and :mod:`stateguard.http.wsgi` lower header names).
KEY_HEADER = b"idempotency-key"


class BadKey(Exception):
    """The header value is not a usable key (the message is the 400 detail)."""


def parse_key(values: list[bytes]) -> str:
    """The key from the ``Idempotency-Key`` header values, or :class:`BadKey`.

    The draft defines the value as a Structured Field string (``"abc"``,
    RFC 8941); a bare token (``abc``) is accepted too, since many clients send
    one, but not with a comma in it (that is two headers a proxy joined).  The
    key is used exactly as sent: no trimming, no case folding.
    """
    if len(values) != 1:
        raise BadKey("send exactly one Idempotency-Key header")
    try:
        text = values[0].decode("ascii")
    except UnicodeDecodeError:
        raise BadKey("the Idempotency-Key must be printable ASCII") from None
    if text.startswith('"'):
        text = _sf_string(text)
    elif "," in text:
        # Two header lines joined by a proxy or a WSGI server (RFC 9110 section 5.3: "a, b"): not one key.
        raise BadKey(
            "send exactly one Idempotency-Key header (a key with a comma must be sent quoted, as a "
            'Structured Field string: "a,b")'
        )
    if not text.strip():
        raise BadKey("the Idempotency-Key is blank")
    if any(not (" " <= c <= "~") for c in text):
        raise BadKey("the Idempotency-Key must be printable ASCII")
    if len(text) > MAX_KEY:
        raise BadKey(f"the Idempotency-Key is {len(text)} characters long; the limit is {MAX_KEY}")
    return text


def _sf_string(text: str) -> str:
    # RFC 8941 section 4.2.5: DQUOTE *( unescaped / "\" ( DQUOTE / "\" ) ) DQUOTE
    out: list[str] = []
    i = 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            if i + 1 >= len(text) or text[i + 1] not in '"\\':
                raise BadKey('the Idempotency-Key is not a valid string: only \\" and \\\\ may be escaped')
            out.append(text[i + 1])
            i += 2
            continue
        if c == '"':
            if i != len(text) - 1:
                raise BadKey("the Idempotency-Key has characters after its closing quote")
            return "".join(out)
        out.append(c)
        i += 1
    raise BadKey("the Idempotency-Key has no closing quote")
