"""Replicated durability: guarded writes that commit only once a synchronous standby confirmed them.

:func:`set_durability` sets an engine's default; the calls that guard money
(:meth:`~stateguard.IdempotentCall.complete`, :func:`~stateguard.consume_token`,
the counters with a ``ref``, :func:`~stateguard.emit`) take a ``durability=``
keyword of their own.  How it works, what it costs and what to do with a
:class:`~stateguard.ReplicationTimeout`: docs/explanation/clusters-postgresql.md.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import Engine

from . import _kernel
from ._kernel import Durability

__all__ = ["Durability", "set_durability"]


def set_durability(
    engine: Engine, durability: Durability | None, *, timeout: timedelta | None = None
) -> None:
    """Make ``durability`` the default of ``engine``'s guarded writes that guard money.

    ``"replicated"``: idempotency completion (:meth:`~stateguard.IdempotentCall.complete`),
    :func:`~stateguard.consume_token`, counter changes with a ``ref``
    (:func:`~stateguard.decrement`, :func:`~stateguard.increment`,
    :func:`~stateguard.reserve`, :func:`~stateguard.release`) and
    :func:`~stateguard.emit` make their transaction commit with PostgreSQL's
    ``synchronous_commit = remote_apply`` (COMMIT returns once a synchronous
    standby has applied it), and a COMMIT whose wait for the standby was cut
    short raises :class:`~stateguard.ReplicationTimeout` instead of passing
    for durable.  ``"local"`` or ``None``: as the server is configured (the
    default).  A call's own ``durability=`` keyword wins over this default;
    one durable call makes its whole transaction durable.  The setting holds
    for ``engine`` and its ``execution_options()`` copies (they share its
    dialect); ``set_durability(engine, None)`` forgets it.

    ``timeout``: how long a durable COMMIT on this engine may wait for the
    standby before stateguard cancels the wait (psycopg's ``cancel()`` from a
    timer thread); the transaction is then committed on the primary only and
    the commit raises ReplicationTimeout.  ``None``: wait as long as
    PostgreSQL does (for ever, unless someone cancels it).  A timeout with
    ``durability=None`` applies to the calls that ask for ``"replicated"``
    themselves::

        stateguard.set_durability(engine, "replicated", timeout=timedelta(seconds=5))

    A durable call refuses with :class:`~stateguard.ConfigurationError`, writing nothing, where
    the COMMIT that would wait is not the session's to watch: a connection in AUTOCOMMIT, a
    two-phase session (``twophase=True``), or a session joined into a transaction the
    application began on its Connection (any ``join_transaction_mode`` but ``"control_fully"``).

    :raises InvalidArgument: an unknown level, or a timeout that is not a positive timedelta.
    :raises NotSupported: ``"replicated"`` where no COMMIT can be confirmed by a standby: SQLite,
        MariaDB/MySQL, CockroachDB, or PostgreSQL through a driver other than psycopg (only
        psycopg hands stateguard the server's WARNING about a cancelled wait).
    """
    _kernel.set_durability(engine, durability, timeout)
