"""Expected versions and version values at the column's limits: a version at the integer maximum is
a typed error, odd expected versions are InvalidArgument and leave the transaction usable, and a
wrong expected version in range is STALE carrying the real version."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Engine, insert
from sqlalchemy.orm import Session

from stateguard import (
    ConfigurationError,
    InvalidArgument,
    Outcome,
    StaleVersion,
    guarded_update,
)
from tests._support.version_docs import DOC_TABLES, Doc, _row
from tests.conftest import Backend, capable

pytestmark = DOC_TABLES


# -- version at the limit, odd expected versions ------------------------------------------------


def _overflow(backend: Backend, engine: Engine, write: Callable[[Session, int], Any]) -> None:
    """``write`` on a row at version 2**31 - 1: the next version does not fit INTEGER.

    PostgreSQL and MariaDB refuse it, and stateguard says so with a ConfigurationError naming the
    version column and BigInteger; the row is unchanged.  MariaDB's transaction goes on;
    PostgreSQL's is aborted (the message says to roll back).  SQLite's INTEGER holds 64 bits, so
    there the write applies (the README says to widen the column before that matters).

    Regression: the raw DataError of the driver came through.
    """
    top = 2**31 - 1
    with engine.begin() as conn:
        conn.execute(insert(Doc).values(id=9, status="draft", version=top, hits=0))
    with Session(engine) as s:
        if not capable(backend, "int32_integer"):
            assert write(s, 9).applied
            s.rollback()
        else:
            with pytest.raises(ConfigurationError, match="BigInteger") as caught:
                write(s, 9)
            assert "version column" in str(caught.value) and "Roll the transaction back" in str(caught.value)
            if capable(backend, "error_aborts_transaction"):
                s.rollback()
            assert guarded_update(s, Doc, 1, {"title": "still"}, expected_version=1).applied
            s.commit()
            assert _row(engine, 1)[1] == "still"
    assert _row(engine, 9)[0::3] == ("draft", top)


@pytest.mark.limits
def test_a_version_at_the_integer_maximum_is_a_typed_error(engine: Engine, backend: Backend) -> None:
    """guarded_update on a row whose version is at INTEGER's maximum (see _overflow)."""
    _overflow(
        backend,
        engine,
        lambda s, key: guarded_update(s, Doc, key, {"title": "x"}, expected_version=2**31 - 1),
    )


@pytest.mark.limits
def test_a_trigger_on_a_row_at_the_integer_maximum_version_is_typed(engine: Engine, backend: Backend) -> None:
    """The same through a trigger (version = version + 1 in the trigger's UPDATE)."""
    _overflow(backend, engine, lambda s, key: Doc.flow.publish(s, key))


@pytest.mark.hostile
@pytest.mark.parametrize("expected", [True, 1.0, Decimal(1), "1", None, 2**31, -(2**31) - 1, 2**63])
def test_odd_expected_versions_are_invalid_and_leave_the_transaction_usable(
    engine: Engine, expected: Any
) -> None:
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            guarded_update(s, Doc, 1, {"title": "x"}, expected_version=expected)
        assert guarded_update(s, Doc, 1, {"title": "ok"}, expected_version=1).applied
    assert _row(engine, 1)[1::2] == ("ok", 2)


@pytest.mark.hostile
@pytest.mark.parametrize("expected", [-1, 0, -(2**31), 2**31 - 1])
def test_in_range_wrong_expected_versions_are_stale_with_the_real_version(
    engine: Engine, expected: int
) -> None:
    with Session(engine) as s, s.begin():
        r = guarded_update(s, Doc, 1, {"title": "x"}, expected_version=expected)
        assert (r.outcome, r.version, r.expected_version) == (Outcome.STALE, 1, expected)
        with pytest.raises(StaleVersion):
            r.raise_for_outcome()
    assert _row(engine, 1)[1::2] == ("orig", 1)
