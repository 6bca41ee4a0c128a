"""Hypothesis fuzz of the public API with hostile input: wrong types, huge and unicode keys, SQL
metacharacters.  Every call ends in a result or a typed StateguardError, never a raw driver error,
and rejected input leaves the database unchanged.  Strings reach the database as bound parameters."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, func, select
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import (
    InvalidArgument,
    Outcome,
    StateguardError,
    consume_once,
    consume_token,
    decrement,
    idempotent,
    insert_once,
)
from stateguard._kernel import backend as backend_of
from stateguard.idempotency.statements import CLAIM as _CLAIM
from stateguard.tables import consumed_messages, idempotency_keys
from tests._support.models import Base, Order, Shipment
from tests.conftest import Backend

SQL_META = ["'", '"', ";", "--", "/*", "*/", "\\", "%", "%s", "?", ":name", "`", "\x00", "DROP TABLE orders;"]
hostile_text = st.one_of(
    st.text(max_size=40),
    st.text(min_size=250, max_size=400),
    st.sampled_from(SQL_META).flatmap(lambda m: st.text(max_size=10).map(lambda t: t + m + t)),
    st.sampled_from(["", " ", "\t", "ordér-ß", "🙂" * 100, "a" * 255, "a" * 256]),
)
hostile_any = st.one_of(
    hostile_text,
    st.integers(),
    st.floats(allow_nan=True),
    st.none(),
    st.booleans(),
    st.lists(st.integers(), max_size=3),
    st.binary(max_size=10),
)


class _StockBase(DeclarativeBase):
    pass


class Stock(_StockBase):
    """A guarded counter for the fuzz."""

    __tablename__ = "fuzz_stock"
    id: Mapped[int] = mapped_column(primary_key=True)
    amount: Mapped[int]


FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _seed(s: Session) -> None:
    s.add(Order(id=1))
    s.add(Stock(id=1, amount=5))


pytestmark = pytest.mark.tables(Base.metadata, _StockBase.metadata, seed=_seed)


def _snapshot(engine: Engine) -> tuple[Any, ...]:
    with engine.connect() as conn:
        return (
            tuple(conn.execute(select(Order.id, Order.status, Order.version)).all()),
            tuple(conn.execute(select(Stock.id, Stock.amount)).all()),
            conn.execute(select(func.count()).select_from(idempotency_keys)).scalar_one(),
            conn.execute(select(func.count()).select_from(consumed_messages)).scalar_one(),
        )


def _call(fn: Any) -> Any:
    """Run fn; a typed error is fine, anything else (a raw driver error) fails the test."""
    try:
        return fn()
    except StateguardError as error:
        return error


@pytest.mark.hostile
@FUZZ
@given(name=hostile_any, key=hostile_any)
# Regression: integer keys beyond the INTEGER column raised DataError on
# PostgreSQL (aborting the transaction) and OverflowError on SQLite.
@example(name="pay", key=2**63)
@example(name="pay", key=2**31)
@example(name="pay", key=-(2**63) - 1)
@example(name=0, key=2**63)
def test_triggers_and_counters_answer_hostile_input_with_typed_errors(
    engine: Engine, name: Any, key: Any
) -> None:
    """fire() with any trigger name and any key, decrement with any key: a Result or a typed error."""
    before = _snapshot(engine)
    with Session(engine) as s:
        fired = _call(lambda: Order.flow.fire(s, name, key))
        taken = _call(lambda: decrement(s, Stock.amount, key, by=1))
        s.rollback()
    for out in (fired, taken):
        assert isinstance(out, StateguardError) or out.outcome in set(Outcome), out
    assert _snapshot(engine) == before


@pytest.mark.hostile
@FUZZ
@given(scope=hostile_any, key=hostile_any, message=hostile_any)
def test_keys_answer_hostile_input_with_typed_errors_and_store_valid_keys_exactly(
    engine: Engine, scope: Any, key: Any, message: Any
) -> None:
    """idempotent, consume_once, consume_token take any input: typed errors, nothing kept for bad input."""
    before = _snapshot(engine)
    with Session(engine) as s:
        claimed = _call(lambda: idempotent(s, scope=scope, key=key).__enter__())
        consumed = _call(lambda: consume_once(s, "fuzz", message))
        token = _call(lambda: consume_token(s, message, scope="fuzz"))
        stored = s.execute(select(idempotency_keys.c.scope, idempotency_keys.c.idem_key)).all()
        s.rollback()
    assert _snapshot(engine) == before
    if isinstance(claimed, InvalidArgument):
        assert stored == []
    else:
        assert not isinstance(claimed, StateguardError), claimed
        assert stored == [(scope, key)]
    assert isinstance(consumed, InvalidArgument) or consumed.outcome is Outcome.APPLIED
    assert isinstance(token, InvalidArgument) or token.outcome is Outcome.NOT_FOUND


@pytest.mark.hostile
@FUZZ
@given(values=st.dictionaries(hostile_text, hostile_any, max_size=3))
def test_insert_once_with_hostile_values(engine: Engine, values: dict[str, Any]) -> None:
    """insert_once with unknown attributes or wrong types raises a typed error and writes nothing."""
    before = _snapshot(engine)
    with Session(engine) as s:
        out = _call(lambda: insert_once(s, Order, values))
        s.rollback()
    assert isinstance(out, InvalidArgument) or out.outcome in set(Outcome)
    assert _snapshot(engine) == before


MARKER = "x'); DROP TABLE orders; --ß"


@pytest.mark.hostile
@pytest.mark.parametrize("dialect", [postgresql.dialect(), mysql.dialect(), sqlite.dialect()], ids=str)
def test_keys_and_states_reach_the_database_as_bound_parameters(dialect: Any) -> None:
    """Compiled statements carry keys, states and values as parameters, never in the SQL text."""
    stmt = Shipment.flow.deliver.statement((MARKER, 7), dialect=dialect)
    compiled = stmt.compile(dialect=dialect)
    assert (
        MARKER not in str(compiled) and "'sent'" not in str(compiled) and "'delivered'" not in str(compiled)
    )
    params = compiled.construct_params()
    assert MARKER in params.values() and "sent" in params.values() and "delivered" in params.values()
    noted = Order.flow.pay.statement(1, values={"note": MARKER}, dialect=dialect).compile(dialect=dialect)
    assert MARKER not in str(noted) and MARKER in noted.construct_params().values()
    claim = _CLAIM.statement(backend_of(dialect))  # the idempotency claim, as sent
    claimed = claim.compile(dialect=dialect)
    assert set(claimed.params) >= {"sg_scope", "sg_key", "sg_fp", "sg_owner"}


@pytest.mark.hostile
def test_hostile_keys_round_trip_through_idempotent(backend: Backend, engine: Engine) -> None:
    """A key full of SQL metacharacters is claimed, replayed and stored byte-exact on every backend."""
    for key in (MARKER, "%s%(x)s?:k", "a" * 255):
        with Session(engine) as s, s.begin(), idempotent(s, scope="fuzz", key=key) as call:
            assert not call.replayed
            call.complete(key)
        with Session(engine) as s, s.begin(), idempotent(s, scope="fuzz", key=key) as call:
            assert call.replayed and call.response == key
    assert (
        _call(lambda: idempotent(Session(engine), scope="fuzz", key="a" * 256)).__class__ is InvalidArgument
    )
