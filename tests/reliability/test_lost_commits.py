"""Lost COMMIT acknowledgements: the COMMIT ran on the
server, the client got a DBAPI error; the retry (a new connection, the same request_id,
ref, unique key or message id) learns that its first attempt applied: REPEATED with
``same_request`` set, and the change is in the database exactly once.

The fault is real: tests/_support/faultproxy.py forwards the COMMIT to PostgreSQL or MariaDB and
drops the server's reply. A connection cut *before* the COMMIT (nothing applied) makes the
retry APPLIED instead, so the two cases are told apart.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from stateguard import (
    Outcome,
    RequestInProgress,
    Result,
    StripedCounter,
    consume_once,
    consume_token,
    decrement,
    idempotent,
    insert_once,
    issue_token,
    new_request_id,
    release,
    reserve,
)
from tests._support.faultproxy import FaultProxy, commit_of, proxied_with_tables
from tests._support.models import Base, Invoice, Message
from tests._support.stock_workers import Stock, StockBase
from tests.conftest import Backend, backends_with

#: A short lease for the separate-mode claim test.
LEASE = timedelta(seconds=1)


pytestmark = pytest.mark.parametrize("backend", backends_with("tcp_server"), indirect=True)


@pytest.fixture
def proxied(backend: Backend) -> Iterator[tuple[Engine, FaultProxy]]:
    """stateguard's tables and the models on ``backend``, and an engine reaching it through a FaultProxy."""
    with proxied_with_tables(backend, Base.metadata, StockBase.metadata) as made:
        yield made


def arm_commit_cut(engine: Engine, proxy: FaultProxy) -> None:
    """Make the proxy lose the reply to the next COMMIT this engine's server receives."""
    proxy.cut_after_next_request(commit_of(engine))


def lose_commit_reply(engine: Engine, proxy: FaultProxy, work: Callable[[Session], Result]) -> Result:
    """Run ``work`` in a transaction whose COMMIT reaches the server but whose reply is cut."""
    with Session(engine) as s:
        first = work(s)
        arm_commit_cut(engine, proxy)
        with pytest.raises(DBAPIError):
            s.commit()
    assert proxy.wait_cut()
    assert proxy.cuts == 1
    return first


def lose_connection_before_commit(
    engine: Engine, proxy: FaultProxy, work: Callable[[Session], Result]
) -> None:
    """Run ``work`` in a transaction whose connection is cut before the COMMIT is sent (nothing applies)."""
    with Session(engine) as s:
        assert work(s).applied
        assert proxy.cut_all() == 1
        with pytest.raises(DBAPIError):
            s.commit()


def lose_reply_inside(
    engine: Engine, proxy: FaultProxy, match: bytes, work: Callable[[Session], Result]
) -> None:
    """Run ``work`` in a transaction; the proxy forwards the first request containing ``match`` (a
    statement inside the call) and cuts the connection before its reply: the call fails and nothing
    is committed."""
    with Session(engine) as s:
        proxy.cut_after_next_request(match)
        with pytest.raises(DBAPIError):
            work(s)
            s.commit()
    assert proxy.wait_cut()
    proxy.disarm()


def retry(engine: Engine, work: Callable[[Session], Result]) -> Result:
    """Run ``work`` again in a new session and commit."""
    with Session(engine) as s, s.begin():
        return work(s)


def _seed(engine: Engine, *rows: Any) -> None:
    with Session(engine) as s, s.begin():
        s.add_all(rows)


def _invoice(engine: Engine, key: int) -> Invoice:
    with Session(engine) as s:
        return s.get_one(Invoice, key)


def _amount(engine: Engine, key: int) -> int:
    with Session(engine) as s:
        return s.get_one(Stock, key).amount


@pytest.mark.lost_reply
def test_trigger_retry_learns_its_lost_commit_applied(proxied: tuple[Engine, FaultProxy]) -> None:
    """A pay whose COMMIT reply was lost is REPEATED with same_request on retry, logged once."""
    engine, proxy = proxied
    _seed(engine, Invoice(id=1, status="sent"))
    pay = lambda s: Invoice.flow.pay(s, 1, request_id="req-1")  # noqa: E731
    assert lose_commit_reply(engine, proxy, pay).applied
    again = retry(engine, pay)
    assert (again.outcome, again.same_request, again.state) == (Outcome.REPEATED, True, "paid")
    assert _invoice(engine, 1).status == "paid"
    with Session(engine) as s:
        assert [e.request_id for e in Invoice.flow.history(s, 1)] == ["req-1"]


@pytest.mark.lost_reply
def test_trigger_other_request_is_not_same_request(proxied: tuple[Engine, FaultProxy]) -> None:
    """After a lost COMMIT another request_id is REPEATED from the row's state, without same_request."""
    engine, proxy = proxied
    _seed(engine, Invoice(id=1, status="sent"))
    lose_commit_reply(engine, proxy, lambda s: Invoice.flow.pay(s, 1, request_id="req-1"))
    other = retry(engine, lambda s: Invoice.flow.pay(s, 1, request_id="req-2"))
    assert (other.outcome, other.same_request) == (Outcome.REPEATED, False)


@pytest.mark.lost_reply
def test_trigger_retry_after_row_moved_on(proxied: tuple[Engine, FaultProxy]) -> None:
    """The retry learns its pay applied even after another request voided the invoice meanwhile."""
    engine, proxy = proxied
    _seed(engine, Invoice(id=1, status="sent"))
    pay = lambda s: Invoice.flow.pay(s, 1, request_id="req-1")  # noqa: E731
    lose_commit_reply(engine, proxy, pay)
    assert retry(engine, lambda s: Invoice.flow.void(s, 1, request_id="req-9")).applied
    again = retry(engine, pay)
    assert (again.outcome, again.same_request) == (Outcome.REPEATED, True)
    assert _invoice(engine, 1).status == "void"


@pytest.mark.lost_reply
def test_trigger_cut_before_commit_retry_applies(proxied: tuple[Engine, FaultProxy]) -> None:
    """A connection lost before the COMMIT left nothing: the retry with the same request_id is APPLIED."""
    engine, proxy = proxied
    _seed(engine, Invoice(id=1, status="sent"))
    pay = lambda s: Invoice.flow.pay(s, 1, request_id="req-1")  # noqa: E731
    lose_connection_before_commit(engine, proxy, pay)
    assert _invoice(engine, 1).status == "sent"
    again = retry(engine, pay)
    assert (again.outcome, again.same_request) == (Outcome.APPLIED, False)


@pytest.mark.lost_reply
def test_decrement_retry_learns_its_lost_commit_applied(proxied: tuple[Engine, FaultProxy]) -> None:
    """A decrement with ref whose COMMIT reply was lost is REPEATED with same_request; taken once."""
    engine, proxy = proxied
    _seed(engine, Stock(id=1, amount=10))
    take = lambda s: decrement(s, Stock.amount, 1, by=3, ref="order-1")  # noqa: E731
    assert lose_commit_reply(engine, proxy, take).applied
    again = retry(engine, take)
    assert (again.outcome, again.same_request) == (Outcome.REPEATED, True)
    assert _amount(engine, 1) == 7


@pytest.mark.lost_reply
def test_decrement_cut_before_commit_retry_applies(proxied: tuple[Engine, FaultProxy]) -> None:
    """A decrement whose connection was lost before the COMMIT is APPLIED on retry, taken once."""
    engine, proxy = proxied
    _seed(engine, Stock(id=1, amount=10))
    take = lambda s: decrement(s, Stock.amount, 1, by=3, ref="order-1")  # noqa: E731
    lose_connection_before_commit(engine, proxy, take)
    again = retry(engine, take)
    assert (again.outcome, again.same_request) == (Outcome.APPLIED, False)
    assert _amount(engine, 1) == 7


@pytest.mark.lost_reply
def test_reserve_and_release_retries_learn_their_lost_commits_applied(
    proxied: tuple[Engine, FaultProxy],
) -> None:
    """reserve and release whose COMMIT replies were lost are REPEATED with same_request on retry."""
    engine, proxy = proxied
    _seed(engine, Stock(id=1, amount=5), Stock(id=2, amount=5))
    hold = lambda s: reserve(s, Stock.amount, {1: 2, 2: 1}, ref="order-1")  # noqa: E731
    assert lose_commit_reply(engine, proxy, hold).applied
    again = retry(engine, hold)
    assert (again.outcome, again.same_request) == (Outcome.REPEATED, True)
    assert (_amount(engine, 1), _amount(engine, 2)) == (3, 4)
    proxy.cuts = 0
    give_back = lambda s: release(s, Stock.amount, "order-1")  # noqa: E731
    assert lose_commit_reply(engine, proxy, give_back).applied
    again = retry(engine, give_back)
    assert (again.outcome, again.same_request) == (Outcome.REPEATED, True)
    assert (_amount(engine, 1), _amount(engine, 2)) == (5, 5)


@pytest.mark.lost_reply
def test_insert_once_retry_learns_its_lost_commit_applied(proxied: tuple[Engine, FaultProxy]) -> None:
    """insert_once whose COMMIT reply was lost is REPEATED with same_request on retry; one row."""
    engine, proxy = proxied
    put = lambda s: insert_once(s, Message, {"message_id": "m-1"})  # noqa: E731
    assert lose_commit_reply(engine, proxy, put).applied
    again = retry(engine, put)
    assert (again.outcome, again.same_request) == (Outcome.REPEATED, True)
    with Session(engine) as s:
        assert s.scalar(select(func.count()).select_from(Message)) == 1


@pytest.mark.lost_reply
def test_consume_once_retry_learns_its_lost_commit_applied(proxied: tuple[Engine, FaultProxy]) -> None:
    """consume_once whose COMMIT reply was lost is REPEATED with same_request on retry."""
    engine, proxy = proxied
    eat = lambda s: consume_once(s, "billing", "msg-1")  # noqa: E731
    assert lose_commit_reply(engine, proxy, eat).applied
    again = retry(engine, eat)
    assert (again.outcome, again.same_request) == (Outcome.REPEATED, True)


@pytest.mark.lost_reply
def test_consume_once_cut_before_commit_retry_applies(proxied: tuple[Engine, FaultProxy]) -> None:
    """consume_once whose connection was lost before the COMMIT is APPLIED on retry."""
    engine, proxy = proxied
    eat = lambda s: consume_once(s, "billing", "msg-1")  # noqa: E731
    lose_connection_before_commit(engine, proxy, eat)
    again = retry(engine, eat)
    assert (again.outcome, again.same_request) == (Outcome.APPLIED, False)


@pytest.mark.lost_reply
def test_consume_token_retry_learns_its_lost_commit_applied(proxied: tuple[Engine, FaultProxy]) -> None:
    """consume_token with a request_id whose COMMIT reply was lost is REPEATED with same_request on retry;
    another request consuming it after is REPEATED without."""
    engine, proxy = proxied
    with Session(engine) as s, s.begin():
        token = issue_token(s, scope="reset", ttl=timedelta(minutes=5))
    eat = lambda s: consume_token(s, token, scope="reset", request_id="req-1")  # noqa: E731
    assert lose_commit_reply(engine, proxy, eat).applied
    again = retry(engine, eat)
    assert (again.outcome, again.same_request) == (Outcome.REPEATED, True)
    other = retry(engine, lambda s: consume_token(s, token, scope="reset", request_id="req-2"))
    assert (other.outcome, other.same_request) == (Outcome.REPEATED, False)
    anonymous = retry(engine, lambda s: consume_token(s, token, scope="reset"))
    assert (anonymous.outcome, anonymous.same_request) == (Outcome.REPEATED, False)


@pytest.mark.lost_reply
def test_consume_token_cut_before_commit_retry_applies(proxied: tuple[Engine, FaultProxy]) -> None:
    """consume_token whose connection was lost before the COMMIT is APPLIED on retry."""
    engine, proxy = proxied
    with Session(engine) as s, s.begin():
        token = issue_token(s, scope="reset", ttl=timedelta(minutes=5))
    eat = lambda s: consume_token(s, token, scope="reset", request_id="req-1")  # noqa: E731
    lose_connection_before_commit(engine, proxy, eat)
    again = retry(engine, eat)
    assert (again.outcome, again.same_request) == (Outcome.APPLIED, False)


@pytest.mark.lost_reply
def test_idempotent_same_transaction_retry_replays_after_lost_commit(
    proxied: tuple[Engine, FaultProxy],
) -> None:
    """An idempotent() block whose COMMIT reply was lost is replayed on retry with its stored response."""
    engine, proxy = proxied
    runs = []
    with Session(engine) as s:
        with idempotent(s, scope="lost", key="k-1") as call:
            runs.append(1)
            call.complete({"charged": 1})
        arm_commit_cut(engine, proxy)
        with pytest.raises(DBAPIError):
            s.commit()
    assert proxy.wait_cut()
    with Session(engine) as s, idempotent(s, scope="lost", key="k-1") as call:
        assert (call.replayed, call.response) == (True, {"charged": 1})
    assert runs == [1]


@pytest.mark.lost_reply
def test_idempotent_separate_retry_replays_after_lost_completion(proxied: tuple[Engine, FaultProxy]) -> None:
    """In separate mode, a completion whose COMMIT reply was lost is replayed on retry, not run again."""
    engine, proxy = proxied
    runs = []
    with Session(engine) as s:
        with pytest.raises(DBAPIError), idempotent(s, scope="lost", key="k-2", mode="separate") as call:
            runs.append(1)
            arm_commit_cut(engine, proxy)  # the claim has committed: this is the completion's
            call.complete({"shipped": 1})
    assert proxy.wait_cut()
    with Session(engine) as s, idempotent(s, scope="lost", key="k-2", mode="separate") as call:
        assert (call.replayed, call.response) == (True, {"shipped": 1})
    assert runs == [1]


@pytest.mark.lost_reply
def test_idempotent_separate_lost_claim_waits_for_its_lease(proxied: tuple[Engine, FaultProxy]) -> None:
    """A separate-mode claim whose COMMIT reply was lost holds the key until its lease ends, then is taken."""
    engine, proxy = proxied
    with Session(engine) as s:
        arm_commit_cut(engine, proxy)
        with pytest.raises(DBAPIError), idempotent(s, scope="lost", key="k-3", mode="separate", lease=LEASE):
            pytest.fail("the block must not run: the claim's reply was lost")
    assert proxy.wait_cut()
    with Session(engine) as s, pytest.raises(RequestInProgress):
        with idempotent(s, scope="lost", key="k-3", mode="separate", lease=LEASE):
            pytest.fail("the lost claim still holds its lease")
    time.sleep(LEASE.total_seconds() + 0.2)
    with Session(engine) as s, idempotent(s, scope="lost", key="k-3", mode="separate", lease=LEASE) as call:
        assert (call.attempt, call.taken_over) == (2, True)
        call.complete("done")


@pytest.mark.lost_reply
def test_new_request_id_is_accepted_as_a_request_id(proxied: tuple[Engine, FaultProxy]) -> None:
    """new_request_id()'s UUID is a request_id as it is (stored as its text), for triggers and tokens."""
    engine, _ = proxied
    _seed(engine, Invoice(id=11))
    rid = new_request_id()
    with Session(engine) as s, s.begin():
        assert Invoice.flow.send(s, 11, request_id=rid).applied
        token = issue_token(s, scope="uuid", ttl=timedelta(minutes=1))
        assert consume_token(s, token, scope="uuid", request_id=rid).applied
    again = retry(engine, lambda s: Invoice.flow.send(s, 11, request_id=str(rid)))
    assert (again.outcome, again.same_request) == (Outcome.REPEATED, True)
    again = retry(engine, lambda s: consume_token(s, token, scope="uuid", request_id=rid))
    assert (again.outcome, again.same_request) == (Outcome.REPEATED, True)


@pytest.mark.lost_reply
def test_striped_decrement_retry_learns_its_lost_commit_applied(proxied: tuple[Engine, FaultProxy]) -> None:
    """A StripedCounter decrement with ref, on the fast path and on the slow path (more than any
    stripe holds), whose COMMIT reply was lost: the retry is REPEATED with same_request, the units
    were taken once; its release, lost the same way, gives them back once."""
    engine, proxy = proxied
    stock = StripedCounter("lost", stripes=4)
    with Session(engine) as s, s.begin():
        stock.create(s, "sku", amount=40)  # stripes of 10
    for ref, by, left in (("small", 3, 37), ("large", 25, 12)):
        take = lambda s, ref=ref, by=by: stock.decrement(s, "sku", by=by, ref=ref)  # noqa: E731
        assert lose_commit_reply(engine, proxy, take).applied
        proxy.cuts = 0
        again = retry(engine, take)
        assert (again.outcome, again.same_request) == (Outcome.REPEATED, True)
        with Session(engine) as s:
            assert stock.total(s, "sku") == left
    give_back = lambda s: stock.release(s, "large")  # noqa: E731
    assert lose_commit_reply(engine, proxy, give_back).applied
    again = retry(engine, give_back)
    assert (again.outcome, again.same_request) == (Outcome.REPEATED, True)
    with Session(engine) as s:
        assert stock.total(s, "sku") == 37


@pytest.mark.lost_reply
def test_striped_decrement_cut_before_commit_retry_applies(proxied: tuple[Engine, FaultProxy]) -> None:
    """A striped decrement whose connection was lost before the COMMIT left nothing: the retry is
    APPLIED and takes the units once."""
    engine, proxy = proxied
    stock = StripedCounter("lost", stripes=4)
    with Session(engine) as s, s.begin():
        stock.create(s, "sku", amount=40)
    take = lambda s: stock.decrement(s, "sku", by=25, ref="order-1")  # noqa: E731
    lose_connection_before_commit(engine, proxy, take)
    with Session(engine) as s:
        assert stock.total(s, "sku") == 40
    again = retry(engine, take)
    assert (again.outcome, again.same_request) == (Outcome.APPLIED, False)
    with Session(engine) as s:
        assert stock.total(s, "sku") == 15


@pytest.mark.lost_reply
@pytest.mark.rollback
def test_release_cut_at_its_savepoint_leaves_nothing_and_the_retry_gives_back_once(
    proxied: tuple[Engine, FaultProxy],
) -> None:
    """release() runs in a savepoint; the connection dies after its RELEASE SAVEPOINT was sent, before
    the reply: nothing was given back (the transaction died with it), the retry gives back once,
    and a third call is REPEATED."""
    engine, proxy = proxied
    _seed(engine, Stock(id=1, amount=5), Stock(id=2, amount=5))
    with Session(engine) as s, s.begin():
        assert reserve(s, Stock.amount, {1: 2, 2: 1}, ref="order-1").applied
    give_back = lambda s: release(s, Stock.amount, "order-1")  # noqa: E731
    lose_reply_inside(engine, proxy, b"RELEASE SAVEPOINT", give_back)
    assert (_amount(engine, 1), _amount(engine, 2)) == (3, 4)
    again = retry(engine, give_back)
    assert (again.outcome, again.same_request) == (Outcome.APPLIED, False)
    assert retry(engine, give_back).outcome is Outcome.REPEATED
    assert (_amount(engine, 1), _amount(engine, 2)) == (5, 5)


@pytest.mark.lost_reply
@pytest.mark.rollback
@pytest.mark.parametrize("ref", [None, "order-1"])
def test_striped_slow_path_cut_at_its_savepoint_leaves_nothing_and_the_retry_takes_once(
    proxied: tuple[Engine, FaultProxy], ref: str | None
) -> None:
    """A striped decrement larger than any stripe takes from several inside a savepoint; the
    connection dies after that savepoint's RELEASE was sent: nothing was taken, the retry takes
    the units once (with a ref, a further retry is REPEATED)."""
    engine, proxy = proxied
    stock = StripedCounter("lost", stripes=4)
    with Session(engine) as s, s.begin():
        stock.create(s, "sku", amount=40)  # stripes of 10
    take = lambda s: stock.decrement(s, "sku", by=25, ref=ref)  # noqa: E731
    lose_reply_inside(engine, proxy, b"RELEASE SAVEPOINT", take)
    with Session(engine) as s:
        assert stock.total(s, "sku") == 40
    assert retry(engine, take).outcome is Outcome.APPLIED
    if ref is not None:
        assert retry(engine, take).outcome is Outcome.REPEATED
    with Session(engine) as s:
        assert stock.total(s, "sku") == 15


@pytest.mark.lost_reply
def test_striped_restripe_retry_after_its_lost_commit_keeps_the_total(
    proxied: tuple[Engine, FaultProxy],
) -> None:
    """A restripe (4 stripes to 8) whose COMMIT reply was lost had committed: the retry restripes
    to the same count again (APPLIED, the same total) and nothing was lost or made up; a
    decrement then takes from the new stripes."""
    engine, proxy = proxied
    stock = StripedCounter("lost", stripes=4)
    with Session(engine) as s, s.begin():
        stock.create(s, "sku", amount=43)
    spread = lambda s: stock.restripe(s, "sku", stripes=8)  # noqa: E731
    first = lose_commit_reply(engine, proxy, spread)
    assert (first.outcome, first.value) == (Outcome.APPLIED, 43)
    proxy.cuts = 0
    again = retry(engine, spread)
    assert (again.outcome, again.value) == (Outcome.APPLIED, 43)
    with Session(engine) as s:
        amounts = stock.stripe_amounts(s, "sku")
        assert (len(amounts), sum(amounts)) == (8, 43)
    assert retry(engine, lambda s: stock.decrement(s, "sku", by=40, ref="after")).applied
    with Session(engine) as s:
        assert stock.total(s, "sku") == 3


@pytest.mark.lost_reply
def test_striped_restripe_cut_midway_changes_nothing_and_the_retry_applies(
    proxied: tuple[Engine, FaultProxy],
) -> None:
    """A restripe (8 stripes to 2) whose connection dies after it sent the DELETE of the stripes the
    new count lacks, before the reply: the transaction died with it, so every stripe is as it was
    (no unit lost with the deleted rows, none counted twice); the retry restripes, keeping the total."""
    engine, proxy = proxied
    stock = StripedCounter("lost", stripes=8)
    with Session(engine) as s, s.begin():
        stock.create(s, "sku", amount=43)
    with Session(engine) as s:
        before = stock.stripe_amounts(s, "sku")
    shrink = lambda s: stock.restripe(s, "sku", stripes=2)  # noqa: E731
    lose_reply_inside(engine, proxy, b"DELETE FROM", shrink)
    with Session(engine) as s:
        assert stock.stripe_amounts(s, "sku") == before
    again = retry(engine, shrink)
    assert (again.outcome, again.value) == (Outcome.APPLIED, 43)
    with Session(engine) as s:
        amounts = stock.stripe_amounts(s, "sku")
        assert (len(amounts), sum(amounts)) == (2, 43)
