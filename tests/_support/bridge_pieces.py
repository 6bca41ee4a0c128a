"""Pieces shared by the tests of the steps bridge's users: acks with attribute access, awaitables
that are not coroutines, outbox probes, and a real conflict to retry."""

from __future__ import annotations

from typing import Any

# --------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------


class AttrDict(dict):  # type: ignore[type-arg]
    """The common "dict with attribute access" idiom (a broker's ack, a JSON reply): a missing
    attribute is a KeyError, as its item would be."""

    def __getattr__(self, name: str) -> Any:
        return self[name]


class Record:
    """A permissive record (like munch.DefaultMunch): an unknown field reads as None."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__["_fields"] = fields

    def __getattr__(self, name: str) -> Any:
        return self._fields.get(name)
