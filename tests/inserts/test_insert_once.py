"""insert_once on every backend: the unique key decides, the transaction survives."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine, String, UniqueConstraint, func, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import InvalidArgument, Outcome, StateguardError, insert_once
from tests._support.models import Base, Message, Order
from tests.conftest import Backend


class PairBase(DeclarativeBase):
    pass


class Delivery(PairBase):
    """A dedup table keyed by (consumer, message_id): a composite unique constraint."""

    __tablename__ = "sg_insert_deliveries"
    __table_args__ = (UniqueConstraint("consumer", "message_id"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    consumer: Mapped[str] = mapped_column(String(20))
    message_id: Mapped[str] = mapped_column(String(40))
    payload: Mapped[str | None] = mapped_column(String(200))


pytestmark = pytest.mark.tables(Base.metadata, PairBase.metadata, stateguard=False)


def _count(engine: Engine, model: Any) -> int:
    with Session(engine) as s:
        return s.scalar(select(func.count()).select_from(model)) or 0


def test_first_insert_is_applied_then_repeated(engine: Engine) -> None:
    """The first insert of a key is APPLIED with the new primary key; the second is REPEATED."""
    with Session(engine) as s, s.begin():
        first = insert_once(s, Message, {"message_id": "m-1"})
        second = insert_once(s, Message, {"message_id": "m-1"})
    assert (first.outcome, first.applied, first.model) == (Outcome.APPLIED, True, Message)
    assert isinstance(first.key, int)
    assert (second.outcome, second.applied) == (Outcome.REPEATED, False)
    assert second.raise_for_outcome() is second
    assert _count(engine, Message) == 1
    with Session(engine) as s:
        assert s.get_one(Message, first.key).message_id == "m-1"


def test_repeated_across_transactions(engine: Engine) -> None:
    """A key committed by an earlier transaction is REPEATED in a later one."""
    with Session(engine) as s, s.begin():
        assert insert_once(s, Message, {"message_id": "m-1", "consumer": "a"}).applied
    with Session(engine) as s, s.begin():
        r = insert_once(s, Message, {"message_id": "m-1", "consumer": "b"})
    assert r.outcome is Outcome.REPEATED
    with Session(engine) as s:
        assert s.scalars(select(Message.consumer)).all() == ["a"]  # the first row is untouched


def test_explicit_primary_key_is_reported_and_a_duplicate_key_is_repeated(engine: Engine) -> None:
    """With the primary key given, APPLIED and REPEATED both report it; a duplicate pk is REPEATED."""
    with Session(engine) as s, s.begin():
        first = insert_once(s, Message, {"id": 5, "message_id": "m-5"})
        same_pk = insert_once(s, Message, {"id": 5, "message_id": "other"})
    assert (first.outcome, first.key) == (Outcome.APPLIED, 5)
    assert (same_pk.outcome, same_pk.key) == (Outcome.REPEATED, 5)
    assert _count(engine, Message) == 1


def test_composite_unique_keys(engine: Engine) -> None:
    """A (consumer, message_id) constraint: the same pair is REPEATED, another consumer APPLIED."""
    with Session(engine) as s, s.begin():
        a = insert_once(s, Delivery, {"consumer": "billing", "message_id": "42"})
        b = insert_once(s, Delivery, {"consumer": "mail", "message_id": "42"})
        again = insert_once(s, Delivery, {"consumer": "billing", "message_id": "42", "payload": "x"})
    assert (a.outcome, b.outcome, again.outcome) == (Outcome.APPLIED, Outcome.APPLIED, Outcome.REPEATED)
    assert _count(engine, Delivery) == 2


def test_transaction_stays_usable_after_a_duplicate(engine: Engine) -> None:
    """After a REPEATED insert the same transaction keeps working and its earlier and later work commits."""
    with Session(engine) as s, s.begin():
        s.add(Order(id=1))
        assert insert_once(s, Message, {"message_id": "m-1"}).applied
        assert insert_once(s, Message, {"message_id": "m-1"}).outcome is Outcome.REPEATED
        assert Order.flow.pay(s, 1).applied
        s.add(Order(id=2))
        assert insert_once(s, Message, {"message_id": "m-2"}).applied
        assert insert_once(s, Message, {"message_id": "m-2"}).outcome is Outcome.REPEATED
        s.flush()
        assert s.scalar(select(func.count()).select_from(Order)) == 2
    with Session(engine) as s:
        assert s.get_one(Order, 1).status == "paid"
        assert s.get_one(Order, 2).status == "pending"
        assert sorted(s.scalars(select(Message.message_id))) == ["m-1", "m-2"]


def test_a_duplicate_does_not_undo_pending_orm_changes(engine: Engine) -> None:
    """Pending ORM objects added before a REPEATED insert are flushed and kept."""
    with Session(engine) as s, s.begin():
        insert_once(s, Message, {"message_id": "m-1"})
    with Session(engine) as s, s.begin():
        s.add(Order(id=7, note="before duplicate"))
        assert insert_once(s, Message, {"message_id": "m-1"}).outcome is Outcome.REPEATED
    with Session(engine) as s:
        assert s.get_one(Order, 7).note == "before duplicate"


@pytest.mark.rollback
def test_rollback_removes_an_applied_insert(engine: Engine) -> None:
    """An APPLIED insert in a transaction that rolls back leaves no row, so a retry applies again."""
    with Session(engine) as s:
        s.begin()
        assert insert_once(s, Message, {"message_id": "m-1"}).applied
        s.rollback()
    assert _count(engine, Message) == 0
    with Session(engine) as s, s.begin():
        assert insert_once(s, Message, {"message_id": "m-1"}).applied


def test_sql_metacharacters_in_values_are_bound(engine: Engine) -> None:
    """Quotes, semicolons and comment markers in values are stored verbatim, never executed."""
    nasty = "x'); DROP TABLE sg_insert_deliveries; -- \" \\ %s ? :p"
    with Session(engine) as s, s.begin():
        first = insert_once(s, Delivery, {"consumer": "o'brien", "message_id": "'; --", "payload": nasty})
        again = insert_once(s, Delivery, {"consumer": "o'brien", "message_id": "'; --", "payload": "y"})
    assert (first.outcome, again.outcome) == (Outcome.APPLIED, Outcome.REPEATED)
    with Session(engine) as s:
        row = s.scalars(select(Delivery)).one()
        assert (row.consumer, row.message_id, row.payload) == ("o'brien", "'; --", nasty)


def test_other_integrity_errors_are_not_reported_as_repeated(engine: Engine) -> None:
    """A NOT NULL violation raises IntegrityError (not REPEATED, not a stateguard error)."""
    with Session(engine) as s:
        s.begin()
        with pytest.raises(IntegrityError) as info:
            insert_once(s, Message, {"message_id": None})
        assert not isinstance(info.value, StateguardError)
        s.rollback()
    assert _count(engine, Message) == 0


@pytest.mark.hostile
@pytest.mark.parametrize(
    ("values", "needle"),
    [({}, "non-empty"), ({"nope": 1}, "'nope'"), ([("message_id", "x")], "mapping")],
)
def test_bad_values_are_invalid_argument(engine: Engine, values: Any, needle: str) -> None:
    """Empty values, unknown columns or a non-mapping are InvalidArgument and nothing is inserted."""
    with Session(engine) as s, s.begin(), pytest.raises(InvalidArgument) as info:
        insert_once(s, Message, values)
    assert needle in str(info.value)
    assert _count(engine, Message) == 0


def test_mariadb_too_long_key_is_an_error_not_a_repeat(mariadb: Backend) -> None:
    """On MariaDB a key too long for String(10) whose truncation is an existing key: InvalidArgument."""
    engine = mariadb.create(Base.metadata)
    with engine.connect() as conn:
        assert "STRICT_TRANS_TABLES" in conn.execute(text("SELECT @@SESSION.sql_mode")).scalar_one()
    with Session(engine) as s, s.begin():
        assert insert_once(s, Message, {"message_id": "abcdefghij"}).applied
        with pytest.raises(InvalidArgument, match="holds at most 10"):
            # INSERT IGNORE would truncate this to 'abcdefghij' and call it a duplicate;
            # stateguard checks the length against the column before any statement.
            insert_once(s, Message, {"message_id": "abcdefghij-and-more"})
        # Nothing was sent: more work, then commit.
        assert insert_once(s, Message, {"message_id": "k"}).applied
        assert insert_once(s, Message, {"message_id": "abcdefghij"}).outcome is Outcome.REPEATED
    with Session(engine) as s:
        assert sorted(s.scalars(select(Message.message_id))) == ["abcdefghij", "k"]


def test_mariadb_too_long_key_without_a_clash_is_also_an_error(mariadb: Backend) -> None:
    """On MariaDB a too-long key is InvalidArgument even when no other key clashes, and nothing is stored."""
    engine = mariadb.create(Base.metadata)
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidArgument):
            insert_once(s, Message, {"message_id": "0123456789-too-long"})
        assert insert_once(s, Message, {"message_id": "fits"}).applied
    with Session(engine) as s:
        assert s.scalars(select(Message.message_id)).all() == ["fits"]
