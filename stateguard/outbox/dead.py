"""Dead events and old ones: :func:`requeue_dead` gives parked events back to the relays,
:func:`purge_published` deletes events published long ago.

A relay parks an event *dead* when its sink refused it ``max_attempts``
times (``dead_ms`` set, the last error in ``last_error``).  A dead event is
never deleted (``purge_published`` deletes only published ones) and no
relay claims it; ``stateguard inspect`` counts and lists dead events as
stuck work.  Once the cause is fixed (the sink accepts it again),
:func:`requeue_dead` or ``stateguard outbox requeue`` makes it claimable
again with its refusals counted from 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

from sqlalchemy import Connection, Engine, and_, bindparam
from sqlalchemy.orm import Session

from .. import _kernel
from .._async import dual_bind
from ..exceptions import InvalidArgument
from ..tables import MAX_KEY, outbox
from .statements import _requeue_statement


@dual_bind
def requeue_dead(
    bind: Engine | Connection | Session, *, ids: Iterable[int] | None = None, key: str | None = None
) -> int:
    """Give dead outbox events back to the relays; return how many were dead and are alive again.

    Every dead event, or only those of ``ids`` and/or of ``key``.  Their
    refusals count from 0 again and a relay claims them at once, each in its
    key's id order (a key's later events that were published meanwhile stay
    published: in the default key order they went ahead of the dead event).
    With an Engine it runs in its own short transaction; with a Connection
    or Session in the caller's::

        requeue_dead(engine)                        # every dead event
        requeue_dead(engine, ids=[41, 42])
        await requeue_dead(async_session, key="order-7")

    :raises InvalidArgument: ``ids`` is not a collection of ints (or is a
        str), or ``key`` is blank, oversize or not a str; nothing was changed.
    """
    id_list: list[int] | None = None
    if ids is not None:
        if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
            raise InvalidArgument(f"ids must be a collection of event ids (ints), got {ids!r}")
        id_list = list(ids)
        if any(type(i) is not int for i in id_list):
            raise InvalidArgument(f"ids must be event ids (ints), got {id_list!r}")
        if not id_list:
            return 0
    if key is not None:
        _kernel.check_text(key, "key", MAX_KEY)
    if isinstance(bind, Engine):
        with bind.begin() as conn:
            return _requeue(conn, id_list, key)
    return _requeue(_kernel.own_connection(bind, outbox) if isinstance(bind, Session) else bind, id_list, key)


def _requeue(conn: Connection, ids: list[int] | None, key: str | None) -> int:
    backend = _kernel.backend(conn.dialect)
    params: dict[str, object] = {}
    if ids is not None:
        params["sg_ids"] = ids
    if key is not None:
        params["sg_key"] = key
    stmt = _requeue_statement(backend, ids is not None, key is not None)
    return int(_kernel.execute(conn, stmt, params).rowcount)


@dual_bind
def purge_published(bind: Engine | Connection | Session, *, older_than: timedelta, batch: int = 1000) -> int:
    """Delete at most ``batch`` events published more than ``older_than`` ago; return how many.

    Unpublished events are never deleted.  Ages are judged on the database's
    clock.  With an Engine the batch runs in its own short transaction; with
    a Connection or Session in the caller's.  Loop until it returns less
    than ``batch`` (``stateguard purge --outbox-retention`` does)::

        while purge_published(engine, older_than=timedelta(days=7)) == 1000:
            pass

    :raises InvalidArgument: ``older_than`` is not a positive timedelta or
        ``batch`` not a positive int.
    """
    old = and_(
        outbox.c.published_ms.is_not(None),
        outbox.c.published_ms <= _kernel.db_now_ms() - bindparam("sg_older"),
    )
    return _kernel.purge_rows(
        outbox, bind, batch, old, sg_older=_kernel.duration_ms(older_than, "older_than")
    )
