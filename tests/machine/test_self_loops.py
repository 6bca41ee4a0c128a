"""Self-loop triggers (source = destination): REPEATED only when the change is known to be in the row.

``withdraw: open -> open`` guarded by ``balance >= 100`` matches no row when the
guard fails or the version is stale; the row is then "in the destination", but
nothing was applied.  Such calls once were reported REPEATED, so
callers skipped work that never happened.  A repeat of a self-loop can only be
known from its request_id in the transition history.
"""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, Integer, String, column
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import Outcome, StateMachine, version_column
from tests.conftest import Backend


class _Base(DeclarativeBase):
    pass


class Account(_Base):
    """An account whose withdrawals keep it open (a guarded self-loop)."""

    __tablename__ = "selfloop_accounts"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(10), default="open")
    balance: Mapped[int] = mapped_column(Integer, default=0)
    version: Mapped[int] = version_column()

    flow = StateMachine(
        "status",
        states=["open", "closed"],
        transitions=[
            {
                "trigger": "withdraw",
                "source": "open",
                "dest": "open",
                "where": lambda cls: cls.balance >= 100,
                "values": {"balance": column("balance", Integer) - 100},
            },
            ["touch", "open", "open"],
            ["close", "open", "closed"],
        ],
        history=True,
    )


def _seed(s: Session) -> None:
    s.add_all([Account(id=1, balance=50), Account(id=2, balance=500), Account(id=3, balance=500)])


pytestmark = pytest.mark.tables(_Base.metadata, seed=_seed)


def _balance(engine: Engine, key: int) -> int:
    with Session(engine) as s:
        return s.get_one(Account, key).balance


def test_a_failed_guard_on_a_self_loop_is_rejected_not_repeated(engine: Engine) -> None:
    """withdraw from an account holding 50: REJECTED (nothing was taken), not REPEATED."""
    with Session(engine) as s, s.begin():
        r = Account.flow.withdraw(s, 1)
    assert r.outcome is Outcome.REJECTED and r.state == "open"
    assert _balance(engine, 1) == 50


def test_a_stale_version_on_a_self_loop_is_stale_not_repeated(engine: Engine) -> None:
    """withdraw with an outdated expected_version: STALE, the balance untouched."""
    with Session(engine) as s, s.begin():
        r = Account.flow.withdraw(s, 2, expected_version=99)
    assert r.outcome is Outcome.STALE
    assert _balance(engine, 2) == 500


def test_many_reports_each_failed_self_loop_as_rejected(engine: Engine) -> None:
    """many() over a rich and a poor account: APPLIED for one, REJECTED (not REPEATED) for the other."""
    with Session(engine) as s, s.begin():
        results = Account.flow.withdraw.many(s, [1, 3])
    assert results[3].outcome is Outcome.APPLIED
    assert results[1].outcome is Outcome.REJECTED
    assert (_balance(engine, 1), _balance(engine, 3)) == (50, 400)


def test_a_self_loop_repeat_is_known_from_its_request_id(engine: Engine) -> None:
    """The same request_id again is REPEATED (from the history) and takes nothing; a new one applies."""
    with Session(engine) as s, s.begin():
        assert Account.flow.withdraw(s, 2, request_id="w-1").outcome is Outcome.APPLIED
    with Session(engine) as s, s.begin():
        assert Account.flow.withdraw(s, 2, request_id="w-1").outcome is Outcome.REPEATED
    with Session(engine) as s, s.begin():
        assert Account.flow.withdraw(s, 2, request_id="w-2").outcome is Outcome.APPLIED
    assert _balance(engine, 2) == 300


def test_an_unguarded_self_loop_applies_every_time(engine: Engine) -> None:
    """touch: open -> open matches every time it is fired on an open row."""
    with Session(engine) as s, s.begin():
        assert Account.flow.touch(s, 3).outcome is Outcome.APPLIED
        assert Account.flow.touch(s, 3).outcome is Outcome.APPLIED


def test_a_trigger_into_a_state_it_does_not_leave_still_repeats(engine: Engine) -> None:
    """close twice: the second is REPEATED, as before (closed is not a source of close)."""
    with Session(engine) as s, s.begin():
        assert Account.flow.close(s, 3).outcome is Outcome.APPLIED
        assert Account.flow.close(s, 3).outcome is Outcome.REPEATED
    with Session(engine) as s, s.begin():
        assert Account.flow.withdraw(s, 3).outcome is Outcome.REJECTED


def test_the_property_tests_counterexample_stop_on_a_red_lamp_with_an_old_version(backend: Backend) -> None:
    """Pinned from test_property's falsifying run: stop (* -> red) on a red lamp, version behind: STALE."""
    from tests._support.models import Base, Color, Lamp

    engine = backend.create(Base.metadata)
    with Session(engine) as s, s.begin():
        s.add(Lamp(id=1, color=Color.RED))
    with Session(engine) as s, s.begin():
        lamp = s.get_one(Lamp, 1)
        r = Lamp.flow.stop(s, 1, expected_version=lamp.version - 1)
    assert r.outcome is Outcome.STALE and r.state is Color.RED
