"""ZooKeeper: a lock whose fencing token is the ZooKeeper transaction id of its own znode.

:class:`ZooKeeperLock` is kazoo's lock recipe (:class:`kazoo.recipe.lock.Lock`:
an ephemeral sequential znode under the lock's path per contender, each
waiter watching its predecessor) plus a *fencing token* that works with
:func:`~stateguard.fence_column` and ``fence=`` exactly like
:class:`~stateguard.RedisLock`'s.

The fence is the ``czxid`` of the holder's own znode: the zxid of the
transaction that created it.  Zxids are 64-bit, totally ordered across the
whole ensemble (the epoch of the leader in the high 32 bits, a counter in
the low 32), and they never go back, across leader elections too.  The lock
grants itself in creation order, so every later holder's znode, hence its
fence, is bigger.  The sequence suffix of the node name is *not* used: it
is a signed 32-bit counter per parent node that wraps (kazoo issue #606).

kazoo (the ``stateguard[zookeeper]`` extra) is imported only by this
module, and only when a lock is built: ``import stateguard`` works without
it.  kazoo has no asyncio client (its handlers are threads, gevent or
eventlet), so there is no ``AsyncZooKeeperLock``: from asyncio, run
:meth:`ZooKeeperLock.acquire` and :meth:`ZooKeeperLock.release` in a thread
(``await asyncio.to_thread(lock.acquire)``).
"""

from __future__ import annotations

import logging
import re
from contextlib import suppress
from datetime import timedelta
from types import TracebackType
from typing import Any, Final

from . import _write
from . import observe as _observe
from .exceptions import InvalidArgument, LockLost, LockNotAcquired

__all__ = ["ZooKeeperLock"]

log = logging.getLogger(__name__)

#: Characters ZooKeeper refuses in a path (PathUtils.validatePath).
_BAD_PATH_CHARS: Final = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\uf8ff\ufff0-\uffff]")

#: A znode holds at most 1 MB (jute.maxbuffer); identifiers are labels, keep them small.
_MAX_IDENTIFIER: Final = 1024


#: The longest finite wait (kazoo turns a timeout into a deadline that must fit a time_t).
_MAX_WAIT: Final = 365 * 24 * 3600.0


def _timeout(value: Any) -> float | None:
    """A wait in seconds: ``None`` and infinity wait forever; over a year is InvalidArgument."""
    wait = _write.seconds(value, "timeout", allow_zero=True)
    if wait == float("inf"):
        return None
    if wait is not None and wait > _MAX_WAIT:
        raise InvalidArgument(
            f"ZooKeeperLock timeout must be at most one year ({_MAX_WAIT:.0f} s), got {value!r}; "
            f"pass None (or float('inf')) to wait forever"
        )
    return wait


def _check_path(path: Any) -> str:
    """``path`` if ZooKeeper accepts it as the parent of the lock's znodes, else InvalidArgument."""
    if not isinstance(path, str):
        raise InvalidArgument(f"ZooKeeperLock path must be a str like '/locks/payout-42', got {path!r}")
    problem = None
    if not path.startswith("/"):
        problem = "it must be absolute (start with '/')"
    elif path == "/":
        problem = "the root cannot be a lock: name a node under it"
    elif path.endswith("/"):
        problem = "it must not end with '/'"
    elif "//" in path:
        problem = "it has an empty segment ('//')"
    elif any(segment in (".", "..") for segment in path.split("/")):
        problem = "ZooKeeper refuses '.' and '..' segments"
    elif _BAD_PATH_CHARS.search(path):
        problem = "it holds a control or reserved character that ZooKeeper refuses"
    elif path == "/zookeeper" or path.startswith("/zookeeper/"):
        problem = "/zookeeper is ZooKeeper's own subtree"
    if problem is not None:
        raise InvalidArgument(f"ZooKeeperLock path {path!r} is not valid: {problem}")
    return path


def _check_client(client: Any) -> None:
    """Refuse anything but a started :class:`kazoo.client.KazooClient`."""
    try:
        from kazoo.client import KazooClient
    except ImportError as error:
        raise ImportError(
            "ZooKeeperLock needs the kazoo package: pip install 'stateguard[zookeeper]'"
        ) from error

    if not isinstance(client, KazooClient):
        raise InvalidArgument(
            f"ZooKeeperLock needs a kazoo.client.KazooClient, got {client!r}; "
            f"build one with KazooClient(hosts='zk1:2181,zk2:2181') and call its start()"
        )
    if not client.connected:
        raise InvalidArgument(
            f"ZooKeeperLock needs a started, connected KazooClient, got {client!r} in state "
            f"{client.state}; call client.start() first (it waits until connected)"
        )


class ZooKeeperLock:
    """A ZooKeeper lock (kazoo's recipe) that hands out a fencing token on every acquisition.

    The fence is the ``czxid`` of this holder's znode: a 64-bit number that
    only grows across the whole ensemble, so a holder whose session expired
    while it was paused (GC, a stalled VM) cannot overwrite a newer holder's
    write.  Pass it as ``fence=`` to a trigger or
    :func:`~stateguard.guarded_update` on a model with a
    :func:`~stateguard.fence_column`::

        zk = KazooClient(hosts="127.0.0.1:2181")
        zk.start()
        with ZooKeeperLock(zk, "/locks/payout-42") as fence:
            Payout.flow.send(session, 42, fence=fence)
            session.commit()

    ``timeout`` (seconds or a ``timedelta``; ``None``: wait forever; ``0``:
    one try) is how long :meth:`acquire` waits before it raises
    :class:`~stateguard.LockNotAcquired`.  ``identifier`` is stored in the
    contender's znode (kazoo's ``contenders()`` lists them).

    Session loss.  The lock lives as long as the client's ZooKeeper session:
    when the session expires (the client was cut off or paused longer than
    the session timeout), the znode goes and the next contender holds the
    lock.  The lock object follows the client's connection state:

    * ``SUSPENDED`` (the connection dropped; the session may still be alive
      on the servers, and with it the lock): :meth:`is_held` answers
      ``False`` and :attr:`fence` raises :class:`~stateguard.LockLost`, because
      nobody can tell yet; if the client reconnects within the session
      timeout, the lock is held again with the same fence.
    * ``LOST`` (the session expired or the client was stopped): the lock is
      gone for good.  :meth:`is_held` is ``False``; :attr:`fence` and
      :meth:`release` raise :class:`~stateguard.LockLost`.

    Writes with ``fence=lock.fence`` therefore fail before anything is sent
    once the loss is known; a fence read earlier (``with ... as fence``) is
    refused by the database (STALE) once a newer holder has written.

    One lock object is one contender: it is not re-entrant, and threads
    that compete for one path each build their own lock (on one client or
    several).  kazoo has no asyncio client, so there is no async form: call
    ``await asyncio.to_thread(lock.acquire)`` from a coroutine.

    :raises InvalidArgument: ``client`` is not a started ``KazooClient``,
        ``path`` is not a valid absolute ZooKeeper path, or a bad
        ``timeout`` or ``identifier``.
    """

    def __init__(
        self,
        client: Any,
        path: str,
        *,
        identifier: str | None = None,
        timeout: float | timedelta | None = None,
    ) -> None:
        _check_client(client)
        self.path = _check_path(path)
        if identifier is not None:
            if not isinstance(identifier, str):
                raise InvalidArgument(f"ZooKeeperLock identifier must be a str or None, got {identifier!r}")
            if len(identifier.encode("utf-8", "surrogatepass")) > _MAX_IDENTIFIER:
                raise InvalidArgument(
                    f"ZooKeeperLock identifier is over {_MAX_IDENTIFIER} bytes; it is a label stored in "
                    f"the contender's znode, keep it short"
                )
            _write.check_storable(identifier, "identifier")
        self.client = client
        self.identifier = identifier
        self.timeout = _timeout(timeout)
        self._recipe: Any = None
        self._node: str | None = None
        self._fence: int | None = None
        self._session: int | None = None
        self._held = False
        self._lost = False
        self._suspended = False
        self._listening = False

    # -- connection state (called on kazoo's event thread: flags only) ----------

    def _on_state(self, state: str) -> None:
        from kazoo.protocol.states import KazooState

        if state == KazooState.LOST:
            self._lost = True
        elif state == KazooState.SUSPENDED:
            self._suspended = True
        else:
            self._suspended = False

    def _listen(self) -> None:
        if not self._listening:
            self.client.add_listener(self._on_state)
            self._listening = True

    def _unlisten(self) -> None:
        if self._listening:
            self.client.remove_listener(self._on_state)
            self._listening = False

    def _session_gone(self) -> bool:
        """Whether the session that created the znode is known to be over.

        kazoo reports no client id while disconnected: that is not known to
        be over (SUSPENDED, see :attr:`fence`), a different id after
        reconnecting is.
        """
        current = self.client.client_id
        return self._lost or (current is not None and current[0] != self._session)

    def _forget(self) -> None:
        """This object holds nothing any more (released, or known lost)."""
        self._unlisten()
        if self._recipe is not None:
            self._recipe.is_acquired = False
            self._recipe.node = None
        self._held = False
        self._node = None

    def _lost_error(self, when: str) -> LockLost:
        return LockLost(
            f"ZooKeeperLock {self.path!r} (fence {self._fence}) lost its ZooKeeper session before "
            f"{when}; another contender may hold it now. Writes made with its fence after that were "
            f"refused by fenced updates once the new holder wrote; anything else was unprotected"
        )

    # -- the lock ---------------------------------------------------------------

    @property
    def fence(self) -> int:
        """The fencing token of the current acquisition (the ``czxid`` of this holder's znode).

        Raises :class:`~stateguard.LockLost` when the session is known lost
        or the connection is suspended (the lock may be gone), so a write
        that reads it at the last moment fails before it is sent, and
        :class:`~stateguard.InvalidArgument` when the lock is not held::

            lock.acquire()
            Payout.flow.send(session, 42, fence=lock.fence)
        """
        if not self._held or self._fence is None:
            raise InvalidArgument(f"ZooKeeperLock {self.path!r} is not held: acquire() it first")
        if self._session_gone():
            raise self._lost_error("this fence was read")
        if self._suspended:
            raise LockLost(
                f"ZooKeeperLock {self.path!r} (fence {self._fence}): the connection to ZooKeeper is "
                f"suspended, so the lock may already belong to someone else; nothing was written. "
                f"Retry once the client is connected again (is_held())"
            )
        return self._fence

    def acquire(self, *, timeout: float | timedelta | None = None) -> int:
        """Take the lock and return its fencing token, or raise :class:`~stateguard.LockNotAcquired`.

        ``timeout`` overrides the one given to the constructor (``0``: one
        try)::

            fence = lock.acquire(timeout=5)
            try:
                ...
            finally:
                lock.release()
        """
        with _observe.watch("zookeeper_lock.acquire", log, scope=self.path, backend="zookeeper"):
            return self._acquire(timeout)

    def _acquire(self, timeout: float | timedelta | None) -> int:
        from kazoo.exceptions import KazooException, LockTimeout
        from kazoo.protocol.states import KazooState, KeeperState
        from kazoo.recipe.lock import Lock

        wait = _timeout(timeout)
        if wait is None:
            wait = self.timeout
        if self._held:
            raise InvalidArgument(
                f"ZooKeeperLock {self.path!r} is already held by this object (it is not re-entrant); "
                f"release() it first, or build one lock object per contender"
            )
        if self.client.client_state == KeeperState.CLOSED:
            raise InvalidArgument(
                f"ZooKeeperLock {self.path!r}: its KazooClient was stopped; start() it again (or build "
                f"the lock on a started client)"
            )
        # A fresh recipe per acquisition: kazoo's keeps is_acquired after its
        # session expired, and would wait forever for itself on a second try.
        recipe = Lock(self.client, self.path, self.identifier)
        self._recipe = recipe
        self._lost = False
        self._suspended = False
        self._listen()
        try:
            try:
                got = recipe.acquire(blocking=wait != 0, timeout=wait or None)
            except LockTimeout:
                got = False
            if not got:
                raise LockNotAcquired(
                    f"ZooKeeperLock {self.path!r} is held by someone else"
                    f"{'' if wait is None else f'; gave up after {wait:g}s'}. "
                    f"Retry later (retry_on_conflict() does this)"
                )
            # A session lost while kazoo retried is over; from here on any
            # LOST is about the session that owns the znode read below.
            self._lost = False
            node = f"{self.path}/{recipe.node}"
            stat = self.client.retry(self.client.exists, node)
            session = self.client.client_id
            if stat is None or session is None or stat.ephemeralOwner != session[0] or self._lost:
                with suppress(KazooException):  # best effort: the znode of a lost session is gone anyway
                    recipe.release()
                raise LockNotAcquired(
                    f"ZooKeeperLock {self.path!r} lost its ZooKeeper session while it was being "
                    f"acquired; retry"
                )
        except BaseException:
            self._unlisten()
            raise
        self._node = node
        self._session = session[0]
        self._fence = int(stat.czxid)
        self._held = True
        if self.client.state != KazooState.CONNECTED:
            self._suspended = True  # dropped again since exists() answered: not known to be held
        return self._fence

    def release(self) -> None:
        """Delete this holder's znode; :class:`~stateguard.LockLost` if the session was lost before.

        A znode of an expired session is already gone (the next contender may
        hold the lock), and this object never deletes anyone else's::

            lock.acquire()
            try:
                work()
            finally:
                lock.release()
        """
        with _observe.watch("zookeeper_lock.release", log, scope=self.path, backend="zookeeper"):
            self._release()

    def _release(self) -> None:
        from kazoo.exceptions import NoNodeError

        if not self._held or self._node is None:
            raise InvalidArgument(
                f"ZooKeeperLock {self.path!r} is not held by this object (never acquired, or already "
                f"released)"
            )
        if self._session_gone():
            self._forget()
            raise self._lost_error("it was released")
        node = self._node
        tries = 0

        def delete() -> None:
            nonlocal tries
            tries += 1
            try:
                self.client.delete(node)
            except NoNodeError:
                # Gone while our session lives: an earlier try of this
                # delete ran and its reply was lost.  Gone with the session:
                # lost.  Gone at the first try: someone deleted our znode.
                if tries > 1 and not self._session_gone():
                    return
                raise

        try:
            self.client.retry(delete)
        except NoNodeError:
            self._forget()
            raise self._lost_error("it was released") from None
        # Any other error (the ensemble unreachable): still held, release() again.
        self._forget()

    def is_held(self) -> bool:
        """Whether this object holds the lock now, as far as ZooKeeper can say: conservative.

        ``False`` while the connection is suspended (the lock may still be
        held on the servers, but nobody can tell) and once the session is
        lost; otherwise one ``exists`` call checks that the znode is there and
        belongs to this client's session::

            if not lock.is_held():
                raise RuntimeError("lost the lock")
        """
        if not self._held or self._node is None or self._suspended:
            return False
        if self._session_gone():
            return False
        from kazoo.exceptions import KazooException
        from kazoo.protocol.states import KazooState

        if self.client.state != KazooState.CONNECTED:
            return False
        try:
            stat = self.client.exists(self._node)
        except KazooException:
            return False
        if stat is None or stat.ephemeralOwner != self._session:
            self._lost = True
            return False
        return not self._suspended and not self._session_gone()

    def __enter__(self) -> int:
        return self.acquire()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._held:
            return
        try:
            self.release()
        except LockLost:
            if exc_type is None:
                raise

    def __repr__(self) -> str:
        state = "held" if self._held else "not held"
        return f"<ZooKeeperLock {self.path!r} {state} fence={self._fence}>"
