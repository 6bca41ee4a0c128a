"""Every check of keys and values that runs before a statement is sent.

A guarded write refuses what its database would refuse, or store other than
given, before anything reaches the server, with an :class:`InvalidArgument`
that names the value and its column: a target that is no primary key of the
model (:func:`resolve_target`), an integer outside its column's range on this
database (:func:`check_integer`), decimal places a ``NUMERIC`` column would
round away (:func:`check_exact`), strings with NUL or a lone surrogate or
longer than their column (:func:`check_string`), blank or oversized keys
(:func:`check_text`), durations and batch sizes.  PostgreSQL aborts the
caller's transaction on a refused parameter, so refusing here keeps it usable.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import timedelta
from decimal import Decimal
from typing import Any, Final

from sqlalchemy import Column, Connection, Enum, String
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ClauseElement

from ..exceptions import InvalidArgument
from .backend import backend, integer_bounds, numeric_digits
from .memo import memo
from .models import ModelInfo

__all__ = [
    "MAX_LIMIT",
    "check_batch",
    "check_exact",
    "check_fence",
    "check_integer",
    "check_key_value",
    "check_storable",
    "check_string",
    "check_text",
    "duration_ms",
    "integer_limits",
    "key_bounds",
    "out_of_range_error",
    "required_seconds",
    "resolve_target",
    "seconds",
    "split_values",
    "value_integers",
]

# --------------------------------------------------------------------------
# Values against their columns
# --------------------------------------------------------------------------


def value_integers(items: Iterable[tuple[str, Column[Any], Any]]) -> list[tuple[Column[Any], Any, str]]:
    """The int, str, Decimal and float values among ``(attr, column, value)`` items, as
    :func:`connection_for` checks them.

    A value of a plain ``String`` column that is not a str (bytes, an int, a
    UUID) is InvalidArgument here: drivers store it as they please (psycopg
    bytes as ``\\x..`` text, an int as its digits, asyncpg refuses it) or fail
    with an error that aborts a PostgreSQL transaction.
    """
    found = []
    for attr, col, value in items:
        kind = type(value)
        if (
            kind is not str
            and value is not None
            and not isinstance(value, str | ClauseElement)
            and isinstance(col.type, String)
            and not isinstance(col.type, Enum)
        ):
            raise InvalidArgument(
                f"values[{attr!r}] is for the text column {col.name}, so it must be a str, "
                f"got {kind.__name__} {value!r:.60}"
            )
        if kind is int or kind is str or (kind is not bool and isinstance(value, Decimal | float)):
            # A Decimal or float is checked against a NUMERIC(p, s) column's digits: the database
            # would round away extra decimal places, or refuse too many digits with an error that
            # aborts a PostgreSQL transaction.
            found.append((col, value, f"values[{attr!r}]"))
    return found


def check_string(info: ModelInfo, column: Column[Any] | None, value: str, what: str) -> None:
    """Raise InvalidArgument for a str no database would store as given.

    NUL (PostgreSQL refuses it in text; refused everywhere, so a model tested
    on SQLite refuses what production refuses), a lone surrogate (no UTF-8
    for it: the driver would raise UnicodeEncodeError), and for a value of a
    ``String(n)`` column more than ``n`` characters (PostgreSQL aborts the
    transaction, MariaDB refuses it in strict mode, SQLite would store it).
    """
    check_storable(value, f"{info.model.__name__} {what}")
    length = None if column is None else getattr(column.type, "length", None)
    if isinstance(length, int) and len(value) > length:
        raise InvalidArgument(
            f"{info.model.__name__} {what} is {len(value)} characters long; "
            f"column {column.name} holds at most {length}"  # type: ignore[union-attr]
        )


def key_bounds(conn: Connection, info: ModelInfo) -> tuple[tuple[int, int] | None, ...] | None:
    """The integer range of each primary-key column on ``conn``'s database (``None``: no integer key)."""
    of = backend(conn.dialect)
    found = info.key_limits.get(of)
    if found is None:
        bounds = tuple(integer_bounds(c, conn.dialect) for c in info.pk_columns)
        found = info.key_limits[of] = bounds if any(bounds) else ()
    return found or None


def integer_limits(conn: Connection, column: Column[Any]) -> tuple[int, int] | None:
    """The integers ``column`` holds on ``conn``'s database (memoised); ``None`` for other columns."""
    memo_key = ("int-bounds", column, backend(conn.dialect))
    limits = memo.get(memo_key)
    if limits is None:
        limits = memo.put(memo_key, integer_bounds(column, conn.dialect) or ())
    return limits or None


def check_integer(conn: Connection, info: ModelInfo, column: Column[Any], value: Any, what: str) -> None:
    """Raise InvalidArgument when the int ``value`` does not fit ``column`` on ``conn``'s database."""
    if type(value) is not int:
        return
    limits = integer_limits(conn, column)
    if limits and not limits[0] <= value <= limits[1]:
        raise out_of_range_error(info, column, value, limits, what)
    if not limits:
        # Not an integer column: an int for a NUMERIC(p, s) one must fit its p - s digits.
        check_exact(info, column, value, what)


def check_exact(info: ModelInfo, column: Column[Any], value: Decimal | float | int, what: str) -> None:
    """Raise InvalidArgument when ``value`` has more decimal places (or digits) than ``column`` stores.

    A ``Numeric(10, 2)`` column rounds ``0.004`` to ``0.00`` on assignment:
    ``decrement(..., by=Decimal("0.004"))`` would apply again and again while
    taking nothing.  Floats are judged by their shortest repr (``0.1`` has one
    decimal place).
    """
    digits = numeric_digits(column)
    if digits is None:
        return
    precision, scale = digits
    exact = value if isinstance(value, Decimal) else Decimal(value if isinstance(value, int) else repr(value))
    if not exact.is_finite():
        raise InvalidArgument(f"{what} must be a finite number, got {value!r}")
    exponent = exact.as_tuple().exponent
    places = -exponent if isinstance(exponent, int) and exponent < 0 else 0
    if places > scale:
        raise InvalidArgument(
            f"{info.model.__name__}.{column.name} stores {scale} decimal place(s); {what}={value!r} "
            f"has {places} and would be rounded by the database; nothing was sent"
        )
    if precision is not None and abs(exact) >= Decimal(10) ** (precision - scale):
        raise InvalidArgument(
            f"{info.model.__name__}.{column.name} is NUMERIC({precision}, {scale}): {what}={value!r} "
            f"has too many digits before the decimal point; nothing was sent"
        )


def out_of_range_error(
    info: ModelInfo, column: Column[Any], value: int, limits: tuple[int, int], what: str
) -> InvalidArgument:
    return InvalidArgument(
        f"{info.model.__name__}.{column.name} cannot hold {value} ({what}): on this database it "
        f"holds integers from {limits[0]} to {limits[1]}; nothing was sent"
    )


# --------------------------------------------------------------------------
# Targets and values of a call
# --------------------------------------------------------------------------


def _bad_key(info: ModelInfo, target: Any, why: str) -> InvalidArgument:
    pk = ", ".join(
        f"{c.name}: {t.__name__ if t else '?'}" for c, t in zip(info.pk_columns, info.pk_checks, strict=True)
    )
    return InvalidArgument(
        f"{info.model.__name__}: {target!r} is not a valid target ({why}); pass a primary key "
        f"({pk}){' as a tuple' if len(info.pk_columns) > 1 else ''} or a loaded "
        f"{info.model.__name__} instance"
    )


def check_key_value(info: ModelInfo, value: Any, i: int, target: Any) -> None:
    """Raise InvalidArgument unless ``value`` fits primary-key column ``i`` of ``info``'s model."""
    expected = info.pk_checks[i]
    if value is None:
        raise _bad_key(info, target, "a primary key value is None")
    if expected is None or isinstance(value, expected):
        if expected is int and isinstance(value, bool):
            raise _bad_key(info, target, "a bool is not an integer key")
        return
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return
    if expected.__module__ == "decimal" and isinstance(value, int | float):
        return
    raise _bad_key(info, target, f"expected {expected.__name__}, got {type(value).__name__}")


def resolve_target(session: Session | None, info: ModelInfo, target: Any) -> tuple[tuple[Any, ...], Any]:
    """``(key tuple, instance or None)`` for a primary key or a mapped instance."""
    # Fast path: a scalar integer/str key of a single-column primary key.
    if len(info.pk_checks) == 1 and type(target) is info.pk_checks[0]:
        return (target,), None
    state = getattr(target, "_sa_instance_state", None)
    if state is not None:
        if not isinstance(target, info.model):
            raise InvalidArgument(
                f"expected a {info.model.__name__} instance or primary key, got a "
                f"{type(target).__name__} instance"
            )
        identity = state.identity
        if identity is None:
            if state.pending and session is not None and state.session_id == session.hash_key:
                # A pending instance has no row yet: flush it, as ORM autoflush would.
                session.flush()
                identity = state.identity
            if identity is None:
                raise InvalidArgument(
                    f"{info.model.__name__} instance {target!r} has no primary key yet "
                    f"(transient or not flushed); add it to the session and flush first"
                )
        return tuple(identity), target
    key = target if isinstance(target, tuple) else (target,)
    if len(key) != len(info.pk_columns):
        raise _bad_key(info, target, f"the primary key has {len(info.pk_columns)} column(s)")
    for i, value in enumerate(key):
        check_key_value(info, value, i, target)
    return key, None


def split_values(
    info: ModelInfo,
    values: Mapping[str, Any] | None,
    *,
    forbidden: Mapping[str, str],
) -> tuple[tuple[tuple[str, Column[Any], Any], ...], bool]:
    """Validate user ``values`` by attribute name.

    Returns ``((attr, column, value), ...)`` sorted by attribute and whether
    any value is a SQL expression (which must be embedded in the statement
    rather than bound).  ``forbidden`` maps attribute names that must not be
    set this way to the reason.
    """
    if not values:
        return (), False
    if not isinstance(values, Mapping):
        raise InvalidArgument(
            f"values must be a mapping of attribute names to values, got {type(values).__name__}"
        )
    items = []
    has_sql = False
    for attr in sorted(values):
        if not isinstance(attr, str):
            raise InvalidArgument(f"values keys must be attribute names (str), got {attr!r}")
        reason = forbidden.get(attr)
        if reason is not None:
            raise InvalidArgument(f"{info.model.__name__}.{attr} cannot be set through values: {reason}")
        col = info.column(attr, role="a values entry")
        if col.primary_key:
            raise InvalidArgument(
                f"{info.model.__name__}.{attr} is part of the primary key and cannot be set"
            )
        value = values[attr]
        if isinstance(value, ClauseElement):
            has_sql = True
        items.append((attr, col, value))
    return tuple(items), has_sql


def check_fence(info: ModelInfo, fence: Any) -> None:
    """Raise InvalidArgument unless the model has a fence column and ``fence`` is a fencing token."""
    if info.fence_column is None:
        raise InvalidArgument(
            f"{info.model.__name__} has no fence column, so fence= cannot be checked; "
            f"declare one with fence_column()"
        )
    if type(fence) is not int or fence < 0:
        raise InvalidArgument(f"fence must be a non-negative int (a fencing token), got {fence!r}")


def check_text(value: Any, what: str, limit: int) -> str:
    """``value`` if it is a non-blank str of at most ``limit`` characters without NUL, else InvalidArgument.

    Keys are stored as given (no stripping, no case folding), so ``"a"`` and
    ``"a "`` are two keys; a blank key is almost always a client bug.
    """
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be a str, got {type(value).__name__}")
    if not value or value.isspace():  # blank: what strip() would empty, without building a copy
        raise InvalidArgument(f"{what} must not be blank, got {value!r}")
    if len(value) > limit:
        raise InvalidArgument(f"{what} is {len(value)} characters long; the limit is {limit}")
    if "\x00" in value or not value.isascii():  # check_storable's own first test, without its call
        check_storable(value, what)
    return value


def check_storable(value: str, what: str) -> str:
    """``value`` unless it holds a NUL or a lone surrogate (no database stores either: InvalidArgument)."""
    if "\x00" in value:
        raise InvalidArgument(f"{what} must not contain NUL characters")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            message = f"{what} contains a lone surrogate ({error.reason}): {value!r:.80}"
            raise InvalidArgument(message) from None
    return value


#: Texts shorter than this (in characters, 4 UTF-8 bytes each at most) are not checked against

# --------------------------------------------------------------------------
# Durations and batch sizes
# --------------------------------------------------------------------------

_ONE_MS: Final = timedelta(milliseconds=1)


def duration_ms(value: Any, what: str) -> int:
    """A positive :class:`~datetime.timedelta` as whole milliseconds, else InvalidArgument."""
    if not isinstance(value, timedelta):
        raise InvalidArgument(f"{what} must be a datetime.timedelta, got {value!r}")
    ms = value // _ONE_MS
    if ms < 1:
        raise InvalidArgument(f"{what} must be at least 1 millisecond, got {value!r}")
    return ms


def seconds(value: Any, what: str, *, allow_zero: bool) -> float | None:
    """Seconds (an int, a float or a :class:`~datetime.timedelta`) as a float; ``None`` stays ``None``.

    Negative, NaN or (unless ``allow_zero``) zero durations and any other
    type are InvalidArgument.
    """
    if value is None:
        return None
    if isinstance(value, timedelta):
        result = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        result = float(value)
    else:
        raise InvalidArgument(f"{what} must be seconds (int or float) or a timedelta, got {value!r}")
    if result < 0 or (result == 0 and not allow_zero) or result != result:
        raise InvalidArgument(f"{what} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return result


def required_seconds(value: Any, what: str) -> float:
    """A finite positive duration in seconds; ``None``, infinity and what :func:`seconds` refuses are
    InvalidArgument (no ``assert``: validation must also hold under ``python -O``)."""
    if value is None:
        raise InvalidArgument(f"{what} is required: pass seconds (int or float) or a timedelta")
    result = seconds(value, what, allow_zero=False)
    if result is None or result == float("inf"):
        raise InvalidArgument(f"{what} must be a finite duration, got {value!r}")
    return result


#: The largest LIMIT every database takes (a BIGINT); a larger batch or limit means "all" anyway.
MAX_LIMIT: Final = 2**63 - 1


def check_batch(batch: Any, what: str = "batch") -> int:
    """``batch`` if it is a positive int (at most :data:`MAX_LIMIT`: a larger one is that), else
    InvalidArgument."""
    if type(batch) is not int or batch < 1:
        raise InvalidArgument(f"{what} must be a positive int, got {batch!r}")
    return min(batch, MAX_LIMIT)
