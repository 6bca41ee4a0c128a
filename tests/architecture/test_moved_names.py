"""What user code written against the earlier layout keeps doing after the renovation."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from sqlalchemy import Engine, String
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import stateguard
from stateguard import ConfigurationError, Outcome, StateMachine
from stateguard.machine import Trigger
from tests.conftest import Backend


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("stateguard.locks", "RedisLock"),
        ("stateguard.locks", "AsyncRedisLock"),
        ("stateguard.tokens", "RedisTokens"),
        ("stateguard.tokens", "AsyncRedisTokens"),
        ("stateguard.idempotency", "consume_once"),
        ("stateguard.redis", "RedisStreamSink"),
        ("stateguard.outbox.relay", "AsyncRelay"),
    ],
)
def test_a_moved_name_still_imports_from_its_old_module_with_a_warning(module: str, name: str) -> None:
    """from stateguard.locks import RedisLock (and the like) still works, warning where it lives now."""
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{name} moved to stateguard\.[\w.]+\.{name}"):
        found = getattr(importlib.import_module(module), name)
    assert found is getattr(stateguard, name)


def test_the_worker_errors_are_still_reachable_from_ids() -> None:
    """ids uses WorkerLeaseLost/WorkerIdsExhausted itself, so stateguard.ids still has them (same classes)."""
    ids = importlib.import_module("stateguard.ids")
    assert ids.WorkerLeaseLost is stateguard.WorkerLeaseLost
    assert ids.WorkerIdsExhausted is stateguard.WorkerIdsExhausted


def test_an_unknown_name_of_a_module_is_still_an_attribute_error() -> None:
    """The compatibility hook answers only for moved names."""
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        importlib.import_module("stateguard.locks").Nope  # noqa: B018


class _Base(DeclarativeBase):
    pass


class Audited(Trigger):
    """A trigger class that wraps every call (what trigger_cls is for)."""

    calls: list[str] = []

    def _fire(self, session: Any, target: Any, **options: Any) -> Any:
        Audited.calls.append(self.name)
        return super()._fire(session, target, **options)


class Door(_Base):
    __tablename__ = "moved_doors"
    id: Mapped[int] = mapped_column(primary_key=True)
    state: Mapped[str] = mapped_column(String(10), default="shut")

    flow = StateMachine(
        "state", states=["shut", "open"], transitions=[["open", "shut", "open"], ["shut", "open", "shut"]]
    )
    flow.trigger_cls = Audited


def test_the_session_may_be_passed_by_keyword_to_triggers_and_machine_methods(backend: Backend) -> None:
    """trigger(session=s, target=1), fire(session=...), many(session=...) work as before the bridge."""
    engine: Engine = backend.create(_Base.metadata)
    with Session(engine) as s, s.begin():
        s.add(Door(id=1))
        s.flush()
        assert Door.flow.open(session=s, target=1).outcome is Outcome.APPLIED
        assert Door.flow.fire(session=s, trigger="shut", target=1).outcome is Outcome.APPLIED
        assert Door.flow.open.many(session=s, targets=[1])[1].outcome is Outcome.APPLIED


def test_fire_goes_through_the_trigger_class_and_a_subclass_override_is_honoured(backend: Backend) -> None:
    """StateMachine.fire and a direct call both run a trigger_cls's override."""
    engine: Engine = backend.create(_Base.metadata)
    Audited.calls.clear()
    with Session(engine) as s, s.begin():
        s.add(Door(id=2))
        s.flush()
        Door.flow.open(s, 2)
        Door.flow.fire(s, "shut", 2)
    assert Audited.calls == ["open", "shut"]


@pytest.mark.parametrize("name", ["codec", "qualname"])
def test_triggers_may_not_take_the_names_of_the_machines_own_attributes(name: str) -> None:
    """A trigger called codec or qualname would hide the machine's attribute: refused at declaration."""

    class Base(DeclarativeBase):
        pass

    with pytest.raises(ConfigurationError, match=name):

        class Lid(Base):
            __tablename__ = f"moved_lid_{name}"
            id: Mapped[int] = mapped_column(primary_key=True)
            state: Mapped[str] = mapped_column(String(10), default="a")
            flow = StateMachine("state", states=["a", "b"], transitions=[[name, "a", "b"]])


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("stateguard.consumers", "CelerySink"),
        ("stateguard.consumers.celery", "CelerySink"),
        ("stateguard.consumers.celery", "TASK_ID_PREFIX"),
    ],
)
def test_a_name_moved_to_the_outbox_sinks_still_imports_with_a_warning(module: str, name: str) -> None:
    """from stateguard.consumers import CelerySink still works, warning where it lives now."""
    sinks = importlib.import_module("stateguard.outbox.sinks.celery")
    with pytest.warns(
        DeprecationWarning, match=rf"{module}\.{name} moved to stateguard\.outbox\.sinks\.celery"
    ):
        found = getattr(importlib.import_module(module), name)
    assert found is getattr(sinks, name)
