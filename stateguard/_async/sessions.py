"""Where a session belongs: what a public call accepts there, and the error that says what to pass.

Every dual call (:mod:`.bridge`, :mod:`.methods`) takes a Session, a
``scoped_session`` (its current Session) or an AsyncSession where the session
belongs; anything else (an Engine, a Connection, a ``sessionmaker`` ...) is an
:class:`~stateguard.InvalidArgument` built by :func:`wrong_session`, which
names what was passed and shows the user's own call with a session in its
place.  The AsyncSession, AsyncEngine and AsyncConnection classes the bridge
tests for come from here too: stand-ins no object can be an instance of when
SQLAlchemy's asyncio extension cannot load (SQLAlchemy 2.1 without greenlet).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy.orm import QueryableAttribute, Session, scoped_session

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
else:
    try:
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
    except ImportError:  # SQLAlchemy 2.1 needs greenlet for it: `pip install 'stateguard[async]'`

        class AsyncSession:
            """Stand-in when SQLAlchemy's asyncio extension cannot load: no AsyncSession can exist then."""

        class AsyncEngine:
            """Stand-in when SQLAlchemy's asyncio extension cannot load: no AsyncEngine can exist then."""

        class AsyncConnection:
            """Stand-in when SQLAlchemy's asyncio extension cannot load: no AsyncConnection can exist then."""


from ..exceptions import InvalidArgument

__all__ = ["AsyncConnection", "AsyncEngine", "AsyncSession", "as_session", "sync_session_of", "wrong_session"]


#: What to do instead, by the type name of the object a call got where a session belongs;
#: ``{call}`` is the user's call with ``session`` in the session's place.
_INSTEAD: dict[str, str] = {
    "Engine": "pass Session(engine): `with Session(engine) as session, session.begin(): {call}`",
    "Connection": "pass Session(bind=connection) to run in that connection's transaction: "
    "`session = Session(bind=connection); {call}`",
    "AsyncEngine": "pass AsyncSession(engine) and await the call: "
    "`async with AsyncSession(engine) as session, session.begin(): await {call}`",
    "AsyncConnection": "pass AsyncSession(bind=connection) and await the call: "
    "`session = AsyncSession(bind=connection); await {call}`",
    "sessionmaker": "call the factory: pass factory(), not factory: "
    "`with factory() as session, session.begin(): {call}`",
    "async_sessionmaker": "call the factory: pass factory(), not factory: "
    "`async with factory() as session, session.begin(): await {call}`",
}
_INSTEAD_OTHER: Final = "pass a sqlalchemy.orm.Session (or an AsyncSession and await the call): `{call}`"

#: Longest text of the user's other arguments shown in the example call (else ``...``).
_SHOWN_ARGUMENTS: Final = 60


def wrong_session(
    got: Any,
    what: str,
    *,
    binds: bool = False,
    args: tuple[Any, ...] | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> InvalidArgument:
    """The InvalidArgument for a call that got ``got`` where a session belongs, saying what to pass.

    ``what`` is the public call as the user wrote it (``"Order.flow.pay()"``);
    ``args`` and ``kwargs`` are its other arguments, shown in the example
    (``None``: not known, shown as ``...``)::

        Order.flow.pay() needs a Session (or an AsyncSession) as its first argument, got Engine:
        pass Session(engine): `with Session(engine) as session, session.begin(): Order.flow.pay(session, 1)`
    """
    kind = type(got).__name__
    wanted = "a Session, an Engine or a Connection" if binds else "a Session"
    # "..." when ``what`` is no call's name (a DualContext made without one).
    call = f"{what.removesuffix('()')}({_shown(args, kwargs)})" if what.endswith("()") else "..."
    instead = _INSTEAD.get(kind, _INSTEAD_OTHER).format(call=call)
    return InvalidArgument(
        f"{what} needs {wanted} (or an AsyncSession) as its first argument, got {kind}: {instead}"
    )


def _shown(args: tuple[Any, ...] | None, kwargs: Mapping[str, Any] | None) -> str:
    """``session`` and the other arguments of a call, as the example in :func:`wrong_session` writes them."""
    if args is None and kwargs is None:
        return "session, ..."
    args, kwargs = args or (), kwargs or {}
    try:
        parts = [_argument(a) for a in args] + [f"{k}={_argument(v)}" for k, v in kwargs.items()]
    except Exception:  # a repr that raises must not hide the real mistake
        parts = ["..."]
    rest = ", ".join(parts)
    if len(rest) > _SHOWN_ARGUMENTS:
        rest = "..."
    return f"session, {rest}" if rest else "session"


def _argument(value: Any) -> str:
    """One argument as source text: a class or mapped attribute by name, a plain value's repr, or ``...``."""
    if isinstance(value, type):
        return value.__name__
    if isinstance(value, QueryableAttribute):
        return f"{value.class_.__name__}.{value.key}"
    if value is None or isinstance(
        value, int | float | str | bytes | Decimal | uuid.UUID | list | tuple | dict
    ):
        return repr(value)
    return "..."


def as_session(
    session: Any, what: str, args: tuple[Any, ...] | None = None, kwargs: Mapping[str, Any] | None = None
) -> Any:
    """``session`` if it is a Session (a ``scoped_session``'s current one), else the typed error.

    AsyncSessions are handled by the caller before this.  ``args`` and
    ``kwargs`` (the call's other arguments) only go into the error's example.
    """
    if isinstance(session, Session):
        return session
    if isinstance(session, scoped_session):
        return session()
    raise wrong_session(session, what, args=args, kwargs=kwargs)


def sync_session_of(session: Session | AsyncSession) -> Session:
    """The synchronous Session behind ``session`` (itself when it is one)."""
    if isinstance(session, AsyncSession):
        return session.sync_session
    return session
