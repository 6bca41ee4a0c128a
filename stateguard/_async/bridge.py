"""The sync/async bridge: every public call written once, synchronously, against a
:class:`~sqlalchemy.orm.Session`, and given an AsyncSession the same call returns a
coroutine that runs that code through :meth:`AsyncSession.run_sync` (SQLAlchemy's own
greenlet bridge).

Five shapes of call get their async face here, and nowhere else:

- :func:`dual`: module functions whose first parameter is the session;
- :func:`dual_connectable`: module functions whose first parameter is an
  Engine or a Connection (``create_tables``), awaited on an AsyncEngine or
  AsyncConnection through :meth:`AsyncConnection.run_sync`;
- :class:`dual_method`: methods whose first parameter after ``self`` is the session;
- :class:`DualContext`: context managers, ``with`` on a Session and ``async with`` on an AsyncSession;
- :class:`dual_member` on a :class:`DualObject`: methods of an object made for
  one session (what ``async with`` handed out), which take no session
  themselves: ``call.complete(r)`` / ``await call.complete(r)``.

What the class gets from :class:`dual_method` and :class:`dual_member` is a
real function with the implementation's own parameters under the public name,
so ``inspect.signature``, ``help()``, qualnames and tracebacks show the public
call.  Anything else where the session belongs is an InvalidArgument that says
what to pass (:func:`wrong_session`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
import uuid
from collections.abc import Callable, Coroutine, Mapping
from contextlib import AbstractContextManager
from decimal import Decimal
from types import TracebackType
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Final,
    Generic,
    ParamSpec,
    Protocol,
    TypeVar,
    cast,
    overload,
)

from sqlalchemy import Connection, Engine
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


from .. import observe as _observe
from ..exceptions import InvalidArgument

__all__ = [
    "AsyncSession",
    "Dual",
    "DualConnectable",
    "DualContext",
    "DualObject",
    "as_session",
    "dual",
    "dual_bind",
    "dual_connectable",
    "dual_member",
    "dual_method",
    "sync_session_of",
    "wrong_session",
]

Obj = TypeVar("Obj")
P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
T = TypeVar("T")
S = TypeVar("S")
S_co = TypeVar("S_co", covariant=True)
S_contra = TypeVar("S_contra", contravariant=True)


class Dual(Protocol[S_contra, P, R_co]):
    """A public call that takes a Session (returns the result) or an AsyncSession (returns a coroutine)."""

    @overload
    def __call__(self, session: S_contra, /, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    @overload
    def __call__(
        self, session: AsyncSession, /, *args: P.args, **kwargs: P.kwargs
    ) -> Coroutine[Any, Any, R_co]: ...


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


def _call_method(session: Session, fn: Callable[..., Any], obj: Any, /, *args: Any, **kwargs: Any) -> Any:
    return fn(obj, session, *args, **kwargs)


def _observe_method(
    session: Session,
    operation: str,
    logger: logging.Logger,
    fn: Callable[..., Any],
    obj: Any,
    /,
    *args: Any,
    **kwargs: Any,
) -> Any:
    # A trigger names its model and trigger up front, so a call that raises still reports them.
    machine = getattr(obj, "machine", None)
    if machine is not None:  # a Trigger
        model, trigger, scope = machine.model, getattr(obj, "name", None), None
    else:  # a StateMachine (its model) or a named object such as a StripedCounter
        model, trigger, scope = getattr(obj, "model", None), None, getattr(obj, "name", None)
    return _observe.observe_session_call(
        session,
        operation,
        logger,
        _call_method,
        fn,
        obj,
        *args,
        sg_model=model,
        sg_trigger=trigger,
        sg_scope=scope if isinstance(scope, str) else None,
        **kwargs,
    )


def _public_name(obj: Any, attribute: str) -> str:
    """The call as the user wrote it: ``Order.flow.pay()``, ``Order.flow.pay.many()``,
    ``Order.flow.fire()``, ``StripedCounter('stock', stripes=8).decrement()``."""
    machine = getattr(obj, "machine", None)
    qualname = getattr(machine, "qualname", None)
    if isinstance(qualname, str):  # a Trigger of a bound machine
        base = f"{qualname}.{getattr(obj, 'name', '?')}"
    else:  # a StateMachine (its qualname), or an object its repr names (a StripedCounter)
        qualname = getattr(obj, "qualname", None)
        base = qualname if isinstance(qualname, str) else repr(obj)
    return f"{base}()" if attribute == "__call__" else f"{base}.{attribute}()"


class _BoundDual:
    """A dual method bound to its object (what ``trigger.many`` evaluates to)."""

    __slots__ = ("attribute", "fn", "logger", "obj", "operation")

    def __init__(
        self, fn: Callable[..., Any], obj: Any, operation: str, logger: logging.Logger, attribute: str
    ) -> None:
        self.fn = fn
        self.obj = obj
        self.operation = operation
        self.logger = logger
        #: The attribute the method is on the object's class (``many``; ``__call__`` for a trigger).
        self.attribute = attribute

    @property
    def __doc__(self) -> str | None:  # type: ignore[override]
        return self.fn.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            session, args = args[0], args[1:]
        else:
            # ``trigger(session=s, target=1)``: a method's session may be passed by keyword.
            session = kwargs.pop("session", None)
        watched = _observe.hooked or self.logger.isEnabledFor(logging.DEBUG)
        if isinstance(session, AsyncSession):
            if watched:
                return session.run_sync(
                    _observe_method, self.operation, self.logger, self.fn, self.obj, *args, **kwargs
                )
            return session.run_sync(_call_method, self.fn, self.obj, *args, **kwargs)
        if not isinstance(session, Session):
            session = as_session(session, _public_name(self.obj, self.attribute), args, kwargs)
        if watched:
            return _observe_method(session, self.operation, self.logger, self.fn, self.obj, *args, **kwargs)
        return self.fn(self.obj, session, *args, **kwargs)


# --------------------------------------------------------------------------
# Public methods as real functions
# --------------------------------------------------------------------------
#
# A dual method or member is written once as a private synchronous function
# (``Trigger._fire(self, session, target, ...)``).  What the class gets under
# the public name is a real function generated with the same parameters, so
# inspect.signature(), help(), IDEs and tracebacks show the public call, a
# wrong argument's TypeError names it (``Trigger.__call__() got an unexpected
# keyword argument``), and a call adds one frame over the function it runs.
# (The technique of dataclasses and attrs: compile the source of a function
# whose parameters are known only when the class is built.)


def _parameters(fn: Callable[..., Any], skip: int) -> tuple[str, str, str, str, dict[str, Any]]:
    """``fn``'s parameters after the first ``skip``, as source: (declaration, call arguments,
    positional values, keyword values) and the namespace of their defaults."""
    params = list(inspect.signature(fn).parameters.values())[skip:]
    declared: list[str] = []
    passed: list[str] = []
    positional: list[str] = []
    keywords: list[str] = []
    defaults: dict[str, Any] = {}
    star = False
    last_positional_only = max(
        (i for i, p in enumerate(params) if p.kind is inspect.Parameter.POSITIONAL_ONLY), default=-1
    )
    for i, p in enumerate(params):
        default = ""
        if p.default is not inspect.Parameter.empty:
            defaults[f"_sg_default_{i}"] = p.default
            default = f"=_sg_default_{i}"
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            declared.append(f"*{p.name}")
            passed.append(f"*{p.name}")
            positional.append(f"*{p.name}")
            star = True
        elif p.kind is inspect.Parameter.KEYWORD_ONLY:
            if not star:
                declared.append("*")
                star = True
            declared.append(f"{p.name}{default}")
            passed.append(f"{p.name}={p.name}")
            keywords.append(f"{p.name!r}: {p.name}")
        elif p.kind is inspect.Parameter.VAR_KEYWORD:
            declared.append(f"**{p.name}")
            passed.append(f"**{p.name}")
            keywords.append(f"**{p.name}")
        else:
            declared.append(f"{p.name}{default}")
            passed.append(p.name)
            positional.append(p.name)
        if i == last_positional_only:
            declared.append("/")
    return (
        ", ".join(declared),
        ", ".join(passed),
        "".join(f"{v}, " for v in positional),
        ", ".join(keywords),
        defaults,
    )


def _as_public(
    func: Any, fn: Callable[..., Any], owner: type[Any], name: str, skip: int
) -> Callable[..., Any]:
    """Give the generated ``func`` the public identity: name, qualname, docstring, annotations."""
    func.__name__ = name
    func.__qualname__ = f"{owner.__qualname__}.{name}"
    # Tracebacks and profilers read the code object's own qualified name.
    func.__code__ = func.__code__.replace(co_qualname=func.__qualname__)
    func.__module__ = owner.__module__
    func.__doc__ = fn.__doc__
    names = list(inspect.signature(fn).parameters)[skip:]
    annotations = getattr(fn, "__annotations__", {})
    func.__annotations__ = {k: v for k, v in annotations.items() if k in names or k == "return"}
    if skip == 2:  # self and the session: the public call takes either kind
        func.__annotations__ = {"session": "Session | AsyncSession", **func.__annotations__}
    return cast(Callable[..., Any], func)


def _compile(source: str, namespace: dict[str, Any], name: str, filename: str) -> Any:
    code = compile(source, filename, "exec")
    exec(code, namespace)
    return namespace[name]


_METHOD_SOURCE = """\
def {name}(self, session, {declared}):
    _sg_fn = {lookup}
    _sg_watched = _sg_observe.hooked or _sg_logger.isEnabledFor(_sg_DEBUG)
    if isinstance(session, _sg_AsyncSession):
        if _sg_watched:
            return session.run_sync(_sg_observe_method, _sg_operation, _sg_logger, _sg_fn, self, {passed})
        return session.run_sync(_sg_call_method, _sg_fn, self, {passed})
    if not isinstance(session, _sg_Session):
        session = _sg_as_session(
            session,
            _sg_public_name(self, _sg_attribute),
            ({positional}),
            {{k: v for k, v in {{{keywords}}}.items() if v is not _sg_defaults.get(k, _sg_as_session)}},
        )
    if _sg_watched:
        return _sg_observe_method(session, _sg_operation, _sg_logger, _sg_fn, self, {passed})
    return _sg_fn(self, session, {passed})
"""

_MEMBER_SOURCE = """\
def {name}(self, {declared}):
    _sg_session = self._dual_session
    if isinstance(_sg_session, _sg_AsyncSession):
        return _sg_awaitable_member(_sg_session, _sg_fn, self, {passed})
    return _sg_fn(self, {passed})
"""


class dual_method(Generic[Obj, S, P, R]):
    """``@dual`` for methods whose first parameter after ``self`` is the session.

    ::

        class Trigger:
            def _fire(self, session: Session, target: Any) -> Result: ...
            __call__ = dual_method(_fire)    # trigger(session, 42) / await trigger(async_session, 42)

    The method is written once, synchronously; bound to an object it is a
    :class:`Dual`, typed per session kind.  The synchronous method is looked
    up by name on the object's class, so a subclass that overrides it (a
    ``Trigger`` subclass overriding ``_fire``) is honoured by both faces.
    """

    def __init__(self, fn: Callable[Concatenate[Obj, S, P], R], *, operation: str | None = None) -> None:
        self.fn = fn
        self._name = fn.__name__
        self.__doc__ = fn.__doc__
        #: What the call is reported as (stateguard.observe): ``"trigger"``, ``"many"`` ...
        self.operation = operation or fn.__name__.lstrip("_")
        self._logger = logging.getLogger(fn.__module__)
        #: The attribute name on the class (set by __set_name__), as error messages name the call.
        self._attribute = fn.__name__.lstrip("_")

    def __set_name__(self, owner: type[Any], name: str) -> None:
        self._attribute = name
        setattr(owner, name, self.public(owner, name))

    def public(self, owner: type[Any], name: str) -> Callable[..., Any]:
        """The function ``owner`` gets as ``name``: ``fn``'s parameters after ``self`` and the session."""
        fn = self.fn
        declared, passed, positional, keywords, namespace = _parameters(fn, 2)
        # The synchronous method is looked up by name on the object's class when it is one of
        # owner's own, so a subclass that overrides it (a Trigger subclass overriding _fire) is
        # honoured by both faces.
        overridable = fn.__name__ != name and owner.__dict__.get(fn.__name__) is fn
        lookup = f"type(self).{fn.__name__}" if overridable else "_sg_impl"
        source = _METHOD_SOURCE.format(
            name=name,
            declared=declared,
            passed=passed,
            positional=positional,
            keywords=keywords,
            lookup=lookup,
        )
        if not declared:  # no parameter after the session: no dangling commas
            source = source.replace("(self, session, ):", "(self, session):").replace(", self, )", ", self)")
            source = source.replace("(self, session, )", "(self, session)")
        namespace.update(
            _sg_defaults={
                p.name: p.default
                for p in inspect.signature(fn).parameters.values()
                if p.default is not inspect.Parameter.empty
            },
            _sg_impl=fn,
            _sg_observe=_observe,
            _sg_logger=self._logger,
            _sg_DEBUG=logging.DEBUG,
            _sg_AsyncSession=AsyncSession,
            _sg_Session=Session,
            _sg_observe_method=_observe_method,
            _sg_call_method=_call_method,
            _sg_as_session=as_session,
            _sg_public_name=_public_name,
            _sg_operation=self.operation,
            _sg_attribute=name,
        )
        func = _compile(source, namespace, name, f"<stateguard {owner.__qualname__}.{name}>")
        return _as_public(func, fn, owner, name, 2)

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> dual_method[Obj, S, P, R]: ...

    @overload
    def __get__(self, obj: Obj, owner: type[Any]) -> Dual[S, P, R]: ...

    def __get__(self, obj: Obj | None, owner: type[Any]) -> Any:
        if obj is None:
            return self
        fn = getattr(owner, self._name, self.fn)
        return _BoundDual(self.fn if fn is self else fn, obj, self.operation, self._logger, self._attribute)


def sync_session_of(session: Session | AsyncSession) -> Session:
    """The synchronous Session behind ``session`` (itself when it is one)."""
    if isinstance(session, AsyncSession):
        return session.sync_session
    return session


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


class DualObject(Generic[S_co]):
    """An object made for one Session or AsyncSession; its :class:`dual_member` methods follow that session.

    What a :class:`DualContext` hands out is typically one: made for a
    Session, its members return their result; made for an AsyncSession, they
    return a coroutine that runs the same synchronous code through
    ``run_sync`` (``await call.complete(r)``).  The type parameter is the
    session's type, so mypy knows which.
    """

    __slots__ = ("_dual_session",)

    def __init__(self, session: S_co) -> None:
        self._dual_session = session


def _call_member(_session: Session, fn: Callable[..., Any], obj: Any, /, *args: Any, **kwargs: Any) -> Any:
    return fn(obj, *args, **kwargs)


def _awaitable_member(
    session: AsyncSession, fn: Callable[..., Any], obj: Any, /, *args: Any, **kwargs: Any
) -> Coroutine[Any, Any, Any]:
    return session.run_sync(_call_member, fn, obj, *args, **kwargs)


class dual_member(Generic[Obj, P, R]):
    """A :class:`DualObject` method, written once synchronously; awaited when the object's session is async.

    ::

        class IdempotentCall(DualObject[S]):
            def _complete(self, response: R) -> R: ...
            complete = dual_member(_complete)   # call.complete(r) / await call.complete(r)

    Unlike :class:`dual_method`, the method takes no session: the object
    carries it.
    """

    def __init__(self, fn: Callable[Concatenate[Obj, P], R]) -> None:
        self.fn = fn
        functools.update_wrapper(cast(Any, self), fn)  # help() and docs show fn's docstring

    def __set_name__(self, owner: type[Any], name: str) -> None:
        self.__name__ = name
        self.__qualname__ = f"{owner.__qualname__}.{name}"
        fn = self.fn
        declared, passed, _positional, _keywords, namespace = _parameters(fn, 1)
        source = _MEMBER_SOURCE.format(name=name, declared=declared, passed=passed)
        if not declared:
            source = source.replace("(self, ):", "(self):").replace(", self, )", ", self)")
            source = source.replace("(self, )", "(self)")
        namespace.update(_sg_fn=fn, _sg_AsyncSession=AsyncSession, _sg_awaitable_member=_awaitable_member)
        func = _compile(source, namespace, name, f"<stateguard {owner.__qualname__}.{name}>")
        setattr(owner, name, _as_public(func, fn, owner, name, 1))

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> dual_member[Obj, P, R]: ...

    @overload
    def __get__(self, obj: DualObject[Session], owner: type[Any]) -> Callable[P, R]: ...

    @overload
    def __get__(
        self, obj: DualObject[AsyncSession], owner: type[Any]
    ) -> Callable[P, Coroutine[Any, Any, R]]: ...

    @overload
    def __get__(self, obj: object, owner: type[Any]) -> Callable[P, R | Coroutine[Any, Any, R]]: ...

    def __get__(self, obj: Any, owner: type[Any]) -> Any:
        if obj is None:
            return self
        session = obj._dual_session
        if isinstance(session, AsyncSession):
            return functools.partial(_awaitable_member, session, self.fn, obj)
        return types.MethodType(self.fn, obj)
