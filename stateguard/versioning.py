"""Version columns and the optimistic-lock guarded update (``docs/explanation/schemes.md``).

:func:`version_column` declares an integer column that is *also* SQLAlchemy's
``version_id_col``: ordinary ORM flushes of the model are version-checked by
SQLAlchemy itself (raising ``StaleDataError``) and stateguard's statements
increment the same column, so both paths agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import BigInteger, Integer, text, update
from sqlalchemy.orm import MappedColumn, Session

from . import _sql, _write
from ._async import dual
from .exceptions import ConfigurationError, InvalidArgument
from .result import Outcome, Result

__all__ = ["column_role", "fence_column", "guarded_update", "version_column"]


def column_role(column: Any) -> str | None:
    """``"version"`` or ``"fence"`` for a column declared by :func:`version_column` or
    :func:`fence_column`, else ``None``::

        column_role(Order.__table__.c.version)   # 'version'
    """
    info = getattr(column, "info", None)
    return info.get(_sql.INFO_KEY) if isinstance(info, dict) else None


class _VersionColumn(MappedColumn[int]):
    """A ``mapped_column`` that registers itself as the mapper's ``version_id_col``."""

    def __set_name__(self, owner: type[Any], name: str) -> None:
        # Runs while the class body is being turned into a class, before the
        # declarative scan reads ``__mapper_args__``.
        args = owner.__dict__.get("__mapper_args__")
        if args is None:
            inherited = getattr(owner, "__mapper_args__", None)
            args = dict(inherited) if isinstance(inherited, Mapping) else {}
        elif not isinstance(args, Mapping):
            raise ConfigurationError(
                f"{owner.__name__}.{name}: version_column() cannot be combined with a "
                f"__mapper_args__ that is not a plain dict; set version_id_col there yourself"
            )
        existing = args.get("version_id_col")
        if existing is not None and existing is not self.column:
            raise ConfigurationError(
                f"{owner.__name__}.{name}: the model already declares another version_id_col"
            )
        type.__setattr__(owner, "__mapper_args__", {**args, "version_id_col": self.column})


def version_column(*, name: str | None = None, type_: Any = Integer, **kw: Any) -> MappedColumn[int]:
    """An ``INTEGER NOT NULL`` version column with server default ``0``.

    ``type_=BigInteger`` for a row written more than 2,147,483,647 times in
    its life (a hot counter row: every guarded write increments the version);
    a write past the type's maximum is :class:`~stateguard.ConfigurationError`.

    It is wired as SQLAlchemy's ``version_id_col``, so plain ORM updates of the
    model are version-checked too; every stateguard write increments it::

        class Order(Base):
            __tablename__ = "orders"
            id: Mapped[int] = mapped_column(primary_key=True)
            version: Mapped[int] = version_column()

    Rows inserted through the ORM start at 1 (SQLAlchemy's version counter);
    rows inserted otherwise, and existing rows when the column is added by a
    migration, start at 0.
    """
    kw.setdefault("nullable", False)
    kw.setdefault("server_default", text("0"))
    info = dict(kw.pop("info", None) or {})
    info[_sql.INFO_KEY] = "version"
    kind = type_() if isinstance(type_, type) else type_
    if not isinstance(kind, Integer):
        raise ConfigurationError(
            f"version_column(type_=...) must be an integer type (Integer, BigInteger, SmallInteger), "
            f"got {type_!r}"
        )
    args: tuple[Any, ...] = (name, kind) if name else (kind,)
    return _VersionColumn(*args, info=info, **kw)


def fence_column(*, name: str | None = None, **kw: Any) -> MappedColumn[int | None]:
    """A nullable ``BIGINT`` column that records the fencing token of the last writer.

    Triggers and :func:`guarded_update` called with ``fence=`` only write when
    the stored token is NULL or not newer than the caller's, and store the
    caller's token, so a lock holder whose lock expired while it was paused
    gets STALE instead of overwriting a newer holder's write::

        class Payout(Base):
            __tablename__ = "payouts"
            id: Mapped[int] = mapped_column(primary_key=True)
            fence: Mapped[int | None] = fence_column()

        with RedisLock(redis, "payout:42", ttl=timedelta(seconds=30)) as token:
            Payout.flow.send(session, 42, fence=token)
    """
    kw.setdefault("nullable", True)
    info = dict(kw.pop("info", None) or {})
    info[_sql.INFO_KEY] = "fence"
    args: tuple[Any, ...] = (name, BigInteger) if name else (BigInteger,)
    return MappedColumn(*args, info=info, **kw)


@dual
def guarded_update(
    session: Session,
    model: type[Any],
    target: Any,
    values: Mapping[str, Any],
    *,
    expected_version: int,
    fence: int | None = None,
) -> Result:
    """``UPDATE ... SET values, version = version + 1 WHERE pk = :pk AND version = :expected``.

    APPLIED when the row still had ``expected_version``; STALE (with the
    version found) when someone else changed it; NOT_FOUND when it is gone::

        order = session.get(Order, 42)
        r = guarded_update(session, Order, 42, {"note": "gift"},
                           expected_version=order.version)
        r.raise_for_outcome()      # StaleVersion if someone else wrote first

    With ``fence=`` (a fencing token) the model needs a :func:`fence_column`;
    the row's stored token must not be newer (else STALE) and becomes ``fence``.
    """
    from .machine import machines_of

    info = _sql.model_info(model)
    if info.version_column is None:
        raise ConfigurationError(f"{model.__name__} has no version column; declare one with version_column()")
    if type(expected_version) is not int:
        raise InvalidArgument(f"expected_version must be an int, got {expected_version!r}")
    key, instance = _write.resolve_target(session, info, target)
    if fence is not None:
        _write.check_fence(info, fence)
    forbidden = {info.version_attr or "": "it is the version column; stateguard increments it"}
    if info.fence_attr is not None:
        forbidden[info.fence_attr] = "it is the fence column; pass fence= instead"
    for m in machines_of(model):
        forbidden[m.attr] = f"it is the state column of {m.name}; fire a trigger instead"
    items, has_sql = _write.split_values(info, values, forbidden=forbidden)
    if not items:
        raise InvalidArgument("guarded_update needs at least one value to set")
    integers = _write.value_integers(items)
    integers.append((info.version_column, expected_version, "expected_version"))
    if fence is not None and info.fence_column is not None:
        integers.append((info.fence_column, fence, "fence"))
    conn = _write.connection_for(session, info, (key,), integers)
    backend = _sql.backend(conn.dialect)
    variant = _sql.variant_key(items, has_sql)
    cache_key = ("guarded_update", info, variant, fence is not None)
    stmt = _write.memo.get(cache_key) if variant is not None else None
    if stmt is None:
        vcol = info.version_column
        pairs = _sql.set_clause(items, embed=False)
        pairs.append((vcol, vcol + 1))
        conditions = [info.pk_where, vcol == _sql.bindparam("sg_expected", type_=vcol.type)]
        fcol = info.fence_column
        if fence is not None and fcol is not None:
            pairs.append((fcol, _sql.bindparam("sg_fence", type_=fcol.type)))
            conditions.append(_sql.fence_condition(fcol))
        stmt = update(info.table).where(*conditions).ordered_values(*pairs)
        if variant is not None:
            _write.memo.put(cache_key, stmt)
    params = info.key_params(key)
    params.update(_sql.value_params(items))
    params["sg_expected"] = expected_version
    if fence is not None:
        params["sg_fence"] = fence
    applied, _ = _write.run_guarded(conn, stmt, params, returning=False)
    public = _sql.public_key(key)
    if applied:
        version = expected_version + 1
        committed: dict[str, Any] = {info.version_attr: version} if info.version_attr is not None else {}
        if fence is not None and info.fence_attr is not None:
            committed[info.fence_attr] = fence
        _write.sync_loaded(session, info, key, instance, committed, [a for a, _, _ in items])
        return Result(
            Outcome.APPLIED,
            model=model,
            key=public,
            version=version,
            expected_version=expected_version,
            session=session,
        )
    read = _write.read_back(info, [info.version_column], backend)
    row = _write.execute(conn, read, info.key_params(key)).first()
    if row is None:
        return Result(
            Outcome.NOT_FOUND, model=model, key=public, expected_version=expected_version, session=session
        )
    return Result(
        Outcome.STALE,
        model=model,
        key=public,
        version=row[0],
        expected_version=expected_version,
        session=session,
    )
