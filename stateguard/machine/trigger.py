"""Trigger: fire one row's transition, and say exactly why an UPDATE that matched nothing changed nothing.

One conditional UPDATE (built once, see :mod:`stateguard.machine.compile`)
when the transition applies; when it matches no row, one read of the row
tells REPEATED, REJECTED, STALE and NOT_FOUND apart.  Written once against a
:class:`~sqlalchemy.orm.Session`; given an AsyncSession every call returns
an awaitable (:mod:`stateguard._async`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, TypedDict
from uuid import UUID

from sqlalchemy import Connection, Update
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Session

from .. import _kernel
from .._async import dual_method
from ..exceptions import InvalidArgument
from ..result import Outcome, Result
from . import bulk, compile, events, history

if TYPE_CHECKING:
    from .declaration import StateMachine, _Edge

__all__ = ["FireOptions", "Trigger"]

#: How often a call re-runs its UPDATE after a concurrent commit made the row eligible.
_RACE_RETRIES: Final = 3


class FireOptions(TypedDict, total=False):
    """The keyword options of a trigger call, for calls that pass them on (``StateMachine.fire``)."""

    values: Mapping[str, Any] | None
    expected_version: int | None
    fence: int | None
    request_id: str | UUID | None
    metadata: Mapping[str, Any] | None


class Trigger:
    """A trigger of a bound :class:`StateMachine`: ``Order.flow.pay``.

    Calling it runs the transition; :meth:`statement` shows the SQL.
    """

    def __init__(self, machine: StateMachine[Any], name: str, edges: list[_Edge]) -> None:
        self.machine = machine
        self.name = name
        self.edges = edges
        self.sources = tuple(dict.fromkeys(s for e in edges for s in e.sources))
        self.dests = tuple(dict.fromkeys(e.dest for e in edges))
        self._callbacks = any(e.after_commit for e in edges)
        #: The outbox topic of this trigger's events, or ``None`` (set when the machine is bound).
        self.topic: str | None = None
        #: No history, no events, one destination (set when the machine is bound): a call on a
        #: scalar key with no options takes :meth:`_attempt_simple`.
        self._simple = False
        #: :meth:`_attempt_simple`'s statement per Backend (interned: a handful at most).
        self._simple_plans: dict[_kernel.Backend, compile.Plan] = {}

    def __repr__(self) -> str:
        model = self.machine.model.__name__ if self.machine.model is not None else "?"
        return f"<Trigger {model}.{self.machine.name}.{self.name}>"

    # -- building -----------------------------------------------------------

    def _prepare(
        self,
        session: Session | None,
        target: Any,
        values: Mapping[str, Any] | None,
        expected_version: int | None,
        fence: int | None = None,
    ) -> tuple[_kernel.ModelInfo, tuple[Any, ...], Any, compile.Items, bool]:
        m = self.machine
        info = m.info
        key, instance = _kernel.resolve_target(session, info, target)
        if values:
            items, has_sql = _kernel.split_values(info, values, forbidden=m._forbidden)
        else:
            items, has_sql = (), False
        if expected_version is not None:
            if info.version_column is None:
                raise InvalidArgument(
                    f"{info.model.__name__} has no version column, so expected_version "
                    f"cannot be checked; declare one with version_column()"
                )
            if type(expected_version) is not int:
                raise InvalidArgument(f"expected_version must be an int, got {expected_version!r}")
        if fence is not None:
            _kernel.check_fence(info, fence)
        return info, key, instance, items, has_sql

    def statement(
        self,
        target: Any,
        *,
        values: Mapping[str, Any] | None = None,
        expected_version: int | None = None,
        fence: int | None = None,
        dialect: Dialect | None = None,
    ) -> Update:
        """The ``UPDATE`` this trigger runs for ``target``, with its parameters bound.

        Without ``dialect`` it is the portable statement; with one it is exactly
        what runs there (``RETURNING`` on PostgreSQL/SQLite, ``LAST_INSERT_ID``
        on MySQL/MariaDB)::

            print(Order.flow.pay.statement(42))
            # UPDATE orders SET version=(orders.version + :version_1), status=:param_1
            # WHERE orders.id = :sg_pk0 AND orders.status IN (__[POSTCOMPILE_status_1])
        """
        info, key, _, items, _ = self._prepare(None, target, values, expected_version, fence)
        backend = _kernel.backend(dialect) if dialect is not None else None
        params: dict[str, Any] = info.key_params(key)
        params["sg_expected"] = expected_version
        params["sg_fence"] = fence
        return compile.build(
            self,
            backend,
            items,
            expected_version is not None,
            embed=True,
            bound=params,
            fence=fence is not None,
        ).stmt

    # -- running ------------------------------------------------------------

    def _fire(
        self,
        session: Session,
        target: Any,
        *,
        values: Mapping[str, Any] | None = None,
        expected_version: int | None = None,
        fence: int | None = None,
        request_id: str | UUID | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Result:
        """Fire the trigger on ``target`` (a primary key or a loaded instance).

        One UPDATE when it applies, one more read when it does not::

            r = Order.flow.pay(session, 42, values={"paid_at": func.now()})
            r.outcome   # APPLIED, REPEATED, REJECTED, STALE or NOT_FOUND

        When the read finds the row in a state an unguarded edge of this
        trigger leaves from (a transaction committed between the UPDATE and
        the read, possible at READ COMMITTED), the UPDATE runs again, at most
        three times, rather than report a rejection the row contradicts.

        ``expected_version`` adds an optimistic version check (a mismatch is
        STALE).  ``fence`` (a fencing token, e.g. from :class:`RedisLock`)
        needs a :func:`fence_column` on the model: the row's fence must not be
        newer than ``fence`` (else STALE), and the row records ``fence``.

        On a machine declared with ``history=True``, ``request_id`` and
        ``metadata`` go into the transition log; a ``request_id`` that already
        applied this trigger to this row makes the call REPEATED even after
        the row moved on (see :mod:`stateguard.machine.history`).  A trigger
        with events (``events=True`` or ``"event"``) writes one outbox event
        when the call is APPLIED, carrying ``request_id`` and ``metadata``
        (see :mod:`stateguard.machine.events`).

        Given an :class:`~sqlalchemy.ext.asyncio.AsyncSession`, returns a
        coroutine: ``r = await Order.flow.pay(session, 42)``.
        """
        # new_request_id()'s UUID is stored as its canonical text.
        rid = str(request_id) if request_id is not None and isinstance(request_id, UUID) else request_id
        if (
            self._simple
            and type(target) is self.machine._fast_key
            and values is None
            and expected_version is None
            and fence is None
            and rid is None
            and metadata is None
        ):
            result = self._attempt_simple(session, target)
        else:
            result = self._attempt(session, target, values, expected_version, fence, rid, metadata)
        raced = 0
        while result.outcome is Outcome.REJECTED and raced < _RACE_RETRIES and self._allows(result.state):
            # At READ COMMITTED (PostgreSQL) the follow-up read takes a newer
            # snapshot than the UPDATE did: a transaction that committed in
            # between moved the row into a state this trigger leaves from, so
            # "rejected" would be false news.  Run the UPDATE again.
            raced += 1
            result = self._attempt(session, target, values, expected_version, fence, rid, metadata)
        return result

    __call__ = dual_method(_fire, operation="trigger")
    many = dual_method(bulk.fire_many, operation="many")
    where = dual_method(bulk.fire_where, operation="where")

    def _attempt_simple(self, session: Session, value: Any) -> Result:
        """:meth:`_attempt` for the most frequent call, written out: a scalar primary key of exactly
        the column's type, no options, on a trigger with one destination, no history and no events."""
        m = self.machine
        info = m._info
        if info is None:  # never: the key's type is known only once the model info is
            info = m.info
        conn, backend = _kernel.connection_for_key(session, info, value)
        plan = self._simple_plans.get(backend)
        if plan is None:
            plan = self._simple_plans[backend] = compile.plan(self, backend, (), False, False, False)
        applied, row = _kernel.run_guarded(
            conn,
            plan.stmt,
            {"sg_pk0": value},
            returning=plan.returning,
            last_insert_id=plan.uses_last_insert_id,
        )
        key = (value,)
        if not applied:
            return self._classify(session, conn, backend, info, key, None, None)
        # RETURNING (version,), or MySQL's (LAST_INSERT_ID,): the new version.
        version = row[0] if row is not None and info.version_column is not None else None
        state = self.dests[0]
        if self._callbacks:
            out = self._applied(session, key, state, version)
        else:
            out = Result(
                Outcome.APPLIED,
                model=info.model,
                key=value,
                trigger=self.name,
                state=state,
                version=version,
                session=session,
            )
        instance = _kernel.identity_instance(session, info, key)
        if instance is not None:
            self._sync_applied(session, info, key, instance, (), m.codec.to_db(state), version, None)
        return out

    def _attempt(
        self,
        session: Session,
        target: Any,
        values: Mapping[str, Any] | None,
        expected_version: int | None,
        fence: int | None,
        request_id: str | None,
        metadata: Mapping[str, Any] | None,
    ) -> Result:
        """One UPDATE, and the read that classifies it when it matched nothing."""
        m = self.machine
        if values is None and expected_version is None and fence is None and type(target) is m._fast_key:
            # The common call, a scalar primary key and nothing else: skip the
            # general validation (the key's type is exactly the column's).
            info, key, instance, has_sql = m.info, (target,), None, False
            items: compile.Items = ()
        else:
            info, key, instance, items, has_sql = self._prepare(
                session, target, values, expected_version, fence
            )
        integers: list[tuple[Any, Any, str]] | tuple[()] = ()
        if items or expected_version is not None or fence is not None:
            integers = _kernel.value_integers(items)
            if expected_version is not None and info.version_column is not None:
                integers.append((info.version_column, expected_version, "expected_version"))
            if fence is not None and info.fence_column is not None:
                integers.append((info.fence_column, fence, "fence"))
        topic = self.topic
        if m.history_enabled or topic is not None:
            # Before the connection: on SQLite connection_for takes the write lock.
            history.check_request(request_id, metadata)
        conn = _kernel.connection_for(session, info, (key,), integers)
        if info.text_key and (m.history_enabled or topic is not None):
            # The row's own spelling of a text key (MariaDB's case-insensitive collations), for
            # the log's request-id lookup and the event's key.
            key = _kernel.stored_key(conn, info, key)
        backend = _kernel.backend(conn.dialect)
        old_db_state: Any = None
        # PostgreSQL writes the event in the UPDATE's own statement (a data-modifying CTE).
        in_cte = topic is not None and backend.dml_cte
        if m.history_enabled and request_id is not None:
            logged = history.applied_by_request(conn, m, self.name, key, request_id)
            if logged is not None:
                state = m.codec.named(logged[0])
                return self._result(
                    Outcome.REPEATED, session, key, state, logged[1], expected_version, same_request=True
                )
        elif not m.history_enabled and topic is None and (request_id is not None or metadata is not None):
            raise InvalidArgument(
                f"{m._where()} keeps no history and {self.name!r} writes no events; request_id and "
                f"metadata need StateMachine(..., history=True) or events"
            )
        if len(self.sources) > 1 and (m.history_enabled or (topic is not None and not in_cte)):
            # Several possible sources: lock the row and read the real one first.
            _kernel.sqlite_write_lock(conn)
            lock = compile.lock_statement(m, backend)
            locked: Any = _kernel.execute(conn, lock, info.key_params(key)).first()
            if locked is None:
                return self._result(Outcome.NOT_FOUND, session, key, expected_version=expected_version)
            old_db_state = locked[0]
        params = info.key_params(key)
        if items:
            params.update(_kernel.value_params(items))
        if expected_version is not None:
            params["sg_expected"] = expected_version
        if fence is not None:
            params["sg_fence"] = fence
        returns_state: bool
        if in_cte:
            expected = expected_version is not None
            cte = events.cte_plan(self, backend, items, has_sql, expected, fence is not None)
            params.update(events.cte_params(self, key, request_id, history.meta_of(metadata)))
            applied, row = _kernel.run_guarded(conn, cte.stmt, params, returning=True)
            returns_state = cte.returns_state
            if row is not None and cte.returns_source:
                old_db_state, row = row[-1], row[:-1]
        else:
            plan = compile.plan(
                self, backend, items, has_sql, expected_version is not None, fence is not None
            )
            applied, row = _kernel.run_guarded(
                conn, plan.stmt, params, returning=plan.returning, last_insert_id=plan.uses_last_insert_id
            )
            returns_state = plan.returns_state
        if not applied:
            return self._classify(session, conn, backend, info, key, instance, expected_version, fence)
        version: int | None = None
        db_state: Any = None
        if row is not None:
            # RETURNING (version, [state]), or MySQL's (LAST_INSERT_ID,): the new version.
            if info.version_column is not None:
                version = row[0]
            if returns_state:
                db_state = row[-1]
        codec = m.codec
        if len(self.dests) == 1:
            state = self.dests[0]
            db_state = codec.to_db(state)
        elif db_state is None and old_db_state is not None:
            state = m.target_of(self.name, codec.from_db(old_db_state))
            db_state = codec.to_db(state)
        elif db_state is None:
            # MySQL/MariaDB cannot return the new state of a trigger with
            # several destinations: read it back.  Our UPDATE holds the row
            # lock, so this is exactly the row we wrote.
            read: Any = _kernel.execute(conn, compile.read_statement(m, backend), info.key_params(key)).one()
            db_state = read[0]
            if info.version_column is not None:
                version = read[1]
            state = codec.from_db(db_state)
        else:
            state = codec.from_db(db_state)
        if expected_version is not None and version is None:
            version = expected_version + 1
        if m.history_enabled or (topic is not None and not in_cte):
            source = self.sources[0] if old_db_state is None else codec.from_db(old_db_state)
            entry = [(key, source, state, version)]
            if m.history_enabled:
                history.record(conn, self, entry, request_id, history.meta_of(metadata))
            if topic is not None and not in_cte:
                events.record(conn, self, entry, request_id, history.meta_of(metadata))
        out = self._applied(session, key, state, version, expected_version)
        if instance is None:
            instance = _kernel.identity_instance(session, info, key)
        if instance is not None:
            self._sync_applied(session, info, key, instance, items, db_state, version, fence)
        return out

    def _sync_applied(
        self,
        session: Session,
        info: _kernel.ModelInfo,
        key: tuple[Any, ...],
        instance: Any,
        items: compile.Items,
        db_state: Any,
        version: int | None,
        fence: int | None,
    ) -> None:
        """Make the loaded ``instance`` agree with the row this trigger's UPDATE just wrote."""
        committed = {self.machine.attr: db_state}
        expire = [attr for attr, _, _ in items]
        for edge in self.edges:
            expire.extend(edge.values)
        if info.version_attr is not None:
            if version is not None:
                committed[info.version_attr] = version
            else:
                expire.append(info.version_attr)
        if fence is not None and info.fence_attr is not None:
            committed[info.fence_attr] = fence
        _kernel.sync_loaded(session, info, key, instance, committed, expire)

    def _allows(self, state: Any) -> bool:
        """Whether an unguarded edge of this trigger leaves from ``state``."""
        return any(edge.where is None and state in edge.sources for edge in self.edges)

    def _result(
        self,
        outcome: Outcome,
        session: Session,
        key: tuple[Any, ...],
        state: Any = None,
        version: int | None = None,
        expected_version: int | None = None,
        *,
        same_request: bool = False,
    ) -> Result:
        """A result of this trigger for ``key``."""
        return Result(
            outcome,
            model=self.machine.info.model,
            key=key[0] if len(key) == 1 else key,  # public_key(), written out: on every call
            trigger=self.name,
            state=state,
            version=version,
            expected_version=expected_version,
            session=session,
            same_request=same_request,
        )

    def _applied(
        self,
        session: Session,
        key: tuple[Any, ...],
        state: Any,
        version: int | None,
        expected_version: int | None = None,
    ) -> Result:
        """The APPLIED result for ``key``, with the edge's after-commit callbacks scheduled."""
        out = self._result(Outcome.APPLIED, session, key, state, version, expected_version)
        if self._callbacks:
            for edge in self.edges:
                if edge.after_commit and edge.dest == state:
                    for fn in edge.after_commit:
                        _kernel.schedule(session, fn, (out,), {})
        return out

    def _found(
        self,
        session: Session,
        key: tuple[Any, ...],
        db_state: Any,
        version: int | None,
        *,
        expected_version: int | None = None,
        fence: int | None = None,
        fence_found: Any = None,
    ) -> Result:
        """The result for a row the UPDATE did not change, found in ``db_state`` at ``version``."""
        m = self.machine
        state = m.codec.from_db(db_state)
        if state in self.dests and state not in self.sources:
            # The row is where this trigger leads and no edge of it leaves from there:
            # the change is already in the row.  A state this trigger also leaves from
            # (a self-loop such as withdraw: open -> open) proves nothing: the UPDATE
            # would have matched it, so a guard, the version or the fence refused it.
            # Only a request_id in the history can tell a repeat there (checked first).
            outcome = Outcome.REPEATED
        elif fence is not None and not _kernel.fence_allows(fence_found, fence) and state in self.sources:
            # A newer lock holder already wrote this row.
            outcome = Outcome.STALE
        elif expected_version is not None and version != expected_version and state in self.sources:
            outcome = Outcome.STALE
        else:
            outcome = Outcome.REJECTED
        return self._result(outcome, session, key, state, version, expected_version)

    def _classify(
        self,
        session: Session,
        conn: Connection,
        backend: _kernel.Backend,
        info: _kernel.ModelInfo,
        key: tuple[Any, ...],
        instance: Any,
        expected_version: int | None,
        fence: int | None = None,
    ) -> Result:
        """Read the row a 0-row UPDATE left alone and say why."""
        m = self.machine
        row: Any = _kernel.execute(conn, compile.read_statement(m, backend), info.key_params(key)).first()
        if row is None:
            return self._result(Outcome.NOT_FOUND, session, key, expected_version=expected_version)
        db_state = row[0]
        version = row[1] if info.version_column is not None else None
        found = self._found(
            session,
            key,
            db_state,
            version,
            expected_version=expected_version,
            fence=fence,
            fence_found=row[-1],
        )
        if instance is None:
            instance = _kernel.identity_instance(session, info, key)
        if instance is not None:
            committed = {m.attr: db_state}
            if info.version_attr is not None:
                committed[info.version_attr] = version
            _kernel.sync_loaded(session, info, key, instance, committed)
        return found
