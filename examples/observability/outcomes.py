"""One outcome event per guarded call: count them with on_event, or export them with OpenTelemetry."""

import collections
import os

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from sqlalchemy import String, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import GuardEvent, StateMachine, on_event
from stateguard.otel import instrument


class Base(DeclarativeBase): ...


class Order(Base):
    __tablename__ = "observed_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="paid")
    flow = StateMachine("status", states=["pending", "paid", "shipped", "cancelled"], transitions=[
        ["ship", "paid", "shipped"], ["cancel", ["pending", "paid"], "cancelled"]])


engine = create_engine(os.environ.get("DATABASE_URL", "sqlite:///observed.db"))
Base.metadata.create_all(engine)
with Session(engine) as session, session.begin():
    session.add_all([Order(id=42), Order(id=7, status="pending")])

outcomes: collections.Counter[tuple[str, str]] = collections.Counter()


def count(event: GuardEvent) -> None:
    outcomes[(event.operation, event.outcome)] += 1


remove = on_event(count)
with Session(engine) as session, session.begin():
    Order.flow.ship(session, 42)      # APPLIED
    Order.flow.ship(session, 42)      # REPEATED
    Order.flow.ship(session, 7)       # REJECTED: 7 is still pending
remove()
assert outcomes == {("trigger", "APPLIED"): 1, ("trigger", "REPEATED"): 1, ("trigger", "REJECTED"): 1}

reader = InMemoryMetricReader()
stop = instrument(meter_provider=MeterProvider(metric_readers=[reader]), spans=False)
with Session(engine) as session, session.begin():
    Order.flow.cancel(session, 7)
stop()
[calls] = [m for rm in reader.get_metrics_data().resource_metrics
           for sm in rm.scope_metrics for m in sm.metrics if m.name == "stateguard.calls"]
assert [p.attributes["stateguard.outcome"] for p in calls.data.data_points] == ["APPLIED"]
engine.dispose()
