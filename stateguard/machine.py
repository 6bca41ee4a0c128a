"""Declarative state machines whose transitions are one conditional UPDATE.

A :class:`StateMachine` is declared as a class attribute of a mapped class.
Each trigger compiles to::

    UPDATE t SET <values>, version = version + 1, state = :dest
    WHERE pk = :pk AND state IN (:sources) [AND <where guard>] [AND version = :expected]
          [AND (fence IS NULL OR fence <= :fence)]

and the affected-row count decides the outcome (see SCHEMES.md, scheme 1).
The graph itself is held by one ``transitions.Machine`` per declaration, used
for validation, :meth:`StateMachine.available` and diagrams; rows never get a
machine or listener of their own, so loading rows costs what it costs without
stateguard.
"""

from __future__ import annotations

import enum
import keyword
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Final, Generic, TypeVar, overload

from sqlalchemy import ColumnElement, Connection, Update, and_, case, event, or_, select, update
from sqlalchemy import Enum as SAEnum
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import InvalidRequestError
from sqlalchemy.orm import Mapper, Session
from sqlalchemy.schema import CheckConstraint, Column
from sqlalchemy.sql import visitors
from sqlalchemy.sql.elements import conv
from sqlalchemy.sql.selectable import Exists, ScalarSelect, Select
from transitions import Machine as _GraphMachine

from . import _commit, _sql, _write
from ._async import AsyncSession
from .exceptions import ConfigurationError, InvalidArgument, UnknownTrigger
from .result import Outcome, Result

__all__ = ["StateCodec", "StateMachine", "Trigger"]

S = TypeVar("S")

#: Names a trigger may not use because the machine itself needs them.
RESERVED_NAMES: Final = frozenset(
    {
        "available",
        "column",
        "edges",
        "fire",
        "graph",
        "history",
        "initial",
        "machine",
        "many",
        "model",
        "name",
        "states",
        "statement",
        "transitions",
        "triggers",
        "where",
    }
)

#: How often a call re-runs its UPDATE after a concurrent commit made the row eligible.
_RACE_RETRIES: Final = 3

_EDGE_KEYS: Final = frozenset({"trigger", "source", "dest", "where", "values", "after_commit"})
_CALLBACK_KEYS: Final = frozenset(
    {"conditions", "unless", "before", "after", "prepare", "on_enter", "on_exit"}
)


class StateCodec:
    """A machine's states and how each is stored and named: state <-> database value <-> name.

    A state is what the declaration uses (a string, or a member of the
    declared Enum); its database value is what the state column holds (the
    member itself for a SQLAlchemy ``Enum`` column of that class, the
    member's value for a plain column); its name is the string used in
    diagrams, the transition log and error messages::

        codec = Order.flow.codec
        codec.to_db("paid"), codec.from_db("paid"), codec.name("paid")
    """

    __slots__ = ("_by_name", "_from_db", "_to_db", "states")

    def __init__(self, states: Sequence[Any], to_db: Mapping[Any, Any]) -> None:
        self.states: tuple[Any, ...] = tuple(states)
        self._to_db = dict(to_db)
        self._from_db = {v: k for k, v in self._to_db.items()}
        self._by_name = {self.name(s): s for s in self.states}

    @staticmethod
    def name(state: Any) -> str:
        """The name of a state (an Enum member's name, else the string itself)."""
        return state.name if isinstance(state, enum.Enum) else str(state)

    def to_db(self, state: Any) -> Any:
        """The database value of a declared state (``KeyError`` for an undeclared one)."""
        return self._to_db[state]

    def from_db(self, value: Any) -> Any:
        """The state stored as ``value``; an undeclared value comes back unchanged."""
        return self._from_db.get(value, value)

    def named(self, name: str) -> Any:
        """The state called ``name``; an unknown name comes back unchanged."""
        return self._by_name.get(name, name)

    def declared(self, state: Any) -> bool:
        """Whether ``state`` is one of the declared states."""
        return state in self._to_db


class _Edge:
    """One declared transition entry: sources -> dest for a trigger."""

    __slots__ = ("after_commit", "dest", "sources", "values", "where")

    def __init__(
        self,
        sources: tuple[Any, ...],
        dest: Any,
        where: Callable[[Any], ColumnElement[bool]] | None,
        values: Mapping[str, Any],
        after_commit: tuple[Callable[[Result], object], ...],
    ) -> None:
        self.sources = sources
        self.dest = dest
        self.where = where
        self.values = dict(values)
        self.after_commit = after_commit


class _Plan:
    """A compiled trigger statement for one dialect and one call variant."""

    __slots__ = ("returns_state", "returns_version", "stmt", "uses_last_insert_id")

    def __init__(self, stmt: Update, returns_state: bool, returns_version: bool, lid: bool) -> None:
        self.stmt = stmt
        self.returns_state = returns_state
        self.returns_version = returns_version
        self.uses_last_insert_id = lid


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
        self._plans: dict[Any, _Plan] = {}

    def __repr__(self) -> str:
        model = self.machine.model.__name__ if self.machine.model is not None else "?"
        return f"<Trigger {model}.{self.machine.name}.{self.name}>"

    # -- building -----------------------------------------------------------

    def _parts(
        self,
        backend: _sql.Backend | None,
        items: tuple[tuple[str, Column[Any], Any], ...],
        *,
        embed: bool,
        fence: bool = False,
        bound: Mapping[str, Any] | None = None,
        last_insert_id: bool = True,
    ) -> tuple[list[tuple[Any, Any]], ColumnElement[bool], bool]:
        """The SET pairs and the state condition shared by single and bulk statements.

        Returns ``(pairs, condition, uses_last_insert_id)``.
        """
        m = self.machine
        info = m.info
        state_col = m.state_column
        model = info.model
        to_db = m._to_db
        conds: list[ColumnElement[bool]] = []
        for edge in self.edges:
            sources = [to_db[s] for s in edge.sources]
            # One source: a plain equality, whose compiled form SQLAlchemy
            # caches; IN takes an expanding parameter that is rendered again
            # at every execution (measurably slower on the hot path).
            cond: ColumnElement[bool] = (
                state_col == sources[0] if len(sources) == 1 else state_col.in_(sources)
            )
            if edge.where is not None:
                cond = and_(cond, edge.where(model))
            conds.append(cond)
        single = len(self.edges) == 1
        pairs: list[tuple[Any, Any]] = []
        # Declared per-edge values, then call-time values.  MySQL evaluates SET
        # assignments left to right with the *new* values of earlier columns,
        # so the state is assigned last: every expression sees the old state.
        declared: dict[Column[Any], list[tuple[ColumnElement[bool], Any]]] = {}
        for edge, cond in zip(self.edges, conds, strict=True):
            for attr, value in edge.values.items():
                declared.setdefault(info.column_by_attr[attr], []).append((cond, value))
        call_cols = {col for _, col, _ in items}
        for col, whens in declared.items():
            if col in call_cols:
                continue
            if single:
                pairs.append((col, whens[0][1]))
            else:
                pairs.append((col, case(*whens, else_=col)))
        pairs.extend(_sql.set_clause(items, embed=embed))
        vcol = info.version_column
        lid = False
        if vcol is not None:
            if backend is None or not last_insert_id:
                pairs.append((vcol, vcol + 1))
            else:
                pairs.append((vcol, _sql.version_increment(vcol, backend)))
                lid = backend.last_insert_id
        if fence:
            fcol = info.fence_column
            assert fcol is not None
            fence_value = None if bound is None else bound["sg_fence"]
            pairs.append((fcol, _sql.bindparam("sg_fence", fence_value, type_=fcol.type)))
        if single:
            pairs.append((state_col, to_db[self.edges[0].dest]))
        else:
            whens_state = [(c, to_db[e.dest]) for c, e in zip(conds, self.edges, strict=True)]
            pairs.append((state_col, case(*whens_state, else_=state_col)))
        return pairs, conds[0] if single else or_(*conds), lid

    def _build(
        self,
        backend: _sql.Backend | None,
        items: tuple[tuple[str, Column[Any], Any], ...],
        expected: bool,
        embed: bool,
        bound: Mapping[str, Any] | None = None,
        fence: bool = False,
    ) -> _Plan:
        m = self.machine
        info = m.info
        state_col = m.state_column
        single = len(self.edges) == 1
        vcol = info.version_column
        fcol = info.fence_column
        pairs, state_cond, lid = self._parts(backend, items, embed=embed, fence=fence, bound=bound)
        pk_where = info.pk_where if bound is None else info.bound_pk_where(bound)
        where = [pk_where, state_cond]
        if expected:
            assert vcol is not None
            expected_value = None if bound is None else bound["sg_expected"]
            where.append(vcol == _sql.bindparam("sg_expected", expected_value, type_=vcol.type))
        if fence:
            assert fcol is not None
            where.append(_sql.fence_condition(fcol, None if bound is None else bound["sg_fence"]))
        stmt = update(info.table).where(*where).ordered_values(*pairs)
        returning: list[Column[Any]] = []
        returns_state = not single
        returns_version = vcol is not None
        if backend is not None and backend.returning:
            if vcol is not None:
                returning.append(vcol)
            if returns_state:
                returning.append(state_col)
            stmt = stmt.returning(*returning)
        elif backend is not None:
            returns_state = False
            returns_version = lid
        return _Plan(stmt, returns_state, returns_version, lid)

    def _plan(
        self,
        dialect: Dialect,
        items: tuple[tuple[str, Column[Any], Any], ...],
        has_sql: bool,
        expected: bool,
        fence: bool = False,
    ) -> _Plan:
        variant = _sql.variant_key(items, has_sql) if items else ()
        if variant is None:
            return self._build(_sql.backend(dialect), items, expected, embed=False, fence=fence)
        cache_key = (dialect, variant, expected, fence)
        plan = self._plans.get(cache_key)
        if plan is None:
            plan = self._build(_sql.backend(dialect), items, expected, embed=False, fence=fence)
            if len(self._plans) < 256:
                self._plans[cache_key] = plan
        return plan

    def _prepare(
        self,
        session: Session | None,
        target: Any,
        values: Mapping[str, Any] | None,
        expected_version: int | None,
        fence: int | None = None,
    ) -> tuple[_sql.ModelInfo, tuple[Any, ...], Any, tuple[tuple[str, Column[Any], Any], ...], bool]:
        m = self.machine
        info = m.info
        key, instance = _write.resolve_target(session, info, target)
        if values:
            items, has_sql = _write.split_values(info, values, forbidden=m._forbidden)
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
            _write.check_fence(info, fence)
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
        backend = _sql.backend(dialect) if dialect is not None else None
        params: dict[str, Any] = info.key_params(key)
        params["sg_expected"] = expected_version
        params["sg_fence"] = fence
        return self._build(
            backend, items, expected_version is not None, embed=True, bound=params, fence=fence is not None
        ).stmt

    # -- running ------------------------------------------------------------

    @overload
    def __call__(
        self,
        session: Session,
        target: Any,
        *,
        values: Mapping[str, Any] | None = None,
        expected_version: int | None = None,
        fence: int | None = None,
        request_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Result: ...

    @overload
    def __call__(
        self,
        session: AsyncSession,
        target: Any,
        *,
        values: Mapping[str, Any] | None = None,
        expected_version: int | None = None,
        fence: int | None = None,
        request_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Coroutine[Any, Any, Result]: ...

    def __call__(
        self,
        session: Session | AsyncSession,
        target: Any,
        *,
        values: Mapping[str, Any] | None = None,
        expected_version: int | None = None,
        fence: int | None = None,
        request_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Result | Coroutine[Any, Any, Result]:
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
        the row moved on (see :mod:`stateguard.history`).

        Given an :class:`~sqlalchemy.ext.asyncio.AsyncSession`, returns a
        coroutine: ``r = await Order.flow.pay(session, 42)``.
        """
        if isinstance(session, AsyncSession):
            return session.run_sync(
                self._fire,
                target,
                values=values,
                expected_version=expected_version,
                fence=fence,
                request_id=request_id,
                metadata=metadata,
            )
        return self._fire(
            session,
            target,
            values=values,
            expected_version=expected_version,
            fence=fence,
            request_id=request_id,
            metadata=metadata,
        )

    def _fire(
        self,
        session: Session,
        target: Any,
        *,
        values: Mapping[str, Any] | None = None,
        expected_version: int | None = None,
        fence: int | None = None,
        request_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        _raced: int = 0,
    ) -> Result:
        m = self.machine
        if values is None and expected_version is None and fence is None and type(target) is m._fast_key:
            # The common call, a scalar primary key and nothing else: skip the
            # general validation (the key's type is exactly the column's).
            info, key, instance, has_sql = m.info, (target,), None, False
            items: tuple[tuple[str, Column[Any], Any], ...] = ()
        else:
            info, key, instance, items, has_sql = self._prepare(
                session, target, values, expected_version, fence
            )
        if session.autoflush:
            session.flush()
        conn = session.connection(bind_arguments=m._bind_args)
        old_db_state: Any = None
        if m.history_enabled:
            from . import history

            history.check_request(request_id, metadata)
            if request_id is not None:
                logged = history.applied_by_request(conn, m, self.name, key, request_id)
                if logged is not None:
                    return Result(
                        Outcome.REPEATED,
                        model=info.model,
                        key=_sql.public_key(key),
                        trigger=self.name,
                        state=m._state_named(logged[0]),
                        version=logged[1],
                        expected_version=expected_version,
                        session=session,
                    )
            if len(self.sources) > 1:
                # Several possible sources: lock the row and read the real one first.
                _write.sqlite_write_lock(conn)
                locked: Any = _write.execute(conn, m._lock_stmt(conn.dialect), info.key_params(key)).first()
                if locked is None:
                    return Result(
                        Outcome.NOT_FOUND,
                        model=info.model,
                        key=_sql.public_key(key),
                        trigger=self.name,
                        expected_version=expected_version,
                        session=session,
                    )
                old_db_state = locked[0]
        elif request_id is not None or metadata is not None:
            raise InvalidArgument(
                f"{m._where()} keeps no history; request_id and metadata need StateMachine(..., history=True)"
            )
        plan = self._plan(conn.dialect, items, has_sql, expected_version is not None, fence is not None)
        params = info.key_params(key)
        if items:
            params.update(_sql.value_params(items))
        if expected_version is not None:
            params["sg_expected"] = expected_version
        if fence is not None:
            params["sg_fence"] = fence
        result = _write.execute(conn, plan.stmt, params)
        version: int | None = None
        db_state: Any = None
        applied: bool
        if plan.returns_state or (plan.returns_version and not plan.uses_last_insert_id):
            row: Any = result.first()
            applied = row is not None
            if row is not None:
                i = 0
                if info.version_column is not None:
                    version = row[0]
                    i = 1
                if plan.returns_state:
                    db_state = row[i]
        else:
            applied = result.rowcount == 1
            if applied and plan.uses_last_insert_id:
                version = result.lastrowid
        if applied:
            if len(self.dests) == 1:
                state = self.dests[0]
                db_state = m._to_db[state]
            elif db_state is None and old_db_state is not None:
                state = m.target_of(self.name, m._from_db(old_db_state))
                db_state = m._to_db[state]
            elif db_state is None:
                # MySQL/MariaDB cannot return the new state of a trigger with
                # several destinations: read it back.  Our UPDATE holds the row
                # lock, so this is exactly the row we wrote.
                row = _write.execute(conn, m._read_stmt(conn.dialect), info.key_params(key)).one()
                db_state = row[0]
                if info.version_column is not None:
                    version = row[1]
                state = m._from_db(db_state)
            else:
                state = m._from_db(db_state)
            if expected_version is not None and version is None:
                version = expected_version + 1
            if m.history_enabled:
                from . import history

                source = self.sources[0] if old_db_state is None else m._from_db(old_db_state)
                history.record(
                    conn, self, [(key, source, state, version)], request_id, history.meta_of(metadata)
                )
            out = self._applied(session, key, state, version, expected_version)
            if instance is None:
                instance = _write.identity_instance(session, info, key)
            if instance is not None:
                committed = {m.attr: db_state}
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
                _write.sync_loaded(session, info, key, instance, committed, expire)
            return out
        found = self._classify(session, conn, info, key, instance, expected_version, fence)
        if found.outcome is Outcome.REJECTED and _raced < _RACE_RETRIES and self._allows(found.state):
            # At READ COMMITTED (PostgreSQL) the follow-up read takes a newer
            # snapshot than the UPDATE did: a transaction that committed in
            # between moved the row into a state this trigger leaves from, so
            # "rejected" would be false news.  Run the UPDATE again.
            return self._fire(
                session,
                target,
                values=values,
                expected_version=expected_version,
                fence=fence,
                request_id=request_id,
                metadata=metadata,
                _raced=_raced + 1,
            )
        return found

    def _allows(self, state: Any) -> bool:
        """Whether an unguarded edge of this trigger leaves from ``state``."""
        return any(edge.where is None and state in edge.sources for edge in self.edges)

    def _applied(
        self,
        session: Session,
        key: tuple[Any, ...],
        state: Any,
        version: int | None,
        expected_version: int | None = None,
    ) -> Result:
        """The APPLIED result for ``key``, with the edge's after-commit callbacks scheduled."""
        out = Result(
            Outcome.APPLIED,
            model=self.machine.info.model,
            key=_sql.public_key(key),
            trigger=self.name,
            state=state,
            version=version,
            expected_version=expected_version,
            session=session,
        )
        if self._callbacks:
            for edge in self.edges:
                if edge.after_commit and edge.dest == state:
                    for fn in edge.after_commit:
                        _commit.schedule(session, fn, (out,), {})
        return out

    @overload
    def many(
        self,
        session: Session,
        targets: Iterable[Any],
        *,
        values: Mapping[str, Any] | None = None,
        chunk_size: int = 1000,
        metadata: Mapping[str, Any] | None = None,
    ) -> dict[Any, Result]: ...

    @overload
    def many(
        self,
        session: AsyncSession,
        targets: Iterable[Any],
        *,
        values: Mapping[str, Any] | None = None,
        chunk_size: int = 1000,
        metadata: Mapping[str, Any] | None = None,
    ) -> Coroutine[Any, Any, dict[Any, Result]]: ...

    def many(
        self,
        session: Session | AsyncSession,
        targets: Iterable[Any],
        *,
        values: Mapping[str, Any] | None = None,
        chunk_size: int = 1000,
        metadata: Mapping[str, Any] | None = None,
    ) -> dict[Any, Result] | Coroutine[Any, Any, dict[Any, Result]]:
        """Fire the trigger on many rows with one UPDATE per chunk; a Result per key.

        Outcomes are exact per key (APPLIED / REPEATED / REJECTED / NOT_FOUND),
        also when other transactions move some of the same rows concurrently;
        see :mod:`stateguard.bulk` for the statements each backend runs::

            results = Order.flow.ship.many(session, [1, 2, 3], values={"note": "batch 7"})
            results[2].outcome
        """
        from .bulk import fire_many

        if isinstance(session, AsyncSession):
            return session.run_sync(
                lambda sync: fire_many(
                    self, sync, targets, values=values, chunk_size=chunk_size, metadata=metadata
                )
            )
        return fire_many(self, session, targets, values=values, chunk_size=chunk_size, metadata=metadata)

    @overload
    def where(
        self,
        session: Session,
        condition: ColumnElement[bool],
        *,
        limit: int | None = None,
        values: Mapping[str, Any] | None = None,
    ) -> list[Any]: ...

    @overload
    def where(
        self,
        session: AsyncSession,
        condition: ColumnElement[bool],
        *,
        limit: int | None = None,
        values: Mapping[str, Any] | None = None,
    ) -> Coroutine[Any, Any, list[Any]]: ...

    def where(
        self,
        session: Session | AsyncSession,
        condition: ColumnElement[bool],
        *,
        limit: int | None = None,
        values: Mapping[str, Any] | None = None,
    ) -> list[Any] | Coroutine[Any, Any, list[Any]]:
        """Fire the trigger on every row matching ``condition`` (a sweeper); the applied keys.

        Rows not in a source state are left alone.  With ``limit``, at most
        that many rows, in primary-key order; concurrent sweepers skip each
        other's locked rows instead of waiting::

            expired = Order.flow.cancel.where(session, Order.created_at < cutoff, limit=500)
        """
        from .bulk import fire_where

        if isinstance(session, AsyncSession):
            return session.run_sync(
                lambda sync: fire_where(self, sync, condition, limit=limit, values=values)
            )
        return fire_where(self, session, condition, limit=limit, values=values)

    def _classify(
        self,
        session: Session,
        conn: Connection,
        info: _sql.ModelInfo,
        key: tuple[Any, ...],
        instance: Any,
        expected_version: int | None,
        fence: int | None = None,
    ) -> Result:
        m = self.machine
        row: Any = _write.execute(conn, m._read_stmt(conn.dialect), info.key_params(key)).first()
        public = _sql.public_key(key)
        if row is None:
            return Result(
                Outcome.NOT_FOUND,
                model=info.model,
                key=public,
                trigger=self.name,
                expected_version=expected_version,
                session=session,
            )
        db_state = row[0]
        version = row[1] if info.version_column is not None else None
        state = m._from_db(db_state)
        if state in self.dests:
            outcome = Outcome.REPEATED
        elif fence is not None and not _sql.fence_allows(row[-1], fence) and state in self.sources:
            # A newer lock holder already wrote this row.
            outcome = Outcome.STALE
        elif expected_version is not None and version != expected_version and state in self.sources:
            outcome = Outcome.STALE
        else:
            outcome = Outcome.REJECTED
        if instance is None:
            instance = _write.identity_instance(session, info, key)
        if instance is not None:
            committed = {m.attr: db_state}
            if info.version_attr is not None:
                committed[info.version_attr] = version
            _write.sync_loaded(session, info, key, instance, committed)
        return Result(
            outcome,
            model=info.model,
            key=public,
            trigger=self.name,
            state=state,
            version=version,
            expected_version=expected_version,
            session=session,
        )


class StateMachine(Generic[S]):
    """A state graph over one column of a mapped class.

    ::

        class Order(Base):
            __tablename__ = "orders"
            id: Mapped[int] = mapped_column(primary_key=True)
            status: Mapped[str] = mapped_column(String(20), default="pending")
            version: Mapped[int] = version_column()

            flow = StateMachine(
                "status",
                states=["pending", "paid", "shipped", "cancelled"],
                transitions=[
                    {"trigger": "pay", "source": "pending", "dest": "paid"},
                    {"trigger": "ship", "source": "paid", "dest": "shipped"},
                    ["cancel", ["pending", "paid"], "cancelled"],
                ],
            )

        Order.flow.pay(session, 42)            # -> Result

    ``states`` is a list of strings or an :class:`enum.Enum` class.
    ``transitions`` uses the ``transitions`` package's format (dicts with
    ``trigger``, ``source`` -- a state, a list or ``"*"`` -- and ``dest``, or
    ``[trigger, source, dest]`` lists) plus three stateguard keys:

    ``where``
        ``lambda cls: <SQL expression over the row's own columns>``, ANDed into
        the UPDATE's WHERE: an atomic guard.  Subqueries and other tables are
        rejected, because PostgreSQL re-checks a waiting UPDATE's WHERE only
        against the target row: a guard over other rows would not be atomic.
    ``values``
        ``{attribute: value or SQL expression}`` set along with the state.
    ``after_commit``
        a callable (or list) called with the :class:`Result` after the
        outermost transaction commits, only when the call was APPLIED.

    Mistakes are :class:`ConfigurationError` at class definition.
    """

    #: The class used for triggers; subclass to extend.
    trigger_cls: ClassVar[type[Trigger]] = Trigger

    def __init__(
        self,
        column: str,
        *,
        states: Sequence[S] | type[S],
        transitions: Sequence[Mapping[str, Any] | Sequence[Any]],
        initial: S | str | None = None,
        check_constraint: bool = True,
        history: bool = False,
        legal_edges: bool = False,
    ) -> None:
        self.attr = column
        self.check_constraint = check_constraint
        self.history_enabled = history
        #: PostgreSQL only: a trigger refusing undeclared edges (see stateguard.alembic).
        self.legal_edges = legal_edges
        self.name: str = "?"
        self.model: type[Any] | None = None
        self._owner_name = "?"
        if not isinstance(column, str) or not column:
            raise ConfigurationError(f"StateMachine column must be an attribute name (str), got {column!r}")
        self._enum: type[enum.Enum] | None = None
        if isinstance(states, type) and issubclass(states, enum.Enum):
            self._enum = states
            declared: list[Any] = list(states)
        else:
            if isinstance(states, str | bytes) or not isinstance(states, Sequence):
                raise ConfigurationError(f"states must be a list of strings or an Enum class, got {states!r}")
            declared = list(states)
            for s in declared:
                if not isinstance(s, str) or not s:
                    raise ConfigurationError(f"states must be non-empty strings, got {s!r}")
        if len(set(declared)) != len(declared):
            raise ConfigurationError(f"duplicate states in {declared!r}")
        self.states: tuple[Any, ...] = tuple(declared)
        self._raw_transitions = transitions
        self._initial_arg = initial
        self.initial: Any = None
        self.triggers: dict[str, Trigger] = {}
        self._edges_by_trigger: dict[str, list[_Edge]] = {}
        self._graph: Any = None
        self._info: _sql.ModelInfo | None = None
        self.state_column: Column[Any] = None  # type: ignore[assignment]
        self._to_db: dict[Any, Any] = {}
        self._from_db_map: dict[Any, Any] = {}
        #: The state codec (set when the machine is bound to its mapped class).
        self.codec: StateCodec = StateCodec(self.states, {s: s for s in self.states})
        self._forbidden: dict[str, str] = {}
        self._bind_args: dict[str, Any] = {}
        self._reads: dict[Dialect, Any] = {}
        self._fast_key: type | None = None

    # -- declaration ----------------------------------------------------------

    def _where(self) -> str:
        return f"{self._owner_name}.{self.name}"

    @property
    def qualname(self) -> str:
        """``Model.attribute`` of this machine (``"Order.flow"``), as messages name it."""
        return self._where()

    def _state(self, value: Any, role: str, trigger: str | None = None) -> Any:
        """Resolve a declared state reference (name, value or member)."""
        if self._enum is not None:
            if isinstance(value, self._enum):
                return value
            if isinstance(value, str):
                if value in self._enum.__members__:
                    return self._enum[value]
                for member in self._enum:
                    if member.value == value:
                        return member
        elif isinstance(value, str) and value in self.states:
            return value
        where = f" of trigger {trigger!r}" if trigger else ""
        raise ConfigurationError(
            f"{self._where()}: {role}{where} {value!r} is not a declared state; "
            f"declared: {[self._name(s) for s in self.states]}"
        )

    @staticmethod
    def _name(state: Any) -> str:
        return state.name if isinstance(state, enum.Enum) else str(state)

    def __set_name__(self, owner: type[Any], name: str) -> None:
        # Validation waits for the mapper (see _bind): Python 3.11 wraps any
        # exception raised here in a RuntimeError, hiding ConfigurationError.
        self.name = name
        self._owner_name = owner.__name__

    def _declare(self) -> None:
        if self.triggers:
            return
        if not self.states:
            # Checked here rather than in __init__ so the message can name the model.
            raise ConfigurationError(f"{self._where()}: a StateMachine needs at least one state")
        initial = self._state(self._initial_arg, "initial") if self._initial_arg is not None else None
        self.initial = initial
        edges_by: dict[str, list[_Edge]] = {}
        seen: dict[tuple[str, Any], Any] = {}
        graph_transitions: list[dict[str, Any]] = []
        for raw in self._raw_transitions:
            spec = self._normalise(raw)
            trig = spec["trigger"]
            self._check_trigger_name(trig)
            src = spec["source"]
            if src == "*":
                sources = self.states
            elif isinstance(src, str | enum.Enum):
                sources = (self._state(src, "source", trig),)
            elif isinstance(src, Sequence) and src:
                sources = tuple(self._state(s, "source", trig) for s in src)
            else:
                raise ConfigurationError(f"{self._where()}: trigger {trig!r} has no source state")
            dest = self._state(spec["dest"], "dest", trig)
            for s in sources:
                other = seen.get((trig, s))
                if other is not None and other != dest:
                    raise ConfigurationError(
                        f"{self._where()}: trigger {trig!r} goes from {self._name(s)!r} to two "
                        f"different states ({self._name(other)!r} and {self._name(dest)!r}); "
                        f"a trigger must be deterministic: use two triggers"
                    )
                if other is not None:
                    raise ConfigurationError(
                        f"{self._where()}: trigger {trig!r} from {self._name(s)!r} is declared twice"
                    )
                seen[(trig, s)] = dest
            where = spec.get("where")
            if where is not None and not callable(where):
                raise ConfigurationError(
                    f"{self._where()}: 'where' of trigger {trig!r} must be a callable taking the "
                    f"mapped class and returning a SQL expression, got {where!r}"
                )
            values = spec.get("values") or {}
            if not isinstance(values, Mapping) or not all(isinstance(k, str) for k in values):
                raise ConfigurationError(
                    f"{self._where()}: 'values' of trigger {trig!r} must map attribute names to values"
                )
            cbs = spec.get("after_commit") or ()
            cbs = (cbs,) if callable(cbs) else tuple(cbs)
            for cb in cbs:
                if not callable(cb):
                    raise ConfigurationError(
                        f"{self._where()}: after_commit of trigger {trig!r} must be callables, got {cb!r}"
                    )
            edges_by.setdefault(trig, []).append(_Edge(sources, dest, where, values, cbs))
            graph_transitions.append(
                {"trigger": trig, "source": [self._name(s) for s in sources], "dest": self._name(dest)}
            )
        if not edges_by:
            raise ConfigurationError(f"{self._where()}: a StateMachine needs at least one transition")
        try:
            self._graph = _GraphMachine(
                model=None,
                states=[self._name(s) for s in self.states],
                transitions=graph_transitions,
                initial=self._name(initial if initial is not None else self.states[0]),
                auto_transitions=False,
            )
        except (ValueError, AttributeError, TypeError) as error:  # pragma: no cover - validated above
            raise ConfigurationError(f"{self._where()}: {error}") from error
        self._edges_by_trigger = edges_by
        for trig, edges in edges_by.items():
            trigger = self.trigger_cls(self, trig, edges)
            self.triggers[trig] = trigger
            setattr(self, trig, trigger)

    def _normalise(self, raw: Mapping[str, Any] | Sequence[Any]) -> dict[str, Any]:
        if isinstance(raw, Mapping):
            unknown = set(raw) - _EDGE_KEYS
            if unknown & _CALLBACK_KEYS:
                raise ConfigurationError(
                    f"{self._where()}: trigger {raw.get('trigger')!r}: "
                    f"{sorted(unknown & _CALLBACK_KEYS)} callbacks are not supported: "
                    f"they would run in Python before the database decides, also for the "
                    f"losers of a race; use 'where' for guards and 'after_commit' for side effects"
                )
            if unknown:
                raise ConfigurationError(f"{self._where()}: unknown transition keys {sorted(unknown)}")
            missing = {"trigger", "source", "dest"} - set(raw)
            if missing:
                raise ConfigurationError(f"{self._where()}: transition {dict(raw)!r} lacks {sorted(missing)}")
            return dict(raw)
        if isinstance(raw, Sequence) and not isinstance(raw, str) and len(raw) == 3:
            return {"trigger": raw[0], "source": raw[1], "dest": raw[2]}
        raise ConfigurationError(
            f"{self._where()}: a transition is a dict or a [trigger, source, dest] list, got {raw!r}"
        )

    def _check_trigger_name(self, trig: Any) -> None:
        if not isinstance(trig, str) or not trig.isidentifier() or keyword.iskeyword(trig):
            raise ConfigurationError(f"{self._where()}: trigger name {trig!r} is not a Python identifier")
        if trig.startswith("_") or trig in RESERVED_NAMES or hasattr(StateMachine, trig):
            raise ConfigurationError(
                f"{self._where()}: trigger name {trig!r} clashes with the machine's own "
                f"attributes; rename the trigger"
            )

    def _bind(self, mapper: Mapper[Any], cls: type[Any]) -> None:
        """Attach to the mapped class and validate the whole declaration."""
        self.model = cls
        self._owner_name = cls.__name__
        self._declare()
        try:
            prop = mapper.get_property(self.attr, _configure_mappers=False)
        except InvalidRequestError:
            prop = None
        columns = getattr(prop, "columns", None)
        if not columns or not isinstance(columns[0], Column) or columns[0].table is not mapper.local_table:
            raise ConfigurationError(
                f"{self._where()}: {self.attr!r} is not a mapped column of {cls.__name__}'s table"
            )
        col: Column[Any] = columns[0]
        self.state_column = col
        if self._enum is not None and isinstance(col.type, SAEnum) and col.type.enum_class is not None:
            if col.type.enum_class is not self._enum:
                raise ConfigurationError(
                    f"{self._where()}: column {col.name!r} is an Enum of {col.type.enum_class.__name__}, "
                    f"but the machine declares states of {self._enum.__name__}"
                )
            self._to_db = {s: s for s in self.states}
        elif self._enum is not None:
            self._to_db = {s: s.value for s in self.states}
        else:
            self._to_db = {s: s for s in self.states}
        self._from_db_map = {v: k for k, v in self._to_db.items()}
        self.codec = StateCodec(self.states, self._to_db)
        for trig, edges in self._edges_by_trigger.items():
            for edge in edges:
                for attr in edge.values:
                    vprop = mapper._props.get(attr)
                    if vprop is None or not getattr(vprop, "columns", None):
                        raise ConfigurationError(
                            f"{self._where()}: values of trigger {trig!r} name unknown column {attr!r}"
                        )
                    if attr == self.attr:
                        raise ConfigurationError(
                            f"{self._where()}: values of trigger {trig!r} set the state column"
                        )
                if edge.where is not None:
                    _check_guard(self, trig, edge.where(cls), mapper)
        self._bind_args = {"mapper": mapper}
        if self.check_constraint:
            self._add_check_constraint(mapper, col)

    def check_constraint_name(self) -> str:
        """``ck_<table>_<column>_states``: the name of the CHECK constraint on the state column."""
        return f"ck_{self.state_column.table.name}_{self.state_column.name}_states"

    def _add_check_constraint(self, mapper: Mapper[Any], col: Column[Any]) -> None:
        # The database refuses an undeclared state even from raw SQL.  conv()
        # keeps a metadata naming convention from renaming the constraint, so
        # the alembic comparator (stateguard.alembic) can find it by name.
        table = mapper.local_table
        name = self.check_constraint_name()
        for existing in getattr(table, "constraints", ()):
            if isinstance(existing, CheckConstraint) and existing.name == name:
                return
        values = [self._to_db[s] for s in self.states]
        table.append_constraint(  # type: ignore[attr-defined]
            CheckConstraint(col.in_(values), name=conv(name), info={_sql.INFO_KEY: "states"})
        )

    @property
    def info(self) -> _sql.ModelInfo:
        info = self._info
        if info is None:
            if self.model is None:
                raise ConfigurationError(
                    f"StateMachine {self._where()} is not attached to a mapped class; declare it "
                    f"as a class attribute of a mapped (declarative) class"
                )
            info = _sql.model_info(self.model)
            forbidden = {self.attr: f"it is the state column; fire a trigger of {self.name} instead"}
            if info.version_attr is not None:
                forbidden[info.version_attr] = "it is the version column; stateguard increments it"
            if info.fence_attr is not None:
                forbidden[info.fence_attr] = "it is the fence column; pass fence= instead"
            self._forbidden = forbidden
            checks = info.pk_checks
            # A scalar key of exactly this type needs no further validation.
            self._fast_key = checks[0] if len(checks) == 1 and checks[0] in (int, str) else None
            self._info = info
        return info

    def _from_db(self, value: Any) -> Any:
        return self._from_db_map.get(value, value)

    def _state_named(self, name: str) -> Any:
        for s in self.states:
            if self._name(s) == name:
                return s
        return name

    def _lock_stmt(self, dialect: Dialect) -> Any:
        """``SELECT state, version ... FOR UPDATE`` (plain on SQLite, which has one writer)."""
        key = ("lock", dialect)
        stmt = self._reads.get(key)  # type: ignore[call-overload]
        if stmt is None:
            info = self.info
            cols = [self.state_column]
            if info.version_column is not None:
                cols.append(info.version_column)
            stmt = select(*cols).where(info.pk_where)
            if dialect.name != "sqlite":
                stmt = stmt.with_for_update()
            self._reads[key] = stmt  # type: ignore[index]
        return stmt

    def _read_stmt(self, dialect: Dialect) -> Any:
        stmt = self._reads.get(dialect)
        if stmt is None:
            info = self.info
            cols = [self.state_column]
            if info.version_column is not None:
                cols.append(info.version_column)
            if info.fence_column is not None:
                cols.append(info.fence_column)
            stmt = self._reads[dialect] = _write.read_back(info, cols, _sql.backend(dialect))
        return stmt

    # -- public API -----------------------------------------------------------

    @overload
    def __get__(self, instance: None, owner: type[Any]) -> StateMachine[S]: ...
    @overload
    def __get__(self, instance: object, owner: type[Any]) -> StateMachine[S]: ...
    def __get__(self, instance: object | None, owner: type[Any]) -> StateMachine[S]:
        return self

    def __getattr__(self, name: str) -> Trigger:
        # Only reached for names that are not triggers (those are attributes).
        if name.startswith("__"):
            raise AttributeError(name)
        triggers = self.__dict__.get("triggers") or {}
        raise UnknownTrigger(
            f"{self.__dict__.get('_owner_name', '?')}.{self.__dict__.get('name', '?')} has no trigger "
            f"{name!r}; declared: {sorted(triggers)}"
        )

    def trigger(self, name: str) -> Trigger:
        """The :class:`Trigger` called ``name`` (``UnknownTrigger`` if there is none)."""
        found = self.triggers.get(name) if isinstance(name, str) else None
        if found is None:
            raise UnknownTrigger(
                f"{self._where()} has no trigger {name!r}; declared: {sorted(self.triggers)}"
            )
        return found

    @overload
    def fire(
        self,
        session: Session,
        trigger: str,
        target: Any,
        *,
        values: Mapping[str, Any] | None = None,
        expected_version: int | None = None,
        fence: int | None = None,
        request_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Result: ...

    @overload
    def fire(
        self,
        session: AsyncSession,
        trigger: str,
        target: Any,
        *,
        values: Mapping[str, Any] | None = None,
        expected_version: int | None = None,
        fence: int | None = None,
        request_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Coroutine[Any, Any, Result]: ...

    def fire(
        self,
        session: Session | AsyncSession,
        trigger: str,
        target: Any,
        *,
        values: Mapping[str, Any] | None = None,
        expected_version: int | None = None,
        fence: int | None = None,
        request_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Result | Coroutine[Any, Any, Result]:
        """Fire the trigger named ``trigger``: ``Order.flow.fire(session, "pay", 42)``.

        Awaited when given an AsyncSession, like the trigger itself.
        """
        return self.trigger(trigger)(
            session,
            target,
            values=values,
            expected_version=expected_version,
            fence=fence,
            request_id=request_id,
            metadata=metadata,
        )

    @overload
    def history(self, session: Session, target: Any) -> list[Any]: ...

    @overload
    def history(self, session: AsyncSession, target: Any) -> Coroutine[Any, Any, list[Any]]: ...

    def history(
        self, session: Session | AsyncSession, target: Any
    ) -> list[Any] | Coroutine[Any, Any, list[Any]]:
        """The logged transitions of one row, oldest first (needs ``history=True``).

        Each entry is a :class:`~stateguard.history.HistoryEntry`
        ``(trigger, source, dest, at, request_id, metadata, version)``::

            Order.flow.pay(session, 42, request_id="req-7f3a", metadata={"by": "user:12"})
            [e.trigger for e in Order.flow.history(session, 42)]   # ['pay']
        """
        if not self.history_enabled:
            raise InvalidArgument(f"{self._where()} keeps no history; declare it with history=True")
        from . import history

        if isinstance(session, AsyncSession):
            return session.run_sync(lambda sync: list(history.history(sync, self, target)))
        return list(history.history(session, self, target))

    def available(self, obj: Any) -> list[str]:
        """Trigger names the graph allows from a loaded object's current state.

        ``where`` guards are not evaluated (they are SQL, checked by the
        database when the trigger fires)::

            Order.flow.available(order)   # ['pay', 'cancel']
        """
        if self.model is not None and not isinstance(obj, self.model):
            raise InvalidArgument(f"expected a {self.model.__name__} instance, got {type(obj).__name__}")
        state = self._from_db(getattr(obj, self.attr))
        if state not in self._to_db:
            return []
        return sorted(self._graph.get_triggers(self._name(state)))

    def can(self, trigger: str, state: Any) -> bool:
        """Whether the graph has an edge for ``trigger`` out of ``state``."""
        t = self.trigger(trigger)
        return self._state(state, "state") in t.sources

    def target_of(self, trigger: str, state: Any) -> Any:
        """The state ``trigger`` leads to from ``state``, or ``None`` if it is not allowed."""
        t = self.trigger(trigger)
        s = self._state(state, "state")
        for edge in t.edges:
            if s in edge.sources:
                return edge.dest
        return None

    @property
    def graph(self) -> Any:
        """The ``transitions.Machine`` built from this declaration (one per class)."""
        return self._graph

    def __repr__(self) -> str:
        return f"<StateMachine {self._where()} on {self.attr!r}: {len(self.triggers)} triggers>"


def _check_guard(machine: StateMachine[Any], trigger: str, expr: Any, mapper: Mapper[Any]) -> None:
    if not isinstance(expr, ColumnElement):
        raise ConfigurationError(
            f"{machine._where()}: 'where' of trigger {trigger!r} must return a SQL expression, got {expr!r}"
        )
    table = mapper.local_table
    for node in visitors.iterate(expr):
        if isinstance(node, Select | ScalarSelect | Exists):
            raise ConfigurationError(
                f"{machine._where()}: 'where' of trigger {trigger!r} contains a subquery; a guard "
                f"must only use the row's own columns, because PostgreSQL re-checks a waiting "
                f"UPDATE's WHERE against the target row only, so a guard over other rows is not atomic"
            )
        if isinstance(node, Column) and node.table is not table:
            raise ConfigurationError(
                f"{machine._where()}: 'where' of trigger {trigger!r} uses {node.table.name}.{node.name}; "
                f"a guard must only use columns of {table.name}"  # type: ignore[attr-defined]
            )


def machines_of(cls: type[Any]) -> list[StateMachine[Any]]:
    """Every StateMachine declared on ``cls`` (including inherited ones)."""
    found: list[StateMachine[Any]] = []
    for klass in cls.__mro__:
        for value in vars(klass).values():
            if isinstance(value, StateMachine) and value not in found:
                found.append(value)
    return found


@event.listens_for(Mapper, "after_mapper_constructed")
def _on_mapper(mapper: Mapper[Any], cls: type[Any]) -> None:
    for klass in cls.__mro__:
        for name, value in list(vars(klass).items()):
            if not isinstance(value, StateMachine):
                continue
            if value.model is None:
                value._bind(mapper, cls)
            elif value.model is not cls and not issubclass(cls, value.model):
                # Declared on a mixin used by several models: each gets its own copy.
                copy: StateMachine[Any] = StateMachine(
                    value.attr,
                    states=value._enum if value._enum is not None else list(value.states),
                    transitions=value._raw_transitions,
                    initial=value._initial_arg,
                    check_constraint=value.check_constraint,
                    history=value.history_enabled,
                    legal_edges=value.legal_edges,
                )
                copy.__set_name__(cls, name)
                type.__setattr__(cls, name, copy)
                copy._bind(mapper, cls)


def iter_triggers(machines: Iterable[StateMachine[Any]]) -> Iterable[Trigger]:
    for m in machines:
        yield from m.triggers.values()
