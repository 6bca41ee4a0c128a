"""StateMachine: a declared state graph over one column, parsed, validated and bound to its mapper.

A :class:`StateMachine` is declared as a class attribute of a mapped class.
When SQLAlchemy constructs the mapper, the one ``after_mapper_constructed``
listener of this module binds it: the declaration is validated against the
mapped columns (mistakes are :class:`ConfigurationError` at class
definition), the states CHECK constraint is added to the table, and the
PostgreSQL legal-edges DDL is attached (:mod:`stateguard.machine.ddl`).
The graph itself is held by one ``transitions.Machine`` per declaration, used
for validation, :meth:`StateMachine.available` and diagrams; rows never get a
machine or listener of their own, so loading rows costs what it costs without
stateguard.
"""

from __future__ import annotations

import enum
import keyword
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Final, Generic, TypeVar, Unpack

from sqlalchemy import ColumnElement, event
from sqlalchemy import Enum as SAEnum
from sqlalchemy.exc import InvalidRequestError
from sqlalchemy.orm import Mapper, Session
from sqlalchemy.schema import Column
from sqlalchemy.sql import visitors
from sqlalchemy.sql.selectable import Exists, ScalarSelect, Select
from transitions import Machine as _GraphMachine

from .. import _kernel
from .._async import dual_method
from ..exceptions import ConfigurationError, InvalidArgument, UnknownTrigger
from ..result import Result
from . import ddl, events, history
from .codec import StateCodec
from .trigger import FireOptions, Trigger

__all__ = ["RESERVED_NAMES", "StateMachine", "iter_triggers", "machines_of"]

S = TypeVar("S")

_name = StateCodec.name

#: Names a trigger may not use because the machine itself needs them.
RESERVED_NAMES: Final = frozenset(
    {
        "available",
        "codec",
        "column",
        "edges",
        "fire",
        "graph",
        "history",
        "initial",
        "machine",
        "many",
        "model",
        "name",
        "qualname",
        "states",
        "statement",
        "transitions",
        "triggers",
        "where",
    }
)

_EDGE_KEYS: Final = frozenset({"trigger", "source", "dest", "where", "values", "after_commit", "event"})
_CALLBACK_KEYS: Final = frozenset(
    {"conditions", "unless", "before", "after", "prepare", "on_enter", "on_exit"}
)


class _Edge:
    """One declared transition entry: sources -> dest for a trigger."""

    __slots__ = ("after_commit", "dest", "event", "sources", "values", "where")

    def __init__(
        self,
        sources: tuple[Any, ...],
        dest: Any,
        where: Callable[[Any], ColumnElement[bool]] | None,
        values: Mapping[str, Any],
        after_commit: tuple[Callable[[Result], object], ...],
        event: str | None = None,
    ) -> None:
        self.sources = sources
        self.dest = dest
        self.where = where
        self.values = dict(values)
        self.after_commit = after_commit
        self.event = event


class StateMachine(Generic[S]):
    """A state graph over one column of a mapped class.

    ::

        class Order(Base):
            __tablename__ = "orders"
            id: Mapped[int] = mapped_column(primary_key=True)
            status: Mapped[str] = mapped_column(String(20), default="pending")
            version: Mapped[int] = version_column()

            flow = StateMachine(
                "status",
                states=["pending", "paid", "shipped", "cancelled"],
                transitions=[
                    {"trigger": "pay", "source": "pending", "dest": "paid"},
                    {"trigger": "ship", "source": "paid", "dest": "shipped"},
                    ["cancel", ["pending", "paid"], "cancelled"],
                ],
            )

        Order.flow.pay(session, 42)            # -> Result

    ``states`` is a list of strings or an :class:`enum.Enum` class.
    ``transitions`` uses the ``transitions`` package's format (dicts with
    ``trigger``, ``source`` -- a state, a list or ``"*"`` -- and ``dest``, or
    ``[trigger, source, dest]`` lists) plus three stateguard keys:

    ``where``
        ``lambda cls: <SQL expression over the row's own columns>``, ANDed into
        the UPDATE's WHERE: an atomic guard.  Subqueries and other tables are
        rejected, because PostgreSQL re-checks a waiting UPDATE's WHERE only
        against the target row: a guard over other rows would not be atomic.
    ``values``
        ``{attribute: value or SQL expression}`` set along with the state.
    ``after_commit``
        a callable (or list) called with the :class:`Result` after the
        outermost transaction commits, only when the call was APPLIED.
    ``event``
        a topic (``"order.paid"``): every APPLIED call of this trigger writes
        one event with that topic to the transactional outbox, in the same
        transaction (see :mod:`stateguard.machine.events`).

    ``events=True`` writes such an event for every trigger of the machine,
    with the topic ``"<table name>.<trigger>"`` (``"orders.pay"``) unless the
    transition names one with ``event``.

    Mistakes are :class:`ConfigurationError` at class definition.
    """

    #: The class used for triggers; subclass to extend.
    trigger_cls: ClassVar[type[Trigger]] = Trigger

    def __init__(
        self,
        column: str,
        *,
        states: Sequence[S] | type[S],
        transitions: Sequence[Mapping[str, Any] | Sequence[Any]],
        initial: S | str | None = None,
        check_constraint: bool = True,
        history: bool = False,
        legal_edges: bool = False,
        events: bool = False,
    ) -> None:
        self.attr = column
        self.check_constraint = check_constraint
        self.history_enabled = history
        if type(events) is not bool:
            raise ConfigurationError(f"StateMachine events= must be True or False, got {events!r}")
        #: Write an outbox event for every APPLIED transition (see stateguard.machine.events).
        self.events_enabled = events
        #: PostgreSQL only: a trigger refusing undeclared edges (see stateguard.alembic).
        self.legal_edges = legal_edges
        self.name: str = "?"
        self.model: type[Any] | None = None
        self._owner_name = "?"
        if not isinstance(column, str) or not column:
            raise ConfigurationError(f"StateMachine column must be an attribute name (str), got {column!r}")
        self._enum: type[enum.Enum] | None = None
        if isinstance(states, type) and issubclass(states, enum.Enum):
            self._enum = states
            declared: list[Any] = list(states)
        else:
            if isinstance(states, str | bytes) or not isinstance(states, Sequence):
                raise ConfigurationError(f"states must be a list of strings or an Enum class, got {states!r}")
            declared = list(states)
            for s in declared:
                if not isinstance(s, str) or not s:
                    raise ConfigurationError(f"states must be non-empty strings, got {s!r}")
        if len(set(declared)) != len(declared):
            raise ConfigurationError(f"duplicate states in {declared!r}")
        self.states: tuple[Any, ...] = tuple(declared)
        self._raw_transitions = transitions
        self._initial_arg = initial
        self.initial: Any = None
        self.triggers: dict[str, Trigger] = {}
        self._edges_by_trigger: dict[str, list[_Edge]] = {}
        self._graph: Any = None
        self._info: _kernel.ModelInfo | None = None
        self.state_column: Column[Any] = None  # type: ignore[assignment]
        #: The state codec (set when the machine is bound to its mapped class).
        self.codec: StateCodec = StateCodec(self.states, {s: s for s in self.states})
        self._forbidden: dict[str, str] = {}
        #: What the read after a 0-row UPDATE selects: state, version, fence.
        self._read_columns: tuple[Column[Any], ...] = ()
        self._fast_key: type | None = None

    # -- declaration ----------------------------------------------------------

    def _where(self) -> str:
        return f"{self._owner_name}.{self.name}"

    @property
    def qualname(self) -> str:
        """``Model.attribute`` of this machine (``"Order.flow"``), as messages name it."""
        return self._where()

    # Any: a declared state, the machine's Enum member or str (its S, which the body cannot narrow to).
    def _state(self, value: Any, role: str, trigger: str | None = None) -> Any:
        """Resolve a declared state reference (name, value or member)."""
        if self._enum is not None:
            if isinstance(value, self._enum):
                return value
            if isinstance(value, str):
                if value in self._enum.__members__:
                    return self._enum[value]
                for member in self._enum:
                    if member.value == value:
                        return member
        elif isinstance(value, str) and value in self.states:
            return value
        where = f" of trigger {trigger!r}" if trigger else ""
        raise ConfigurationError(
            f"{self._where()}: {role}{where} {value!r} is not a declared state; "
            f"declared: {[_name(s) for s in self.states]}"
        )

    def __set_name__(self, owner: type[Any], name: str) -> None:
        # Validation waits for the mapper (see _bind): Python 3.11 wraps any
        # exception raised here in a RuntimeError, hiding ConfigurationError.
        self.name = name
        self._owner_name = owner.__name__

    def _copy_for(self, owner: type[Any], name: str) -> StateMachine[Any]:
        """An unbound copy of this declaration, as attribute ``name`` of ``owner``."""
        copy: StateMachine[Any] = StateMachine(
            self.attr,
            states=self._enum if self._enum is not None else list(self.states),
            transitions=self._raw_transitions,
            initial=self._initial_arg,
            check_constraint=self.check_constraint,
            history=self.history_enabled,
            legal_edges=self.legal_edges,
            events=self.events_enabled,
        )
        copy.__set_name__(owner, name)
        return copy

    def _declare(self) -> None:
        if self.triggers:
            return
        if not self.states:
            # Checked here rather than in __init__ so the message can name the model.
            raise ConfigurationError(f"{self._where()}: a StateMachine needs at least one state")
        initial = self._state(self._initial_arg, "initial") if self._initial_arg is not None else None
        self.initial = initial
        edges_by: dict[str, list[_Edge]] = {}
        seen: dict[tuple[str, Any], Any] = {}
        graph_transitions: list[dict[str, Any]] = []
        for raw in self._raw_transitions:
            spec = self._normalise(raw)
            trig = spec["trigger"]
            self._check_trigger_name(trig)
            src = spec["source"]
            if src == "*":
                sources = self.states
            elif isinstance(src, str | enum.Enum):
                sources = (self._state(src, "source", trig),)
            elif isinstance(src, Sequence) and src:
                sources = tuple(self._state(s, "source", trig) for s in src)
            else:
                raise ConfigurationError(f"{self._where()}: trigger {trig!r} has no source state")
            dest = self._state(spec["dest"], "dest", trig)
            for s in sources:
                other = seen.get((trig, s))
                if other is not None and other != dest:
                    raise ConfigurationError(
                        f"{self._where()}: trigger {trig!r} goes from {_name(s)!r} to two "
                        f"different states ({_name(other)!r} and {_name(dest)!r}); "
                        f"a trigger must be deterministic: use two triggers"
                    )
                if other is not None:
                    raise ConfigurationError(
                        f"{self._where()}: trigger {trig!r} from {_name(s)!r} is declared twice"
                    )
                seen[(trig, s)] = dest
            where = spec.get("where")
            if where is not None and not callable(where):
                raise ConfigurationError(
                    f"{self._where()}: 'where' of trigger {trig!r} must be a callable taking the "
                    f"mapped class and returning a SQL expression, got {where!r}"
                )
            values = spec.get("values") or {}
            if not isinstance(values, Mapping) or not all(isinstance(k, str) for k in values):
                raise ConfigurationError(
                    f"{self._where()}: 'values' of trigger {trig!r} must map attribute names to values"
                )
            cbs = spec.get("after_commit") or ()
            cbs = (cbs,) if callable(cbs) else tuple(cbs)
            for cb in cbs:
                if not callable(cb):
                    raise ConfigurationError(
                        f"{self._where()}: after_commit of trigger {trig!r} must be callables, got {cb!r}"
                    )
            topic = spec.get("event")
            if "event" in spec:
                events.check_topic(topic, f"{self._where()}: 'event' of trigger {trig!r}")
            edges_by.setdefault(trig, []).append(_Edge(sources, dest, where, values, cbs, topic))
            graph_transitions.append(
                {"trigger": trig, "source": [_name(s) for s in sources], "dest": _name(dest)}
            )
        if not edges_by:
            raise ConfigurationError(f"{self._where()}: a StateMachine needs at least one transition")
        try:
            self._graph = _GraphMachine(
                model=None,
                states=[_name(s) for s in self.states],
                transitions=graph_transitions,
                initial=_name(initial if initial is not None else self.states[0]),
                auto_transitions=False,
            )
        except (ValueError, AttributeError, TypeError) as error:  # pragma: no cover - validated above
            raise ConfigurationError(f"{self._where()}: {error}") from error
        self._edges_by_trigger = edges_by
        for trig, edges in edges_by.items():
            named = {e.event for e in edges}
            if len(named) > 1:
                raise ConfigurationError(
                    f"{self._where()}: the transitions of trigger {trig!r} name different events "
                    f"({', '.join(sorted(repr(n) if n else 'no event' for n in named))}); give 'event' "
                    f"the same topic on each of them, "
                    f"or on none (one trigger writes one topic)"
                )
            trigger = self.trigger_cls(self, trig, edges)
            self.triggers[trig] = trigger
            setattr(self, trig, trigger)

    def _normalise(self, raw: Mapping[str, Any] | Sequence[Any]) -> dict[str, Any]:
        if isinstance(raw, Mapping):
            unknown = set(raw) - _EDGE_KEYS
            if unknown & _CALLBACK_KEYS:
                raise ConfigurationError(
                    f"{self._where()}: trigger {raw.get('trigger')!r}: "
                    f"{sorted(unknown & _CALLBACK_KEYS)} callbacks are not supported: "
                    f"they would run in Python before the database decides, also for the "
                    f"losers of a race; use 'where' for guards and 'after_commit' for side effects"
                )
            if unknown:
                raise ConfigurationError(f"{self._where()}: unknown transition keys {sorted(unknown)}")
            missing = {"trigger", "source", "dest"} - set(raw)
            if missing:
                raise ConfigurationError(f"{self._where()}: transition {dict(raw)!r} lacks {sorted(missing)}")
            return dict(raw)
        if isinstance(raw, Sequence) and not isinstance(raw, str) and len(raw) == 3:
            return {"trigger": raw[0], "source": raw[1], "dest": raw[2]}
        raise ConfigurationError(
            f"{self._where()}: a transition is a dict or a [trigger, source, dest] list, got {raw!r}"
        )

    def _check_trigger_name(self, trig: Any) -> None:
        if not isinstance(trig, str) or not trig.isidentifier() or keyword.iskeyword(trig):
            raise ConfigurationError(f"{self._where()}: trigger name {trig!r} is not a Python identifier")
        if trig.startswith("_") or trig in RESERVED_NAMES or hasattr(StateMachine, trig):
            raise ConfigurationError(
                f"{self._where()}: trigger name {trig!r} clashes with the machine's own "
                f"attributes; rename the trigger"
            )

    def _bind(self, mapper: Mapper[Any], cls: type[Any]) -> None:
        """Attach to the mapped class and validate the whole declaration."""
        self.model = cls
        self._owner_name = cls.__name__
        self._declare()
        try:
            prop = mapper.get_property(self.attr, _configure_mappers=False)
        except InvalidRequestError:
            prop = None
        columns = getattr(prop, "columns", None)
        if not columns or not isinstance(columns[0], Column) or columns[0].table is not mapper.local_table:
            raise ConfigurationError(
                f"{self._where()}: {self.attr!r} is not a mapped column of {cls.__name__}'s table"
            )
        col: Column[Any] = columns[0]
        self.state_column = col
        if self._enum is not None and isinstance(col.type, SAEnum) and col.type.enum_class is not None:
            if col.type.enum_class is not self._enum:
                raise ConfigurationError(
                    f"{self._where()}: column {col.name!r} is an Enum of {col.type.enum_class.__name__}, "
                    f"but the machine declares states of {self._enum.__name__}"
                )
            to_db = {s: s for s in self.states}
        elif self._enum is not None:
            to_db = {s: s.value for s in self.states}
        else:
            to_db = {s: s for s in self.states}
        self.codec = StateCodec(self.states, to_db)
        for trig, edges in self._edges_by_trigger.items():
            for edge in edges:
                for attr in edge.values:
                    vprop = mapper._props.get(attr)
                    if vprop is None or not getattr(vprop, "columns", None):
                        raise ConfigurationError(
                            f"{self._where()}: values of trigger {trig!r} name unknown column {attr!r}"
                        )
                    if attr == self.attr:
                        raise ConfigurationError(
                            f"{self._where()}: values of trigger {trig!r} set the state column"
                        )
                if edge.where is not None:
                    _check_guard(self, trig, edge.where(cls), mapper)
        for trigger in self.triggers.values():
            trigger.topic = events.topic_for(self, trigger, mapper.local_table.name)
            trigger._simple = not self.history_enabled and trigger.topic is None and len(trigger.dests) == 1
        if self.check_constraint:
            ddl.add_states_check(self)

    def check_constraint_name(self) -> str:
        """``ck_<table>_<column>_states``: the name of the CHECK constraint on the state column."""
        return f"ck_{self.state_column.table.name}_{self.state_column.name}_states"

    @property
    def info(self) -> _kernel.ModelInfo:
        info = self._info
        if info is None:
            if self.model is None:
                raise ConfigurationError(
                    f"StateMachine {self._where()} is not attached to a mapped class; declare it "
                    f"as a class attribute of a mapped (declarative) class"
                )
            info = _kernel.model_info(self.model)
            forbidden = {self.attr: f"it is the state column; fire a trigger of {self.name} instead"}
            if info.version_attr is not None:
                forbidden[info.version_attr] = "it is the version column; stateguard increments it"
            if info.fence_attr is not None:
                forbidden[info.fence_attr] = "it is the fence column; pass fence= instead"
            self._forbidden = forbidden
            checks = info.pk_checks
            # A scalar key of exactly this type needs no further validation.
            self._fast_key = checks[0] if len(checks) == 1 and checks[0] in (int, str) else None
            read = [self.state_column]
            if info.version_column is not None:
                read.append(info.version_column)
            if info.fence_column is not None:
                read.append(info.fence_column)
            self._read_columns = tuple(read)
            self._info = info
        return info

    # -- public API -----------------------------------------------------------

    def __get__(self, instance: object | None, owner: type[Any]) -> StateMachine[S]:
        return self

    def __getattr__(self, name: str) -> Trigger:
        # Only reached for names that are not triggers (those are attributes).
        if name.startswith("__"):
            raise AttributeError(name)
        triggers = self.__dict__.get("triggers") or {}
        raise UnknownTrigger(
            f"{self.__dict__.get('_owner_name', '?')}.{self.__dict__.get('name', '?')} has no trigger "
            f"{name!r}; declared: {sorted(triggers)}"
        )

    def trigger(self, name: str) -> Trigger:
        """The :class:`Trigger` called ``name`` (``UnknownTrigger`` if there is none)."""
        found = self.triggers.get(name) if isinstance(name, str) else None
        if found is None:
            raise UnknownTrigger(
                f"{self._where()} has no trigger {name!r}; declared: {sorted(self.triggers)}"
            )
        return found

    def _fire(self, session: Session, trigger: str, target: Any, **options: Unpack[FireOptions]) -> Result:
        """Fire the trigger named ``trigger``: ``Order.flow.fire(session, "pay", 42)``.

        Takes the options of the trigger itself; awaited when given an
        AsyncSession, like the trigger.
        """
        # Through the trigger's own __call__, so a trigger_cls that wraps it is honoured.
        return self.trigger(trigger)(session, target, **options)

    def _history(self, session: Session, target: Any) -> list[Any]:
        """The logged transitions of one row, oldest first (needs ``history=True``).

        Each entry is a :class:`~stateguard.HistoryEntry`
        ``(trigger, source, dest, at, request_id, metadata, version)``::

            Order.flow.pay(session, 42, request_id="req-7f3a", metadata={"by": "user:12"})
            [e.trigger for e in Order.flow.history(session, 42)]   # ['pay']

        Awaited when given an AsyncSession.
        """
        if not self.history_enabled:
            raise InvalidArgument(f"{self._where()} keeps no history; declare it with history=True")
        return history.entries(session, self, target)

    fire = dual_method(_fire, operation="trigger")
    history = dual_method(_history)

    def available(self, obj: Any) -> list[str]:
        """Trigger names the graph allows from a loaded object's current state.

        ``where`` guards are not evaluated (they are SQL, checked by the
        database when the trigger fires)::

            Order.flow.available(order)   # ['pay', 'cancel']
        """
        if self.model is not None and not isinstance(obj, self.model):
            raise InvalidArgument(f"expected a {self.model.__name__} instance, got {type(obj).__name__}")
        state = self.codec.from_db(getattr(obj, self.attr))
        if not self.codec.declared(state):
            return []
        return sorted(self._graph.get_triggers(_name(state)))

    def can(self, trigger: str, state: Any) -> bool:
        """Whether the graph has an edge for ``trigger`` out of ``state``."""
        t = self.trigger(trigger)
        return self._state(state, "state") in t.sources

    def target_of(self, trigger: str, state: Any) -> Any:
        """The state ``trigger`` leads to from ``state``, or ``None`` if it is not allowed."""
        t = self.trigger(trigger)
        s = self._state(state, "state")
        for edge in t.edges:
            if s in edge.sources:
                return edge.dest
        return None

    @property
    def graph(self) -> Any:
        """The ``transitions.Machine`` built from this declaration (one per class)."""
        return self._graph

    def __repr__(self) -> str:
        return f"<StateMachine {self._where()} on {self.attr!r}: {len(self.triggers)} triggers>"


def _check_guard(machine: StateMachine[Any], trigger: str, expr: Any, mapper: Mapper[Any]) -> None:
    if not isinstance(expr, ColumnElement):
        raise ConfigurationError(
            f"{machine._where()}: 'where' of trigger {trigger!r} must return a SQL expression, got {expr!r}"
        )
    table = mapper.local_table
    for node in visitors.iterate(expr):
        if isinstance(node, Select | ScalarSelect | Exists):
            raise ConfigurationError(
                f"{machine._where()}: 'where' of trigger {trigger!r} contains a subquery; a guard "
                f"must only use the row's own columns, because PostgreSQL re-checks a waiting "
                f"UPDATE's WHERE against the target row only, so a guard over other rows is not atomic"
            )
        if isinstance(node, Column) and node.table is not table:
            raise ConfigurationError(
                f"{machine._where()}: 'where' of trigger {trigger!r} uses {node.table.name}.{node.name}; "
                f"a guard must only use columns of {table.name}"  # type: ignore[attr-defined]
            )


def machines_of(cls: type[Any]) -> list[StateMachine[Any]]:
    """Every StateMachine declared on ``cls`` (including inherited ones)."""
    found: list[StateMachine[Any]] = []
    for klass in cls.__mro__:
        for value in vars(klass).values():
            if isinstance(value, StateMachine) and value not in found:
                found.append(value)
    return found


@event.listens_for(Mapper, "after_mapper_constructed")
def _on_mapper(mapper: Mapper[Any], cls: type[Any]) -> None:
    """The one mapper listener: bind the class's machines, then record them on their tables."""
    for klass in cls.__mro__:
        for name, value in list(vars(klass).items()):
            if not isinstance(value, StateMachine):
                continue
            if value.model is None:
                value._bind(mapper, cls)
            elif value.model is not cls and not issubclass(cls, value.model):
                # Declared on a mixin used by several models: each gets its own copy.
                copy = value._copy_for(cls, name)
                type.__setattr__(cls, name, copy)
                copy._bind(mapper, cls)
    for machine in machines_of(cls):
        if machine.model is not None and machine.state_column is not None:
            ddl.attach(machine)


def iter_triggers(machines: Iterable[StateMachine[Any]]) -> Iterable[Trigger]:
    """Every trigger of ``machines``, machine by machine."""
    for m in machines:
        yield from m.triggers.values()
