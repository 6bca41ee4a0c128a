"""A card charge that must happen inside the request: ``idempotent(..., mode="separate")``.

The claim commits at once, in its own short transaction; the charge is an outside call that
cannot be rolled back, so its result is saved with a checkpoint, and a retry that takes the key
over after a crash resumes after the charge instead of charging again.
"""

import contextlib
import os
from datetime import timedelta

from sqlalchemy import String, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import RequestFailed, create_tables, idempotent


class Base(DeclarativeBase): ...


class Charge(Base):
    __tablename__ = "psp_charges"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    amount: Mapped[int]


class CardDeclined(Exception): ...


class PaymentProvider:
    """Stands in for a payment provider that takes its own idempotency key."""

    def __init__(self) -> None:
        self.charges: dict[str, int] = {}

    def charge(self, amount: int, idempotency_key: str) -> str:
        if amount > 10_000:
            raise CardDeclined("insufficient funds")
        self.charges.setdefault(idempotency_key, amount)
        return f"ch_{idempotency_key}"


psp = PaymentProvider()
engine = create_engine(os.environ.get("DATABASE_URL", "sqlite:///payouts.db"))
Base.metadata.create_all(engine)
create_tables(engine)


def payout(session: Session, key: str, body: dict) -> dict:
    """Called with no transaction open on the session: separate mode commits as it goes."""
    with idempotent(session, scope="payouts", key=key, fingerprint=body, mode="separate",
                    lease=timedelta(seconds=30), heartbeat_every=timedelta(seconds=10),
                    non_retryable=(CardDeclined,)) as call:
        if call.replayed:
            return call.response
        if call.checkpoint_name != "charged":                 # a takeover resumes here
            charge_id = psp.charge(body["amount"], idempotency_key=key)
            session.add(Charge(id=charge_id, amount=body["amount"]))
            call.checkpoint("charged", {"charge_id": charge_id})   # commits the phase with its recovery point
        return call.complete({"charge_id": call.checkpoint_data["charge_id"]})  # commits the session


with Session(engine) as session:
    first = payout(session, "po-1", {"amount": 500})
with Session(engine) as session:
    assert payout(session, "po-1", {"amount": 500}) == first == {"charge_id": "ch_po-1"}   # replayed
with Session(engine) as session, contextlib.suppress(CardDeclined):
    payout(session, "po-2", {"amount": 99_999})               # declined: failed for good, stored as such
with Session(engine) as session:
    try:
        payout(session, "po-2", {"amount": 99_999})            # the retry is told, not run
    except RequestFailed as failed:
        assert "CardDeclined" in str(failed.error)
    else:
        raise AssertionError("a request that failed for good ran again")
assert psp.charges == {"po-1": 500}
with Session(engine) as session:
    assert session.query(Charge).count() == 1
engine.dispose()
