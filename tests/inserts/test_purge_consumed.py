"""purge_consumed(): consume_once() records older than a retention go, on the database's clock."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, insert, select, update
from sqlalchemy.orm import Session

from stateguard import InvalidArgument, Outcome, consume_once, purge_consumed
from stateguard.tables import consumed_messages

HOUR_MS = 3_600_000


def _consume(engine: Engine, *ids: str) -> None:
    with Session(engine) as s, s.begin():
        for message_id in ids:
            assert consume_once(s, "billing", message_id).applied


def _age(engine: Engine, hours: float, *ids: str) -> None:
    """Make the records of ``ids`` look consumed ``hours`` earlier than they were."""
    with engine.begin() as conn:
        conn.execute(
            update(consumed_messages)
            .where(consumed_messages.c.message_id.in_(ids))
            .values(consumed_ms=consumed_messages.c.consumed_ms - int(hours * HOUR_MS))
        )


def _left(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return sorted(conn.execute(select(consumed_messages.c.message_id)).scalars())


def test_old_records_go_in_batches_and_recent_ones_stay(engine: Engine) -> None:
    """Five records 48 h old go (batches of 2: 2, 2, 1), the one consumed now stays; a message
    redelivered after its record went is handled again, as the README warns."""
    _consume(engine, "a", "b", "c", "d", "e", "now")
    _age(engine, 48, "a", "b", "c", "d", "e")
    counts = [purge_consumed(engine, older_than=timedelta(hours=24), batch=2) for _ in range(4)]
    assert counts == [2, 2, 1, 0]
    assert _left(engine) == ["now"]
    with Session(engine) as s, s.begin():
        assert consume_once(s, "billing", "now").outcome is Outcome.REPEATED
        assert consume_once(s, "billing", "a").applied


@pytest.mark.clock
def test_ages_are_judged_on_the_database_clock(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """An application clock 6 hours ahead neither stamps a record old nor purges a new one."""
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() + 6 * HOUR_MS * 1_000_000)
    monkeypatch.setattr(time, "time", lambda: real() / 1e9 + 6 * 3600)
    _consume(engine, "skewed")
    assert purge_consumed(engine, older_than=timedelta(hours=1)) == 0
    assert _left(engine) == ["skewed"]
    with engine.connect() as conn:
        stamped = conn.execute(select(consumed_messages.c.consumed_ms)).scalar_one()
    assert abs(stamped - real() // 1_000_000) < 60_000  # the database's now, not the app's


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("older_than", "batch"),
    [(timedelta(0), 10), (timedelta(hours=-1), 10), (3600, 10), (None, 10), (timedelta(hours=1), 0),
     (timedelta(hours=1), -5), (timedelta(hours=1), 2.0), (timedelta(hours=1), True)],
)  # fmt: skip
def test_bad_arguments_are_invalid_and_delete_nothing(engine: Engine, older_than: Any, batch: Any) -> None:
    _consume(engine, "kept")
    _age(engine, 48, "kept")
    with pytest.raises(InvalidArgument):
        purge_consumed(engine, older_than=older_than, batch=batch)
    assert _left(engine) == ["kept"]


@pytest.mark.rollback
def test_in_the_callers_transaction_it_rolls_back_with_it(engine: Engine) -> None:
    """With a Session (or Connection) the purge is part of the caller's transaction."""
    _consume(engine, "x", "y")
    _age(engine, 48, "x", "y")
    with Session(engine) as s:
        assert purge_consumed(s, older_than=timedelta(hours=1)) == 2
        s.rollback()
    assert _left(engine) == ["x", "y"]
    with engine.connect() as conn:
        assert purge_consumed(conn, older_than=timedelta(hours=1), batch=2**70) == 2  # clamped: all
        conn.commit()
    assert _left(engine) == []


def test_a_batch_larger_than_the_table_and_other_consumers(engine: Engine) -> None:
    """Records of every consumer are judged alike; only old ones go (the same message id of another
    consumer, recorded at the epoch, goes; billing's of now stays)."""
    _consume(engine, "m1")
    with engine.begin() as conn:
        conn.execute(
            insert(consumed_messages), [{"consumer": "search", "message_id": "m1", "consumed_ms": 0}]
        )
    assert purge_consumed(engine, older_than=timedelta(days=1), batch=1000) == 1
    with engine.connect() as conn:
        rows = conn.execute(select(consumed_messages.c.consumer, consumed_messages.c.message_id)).all()
    assert [tuple(r) for r in rows] == [("billing", "m1")]


def test_purgers_race_each_other_and_consumers(engine: Engine) -> None:
    """Three purgers (batches of 40) and three consumers start together on 300 old records: every
    old record is deleted exactly once in all (the counts add up), no new record goes, every new
    message applies once and its redelivery is REPEATED, and nobody gets an error (purgers skip
    each other's rows where the database has row locks; SQLite has one writer)."""
    import threading

    from stateguard import retry_on_conflict

    old = [f"old-{i}" for i in range(300)]
    for start in range(0, 300, 100):
        _consume(engine, *old[start : start + 100])
    _age(engine, 48, *old)
    barrier = threading.Barrier(6)
    purged: list[int] = []
    outcomes: list[tuple[str, Outcome]] = []
    errors: list[BaseException] = []

    def purger() -> None:
        try:
            barrier.wait(timeout=30)
            while True:
                n = retry_on_conflict(
                    lambda: purge_consumed(engine, older_than=timedelta(hours=24), batch=40)
                )
                purged.append(n)
                if n == 0:
                    return
        except BaseException as error:
            errors.append(error)

    def consumer(k: int) -> None:
        try:
            barrier.wait(timeout=30)
            for j in range(40):
                message_id = f"new-{k}-{j}"
                for _ in range(2):  # a delivery and its redelivery

                    def once(message_id: str = message_id) -> Outcome:
                        with Session(engine) as s, s.begin():
                            return consume_once(s, "billing", message_id).outcome

                    outcomes.append((message_id, retry_on_conflict(once)))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=purger) for _ in range(3)]
    threads += [threading.Thread(target=consumer, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "hung"
    assert not errors, errors
    assert sum(purged) == 300, purged
    new = sorted(f"new-{k}-{j}" for k in range(3) for j in range(40))
    assert _left(engine) == new
    for message_id in new:
        assert [o for m, o in outcomes if m == message_id] == [Outcome.APPLIED, Outcome.REPEATED], message_id
