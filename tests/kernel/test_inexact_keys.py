"""MariaDB's default collations match ``'SKU-A'`` and ``'sku-a '`` to the row ``'sku-a'``: the ledger, the
transition log and the outbox record the row's own spelling.

Regressions checked: one ref applied once per spelling (three decrements for one order),
a retried request id with another spelling missed its first attempt, and one row's events got
several outbox keys (so two relays could publish them out of order).
"""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, Integer, String, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import Outcome, StateMachine, decrement
from stateguard.tables import outbox
from tests.conftest import backends_with


class _Base(DeclarativeBase):
    pass


class Sku(_Base):
    """A String key in the database's default (case-insensitive, PAD SPACE on MariaDB) collation."""

    __tablename__ = "inexact_skus"
    code: Mapped[str] = mapped_column(String(20), primary_key=True)
    qty: Mapped[int] = mapped_column(Integer, default=10)
    status: Mapped[str] = mapped_column(String(20), default="open")

    flow = StateMachine(
        "status",
        states=["open", "frozen", "closed"],
        transitions=[["freeze", "open", "frozen"], ["close", "frozen", "closed"]],
        history=True,
        events=True,
    )


def _seed(s: Session) -> None:
    s.add(Sku(code="sku-a"))


# Only the backends whose default collation matches inexact spellings (MariaDB); not collected on the others.
pytestmark = [
    pytest.mark.tables(_Base.metadata, seed=_seed),
    pytest.mark.parametrize("backend", backends_with("inexact_keys"), indirect=True),
]


def test_one_ref_applies_once_whatever_the_spelling(engine: Engine) -> None:
    """decrement with one ref and three spellings of one row: APPLIED, REPEATED, REPEATED."""
    outcomes = []
    for code in ("sku-a", "SKU-A", "sku-a "):
        with Session(engine) as s, s.begin():
            outcomes.append(decrement(s, Sku.qty, code, by=3, ref="order-1").outcome)
    assert outcomes == [Outcome.APPLIED, Outcome.REPEATED, Outcome.REPEATED]
    with Session(engine) as s:
        assert s.get_one(Sku, "sku-a").qty == 7


def test_request_id_and_event_keys_follow_the_rows_spelling(engine: Engine) -> None:
    """A retry spelled otherwise is REPEATED with same_request; both transitions' events share one key."""
    with Session(engine) as s, s.begin():
        assert Sku.flow.freeze(s, "SKU-A", request_id="r-1").applied
    with Session(engine) as s, s.begin():
        again = Sku.flow.freeze(s, "sku-a", request_id="r-1")
        assert (again.outcome, again.same_request) == (Outcome.REPEATED, True)
        assert Sku.flow.close(s, "Sku-A ").applied
    with Session(engine) as s:
        keys = s.execute(select(outbox.c.key).order_by(outbox.c.id)).scalars().all()
        assert keys == ['inexact_skus:"sku-a"'] * 2
        assert s.execute(select(func.count()).select_from(outbox)).scalar_one() == 2
