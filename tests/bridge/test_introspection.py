"""The public calls show themselves as written: real signatures, help(), public names, one frame.

Every public callable reachable from ``stateguard.__all__`` (functions, methods of public
classes, triggers of a declared StateMachine, bound on an instance and looked up on the class)
is checked by walking the names, so a new call cannot hide behind ``(*args, **kwargs)``.
"""

from __future__ import annotations

import inspect
import pydoc
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

import stateguard
from stateguard import StripedCounter, Trigger
from tests._support.models import Order

#: Public names whose signature is not checked, and why.
NOT_CALLS = {
    # typing.Protocol classes describe what the application writes; they are never called.
    "Serializer": "a Protocol: its constructor is typing's (*args, **kwargs)",
    "Sink": "a Protocol: its constructor is typing's (*args, **kwargs)",
}
#: Methods whose qualified name is a private base class's, and why.
INHERITED = {
    "RedisTokens.key": "shared by the sync and async token stores through one private base",
    "AsyncRedisTokens.key": "shared by the sync and async token stores through one private base",
}


def public_callables() -> Iterator[tuple[str, Any]]:
    """(label, callable) for every public call: functions, methods, triggers, bound and unbound."""
    for name in stateguard.__all__:
        obj = getattr(stateguard, name)
        if inspect.isclass(obj):
            if issubclass(obj, BaseException) or name in NOT_CALLS:
                continue
            yield name, obj
            for attr, member in inspect.getmembers(obj):
                if attr.startswith("_") and attr != "__call__":
                    continue
                if isinstance(inspect.getattr_static(obj, attr), property):
                    continue
                if callable(member) and not inspect.isclass(member):
                    yield f"{name}.{attr}", member
        elif callable(obj):
            yield name, obj
    yield "Order.flow.pay", Order.flow.pay
    yield "Order.flow.pay.many", Order.flow.pay.many
    yield "Order.flow.pay.where", Order.flow.pay.where
    yield "Order.flow.fire", Order.flow.fire
    yield "Order.flow.history", Order.flow.history
    counter = StripedCounter("stock", stripes=4)
    for attr in ("create", "decrement", "increment", "reserve", "release", "total", "restripe"):
        yield f"StripedCounter(...).{attr}", getattr(counter, attr)


CALLS = list(public_callables())


@pytest.mark.parametrize(("label", "call"), CALLS, ids=[label for label, _ in CALLS])
def test_every_public_call_has_a_real_signature_a_docstring_and_a_public_name(label: str, call: Any) -> None:
    """inspect.signature() shows real parameters, there is a docstring, the qualified name is public."""
    signature = inspect.signature(call)
    params = list(signature.parameters.values())
    assert not params or not all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params), signature
    assert (call.__doc__ or "").strip(), f"{label} has no docstring"
    qualname = getattr(call, "__qualname__", type(call).__qualname__)
    private = [part for part in qualname.split(".") if part.startswith("_") and not part.startswith("__")]
    assert not private or label in INHERITED, f"{label} is named {qualname}"


@pytest.mark.parametrize(
    ("call", "shown"),
    [
        (Order.flow.pay, "session: 'Session | AsyncSession', target: 'Any', *, values:"),
        (Order.flow.pay.many, "session: 'Session | AsyncSession', targets: 'Iterable[Any]'"),
        (StripedCounter("stock", stripes=4).decrement, "session: 'Session | AsyncSession', item: 'str'"),
        (Trigger.__call__, "self, session: 'Session | AsyncSession', target: 'Any'"),
    ],
)
def test_help_shows_the_signature_and_the_docstring(call: Any, shown: str) -> None:
    """pydoc (what help() prints) renders the parameters and the first docstring line."""
    text = pydoc.render_doc(call, renderer=pydoc.plaintext)
    assert shown in text
    assert (call.__doc__ or "").strip().splitlines()[0] in text


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda s: Order.flow.pay(s, 1, bogus=2), "Trigger.__call__()"),
        (lambda s: Order.flow.pay.many(s, [1], bogus=2), "Trigger.many()"),
        (lambda s: StripedCounter("s", stripes=2).decrement(s, "x", bogus=2), "StripedCounter.decrement()"),
        (lambda s: stateguard.decrement(s, Order.amount, 1, bogus=2), "decrement()"),
        (lambda s: stateguard.idempotent(s, scope="a", key="b", bogus=2), "idempotent()"),
    ],
)
def test_a_wrong_keyword_names_the_public_call(make: Callable[[Session], Any], name: str) -> None:
    """Python's own TypeError names the call the user made, not a private implementation."""
    engine = create_engine("sqlite://")
    with Session(engine) as session, pytest.raises(TypeError) as caught:
        make(session)
    assert str(caught.value).startswith(f"{name} got an unexpected keyword argument 'bogus'")
    engine.dispose()


def _callers_of(target: str, run: Callable[[], Any]) -> list[str]:
    """The two frames above ``target`` (qualified name) the first time ``run()`` enters it."""
    found: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and not found and frame.f_code.co_qualname == target:
            caller = frame.f_back
            assert caller is not None and caller.f_back is not None
            found.extend([caller.f_code.co_qualname, caller.f_back.f_code.co_qualname])

    sys.setprofile(profile)
    try:
        run()
    except Exception:  # where the call went is what is looked at, not how it ended
        pass
    finally:
        sys.setprofile(None)
    return found


@pytest.mark.parametrize(
    ("run", "public", "target"),
    [
        (lambda s: Order.flow.pay(s, 1), "Trigger.__call__", "Trigger._fire"),
        (lambda s: Order.flow.pay.many(s, [1]), "Trigger.many", "fire_many"),
        (
            lambda s: StripedCounter("stock", stripes=2).decrement(s, "sku"),
            "StripedCounter.decrement",
            "StripedCounter._decrement",
        ),
    ],
)
def test_a_sync_call_adds_one_frame_over_the_function_it_runs(
    run: Callable[[Session], Any], public: str, target: str
) -> None:
    """The implementation's caller is the public function, whose caller is the application."""
    engine = create_engine("sqlite://")
    with Session(engine) as session:
        callers = _callers_of(target, lambda: run(session))
    assert callers == [public, "<lambda>"]  # the lambda is the application's call
    engine.dispose()
