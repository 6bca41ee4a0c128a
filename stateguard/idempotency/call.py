"""The handle of one idempotent block: :class:`IdempotentCall`, what a claim found and how to finish it.

A call is a replay (``replayed``, ``response``) or owns the key; an owned
call is finished with :meth:`~IdempotentCall.complete` (or released, or
failed by its block's exception) and may record checkpoints and extend its
lease meanwhile.  Every write goes through its :class:`~stateguard.idempotency.claim.Claim`,
which holds the algorithm; with an AsyncSession the methods are awaited.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, TypeVar

from .. import _kernel
from .._async import DualObject, dual_member
from ..exceptions import InvalidArgument
from .options import Mode
from .serialization import MAX_ERROR, dump
from .statements import CHECKPOINT, COMPLETE

if TYPE_CHECKING:
    from .claim import Claim

__all__ = ["IdempotentCall"]

R = TypeVar("R")
#: The kind of session a call was made for (a Session or an AsyncSession).
S = TypeVar("S")


class IdempotentCall(DualObject[S]):
    """What :func:`idempotent` found for a key, and the way to finish it.

    - ``replayed``: ``True`` when the key was completed before; ``response``
      is the stored response (after a serializer round trip).  Do not run
      the work again.
    - otherwise this call owns the key: do the work, then
      ``return call.complete(response)``.  ``attempt`` counts the claims of
      this key (1 for a first call); ``taken_over`` is ``True`` when an
      earlier claim died or was released, and ``checkpoint_name`` /
      ``checkpoint_data`` then hold its last :meth:`checkpoint`.

    With an AsyncSession (``async with idempotent(...) as call``) the
    attributes are the same and ``complete``, ``checkpoint``, ``heartbeat``
    and ``release`` are awaited::

        return await call.complete({"payment_id": payment.id})
    """

    #: ``True`` when the key was completed before: return :attr:`response`, do not run the work again.
    replayed: bool = False
    #: The stored response of a replay (after a serializer round trip).
    response: Any = None
    #: How many times the key was claimed (1 for a first call).
    attempt: int = 1
    #: ``True`` when an earlier claim died or was released and this call resumed it.
    taken_over: bool = False
    #: The last :meth:`checkpoint` of a taken-over claim.
    checkpoint_name: str | None = None
    #: Its data (after a serializer round trip).
    checkpoint_data: Any = None

    def __init__(self, claim: Claim[S], state: str = "open") -> None:
        self._dual_session = claim.face  # DualObject.__init__, written out: one call less per claim
        self._claim = claim
        #: "replayed", "open", "completed", "released", "failed" or "lost".
        self._state = state

    @property
    def scope(self) -> str:
        """The key's scope."""
        return self._claim.scope

    @property
    def key(self) -> str:
        """The idempotency key."""
        return self._claim.key

    @property
    def mode(self) -> Mode:
        """``"same_transaction"`` or ``"separate"``."""
        return self._claim.options.mode

    def _complete(self, response: R, *, durability: Literal["replicated", "local"] | None = None) -> R:
        """Store ``response`` as the key's result and return it.

        In same-transaction mode the record commits with the caller's
        transaction; in separate mode this commits the session (the last
        phase's writes and the response land together).  A replay of this key
        returns ``response`` through the serializer (JSON by default)::

            return call.complete({"payment_id": payment.id})

        ``durability="replicated"`` (PostgreSQL with a synchronous standby): the
        record's transaction commits only once the standby applied it; a
        COMMIT the standby did not confirm raises
        :class:`~stateguard.ReplicationTimeout` (from this call in separate
        mode, which commits; from the caller's commit in same-transaction
        mode), whose ``value`` holds ``response``.  An engine's
        :func:`~stateguard.set_durability` default applies when it is ``None``;
        ``"local"`` opts out.

        :raises InvalidArgument: the response cannot be stored (not
            serialisable, NaN, nested too deeply, a NUL or lone surrogate in
            its text, larger than the server accepts): nothing was sent and
            the call stays open; or the call is a replay or already finished.
        :raises LeaseLost: the lease expired and another worker took the key
            over; its record was left as it was.
        :raises NotSupported: ``durability="replicated"`` on SQLite, MariaDB or
            a driver other than psycopg; nothing was written, the call stays open.
        :raises ConfigurationError: ``durability="replicated"`` with no
            synchronous standby; nothing was written, the call stays open.
        :raises ReplicationTimeout: separate mode: the completion is committed
            on the primary (the call is completed) but the standby did not
            confirm it.
        """
        if self._state != "open":
            self._check_open("complete")
        claim = self._claim
        options = claim.options
        text = dump(options.serializer, response, "response")
        if options.mode == "same_transaction":
            claim.complete_same(self, text, durability, response)
        else:
            claim.write(self, COMPLETE, {"sg_text": text}, "completed", durability, response)
        return response

    def _checkpoint(self, name: str, data: Any = None) -> None:
        """Record a recovery point (Stripe's atomic phases) and extend the lease.

        A worker that takes this key over after a crash finds ``name`` and
        ``data`` in its call's ``checkpoint_name`` / ``checkpoint_data``.  In
        separate mode this commits the session, so the phase's writes and its
        recovery point land together::

            if call.checkpoint_name != "charged":
                charge_id = psp.charge(...)                # outside system
                call.checkpoint("charged", {"charge_id": charge_id})

        :raises InvalidArgument: bad ``name``, or ``data`` that cannot be
            stored (as for :meth:`complete`); nothing was sent.
        :raises LeaseLost: the key was taken over.
        """
        self._check_open("checkpoint")
        _kernel.check_text(name, "checkpoint name", 100)
        claim = self._claim
        serializer = claim.options.serializer
        text = dump(serializer, data, "checkpoint data")
        claim.write(self, CHECKPOINT, {"sg_name": name, "sg_text": text}, None)
        self.checkpoint_name = name
        self.checkpoint_data = serializer.loads(text)

    def _heartbeat(self) -> None:
        """Extend the lease by ``lease`` from now, for work that takes longer than one lease.

        In separate mode it commits in its own short transaction (the
        session's work is not committed); ``heartbeat_every=`` does this from
        a background thread::

            for chunk in chunks:
                process(chunk)
                call.heartbeat()

        :raises LeaseLost: the key was taken over meanwhile.
        """
        self._check_open("heartbeat")
        self._claim.heartbeat(self)

    def _release(self, reason: str | None = None, *, forget: bool = False) -> None:
        """Give the key back without a response, so the next retry runs the work (e.g. after a 5xx).

        In separate mode the release commits the session; the record keeps
        the last checkpoint (and the request's fingerprint) for the next
        attempt.  ``forget=True`` deletes this call's record instead, so any
        request may use the key again, not only the same one (the HTTP
        middleware does this for requests refused before they ran).  In
        same-transaction mode it rolls back the savepoint: the claim and
        everything the block wrote, exactly as an exception would (the key
        is then as it was before this call, ``forget`` or not)::

            if response.status_code >= 500:
                call.release("upstream failed")

        :raises InvalidArgument: ``reason`` is not a str, longer than 2,000
            characters, or holds a NUL or lone surrogate; nothing was sent.
        :raises LeaseLost: the key was taken over meanwhile.
        """
        self._check_open("release")
        if reason is not None:
            if not isinstance(reason, str):
                raise InvalidArgument(f"release reason must be a str or None, got {type(reason).__name__}")
            if len(reason) > MAX_ERROR:
                raise InvalidArgument(
                    f"release reason is {len(reason)} characters long; the limit is {MAX_ERROR}"
                )
            _kernel.check_storable(reason, "release reason")
        self._claim.release(self, reason, forget)

    complete = dual_member(_complete)
    checkpoint = dual_member(_checkpoint)
    heartbeat = dual_member(_heartbeat)
    release = dual_member(_release)

    def _check_open(self, what: str) -> None:
        if self._state != "open":
            if self._state == "replayed":
                raise InvalidArgument(
                    f"cannot {what} idempotency key {self.key!r} in scope {self.scope!r}: this call replayed "
                    f"the stored response; return call.response instead"
                )
            raise InvalidArgument(
                f"cannot {what} idempotency key {self.key!r} in scope {self.scope!r}: the call is already "
                f"{self._state}"
            )

    def __repr__(self) -> str:
        return (
            f"<IdempotentCall scope={self.scope!r} key={self.key!r} {self._state} attempt={self.attempt}"
            f"{' taken_over' if self.taken_over else ''}>"
        )
