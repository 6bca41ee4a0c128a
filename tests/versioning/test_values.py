"""``values=`` of guarded updates: hostile values write nothing and the transaction goes on, more
decimals than the scale are invalid, SQL text is bound not run, and exact limits are accepted."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Engine, func
from sqlalchemy.orm import Session

from stateguard import (
    InvalidArgument,
    guarded_update,
)
from tests._support.version_docs import DOC_TABLES, Doc, _row

pytestmark = DOC_TABLES


# -- hostile values= -------------------------------------------------------------------------------


@pytest.mark.hostile
@pytest.mark.parametrize(
    "values",
    [
        {"title": "123456789"},
        {"title": "ab\x00cd"},
        {"title": "\ud800"},
        # Regression: Decimal/float values= were not checked against Numeric(6, 2): 1.005 and 0.001 were
        # rounded by the database, 12345.6 was a raw DataError.
        {"price": Decimal("1.005")},
        {"price": Decimal("12345.6")},
        {"price": 0.001},
        {"small": 40000},
        {"small": 2**70},
        {"hits": -(2**31) - 1},
        {"title": 12},
        {"title": b"bytes"},
        {"nope": 1},
        {"version": 5},
        {"status": "published"},
        {},
    ],
    ids=lambda v: repr(v)[:30],
)
def test_hostile_values_write_nothing_and_the_transaction_goes_on(engine: Engine, values: Any) -> None:
    with Session(engine) as s, s.begin():
        doc = s.get_one(Doc, 1)
        with pytest.raises(InvalidArgument):
            guarded_update(s, Doc, doc, values, expected_version=1)
        assert doc.version == 1
        assert guarded_update(s, Doc, doc, {"note": "after"}, expected_version=1).applied
    assert _row(engine, 1) == ("draft", "orig", "after", 2, 0)


@pytest.mark.hostile
def test_trigger_values_with_more_decimals_than_the_scale_are_invalid(engine: Engine) -> None:
    """README (Errors): a values= entry with more decimal places than the column's scale is InvalidArgument
    (found: a trigger's values={"price": Decimal("0.004")} was written as 0.00)."""
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            Doc.flow.publish(s, 1, values={"price": Decimal("0.004")})
        assert Doc.flow.archive(s, 1).applied
    assert _row(engine, 1)[0::3] == ("archived", 2)


@pytest.mark.hostile
def test_sql_injection_text_and_expressions_in_values_are_bound_not_run(engine: Engine) -> None:
    evil = "x'); DROP TABLE sg_va_doc; --"
    with Session(engine) as s, s.begin():
        doc = s.get_one(Doc, 1)
        r = guarded_update(
            s, Doc, doc, {"note": evil, "hits": Doc.hits + 41, "title": func.upper("ab")}, expected_version=1
        )
        assert r.applied
        assert (doc.note, doc.hits, doc.title) == (evil, 41, "AB")
    assert _row(engine, 1) == ("draft", "AB", evil, 2, 41)


@pytest.mark.hostile
@pytest.mark.limits
def test_exact_limits_are_accepted(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        r = guarded_update(
            s,
            Doc,
            1,
            {"title": "ü" * 8, "price": Decimal("9999.99"), "small": -32768, "hits": 2**31 - 1},
            expected_version=1,
        )
        assert r.applied
    with Session(engine) as s:
        doc = s.get_one(Doc, 1)
        assert (doc.title, doc.price, doc.small, doc.hits) == ("ü" * 8, Decimal("9999.99"), -32768, 2**31 - 1)
