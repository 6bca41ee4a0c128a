"""How idempotency records store what they keep: responses, checkpoint data, fingerprints, errors.

A :class:`Serializer` turns a response or checkpoint data into text and
back (:class:`JSONSerializer` by default); :func:`fingerprint_of` reduces a
request to the SHA-256 of its canonical form, the only trace of it that is
stored.  :func:`dump` refuses, before anything is sent, text that no
database can store; :func:`storable_error` and :func:`exception_text` make
error descriptions that always can be.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Callable
from typing import Any, Final, Protocol, cast

from .. import _kernel
from ..exceptions import InvalidArgument

__all__ = [
    "JSON",
    "MAX_ERROR",
    "JSONSerializer",
    "Serializer",
    "dump",
    "exception_text",
    "fingerprint_of",
    "load",
    "storable_error",
]


class Serializer(Protocol):
    """Turns stored responses and checkpoint data into text and back.

    ``dumps`` must raise ``TypeError`` or ``ValueError`` for a value it cannot
    store; stateguard turns that into :class:`~stateguard.InvalidArgument`
    before anything is written.
    """

    def dumps(self, value: Any) -> str:
        """Text to store for ``value``."""
        ...

    def loads(self, text: str) -> Any:
        """The value ``text`` was made from."""
        ...


class JSONSerializer:
    """The default :class:`Serializer`: strict JSON (no NaN), UTF-8 kept as is.

    A replay gets the JSON round trip of the response: tuples come back as
    lists, dict keys as strings.  Pass ``serializer=`` for other types.
    """

    def dumps(self, value: Any) -> str:
        """``value`` as compact JSON."""
        return _kernel.dumps_json(value)

    def loads(self, text: str) -> Any:
        """The value of JSON ``text``."""
        return json.loads(text)


#: The serializer of every call that passes none.
JSON: Final = JSONSerializer()


#: Canonical JSON of a fingerprint (sorted keys, no whitespace), built once.
_canonical: Final = _kernel.json_encoder(sort_keys=True)


def _builtin_sha256() -> Callable[[bytes], Any]:
    """CPython's own SHA-256 (``_sha2``; ``_sha256`` before 3.12), else hashlib's.

    The same digest as ``hashlib.sha256``, which is OpenSSL's: its context setup costs more than
    hashing a request fingerprint (a third of the time, measured right after a database round
    trip).  The fingerprint only tells requests apart; nothing security-related depends on it.
    """
    for module in ("_sha2", "_sha256"):
        try:
            return cast("Callable[[bytes], Any]", importlib.import_module(module).sha256)
        except (ImportError, AttributeError):
            continue
    return hashlib.sha256  # pragma: no cover - CPython has one of the two


_sha256: Final = _builtin_sha256()


_BYTES: Final = (bytes, bytearray, memoryview)


def fingerprint_of(value: Any) -> str | None:
    """SHA-256 (hex) of a request fingerprint's canonical form, or ``None`` for ``None``.

    Bytes are hashed as they are; anything else as canonical JSON (sorted
    keys, no whitespace), so ``{"a": 1, "b": 2}`` and ``{"b": 2, "a": 1}``
    are the same request.  Only this hash is stored, never the payload::

        fingerprint_of({"amount": 100, "currency": "EUR"})   # '5c1d...'

    :raises InvalidArgument: the value is not JSON-serialisable.
    """
    if value is None:
        return None
    if isinstance(value, _BYTES):
        data = b"bytes:" + bytes(value)
    else:
        try:
            canonical = _canonical(value)
        except RecursionError:
            raise InvalidArgument("fingerprint is nested too deeply to serialise as JSON") from None
        except (TypeError, ValueError) as error:
            raise InvalidArgument(
                f"fingerprint must be bytes or JSON-serialisable (dicts with str keys, lists, str, "
                f"numbers without NaN, bools, None): {error}"
            ) from error
        try:
            data = b"json:" + canonical.encode("utf-8")
        except UnicodeEncodeError as error:
            # json.loads accepts "\udc80"; there is no UTF-8 (hence no canonical form) for it.
            raise InvalidArgument(f"fingerprint holds a lone surrogate ({error.reason})") from None
    digest: str = _sha256(data).hexdigest()
    return digest


def dump(serializer: Serializer, value: Any, what: str) -> str:
    """``value`` as the text to store; InvalidArgument (nothing sent) for what no database can take."""
    try:
        # The default serializer's own encoder called directly: dump() runs on every completion.
        text = _kernel.dumps_json(value) if serializer is JSON else serializer.dumps(value)
    except RecursionError:
        raise InvalidArgument(
            f"the {what} is nested too deeply for {type(serializer).__name__} to store; flatten it"
        ) from None
    except (TypeError, ValueError) as error:
        # Strict JSON: NaN and Infinity are ValueError.
        raise InvalidArgument(
            f"the {what} cannot be stored by {type(serializer).__name__}: {error}; "
            f"return a serialisable value or pass serializer="
        ) from error
    if not isinstance(text, str):
        raise InvalidArgument(
            f"{type(serializer).__name__}.dumps() must return str, got {type(text).__name__}"
        )
    # PostgreSQL refuses NUL in text and no driver encodes a lone surrogate
    # (JSON with ensure_ascii=False passes one through).
    if "\x00" in text or not text.isascii():  # check_storable's own first test, without its call
        _kernel.check_storable(text, f"the serialised {what}")
    return text


def load(serializer: Serializer, text: str | None) -> Any:
    """The value stored as ``text`` (``None`` stays ``None``)."""
    return None if text is None else serializer.loads(text)


#: Characters of a stored error description (release reasons, exception messages).
MAX_ERROR: Final = 2000


def storable_error(text: str) -> str:
    """An error description any database stores: NUL and lone surrogates escaped, at most MAX_ERROR long."""
    text = text[:MAX_ERROR].replace("\x00", "\\x00")
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def exception_text(exc: BaseException) -> str:
    """``"Type: message"`` of ``exc``, storable; never raises (a broken ``__str__`` is not the error)."""
    try:
        message = str(exc)
    except Exception:
        message = "<str() of the exception failed>"
    return storable_error(f"{type(exc).__name__}: {message}")
