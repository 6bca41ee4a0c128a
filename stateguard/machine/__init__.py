"""Declarative state machines whose transitions are one conditional UPDATE.

* :mod:`~stateguard.machine.declaration`: :class:`StateMachine`, parsed,
  validated and bound to its mapper (the one mapper listener);
* :mod:`~stateguard.machine.codec`: :class:`StateCodec`, state <-> database value <-> name;
* :mod:`~stateguard.machine.trigger`: :class:`Trigger`, one row's transition and its outcome;
* :mod:`~stateguard.machine.compile`: the statements, built once per backend;
* :mod:`~stateguard.machine.bulk`: ``many()`` and ``where()``;
* :mod:`~stateguard.machine.history`: the transition log;
* :mod:`~stateguard.machine.ddl`: the states CHECK constraint and PostgreSQL's legal-edges trigger.

Private members of these modules are used only inside this package.
"""

from __future__ import annotations

from .codec import StateCodec
from .declaration import StateMachine, iter_triggers, machines_of
from .history import HistoryEntry
from .trigger import Trigger

__all__ = ["HistoryEntry", "StateCodec", "StateMachine", "Trigger", "iter_triggers", "machines_of"]
