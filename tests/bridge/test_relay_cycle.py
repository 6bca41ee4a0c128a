"""Relay and AsyncRelay run one cycle through the steps bridge (run_steps / Awaited): a raising sink
frees its batch at once, a KeyboardInterrupt or a cancel mid-publish propagates and frees the batch,
a sync relay refuses an awaitable from its sink, ``run()`` stops on its event, goes through a
subclassed ``run_once`` and survives failing sinks, and relays in threads share one outbox once each."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from stateguard import (
    AsyncRelay,
    CallableSink,
    InvalidArgument,
    Relay,
    create_tables,
    drop_tables,
    emit,
)
from stateguard.tables import outbox
from tests._support.async_helpers import AsyncTarget, target_from
from tests._support.bridge_pieces import AttrDict, Record
from tests.conftest import Backend, backends_with, capable, count_statements


class Awaitish:
    """An awaitable that is not a coroutine (what some client libraries return)."""

    def __await__(self) -> Iterator[None]:
        yield from asyncio.sleep(0).__await__()


def _emit(engine: Engine, n: int, *, key: str | None = "k", topic: str = "t") -> list[int]:
    with Session(engine) as session, session.begin():
        return [emit(session, topic, {"n": i}, key=key) for i in range(n)]


def _rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(outbox).order_by(outbox.c.id)))


def _unpublished(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).where(outbox.c.published_ms.is_(None))) or 0)


def _free_and_unpublished(engine: Engine) -> bool:
    return all(r.published_ms is None and r.claimed_until_ms is None for r in _rows(engine))


@pytest.fixture(params=["aiosqlite", "asyncpg", "aiomysql"])
def target(request: pytest.FixtureRequest) -> AsyncTarget:
    return target_from(request)


# --------------------------------------------------------------------------
# Relay (sync): the cycle run at once through run_steps
# --------------------------------------------------------------------------


def test_sink_raising_releases_the_batch_at_once_and_the_next_round_publishes_it(
    backend: Backend, engine: Engine
) -> None:
    """A sink that is down: the round raises, the claim is released at once (not left for the lease), and
    the next round publishes the batch."""
    ids = _emit(engine, 3)
    calls: list[list[int]] = []
    down = True

    def flaky(events: Any) -> None:
        calls.append([e.id for e in events])
        if down:
            raise ConnectionError("broker down")

    relay = Relay(engine, CallableSink(flaky), lease=timedelta(minutes=10))
    with pytest.raises(ConnectionError, match="broker down"):
        relay.run_once()
    # Two failed calls and nothing taken: the relay stops taking the batch apart (the sink is down).
    assert len(calls) == 2 and calls[0] == ids
    assert _free_and_unpublished(engine)  # released at once, not left for the 10-minute lease
    down = False
    calls.clear()
    assert relay.run_once() == 3
    assert calls == [ids]
    assert _unpublished(engine) == 0


def test_a_sink_failing_once_gets_the_batch_again_in_halves_in_the_same_round(
    backend: Backend, engine: Engine
) -> None:
    """One failed sink call: the relay publishes the batch again in halves, earliest first, in the round."""
    ids = _emit(engine, 3)
    calls: list[list[int]] = []

    def flaky(events: Any) -> None:
        calls.append([e.id for e in events])
        if len(calls) == 1:
            raise ConnectionError("broker hiccup")

    relay = Relay(engine, CallableSink(flaky), lease=timedelta(minutes=10))
    assert relay.run_once() == 3
    assert calls == [ids, ids[:1], ids[1:]]
    assert _unpublished(engine) == 0


@pytest.mark.cancel
def test_keyboard_interrupt_mid_publish_propagates_and_frees_the_batch(
    backend: Backend, engine: Engine
) -> None:
    """A BaseException in the sink is not swallowed by the cycle or by run(), and frees the claim."""
    _emit(engine, 2)

    def interrupted(events: Any) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Relay(engine, CallableSink(interrupted)).run(threading.Event(), idle_sleep=0.01)
    assert _free_and_unpublished(engine)


@pytest.mark.cancel
@pytest.mark.parametrize("hold", ["lease", "locks"])
def test_keyboard_interrupt_mid_claim_claims_nothing(backend: Backend, engine: Engine, hold: str) -> None:
    """A KeyboardInterrupt inside the claim's transaction rolls it back: no event stays claimed."""
    _emit(engine, 2)

    class Interrupted(Relay):
        def _claim(self, conn: Any, owner: str) -> Any:
            super()._claim(conn, owner)  # the claim's statement(s) ran in this transaction
            raise KeyboardInterrupt

        def _claim_held(self, conn: Any) -> Any:
            super()._claim_held(conn)  # the rows are locked by this transaction
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Interrupted(engine, CallableSink(lambda events: None), hold=hold).run_once()
    # PostgreSQL's lease claim is one autocommitted statement (a writable CTE): the lease stays.
    # Held by row locks, the claim dies with its transaction: the events are free at once.
    if hold == "locks" or not capable(backend, "writable_cte"):
        assert _free_and_unpublished(engine)
    assert all(r.published_ms is None for r in _rows(engine))


@pytest.mark.parametrize("reply", ["coroutine", "awaitable object"])
def test_a_sync_relay_refuses_an_awaitable_from_its_sink_and_keeps_the_batch(
    backend: Backend, engine: Engine, reply: str
) -> None:
    """Any awaitable the sink returns (not only a coroutine) is InvalidArgument; nothing is marked."""
    _emit(engine, 1)

    async def coro() -> None:
        return None

    def publish(events: Any) -> Any:
        return coro() if reply == "coroutine" else Awaitish()

    relay = Relay(engine, CallableSink(publish))
    with pytest.raises(InvalidArgument, match="AsyncRelay"):
        relay.run_once()
    assert _free_and_unpublished(engine)
    # run() stops on it too (a non-retryable stateguard error), instead of republishing forever
    with pytest.raises(InvalidArgument):
        relay.run(threading.Event(), idle_sleep=0.01)


def test_run_stops_when_another_thread_sets_the_event_during_a_long_idle(sqlite: Backend) -> None:
    """stop_event set from another thread wakes run() out of its idle_sleep at once."""
    engine = sqlite.engine
    drop_tables(engine)
    create_tables(engine)
    try:
        stop = threading.Event()
        relay = Relay(engine, CallableSink(lambda events: None))
        runner = threading.Thread(target=relay.run, args=(stop,), kwargs={"idle_sleep": 600})
        runner.start()
        time.sleep(0.3)
        started = time.monotonic()
        stop.set()
        runner.join(10)
        assert not runner.is_alive() and time.monotonic() - started < 5
    finally:
        drop_tables(engine)


@pytest.mark.hostile
@pytest.mark.parametrize("idle_sleep", [0, -1, float("nan"), float("inf"), "1", True, None, timedelta(0)])
def test_bad_idle_sleep_is_invalid_argument_before_any_statement(sqlite: Backend, idle_sleep: Any) -> None:
    engine = sqlite.engine
    create_tables(engine)
    relay = Relay(engine, CallableSink(lambda events: None))
    with count_statements(engine) as sent, pytest.raises(InvalidArgument, match="idle_sleep"):
        relay.run(threading.Event(), idle_sleep=idle_sleep)
    assert len(sent) == 0


@pytest.mark.hostile
def test_wrong_engines_are_typed_errors_naming_the_other_class(sqlite: Backend) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = sqlite.engine
    async_engine = create_async_engine("sqlite+aiosqlite://")
    sink = CallableSink(lambda events: None)
    with pytest.raises(InvalidArgument, match="use AsyncRelay"):
        Relay(async_engine, sink)  # type: ignore[arg-type]
    with Session(engine) as session, engine.connect() as conn:
        for wrong in (session, conn, "sqlite://", None):
            with pytest.raises(InvalidArgument, match="Relay needs an Engine"):
                Relay(wrong, sink)  # type: ignore[arg-type]
            with pytest.raises(InvalidArgument, match="AsyncRelay needs an AsyncEngine"):
                AsyncRelay(wrong, sink)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="AsyncRelay needs an AsyncEngine, got Engine"):
        AsyncRelay(engine, sink)  # type: ignore[arg-type]
    # the engine is judged before the sink: the message names the engine, not the sink
    with pytest.raises(InvalidArgument, match="needs an Engine"):
        Relay(None, object())  # type: ignore[arg-type]
    asyncio.run(async_engine.dispose())


def test_run_goes_through_a_subclassed_run_once(backend: Backend, engine: Engine) -> None:
    """run() calls run_once() (the CLI counts with it): a subclass sees every round."""
    _emit(engine, 5)
    stop = threading.Event()
    rounds: list[int] = []

    class Counting(Relay):
        def run_once(self) -> int:
            n = super().run_once()
            rounds.append(n)
            if sum(rounds) == 5:
                stop.set()
            return n

    Counting(engine, CallableSink(lambda events: None), batch=2).run(stop, idle_sleep=0.01)
    assert rounds == [2, 2, 1]
    assert _unpublished(engine) == 0


@pytest.mark.parametrize("backend", backends_with("concurrent_writers"), indirect=True)
def test_four_relay_threads_share_one_outbox_once_each_in_key_order(backend: Backend) -> None:
    engine = backend.engine
    drop_tables(engine)
    create_tables(engine)
    try:
        with Session(engine) as session, session.begin():
            ids = [emit(session, "t", {"n": i}, key=f"k{i % 7}") for i in range(140)]
        seen: list[tuple[str, int]] = []
        lock = threading.Lock()

        def publish(events: Any) -> None:
            with lock:
                seen.extend((e.key, e.id) for e in events)

        def work() -> None:
            relay = Relay(engine, CallableSink(publish), batch=5)
            idle = 0
            while idle < 3:
                idle = idle + 1 if relay.run_once() == 0 else 0

        with ThreadPoolExecutor(4) as pool:
            for f in [pool.submit(work) for _ in range(4)]:
                f.result()
        assert sorted(i for _, i in seen) == ids  # each once
        per_key: dict[str, list[int]] = defaultdict(list)
        for key, i in seen:
            per_key[key].append(i)
        assert all(v == sorted(v) for v in per_key.values())
        assert _unpublished(engine) == 0
    finally:
        drop_tables(engine)


@pytest.mark.parametrize("ack", ["AttrDict", "Record"])
def test_a_sink_returning_an_attribute_access_ack_gets_its_batch_once(
    backend: Backend, engine: Engine, ack: str
) -> None:
    # README: "A sink is any object with publish(events): it ... returns once the batch is
    # accepted" -- what it returns is not constrained, and in an earlier version it was ignored.  Now
    # Relay._publish passes the reply to _async.step(), which asks hasattr(reply, "__await__") on
    # the *instance*: an AttrDict raises KeyError('__await__') from the hasattr, a permissive record
    # answers None and step() calls it (TypeError).  The cycle treats that as a sink failure AFTER
    # the sink accepted the batch: the batch is released, never marked, and every round publishes
    # it again (Relay.run() logs and loops: the same events are delivered forever).
    _emit(engine, 1)
    calls: list[int] = []

    def publish(events: Any) -> Any:
        calls.append(len(events))
        return AttrDict(offset=1) if ack == "AttrDict" else Record(offset=1)

    relay = Relay(engine, CallableSink(publish))
    assert relay.run_once() == 1
    assert relay.run_once() == 0
    assert calls == [1] and _unpublished(engine) == 0


# --------------------------------------------------------------------------
# AsyncRelay: the same cycle awaited through Awaited
# --------------------------------------------------------------------------


async def _async_tables(engine: Any) -> None:
    await drop_tables(engine)
    await create_tables(engine)


async def _async_emit(engine: Any, n: int, key: str | None = "k") -> list[int]:
    async with AsyncSession(engine) as session, session.begin():
        return [await emit(session, "t", {"n": i}, key=key) for i in range(n)]


async def _async_rows(engine: Any) -> list[Any]:
    async with engine.connect() as conn:
        return list(await conn.execute(select(outbox).order_by(outbox.c.id)))


@pytest.mark.cancel
def test_async_relay_cancelled_mid_publish_frees_the_batch_at_once(target: AsyncTarget) -> None:
    """CancelledError in an async sink propagates; the claim is released (awaited) before it does."""

    async def main() -> None:
        engine = target.engine()
        try:
            await _async_tables(engine)
            ids = await _async_emit(engine, 3)
            entered = asyncio.Event()

            async def hang(events: Any) -> None:
                entered.set()
                await asyncio.sleep(3600)

            relay = AsyncRelay(engine, CallableSink(hang), lease=timedelta(minutes=10))
            task = asyncio.create_task(relay.run_once())
            await asyncio.wait_for(entered.wait(), 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            rows = await _async_rows(engine)
            assert all(r.published_ms is None and r.claimed_until_ms is None for r in rows)
            got: list[int] = []

            async def ok(events: Any) -> None:
                got.extend(e.id for e in events)

            assert await AsyncRelay(engine, CallableSink(ok)).run_once() == 3
            assert got == ids
            await drop_tables(engine)
        finally:
            await engine.dispose()

    asyncio.run(main())


@pytest.mark.failing_observer
def test_async_relay_run_survives_a_failing_sink_and_stops_on_its_event(target: AsyncTarget) -> None:
    """run(): a sink error is logged and retried after idle_sleep; sync and async sinks both work;
    stop set by another task ends it."""

    async def main() -> None:
        engine = target.engine()
        try:
            await _async_tables(engine)
            ids = await _async_emit(engine, 4)
            got: list[int] = []
            failures = [2]

            def sync_sink(events: Any) -> None:  # a plain function sink on the async relay
                if failures[0]:
                    failures[0] -= 1
                    raise ConnectionError("broker down")
                got.extend(e.id for e in events)

            stop = asyncio.Event()
            relay = AsyncRelay(engine, CallableSink(sync_sink), batch=3)
            runner = asyncio.create_task(relay.run(stop, idle_sleep=0.01))

            async def stopper() -> None:
                while len(got) < 4:
                    await asyncio.sleep(0.01)
                stop.set()

            await asyncio.wait_for(asyncio.gather(runner, stopper()), 60)
            assert got == ids and failures == [0]
            rows = await _async_rows(engine)
            assert all(r.published_ms is not None for r in rows)
            await drop_tables(engine)
        finally:
            await engine.dispose()

    asyncio.run(main())


@pytest.mark.hostile
def test_async_relay_bad_idle_sleep_is_invalid_argument(sqlite: Backend) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    async def main() -> None:
        engine = create_async_engine("sqlite+aiosqlite://")
        relay = AsyncRelay(engine, CallableSink(lambda events: None))
        for bad in (0, -1, float("nan"), "1", None):
            with pytest.raises(InvalidArgument, match="idle_sleep"):
                await relay.run(asyncio.Event(), idle_sleep=bad)  # type: ignore[arg-type]
        await engine.dispose()

    asyncio.run(main())


@pytest.mark.cancel
def test_async_relays_cancelled_at_random_points_lose_nothing(pg: Backend) -> None:
    """Relays cancelled mid-claim / mid-publish / mid-mark at random (wait_for timeouts), then a
    relay drains: every event is published, none is left claimed past its lease."""
    from tests._support.async_helpers import async_target

    target = async_target("asyncpg", pg)

    async def main() -> set[int]:
        engine = target.engine()
        try:
            await _async_tables(engine)
            async with AsyncSession(engine) as session, session.begin():
                ids = [await emit(session, "t", {"n": i}, key=f"k{i % 5}") for i in range(60)]
            got: set[int] = set()

            async def publish(events: Any) -> None:
                await asyncio.sleep(0.001)
                got.update(e.id for e in events)

            relay = AsyncRelay(engine, CallableSink(publish), batch=4, lease=timedelta(seconds=1))
            for i in range(40):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(relay.run_once(), 0.0005 * (i % 10 + 1))
            await asyncio.sleep(1.2)  # any claim orphaned by a cancellation expires
            for _ in range(100):
                if await relay.run_once() == 0 and got >= set(ids):
                    break
            async with engine.connect() as conn:
                left = await conn.scalar(select(func.count()).where(outbox.c.published_ms.is_(None)))
            assert left == 0
            await drop_tables(engine)
            return got ^ set(ids)
        finally:
            await engine.dispose()

    assert asyncio.run(main()) == set()


def test_async_relay_with_a_sync_sink_returning_an_attrdict_publishes_once(target: AsyncTarget) -> None:
    # same as the sync Relay: AsyncRelay._publish hands the sink's reply to step(), whose
    # hasattr(reply, "__await__") raises KeyError from an AttrDict (an earlier version used
    # inspect.isawaitable, a type check).  The batch was accepted by the sink, then released as a
    # failure and published again on every round.
    async def main() -> tuple[int, int, list[int]]:
        engine = target.engine()
        try:
            await _async_tables(engine)
            await _async_emit(engine, 1)
            calls: list[int] = []

            def publish(events: Any) -> Any:
                calls.append(len(events))
                return AttrDict(offset=7)

            relay = AsyncRelay(engine, CallableSink(publish))
            first = await relay.run_once()
            second = await relay.run_once()
            await drop_tables(engine)
            return first, second, calls
        finally:
            await engine.dispose()

    assert asyncio.run(main()) == (1, 0, [1])
