"""JSON as stateguard stores it: strict and compact (no NaN or Infinity, UTF-8 kept), with an
encoder built once (:func:`json_encoder`), and the checks a value passes before it is sent
(:func:`json_text`: object keys, depth, what JSON cannot carry, lone surrogates).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final

from ..exceptions import InvalidArgument
from .checks import check_storable

__all__ = ["check_json_shape", "dumps_json", "json_encoder", "json_text"]


def json_encoder(*, sort_keys: bool = False) -> Callable[[Any], str]:
    """A function that turns a value into strict, compact JSON text (no NaN or Infinity, UTF-8 kept).

    The same text and the same errors as ``json.JSONEncoder(...).encode``, which builds a new C
    encoder (and a closure) at every call: this one is built once.  It skips the encoder's
    circular-reference bookkeeping (a dict of ids per call); a value that refers to itself ends in
    RecursionError, and only then is the standard encoder asked, so a cycle is reported as the
    ValueError it gives (and a value nested too deeply as its RecursionError).
    """
    standard = json.JSONEncoder(
        sort_keys=sort_keys, allow_nan=False, ensure_ascii=False, separators=(",", ":")
    )
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - CPython always has the C encoder
        return standard.encode
    fast = make(
        None, standard.default, json.encoder.encode_basestring, None, ":", ",", sort_keys, False, False
    )
    join = "".join

    def encode(value: Any) -> str:
        try:
            return join(fast(value, 0))
        except RecursionError:
            return standard.encode(value)

    return encode


#: Compact JSON text as stateguard stores it (no NaN or Infinity: other JSON readers refuse them).
dumps_json: Final = json_encoder()


def json_text(value: Any, what: str, max_depth: int) -> str:
    """``value`` as the JSON text stateguard stores (:func:`dumps_json`), or InvalidArgument before any
    statement: non-str object keys or nesting past ``max_depth`` (:func:`check_json_shape`), what JSON
    cannot carry (NaN, Infinity, sets, objects), and lone surrogates (no UTF-8 for them; MariaDB's
    JSON_VALID refuses even their escapes)."""
    check_json_shape(value, what, max_depth)
    try:
        text = dumps_json(value)
    except (TypeError, ValueError, RecursionError) as error:
        raise InvalidArgument(
            f"{what} must be JSON-serialisable (dict, list, str, int, finite float, bool, None): "
            f"{error}; nothing was written"
        ) from None
    return check_storable(text, what)


def check_json_shape(value: Any, what: str, max_depth: int) -> None:
    """Refuse what JSON would change or could not carry: non-str object keys (JSON turns ``1`` into
    ``"1"``), nesting past ``max_depth`` (InvalidArgument; nothing was written)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            if depth >= max_depth:
                raise InvalidArgument(f"{what} nests deeper than {max_depth} levels; nothing was written")
            for k, v in item.items():
                if not isinstance(k, str):
                    raise InvalidArgument(
                        f"{what} object keys must be str (JSON would turn {k!r} into a string); "
                        f"nothing was written"
                    )
                stack.append((v, depth + 1))
        elif isinstance(item, list | tuple):
            if depth >= max_depth:
                raise InvalidArgument(f"{what} nests deeper than {max_depth} levels; nothing was written")
            stack.extend((v, depth + 1) for v in item)
