"""`stream_apps.handover`: Faust's per-record hand-over without tasks when the callback does not
suspend, and Faust's own `wait_first` (a suspended flow abandons the record) when it does."""

from __future__ import annotations

import asyncio
from typing import Any

from mode import Service

from stream_apps.handover import hand_over


class FakeConsumer(Service):
    """What `hand_over` uses of Faust's consumer: `wait_first` (mode's own) and `suspend_flow`."""

    def __init__(self) -> None:
        super().__init__()
        self.suspend_flow = asyncio.Event()
        self.waits = 0

    async def wait_first(self, *coros: Any, timeout: Any = None) -> Any:
        self.waits += 1
        return await super().wait_first(*coros, timeout=timeout)


def test_a_callback_that_does_not_suspend_runs_without_wait_first() -> None:
    async def main() -> None:
        consumer = FakeConsumer()
        got: list[int] = []

        async def callback(message: int) -> None:
            got.append(message)

        for m in range(5):
            await hand_over(consumer, callback, m)
        assert got == [0, 1, 2, 3, 4]
        assert consumer.waits == 0

    asyncio.run(main())


def test_a_callback_that_suspends_is_finished_with_its_results_and_exceptions() -> None:
    async def main() -> None:
        consumer = FakeConsumer()
        loop = asyncio.get_running_loop()
        steps: list[str] = []
        ready: asyncio.Future[str] = loop.create_future()
        failing: asyncio.Future[str] = loop.create_future()

        async def callback(message: int) -> None:
            steps.append(f"start {message}")
            await asyncio.sleep(0)  # a bare yield
            steps.append(await ready)  # a future's result, read by the callback itself
            try:
                await failing
            except ValueError as exc:
                steps.append(f"caught {exc}")

        loop.call_later(0.01, ready.set_result, "ready")
        loop.call_later(0.02, failing.set_exception, ValueError("bad"))
        await hand_over(consumer, callback, 7)
        assert steps == ["start 7", "ready", "caught bad"]
        assert consumer.waits == 1

    asyncio.run(main())


def test_a_suspended_flow_abandons_a_suspended_callback_as_faust_does() -> None:
    async def main() -> None:
        consumer = FakeConsumer()
        loop = asyncio.get_running_loop()
        never: asyncio.Future[None] = loop.create_future()
        ended: list[str] = []

        async def callback(message: int) -> None:
            try:
                await never  # e.g. a full queue
                ended.append("delivered")
            finally:
                ended.append("closed")

        loop.call_later(0.01, consumer.suspend_flow.set)
        await asyncio.wait_for(hand_over(consumer, callback, 1), 5)
        await asyncio.sleep(0)
        assert ended == ["closed"]
        assert never.cancelled()

    asyncio.run(main())


# Refilling after a full queue: Faust's fetch path waited up to a second after the agent's queue
# drained (`stream_apps.handover` module doc). The fakes below carry what Faust's consumer and
# aiokafka's fetcher use; the functions under test are Faust's and aiokafka's own where they can be.

TP0, TP1 = ("rollouts", 0), ("rollouts", 1)


class FlowConsumer(Service):
    """What Faust's `_wait_next_records` and `on_buffer_full` / `on_buffer_drop` use of its consumer."""

    def __init__(self, fetcher: Any = None) -> None:
        super().__init__()
        from types import SimpleNamespace

        self.app = SimpleNamespace(client_only=False, in_recovery=False)
        self.flow_active = True
        self.not_waiting_next_records = asyncio.Event()
        self._active_partitions: set[Any] = {TP0, TP1}  # Faust keeps one set and changes it
        self._paused_partitions: set[Any] = set()
        self._buffered_partitions: set[Any] = set()
        self.fetches: list[set[Any]] = []
        self._thread = SimpleNamespace(_consumer=SimpleNamespace(_fetcher=fetcher), thread_loop=asyncio.get_running_loop())

    def _get_active_partitions(self) -> set[Any]:
        return self._active_partitions

    async def _getmany(self, active_partitions: Any, timeout: float) -> Any:
        self.fetches.append(set(active_partitions))
        return {}


async def _turns(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_with_every_partition_full_the_next_fetch_waits_for_the_drain_not_a_second() -> None:
    from faust.transport.consumer import Consumer

    from stream_apps.handover import buffer_dropped, wait_next_records

    async def main() -> None:
        consumer = FlowConsumer()
        await consumer.start()
        for tp in (TP0, TP1):
            Consumer.on_buffer_full(consumer, tp)  # Faust's own: out of the active partitions
        waiting = asyncio.ensure_future(wait_next_records(consumer, 1.0))
        await _turns()
        assert not waiting.done()
        assert consumer.fetches == []  # nothing to fetch for: it waits
        buffer_dropped(consumer, TP1, Consumer.on_buffer_drop)
        await _turns()  # a few loop turns, far less than the second Faust slept here
        assert waiting.done()
        assert waiting.result() == ({}, {TP1})
        again = await wait_next_records(consumer, 1.0)  # the next round fetches TP1 again
        assert again == ({}, {TP1}) and consumer.fetches == [{TP1}]
        await consumer.stop()

    asyncio.run(main())


def test_a_drained_partition_wakes_the_fetch_that_waits_without_it() -> None:
    """aiokafka's `Fetcher.fetched_records`, waiting for new data for the partitions active when it
    was asked (TP0), returns TP1's records already fetched as soon as TP1 is active again."""
    from types import MethodType, SimpleNamespace

    from aiokafka.consumer.fetcher import Fetcher, FetchResult
    from faust.transport.consumer import Consumer

    from stream_apps.handover import buffer_dropped

    async def main() -> None:
        held = FetchResult(TP1, assignment=None, partition_records=None, backoff=0)
        held.getall = lambda max_records=None: ["r1", "r2"]  # type: ignore[method-assign]
        held.has_more = lambda: False  # type: ignore[method-assign]
        fetcher = SimpleNamespace(
            _subscriptions=SimpleNamespace(reassignment_in_progress=False, is_assigned=lambda tp: True),
            _records={TP1: held}, _fetch_waiters=set(), _closed=False, _loop=asyncio.get_running_loop(),
            _wait_consume_future=None,
        )
        fetcher._notify = MethodType(Fetcher._notify, fetcher)
        fetcher._create_fetch_waiter = MethodType(Fetcher._create_fetch_waiter, fetcher)
        consumer = FlowConsumer(fetcher)
        Consumer.on_buffer_full(consumer, TP1)
        active = consumer._get_active_partitions()
        assert active == {TP0}
        fetch = asyncio.ensure_future(Fetcher.fetched_records(fetcher, active, timeout=30.0))
        await _turns()
        assert not fetch.done()  # TP0 has nothing new; TP1's records are held back
        buffer_dropped(consumer, TP1, Consumer.on_buffer_drop)
        await _turns()
        assert fetch.done()
        assert fetch.result() == {TP1: ["r1", "r2"]}

    asyncio.run(main())


def test_a_drop_for_a_partition_that_was_not_full_changes_nothing() -> None:
    from faust.transport.consumer import Consumer

    from stream_apps.handover import buffer_dropped

    async def main() -> None:
        consumer = FlowConsumer()
        active = consumer._get_active_partitions()
        buffer_dropped(consumer, TP0, Consumer.on_buffer_drop)
        assert active == {TP0, TP1} and consumer._buffered_partitions == set()
        assert getattr(consumer, "_astraflow_buffer_dropped", None) is None

    asyncio.run(main())
