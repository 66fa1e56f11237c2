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
