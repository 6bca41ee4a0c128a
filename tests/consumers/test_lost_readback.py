"""The consumer's read-back of its consume_once record, and the COMMIT after it, whose reply is lost on
the wire: RabbitMQ, Redis Streams and NATS JetStream on PostgreSQL and MariaDB.

Just before COMMIT the consumer reads its own record back (``still_recorded``: one primary-key SELECT),
so that a transaction the database threw away under a handler is not acknowledged.  Here that SELECT
(or the COMMIT after it) reaches the server and tests/_support/faultproxy.py drops the answer and cuts
the connection.  The cut is armed by the handler after its writes, so the next matching statement on
the wire is the read-back (or the COMMIT) of that very message: no timing is guessed.

After a lost read-back reply nothing committed (the server rolls back a transaction whose connection
went away before its COMMIT): the next try must apply the message again.  After a lost COMMIT reply the
transaction did commit: the next try must recognise the message as consumed.  Either way the effect is
in the database once, the consumer neither crashes nor hangs, and nothing is acknowledged that did not
commit: a consumer stopped while the fate is unknown gives the message back, and the one after it
settles it (with ``max_deliveries=1``, so a delivery wrongly counted would dead-letter it unhandled;
JetStream counts the nak'd one whatever the consumer does: a strict xfail there).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from stateguard.consumers import Message, NATSConsumer, RabbitMQConsumer, RedisStreamConsumer

from .._support.brokers import NATS_URL, RABBITMQ_URL, Queue, rabbit_queue
from .._support.faultproxy import FaultProxy, commit_of
from ..conftest import backends_with
from ._behaviours import Counting
from ._drive import publish_amqp, publish_nats, run_until
from ._effects import applied, record

pytestmark = [
    pytest.mark.lost_reply,
    pytest.mark.parametrize("backend", backends_with("tcp_server"), indirect=True),
]

#: The read-back's SELECT on the wire (PostgreSQL's Parse message and MariaDB's COM_QUERY alike); no
#: other statement of a consumer's transaction reads this column list from this table.
READBACK = b"SELECT stateguard_consumed_messages.consumer \nFROM stateguard_consumed_messages"

CUTS = ["readback", "commit"]


@dataclass(frozen=True)
class Lane:
    """One test's broker: ``publish(id)``, ``consumer(engine, handler, **kw)``, and what is still on it:
    ``waiting()`` (not acknowledged) and ``dead()`` (dead-lettered)."""

    publish: Callable[[str], None]
    consumer: Callable[..., Counting]
    waiting: Callable[[], int]
    dead: Callable[[], int]


def unsettled(url: str, stream: str, durable: str) -> int:
    """The durable JetStream consumer's messages not delivered yet or not acknowledged."""

    async def ask() -> int:
        import nats

        client = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0)
        try:
            info = await client.jetstream().consumer_info(stream, durable)
            return int(info.num_pending) + int(info.num_ack_pending)
        finally:
            await client.close()

    return asyncio.run(ask())


def rabbit_lane(mq: Queue) -> Lane:
    def rabbit(engine: Engine, handler: Any, **kw: Any) -> RabbitMQConsumer:
        return RabbitMQConsumer(
            engine, handler, RABBITMQ_URL, queue=mq.queue, consumer="billing", poll=0.05, **kw
        )

    return Lane(
        publish=lambda message_id: publish_amqp(mq, message_id),
        consumer=rabbit,
        waiting=lambda: mq.count(),
        dead=lambda: mq.count(mq.dead_queue),
    )


@pytest.fixture(params=["rabbitmq", "rabbitmq-quorum", "redis", "nats"])
def lane(request: pytest.FixtureRequest) -> Iterator[Lane]:
    if request.param == "rabbitmq-quorum":
        with rabbit_queue(quorum=True) as quorum:
            yield rabbit_lane(quorum)
        return
    yield made_lane(request)


def made_lane(request: pytest.FixtureRequest) -> Lane:
    if request.param == "nats":
        js = request.getfixturevalue("js")

        def jetstream(engine: Engine, handler: Any, **kw: Any) -> NATSConsumer:
            return NATSConsumer(
                engine,
                handler,
                NATS_URL,
                stream=js.name,
                durable="billing",
                dead_letter_subject=js.dead_subject,
                poll=timedelta(milliseconds=100),
                retry_delay=timedelta(milliseconds=50),
                **kw,
            )

        return Lane(
            publish=lambda message_id: publish_nats(js, message_id),
            consumer=jetstream,
            waiting=lambda: unsettled(NATS_URL, js.name, "billing"),
            dead=lambda: len(js.messages(js.dead_name)),
        )
    if request.param == "rabbitmq":
        return rabbit_lane(request.getfixturevalue("mq"))
    client, name = request.getfixturevalue("stream")

    def streams(engine: Engine, handler: Any, **kw: Any) -> RedisStreamConsumer:
        return RedisStreamConsumer(
            engine,
            handler,
            client,
            stream=name,
            group="billing",
            worker="w1",
            block=timedelta(milliseconds=50),
            **kw,
        )

    def add(message_id: str) -> None:
        client.xadd(name, {"id": message_id, "topic": "t", "key": "k", "payload": "{}"})

    def pending() -> int:
        if not client.exists(name):
            return 0
        groups = {g["name"]: g for g in client.xinfo_groups(name)}
        return int(groups[b"billing"]["pending"]) if b"billing" in groups else 0

    return Lane(
        publish=add,
        consumer=streams,
        waiting=pending,
        dead=lambda: int(client.xlen(name + ":dead")),
    )


def arming(engine: Engine, proxy: FaultProxy, cut: str, calls: list[str], then: Any = None) -> Any:
    """``record``, which on its first run arms the proxy to lose the reply of that transaction's
    read-back (``cut="readback"``) or of its COMMIT (``cut="commit"``), then calls ``then()``."""

    def handler(session: Session, message: Message) -> None:
        calls.append(message.id)
        record(session, message)
        if len(calls) == 1:
            session.flush()  # the handler's writes are on the server: the next match is ours
            proxy.cut_after_next_request(READBACK if cut == "readback" else commit_of(engine))
            if then is not None:
                then()

    return handler


@pytest.mark.parametrize("cut", CUTS)
def test_a_lost_reply_is_settled_before_the_ack(
    proxied: tuple[Engine, FaultProxy], direct: Engine, lane: Lane, cut: str
) -> None:
    """The reply to the read-back (nothing committed) or to the COMMIT (committed) is lost: the consumer
    tries the message again where it is; it is applied again (read-back) or recognised as consumed
    (COMMIT), acknowledged once, and the next message is handled as usual."""
    engine, proxy = proxied
    lane.publish("1")
    lane.publish("2")
    calls: list[str] = []
    c = lane.consumer(engine, arming(engine, proxy, cut, calls))
    run_until(c, lambda: c.handled == 2, timeout=30)
    assert (proxy.cuts, proxy.cuts_without_reply) == (1, 0)
    assert not proxy.armed
    # After a lost read-back the first transaction did not commit: the handler ran again (APPLIED).
    # After a lost COMMIT reply it had: the retry was REPEATED and the handler did not run again.
    assert calls == (["1", "1", "2"] if cut == "readback" else ["1", "2"])
    assert applied(direct) == {"1": 1, "2": 1}
    assert (c.handled, c.dead_lettered) == (2, 0)
    assert (lane.waiting(), lane.dead()) == (0, 0)


@pytest.mark.parametrize("cut", CUTS)
def test_stopped_with_the_fate_unknown_the_message_is_given_back_and_settled_next(
    request: pytest.FixtureRequest, proxied: tuple[Engine, FaultProxy], direct: Engine, lane: Lane, cut: str
) -> None:
    """Stop asked while the read-back's or the COMMIT's reply is lost: the message is not acknowledged
    but given back, uncounted; the next consumer (``max_deliveries=1``) applies it (nothing had
    committed) or acknowledges it as a repeat (it had), and it is in once, nothing dead-lettered."""
    if "rabbitmq-quorum" in request.node.callspec.id:
        request.applymarker(
            pytest.mark.xfail(
                strict=True,
                reason="a quorum queue counts the nack(requeue) of the message in hand in x-delivery-count, "
                "which RabbitMQConsumer reads as failed deliveries: with max_deliveries=1 the next "
                "consumer dead-letters it unhandled",
            )
        )
    if "js" in request.fixturenames:
        request.applymarker(
            pytest.mark.xfail(
                strict=True,
                reason="JetStream counts the nak'd delivery (num_delivered) and nothing can take it "
                "back: with max_deliveries=1 the next consumer dead-letters it (docs/how-to/consumers.md, "
                "as test_nats_deliveries' stop mid-batch)",
            )
        )
    engine, proxy = proxied
    lane.publish("7")
    calls: list[str] = []
    holder: list[Counting] = []
    first = lane.consumer(
        engine, arming(engine, proxy, cut, calls, then=lambda: holder[0].stop()), max_deliveries=1
    )
    holder.append(first)
    first.run()  # returns: stopped while waiting out the lost connection
    assert (proxy.cuts, proxy.cuts_without_reply) == (1, 0)
    assert first.handled == 0 and first.dead_lettered == 0  # not acknowledged on a guess
    assert applied(direct) == ({} if cut == "readback" else {"7": 1})
    assert lane.waiting() == 1 and lane.dead() == 0  # given back (Redis: still pending)
    again: list[str] = []

    def handler(session: Session, message: Message) -> None:
        again.append(message.id)
        record(session, message)

    second = lane.consumer(direct, handler, max_deliveries=1)
    run_until(second, lambda: second.handled + second.dead_lettered >= 1, timeout=20)
    assert again == (["7"] if cut == "readback" else [])
    assert applied(direct) == {"7": 1}
    assert (second.handled, second.dead_lettered) == (1, 0)
    assert (lane.waiting(), lane.dead()) == (0, 0)
