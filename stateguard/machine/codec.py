"""The state codec: state <-> database value <-> name, one object per bound machine."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["StateCodec"]


class StateCodec:
    """A machine's states and how each is stored and named: state <-> database value <-> name.

    A state is what the declaration uses (a string, or a member of the
    declared Enum); its database value is what the state column holds (the
    member itself for a SQLAlchemy ``Enum`` column of that class, the
    member's value for a plain column); its name is the string used in
    diagrams, the transition log and error messages::

        codec = Order.flow.codec
        codec.to_db("paid"), codec.from_db("paid"), codec.name("paid")
    """

    __slots__ = ("_by_name", "_from_db", "_to_db", "states")

    def __init__(self, states: Sequence[Any], to_db: Mapping[Any, Any]) -> None:
        self.states: tuple[Any, ...] = tuple(states)
        self._to_db = dict(to_db)
        self._from_db = {v: k for k, v in self._to_db.items()}
        self._by_name = {self.name(s): s for s in self.states}

    @staticmethod
    def name(state: Any) -> str:
        """The name of a state (an Enum member's name, else the string itself)."""
        return state.name if isinstance(state, enum.Enum) else str(state)

    def to_db(self, state: Any) -> Any:
        """The database value of a declared state (``KeyError`` for an undeclared one)."""
        return self._to_db[state]

    def from_db(self, value: Any) -> Any:
        """The state stored as ``value``; an undeclared value comes back unchanged."""
        return self._from_db.get(value, value)

    def named(self, name: str) -> Any:
        """The state called ``name``; an unknown name comes back unchanged."""
        return self._by_name.get(name, name)

    def declared(self, state: Any) -> bool:
        """Whether ``state`` is one of the declared states."""
        return state in self._to_db
