"""Ends a workflow that blocks the node's event loop in synchronous code.

The rollout deadline (`astraflow.raas.guard`) is an asyncio timeout: it fires only when the
loop runs. A workflow stuck in synchronous code (`while True: pass`, `time.sleep(3600)`, a
regular expression that backtracks for hours) holds the loop, and with it every rollout,
commit and heartbeat of the node. `StallWatchdog` notices that from a thread: the loop beats
every `beat_s`; when the last beat is older than the deadline and the step the loop is running
belongs to a workflow, it signals the main thread (SIGUSR2), whose handler raises `LoopStalled`
inside that workflow's code. The workflow's guard turns it into an ERROR trajectory like any
other exception. Code that is not a workflow's (a Kafka flush, an import) is never interrupted.
The node uses the rollout deadline, at most 30 s (`STALL_LIMIT_S`): a loop held longer would
also cost the node its consumer-group membership.

Limits: Python runs signal handlers in the main thread only, so the watchdog works when the
node's loop runs there (as `astraflow raas serve` does) and stays off otherwise; C code that
never returns to the interpreter (nor checks for signals) cannot be interrupted at all.
"""

from __future__ import annotations

import asyncio
import asyncio.tasks
import logging
import signal
import threading
import time
import weakref
from typing import Any

log = logging.getLogger("astraflow.raas")

STALL_SIGNAL = signal.SIGUSR2
STALL_LIMIT_S = 30.0  # longest a workflow may hold the loop, whatever the rollout deadline


class LoopStalled(BaseException):
    """Raised inside a workflow that held the node's event loop past the rollout deadline.

    A BaseException, so a workflow's `except Exception` does not swallow it."""


class StallWatchdog:
    """See the module doc. Use as `with StallWatchdog(loop, timeout_s, workflow_tasks): ...`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float,
                 workflow_tasks: weakref.WeakSet[asyncio.Future], beat_s: float = 0.1) -> None:
        self.loop, self.timeout_s, self.tasks, self.beat_s = loop, timeout_s, workflow_tasks, beat_s
        self.interrupted = 0  # workflows stopped so far
        self._last_beat = time.monotonic()
        self._flagged: Any = None  # the task whose step must raise
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beat_handle: asyncio.TimerHandle | None = None
        self._previous: Any = None
        self._current = getattr(asyncio.tasks, "_current_tasks", None)  # loop -> task being stepped

    def __enter__(self) -> StallWatchdog:
        if threading.current_thread() is not threading.main_thread() or not isinstance(self._current, dict):
            log.warning("the stall watchdog is off (the node's loop is not in the main thread): a workflow that "
                        "blocks the event loop cannot be stopped")
            return self
        self._previous = signal.signal(STALL_SIGNAL, self._on_signal)
        self._beat()
        self._thread = threading.Thread(target=self._watch, name="raas-stall-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=5)
        if self._beat_handle is not None:
            self._beat_handle.cancel()
        signal.signal(STALL_SIGNAL, self._previous)

    def _beat(self) -> None:
        self._last_beat = time.monotonic()
        self._beat_handle = self.loop.call_later(self.beat_s, self._beat)

    def _watch(self) -> None:
        main = threading.main_thread().ident
        while not self._stop.wait(min(self.beat_s, self.timeout_s / 4)):
            if time.monotonic() - self._last_beat < self.timeout_s:
                continue
            task = self._current.get(self.loop) if self._current is not None else None
            if task is None or task not in self.tasks or task is self._flagged:
                continue
            self._flagged = task
            log.error("a workflow has held the event loop for %.0f s; interrupting it", self.timeout_s)
            signal.pthread_kill(main, STALL_SIGNAL)

    def _on_signal(self, signum: int, frame: object) -> None:
        task, self._flagged = self._flagged, None
        if task is None or self._current.get(self.loop) is not task:  # type: ignore[union-attr]
            return  # the loop moved on meanwhile: nothing to interrupt
        self._last_beat = time.monotonic()  # the next stall needs a full deadline again
        self.interrupted += 1
        raise LoopStalled(f"the workflow blocked the event loop for more than {self.timeout_s:g} s "
                          "(raas.rollout_timeout_s); run blocking code with asyncio.to_thread")


__all__ = ["STALL_LIMIT_S", "STALL_SIGNAL", "LoopStalled", "StallWatchdog"]
