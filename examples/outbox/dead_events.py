"""An event the sink keeps refusing holds back only its own key, then is parked dead until requeued."""

import os
from datetime import timedelta

from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from stateguard import PublishFailed, Relay, create_tables, emit, requeue_dead

engine = create_engine(os.environ.get("DATABASE_URL", "sqlite:///dead.db"))
create_tables(engine)
with Session(engine) as session, session.begin():
    emit(session, "invoice.sent", {"invoice": 1}, key="invoice-1")
    poison = emit(session, "invoice.sent", {"invoice": 2, "email": "not an address"}, key="invoice-2")
    emit(session, "invoice.sent", {"invoice": 3}, key="invoice-3")


class MailSink:
    """A sink that refuses what the mail service refuses, naming the events."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.broken = True

    def publish(self, events) -> None:
        bad = tuple(e.id for e in events if self.broken and "@" not in e.payload.get("email", "@"))
        self.sent += [e.payload["invoice"] for e in events if e.id not in bad]
        if bad:
            raise PublishFailed("the mail service refused them", event_ids=bad)


sink = MailSink()
relay = Relay(engine, sink, max_attempts=1, retry_delay=timedelta(milliseconds=1))
assert relay.run_once() == 2                  # invoices 1 and 3 went out; 2 was refused ...
assert sorted(sink.sent) == [1, 3]
assert relay.run_once() == 0                  # ... once (max_attempts=1): now it is dead, not retried

sink.broken = False                           # the cause is fixed
requeue_dead(engine, ids=[poison])            # or `stateguard outbox requeue --db URL --id N`
assert relay.run_once() == 1 and sorted(sink.sent) == [1, 2, 3]
engine.dispose()
