"""Exactly-once on Faust: a thin subclass of Faust's TransactionManager, and tables whose writes join it.

Faust 0.15 with `processing_guarantee="exactly_once"` keeps one transactional producer per
assigned source partition (id `<app id>-<topic group>-<partition>`), and at every commit sends
the acked offsets to it and commits. Reading its source (faust/transport/consumer.py,
faust/transport/drivers/aiokafka.py) and its open reports shows where that is not exact:

1. `TransactionManager.send` picks the producer from the DESTINATION partition, so an output to
   a topic with another partition count or key lands in another partition's transaction (or
   fails with "No transaction producer found"), committed with the wrong offsets.
2. Offsets are taken from acked events before the commit awaits anything; events that finish
   meanwhile have their outputs in the transaction but not their offsets (duplicates after a
   kill), and an event is acked when the agent's body returns, whatever it left running.
3. `begin_transaction`, `commit_transaction` log and swallow every exception; the producers'
   registry is a class attribute shared by every app of the process; transactional ids come
   from the assignor's topic groups, which are empty (KeyError at the first rebalance) unless
   the app has changelog tables.
4. Table changelog writes go through the producer buffer, a separate task that may not have
   handed them to the producer when the transaction commits; sends from timers have no
   transaction at all.

What we do instead (the engine, `stream_apps.engine`, produces with an explicit transactional
id, holds each record until its outputs are in the producer, and serialises a partition's
records with its commits through a per-partition gate):

* `ExactTransactionManager.commit` commits, per source partition and under its gate, the
  offset below which every record has its outputs in that partition's transaction
  (`OffsetTracker`; the outputs the engine kept for it are handed to the producer first), then
  begins the next transaction; a failure crashes the app (the engine
  rebuilds it: the transaction is aborted, the records are read again).
* Starting a partition's producer must succeed, or the rebalance fails and the app restarts.
* Revoked partitions commit what they finished before Faust stops their producers.
* `TxTable` writes its changelog records into the current record's (or periodic
  transaction's) outbox, so state and outputs commit together.
* Recovery asks the broker for each changelog partition's last stable offset (Faust reads the
  one cached from the latest fetch, None for a partition just assigned: taken as -1, a
  ConsistencyError that crashes the app at every rebalance, or a recovery that reads nothing),
  and ends at the last record a read_committed reader gets below it: the changelog ends in a
  commit marker no reader sees, and Faust otherwise waited two idle 5 s polls past it.
* A partition kept across an (eager) rebalance keeps its producer: its transaction is
  committed at the assignment (Faust would begin one again, and log that it failed).
* An assigned partition starts without the read offset Faust's fetch loop may have recorded
  after the revocation (`on_rebalance`): it would drop the first records read again.
* A send Faust makes itself outside an event (a timer, a user's `topic.send`) raises instead
  of leaving the transaction.
* Resuming Faust's flow control keeps the agent's queue (`KeepQueuesOnResume`): Faust resumes
  after its post-recovery seek, and emptying the queue then lost records. Which records the
  agent then takes, holds back or skips around a rebalance is `stream_apps.takeover`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from faust.exceptions import ProducerSendError
from faust.streams import current_event
from faust.tables.table import Table
from faust.transport.consumer import TransactionManager
from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread
from faust.transport.drivers.aiokafka import Consumer as AIOKafkaConsumer
from faust.types import TP
from mode.utils.queues import FlowControlEvent

from astraflow.errors import KafkaLayerError
from stream_apps.handover import buffer_dropped, drain_messages, wait_next_records

if TYPE_CHECKING:
    from stream_apps.engine_api import EngineApi

log = logging.getLogger(__name__)


def _readable_ends(kafka: Any, serde: Any, stable: dict[Any, int]) -> dict[Any, int]:
    """For each partition, one past the last record below its last stable offset that a
    read_committed reader gets; its first offset when it has none (nothing to recover)."""
    from astraflow.kafka.clients import reader, watermarks
    from astraflow.kafka.read import last_readable
    from astraflow.kafka.topics import reader_group

    # A fetch at the end waits at most 10 ms for data (librdkafka's default, 500 ms, is paid at
    # every partition's end: the reader stops there).
    ends_reader = reader(kafka, reader_group("changelog_ends"), serde.max_record_bytes,
                         **{"enable.partition.eof": True, "fetch.wait.max.ms": 10})
    try:
        ends = {}
        for tp, end in stable.items():
            last = last_readable(ends_reader, tp.topic, tp.partition, end) if end else None
            ends[tp] = last + 1 if last is not None else watermarks(ends_reader, tp.topic, tp.partition)[0]
        return ends
    finally:
        ends_reader.close()


class ExactTransactionManager(TransactionManager):
    """Faust's TransactionManager with commits that match outputs (see the module doc)."""

    @property
    def engine(self) -> EngineApi:
        return self.app.astraflow_engine  # type: ignore[attr-defined,no-any-return]

    async def send(self, topic: str, key: bytes | None, value: bytes | None, partition: int | None,
                   timestamp: float | None, headers: Any, *, transactional_id: str | None = None) -> Any:
        """A send Faust (or user code given the app) makes: into the current event's transaction."""
        event = current_event()
        if transactional_id is None and event is not None and event.message.topic == self.engine.source:
            transactional_id = self.engine.tid(event.message.partition)
        if transactional_id is None:
            raise ProducerSendError(
                f"record for {topic} sent outside a transaction; in an AstraFlow app send through the engine"
            )
        return await self.producer.send(topic, key, value, partition, timestamp, headers, transactional_id=transactional_id)

    async def commit(self, offsets: Any, start_new_transaction: bool = True) -> bool:
        engine = self.engine
        for p in sorted({tp.partition for tp in offsets if tp.topic == engine.source}):
            async with engine.gate(p):
                await self.commit_partition(p)
        return True

    async def commit_partition(self, partition: int) -> None:
        """Commits the transaction of source `partition` (with its offset); the caller holds the gate."""
        from aiokafka.structs import TopicPartition

        engine = self.engine
        tid = engine.tid(partition)
        txp = self.producer._transaction_producers.get(tid)
        if txp is None:
            engine.forget_unsent(partition)
            return  # not ours (any more)
        tp = (engine.source, partition)
        offset = engine.tracker.committable(tp)
        committed = engine.tracker.committed(tp)  # None: the partition is not tracked (revoked)
        if offset is not None and (committed is None or offset <= committed):
            offset = None
        try:
            await engine.flush_partition(partition)  # the outputs of the records whose offset this commits
            async with self.producer._trn_locks[tid]:
                if offset is not None:
                    await txp.send_offsets_to_transaction({TopicPartition(engine.source, partition): offset}, self.app.conf.id)
                await txp.commit_transaction()
                await txp.begin_transaction()
        except Exception as exc:
            error = KafkaLayerError(f"transaction {tid} did not commit ({exc!r}); it is aborted and its records read again")
            engine.crash(error)
            raise error from exc
        if offset is not None:
            engine.tracker.mark_committed({tp: offset})
            self.app.monitor.on_tp_commit({TP(*tp): offset})
        if offset is not None or (committed is not None and engine.tracker.committable(tp) in (None, committed)):
            self.app.consumer._thread._commit_recorded(TP(*tp))  # nothing left uncommitted: Faust's check agrees

    async def on_partitions_revoked(self, revoked: Any) -> None:
        engine = self.engine
        for p in sorted({tp.partition for tp in revoked if tp.topic == engine.source}):
            async with engine.gate(p):
                await self.commit_partition(p)

    async def on_rebalance(self, assigned: Any, revoked: Any, newly_assigned: Any) -> None:
        # Faust's fetch loop drops a record below the last offset it handed over (`_read_offset`).
        # It records that offset after each hand-over, also for the one it was handing over when
        # a revocation stopped the flow (the revocation already dropped the partition's entry),
        # and that record never reached the agent. Kept, the entry would drop the records between
        # the committed offset and it when the partition resumes, and the agent would commit past them.
        read_offsets = self.app.consumer._read_offset
        for tp in assigned:
            if tp.topic == self.engine.source and (stale := read_offsets.pop(tp, None)) is not None:
                log.info("%s[%d]: Faust's read offset %d, recorded after the revocation, forgotten", tp.topic, tp.partition, stale)
        await super().on_rebalance(assigned, revoked, newly_assigned)

    def _tps_to_transactional_ids(self, tps: Any) -> set[str]:
        # Faust asks its assignor for the partition's topic group, which it only knows when the
        # app has changelog tables (without, aiokafka's round-robin assignor runs): one id per
        # source partition does not need it.
        engine = self.engine
        return {engine.tid(tp.partition) for tp in tps if tp.topic == engine.source}

    async def _start_transactions(self, tids: Any) -> None:
        engine = self.engine
        for tid in tids:
            if tid in self.producer._transaction_producers:  # kept across the rebalance (module doc)
                partition = int(tid.rsplit("-", 1)[1])
                async with engine.gate(partition):
                    await self.commit_partition(partition)
                continue
            engine.forget_unsent(int(tid.rsplit("-", 1)[1]))  # kept for a producer that is gone: those records are read again
            await self.producer.maybe_begin_transaction(tid)
            if tid not in self.producer._transaction_producers:  # Faust logged why and went on
                raise KafkaLayerError(f"could not start the transactional producer {tid}; the app restarts")


class TxTable(Table):
    """A Faust table (bytes -> bytes) whose changelog writes join the engine's current transaction.

    After every rebalance each assigned partition is recovered from the start of its
    changelog: Faust's recovery resumes from the offset it last read, assuming the store kept
    what it had, but the memory store drops recovered keys of partitions it lost, and the apps
    forget revoked partitions (eager rebalancing revokes all of them, also those assigned
    again at once), so resuming would miss everything before that offset.
    """

    async def on_rebalance(self, assigned: Any, revoked: Any, newly_assigned: Any, generation_id: int = 0) -> None:
        await super().on_rebalance(assigned, revoked, newly_assigned, generation_id)
        self.app.astraflow_engine.takeover.tables_assigned(self.app.rebalancing_count)  # type: ignore[attr-defined]
        changelog = self.changelog_topic.get_topic_name()
        offsets = self.app.tables.recovery.active_offsets
        for tp in assigned:
            if tp.topic == changelog:
                offsets.pop(tp, None)

    async def on_recovery_completed(self, active_tps: Any, standby_tps: Any) -> None:
        await super().on_recovery_completed(active_tps, standby_tps)
        # Before Faust's seek to the committed offsets: records held back meanwhile come again.
        self.app.astraflow_engine.takeover.tables_recovered(self.app.rebalancing_count)  # type: ignore[attr-defined]
        self.app.astraflow_engine.handler.on_recovered(self.name)  # type: ignore[attr-defined]

    def on_key_set(self, key: Any, value: Any) -> None:
        self.app.astraflow_engine.changelog(self, key, value)  # type: ignore[attr-defined]

    def on_key_del(self, key: Any) -> None:
        self.app.astraflow_engine.changelog(self, key, None)  # type: ignore[attr-defined]


class ExactConsumerThread(AIOKafkaConsumerThread):
    """Faust's aiokafka consumer thread, with changelog ends a read_committed reader reaches.

    Faust's recovery of a changelog partition ends once it has applied the record at its
    "highwater" - 1. Faust takes the last stable offset from the latest fetch (none yet for a
    partition just assigned); asking the broker gives it, but under exactly-once a changelog ends
    in a transaction marker (and maybe aborted records) that no reader sees, so the recovery
    never reaches it and only ends after two idle 5-second polls (~10 s per takeover). Here the
    highwater is one past the last record a read_committed reader gets below the last stable
    offset (`astraflow.kafka.read.last_readable`, read in an executor: this thread heartbeats),
    so the recovery ends as soon as it applied that record.
    """

    async def _highwaters(self, partitions: Any) -> Any:
        consumer = self._ensure_consumer()
        if not self.consumer.in_transaction:
            return await super()._highwaters(partitions)
        stable = await consumer.end_offsets(list(partitions))  # read_committed: the last stable offsets
        engine = self.app.astraflow_engine
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, _readable_ends, engine.kafka, engine.serde, dict(stable))

    def _commit_recorded(self, tp: Any) -> None:
        """Tells Faust's slow-processing check that `tp` committed now (our commits bypass `_commit`)."""
        self.tp_last_committed_at[tp] = time.monotonic()


class ExactConsumer(AIOKafkaConsumer):
    """Faust's aiokafka consumer running `ExactConsumerThread`, whose fetch loop hands records
    over without four tasks each, and fetches again as soon as a full queue drains, not up to a
    second later (`stream_apps.handover`)."""

    _drain_messages = drain_messages
    _wait_next_records = wait_next_records

    def on_buffer_drop(self, tp: Any) -> None:
        buffer_dropped(self, tp, AIOKafkaConsumer.on_buffer_drop)

    def _new_consumer_thread(self) -> ExactConsumerThread:
        return ExactConsumerThread(self, loop=self.loop, beacon=self.beacon)


class KeepQueuesOnResume(FlowControlEvent):
    """Faust's flow control, except that resuming keeps what the agents' queues hold.

    `FlowControlEvent.resume` empties every queue it manages, and Faust resumes the flow at
    the end of a table recovery *after* seeking the source partitions to their committed
    offsets (`Recovery.on_recovery_completed`, `_resume_streams`). Records the fetch loop put
    into the agent's queue in between are dropped there, after Faust already recorded them as
    handed over (its read offset), so neither the seek nor the fetch loop hands them over again,
    and the agent commits past them. Seen in a crash run (DEVLOG): a fresh worker's agent got
    offsets 65, then 70 (66-69 emptied from the queue), and Faust then dropped the seek's
    re-read of 65-85 as below its read offset. Every record that reaches the queue now reaches
    the agent: `stream_apps.takeover` holds back those that come while the tables recover and
    skips the seek's second copy of those already taken. A revocation still empties the
    queues (Faust calls `clear` itself there), and the new assignment reads again from the
    committed offsets. The tables' changelog queue is still emptied at resume, as Faust does
    (its recovery seeks the changelogs first).
    """

    tables: Any = None  # the app's TableManager (its changelog queue), set by `keep_queues_on_resume`

    def resume(self) -> None:
        self._suspend.clear()
        self._resume.set()
        changelog_queue = getattr(self.tables, "_changelog_queue", None)
        if changelog_queue is not None:
            changelog_queue.clear()


def keep_queues_on_resume(app: Any) -> None:
    """Makes `app`'s flow control a `KeepQueuesOnResume` (call before the agents start)."""
    app.flow_control.__class__ = KeepQueuesOnResume
    app.flow_control.tables = app.tables
