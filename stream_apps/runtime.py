"""The stream worker: consume -> handle -> produce -> commit, with the DLQ, metrics and control.

Every app (`reward`, `curate`, `curator`, user processors) is an `AppHandler`
(`stream_apps.handler`) run by a `StreamWorker`. One worker is one consumer-group member and one asyncio event loop:

* **Input.** A confluent-kafka consumer in the group `af.<experiment>.<app>` (start more workers
  to split the partitions; eager rebalancing, see `_on_assign`). Each record is decoded into its
  typed class; undecodable records go to the DLQ and the worker goes on.
* **Handling.** `handler.handle(incoming)` may finish synchronously or return an awaitable; up
  to `max_inflight` awaitables run at once (slow rewards, async user functions), so outputs of
  one partition can leave in another order than their inputs came. Any exception raised while
  handling a record dead-letters that record, naming the strategy when the app says which one
  raised (`StrategyFailed`); Kafka-layer failures (a broker that rejects writes) stop the
  worker instead, since skipping records would lose them.
* **Commits.** A record is finished once its outputs are queued (or it was dropped or
  dead-lettered); a handler may hold records (curate holds a group's records until the group
  is emitted). Every `commit_interval_s` the worker flushes the producer, then commits per
  partition the lowest unfinished offset (`OffsetTracker`). Delivery is at-least-once: after a
  crash or a rebalance, records past the committed offset are handled again.
* **Control.** A `ControlReader` for the app is read to its end before the first record and
  polled every `control_interval_s` (100 ms), so a `astraflow control set` applies within a
  second; apps read their slots through `stream_apps.slots.Slot`.
* **Metrics** go to the `metrics` topic every `metrics_interval_s` (see `stream_apps.metrics`).

Why not Faust: faust-streaming 0.15 talks to Kafka through aiokafka, which cannot decompress
zstd batches without `cramjam` (not a dependency here), and every AstraFlow producer writes
zstd; Faust's confluent-kafka driver is marked broken in its own source. This loop keeps
librdkafka's fetch and produce threads, the commit-after-processing rule of
`astraflow.kafka.clients`, and an app interface small enough to run in a thread in tests.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from astraflow.errors import AstraflowError, KafkaLayerError, SerdeError
from astraflow.kafka.offsets import TP, OffsetTracker
from stream_apps.handler import AppHandler, Incoming, StrategyFailed
from stream_apps.metrics import MetricsReporter, WorkerStats

if TYPE_CHECKING:
    from confluent_kafka import Message

    from astraflow.config import KafkaSettings
    from astraflow.control import ControlReader
    from astraflow.kafka.clients import DeadLetterWriter, RecordProducer
    from astraflow.kafka.topics import Topics
    from astraflow.serde import AvroSerde

log = logging.getLogger("astraflow.stream")


@dataclass
class WorkerSettings:
    """How one worker runs; the defaults suit production, tests shorten the intervals."""

    experiment: str  # topics are af.<experiment>.*
    kafka: KafkaSettings  # where Kafka is
    group_id: str | None = None  # consumer group; default af.<experiment>.<app>
    instance_id: str | None = None  # metrics instance; default <app>-<host>-<pid>-<random>
    max_inflight: int = 16  # awaitables (slow rewards, async functions) running at once
    batch_size: int = 256  # most records taken per poll
    poll_timeout_s: float = 0.2  # longest blocking poll when idle (bounds stop latency)
    commit_interval_s: float = 1.0  # flush + commit period
    control_interval_s: float = 0.1  # control topic poll period
    metrics_interval_s: float = 10.0  # metrics publication period
    drain_timeout_s: float = 10.0  # how long stop() waits for in-flight awaitables
    extra_consumer_config: dict[str, Any] = field(default_factory=dict)  # librdkafka overrides


class StreamWorker:
    """Runs one `AppHandler` until `stop()` (or SIGTERM / SIGINT with `install_signal_handlers`)."""

    def __init__(self, handler: AppHandler, settings: WorkerSettings) -> None:
        from astraflow.kafka.topics import Topics

        self.handler = handler
        self.settings = settings
        self.topics: Topics = Topics(settings.experiment)
        self.kafka = settings.kafka
        self.group_id = settings.group_id or f"af.{settings.experiment}.{handler.name}"
        self.instance_id = settings.instance_id or (
            f"{handler.name}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        )
        self.stats = WorkerStats()
        self.log = logging.getLogger(f"astraflow.stream.{handler.name}")
        self.started = threading.Event()  # set once subscribed and the control topic is read
        self.stopped = threading.Event()  # set when run() returned
        self.error: BaseException | None = None  # what ended run() abnormally
        self.assigned: frozenset[TP] = frozenset()  # partitions this worker owns now
        self.serde: AvroSerde
        self.producer: RecordProducer | None = None
        self.control: ControlReader | None = None
        self._dlq: DeadLetterWriter
        self._stop = threading.Event()
        self._offsets = OffsetTracker()
        self._tasks: set[asyncio.Future[Any]] = set()
        self._consumer: Any = None
        self._reporter = MetricsReporter(handler.name, self.instance_id, {"experiment": settings.experiment})
        self._due: dict[str, float] = {}

    # ---- lifecycle -------------------------------------------------------------------------------

    def run(self) -> None:
        """Blocks until stopped; raises what stopped it abnormally (after cleaning up)."""
        try:
            asyncio.run(self._run())
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            self.stopped.set()

    def stop(self) -> None:
        """Asks the worker to stop (thread-safe); in-flight records finish, offsets are committed."""
        self._stop.set()

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

    # ---- what handlers call ----------------------------------------------------------------------

    def send(self, topic: str, record: Any, key: str | bytes | None = None) -> None:
        """Queues one output record (encoding errors raise SerdeError to the handler's caller)."""
        self.producer.send_raw(topic, self.serde.dumps(record), key)
        self.stats.records_out += 1
        self.stats.last_out_at = time.monotonic()

    def send_side(self, topic: str, record: Any, key: str | bytes | None = None) -> None:
        """Queues a record that is not an app output (feedback, ...): not counted in records_out."""
        self.producer.send_raw(topic, self.serde.dumps(record), key)

    def hold(self, inc: Incoming) -> None:
        """Keeps `inc` unfinished after `handle` returns, until `release` (its offset is not committed)."""
        inc.held = True

    def release(self, incs: Iterable[Incoming]) -> None:
        """Finishes held records: their offsets may be committed once the producer flushed."""
        for inc in incs:
            inc.held = False
            self._offsets.finished(inc.tp, inc.offset, inc.epoch)

    def drop(self, reason: str, n: int = 1) -> None:
        """Counts records dropped on purpose (a filter, a late record) for the metrics."""
        self.stats.dropped[reason] += n

    def dead_letter(self, inc: Incoming, error: BaseException | str, strategy: str | None = None) -> None:
        """Sends `inc` to the DLQ with the reason (and strategy); finishes it."""
        self._dead_letter_msg(inc.message, error, strategy)
        self.release([inc])

    # ---- the loop --------------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            self._open()
            self.started.set()
            self.log.info(
                "%s worker %s started (group %s, sources %s)",
                self.handler.name, self.instance_id, self.group_id, ", ".join(self._source_topics()) or "none",
            )
            await self._loop()
            if self.error is not None:  # a slow record's task hit a Kafka-layer failure
                raise self.error
        finally:
            await self._shutdown()

    def _source_topics(self) -> list[str]:
        return [self.topics.stream(s) for s in self.handler.sources]

    def _open(self) -> None:
        from astraflow.control import ControlReader
        from astraflow.kafka.clients import DeadLetterWriter, RecordProducer
        from astraflow.serde import AvroSerde

        self.serde = AvroSerde(registry_url=self.kafka.schema_registry_url)
        self.producer = RecordProducer(self.kafka, self.serde)
        self._dlq = DeadLetterWriter(self.producer, self.topics.dlq, component=self.handler.name)
        self.control = ControlReader(self.kafka, self.settings.experiment, self.handler.name, serde=self.serde).start()
        self.handler.bind(self)
        sources = self._source_topics()
        if sources:
            from confluent_kafka import Consumer

            conf = {
                **self.kafka.client_config(),
                "group.id": self.group_id,
                "client.id": self.instance_id,
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "isolation.level": "read_committed",
                "fetch.message.max.bytes": self.serde.max_record_bytes + 64 * 1024,
                "max.poll.interval.ms": 300000,
                "heartbeat.interval.ms": 1000,  # members learn of a rebalance by heartbeat: joiners get work sooner
                **self.settings.extra_consumer_config,
            }
            self._consumer = Consumer(conf)
            self._consumer.subscribe(sources, on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost)

    async def _loop(self) -> None:
        s = self.settings
        while not self._stop.is_set():
            self._periodic(time.monotonic())
            if self._consumer is None:
                await asyncio.sleep(min(self.handler.tick_interval_s, s.poll_timeout_s))
                continue
            room = s.max_inflight - len(self._tasks)
            if room <= 0:  # backpressure: librdkafka heartbeats on its own, max.poll.interval is 5 min
                await asyncio.wait(self._tasks, timeout=0.1, return_when=asyncio.FIRST_COMPLETED)
                continue
            msgs = self._consumer.consume(min(room, s.batch_size), 0 if self._tasks else s.poll_timeout_s)
            for msg in msgs:
                self._dispatch(msg)
            if self._tasks:
                await asyncio.wait(self._tasks, timeout=0 if msgs else 0.02, return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.sleep(0)

    def _periodic(self, now: float) -> None:
        s = self.settings
        if self._is_due("control", now, s.control_interval_s) and self.control.refresh():
            self.log.debug("control changed (generation %d)", self.control.generation)
        if self._is_due("tick", now, self.handler.tick_interval_s):
            self.handler.tick(now)
        if self._is_due("commit", now, s.commit_interval_s):
            self._commit()
        if self._is_due("metrics", now, s.metrics_interval_s, first_now=False):
            self._publish_metrics()

    def _is_due(self, what: str, now: float, interval: float, first_now: bool = True) -> bool:
        due = self._due.get(what)
        if due is None:
            self._due[what] = now + interval
            return first_now
        if now >= due:
            self._due[what] = now + interval
            return True
        return False

    def _dispatch(self, msg: Message) -> None:
        from confluent_kafka import KafkaError

        err = msg.error()
        if err is not None:
            if err.code() == KafkaError._PARTITION_EOF:
                return
            if err.fatal():
                raise KafkaLayerError(f"fatal Kafka consumer error on {msg.topic()}: {err.str()}")
            self.log.warning("consumer error (librdkafka retries): %s", err.str())
            return
        tp = (msg.topic(), msg.partition())
        epoch = self._offsets.received(tp, msg.offset())
        self.stats.records_in += 1
        if self.stats.first_in_at is None:
            self.stats.first_in_at = time.monotonic()
        try:
            record = self.serde.loads(msg.value(), self.handler.expect)
        except SerdeError as exc:
            self._dead_letter_msg(msg, exc, None)
            self._offsets.finished(tp, msg.offset(), epoch)
            return
        inc = Incoming(record, tp[0], tp[1], msg.offset(), msg.key(), msg.timestamp()[1], msg, epoch)
        try:
            result = self.handler.handle(inc)
        except KafkaLayerError:
            raise
        except Exception as exc:  # the one boundary where a bad record must not stop the app
            self._failed(inc, exc)
            return
        if inspect.isawaitable(result):
            task = asyncio.ensure_future(result)
            self._tasks.add(task)
            self.stats.inflight_peak = max(self.stats.inflight_peak, len(self._tasks))
            task.add_done_callback(functools.partial(self._task_done, inc))
        elif not inc.held:
            self._offsets.finished(inc.tp, inc.offset, inc.epoch)

    def _task_done(self, inc: Incoming, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return  # stopping: not finished, so not committed; the next owner handles it again
        exc = task.exception()
        if isinstance(exc, KafkaLayerError):
            self.error = exc
            self._stop.set()
            return
        if exc is not None:
            self._failed(inc, exc)
        elif not inc.held:
            self._offsets.finished(inc.tp, inc.offset, inc.epoch)

    def _failed(self, inc: Incoming, exc: BaseException) -> None:
        strategy = exc.strategy if isinstance(exc, StrategyFailed) else None
        if not isinstance(exc, AstraflowError):
            self.log.warning("%s raised on %s[%d]@%d: %r", self.handler.name, inc.topic, inc.partition, inc.offset, exc)
        self.dead_letter(inc, exc, strategy)

    def _dead_letter_msg(self, msg: Message, error: BaseException | str, strategy: str | None) -> None:
        if isinstance(error, StrategyFailed):  # the DLQ names the strategy and shows what it raised
            strategy, error = strategy or error.strategy, error.cause
        self._dlq.send(msg, error, strategy)
        self.stats.dead_lettered[type(error).__name__ if isinstance(error, BaseException) else "Error"] += 1

    # ---- commits and rebalances ------------------------------------------------------------------

    def _commit(self, tps: set[TP] | None = None) -> None:
        from confluent_kafka import KafkaException, TopicPartition

        if self._consumer is None:
            self.producer.poll(0)
            return
        offsets = self._offsets.to_commit(tps)
        if not offsets:
            self.producer.poll(0)
            return
        self.producer.flush(30.0)  # outputs of every finished record are durable before its offset moves
        try:
            self._consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()], asynchronous=False)
        except KafkaException as exc:  # e.g. a rebalance in progress: the next commit retries
            self.log.warning("commit failed (will retry): %s", exc)
            return
        self._offsets.mark_committed(offsets)
        self.stats.commits += 1

    # Eager rebalancing (librdkafka's default range/roundrobin), with explicit assign/unassign:
    # the revoke callback runs before the group moves to a new generation, so its commit is
    # accepted. With cooperative-sticky, librdkafka 2.x ran the revoke after the new generation
    # began here: commits failed with ILLEGAL_GENERATION and hand-overs stalled for seconds.

    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        if partitions:
            self.log.info("assigned %s", ", ".join(f"{p.topic}[{p.partition}]" for p in partitions))
        consumer.assign(partitions)
        self.assigned = frozenset((p.topic, p.partition) for p in partitions)

    def _on_revoke(self, consumer: Any, partitions: list[Any]) -> None:
        tps = {(p.topic, p.partition) for p in partitions}
        if tps:
            self.log.info("revoked %s", ", ".join(f"{t}[{p}]" for t, p in sorted(tps)))
            try:
                self._commit(tps)
            except AstraflowError as exc:  # outputs not acknowledged: do not commit, the next owner redoes them
                self.log.warning("could not commit revoked partitions: %s", exc)
            self.handler.on_revoke(tps)
            self._offsets.forget(tps)
        consumer.unassign()
        self.assigned = frozenset()

    def _on_lost(self, consumer: Any, partitions: list[Any]) -> None:
        tps = {(p.topic, p.partition) for p in partitions}
        self.log.warning("lost %s (session expired); they are handled again elsewhere", sorted(tps))
        self.handler.on_revoke(tps)
        self._offsets.forget(tps)
        consumer.unassign()
        self.assigned = frozenset()

    # ---- metrics and shutdown --------------------------------------------------------------------

    def gauges(self) -> dict[str, float]:
        return {"inflight": float(len(self._tasks)), "pending_records": float(self._offsets.pending()),
                **self.handler.gauges()}

    def _publish_metrics(self) -> None:
        for m in self._reporter.report(self.stats, self.gauges()):
            self.producer.send(self.topics.metrics, m, key=self.instance_id)

    async def _shutdown(self) -> None:
        try:
            if self._tasks:
                _, pending = await asyncio.wait(self._tasks, timeout=self.settings.drain_timeout_s)
                for t in pending:
                    t.cancel()
                if pending:
                    await asyncio.wait(pending, timeout=1.0)
            self.handler.close()
            if self.producer is not None and self.started.is_set():
                self._commit()
                self._publish_metrics()
                self.producer.flush(30.0)
        finally:
            if self._consumer is not None:
                self._consumer.close()
            if self.control is not None:
                self.control.close()
            self.log.info(
                "%s worker %s stopped: %d in, %d out, %d dead-lettered, %d dropped",
                self.handler.name, self.instance_id, self.stats.records_in, self.stats.records_out,
                self.stats.dead_lettered_total, self.stats.dropped_total,
            )
