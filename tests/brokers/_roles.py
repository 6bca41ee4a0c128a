"""The processes of the end-to-end tests: producers, relays, consumers, Celery workers.

``python -m tests.brokers._roles ROLE BROKER`` with the settings in environment variables
(``SG_DB_URL``, ``SG_LOG`` (this process's log file), ``SG_TARGET`` (queue or stream), ``SG_NAME``,
``SG_PRODUCER``); every process runs until SIGTERM.  Logs are lines ``<word> <event id>``, flushed
at once, so the test sees what a process is doing when it kills it:

- relays, consumers and workers write ``ready <pid>`` once they are about to take work;
- a relay writes ``published <ids>`` after its sink took a batch, then waits 0.15 s before the
  relay marks it: a kill then leaves a batch published and unmarked (published again later);
- a consumer writes ``start <id>`` when its handler runs and, for every tenth event, ``slow <id>``
  and waits 0.2 s inside the transaction: a kill then leaves a message handled and not committed.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import create_engine, insert
from sqlalchemy.orm import Session

from stateguard import CallableSink, OutboxEvent, RedisStreamSink, Relay, emit
from stateguard.consumers import Message

from .._support.brokers import NATS_URL, RABBITMQ_URL, REDIS_URL
from ..consumers._effects import effects

TOPIC_PREFIX = "e2e"
LEASE = timedelta(seconds=1)


def env(name: str) -> str:
    return os.environ[name]


class Log:
    """This process's log: one line per step, flushed at once."""

    def __init__(self) -> None:
        self.file = open(env("SG_LOG"), "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def write(self, word: str, what: object) -> None:
        self.file.write(f"{word} {what}\n")
        self.file.flush()


def engine() -> Any:
    return create_engine(env("SG_DB_URL"), pool_size=2, max_overflow=2)


# -- producers ------------------------------------------------------------------


def produce(broker: str) -> int:
    """Transactions until SIGTERM, each emitting one event of key p<P>-k<0..3>; every 7th rolls back."""
    producer = int(env("SG_PRODUCER"))
    stop = threading.Event()
    _on_sigterm(stop)
    db = engine()
    topic = f"{env('SG_TARGET')}.{TOPIC_PREFIX}" if broker == "nats" else "sgtest.apply_effect"
    seqs = [0, 0, 0, 0]
    i = 0
    while not stop.is_set():
        k = i % 4
        key = f"p{producer}-k{k}"
        with Session(db) as session:
            with session.begin():
                payload: dict[str, Any] = {"seq": seqs[k], "key": key}
                if broker == "celery":
                    payload = {"args": [seqs[k]], "kwargs": {}}
                emit(session, topic, payload, key=key)
                if i % 7 == 6:
                    session.rollback()  # never committed: never published, never applied
            if i % 7 != 6:
                seqs[k] += 1
        i += 1
        stop.wait(0.2)
    db.dispose()
    return 0


# -- relays ---------------------------------------------------------------------


def relay(broker: str) -> int:
    log = Log()
    db = engine()
    real: Any
    if broker == "redis":
        import redis

        real = RedisStreamSink(redis.Redis.from_url(REDIS_URL), stream=env("SG_TARGET"))
    elif broker == "rabbitmq":
        from stateguard.outbox.sinks import RabbitMQSink

        real = RabbitMQSink(RABBITMQ_URL, exchange="", routing_key=env("SG_TARGET"))
    elif broker == "nats":
        from stateguard.outbox.sinks import NATSSink

        real = NATSSink(NATS_URL, stream=env("SG_TARGET"), lease=LEASE)
    else:
        from stateguard.outbox.sinks import CelerySink

        from ._celery_app import app

        real = CelerySink(app)

    def publish(events: Sequence[OutboxEvent]) -> None:
        real.publish(events)
        log.write("published", ",".join(str(e.id) for e in events))
        time.sleep(0.15)  # the window between publish and mark a kill aims at

    stop = threading.Event()
    _on_sigterm(stop)
    relay = Relay(db, CallableSink(publish), batch=10, lease=LEASE)
    log.write("ready", os.getpid())
    relay.run(stop, idle_sleep=0.05)
    return 0


def _on_sigterm(stop: threading.Event) -> None:
    import signal

    signal.signal(signal.SIGTERM, lambda *_: stop.set())


# -- consumers ------------------------------------------------------------------


def handler(log: Log) -> Any:
    def handle(session: Session, message: Message) -> None:
        payload = message.payload
        log.write("start", message.id)
        session.execute(
            insert(effects).values(event_id=message.id, key=message.key, seq=payload["seq"], pid=os.getpid())
        )
        if payload["seq"] % 10 == 2:
            session.flush()
            log.write("slow", message.id)
            time.sleep(0.2)  # the window a kill aims at: handled, not committed

    return handle


def consume(broker: str) -> int:
    log = Log()
    db = engine()
    handle = handler(log)
    name = env("SG_NAME")
    consumer: Any
    if broker == "redis":
        import redis

        from stateguard.consumers import RedisStreamConsumer

        consumer = RedisStreamConsumer(
            db,
            handle,
            redis.Redis.from_url(REDIS_URL),
            stream=env("SG_TARGET"),
            group="e2e",
            worker=name,
            claim_idle=timedelta(milliseconds=500),
            block=timedelta(milliseconds=100),
            batch=1,
        )
    elif broker == "rabbitmq":
        from stateguard.consumers import RabbitMQConsumer

        consumer = RabbitMQConsumer(
            db, handle, RABBITMQ_URL, queue=env("SG_TARGET"), consumer="e2e", poll=0.1
        )
    else:
        from stateguard.consumers import NATSConsumer

        consumer = NATSConsumer(
            db,
            handle,
            NATS_URL,
            stream=env("SG_TARGET"),
            durable="e2e",
            ack_wait=timedelta(seconds=1),
            poll=timedelta(milliseconds=200),
        )
    log.write("ready", os.getpid())
    code = int(consumer.serve())
    db.dispose()
    return code


def worker() -> int:
    """A Celery worker of the e2e app: one process, one thread, prefetch 1."""
    from ._celery_app import app

    app.worker_main(
        [
            "worker",
            "--pool=threads",  # one process (a SIGKILL takes all of it); the solo pool waits ~0.7 s per task
            "--concurrency=1",
            "--prefetch-multiplier=1",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--loglevel=WARNING",
            f"--queues={env('SG_TARGET')}",
            f"--hostname={env('SG_NAME')}@%h",
        ]
    )
    return 0


def main(argv: list[str]) -> int:
    role, broker = argv
    if role == "producer":
        return produce(broker)
    if role == "relay":
        return relay(broker)
    if role == "worker":
        return worker()
    return consume(broker)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
