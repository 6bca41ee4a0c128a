"""The sync/async bridge: every public call written once, synchronously, against a
:class:`~sqlalchemy.orm.Session`, and given an AsyncSession the same call returns a
coroutine that runs that code through :meth:`AsyncSession.run_sync` (SQLAlchemy's own
greenlet bridge).

Five shapes of call get their async face in this package, and nowhere else:

- :func:`dual`: module functions whose first parameter is the session;
- :func:`dual_connectable`: module functions whose first parameter is an
  Engine or a Connection (``create_tables``), awaited on an AsyncEngine or
  AsyncConnection through :meth:`AsyncConnection.run_sync`;
- :class:`~stateguard._async.methods.dual_method`: methods whose first
  parameter after ``self`` is the session;
- :class:`DualContext`: context managers, ``with`` on a Session and ``async with`` on an AsyncSession
  (:class:`DualContextManager` for one that is its own synchronous context manager);
- :class:`~stateguard._async.methods.dual_member` on a
  :class:`~stateguard._async.methods.DualObject`: methods of an object made for
  one session (what ``async with`` handed out), which take no session
  themselves: ``call.complete(r)`` / ``await call.complete(r)``.

This module holds the functions and the context managers; the methods and
members, which the class gets as real functions with the implementation's own
parameters under the public name (so ``inspect.signature``, ``help()``,
qualnames and tracebacks show the public call), are in :mod:`.methods`.
Anything else where the session belongs is an InvalidArgument that says what
to pass (:func:`~stateguard._async.sessions.wrong_session`, in :mod:`.sessions`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Coroutine
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, overload

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session, scoped_session

from .. import observe as _observe
from ..exceptions import InvalidArgument
from .sessions import AsyncConnection, AsyncEngine, AsyncSession, as_session, sync_session_of, wrong_session

__all__ = [
    "Dual",
    "DualConnectable",
    "DualContext",
    "DualContextManager",
    "dual",
    "dual_bind",
    "dual_connectable",
]

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
T = TypeVar("T")
S = TypeVar("S")
S_contra = TypeVar("S_contra", contravariant=True)


class Dual(Protocol[S_contra, P, R_co]):
    """A public call that takes a Session (returns the result) or an AsyncSession (returns a coroutine)."""

    @overload
    def __call__(self, session: S_contra, /, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    @overload
    def __call__(
        self, session: AsyncSession, /, *args: P.args, **kwargs: P.kwargs
    ) -> Coroutine[Any, Any, R_co]: ...


def dual(fn: Callable[Concatenate[S, P], R]) -> Dual[S, P, R]:
    """Make ``fn(session, ...)`` also accept an AsyncSession, returning an awaitable then.

    Anything else where the session belongs (an Engine, a Connection, an
    AsyncEngine ...) is an :class:`~stateguard.InvalidArgument` that says what
    to pass, before anything runs.
    """
    what = f"{fn.__name__}()"
    operation = fn.__name__.lstrip("_")
    logger = logging.getLogger(fn.__module__)

    @functools.wraps(fn)
    def call(session: Any, /, *args: Any, **kwargs: Any) -> Any:
        # The one flag test of the fast path; the report (stateguard.observe) only when asked for.
        watched = _observe.hooked or logger.isEnabledFor(logging.DEBUG)
        if isinstance(session, AsyncSession):
            if watched:
                return session.run_sync(_observe.observe_session_call, operation, logger, fn, *args, **kwargs)
            return session.run_sync(fn, *args, **kwargs)  # type: ignore[arg-type]
        if watched:
            return _observe.observe_session_call(
                as_session(session, what, args, kwargs), operation, logger, fn, *args, **kwargs
            )
        return fn(as_session(session, what, args, kwargs), *args, **kwargs)

    return call


def dual_bind(fn: Callable[Concatenate[S, P], R]) -> Dual[S, P, R]:
    """:func:`dual` for calls that also take an Engine or a Connection (the purges)."""
    what = f"{fn.__name__}()"

    @functools.wraps(fn)
    def call(bind: Any, /, *args: Any, **kwargs: Any) -> Any:
        if isinstance(bind, AsyncSession):
            return bind.run_sync(fn, *args, **kwargs)  # type: ignore[arg-type]
        if isinstance(bind, scoped_session):
            bind = bind()
        elif not isinstance(bind, Session | Engine | Connection):
            raise wrong_session(bind, what, binds=True, args=args, kwargs=kwargs)
        return fn(bind, *args, **kwargs)

    return call


class DualConnectable(Protocol[P, R_co]):
    """A public call that takes an Engine or a Connection (returns the result), or an AsyncEngine or
    AsyncConnection (returns a coroutine)."""

    @overload
    def __call__(self, bind: Engine | Connection, /, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    @overload
    def __call__(
        self, bind: AsyncEngine | AsyncConnection, /, *args: P.args, **kwargs: P.kwargs
    ) -> Coroutine[Any, Any, R_co]: ...


def dual_connectable(fn: Callable[Concatenate[Engine | Connection, P], R]) -> DualConnectable[P, R]:
    """Make ``fn(bind, ...)`` (an Engine or a Connection) also accept an AsyncEngine or AsyncConnection.

    ::

        create_tables(engine)                  # Engine or Connection: runs now
        await create_tables(async_engine)      # AsyncEngine: in one transaction of its own
        await create_tables(async_connection)  # AsyncConnection: in that connection's transaction

    The synchronous ``fn`` runs through :meth:`AsyncConnection.run_sync`;
    anything else where the bind belongs is an :class:`~stateguard.InvalidArgument`.
    """
    what = f"{fn.__name__.lstrip('_')}()"

    @functools.wraps(fn)
    def call(bind: Any, /, *args: Any, **kwargs: Any) -> Any:
        if isinstance(bind, AsyncConnection):
            return bind.run_sync(fn, *args, **kwargs)
        if isinstance(bind, AsyncEngine):
            return _on_async_engine(bind, fn, *args, **kwargs)
        if not isinstance(bind, Engine | Connection):
            raise InvalidArgument(
                f"{what} needs an Engine or a Connection (or an AsyncEngine or AsyncConnection, "
                f"awaited), got {type(bind).__name__}"
                + (": pass the session's bind, session.get_bind()" if isinstance(bind, Session) else "")
            )
        return fn(bind, *args, **kwargs)

    return call


async def _on_async_engine(engine: AsyncEngine, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> R:
    async with engine.begin() as conn:
        return await conn.run_sync(fn, *args, **kwargs)


class DualContext(Generic[T]):
    """A context manager for ``with`` on a Session and ``async with`` on an AsyncSession.

    ``factory(sync_session)`` builds the synchronous context manager; with an
    AsyncSession it is built, entered and exited inside ``run_sync``.  ``name``
    is what the error for a ``with`` / ``async with`` mix-up calls it.
    """

    __slots__ = ("_async", "_cm", "_factory", "_name", "_session")

    def __init__(
        self,
        session: Any,
        factory: Callable[[Session], AbstractContextManager[T]],
        *,
        name: str = "this call",
    ) -> None:
        self._async = session if isinstance(session, AsyncSession) else None
        self._session = sync_session_of(session) if self._async is not None else as_session(session, name)
        self._factory = factory
        self._name = name
        self._cm: AbstractContextManager[T] | None = None

    @classmethod
    def checked(
        cls,
        session: Any,
        sync_session: Session,
        factory: Callable[[Session], AbstractContextManager[T]],
        name: str,
    ) -> DualContext[T]:
        """The same for a caller that has already told the two kinds apart: ``session`` is an
        AsyncSession whose ``sync_session`` is ``sync_session``, or is ``sync_session`` itself."""
        self = cls.__new__(cls)
        self._async = None if session is sync_session else session
        self._session = sync_session
        self._factory = factory
        self._name = name
        self._cm = None
        return self

    def __enter__(self) -> T:
        if self._async is not None:
            raise InvalidArgument(f"{self._name} got an AsyncSession: use `async with`, not `with`")
        self._cm = self._factory(self._session)
        return self._cm.__enter__()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        if self._cm is None:
            raise InvalidArgument("__exit__ without __enter__: use this object in a with statement")
        return self._cm.__exit__(exc_type, exc, tb)

    async def __aenter__(self) -> T:
        if self._async is None:
            raise InvalidArgument(f"{self._name} got a Session: use `with`, not `async with`")

        def enter(session: Session) -> T:
            self._cm = self._factory(session)
            return self._cm.__enter__()

        return await self._async.run_sync(enter)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        if self._async is None or self._cm is None:
            raise InvalidArgument("__aexit__ without __aenter__: use this object in an async with statement")
        cm = self._cm
        return await self._async.run_sync(lambda _session: cm.__exit__(exc_type, exc, tb))


class DualContextManager(DualContext[T]):
    """A :class:`DualContext` that is its own synchronous context manager, with no factory in between.

    A subclass writes :meth:`_enter` and ``__exit__`` once, synchronously, and its constructor
    sets ``_async`` (the AsyncSession it was made for, or ``None``) and ``_name`` (what the error
    for a ``with`` / ``async with`` mix-up calls it): ``with`` runs them directly on a Session
    (three frames fewer than a factory's context, for a context entered on every call),
    ``async with`` inside ``run_sync`` on an AsyncSession.
    """

    __slots__ = ()

    def _enter(self) -> T:
        """What entering does, on the synchronous session."""
        raise NotImplementedError

    def __enter__(self) -> T:
        if self._async is not None:
            raise InvalidArgument(f"{self._name} got an AsyncSession: use `async with`, not `with`")
        return self._enter()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        raise NotImplementedError

    async def __aenter__(self) -> T:
        if self._async is None:
            raise InvalidArgument(f"{self._name} got a Session: use `with`, not `async with`")
        return await self._async.run_sync(lambda _session: self._enter())

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        if self._async is None:
            raise InvalidArgument("__aexit__ without __aenter__: use this object in an async with statement")
        return await self._async.run_sync(lambda _session: self.__exit__(exc_type, exc, tb))
