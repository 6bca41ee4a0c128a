"""What a mapped class looks like to a guarded write (:class:`ModelInfo`, built once per
class), and its primary keys: spelled one way for the logs (:func:`canonical_key`),
decoded from them (:func:`decode_key`), ordered so that batches cannot deadlock
(:func:`key_order`).
"""

from __future__ import annotations

import datetime
import enum
import threading
import uuid
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any, Final

from sqlalchemy import ColumnElement, Table, and_, bindparam, inspect
from sqlalchemy.orm import Mapper
from sqlalchemy.schema import Column
from sqlalchemy.sql import sqltypes
from sqlalchemy.types import TypeDecorator

from ..exceptions import ConfigurationError, InvalidArgument
from .backend import Backend

__all__ = [
    "INFO_KEY",
    "ModelInfo",
    "canonical_key",
    "decode_key",
    "inexact_text_key",
    "key_order",
    "model_info",
    "public_key",
]

#: Marker stored in ``Column.info`` by :func:`stateguard.version_column`.
INFO_KEY: Final = "stateguard"


class ModelInfo:
    """Everything about a mapped class that a guarded write needs, computed once."""

    __slots__ = (
        "attr_by_column",
        "bind_arguments",
        "column_by_attr",
        "fence_attr",
        "fence_column",
        "identity_class",
        "key_kinds",
        "key_limits",
        "mapper",
        "model",
        "pk_checks",
        "pk_columns",
        "pk_names",
        "pk_where",
        "table",
        "text_key",
        "version_attr",
        "version_column",
    )

    def __init__(self, model: type[Any]) -> None:
        mapper: Mapper[Any] = inspect(model)
        table = mapper.local_table
        if not isinstance(table, Table):
            raise ConfigurationError(
                f"{model.__name__} is not mapped to a single table; stateguard needs one"
            )
        self.model = model
        self.mapper = mapper
        #: What ``Session.connection()`` needs to pick the model's bind (per-model binds).
        self.bind_arguments: dict[str, Any] = {"mapper": mapper}
        self.table: Table = table
        self.identity_class = mapper._identity_class
        self.pk_columns: tuple[Column[Any], ...] = tuple(mapper.primary_key)  # type: ignore[arg-type]
        self.pk_names = tuple(f"sg_pk{i}" for i in range(len(self.pk_columns)))
        self.pk_where = and_(
            *(c == bindparam(n, type_=c.type) for c, n in zip(self.pk_columns, self.pk_names, strict=True))
        )
        self.pk_checks = tuple(_python_type(c) for c in self.pk_columns)
        #: Per key column (type, Numeric scale) for canonical_key/decode_key; False until computed.
        self.key_kinds: Any = False
        #: Whether a key part may be a str (checked for NUL and lone surrogates before any statement).
        self.text_key = any(t is str or t is None for t in self.pk_checks)
        #: Per Backend (a handful, interned): the integer range of each key column, or ``()``.
        self.key_limits: dict[Backend, tuple[tuple[int, int] | None, ...]] = {}
        self.column_by_attr: dict[str, Column[Any]] = {}
        self.attr_by_column: dict[Column[Any], str] = {}
        for prop in mapper.column_attrs:
            col = prop.columns[0]
            if isinstance(col, Column) and col.table is table:
                self.column_by_attr[prop.key] = col
                self.attr_by_column[col] = prop.key
        vcol = mapper.version_id_col
        if vcol is not None and vcol.table is not table:  # pragma: no cover - inheritance edge
            vcol = None
        self.version_column: Column[Any] | None = vcol  # type: ignore[assignment]
        self.version_attr = self.attr_by_column.get(vcol) if vcol is not None else None  # type: ignore[call-overload]
        self.fence_column: Column[Any] | None = None
        self.fence_attr: str | None = None
        for attr, col in self.column_by_attr.items():
            if col.info.get(INFO_KEY) == "fence":
                self.fence_column, self.fence_attr = col, attr

    def column(self, attr: str, *, role: str) -> Column[Any]:
        col = self.column_by_attr.get(attr)
        if col is None:
            raise InvalidArgument(
                f"{self.model.__name__} has no mapped column attribute {attr!r} "
                f"(used as {role}); known: {sorted(self.column_by_attr)}"
            )
        return col

    def bound_pk_where(self, params: Mapping[str, Any]) -> ColumnElement[bool]:
        return and_(
            *(
                c == bindparam(n, params[n], type_=c.type)
                for c, n in zip(self.pk_columns, self.pk_names, strict=True)
            )
        )

    def key_params(self, key: tuple[Any, ...]) -> dict[str, Any]:
        if len(key) == 1:
            return {"sg_pk0": key[0]}
        return dict(zip(self.pk_names, key, strict=True))


def _python_type(col: Column[Any]) -> type | None:
    try:
        return col.type.python_type
    except NotImplementedError:
        return None


_infos: dict[type, ModelInfo] = {}
_infos_lock = threading.Lock()


def model_info(model: type[Any]) -> ModelInfo:
    """The :class:`ModelInfo` of a mapped class (built once per class)."""
    found = _infos.get(model)
    if found is None:
        with _infos_lock:
            found = _infos.get(model)
            if found is None:
                found = _infos[model] = ModelInfo(model)
    return found


def public_key(key: tuple[Any, ...]) -> Any:
    return key[0] if len(key) == 1 else key


def _key_kinds(info: ModelInfo) -> tuple[tuple[type | None, int | None], ...] | None:
    """Per key column, the Python type and Numeric scale :func:`canonical_key` needs; ``None`` when
    every key column is an int or a str (nothing to canonicalise or decode)."""
    kinds = info.key_kinds
    if kinds is False:
        found = tuple(
            (_python_type(c), getattr(c.type, "scale", None) if _python_type(c) is Decimal else None)
            for c in info.pk_columns
        )
        kinds = info.key_kinds = None if all(t in (int, str) for t, _ in found) else found
    result: tuple[tuple[type | None, int | None], ...] | None = kinds
    return result


def canonical_key(info: ModelInfo, key: tuple[Any, ...]) -> tuple[Any, ...]:
    """``key`` spelled one way for the transition log and the counter ledger.

    The database matches ``1.5``, ``1.50`` and ``Decimal("1.500")`` to the
    same ``NUMERIC(10, 2)`` row; their JSON would differ, and a ref or
    request id would then apply twice.  Decimals, ints and floats of a
    Numeric key with a scale are quantized to it when that is exact.
    """
    kinds = _key_kinds(info)
    if kinds is None:
        return key
    out = []
    for value, (kind, scale) in zip(key, kinds, strict=True):
        if kind is Decimal and scale is not None and type(value) in (int, float, Decimal):
            # A float by its shortest repr (1.5, not 1.5000000000000000), as check_exact reads it.
            given = Decimal(repr(value)) if type(value) is float else Decimal(value)
            try:
                exact = given.quantize(Decimal(1).scaleb(-scale))
            except InvalidOperation:  # NaN, infinity, more digits than the context holds
                exact = None
            if exact is not None and exact == given:
                value = exact
        out.append(value)
    return tuple(out)


def inexact_text_key(info: ModelInfo, backend: Backend) -> bool:
    """Whether ``backend``'s database may match a text key part to a row spelled otherwise.

    MariaDB's and MySQL's default collations ignore case and trailing spaces:
    ``'SKU-A'`` and ``'sku-a '`` find the row ``'sku-a'``.  A ``String`` key
    column without a binary (``*_bin``) collation there; type decorators
    (such as :class:`~stateguard.tables.ExactString`) declare their own.
    """
    if not backend.folds_text:
        return False
    for column in info.pk_columns:
        kind = column.type
        if isinstance(kind, TypeDecorator) or not isinstance(kind, sqltypes.String):
            continue
        if isinstance(kind, sqltypes.Enum):
            continue
        collation = getattr(kind, "collation", None)
        if collation is None or not collation.endswith("_bin"):
            return True
    return False


def key_order(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """A sort key for primary keys (Enum members, which do not order, sort by value): rows are
    changed in this order by reserve() and release(), so the two cannot deadlock."""
    return tuple(v.value if isinstance(v, enum.Enum) else v for v in key)


def decode_key(info: ModelInfo, stored: Any) -> tuple[Any, ...]:
    """The key a ``row_key`` JSON (already parsed) stands for, as the key columns take it.

    JSON keeps ints and strs; the rest was written with ``str()`` (UUIDs,
    dates, Decimals, Enum members): turned back by the column's Python type,
    so ``release()`` finds the row it changed on every backend (SQLite's Uuid
    and Date types take only their own Python objects).
    """
    parts = tuple(stored) if isinstance(stored, list) else (stored,)
    kinds = _key_kinds(info)
    if kinds is None:
        return parts
    return tuple(_decode_part(value, kind) for value, (kind, _) in zip(parts, kinds, strict=True))


def _decode_part(value: Any, kind: type | None) -> Any:
    if kind is None or not isinstance(value, str) or kind is str:
        return value
    if issubclass(kind, enum.Enum):
        for member in kind:
            if str(member) == value or member.value == value or member.name == value:
                return member
        return value
    if kind is uuid.UUID:
        return uuid.UUID(value)
    if kind is datetime.datetime:
        return datetime.datetime.fromisoformat(value)
    if kind is datetime.date:
        return datetime.date.fromisoformat(value)
    if kind is datetime.time:
        return datetime.time.fromisoformat(value)
    if kind is Decimal:
        return Decimal(value)
    return value
