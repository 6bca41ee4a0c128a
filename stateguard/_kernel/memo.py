"""The one bounded memo of built statements (:data:`memo`), and :func:`frozen` for the
statements a hot path runs on every call.

Statements are built once per owner, :class:`~stateguard._kernel.backend.Backend`
and call variant, then only executed: building a statement costs more than
running the cached compiled form of one.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Hashable
from typing import Any, Final, TypeVar

from sqlalchemy import lambda_stmt
from sqlalchemy.sql.base import Executable
from sqlalchemy.sql.lambdas import StatementLambdaElement

__all__ = ["Memo", "frozen", "memo"]

T = TypeVar("T")


class Memo:
    """A bounded memo of built statements, shared by every guarded write.

    Keys name what a statement depends on: its owner (a trigger, a model's
    :class:`~stateguard._kernel.models.ModelInfo`, a table), the
    :class:`~stateguard._kernel.backend.Backend` (interned per capability set, so an
    application that creates an engine per tenant adds no entries) and the
    call variant.  A hit is one ``dict.get``; when full, the oldest entry is
    dropped (insertion order), so a workload that churns through variants
    cannot grow it without bound.
    """

    __slots__ = ("_data", "_lock", "maxsize")

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._data: dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any:
        """The memoised value for ``key``, or ``None``."""
        return self._data.get(key)

    def put(self, key: Hashable, value: T) -> T:
        """Remember ``value`` under ``key`` (evicting the oldest entry when full); return it."""
        with self._lock:
            data = self._data
            if key not in data and len(data) >= self.maxsize:
                del data[next(iter(data))]
            data[key] = value
        return value

    def get_or_build(self, key: Hashable, build: Callable[[], T]) -> T:
        """The memoised value for ``key``, built by ``build()`` on a miss."""
        found = self._data.get(key)
        if found is None:
            found = self.put(key, build())
        return found

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        """Forget everything (tests)."""
        with self._lock:
            self._data.clear()


#: The statement memo of every guarded write.
memo: Final = Memo(4096)

_frozen_ids = itertools.count(1)


def frozen(stmt: Executable) -> StatementLambdaElement:
    """``stmt`` with its SQL cache key computed once, for statements run on every call of a hot path.

    SQLAlchemy looks up the compiled form of a statement by a cache key that
    it recomputes, by walking the whole statement, at every execution: a few
    microseconds for a one-table UPDATE, about 30 for the idempotency claim's
    CTE.  A lambda statement (:func:`sqlalchemy.lambda_stmt`) is keyed by its
    code and ``track_on`` instead: here a number unique to this call, so two
    frozen statements never share a compiled form.  ``stmt`` must be complete
    and never change (its bound parameters get their values at execution, as
    usual); the result executes, compiles and renders exactly like ``stmt``
    (``schema_translate_map`` and events included).
    """
    return lambda_stmt(lambda: stmt, track_on=[f"stateguard.frozen.{next(_frozen_ids)}"])
