"""Dual methods and members: what a class gets under the public name is a real function.

:class:`dual_method` gives a method whose first parameter after ``self`` is
the session (``Trigger.__call__``, ``StripedCounter.decrement``) its async
face; :class:`dual_member` does it for a method of a :class:`DualObject`, an
object made for one session that takes none itself (``call.complete(r)`` /
``await call.complete(r)``).  Either is written once, synchronously; the class
gets a function compiled with the implementation's own parameters, so
``inspect.signature``, ``help()``, qualnames and tracebacks show the public
call, and a call adds one frame over the function it runs.  Module functions
and context managers get theirs in :mod:`.bridge`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, cast, overload

from sqlalchemy.orm import Session

from .. import observe as _observe
from .bridge import Dual
from .sessions import AsyncSession, as_session

__all__ = ["DualObject", "dual_member", "dual_method"]

Obj = TypeVar("Obj")
P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")
S_co = TypeVar("S_co", covariant=True)


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
