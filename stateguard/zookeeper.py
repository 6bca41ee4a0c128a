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

from . import _kernel
from . import observe as _observe
from .exceptions import InvalidArgument, LockLost, LockNotAcquired

__all__ = ["ZooKeeperLock"]

log = logging.getLogger(__name__)

#: Characters ZooKeeper refuses in a path.  PathUtils.validatePath checks Java chars, UTF-16
#: units: a character above U+FFFF (an emoji, CJK extension B) is a surrogate pair there, inside
#: its refused \ud800-\uf8ff range, so the server answers BadArguments.  A lone surrogate in a
#: Python str is worse: kazoo's UTF-8 encoder raises in its connection thread, which then dies.
_BAD_PATH_CHARS: Final = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\uf8ff\ufff0-\uffff\U00010000-\U0010ffff]")

#: What kazoo's lock recipe appends to the lock's path for each contender's znode:
#: ``/`` + a uuid4 in hex (32) + ``__lock__`` + the 10-digit sequence suffix.
_CONTENDER_SUFFIX: Final = 1 + 32 + len("__lock__") + 10

#: The longest contender znode path, in UTF-8 bytes (what kazoo sends and ZooKeeper counts).
#: ZooKeeper drops the connection on any request over jute.maxbuffer (0xfffff bytes by
#: default, the whole request: a create of a path of about 1,048,528 bytes is the largest a
#: standalone server takes), kazoo then retries it forever, and every other lock on that client
#: reads SUSPENDED meanwhile.  Far below that on purpose: a leader forwards the request inside
#: a bigger packet, a server may run a smaller jute.maxbuffer, and a client re-registers all its
#: watches (each waiter watches a path this long) in one request when it reconnects.
_MAX_PATH_BYTES: Final = 4096

#: A znode holds at most 1 MB (jute.maxbuffer); identifiers are labels, keep them small.
_MAX_IDENTIFIER: Final = 1024


#: How long past its deadline acquire() lets a connected attempt finish (kazoo's recipe deletes
#: its contender znode, one round trip) before it gives up on it and cleans up in the background.
_GRACE: Final = 0.25

#: The longest finite wait (kazoo turns a timeout into a deadline that must fit a time_t).
_MAX_WAIT: Final = 365 * 24 * 3600.0


def _timeout(value: Any) -> float | None:
    """A wait in seconds: ``None`` and infinity wait forever; over a year is InvalidArgument."""
    wait = _kernel.seconds(value, "timeout", allow_zero=True)
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
    size = len(path.encode("utf-8")) + _CONTENDER_SUFFIX
    if size > _MAX_PATH_BYTES:
        raise InvalidArgument(
            f"ZooKeeperLock path {path[:40]!r}... is too long: with the {_CONTENDER_SUFFIX} characters of "
            f"its contender znode's name it is {size} bytes in UTF-8, over the {_MAX_PATH_BYTES} this lock "
            f"allows (ZooKeeper drops the connection on a request over jute.maxbuffer, about 1 MB). "
            f"Hash a long name: '/locks/' + hashlib.sha256(name.encode()).hexdigest()"
        )
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


class _Attempt:
    """One acquisition run on a handler thread, and whether its caller still waits for it."""

    def __init__(self, handler: Any) -> None:
        self.lock = handler.lock_object()
        self.done = handler.event_object()
        self.abandoned = False
        #: ``(node, session id, fence, LOST count)`` or the error, once ``done`` is set.
        self.outcome: tuple[str, int, int, int] | BaseException = RuntimeError("the attempt has not finished")


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
    :class:`~stateguard.LockNotAcquired`: it bounds the whole call, a client
    cut off from ZooKeeper included (a one try is bounded by the client's
    session timeout).  ``identifier`` is stored in the contender's znode
    (kazoo's ``contenders()`` lists them).

    ``path`` is checked against ZooKeeper's rules before anything is sent:
    no character ZooKeeper refuses (any above U+FFFF among them: ZooKeeper
    checks UTF-16 units), and at most 4,096 bytes in UTF-8 for a contender's
    znode, the path plus the 51 characters kazoo's recipe appends.  Hash a
    long name: ``"/locks/" + hashlib.sha256(name.encode()).hexdigest()``.

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
        ``path`` is not a valid absolute ZooKeeper path or is too long, or a
        bad ``timeout`` or ``identifier``.
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
            _kernel.check_storable(identifier, "identifier")
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
        self._losses = 0

    # -- connection state (called on kazoo's event thread: flags only) ----------

    def _on_state(self, state: str) -> None:
        from kazoo.protocol.states import KazooState

        if state == KazooState.LOST:
            self._lost = True
            self._losses += 1
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
        try).  It bounds the whole call: a client cut off from ZooKeeper, or
        a server that does not answer, gets LockNotAcquired in time, and the
        attempt's znode, if it made one, is deleted once ZooKeeper answers::

            fence = lock.acquire(timeout=5)
            try:
                ...
            finally:
                lock.release()
        """
        with _observe.watch("zookeeper_lock.acquire", log, scope=self.path, backend="zookeeper"):
            return self._acquire(timeout)

    def _acquire(self, timeout: float | timedelta | None) -> int:
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
            if wait is None:
                node, session, fence, losses = self._take(recipe, None)
            else:
                node, session, fence, losses = self._take_within(recipe, wait)
        except BaseException:
            self._unlisten()
            raise
        self._node = node
        self._session = session
        self._fence = fence
        # A session lost while kazoo retried is over; a LOST since the grant is about ours.
        self._lost = self._losses != losses
        self._held = True
        if self.client.state != KazooState.CONNECTED:
            self._suspended = True  # dropped again since exists() answered: not known to be held
        return fence

    def _take(self, recipe: Any, wait: float | None) -> tuple[str, int, int, int]:
        """Run kazoo's recipe, then read the fence: ``(node, session id, fence, LOST count at the grant)``.

        Touches no attribute of the lock object, so that an attempt given up
        by :meth:`_take_within` cannot disturb a later one.
        """
        from kazoo.exceptions import CancelledError, KazooException, LockTimeout
        from kazoo.protocol.states import KazooState

        try:
            got = recipe.acquire(blocking=wait != 0, timeout=wait or None)
        except (LockTimeout, CancelledError):  # cancelled: by _take_within, at its deadline
            got = False
        if not got:
            unreachable = self.client.state != KazooState.CONNECTED
            raise LockNotAcquired(
                f"ZooKeeperLock {self.path!r} "
                + ("could not reach ZooKeeper (the client is not connected)" if unreachable
                   else "is held by someone else")
                + f"{'' if wait is None else f'; gave up after {wait:g}s'}. "
                f"Retry later (retry_on_conflict() does this)"
            )  # fmt: skip
        losses = self._losses
        node = f"{self.path}/{recipe.node}"
        stat = self.client.retry(self.client.exists, node)
        session = self.client.client_id
        if stat is None or session is None or stat.ephemeralOwner != session[0] or self._losses != losses:
            with suppress(KazooException):  # best effort: the znode of a lost session is gone anyway
                recipe.release()
            raise LockNotAcquired(
                f"ZooKeeperLock {self.path!r} lost its ZooKeeper session while it was being acquired; retry"
            )
        return node, session[0], int(stat.czxid), losses

    def _take_within(self, recipe: Any, wait: float) -> tuple[str, int, int, int]:
        """:meth:`_take` bounded by ``wait`` seconds, connection loss included.

        kazoo's calls wait without a limit for a connection that is down
        (they are queued until the client reconnects), and its recipe's
        deadline is only checked between retries: the attempt runs on a
        thread of the client's handler, and the caller stops waiting for it
        at the deadline.  An attempt given up on is cancelled and cleans up
        after itself when ZooKeeper answers again (:meth:`_abandon`).  A one
        try (``wait == 0``) is bounded by the client's session timeout.
        """
        from kazoo.protocol.states import KazooState

        budget = wait or getattr(self.client, "_session_timeout", 10_000) / 1000
        handler = self.client.handler
        attempt = _Attempt(handler)
        handler.spawn(self._attempt, attempt, recipe, wait)
        try:
            if not attempt.done.wait(budget):
                # The recipe's own wait ends about now too: cancelled, a waiter
                # deletes its znode and returns, one round trip while connected.
                recipe.cancel()
                if self.client.state == KazooState.CONNECTED:
                    attempt.done.wait(_GRACE)
        finally:
            with attempt.lock:
                attempt.abandoned = not attempt.done.is_set()
            if attempt.abandoned:
                recipe.cancel()
        if attempt.abandoned:
            raise LockNotAcquired(
                f"ZooKeeperLock {self.path!r}: ZooKeeper did not answer within {budget:g}s (the client "
                f"is {self.client.state}); nothing is held, and the attempt's contender znode, if it "
                f"was made, is deleted when ZooKeeper answers again. Retry later (retry_on_conflict() "
                f"does this)"
            )
        if isinstance(attempt.outcome, BaseException):
            raise attempt.outcome
        return attempt.outcome

    def _attempt(self, attempt: _Attempt, recipe: Any, wait: float) -> None:
        """One acquisition on a handler thread: hand the outcome over, or clean up if nobody waits."""
        outcome: tuple[str, int, int, int] | BaseException
        try:
            outcome = self._take(recipe, wait)
        except BaseException as error:  # handed to the caller
            outcome = error
        with attempt.lock:
            if not attempt.abandoned:
                attempt.outcome = outcome
                attempt.done.set()
                return
        self._abandon(recipe)

    def _abandon(self, recipe: Any) -> None:
        """Delete whatever znode a given-up attempt made (found by the recipe's unique prefix).

        kazoo's recipe cleans up after itself at its best effort, but that
        delete may meet the connection down too, and its create may have run
        on the server before the connection dropped: a znode left would be a
        contender nobody waits for, that blocks the lock for the session's
        whole life.  ZooKeeper answers a session's requests in order, so a
        listing sent after the create sees it.  A session that expired took
        its ephemeral znodes with it: nothing left to do.
        """
        from kazoo.exceptions import KazooException, NoNodeError
        from kazoo.retry import KazooRetry

        def delete_ours() -> None:
            try:
                children = self.client.get_children(self.path)
            except NoNodeError:
                return
            for child in children:
                if child.startswith(recipe.prefix):
                    with suppress(NoNodeError):
                        self.client.delete(f"{self.path}/{child}")

        retry = KazooRetry(max_tries=-1, ignore_expire=False, sleep_func=self.client.handler.sleep_func)
        try:
            retry(delete_ours)
        except KazooException as error:  # a stopped client or an expired session: its znodes are gone
            log.debug("ZooKeeperLock %r: no clean-up after a given-up acquire: %r", self.path, error)

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
