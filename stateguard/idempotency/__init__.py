"""Idempotency keys: a retried request runs once, and its retries get the stored response.

::

    with idempotent(session, scope=f"payments:{client_id}", key=key, fingerprint=body) as call:
        if call.replayed:
            return call.response
        ...                                    # the work: runs once per key
        return call.complete({"payment_id": payment.id})

* :mod:`~stateguard.idempotency.api`: :func:`idempotent`, :func:`idempotent_function`, :func:`purge_expired`;
* :mod:`~stateguard.idempotency.options`: the options every face shares, checked once;
* :mod:`~stateguard.idempotency.call`: :class:`IdempotentCall`, what the block gets;
* :mod:`~stateguard.idempotency.claim`: the claim algorithm, written once;
* :mod:`~stateguard.idempotency.statements`: its statements, built once;
* :mod:`~stateguard.idempotency.serialization`: responses, checkpoints, fingerprints;
* :mod:`~stateguard.idempotency.events`: :func:`on_idempotency_event`.

The record lives in ``stateguard_idempotency_keys``; how the claim settles
races, the two modes and the database clock are explained in the
documentation's "Idempotency keys" page.
"""

from __future__ import annotations

from typing import Any, Final

from .. import _compat
from .api import idempotent, idempotent_function, purge_expired
from .call import IdempotentCall
from .events import IdempotencyEvent, on_idempotency_event
from .options import Mode
from .serialization import JSONSerializer, Serializer, fingerprint_of

__all__ = [
    "IdempotencyEvent",
    "IdempotentCall",
    "JSONSerializer",
    "Mode",
    "Serializer",
    "fingerprint_of",
    "idempotent",
    "idempotent_function",
    "on_idempotency_event",
    "purge_expired",
]

#: Names this module defined before the 0.2 layout, and where they live now.
_MOVED: Final = {"consume_once": "stateguard.inserts", "ConsumedMessage": "stateguard.inserts"}


def __getattr__(name: str) -> Any:
    return _compat.moved(__name__, name, _MOVED)
