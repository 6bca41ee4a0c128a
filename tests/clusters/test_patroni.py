"""stateguard on a Patroni pair (two PostgreSQL 15 nodes, ZooKeeper as DCS) started by the tests.

Patroni decides the failovers here, not the test: the primary's machine is crashed (SIGKILL to its
Patroni and its postmaster's process group) and Patroni promotes the standby once the leader's
ZooKeeper session is over; or only the primary's Patroni is killed, and its PostgreSQL, with no
watchdog to stop it, goes on as a writable primary beside the promoted standby.  The engines reach
the primary through a libpq multi-host URL with ``target_session_attrs=read-write``.  The storms
run the acknowledged units of ``tests/_support/failover_units.py`` and count what the failover lost
by running every acknowledged unit again on the new primary.  Each test prints its measured line
(``pytest -s``); docs/explanation/clusters-postgresql.md holds the table.

The pair is brought up once for the module; a test that failed it over leaves the deposed node
to the next test's fixture, which remakes it as a fresh replica.  The asynchronous tests come
first, so Patroni's ``synchronous_mode`` is switched on once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import pytest
from sqlalchemy import Engine
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from stateguard import (
    ConfigurationError,
    ReplicationTimeout,
    ZooKeeperLock,
    emit,
    guarded_update,
    set_durability,
)

from .._support import patroni
from .._support.failover_units import (
    Measured,
    Timed,
    count_losses,
    issue_tokens,
    multi_host_url,
    routing_engine,
    server_port,
    storm,
    timed_storm,
)
from .._support.pg_cluster import DATABASE
from .._support.zk_workers import ZkBase, ZkPayout, client_for, fenced_write
from ._started import fresh_tables, started

pytestmark = pytest.mark.failover

#: A failover starts when the dead leader's ZooKeeper session ends (patroni.SESSION_MS), then
#: Patroni's loop (1 s) promotes; generous for a loaded 2-core machine.
FAILOVER_WITHIN = 30.0
#: How long the test keeps two writable primaries after the promotion (writes go on meanwhile).
HOLD = 2.0
LOCK_PATH = "/sg-fence/payout"


@pytest.fixture(scope="module")
def cluster() -> Iterator[patroni.PatroniPair]:
    """The Patroni pair for this module (a few seconds to start), stopped by pid afterwards."""
    yield from started("a Patroni pair on ZooKeeper", patroni.available, patroni.PatroniPair)


@pytest.fixture
def pair(cluster: patroni.PatroniPair) -> patroni.PatroniPair:
    """The pair made whole (a deposed or dead node remade as a replica), with fresh tables."""
    if not cluster.healthy:
        cluster.repair()
    assert cluster.primary is not None
    fresh_tables(cluster.primary.url, ZkBase.metadata)
    cluster.wait_replayed()
    return cluster


def routing_url(pair: patroni.PatroniPair, *, deposed_first: bool = False) -> str:
    """Both nodes in one URL: the standby first (reaching the primary proves the routing), or the
    primary first (``deposed_first``: the client that keeps writing to it once it is deposed)."""
    assert pair.primary is not None and pair.standby is not None
    nodes = (pair.primary, pair.standby) if deposed_first else (pair.standby, pair.primary)
    return multi_host_url([node.port for node in nodes], DATABASE)


def node_engine(node: patroni.PatroniNode) -> Engine:
    """An engine on one node only (its writes go there whatever Patroni thinks of it)."""
    return routing_engine(multi_host_url([node.port], DATABASE))


def wait_routed(engine: Engine, port: int, since: float) -> float:
    """Seconds from ``since`` until ``engine`` hands out a writable session on ``port``."""
    deadline = since + FAILOVER_WITHIN
    while time.monotonic() < deadline:
        engine.dispose()
        try:
            if server_port(engine) == port:
                return time.monotonic() - since
        except sa_exc.OperationalError:  # the dead node refuses, the standby is still read-only
            pass
        time.sleep(0.05)
    raise AssertionError(f"no writable session on port {port} within {FAILOVER_WITHIN}s of the kill")


def seed_payout(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        s.add(ZkPayout(id=1, holder=None))


def durable_fenced_write(engine: Engine, holder: str, fence: int) -> str:
    """:func:`fenced_write` in a transaction that also emits an event with ``durability="replicated"``."""
    with Session(engine) as s, s.begin():
        emit(s, "payout", {"holder": holder}, durability="replicated")
        version = s.get_one(ZkPayout, 1).version
        return guarded_update(
            s, ZkPayout, 1, {"holder": holder}, expected_version=version, fence=fence
        ).outcome.name


def holder_on(node: patroni.PatroniNode) -> Any:
    return node.scalar("SELECT holder FROM zk_payouts WHERE id = 1")


def kill_node_storm(pair: patroni.PatroniPair, engine: Engine, tokens: list[str]) -> tuple[Measured, float]:
    """4 writers; the primary's machine crashed after 80 acks; Patroni fails over. (measured, seconds)."""
    assert pair.standby is not None
    standby = pair.standby
    killed: list[float] = []
    measured = storm(engine, tokens, writers=4, kill_after=80, kill=lambda: killed.append(pair.kill_node()))
    took = wait_routed(engine, standby.port, killed[0])
    pair.wait_promoted()
    return measured, took


# -- failovers Patroni decides: the primary's machine crashed --------------------------------------


def test_an_asynchronous_patroni_failover_mid_storm_is_measured_and_the_url_reaches_the_new_primary(
    pair: patroni.PatroniPair,
) -> None:
    """Async standby, primary node SIGKILLed under 4 writers: Patroni promotes, the URL follows."""
    pair.set_synchronous(False)
    assert pair.primary is not None and pair.standby is not None
    engine = routing_engine(routing_url(pair))
    try:
        assert server_port(engine) == pair.primary.port  # the standby, listed first, was skipped
        tokens = issue_tokens(engine, 400)
        pair.wait_replayed()
        measured, took = kill_node_storm(pair, engine, tokens)
        count_losses(engine, tokens, measured)
        print(measured.line("async, primary node SIGKILLed mid-storm, durability local", "patroni"))
        print(f"patroni | failover: kill to a write accepted through the URL {took:.2f} s")
        # What the async standby had received is timing: only the bookkeeping is asserted.
        assert measured.tokens_twice == measured.lost <= len(measured.acknowledged)
        assert took < FAILOVER_WITHIN
    finally:
        engine.dispose()


# -- no watchdog: the primary's Patroni dies, its PostgreSQL does not --------------------------------


@dataclass
class SplitBrain:
    """Only the primary's Patroni killed mid-storm: the deposed primary (``old``) still writable beside
    the promoted standby (``new``); A held the ZooKeeper lock before, B holds it after (larger fence)."""

    old: patroni.PatroniNode
    new: patroni.PatroniNode
    on_old: Engine
    on_new: Engine
    tokens: list[str]
    timed: Timed
    join: Callable[[], None]
    errors: list[BaseException]
    fence_a: int
    fence_b: int
    killed: float
    promoted: float

    def measured(self) -> Measured:
        """What the writers saw acknowledged, counted against the new primary (after ``join()``)."""
        timed = self.timed
        measured = Measured(acknowledged=[n for n, _, _ in timed.acknowledged], in_doubt=timed.in_doubt)
        count_losses(self.on_new, self.tokens, measured)
        return measured


@contextmanager
def patroni_killed_mid_storm(
    pair: patroni.PatroniPair, writers_engine: Engine, *, durability: Literal["replicated"] | None = None
) -> Iterator[SplitBrain]:
    """3 writers on ``writers_engine`` (``durability`` for them, 1 s); A's fenced write on the
    primary; then only its Patroni SIGKILLed, the promotion awaited, A's lock ended and B's taken.
    Everything stopped, closed and disposed afterwards."""
    assert pair.primary is not None and pair.standby is not None
    old, new = pair.primary, pair.standby
    on_old, on_new = node_engine(old), node_engine(new)
    assert pair.zookeeper is not None
    zk_a, zk_b = client_for(pair.zookeeper.hosts), client_for(pair.zookeeper.hosts)
    stop = threading.Event()
    errors: list[BaseException] = []
    join = None
    try:
        tokens = issue_tokens(writers_engine, 1500)
        seed_payout(on_old)
        fence_a = ZooKeeperLock(zk_a, LOCK_PATH, identifier="A").acquire(timeout=10)
        assert fenced_write(on_old, "A", fence_a) == "APPLIED"
        pair.wait_replayed()
        if durability is not None:
            set_durability(writers_engine, durability, timeout=timedelta(seconds=1))
            set_durability(on_old, None, timeout=timedelta(seconds=1))

        timed, join = timed_storm(writers_engine, tokens, writers=3, stop=stop, errors=errors)
        time.sleep(0.5)
        killed = pair.kill_patroni()
        pair.wait_promoted(timeout=FAILOVER_WITHIN)
        promoted = time.monotonic()
        # A's lock ends (its session closed, as when it expires); B takes it: a larger fence.
        zk_a.stop()
        fence_b = ZooKeeperLock(zk_b, LOCK_PATH, identifier="B").acquire(timeout=10)
        assert fence_b > fence_a
        yield SplitBrain(
            old, new, on_old, on_new, tokens, timed, join, errors, fence_a, fence_b, killed, promoted
        )
    finally:
        stop.set()
        if join is not None:
            join()
        for zk in (zk_a, zk_b):
            zk.stop()
            zk.close()
        for engine in (writers_engine, on_old, on_new):
            set_durability(engine, None)
            engine.dispose()


def test_without_a_watchdog_a_primary_whose_patroni_died_stays_writable_and_fences_decide_per_server(
    pair: patroni.PatroniPair,
) -> None:
    """Async standby, only the primary's Patroni SIGKILLed, no watchdog, 3 writers on a URL that lists
    the primary first.

    The old primary's PostgreSQL goes on, writable; Patroni promotes the standby once the dead
    Patroni's ZooKeeper session ends.  A client whose URL lists the old primary first keeps
    writing there: every unit begun after the promotion is acknowledged and lost.  A fence from
    ZooKeeperLock refuses the deposed holder's write (STALE) on each server that has seen the new
    holder's larger fence, and only there.
    """
    pair.set_synchronous(False)
    writers_engine = routing_engine(routing_url(pair, deposed_first=True))
    with patroni_killed_mid_storm(pair, writers_engine) as split:
        old, on_old, on_new = split.old, split.on_old, split.on_new
        fence_a, fence_b = split.fence_a, split.fence_b
        assert old.writable(), "the deposed primary stopped taking writes: something fenced it off"
        fencing = {
            "B on the new primary": fenced_write(on_new, "B", fence_b),
            "A on the new primary": fenced_write(on_new, "A", fence_a),
            # The deposed primary never saw fence B: A's old fence passes there.
            "A on the deposed primary, before B's write reached it": fenced_write(on_old, "A", fence_a),
        }
        # A transaction with a durable call: refused there, nothing written (async: no sync standby).
        with pytest.raises(ConfigurationError, match="synchronous_standby_names is empty"):
            durable_fenced_write(on_old, "A-durable", fence_a)
        assert holder_on(old) == "A"
        fencing["B on the deposed primary"] = fenced_write(on_old, "B", fence_b)
        fencing["A on the deposed primary, after B's write reached it"] = fenced_write(on_old, "A", fence_a)

        time.sleep(max(0.0, split.promoted + HOLD - time.monotonic()))
        still_writable = old.writable()
        window = time.monotonic() - split.promoted
        split.join()
        assert split.errors == [], split.errors
        assert still_writable, "without a watchdog nothing stops the deposed primary"
        # What ends the window here: its Patroni started again (a service manager's restart).
        pair.restart_patroni(old)
        demoted = pair.wait_demoted(old)

        measured = split.measured()
        begun_after = {n for n, began, _ in split.timed.acknowledged if began > split.promoted}
        print(
            measured.line(
                "async, only the primary's Patroni SIGKILLed, no watchdog, durability local", "patroni"
            )
        )
        print(
            f"patroni | no watchdog | kill to promotion {split.promoted - split.killed:.2f} s | both "
            f"primaries writable {window:.2f} s, then its Patroni restarted demoted it in {demoted:.2f} s | "
            f"units begun after the promotion {len(begun_after)}"
        )
        print(f"patroni | fencing | {fencing}")
        assert fencing == {
            "B on the new primary": "APPLIED",
            "A on the new primary": "STALE",
            "A on the deposed primary, before B's write reached it": "APPLIED",
            "B on the deposed primary": "APPLIED",
            "A on the deposed primary, after B's write reached it": "STALE",
        }
        # Begun after the promotion, acknowledged by the deposed primary: the new one cannot have them.
        assert len(begun_after) > 0, "no unit was written to the deposed primary after the promotion"
        assert measured.lost >= len(begun_after)
        assert measured.tokens_twice == measured.lost


# -- synchronous_mode: Patroni keeps a synchronous standby ------------------------------------------


def test_a_synchronous_patroni_failover_mid_storm_loses_no_durable_write_and_consumes_no_token_twice(
    pair: patroni.PatroniPair,
) -> None:
    """synchronous_mode on, durability="replicated", primary node SIGKILLed mid-storm: 0 lost, 0 twice."""
    pair.set_synchronous(True)
    assert pair.primary is not None
    # Non-durable commits do not wait: the durable calls ask for the standby themselves.
    engine = routing_engine(routing_url(pair), local=True)
    try:
        assert server_port(engine) == pair.primary.port
        tokens = issue_tokens(engine, 400)
        pair.wait_replayed()
        set_durability(engine, "replicated")
        measured, took = kill_node_storm(pair, engine, tokens)
        set_durability(engine, None)  # the promoted node has no standby of its own to confirm reruns
        count_losses(engine, tokens, measured)
        print(
            measured.line('sync mode, primary node SIGKILLed mid-storm, durability="replicated"', "patroni")
        )
        print(f"patroni | failover (synchronous_mode): kill to a write accepted through the URL {took:.2f} s")
        assert measured.lost == 0 and measured.tokens_twice == 0
        assert measured.messages_twice == 0 and measured.blocks_twice == 0
        assert took < FAILOVER_WITHIN
    finally:
        set_durability(engine, None)
        engine.dispose()


def test_with_synchronous_mode_a_deposed_primary_cannot_confirm_a_durable_write_it_takes(
    pair: patroni.PatroniPair,
) -> None:
    """synchronous_mode on, only Patroni killed: durable units there raise ReplicationTimeout, none lost."""
    pair.set_synchronous(True)
    writers_engine = routing_engine(routing_url(pair, deposed_first=True), local=True)
    with patroni_killed_mid_storm(pair, writers_engine, durability="replicated") as split:
        old, new, on_old, on_new = split.old, split.new, split.on_old, split.on_new
        assert fenced_write(on_new, "B", split.fence_b) == "APPLIED"
        assert fenced_write(on_new, "A", split.fence_a) == "STALE"
        # A's old fence on the deposed primary, in a durable transaction: committed there, not confirmed.
        with pytest.raises(ReplicationTimeout) as raised:
            durable_fenced_write(on_old, "A-durable", split.fence_a)
        assert raised.value.acknowledged == 0
        assert holder_on(old) == "A-durable" and holder_on(new) == "B"

        time.sleep(max(0.0, split.promoted + HOLD - time.monotonic()))
        split.join()
        assert split.errors == [], split.errors
        set_durability(writers_engine, None)
        measured = split.measured()
        unconfirmed_after = len(split.timed.unconfirmed)
        print(
            measured.line(
                'sync mode, only the primary\'s Patroni SIGKILLed, durability="replicated" 1 s', "patroni"
            )
        )
        print(
            f"patroni | no watchdog, synchronous_mode | kill to promotion "
            f"{split.promoted - split.killed:.2f} s | ReplicationTimeout on the deposed primary "
            f"{unconfirmed_after}"
        )
        assert measured.lost == 0 and measured.tokens_twice == 0
        assert unconfirmed_after > 0, "no unit reached the deposed primary after the promotion"
