"""The stream engine: each stream app (or user processor) runs as a Faust app, exactly-once by default.

A `StreamEngine` wires one `AppHandler` (`stream_apps.handler`) into a `faust.App` whose id is
the consumer group `af.<experiment>.<app>`:

* **Input.** One agent reads the app's source topic as raw bytes and decodes each record with
  `astraflow.serde` (single-object Avro; the same codec is registered for Faust as
  `astraflow`, see `stream_apps.codec`). A record that does not decode, or on which the app
  raises, goes to the DLQ with its reason (and the strategy's name) and the agent goes on.
* **Handling.** `handler.handle` runs under the record's partition gate; an awaitable it returns
  (a slow reward, an async user function) runs concurrently, up to `max_inflight` per worker.
  Outputs, dead letters and table writes made for a record are collected when it finishes and
  kept for the transaction of its source partition; they go to that partition's producer in
  batches (aiokafka's `send_batch`, one per destination partition: one call for many records,
  not one `send` each) `SEND_LINGER_S` (25 ms) after the first of them was kept, once
  `SEND_BATCH_BYTES` (1 MiB) are kept, and before every commit of the partition, ahead of its
  offsets. Of the table writes handed over together, only the last one of each key goes (the
  others are replaced in the same transaction: a recovery would read the last one anyway), and
  none when that last one deletes a key the table did not hold before the first of them (curate's
  group assembled and emitted in one burst: the changelog would only get a tombstone).
* **Exactly-once** (`processing_guarantee="exactly_once"`): Faust keeps one transactional
  producer per assigned source partition. `ExactTransactionManager` (`stream_apps.transactions`
  lists every gap of Faust 0.15 it closes): outputs go to the transaction of the SOURCE
  partition (Faust picks it from the destination partition), offsets committed are those of
  records whose outputs are in the transaction (never one whose outputs are not, never one past
  a record still in flight), and any failure to commit crashes the app instead of being
  logged. Periodic work (curate's timeouts) runs in a transaction of its own partition.
  `at_least_once` keeps Faust's own commits: outputs flushed, then offsets.
* **Tables** are Faust tables (in memory, backed by changelog topics `<group>-<table>-changelog`)
  whose writes join the record's transaction; a worker that takes over a partition rebuilds its
  state from the changelog (read_committed) before its first record.
* **Control** (`astraflow.control.ControlReader`) is read to its end before the first record and
  refreshed every `control_interval_s`; **metrics** go to `metrics` every `metrics_interval_s`.

Running (`stream_apps.lifecycle`): `StreamEngine.run()` blocks (the CLI), `start_thread()` runs
it in a thread (tests);
a crash of the Faust app (e.g. a broker gone longer than the timeouts) ends `run_once`, and
`run()` rebuilds the app after a pause, so a role outlives broker outages.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from astraflow.config import TopicSettings
from astraflow.errors import AstraflowError, ConfigError, KafkaLayerError, SerdeError
from astraflow.kafka.offsets import OffsetTracker
from astraflow.kafka.received import Received, dead_letter_bytes, decode_headers
from astraflow.kafka.signing import MetricSigner
from astraflow.records import Metric
from stream_apps.handler import AppHandler, StrategyFailed
from stream_apps.lifecycle import EngineLifecycle
from stream_apps.metrics import MetricsReporter, WorkerStats
from stream_apps.takeover import Takeover

if TYPE_CHECKING:
    import faust

    from astraflow.config import KafkaSettings
    from astraflow.control import ControlReader

log = logging.getLogger("astraflow.stream")

Guarantee = Literal["exactly_once", "at_least_once"]
SEND_BATCH_BYTES = 1 << 20  # outputs kept per source partition before they go to its producer (`flush_partition`)
SEND_LINGER_S = 0.025  # ...or this long after the first of them was kept (at full speed the 1 MiB comes first)
Compression = Literal["snappy", "zstd", "lz4", "gzip", "none"]
COMPRESSIONS: tuple[str, ...] = ("snappy", "zstd", "lz4", "gzip", "none")


@dataclass
class EngineSettings:
    """How one worker runs; the defaults suit production, tests shorten the intervals."""

    experiment: str  # topics are af.<experiment>.*
    kafka: KafkaSettings  # where Kafka is
    group_id: str | None = None  # Faust app id = consumer group; default af.<experiment>.<app>
    instance_id: str | None = None  # metrics instance; default <app>-<host>-<pid>-<random>
    guarantee: Guarantee = "exactly_once"  # Kafka transactions from input to outputs
    max_inflight: int = 16  # awaitables (slow rewards, async functions) running at once
    commit_interval_s: float = 1.0  # Faust's broker_commit_interval: how often transactions commit under steady input
    commit_idle_s: float = 0.02  # ...and sooner once no record arrived or finished for this long (a burst's outputs)
    control_interval_s: float = 0.1  # control topic poll period
    metrics_interval_s: float = 10.0  # metrics publication period
    restart_delay_s: float = 5.0  # pause before a crashed app is rebuilt (run())
    data_dir: Path | None = None  # Faust's datadir; default a fresh temporary folder
    faust_overrides: dict[str, Any] = field(default_factory=dict)  # extra faust.App settings
    source_partitions: int | None = None  # partitions of the source topic; None: asked from Kafka
    topics: TopicSettings = field(default_factory=TopicSettings)  # replication / min ISR of its changelogs
    compression: Compression = "snappy"  # codec of every batch the worker writes (stream_apps.faust_app)

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ConfigError(f"compression must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}")


_METRIC_SIGNER = MetricSigner()


@dataclass(slots=True)
class _Out:
    """One record to produce when the current record (or periodic transaction) finishes."""

    topic: str
    key: bytes | None
    value: bytes | None
    partition: int | None = None  # changelog writes (co-partitioned with the source), placed tasks (curator)
    table: bool = False  # a table's changelog write: only the last one per key of a hand-over is sent
    born: bool = False  # ...and the table did not hold its key before it (`_last_table_writes`)
    headers: list[tuple[str, bytes]] | None = None  # a signature: a metric's, the curator's on a task


_OUTBOX: contextvars.ContextVar[list[_Out] | None] = contextvars.ContextVar("astraflow_outbox", default=None)
_PARTITION: contextvars.ContextVar[int | None] = contextvars.ContextVar("astraflow_partition", default=None)


def _last_table_writes(outs: list[_Out]) -> list[_Out]:
    """`outs` without the table writes a later write of the same key (same table, same partition)
    replaces: all of them are in one transaction, and a table recovered from its changelog keeps
    the last value of each key (curate writes a group's state once per member, then deletes it).
    When that last write deletes a key the table did not hold before the first write of it here,
    none of them goes: the changelog holds nothing for the key (the table's memory follows its
    changelog write for write, so a key it did not hold has no value there, or a tombstone) and
    a recovery without them reads what it would read with them: no value."""
    born: dict[tuple[str, int | None, bytes | None], bool] = {}
    for out in outs:
        if out.table:
            born.setdefault((out.topic, out.partition, out.key), out.born)
    seen: set[tuple[str, int | None, bytes | None]] = set()
    kept: list[_Out] = []
    for out in reversed(outs):
        if out.table:
            where = (out.topic, out.partition, out.key)
            if where in seen:
                continue
            seen.add(where)
            if out.value is None and born[where]:
                continue
        kept.append(out)
    kept.reverse()
    return kept


def _key(key: str | bytes | None) -> bytes | None:
    return key.encode() if isinstance(key, str) else key


class StreamEngine(EngineLifecycle):
    """Runs one `AppHandler` as a Faust app (see the module doc)."""

    def __init__(self, handler: AppHandler, settings: EngineSettings) -> None:
        from astraflow.kafka.topics import Topics
        from astraflow.serde import AvroSerde

        if len(handler.sources) > 1:
            raise AstraflowError(f"{handler.name}: an app reads at most one stream, got {handler.sources}")
        self.handler = handler
        self.settings = settings
        self.kafka = settings.kafka
        self.topics = Topics(settings.experiment)
        self.group_id = settings.group_id or self.topics.group(handler.name)
        self.instance_id = settings.instance_id or (
            f"{handler.name}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        )
        self.exactly_once = settings.guarantee == "exactly_once"
        self.serde = AvroSerde.for_kafka(self.kafka)  # registers its schemas with the registry, if one is set
        # What the DLQ topic takes and this worker's producer can send (an original over it is left
        # out of its letter: a 10 MB record must not make the dead-lettering itself fail).
        self._dlq_serde = AvroSerde(self.serde.catalog,
                                    max_record_bytes=min(settings.topics.max_message_bytes, self.serde.max_record_bytes))
        self.source = self.topics.stream(handler.sources[0]) if handler.sources else None
        self.stats = WorkerStats()
        self.log = logging.getLogger(f"astraflow.stream.{handler.name}")
        self.started = threading.Event()  # set once the app runs and the control topic is read
        self.stopped = threading.Event()  # set when run() returned
        self.error: BaseException | None = None  # what ended run() abnormally
        self.control: ControlReader | None = None
        self.app: faust.App
        self.tables: dict[str, Any] = {}
        self.tracker = OffsetTracker()
        self.takeover = Takeover(self.tracker, bool(handler.tables))
        self._gates: dict[int, asyncio.Lock] = {}
        self._tasks: set[asyncio.Future[Any]] = set()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reporter = MetricsReporter(handler.name, self.instance_id,
                                         {**handler.metric_labels, "experiment": settings.experiment})
        self.metric_observers: list[Callable[[Metric], None]] = []  # e.g. the role's /metrics endpoint
        self._dirty: set[int] = set()  # partitions with records produced since their last commit
        self._unsent: dict[int, list[_Out]] = {}  # source partition -> outputs of its transaction not handed over yet
        self._unsent_bytes: dict[int, int] = {}  # ...and their bytes
        self._lingering: dict[int, asyncio.TimerHandle] = {}  # ...and when they go if nothing sends them sooner
        self._active_at = 0.0  # monotonic time a record last arrived or finished
        self._idle_due: asyncio.TimerHandle | None = None  # the idle commit, armed by activity (`_note_active`)
        self._crashing: asyncio.Future[Any] | None = None
        self._seen_record = False  # per Faust app built: logged once, so supervisors see it is working
        self._bound = False  # handler.bind succeeded
        self._rereader: Any = None  # consumer of `reread` (made at its first use)

    # ---- what handlers call ----------------------------------------------------------------------

    def send(self, topic: str, record: Any, key: str | bytes | None = None, partition: int | None = None) -> None:
        """Queues one output of the current record (encoding errors raise SerdeError to the handler);
        `partition`: that one, not the key's (the curator places tasks)."""
        self._outbox().append(_Out(topic, _key(key), self.serde.dumps(record), partition))
        self.stats.records_out += 1
        self.stats.last_out_at = time.monotonic()

    def send_encoded(self, topic: str, value: bytes, key: str | bytes | None = None, partition: int | None = None,
                     headers: dict[str, str] | None = None) -> None:
        """Queues one output of the current record, already encoded (the reward app's short path;
        the curator's signed tasks, whose `headers` sign exactly these bytes)."""
        hdrs = [(k, v.encode()) for k, v in headers.items()] if headers else None
        self._outbox().append(_Out(topic, _key(key), value, partition, headers=hdrs))
        self.stats.records_out += 1
        self.stats.last_out_at = time.monotonic()

    def send_side(self, topic: str, record: Any, key: str | bytes | None = None) -> None:
        """Queues a record that is not an app output (feedback, ...): not counted in records_out."""
        self._outbox().append(_Out(topic, _key(key), self.serde.dumps(record)))

    def drop(self, reason: str, n: int = 1) -> None:
        """Counts records dropped on purpose (a filter, a late record) for the metrics."""
        self.stats.dropped[reason] += n

    def dead_letter(self, inc: Received[Any], error: BaseException | str, strategy: str | None = None) -> None:
        """Queues `inc`'s original bytes to the DLQ with the reason (and the strategy that failed)."""
        detail = None
        if isinstance(error, StrategyFailed):  # the DLQ names the strategy and shows what it raised
            strategy, error, detail = strategy or error.strategy, error.cause, error.detail
        dl, data = dead_letter_bytes(self._dlq_serde, inc, error, self.handler.name, strategy, detail)
        self._outbox().append(_Out(self.topics.dlq, inc.key, data))
        self.stats.dead_lettered[dl.error_class] += 1

    def table(self, name: str) -> Any:
        """The app's table `name` (declared in `handler.tables`): a mapping bytes -> bytes."""
        return self.tables[name]

    def changelog(self, table: Any, key: bytes, value: bytes | None) -> None:
        """A table write: joins the current transaction (called by `stream_apps.transactions.TxTable`)."""
        partition = _PARTITION.get()
        if partition is None:
            raise AstraflowError(f"table {table.name} written outside a record or partition transaction")
        born = key not in table.data  # Faust's table changes its data after calling on_key_set / on_key_del
        self._outbox().append(_Out(table.changelog_topic.get_topic_name(), key, value, partition, table=True, born=born))

    def reread(self, partition: int, offsets: list[int]) -> dict[int, bytes]:
        """Values of the source's records at `offsets` of `partition`, read again (read_committed);
        offsets the topic no longer has are left out (`astraflow.kafka.read.read_offsets`).
        Blocks the worker while it reads: for state a worker takes over, not for every record."""
        from astraflow.kafka.read import assigned_consumer, read_offsets

        if self.source is None:
            return {}
        if self._rereader is None:
            self._rereader = assigned_consumer(self.kafka, self.serde, f"{self.group_id}-reread")
        return read_offsets(self._rereader, self.source, partition, offsets)

    def stop(self) -> None:
        """Asks the worker to stop (thread-safe); in-flight records finish, transactions commit."""
        self._stop.set()

    def _outbox(self) -> list[_Out]:
        box = _OUTBOX.get()
        if box is None:
            raise AstraflowError("sent outside a record or partition transaction (use StreamEngine.in_partition)")
        return box

    # ---- the agent -------------------------------------------------------------------------------

    def gate(self, partition: int) -> asyncio.Lock:
        gate = self._gates.get(partition)
        if gate is None:
            gate = self._gates[partition] = asyncio.Lock()
        return gate

    def tid(self, partition: int) -> str:
        """Transactional id of the producer of a source partition (one source topic per app)."""
        return f"{self.app.conf.id}-{partition}"

    async def handle_event(self, event: Any) -> None:
        msg = event.message
        tp = (msg.topic, msg.partition)
        self._note_active()
        if self.exactly_once and self.takeover.skip(msg.topic, msg.partition, msg.offset, self.app.rebalancing_count):
            return  # held back while the tables recover, or read twice (stream_apps.takeover)
        inc: Received[Any] = Received(None, msg.topic, msg.partition, msg.offset, msg.key,
                                      int((msg.timestamp or 0) * 1000), msg.value, decode_headers(msg.headers))
        if not self.tracker.owns(tp):  # the first record of this assignment of the partition
            self.log.info("%s[%d] read from offset %d", msg.topic, msg.partition, msg.offset)
        inc.epoch = self.tracker.received(tp, msg.offset)
        self.stats.records_in += 1
        if self.stats.first_in_at is None:
            self.stats.first_in_at = time.monotonic()
        if not self._seen_record:
            self._seen_record = True
            self.log.info("%s worker %s: first record, %s[%d]@%d", self.handler.name, self.instance_id,
                          msg.topic, msg.partition, msg.offset)
        msg.incref()  # acked by us once its outputs are in the producer, not when this body returns
        outbox: list[_Out] = []
        box_token, part_token = _OUTBOX.set(outbox), _PARTITION.set(msg.partition)
        try:
            async with self.gate(msg.partition):
                if not self._current(inc):
                    return  # revoked while it waited (its table writes would outlive the recovery): read again
                pending = self._handle(inc)
                if pending is None:
                    await self._finish(inc, outbox, msg)
                    return
            await self._room()
            task = asyncio.ensure_future(self._finish_later(inc, pending, outbox, msg))
            self._tasks.add(task)
            self.stats.inflight_peak = max(self.stats.inflight_peak, len(self._tasks))
            task.add_done_callback(self._task_done)
        finally:
            _OUTBOX.reset(box_token)
            _PARTITION.reset(part_token)

    def _handle(self, inc: Received[Any]) -> Any:
        """Decodes and handles `inc`; returns the awaitable of a slow record, None when done."""
        try:
            inc.record = self.handler.decode(inc)
        except SerdeError as exc:
            self.dead_letter(inc, exc)
            return None
        try:
            return self.handler.handle(inc)
        except KafkaLayerError:
            raise
        except Exception as exc:  # the one boundary where a bad record must not stop the app
            self._failed(inc, exc)
            return None

    async def _room(self) -> None:
        while len(self._tasks) >= self.settings.max_inflight:
            await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)

    async def _finish_later(self, inc: Received[Any], pending: Any, outbox: list[_Out], msg: Any) -> None:
        try:
            await pending
        except KafkaLayerError:
            raise
        except Exception as exc:
            del outbox[:]  # a record either has its outputs or its dead letter
            self._failed(inc, exc)
        async with self.gate(inc.partition):
            await self._finish(inc, outbox, msg)

    def _task_done(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.crash(task.exception())

    def _failed(self, inc: Received[Any], exc: BaseException) -> None:
        if not isinstance(exc, AstraflowError):
            self.log.warning("%s raised on %s[%d]@%d: %r", self.handler.name, inc.topic, inc.partition, inc.offset, exc)
        self.dead_letter(inc, exc)

    async def _finish(self, inc: Received[Any], outbox: list[_Out], msg: Any) -> None:
        """Produces a record's outputs into its partition's transaction and acks it (gate held)."""
        if not self._current(inc):
            return  # revoked meanwhile: its new owner handles it again
        await self._produce(outbox, inc.partition)
        self.tracker.finished(inc.tp, inc.offset, inc.epoch)
        self._dirty.add(inc.partition)
        self._note_active()
        msg.ack(self.app.consumer)

    def _current(self, inc: Received[Any]) -> bool:
        epoch = self.tracker.epoch(inc.tp)
        return epoch is not None and epoch == inc.epoch

    async def _produce(self, outbox: list[_Out], partition: int | None) -> None:
        """Hands `outbox` to the producer: the transactional one of source `partition` (exactly-once;
        the caller holds its gate), else Faust's shared producer."""
        if not outbox:
            return
        if self.exactly_once and partition is not None:
            # Kept for the partition's transaction and handed over in batches (`flush_partition`).
            unsent = self._unsent.setdefault(partition, [])
            unsent.extend(outbox)
            self._dirty.add(partition)
            self._unsent_bytes[partition] = size = self._unsent_bytes.get(partition, 0) + sum(
                len(o.value or b"") + len(o.key or b"") for o in outbox)
            if size >= SEND_BATCH_BYTES:
                await self.flush_partition(partition)
            elif partition not in self._lingering:
                loop = asyncio.get_running_loop()
                self._lingering[partition] = loop.call_later(SEND_LINGER_S, self._send_lingered, partition)
            return
        producer = self.app.producer
        for out in outbox:
            fut = await producer.send(out.topic, out.key, out.value, out.partition, None, out.headers)
            fut.add_done_callback(self._delivered)

    async def flush_partition(self, partition: int) -> None:
        """Hands the outputs kept for source `partition`'s transaction to its producer, one batch
        per destination partition (the caller holds the partition's gate). Before every commit of
        the partition (`stream_apps.transactions`) and whenever `SEND_BATCH_BYTES` are kept."""
        unsent = self._unsent.pop(partition, None)
        self._unsent_bytes.pop(partition, None)
        if (linger := self._lingering.pop(partition, None)) is not None:
            linger.cancel()
        if not unsent:
            return
        tid = self.tid(partition)
        txp = self.app.producer._transaction_producers.get(tid)
        if txp is None:
            raise KafkaLayerError(f"no transactional producer {tid} for source partition {partition}")
        by_tp: dict[tuple[str, int], list[_Out]] = {}
        for topic in {out.topic for out in unsent}:
            await txp.client._wait_on_metadata(topic)
        for out in _last_table_writes(unsent):
            dest = out.partition
            if dest is None:  # the key's partition, as `AIOKafkaProducer.send` picks it
                dest = txp._partition(out.topic, None, out.key, out.value, out.key, out.value)
            by_tp.setdefault((out.topic, dest), []).append(out)
        for (topic, dest), outs in by_tp.items():
            batch = txp.create_batch()
            for out in outs:
                if batch.append(key=out.key, value=out.value, timestamp=None, headers=out.headers or []) is None:  # full: send it
                    (await txp.send_batch(batch, topic, partition=dest)).add_done_callback(self._delivered)
                    batch = txp.create_batch()
                    batch.append(key=out.key, value=out.value, timestamp=None, headers=out.headers or [])  # always fits
            (await txp.send_batch(batch, topic, partition=dest)).add_done_callback(self._delivered)

    def _send_lingered(self, partition: int) -> None:
        """`SEND_LINGER_S` after an output was kept: hands the partition's kept outputs over (under its gate)."""
        async def send() -> None:
            async with self.gate(partition):
                if self.app.producer._transaction_producers.get(self.tid(partition)) is None:
                    self.forget_unsent(partition)  # revoked meanwhile: nothing of it commits
                else:
                    await self.flush_partition(partition)

        self._lingering.pop(partition, None)
        task = asyncio.ensure_future(send())
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Future[Any]) -> None:
        """A lingered send or an idle commit ended: a failure crashes the app."""
        if not task.cancelled() and task.exception() is not None:
            self.crash(task.exception())  # type: ignore[arg-type]

    def forget_unsent(self, partition: int) -> None:
        """Drops what was kept for a transaction that will not commit (its producer is gone or new)."""
        self._unsent.pop(partition, None)
        self._unsent_bytes.pop(partition, None)
        if (linger := self._lingering.pop(partition, None)) is not None:
            linger.cancel()

    def _delivered(self, fut: asyncio.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            self.crash(KafkaLayerError(f"{self.handler.name}: a record was not delivered: {fut.exception()!r}"))

    def crash(self, exc: BaseException) -> None:
        self.log.error("%s worker crashes: %r", self.handler.name, exc)
        self.error = exc
        self._crashing = asyncio.ensure_future(self.app.crash(exc))

    async def in_partition(self, partition: int, fn: Callable[[], Any]) -> Any:
        """Runs `fn` (sync) in a transaction of source `partition`: its sends and table writes commit together.
        Not during a rebalance (None): the tables recover, `fn` would read a partial state."""
        outbox: list[_Out] = []
        box_token, part_token = _OUTBOX.set(outbox), _PARTITION.set(partition)
        try:
            async with self.gate(partition):
                if partition not in self.assigned() or self.app.rebalancing:
                    return None
                result = fn()
                await self._produce(outbox, partition)
                if self.exactly_once:  # with the offsets of the records finished so far: their table
                    # writes are in this transaction too, and must not commit without them
                    await self.transactions.commit_partition(partition)
                return result
        finally:
            _OUTBOX.reset(box_token)
            _PARTITION.reset(part_token)

    async def send_now(self, topic: str, record: Any, key: str | bytes | None = None) -> None:
        """Produces outside any transaction (metrics, signed with the apps' key where this host
        holds it: `astraflow.kafka.signing.MetricSigner`)."""
        value = self.serde.dumps(record)
        signed = _METRIC_SIGNER.headers(topic, key, value, record.component) if isinstance(record, Metric) else None
        headers = [(k, v.encode()) for k, v in signed.items()] if signed else None
        await self._produce([_Out(topic, _key(key), value, headers=headers)], None)

    def assigned(self) -> set[int]:
        """Source partitions this worker holds now."""
        try:
            return {tp.partition for tp in self.app.consumer.assignment() if tp.topic == self.source}
        except Exception:  # the consumer is not started yet
            return set()

    @property
    def transactions(self) -> Any:
        return self.app.consumer.transactions

    # ---- periodic work (Faust timers) ------------------------------------------------------------

    async def tick(self) -> None:
        """The handler's periodic work; what it sends outside `in_partition` goes out untransacted."""
        if not self.started.is_set():
            return
        outbox: list[_Out] = []
        token = _OUTBOX.set(outbox)
        try:
            result = self.handler.tick(time.monotonic())
            if result is not None:
                await result
        finally:
            _OUTBOX.reset(token)
        await self._produce(outbox, None)

    async def commit(self) -> None:
        """Commits the transactions of partitions that produced or finished records (every commit interval).

        Faust commits too (on its own timer, for partitions with new acks); this one also covers
        records finished after Faust's last look, e.g. a slow reward acked between two commits.
        """
        if not self.exactly_once:
            return
        dirty, self._dirty = self._dirty, set()
        for p in sorted(dirty & self.assigned()):
            async with self.gate(p):
                await self.transactions.commit_partition(p)

    def _note_active(self) -> None:
        """A record arrived or finished: the idle commit is due `commit_idle_s` after the last of these.

        Readers downstream are read_committed: a record's outputs are visible only once its
        transaction commits. Under steady input the commit interval batches many records per
        transaction; when input pauses (the end of a burst, e.g. a batch of rollouts) there is
        nothing to batch with, and waiting for the interval would only delay the next stage.
        One timer per quiet spell, armed here and moved on by later activity when it fires, so
        the commit comes `commit_idle_s` after the burst (a periodic check came up to twice that).
        """
        self._active_at = time.monotonic()
        if self._idle_due is None and self.exactly_once:
            self._idle_due = asyncio.get_running_loop().call_later(self.settings.commit_idle_s, self._idle_deadline)

    def _idle_deadline(self) -> None:
        left = self._active_at + self.settings.commit_idle_s - time.monotonic()
        if left > 0:  # active since it was armed: due that much later
            self._idle_due = asyncio.get_running_loop().call_later(left, self._idle_deadline)
            return
        self._idle_due = None
        if self._dirty:
            task = asyncio.ensure_future(self.commit())
            task.add_done_callback(self._background_done)

    def refresh_control(self) -> None:
        if self.control is not None and self.control.refresh():
            self.log.debug("control changed (generation %d)", self.control.generation)

    def gauges(self) -> dict[str, float]:
        return {"inflight": float(len(self._tasks)), "pending_records": float(self.tracker.pending()),
                **self.handler.gauges()}

    async def publish_metrics(self) -> None:
        """The role's own endpoint sees every metric first: a send that fails or stalls (a broker
        restart) must not leave /metrics without the series the topic did not get."""
        metrics = self._reporter.report(self.stats, self.gauges())
        for m in metrics:
            for observe in self.metric_observers:
                observe(m)
        for m in metrics:
            await self.send_now(self.topics.metrics, m, key=self.instance_id)

    def on_revoked(self, partitions: set[int]) -> None:
        if self.source is None:
            return
        self.tracker.forget({(self.source, p) for p in partitions})
        self.takeover.forget({(self.source, p) for p in partitions})
        self.handler.on_revoke(partitions)
