"""A first end-to-end check of the backend fixture."""

from sqlalchemy.orm import Session

from stateguard import Outcome
from tests._support.models import Base, Order
from tests.conftest import Backend, count_statements


def test_pay_applies_once_then_repeats(backend: Backend) -> None:
    """The first pay applies in one statement; the second is REPEATED in two."""
    engine = backend.create(Base.metadata)
    with Session(engine) as s, s.begin():
        s.add(Order(id=1))
    with Session(engine) as s, s.begin():
        s.connection()
        with count_statements(engine) as c:
            r = Order.flow.pay(s, 1)
        assert r.outcome is Outcome.APPLIED and len(c) == 1
        with count_statements(engine) as c:
            r = Order.flow.pay(s, 1)
        assert r.outcome is Outcome.REPEATED and len(c) == 2
