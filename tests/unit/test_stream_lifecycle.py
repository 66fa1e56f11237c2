"""A stream worker rebuilds its crashed app even when a task of the old app ignores its cancellation.

`asyncio.run` waits forever for such a task (Faust's recovery loop did, after a crash during a
broker restart: the curate worker stayed alive and idle); `EngineLifecycle.run` gives the
leftover tasks `SHUTDOWN_TIMEOUT_S` and abandons the rest.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from types import SimpleNamespace

import pytest

from astraflow.errors import KafkaLayerError
from stream_apps import lifecycle
from stream_apps.lifecycle import EngineLifecycle

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


class CrashingWorker(EngineLifecycle):
    """Each app run leaves a task that swallows cancellation, then crashes; stops after `runs` runs."""

    def __init__(self, runs: int) -> None:
        self._stop, self.stopped = threading.Event(), threading.Event()
        self.settings = SimpleNamespace(restart_delay_s=0.0)
        self.log = logging.getLogger("test.lifecycle")
        self.handler = SimpleNamespace(name="stubborn")
        self.error = None
        self.runs, self.wanted = 0, runs

    async def run_once(self) -> None:
        self.runs += 1

        async def ignores_cancellation() -> None:
            while True:
                try:
                    await asyncio.sleep(60)
                except asyncio.CancelledError:
                    continue

        self.left = asyncio.ensure_future(ignores_cancellation())
        await asyncio.sleep(0)
        if self.runs >= self.wanted:
            self._stop.set()
        raise KafkaLayerError("the app crashed")


def test_a_task_that_ignores_cancellation_does_not_stop_the_rebuild(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifecycle, "SHUTDOWN_TIMEOUT_S", 0.3, raising=False)
    worker = CrashingWorker(runs=3)
    t = threading.Thread(target=worker.run, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), f"the worker hung after {worker.runs} app run(s)"
    assert worker.runs == 3 and worker.stopped.is_set()
