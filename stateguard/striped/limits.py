"""The striped counter's bounds, stripe ids and argument checks: nothing here talks to a database.

Stripe ids are spread evenly over ``[0, SPACE)`` (stripe ``i`` of ``K`` is
``i * SPACE // K``), so stripe 0 is every item's and a random point of the space
starts a pick at a random stripe.  The restripe gate is a row of the item with
stripe id :data:`GATE`, below every stripe.
"""

from __future__ import annotations

import functools
from typing import Any, Final

from .. import _kernel
from ..exceptions import InvalidArgument
from ..tables import MAX_REF

#: The most stripes an item can have.
MAX_STRIPES: Final = 1024
#: Longest item key accepted (characters).
MAX_ITEM: Final = 200
#: Longest counter name accepted (characters).
MAX_NAME: Final = 100
#: Stripe ids are spread over [0, SPACE): stripe i of K is ``i * SPACE // K``.
SPACE: Final = 1 << 20
#: The largest amount a stripe (a BIGINT) holds.
MAX_AMOUNT: Final = (1 << 63) - 1
#: The restripe gate's stripe id: a row of the item that is no stripe (amount 0, ``stripes`` 0),
#: made by the item's first restripe and kept; reads that range over the item leave it out.
GATE: Final = -1


def stripe_ids(stripes: int) -> list[int]:
    """The stripe ids of an item with ``stripes`` stripes (stripe 0 always exists)::

    stripe_ids(4)     # [0, 262144, 524288, 786432]
    """
    return [i * SPACE // stripes for i in range(stripes)]


@functools.lru_cache(maxsize=256)
def ids_of(stripes: int) -> tuple[int, ...]:
    """:func:`stripe_ids` as a tuple, cached (the hot paths name stripes by it)."""
    return tuple(stripe_ids(stripes))


def split(total: int, stripes: int) -> list[int]:
    """``total`` over ``stripes`` as evenly as integers allow (the first ones get the remainder)."""
    share, extra = divmod(total, stripes)
    return [share + (1 if i < extra else 0) for i in range(stripes)]


def check_int(value: Any, what: str, low: int, high: int) -> int:
    """``value`` if it is an int (not a bool) from ``low`` to ``high``, else InvalidArgument."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{what} must be an int, got {value!r}")
    if not low <= value <= high:
        raise InvalidArgument(f"{what} must be from {low} to {high}, got {value}; nothing was sent")
    return value


def needed_ref(ref: Any, call: str) -> str:
    """The ref of a call that cannot do without one (``reserve``, ``release``), checked."""
    if ref is None:
        raise InvalidArgument(f"{call} needs a ref (it is idempotent per ref)")
    return _kernel.check_storable(check_ref(ref) or "", "ref")


def check_ref(ref: Any) -> str | None:
    """An optional ref, checked: ``None``, or a storable non-empty str of at most MAX_REF characters."""
    if ref is None:
        return None
    if not isinstance(ref, str) or not ref or len(ref) > MAX_REF:
        raise InvalidArgument(f"ref must be a non-empty string of at most {MAX_REF} characters, got {ref!r}")
    return _kernel.check_storable(ref, "ref")
