"""Runs a user processor (`@astraflow.processor`) as a Faust stream worker (`stream_apps.engine`).

    astraflow process run my_module:my_function --experiment EXP

The consumer group is `af.<experiment>.proc.<name>`: start the same command several times and
the workers split the source's partitions. The sink topic is created (as many partitions as
the source, delete policy) if it does not exist. What the function returns:

* a record -> one output to the sink, keyed like the input;
* a list (or tuple) -> one output per item; an empty list drops the input;
* `None` -> the input is dropped (counted in `dropped_total{reason="<name>"}`);
* `Emit(record, key=..., topic=...)` -> that key and/or topic (a stream name or a full name).

An exception raised by the function dead-letters the input: the dead letter's `component` is
`proc.<name>` (so every summary can tell the processor's dead letters from the pipeline's), its
`strategy` the processor's name, and its `error` the exception followed by the traceback (its
last `TRACEBACK_BYTES`). Outputs that have a `lineage` list get `StrategyRef(<name>, "process",
<qualified function name>, <version>)` appended.

A failing processor cannot go unnoticed (`FailureWatch`): every `progress_interval_s` (10 s) the
worker logs a progress line (in, out, dead-lettered, dropped, rate); when more than half of its
last 100 records failed it logs an error saying so, with the last error and how to read the dead
letters; after `max_consecutive_failures` failures in a row (0: never) it stops, and
`astraflow process run` exits with status 1 naming the last error.
"""

from __future__ import annotations

import inspect
import time
import traceback
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from astraflow.errors import ConfigError
from astraflow.kafka.received import Received
from astraflow.processor import Emit, Processor, component_of
from astraflow.records import StrategyRef
from stream_apps.handler import AppHandler, StrategyFailed

TRACEBACK_BYTES = 4096  # most bytes of a traceback kept in a dead letter (its end: where it was raised)
WINDOW = 100  # records the failure rate is taken over
MIN_RECORDS = 10  # ...once at least this many were handled
DEFAULT_MAX_CONSECUTIVE_FAILURES = 1000  # `astraflow process run --max-consecutive-failures`


def traceback_tail(exc: BaseException, limit: int = TRACEBACK_BYTES) -> str:
    """The formatted traceback of `exc`, at most `limit` bytes of UTF-8: its end, where it was raised."""
    text = "".join(traceback.format_exception(exc)).rstrip("\n")
    data = text.encode()
    if len(data) <= limit:
        return text
    return "[...]" + data[len(data) - limit + 5:].decode(errors="ignore")


@dataclass
class FailureWatch:
    """Outcomes of a processor's last `WINDOW` records and its failures in a row (see the module doc)."""

    max_consecutive: int = DEFAULT_MAX_CONSECUTIVE_FAILURES  # stop after this many failures in a row (0: never)
    recent: deque[bool] = field(default_factory=lambda: deque(maxlen=WINDOW))  # True: the record failed
    consecutive: int = 0  # failures since the last success
    last_error: str = ""  # `ErrorClass: message` of the latest failure

    def record(self, failed: bool, error: BaseException | None = None) -> None:
        self.recent.append(failed)
        self.consecutive = self.consecutive + 1 if failed else 0
        if error is not None:
            self.last_error = f"{type(error).__name__}: {error}"[:300]

    @property
    def failing(self) -> bool:
        """More than half of the last `WINDOW` records (at least `MIN_RECORDS` of them) failed."""
        return len(self.recent) >= MIN_RECORDS and sum(self.recent) * 2 > len(self.recent)

    @property
    def exhausted(self) -> bool:
        return 0 < self.max_consecutive <= self.consecutive


class ProcessorApp(AppHandler):
    """Wraps one `Processor` (see the module doc)."""

    def __init__(self, proc: Processor, max_consecutive_failures: int = DEFAULT_MAX_CONSECUTIVE_FAILURES,
                 progress_interval_s: float = 10.0) -> None:
        if max_consecutive_failures < 0:
            raise ConfigError(f"--max-consecutive-failures must be 0 (never stop) or more, got {max_consecutive_failures}")
        self.proc = proc
        self.name = component_of(proc.name)
        self.expect = proc.expect
        self.sources = (proc.source,)
        self.ref = StrategyRef(proc.name, "process", f"{proc.fn.__module__}.{proc.fn.__qualname__}", proc.version)
        # status and the live page draw the processor between these streams (stream names or full topic names)
        self.metric_labels = {"source": proc.source, "sink": proc.sink or ""}
        self.watch = FailureWatch(max_consecutive_failures)
        self.progress_interval_s = progress_interval_s
        self.gave_up: str | None = None  # why the processor stopped itself (too many failures in a row)
        self._last_progress = time.monotonic()
        self._last_shown: tuple[int, int, int] | None = None
        self._last_warned = 0.0

    def bind(self, worker: Any) -> None:
        super().bind(worker)
        self.sink = worker.topics.stream(self.proc.sink) if self.proc.sink else None
        if self.sink is not None:
            self._ensure_topic(self.sink, worker.topics.stream(self.proc.source))

    def _ensure_topic(self, topic: str, like: str) -> None:
        from astraflow.kafka.topics import TopicAdmin, TopicSpec, stream_spec

        admin = TopicAdmin(self.worker.kafka)
        existing = admin.list(topic)
        if topic in existing:
            return
        source = admin.list(like).get(like)
        if source is None:
            raise ConfigError(f"source topic {like} does not exist; create the experiment's topics with `astraflow topics create`")
        t = self.worker.topics
        if t.of_experiment(topic):  # as `astraflow topics create --stream` makes it, with the source's partitions
            spec = stream_spec(t.experiment, topic.removeprefix(t.prefix), self.worker.settings.topics, source)
        else:
            spec = TopicSpec(topic, source, {"cleanup.policy": "delete"})
        admin.create([spec], self.worker.settings.topics.replication_factor)

    def handle(self, inc: Received[Any]) -> Awaitable[None] | None:
        if self.proc.is_async:
            return self._call_async(inc)
        try:
            result = self.proc.fn(inc.record)
        except Exception as exc:  # user code: any exception dead-letters the record, by processor name
            raise self._failed(exc) from exc
        if inspect.isawaitable(result):  # a sync function that returned a coroutine
            return self._finish_async(inc, result)
        self._emit_counted(inc, result)
        return None

    async def _call_async(self, inc: Received[Any]) -> None:
        await self._finish_async(inc, self.proc.fn(inc.record))

    async def _finish_async(self, inc: Received[Any], awaitable: Awaitable[Any]) -> None:
        try:
            result = await awaitable
        except Exception as exc:
            raise self._failed(exc) from exc
        self._emit_counted(inc, result)

    def _emit_counted(self, inc: Received[Any], result: Any) -> None:
        try:
            self._emit(inc, result)
        except StrategyFailed as exc:  # returned something the runner cannot send
            self._note(True, exc)
            raise
        self._note(False)

    def _failed(self, exc: BaseException) -> StrategyFailed:
        """The StrategyFailed that dead-letters the record, with the traceback; counts the failure."""
        failed = StrategyFailed(self.proc.name, exc, detail=traceback_tail(exc))
        self._note(True, exc)
        return failed

    def _note(self, failed: bool, error: BaseException | None = None) -> None:
        self.watch.record(failed, error)
        now = time.monotonic()
        if failed and self.watch.failing and now - self._last_warned >= self.progress_interval_s:
            self._last_warned = now
            self._warn()
        if self.watch.exhausted and self.gave_up is None:
            self.gave_up = (f"processor {self.proc.name} stopped: {self.watch.consecutive} records failed in a row "
                            f"(--max-consecutive-failures {self.watch.max_consecutive}); last error: "
                            f"{self.watch.last_error}. {self._where()}")
            self.worker.log.error("%s", self.gave_up)
            self.worker.stop()

    def _where(self) -> str:
        exp = self.worker.settings.experiment
        return (f"Its dead letters (original record, error, traceback) are on {self.worker.topics.dlq} with component "
                f"{self.name}: astraflow logs show -e {exp} -t dlq --filter \"component == '{self.name}'\"")

    def _warn(self) -> None:
        w = self.watch
        self.worker.log.error(
            "PROCESSOR %s IS FAILING: %d of its last %d records raised (last error: %s); they are dead-lettered, "
            "not processed. %s", self.proc.name, sum(w.recent), len(w.recent), w.last_error, self._where())

    def tick(self, now: float) -> None:
        """Every `progress_interval_s`: a progress line (when something changed, else once a minute)."""
        if now - self._last_progress < self.progress_interval_s:
            return
        stats = self.worker.stats
        shown = (stats.records_in, stats.records_out, stats.dead_lettered_total)
        if shown == self._last_shown and now - self._last_progress < 60.0:
            return
        last = self._last_shown or (0, 0, 0)
        span = max(now - self._last_progress, 1e-6)
        self._last_progress, self._last_shown = now, shown
        self.worker.log.info("processor %s: %s in, %s out, %s dead-lettered, %s dropped; %.1f records/s in the last "
                             "%.0f s", self.proc.name, f"{shown[0]:,}", f"{shown[1]:,}", f"{shown[2]:,}",
                             f"{stats.dropped_total:,}", (stats.records_in - last[0]) / span, span)
        if self.watch.failing and now - self._last_warned >= self.progress_interval_s:
            self._last_warned = now
            self._warn()

    def _emit(self, inc: Received[Any], result: Any) -> None:
        items = list(result) if isinstance(result, list | tuple) else ([] if result is None else [result])
        if not items:
            self.worker.drop(self.proc.name)
            return
        for item in items:
            emit = item if isinstance(item, Emit) else Emit(item)
            topic = self.worker.topics.stream(emit.topic) if emit.topic else self.sink
            if topic is None:
                raise StrategyFailed(self.proc.name, "returned a record but the processor has no sink; use Emit(record, topic=...)")
            record = emit.record
            if not hasattr(record, "SCHEMA"):
                raise StrategyFailed(self.proc.name, f"returned a {type(record).__name__}, not an astraflow record")
            lineage = getattr(record, "lineage", None)
            if isinstance(lineage, list) and self.ref not in lineage:
                lineage.append(self.ref)
            self.worker.send(topic, record, emit.key if emit.key is not None else inc.key)
