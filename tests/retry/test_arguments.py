"""retry_on_conflict checks every argument at the call, before the unit of work runs, in both forms."""

from __future__ import annotations

import asyncio
import math
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest

from stateguard import InvalidArgument, Outcome, Result, retry_on_conflict
from tests._support.models import Order

pytestmark = pytest.mark.hostile

BAD: list[tuple[str, Any]] = [
    ("attempts", 0),
    ("attempts", -1),
    ("attempts", "3"),
    ("attempts", 2.5),
    ("attempts", 3.0),
    ("attempts", True),
    ("attempts", None),
    ("attempts", Decimal(3)),
    ("backoff", -0.01),
    ("backoff", "0.1"),
    ("backoff", math.nan),
    ("backoff", math.inf),
    ("backoff", True),
    ("backoff", None),
    ("max_backoff", -1),
    ("max_backoff", math.inf),
    ("max_backoff", "1"),
    ("max_backoff", False),
    ("max_time", "soon"),
    ("max_time", -1),
    ("max_time", math.nan),
    ("max_time", math.inf),
    ("max_time", True),
    ("max_time", Decimal("NaN")),
    ("max_time", Fraction(10**400, 1)),
    ("max_time", [5]),
    ("lock_not_acquired", 1),
    ("lock_not_acquired", "no"),
    ("lock_not_acquired", None),
    ("sleep", None),
    ("sleep", 0.1),
]


def _ids(case: tuple[str, Any]) -> str:
    return f"{case[0]}={case[1]!r}"


@pytest.mark.hostile
@pytest.mark.parametrize(("name", "value"), BAD, ids=[_ids(c) for c in BAD])
def test_bad_argument_is_invalid_argument_before_a_synchronous_fn_runs(name: str, value: Any) -> None:
    """A bad argument raises InvalidArgument naming it, and the synchronous fn is never called."""
    calls: list[int] = []
    with pytest.raises(InvalidArgument, match=f"retry_on_conflict: {name} must be") as caught:
        retry_on_conflict(lambda: calls.append(1), **{name: value})
    assert calls == []
    assert "e.g." in str(caught.value) or name in ("lock_not_acquired", "sleep")


@pytest.mark.hostile
@pytest.mark.parametrize(("name", "value"), BAD, ids=[_ids(c) for c in BAD])
def test_bad_argument_is_invalid_argument_at_the_call_of_the_async_form(name: str, value: Any) -> None:
    """With a coroutine function the bad argument raises at the call itself: no coroutine is made or run."""
    calls: list[int] = []

    async def work() -> int:
        calls.append(1)
        return 1

    with pytest.raises(InvalidArgument, match=f"retry_on_conflict: {name} must be"):
        _ = retry_on_conflict(work, **{name: value})
    with pytest.raises(InvalidArgument, match=f"retry_on_conflict: {name} must be"):
        _ = retry_on_conflict(lambda: work(), **{name: value})
    assert calls == []


@pytest.mark.hostile
@pytest.mark.parametrize("fn", [None, 42, "work"], ids=repr)
def test_fn_that_is_not_callable_is_invalid_argument(fn: Any) -> None:
    """A fn that cannot be called is InvalidArgument saying to pass the unit of work or a lambda."""
    with pytest.raises(InvalidArgument, match="fn must be a callable"):
        retry_on_conflict(fn)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"attempts": 1},
        {"attempts": 10**6},
        {"backoff": 0, "max_backoff": 0},
        {"backoff": Decimal("0.5"), "max_backoff": Fraction(1, 2)},
        {"max_time": 0},
        {"max_time": None},
        {"max_time": 30},
        {"lock_not_acquired": False},
    ],
    ids=repr,
)
def test_good_arguments_are_accepted_in_both_forms(kwargs: dict[str, Any]) -> None:
    """Ints of at least 1, finite real numbers >= 0 (any numeric type) and None for max_time are accepted."""

    async def work() -> str:
        return "async"

    assert retry_on_conflict(lambda: "sync", **kwargs) == "sync"
    assert asyncio.run(retry_on_conflict(work, **kwargs)) == "async"


@pytest.mark.limits
def test_many_attempts_grow_the_wait_without_overflowing() -> None:
    """Past 1,024 attempts the exponential wait stays capped at max_backoff (2**1100 is no float)."""

    def stale() -> Result:
        return Result(Outcome.STALE, model=Order, key=1, version=2, expected_version=1)

    sleeps: list[float] = []
    result = retry_on_conflict(stale, attempts=1100, backoff=0.5, max_backoff=0.001, sleep=sleeps.append)
    assert result.outcome is Outcome.STALE
    assert len(sleeps) == 1099 and max(sleeps) <= 0.001
