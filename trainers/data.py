"""Training data from Kafka: TrainSamples of ``<policy>.train``, batched, with exact offsets.

`TrainStream` is an IterableDataset that reads every partition of the train topic with an
assigned consumer (no group rebalances) and yields padded batches (`trainers.batching`), one per
optimizer step, closed when `batch_size` samples or the `token_budget` are reached, or
`max_wait_s` after the batch's first sample: the trainer never waits for a full batch.
While its first batch is still filling, the stream hands the samples it has to `on_partial`
once (`astraflow train`: the module's `warm_up`, a forward and backward pass whose gradients
are dropped), so the process's one-time costs are paid while the rest of the batch arrives, not
in the first optimizer step.

Exactly-once training: each batch carries the next offset of every partition after its
samples (``batch["meta"]["offsets"]``). The LightningModule hands them to
`trainers.datamodule.KafkaTrainData.mark_trained` inside `training_step`, before the optimizer step and before
any checkpoint of that step, and `KafkaTrainData.state_dict` puts them in every Lightning
checkpoint. On restart Lightning restores that state before it builds the dataloader, and the
stream seeks every partition to exactly those offsets, so no record is trained twice or skipped
even after `kill -9`. Group commits of the same offsets are only informational (lag display).

Every record is untrusted: one that cannot be decoded, breaks a limit of
`astraflow.rl.samples.sample_problem` (vocabulary, length, finite and bounded advantage and
logprobs, consistent arrays, masks, versions) or repeats a sample id of the `SampleWindow`
(trained ids, kept in the checkpoint) goes to the DLQ with the reason and counts as consumed;
it never reaches a batch. Dead letters are acknowledged before the batch that consumed them is
trained, waiting for Kafka as long as it takes (a broker outage never stops the trainer).

Several ranks (DDP / FSDP): rank 0 reads and decides each batch, broadcasts its plan
(partition, offset and verdict of every record); every rank reads those exact records and
trains its share (`trainers.batching.rank_rows`: each optimizer step's rows dealt round robin),
so all ranks hold the same offsets, sample ids and counters, and rank 0's checkpoint is
complete. Only rank 0 dead-letters and commits the group's offsets. While rank 0 waits for
samples it broadcasts "wait" every `heartbeat_s`, so the other ranks never sit in a collective
longer than that and a collective timeout only fires when a rank is really gone.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from confluent_kafka import Consumer, KafkaException, Message, TopicPartition
from torch.utils.data import IterableDataset

from astraflow.config import KafkaSettings
from astraflow.errors import KafkaLayerError, SerdeError, TopicError
from astraflow.kafka.backlog import commit_metadata
from astraflow.kafka.clients import RecordProducer, consume_ready, data_messages, reader, watermarks
from astraflow.kafka.received import DeadLetterWriter, Received
from astraflow.records import TrainSample
from astraflow.rl.samples import (
    DuplicateSampleError,
    InvalidSampleError,
    SampleLimits,
    SampleWindow,
    sample_problem,
)
from astraflow.serde import AvroSerde
from trainers.batching import BatchLimits, collate, rank_rows

log = logging.getLogger(__name__)


def flush_patiently(producer: RecordProducer, what: str, should_stop: Callable[[], bool] | None = None) -> bool:
    """Wait until every queued record of `producer` is acknowledged, however long Kafka is away.

    Returns False if `should_stop` said to give up first. Records Kafka rejects (not a timeout:
    the trainer's producers never time out) raise ProduceError.
    """
    waited = 0.0
    while producer.raw.flush(10.0):
        waited += 10.0
        if should_stop is not None and should_stop():
            return False
        if waited % 60 == 10:
            log.warning("waiting for Kafka to acknowledge %s (%.0f s so far); training resumes once it does", what, waited)
    producer.flush(0)  # raises on rejected records
    return True


TRAINER_PRODUCER = {
    # A broker outage must not fail a record: wait for Kafka indefinitely (librdkafka's default
    # message.timeout.ms of 5 minutes would drop dead letters and metrics after a 5-minute outage).
    "message.timeout.ms": 0,
}


@dataclass
class _Item:
    partition: int
    offset: int
    sample: TrainSample | None  # None: dead-lettered, consumed without training
    size: int = 0  # tokens
    ts: int = 0  # Kafka timestamp (ms): partitions are merged oldest first
    msg: Message | None = None  # the raw record, for dead-lettering (kept while its batch is in flight)


WAIT = "wait"  # rank 0's plan while no batch is ready yet (a heartbeat for the other ranks)


@dataclass
class _Filling:
    """The batch being filled; kept across `next_batch` calls that return WAIT."""

    items: list[_Item] = field(default_factory=list)  # taken so far, dead-lettered ones included
    ids: set[str] = field(default_factory=set)  # sample ids admitted into it
    n: int = 0  # samples (not dead-lettered)
    longest: int = 0  # tokens of the longest sample
    first_at: float | None = None  # when its first sample was taken
    idle_since: float = field(default_factory=time.monotonic)  # when a record last arrived


class TrainStream(IterableDataset):
    """Batches of one policy's train topic; see the module docstring."""

    def __init__(
        self,
        kafka: KafkaSettings,
        topic: str,
        policy: str | SampleLimits,
        *,
        limits: BatchLimits = BatchLimits(),
        pad_id: int = 0,
        max_wait_s: float = 2.0,
        start: str = "earliest",
        resume_offsets: dict[int, int] | None = None,
        stop_when_idle_s: float | None = None,
        deadline: float | None = None,
        group_id: str | None = None,
        dlq: DeadLetterWriter | None = None,
        should_stop: Callable[[], bool] | None = None,
        window: SampleWindow | None = None,
        report_s: float = 0.02,
        minibatches: int = 1,
        heartbeat_s: float = 5.0,
    ) -> None:
        super().__init__()
        self.should_stop = should_stop  # polled while waiting for samples (e.g. "SIGTERM received")
        if isinstance(policy, str):  # no model at hand: only the policy and generic bounds are checked
            policy = SampleLimits(policy, vocab_size=2**31 - 1, max_len=1 << 20)
        self.sample_limits = policy
        self.kafka, self.topic, self.policy, self.limits, self.pad_id = kafka, topic, policy.policy, limits, pad_id
        self.window = window if window is not None else SampleWindow(100_000)  # trained ids (the data module's)
        self.newest_version: int | None = None  # newest published version (set by the publisher)
        self.rejected = 0  # records dead-lettered: undecodable, invalid or duplicate
        self._inflight: dict[int, list[_Item]] = {}  # batch seq -> its items, until trained
        self._inflight_ids: set[str] = set()  # sample ids of in-flight batches
        self._seq = 0
        self.max_wait_s, self.start, self.stop_when_idle_s, self.deadline = max_wait_s, start, stop_when_idle_s, deadline
        self.group_id = group_id or f"{topic}.trainer"
        self.dlq = dlq
        self.serde = AvroSerde.for_kafka(kafka)
        self.positions: dict[int, int] = dict(resume_offsets or {})  # next offset to take, per partition
        self.skipped: dict[int, int] = collections.Counter()  # records lost to retention, per partition
        self._consumer: Consumer | None = None
        self._buffers: dict[int, collections.deque[_Item]] = collections.defaultdict(collections.deque)
        self._buffered = 0  # items in all buffers
        self._taken: dict[int, int] = collections.Counter()  # records taken per partition (merge tie-break)
        self.max_buffered = max(1000, 4 * limits.batch_size)  # decoded records held ahead of training
        self._stop = False
        self.minibatches = minibatches  # optimizer steps per batch pass (the module's): rows are dealt per step
        self.min_samples = 1  # samples a batch needs (ranks x minibatches: each rank trains a share of each step)
        self.heartbeat_s = heartbeat_s  # rank 0 broadcasts WAIT this often while no batch is ready
        self.reports = True  # group commits of trained offsets (rank 0 only)
        self._filling: _Filling | None = None
        # The backlog report (see `commit`): a background reader keeps the group commit's metadata
        # current while the trainer trains, every `report_s` (0: only when the trainer reads).
        self.report_s = report_s
        self._lock = threading.RLock()  # the consumer, the buffers and the commits: one thread at a time
        # Called once with the first incomplete batch, collated, before the stream waits for the rest
        # (the module's warm-up; see the module docstring); None: nothing is done while waiting.
        self.on_partial: Callable[[dict[str, Any]], None] | None = None
        self._partial_done = False
        self._raw: list[Message] = []  # polled by the background reader, decoded by the next `_fill`
        self._uncommitted: dict[int, collections.deque[int]] = collections.defaultdict(collections.deque)  # taken offsets past the committed ones
        self._untracked: set[int] = set()  # partitions with more taken past the commit than `_uncommitted` keeps
        self._committed: dict[int, int] = {}  # the trained offsets last committed
        self._reported: list[tuple[int, int, str | None]] | None = None  # the last group commit sent
        self._reader: threading.Thread | None = None
        self._closing = threading.Event()
        self._reader_error: BaseException | None = None

    # -- consumer ----------------------------------------------------------------------------------

    def _open(self) -> Consumer:
        if self._consumer is not None:
            return self._consumer
        # assign() only: the offsets it commits to its group are informational (status, the curator)
        c = reader(self.kafka, self.group_id, self.serde.max_record_bytes)
        waited = 0.0
        while True:  # Kafka may be away (outage, restart): wait for it rather than exit
            try:
                md = c.list_topics(self.topic, timeout=10)
                parts = sorted(md.topics[self.topic].partitions) if md.topics[self.topic].error is None else []
                break
            except KafkaException as exc:
                waited += 10
                if self.stopping:
                    c.close()
                    raise KafkaLayerError(f"cannot read the partitions of {self.topic}: {exc}") from exc
                log.warning("cannot reach Kafka for %s (%.0f s): %s; retrying", self.topic, waited, exc)
        if not parts:
            c.close()
            raise TopicError(f"train topic {self.topic} does not exist; create it with `astraflow topics create`")
        for p in parts:
            if p not in self.positions:  # new run (or new partition): concrete offsets, so checkpoints name them
                low, high = watermarks(c, self.topic, p)
                self.positions[p] = high if self.start == "latest" else low
        c.assign([TopicPartition(self.topic, p, self.positions[p]) for p in parts])
        self._consumer = c
        return c

    def close(self) -> None:
        self._closing.set()
        if self._reader is not None:
            self._reader.join()
            self._reader = None
        with self._lock:
            if self._consumer is not None:
                self._consumer.close()
                self._consumer = None
            self._buffers.clear()
            self._buffered = 0
            self._raw.clear()

    @property
    def stopping(self) -> bool:
        """Whether to end the iteration: asked to, or `should_stop` says so."""
        return self._stop or (self.should_stop is not None and self.should_stop())

    def request_stop(self) -> None:
        """End the iteration after the current batch (e.g. on SIGTERM)."""
        self._stop = True

    def commit(self, offsets: dict[int, int]) -> None:
        """Group commit of trained offsets: the lag display and the curator's count of samples not
        trained yet read it (the checkpoint is the truth of what was trained).

        Each partition is committed past the offsets that hold no sample (the transaction markers
        curate's exactly-once commits leave, aborted records): up to the next record the stream
        holds, or to the consumer's position when it holds none; and with the metadata of
        `astraflow.kafka.backlog` (records held past the offset, taken or not, read up to where),
        so that markers further on are not counted as samples either. Counted as samples, they
        would make the curator, which keeps at most max-ahead tasks between itself and the
        trainer, issue fewer tasks than there is room for.

        The samples of the next batch mostly arrive while the trainer trains this one, each
        transaction of them with its marker, which only a reader passes. So the metadata is kept
        current: the stream commits the same offsets again with new metadata whenever it reads
        more, and while the trainer trains (nothing reads then) a background reader polls every
        `report_s` and does so (it only fetches; records are decoded when the trainer next reads)."""
        if not offsets or not self.reports:
            return
        with self._lock:
            for p, o in offsets.items():
                taken = self._uncommitted.get(p)
                while taken and taken[0] < o:
                    taken.popleft()
                if p in self._untracked and o >= self.positions.get(p, o):  # nothing taken past it: known again
                    self._untracked.discard(p)
            self._committed = dict(offsets)
            if self._consumer is None:
                return
            if self._buffered + len(self._raw) < self.max_buffered:
                self._fill(0)  # the client passes the markers it fetched (and moves its position) while polled; reports
            else:
                self._report()
            if self._reader is None and self.report_s > 0:
                self._closing.clear()
                self._reader = threading.Thread(target=self._read_in_background, name="train-backlog-report", daemon=True)
                self._reader.start()

    def _report(self) -> None:
        """Commits the trained offsets with the metadata of what is read now (see `commit`); the
        caller holds the lock. Nothing is sent when it would repeat the last commit."""
        if self._consumer is None or not self._committed:
            return
        raw: dict[int, list[int]] = collections.defaultdict(list)
        for msg in self._raw:
            if msg.error() is None and msg.topic() == self.topic:
                raw[msg.partition()].append(msg.offset())
        try:
            read = {tp.partition: tp.offset for tp in self._consumer.position(
                [TopicPartition(self.topic, p) for p in self._committed])}
            marks = []
            for p, o in self._committed.items():
                # records read past the trained offset, in offset order: taken into a batch not
                # trained yet, decoded and waiting, fetched by the background reader
                taken, held, fetched = self._uncommitted.get(p) or (), self._buffers.get(p) or (), raw.get(p, [])
                first = taken[0] if taken else held[0].offset if held else fetched[0] if fetched else read.get(p, -1)
                meta: dict[str, str] = {}
                if p not in self._untracked:  # untracked: the trained offset alone, counted by offsets (never too few)
                    o = max(o, first)
                    if read.get(p, -1) >= o:
                        meta["metadata"] = commit_metadata(len(taken) + len(held) + len(fetched), read[p])
                marks.append(TopicPartition(self.topic, p, o, **meta))
            sent = [(tp.partition, tp.offset, tp.metadata) for tp in marks]
            if sent != self._reported:
                self._consumer.commit(offsets=marks, asynchronous=True)
                self._reported = sent
        except KafkaException as exc:  # never stop training for it (the curator measures again)
            log.debug("group commit failed: %s", exc)

    def _read_in_background(self) -> None:
        """While the trainer trains: fetch what arrived and report it (see `commit`). Skips a turn
        while the trainer itself reads (it reports then)."""
        while not self._closing.wait(self.report_s):
            if not self._lock.acquire(blocking=False):
                continue
            try:
                if self._consumer is not None and self._buffered + len(self._raw) < self.max_buffered:
                    msgs = self._consumer.consume(500, 0)
                    self._raw.extend(msgs)
                    self._report()
            except BaseException as exc:  # raised in the trainer's thread at its next read
                self._reader_error = exc
                return
            finally:
                self._lock.release()

    def _fill(self, timeout_s: float) -> int:
        """Poll once (returning as soon as a record is there); decode into the buffer, with what the
        background reader fetched; report the backlog; returns how many records arrived."""
        with self._lock:
            if self._reader_error is not None:
                raise KafkaLayerError(f"reading {self.topic} in the background failed: {self._reader_error!r}") from self._reader_error
            msgs, self._raw = self._raw, []
            msgs += consume_ready(self._open(), 500, 0 if msgs else timeout_s)
            n = 0
            for msg in data_messages(msgs, self.topic):
                n += 1
                item = self._decode(msg)
                self._buffers[item.partition].append(item)
                self._buffered += 1
            self._report()
            return n

    def _decode(self, msg: Message) -> _Item:
        p, o = msg.partition(), msg.offset()
        try:
            s = self.serde.loads(msg.value(), TrainSample)
        except SerdeError as exc:
            self._reject(msg, exc)
            return _Item(p, o, None, 0, msg.timestamp()[1])
        return _Item(p, o, s, len(s.token_ids), msg.timestamp()[1], msg)

    def _reject(self, msg: Message, error: BaseException) -> None:
        self.rejected += 1
        if self.dlq is not None:
            self.dlq.send(Received.of(msg), error)
        else:  # ranks other than 0 (rank 0 dead-letters), or no DLQ configured
            log.warning("skipping %s[%d]@%d: %s", self.topic, msg.partition(), msg.offset(), error)

    def _admit(self, item: _Item, batch_ids: set[str]) -> None:
        """Validate a taken record against the limits and the trained ids; refuse it if need be.

        Checked when taken, not when decoded: a duplicate's verdict depends on what was trained
        before it, and `newest_version` on what was published by then.
        """
        s = item.sample
        if s is None:
            return
        problem = sample_problem(s, self.sample_limits, self.newest_version)
        error: InvalidSampleError | None = None
        if problem is not None:
            error = InvalidSampleError(problem)
        elif s.sample_id in self.window or s.sample_id in self._inflight_ids or s.sample_id in batch_ids:
            error = DuplicateSampleError(f"sample_id {s.sample_id!r} was already trained; dropped (trainer.dedup_window)")
        if error is not None:
            assert item.msg is not None
            self._reject(item.msg, error)
            item.sample, item.size = None, 0
        else:
            batch_ids.add(s.sample_id)

    # -- batching ----------------------------------------------------------------------------------

    def _head(self) -> _Item | None:
        """The oldest buffered record over all partitions (so no partition starves)."""
        heads = [(q[0].ts, self._taken[p], p) for p, q in self._buffers.items() if q]  # ties: fewer taken first
        return self._buffers[min(heads)[2]][0] if heads else None

    def _take(self, item: _Item) -> None:
        self._buffers[item.partition].popleft()
        self._buffered -= 1
        self._taken[item.partition] += 1
        taken = self._uncommitted[item.partition]
        taken.append(item.offset)  # held until its offsets are committed
        if len(taken) > 8 * self.max_buffered:  # a reader that never commits stays bounded
            taken.clear()
            self._untracked.add(item.partition)
        expected = self.positions.get(item.partition, item.offset)
        if item.offset > expected and self._lost_to_retention(item.partition, expected):
            self.skipped[item.partition] += item.offset - expected
            log.warning("%s[%d]: offsets %d..%d are gone (retention)", self.topic, item.partition, expected, item.offset - 1)
        self.positions[item.partition] = item.offset + 1

    def _lost_to_retention(self, partition: int, expected: int) -> bool:
        """Whether a gap before `expected` is records deleted by retention, not a transaction's marker.

        Reading `read_committed`, every transaction leaves a gap (its commit marker, and an aborted
        transaction's records): those are not losses. Records were lost only when the gap starts
        below the partition's log start offset, which the client caches from its fetches.
        """
        if self._consumer is None:
            return False
        low, _ = self._consumer.get_watermark_offsets(TopicPartition(self.topic, partition), cached=True)
        return 0 <= expected < low

    def next_batch(self, heartbeat_s: float | None = None) -> list[_Item] | str | None:
        """The next batch's items (dead-lettered ones included), or None when the stream ends; with
        `heartbeat_s`, WAIT once that long passed without a batch (the batch keeps filling at
        the next call)."""
        with self._lock:
            return self._next_batch(heartbeat_s)

    def _next_batch(self, heartbeat_s: float | None = None) -> list[_Item] | str | None:
        f = self._filling = self._filling or _Filling()
        started = time.monotonic()

        def done(result: list[_Item] | None) -> list[_Item] | None:
            self._filling = None
            return result

        while True:
            if self._buffered < self.max_buffered:
                self._fill(0)  # whatever the client already fetched, from every partition
            while (it := self._head()) is not None:
                if it.sample is not None and f.n >= self.min_samples and not self.limits.fits(f.n, f.longest, it.size):
                    return done(f.items)
                self._take(it)
                self._admit(it, f.ids)
                f.items.append(it)
                if it.sample is not None:
                    f.n, f.longest = f.n + 1, max(f.longest, it.size)
                    f.first_at = f.first_at or time.monotonic()
                    if f.n >= self.limits.batch_size and f.n >= self.min_samples:  # full: train it now
                        return done(f.items)
            now = time.monotonic()
            if f.n >= self.min_samples and (self.stopping or now - (f.first_at or now) >= self.max_wait_s):
                return done(f.items)
            if self.stopping or (self.deadline is not None and now >= self.deadline):
                return done(f.items if f.n >= self.min_samples else None)
            if self.stop_when_idle_s is not None and not f.n and now - f.idle_since >= self.stop_when_idle_s:
                return done(None)
            if heartbeat_s is not None and now - started >= heartbeat_s:
                return WAIT
            if f.n and self.on_partial is not None and not self._partial_done:
                self._partial_done = True  # once per stream: the one-time costs are paid once
                self.on_partial(dict(collate([i.sample for i in f.items if i.sample is not None], self.pad_id)))
                continue  # samples may have arrived meanwhile
            wait = self.max_wait_s - (now - f.first_at) if f.first_at else 0.5
            if heartbeat_s is not None:
                wait = min(wait, heartbeat_s)
            if self._fill(max(0.05, min(wait, 0.5))):
                f.idle_since = time.monotonic()

    def _fetch_planned(self, plan: list[tuple[int, int, bool]]) -> list[_Item]:
        """Non-zero ranks: read exactly the records rank 0 planned, with its verdicts."""
        with self._lock:
            return self._fetch_planned_locked(plan)

    def _fetch_planned_locked(self, plan: list[tuple[int, int, bool]]) -> list[_Item]:
        want = collections.defaultdict(set)
        keep = {(p, o): ok for p, o, ok in plan}
        for p, o, _ in plan:
            want[p].add(o)
        got: dict[tuple[int, int], _Item] = {}
        deadline = time.monotonic() + 120
        while len(got) < len(plan):
            for p, queue in self._buffers.items():  # the plan takes a prefix of each partition
                while queue and queue[0].offset in want[p]:
                    got[(p, queue[0].offset)] = queue[0]
                    self._take(queue[0])
            if len(got) < len(plan):
                if time.monotonic() > deadline:
                    raise KafkaLayerError(f"rank could not read the planned records of {self.topic} in 120 s")
                self._fill(0.5)
        items = [got[(p, o)] for p, o, _ in plan]
        for it in items:
            if not keep[(it.partition, it.offset)]:
                it.sample = None
        return items

    def __len__(self) -> int:
        """A stream has no length; this bound exists so that Lightning does not prefetch.

        Without a length, Lightning's fetcher reads batch N+1 before it trains on batch N (to know
        whether N is the last). On a stream that means waiting for a whole batch of rollouts that
        may only be issued once batch N is trained: with a curator keeping one batch ahead, that
        wait lasts until `max_wait_s`. With a length Lightning fetches a batch when it trains it.
        The stream still ends when it stops (idle, deadline, SIGTERM), as before.
        """
        return 2**31 - 1

    def __iter__(self) -> Iterator[dict[str, Any]]:
        dist = _distributed()
        rank, world = dist if dist is not None else (0, 1)
        self.min_samples = world * self.minibatches
        if rank != 0:  # rank 0 dead-letters and reports; the others only train their share
            self.dlq, self.reports = None, False
        while True:
            t0 = time.perf_counter()
            if dist is None:
                items = self.next_batch()
            else:
                got = self.next_batch(self.heartbeat_s) if rank == 0 else None
                plan = _broadcast(got if got is None or isinstance(got, str)
                                  else [(i.partition, i.offset, i.sample is not None) for i in got])
                if plan == WAIT:
                    continue
                if plan is None:
                    items = None
                elif rank != 0:
                    items = self._fetch_planned(plan)
                else:
                    assert isinstance(got, list)
                    items = got
            if items is None:
                return
            if self.dlq is not None and self.dlq.count:
                # dead letters are durable before their offsets count as consumed
                flush_patiently(self.dlq.producer, "dead letters", lambda: self.stopping)
            kept = [i for i in items if i.sample is not None]
            if not kept:
                continue  # only dead letters: their offsets ride along with the next batch
            parts = rank_rows(len(kept), self.minibatches, world, rank)
            samples = [kept[r] for part in parts for r in part]
            self._seq += 1
            self._inflight[self._seq] = kept
            self._inflight_ids.update(i.sample.sample_id for i in kept)  # type: ignore[union-attr]
            while len(self._inflight) > 8:  # a reader that never settles (no data module) stays bounded
                self.settle(min(self._inflight))
            t1 = time.perf_counter()
            batch: dict[str, Any] = dict(collate([s.sample for s in samples], self.pad_id))  # type: ignore[misc]
            batch["meta"] = {
                "fetch_s": t1 - t0,  # waiting for, decoding and checking its records (metrics)
                "collate_s": time.perf_counter() - t1,
                "seq": self._seq,
                "offsets": dict(self.positions),
                # every sample of the batch over all ranks: [partition, offset, sample_id]
                "samples": [[i.partition, i.offset, i.sample.sample_id] for i in kept],  # type: ignore[union-attr]
                "batch_samples": len(kept),
                "parts": [len(part) for part in parts],  # this rank's rows per optimizer step, in order
            }
            yield batch

    def settle(self, seq: int) -> list[_Item]:
        """The batch `seq` was trained (or skipped): forget its items and return them."""
        items = self._inflight.pop(seq, [])
        for i in items:
            self._inflight_ids.discard(i.sample.sample_id)  # type: ignore[union-attr]
        return items


def _distributed() -> tuple[int, int] | None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if world > 1:
            return torch.distributed.get_rank(), world
    return None


def _broadcast(plan: list[tuple[int, int, bool]] | str | None) -> list[tuple[int, int, bool]] | str | None:
    box = [plan]
    torch.distributed.broadcast_object_list(box, src=0)  # in-cluster control message, never on the wire
    return box[0]
