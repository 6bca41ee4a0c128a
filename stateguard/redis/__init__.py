"""Redis: one-time tokens and locks with fencing tokens.

* :mod:`~stateguard.redis.tokens`: :class:`RedisTokens` and :class:`AsyncRedisTokens`,
  :func:`~stateguard.issue_token` / :func:`~stateguard.consume_token` in Redis;
* :mod:`~stateguard.redis.lock`: :class:`RedisLock` and :class:`AsyncRedisLock`,
  redis-py's lock plus a fencing token for ``fence=``;
* :mod:`~stateguard.redis.fences`: the lock's scripts and the database's fences;
* :mod:`~stateguard.redis.cancellation`: the give-back a task's cancellation cannot cut;
* :mod:`~stateguard.redis.client`: the client check, sync or async calls, ``wait_replicas``.

The outbox sink for Redis streams lives in
:mod:`stateguard.outbox.sinks.redis_streams` (``from stateguard import
RedisStreamSink``).  redis-py (the ``stateguard[redis]`` extra) is imported
only by these modules, and only when a lock is built or an error mapped:
``import stateguard`` works without it.  Private members of these modules are
used only inside this package.
"""

from __future__ import annotations

from typing import Any, Final

from .. import _compat
from .client import DEFAULT_WAIT_TIMEOUT, MAX_WAIT_REPLICAS, MAX_WAIT_TIMEOUT
from .lock import AsyncRedisLock, RedisLock
from .tokens import AsyncRedisTokens, RedisTokens

__all__ = [
    "DEFAULT_WAIT_TIMEOUT",
    "MAX_WAIT_REPLICAS",
    "MAX_WAIT_TIMEOUT",
    "AsyncRedisLock",
    "AsyncRedisTokens",
    "RedisLock",
    "RedisTokens",
]

#: Names this module defined before the sink moved to the outbox, and where they live now.
_MOVED: Final = {
    "RedisStreamSink": "stateguard.outbox.sinks.redis_streams",
    "MAX_MAXLEN": "stateguard.outbox.sinks.redis_streams",
}


def __getattr__(name: str) -> Any:
    return _compat.moved(__name__, name, _MOVED)
