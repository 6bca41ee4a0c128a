"""AsyncSession support: the same public calls, awaited.

Every guarded operation is written once, synchronously, against a
:class:`~sqlalchemy.orm.Session`.  Given an
:class:`~sqlalchemy.ext.asyncio.AsyncSession`, the same call returns a
coroutine that runs that code through SQLAlchemy's own greenlet bridge,
:meth:`AsyncSession.run_sync`: each statement is awaited on the async driver
(asyncpg, psycopg async, aiomysql/asyncmy, aiosqlite) while the statement
building, outcome classification and error mapping stay the single
synchronous implementation.  No second copy of an algorithm exists, so sync
and async cannot drift apart; the cost is one greenlet switch per call.

::

    r = decrement(session, Stock.amount, sku, by=1)          # Session: a Result
    r = await decrement(session, Stock.amount, sku, by=1)    # AsyncSession: awaited

:mod:`.bridge` gives session-taking functions and context managers their
async face, :mod:`.methods` methods and members (real functions under the
public name), :mod:`.sessions` checks what was passed where the session
belongs; :mod:`.steps` runs code that talks to something other than a
session (a Redis client, an Engine of its own) as a sans-I/O generator.
"""

from __future__ import annotations

from .bridge import Dual, DualConnectable, DualContext, DualContextManager, dual, dual_bind, dual_connectable
from .methods import DualObject, dual_member, dual_method
from .sessions import AsyncSession, as_session, sync_session_of, wrong_session
from .steps import Awaited, Steps, run_steps, step

__all__ = [
    "AsyncSession",
    "Awaited",
    "Dual",
    "DualConnectable",
    "DualContext",
    "DualContextManager",
    "DualObject",
    "Steps",
    "as_session",
    "dual",
    "dual_bind",
    "dual_connectable",
    "dual_member",
    "dual_method",
    "run_steps",
    "step",
    "sync_session_of",
    "wrong_session",
]
