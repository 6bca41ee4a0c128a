"""Every key a model accepts fits stateguard's ``row_key`` columns, or is refused typed before writing.

The transition log and the counter ledger store a row's primary key as JSON
in a 255-character column.  With ASCII escapes a 60-character CJK product
code is 362 characters: the INSERT failed with a raw DataError (PostgreSQL
then aborts the transaction).  Keys whose escaped form is too long are now
stored unescaped, and longer ones as a digest in the log; the ledger, which
reads its keys back, refuses those before any statement.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine, Integer, String, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import InvalidArgument, Outcome, StateMachine, decrement, release
from stateguard.tables import DIGEST_PREFIX, ROW_KEY_LENGTH, counter_ledger, row_key, transition_log

CJK = "商品编号" * 15  # 60 characters: 362 as JSON with \\uXXXX escapes
LONG = "sku-" + "x" * 296  # 300 ASCII characters: too long even unescaped


class _Base(DeclarativeBase):
    pass


class Product(_Base):
    """A string primary key long enough for both kinds of key, a counter and a logged machine."""

    __tablename__ = "long_key_products"
    code: Mapped[str] = mapped_column(String(400), primary_key=True)
    qty: Mapped[int] = mapped_column(Integer, default=10)
    status: Mapped[str] = mapped_column(String(20), default="draft")

    flow = StateMachine(
        "status",
        states=["draft", "live", "retired"],
        transitions=[["publish", "draft", "live"], ["retire", "live", "retired"]],
        history=True,
    )


def _seed(s: Session) -> None:
    s.add_all([Product(code=CJK), Product(code=LONG), Product(code="plain")])


pytestmark = pytest.mark.tables(_Base.metadata, seed=_seed)


def _qty(engine: Engine, code: str) -> int:
    with Session(engine) as s:
        return int(s.execute(select(Product.qty).where(Product.code == code)).scalar_one())


@pytest.mark.limits
def test_row_key_keeps_the_escaped_form_of_every_key_that_fit_before() -> None:
    """Keys whose ASCII-escaped JSON fits are stored exactly as before (existing rows still match)."""
    assert row_key(("é" * 40,)) == '"' + "\\u00e9" * 40 + '"'
    assert row_key((42,)) == "42"
    assert row_key(("a", 1)) == '["a",1]'


@pytest.mark.limits
@pytest.mark.parametrize(
    "key",
    [(CJK,), (LONG,), ("商" * 300,), ("\ud800" * 100,), (CJK, 7), ("x" * ROW_KEY_LENGTH,)],
    ids=["cjk-60", "ascii-300", "cjk-300", "lone-surrogates", "composite", "ascii-255"],
)
def test_every_row_key_fits_its_column_and_is_storable(key: tuple[Any, ...]) -> None:
    """Whatever the key, its stored form is at most 255 characters of encodable text."""
    stored = row_key(key)
    assert len(stored) <= ROW_KEY_LENGTH
    stored.encode("utf-8")  # no lone surrogate reaches the driver
    assert row_key(key) == stored  # deterministic: lookups find what was written


@pytest.mark.limits
def test_cjk_key_through_a_logged_trigger_and_its_history(engine: Engine) -> None:
    """A 60-character CJK key transitions, logs, dedups by request_id and reads its history back."""
    with Session(engine) as s, s.begin():
        assert Product.flow.publish(s, CJK, request_id="r1").outcome is Outcome.APPLIED
        assert Product.flow.publish(s, CJK, request_id="r1").outcome is Outcome.REPEATED
        assert Product.flow.retire(s, CJK).outcome is Outcome.APPLIED
    with Session(engine) as s:
        assert [h.trigger for h in Product.flow.history(s, CJK)] == ["publish", "retire"]
        stored = s.execute(select(transition_log.c.row_key).distinct()).scalars().all()
    assert stored == [row_key((CJK,))] and len(stored[0]) == 62


@pytest.mark.limits
def test_key_too_long_even_unescaped_is_logged_as_a_digest(engine: Engine) -> None:
    """A 300-character key transitions and its history is found by its digest."""
    with Session(engine) as s, s.begin():
        assert Product.flow.publish(s, LONG, request_id="r1").outcome is Outcome.APPLIED
        assert Product.flow.publish(s, LONG, request_id="r1").outcome is Outcome.REPEATED
    with Session(engine) as s:
        assert [h.trigger for h in Product.flow.history(s, LONG)] == ["publish"]
        [stored] = s.execute(select(transition_log.c.row_key)).scalars().all()
    assert stored.startswith(DIGEST_PREFIX)


@pytest.mark.limits
def test_many_with_long_keys_logs_every_row(engine: Engine) -> None:
    """many() over CJK, over-long and plain keys applies and logs each."""
    with Session(engine) as s, s.begin():
        results = Product.flow.publish.many(s, [CJK, LONG, "plain"])
        assert [r.outcome for r in results.values()] == [Outcome.APPLIED] * 3
    with Session(engine) as s:
        logged = s.execute(select(func.count()).select_from(transition_log)).scalar_one()
    assert logged == 3


@pytest.mark.limits
def test_cjk_key_through_a_refd_counter_and_its_release(engine: Engine) -> None:
    """A CJK key takes stock once per ref and release gives it back to the same row."""
    with Session(engine) as s, s.begin():
        assert decrement(s, Product.qty, CJK, by=3, ref="o1").outcome is Outcome.APPLIED
        assert decrement(s, Product.qty, CJK, by=3, ref="o1").outcome is Outcome.REPEATED
    assert _qty(engine, CJK) == 7
    with Session(engine) as s, s.begin():
        r = release(s, Product.qty, "o1")
        assert r.outcome is Outcome.APPLIED and r.value == {CJK: 3}
    assert _qty(engine, CJK) == 10


@pytest.mark.limits
def test_refd_counter_refuses_a_key_the_ledger_cannot_read_back(engine: Engine) -> None:
    """A 300-character key with ref= is InvalidArgument before any statement; the transaction goes on."""
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument, match="too long for a ref'd counter"):
            decrement(s, Product.qty, LONG, by=1, ref="o2")
        with pytest.raises(InvalidArgument, match="too long for a ref'd counter"):
            from stateguard import reserve

            reserve(s, Product.qty, {"plain": 1, LONG: 1}, ref="o3")
        # The transaction is usable, and nothing of either call was written.
        assert decrement(s, Product.qty, LONG, by=1).outcome is Outcome.APPLIED
        assert s.execute(select(func.count()).select_from(counter_ledger)).scalar_one() == 0
    assert _qty(engine, LONG) == 9 and _qty(engine, "plain") == 10
