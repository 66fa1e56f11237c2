"""Building, running and stopping a `StreamEngine`'s Faust app (a mixin of `stream_apps.engine.StreamEngine`).

`run()` blocks (the CLI): it builds the Faust app, runs it until it is stopped or crashes, and
builds it again after `restart_delay_s` while the error is not a `ConfigError`, so a worker
outlives broker outages. `start_thread()` runs the same in a thread (tests, benchmarks).

Each app runs in an event loop of its own. When the app has ended, the tasks it left are
cancelled and given `SHUTDOWN_TIMEOUT_S`; tasks that ignore their cancellation are abandoned
with the loop. (`asyncio.run` waits for them forever: after a crash during a broker restart, a
Faust task kept looping through its cancellation, and the worker stayed alive but idle, never
rebuilding its app.)
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astraflow.errors import ConfigError, KafkaLayerError
from astraflow.kafka.offsets import OffsetTracker
from stream_apps.takeover import Takeover

if TYPE_CHECKING:
    import faust

SHUTDOWN_TIMEOUT_S = 15.0  # how long the tasks an ended app left get to finish their cancellation


class EngineLifecycle:
    """The running part of StreamEngine (its attributes are set by StreamEngine.__init__)."""

    handler: Any
    settings: Any
    log: Any
    kafka: Any
    serde: Any
    control: Any
    app: Any
    stats: Any
    group_id: str
    instance_id: str
    source: str | None
    started: threading.Event
    stopped: threading.Event
    error: BaseException | None
    tracker: OffsetTracker
    takeover: Takeover
    _stop: threading.Event
    _loop: asyncio.AbstractEventLoop | None
    _gates: dict[int, asyncio.Lock]
    _tasks: set[asyncio.Future[Any]]
    _dirty: set[int]
    _unsent: dict[int, list[Any]]
    _unsent_bytes: dict[int, int]
    _lingering: dict[int, asyncio.TimerHandle]
    _idle_due: asyncio.TimerHandle | None
    _seen_record: bool
    _bound: bool
    _rereader: Any

    async def publish_metrics(self) -> None:
        raise NotImplementedError

    async def commit(self) -> None:
        raise NotImplementedError

    def build(self) -> faust.App:
        """The Faust app of this worker (call in the thread whose event loop runs it)."""
        from stream_apps.faust_app import build_app

        self.app = build_app(self)
        return self.app

    def run(self) -> None:
        """Blocks until stopped (SIGTERM / SIGINT with `install_signal_handlers`); rebuilds a crashed app."""
        try:
            while not self._stop.is_set():
                self.error = None
                try:
                    self._run_loop()
                except ConfigError:
                    raise  # the user must fix something: retrying cannot help
                except Exception as exc:  # e.g. Kafka unreachable while building the app
                    self.error = exc
                if self._stop.is_set():
                    break
                self.log.error("%s worker ended (%r); starting again in %.0f s", self.handler.name, self.error,
                               self.settings.restart_delay_s)
                self._stop.wait(self.settings.restart_delay_s)
        finally:
            self.stopped.set()

    def _run_loop(self) -> None:
        """`asyncio.run(self.run_once())`, except that leftover tasks get `SHUTDOWN_TIMEOUT_S` (module doc)."""
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self.run_once())
        finally:
            try:
                left = [t for t in asyncio.all_tasks(loop) if not t.done()]
                for t in left:
                    t.cancel()
                if left:
                    _, stuck = loop.run_until_complete(asyncio.wait(left, timeout=SHUTDOWN_TIMEOUT_S))
                    if stuck:
                        self.log.warning("%s: %d task(s) ignored their cancellation for %.0f s and are abandoned: %s",
                                         self.handler.name, len(stuck), SHUTDOWN_TIMEOUT_S,
                                         ", ".join(sorted({t.get_coro().__qualname__ for t in stuck}))[:300])
                for final in (loop.shutdown_asyncgens(), loop.shutdown_default_executor()):  # as asyncio.run, bounded
                    loop.run_until_complete(asyncio.wait([loop.create_task(final)], timeout=SHUTDOWN_TIMEOUT_S))
            finally:
                asyncio.set_event_loop(None)
                loop.close()

    async def run_once(self) -> None:
        """Runs the Faust app until stopped or crashed."""
        self._loop = asyncio.get_running_loop()
        self.tracker = OffsetTracker()
        self.takeover = Takeover(self.tracker, bool(self.handler.tables))
        self._gates, self._tasks, self._dirty, self._unsent, self._unsent_bytes = {}, set(), set(), {}, {}
        self._lingering, self._idle_due = {}, None  # (handles of a previous app's loop never fire)
        self._seen_record = False
        app = self.build()
        own_dir = self.settings.data_dir is None
        data_dir = self.settings.data_dir or Path(tempfile.mkdtemp(prefix=f"faust-{self.handler.name}-"))
        app.conf.datadir = str(data_dir)
        app.in_worker = True  # what faust.Worker sets; Faust enables transactions only in a worker
        try:
            self.bind()
            await app.start()
            self.started.set()
            self.log.info("%s worker %s started (Faust app %s, %s, source %s)", self.handler.name, self.instance_id,
                          self.group_id, self.settings.guarantee, self.source or "none")
            while not self._stop.is_set() and not app.should_stop:
                await asyncio.sleep(0.1)
            if app.crash_reason is not None and self.error is None:
                self.error = app.crash_reason
        except Exception as exc:
            self.error = exc
            self.log.exception("%s worker failed", self.handler.name)
        finally:
            await self._shutdown()
            if own_dir:  # tables live in memory: nothing there outlives the app
                shutil.rmtree(data_dir, ignore_errors=True)

    def bind(self) -> None:
        """Reads the control topic and binds the handler, once per engine (the app may be rebuilt)."""
        from astraflow.control import ControlReader

        if self.control is None:
            self.control = ControlReader(self.kafka, self.settings.experiment, self.handler.name, serde=self.serde).start()
        if not self._bound:  # a failed bind (Kafka unreachable) is tried again with the next app
            self.handler.bind(self)
            self._bound = True
        self.control.refresh()

    async def _shutdown(self) -> None:
        app = self.app
        try:
            if self._tasks:
                await asyncio.wait(self._tasks, timeout=10.0)
            if self.started.is_set() and app.crash_reason is None:
                await self.commit()  # what finished since the last commit interval (a graceful stop)
            if self.started.is_set() and app.producer is not None:
                try:
                    await self.publish_metrics()
                except Exception as exc:
                    self.log.warning("last metrics not published: %r", exc)
            await app.stop()
        except Exception as exc:
            self.log.warning("%s: Faust app did not stop cleanly: %r", self.handler.name, exc)
        self.log.info("%s worker %s stopped: %d in, %d out, %d dead-lettered, %d dropped; %d held back while tables "
                      "recovered, %d handed over twice", self.handler.name, self.instance_id, self.stats.records_in,
                      self.stats.records_out, self.stats.dead_lettered_total, self.stats.dropped_total,
                      self.takeover.held_back, self.takeover.redelivered)

    def close(self) -> None:
        """Releases what outlives the app (the control reader, the handler's readers)."""
        self.handler.close()
        if self._rereader is not None:
            self._rereader.close()
            self._rereader = None
        if self.control is not None:
            self.control.close()  # kept: tests and callers may still read what it last saw

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the worker gracefully (main thread only)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def start_thread(self) -> threading.Thread:
        """Runs the worker in a thread (tests, benchmarks); returns it once the worker started."""
        t = threading.Thread(target=self._run_quietly, name=f"worker-{self.handler.name}", daemon=True)
        t.start()
        while not self.started.wait(0.05):
            if self.stopped.is_set():
                raise self.error or KafkaLayerError(f"{self.handler.name} worker stopped before starting")
        return t

    def _run_quietly(self) -> None:
        try:
            self.run()
        except BaseException:
            self.log.exception("%s worker failed", self.handler.name)
        finally:
            self.close()

