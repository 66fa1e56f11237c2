"""Training data from Kafka: TrainSamples of ``<policy>.train``, batched, with exact offsets.

`TrainStream` is an IterableDataset that reads every partition of the train topic with an
assigned consumer (no group rebalances) and yields padded batches, one per optimizer step,
closed when `batch_size` samples or the `token_budget` are reached, or `max_wait_s` after the
batch's first sample: the trainer never waits for a full batch.

Exactly-once training: each batch carries the next offset of every partition after its
samples (``batch["meta"]["offsets"]``). The LightningModule hands them to
`KafkaTrainData.mark_trained` inside `training_step`, before the optimizer step and before
any checkpoint of that step, and `KafkaTrainData.state_dict` puts them in every Lightning
checkpoint. On restart Lightning restores that state before it builds the dataloader, and the
stream seeks every partition to exactly those offsets, so no record is trained twice or skipped
even after `kill -9`. Group commits of the same offsets are only informational (lag display).

Several ranks (DDP / FSDP): rank 0 reads and decides each batch, broadcasts its plan
(partition, offset of every sample); every rank reads those exact records and trains its share,
so all ranks hold the same offsets and rank 0's checkpoint is complete.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import numpy as np
import torch
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from torch.utils.data import DataLoader, IterableDataset

from astraflow.config import KafkaSettings
from astraflow.errors import KafkaLayerError, SerdeError, TopicError
from astraflow.kafka.clients import DeadLetterWriter, RecordProducer
from astraflow.records import TrainSample
from astraflow.serde import AvroSerde
from astraflow.weights.publish import watermarks

log = logging.getLogger(__name__)


# ---- pure parts: batching and collation -----------------------------------------------------------


@dataclass(frozen=True)
class BatchLimits:
    """When a batch is full."""

    batch_size: int = 32  # most samples
    token_budget: int | None = None  # most padded tokens (samples x longest); None: unlimited

    def fits(self, n: int, longest: int, length: int) -> bool:
        """Whether a sample of `length` tokens fits a batch of `n` samples whose longest has `longest`."""
        if n >= self.batch_size:
            return False
        if self.token_budget is None or n == 0:  # an oversized sample forms a batch on its own
            return True
        return (n + 1) * max(longest, length) <= self.token_budget


def sample_problem(s: TrainSample, policy: str) -> str | None:
    """Why a sample cannot be trained on (for the DLQ), or None."""
    n = len(s.token_ids)
    if s.policy != policy:
        return f"sample is for policy {s.policy!r}, this trainer trains {policy!r}"
    if n < 2:
        return "sample has fewer than 2 tokens"
    if len(s.loss_mask) != n or len(s.behaviour_logprobs) != n:
        return f"token_ids ({n}), loss_mask ({len(s.loss_mask)}) and behaviour_logprobs ({len(s.behaviour_logprobs)}) differ in length"
    if not np.isfinite(s.advantage) or not np.all(np.isfinite(s.behaviour_logprobs[s.loss_mask.astype(bool)])):
        return "advantage or behaviour logprobs are not finite"
    return None


def collate(samples: Sequence[TrainSample], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded tensors of a batch: input_ids / attention_mask / loss_mask / behaviour_logprobs
    [B, T], advantages / rewards [B] float32, min_versions [B] int64. Position 0 is never trained
    (it has no context), padding never is."""
    b, t = len(samples), max(len(s.token_ids) for s in samples)
    ids = np.full((b, t), pad_id, np.int64)
    attn = np.zeros((b, t), np.int64)
    mask = np.zeros((b, t), np.bool_)
    blp = np.zeros((b, t), np.float32)
    for i, s in enumerate(samples):
        n = len(s.token_ids)
        ids[i, :n] = s.token_ids
        attn[i, :n] = 1
        mask[i, :n] = s.loss_mask.astype(bool)
        blp[i, :n] = s.behaviour_logprobs
    mask[:, 0] = False
    return {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(attn),
        "loss_mask": torch.from_numpy(mask),
        "behaviour_logprobs": torch.from_numpy(blp),
        "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        "rewards": torch.tensor([s.reward for s in samples], dtype=torch.float32),
        "min_versions": torch.tensor([s.min_version for s in samples], dtype=torch.int64),
    }


# ---- the stream ----------------------------------------------------------------------------------


@dataclass
class _Item:
    partition: int
    offset: int
    sample: TrainSample | None  # None: dead-lettered, consumed without training
    size: int = 0  # tokens
    ts: int = 0  # Kafka timestamp (ms): partitions are merged oldest first


class TrainStream(IterableDataset):
    """Batches of one policy's train topic; see the module docstring."""

    def __init__(
        self,
        kafka: KafkaSettings,
        topic: str,
        policy: str,
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
    ) -> None:
        super().__init__()
        self.should_stop = should_stop  # polled while waiting for samples (e.g. "SIGTERM received")
        self.kafka, self.topic, self.policy, self.limits, self.pad_id = kafka, topic, policy, limits, pad_id
        self.max_wait_s, self.start, self.stop_when_idle_s, self.deadline = max_wait_s, start, stop_when_idle_s, deadline
        self.group_id = group_id or f"{topic}.trainer"
        self.dlq = dlq
        self.serde = AvroSerde()
        self.positions: dict[int, int] = dict(resume_offsets or {})  # next offset to take, per partition
        self.skipped: dict[int, int] = collections.Counter()  # records lost to retention, per partition
        self._consumer: Consumer | None = None
        self._buffers: dict[int, collections.deque[_Item]] = collections.defaultdict(collections.deque)
        self._buffered = 0  # items in all buffers
        self._taken: dict[int, int] = collections.Counter()  # records taken per partition (merge tie-break)
        self.max_buffered = max(1000, 4 * limits.batch_size)  # decoded records held ahead of training
        self._stop = False
        self.min_samples = 1  # samples a batch needs (the number of ranks: each trains its share)

    # -- consumer ----------------------------------------------------------------------------------

    def _open(self) -> Consumer:
        if self._consumer is not None:
            return self._consumer
        c = Consumer(
            {
                **self.kafka.client_config(),
                "group.id": self.group_id,
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "isolation.level": "read_committed",
                "fetch.message.max.bytes": self.serde.max_record_bytes + 64 * 1024,
            }
        )
        try:
            md = c.list_topics(self.topic, timeout=10)
            parts = sorted(md.topics[self.topic].partitions) if md.topics[self.topic].error is None else []
        except KafkaException as exc:
            c.close()
            raise KafkaLayerError(f"cannot read the partitions of {self.topic}: {exc}") from exc
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
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        self._buffers.clear()
        self._buffered = 0

    @property
    def stopping(self) -> bool:
        """Whether to end the iteration: asked to, or `should_stop` says so."""
        return self._stop or (self.should_stop is not None and self.should_stop())

    def request_stop(self) -> None:
        """End the iteration after the current batch (e.g. on SIGTERM)."""
        self._stop = True

    def commit(self, offsets: dict[int, int]) -> None:
        """Informational group commit of trained offsets (the checkpoint is the truth)."""
        if self._consumer is not None and offsets:
            try:
                self._consumer.commit(
                    offsets=[TopicPartition(self.topic, p, o) for p, o in offsets.items()], asynchronous=True
                )
            except KafkaException as exc:  # lag display only: never stop training for it
                log.debug("group commit failed: %s", exc)

    def _fill(self, timeout_s: float) -> int:
        """Poll once; decode into the buffer; returns how many records arrived."""
        msgs = self._open().consume(500, timeout_s)
        n = 0
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.fatal():
                    raise KafkaLayerError(f"fatal Kafka error on {self.topic}: {err.str()}")
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("Kafka error on %s: %s", self.topic, err.str())
                continue
            n += 1
            item = self._decode(msg)
            self._buffers[item.partition].append(item)
            self._buffered += 1
        return n

    def _decode(self, msg: Message) -> _Item:
        p, o = msg.partition(), msg.offset()
        try:
            s = self.serde.loads(msg.value(), TrainSample)
            problem = sample_problem(s, self.policy)
        except SerdeError as exc:
            s, problem = None, exc
        if problem is not None:
            if self.dlq is not None:
                self.dlq.send(msg, problem if isinstance(problem, BaseException) else ValueError(problem))
            else:  # ranks other than 0 (rank 0 dead-letters), or no DLQ configured
                log.warning("skipping %s[%d]@%d: %s", self.topic, p, o, problem)
            return _Item(p, o, None, 0, msg.timestamp()[1])
        return _Item(p, o, s, len(s.token_ids), msg.timestamp()[1])

    # -- batching ----------------------------------------------------------------------------------

    def _head(self) -> _Item | None:
        """The oldest buffered record over all partitions (so no partition starves)."""
        heads = [(q[0].ts, self._taken[p], p) for p, q in self._buffers.items() if q]  # ties: fewer taken first
        return self._buffers[min(heads)[2]][0] if heads else None

    def _take(self, item: _Item) -> None:
        self._buffers[item.partition].popleft()
        self._buffered -= 1
        self._taken[item.partition] += 1
        expected = self.positions.get(item.partition, item.offset)
        if item.offset > expected:
            self.skipped[item.partition] += item.offset - expected
            log.warning("%s[%d]: offsets %d..%d are gone (retention?)", self.topic, item.partition, expected, item.offset - 1)
        self.positions[item.partition] = item.offset + 1

    def next_batch(self) -> list[_Item] | None:
        """The next batch's items (dead-lettered ones included), or None when the stream ends."""
        items: list[_Item] = []
        n = longest = 0
        first_at: float | None = None
        idle_since = time.monotonic()
        while True:
            if self._buffered < self.max_buffered:
                self._fill(0)  # whatever the client already fetched, from every partition
            while (it := self._head()) is not None:
                if it.sample is not None and n >= self.min_samples and not self.limits.fits(n, longest, it.size):
                    return items
                self._take(it)
                items.append(it)
                if it.sample is not None:
                    n, longest = n + 1, max(longest, it.size)
                    first_at = first_at or time.monotonic()
                    if n >= self.limits.batch_size:  # full: train it now, not when the next sample shows up
                        return items
            now = time.monotonic()
            if n >= self.min_samples and (self.stopping or now - (first_at or now) >= self.max_wait_s):
                return items
            if self.stopping or (self.deadline is not None and now >= self.deadline):
                return items if n >= self.min_samples else None
            if self.stop_when_idle_s is not None and not n and now - idle_since >= self.stop_when_idle_s:
                return None
            wait = self.max_wait_s - (now - first_at) if first_at else 0.5
            if self._fill(max(0.05, min(wait, 0.5))):
                idle_since = time.monotonic()

    def _fetch_planned(self, plan: list[tuple[int, int]]) -> list[_Item]:
        """Non-zero ranks: read exactly the records rank 0 planned."""
        want = collections.defaultdict(set)
        for p, o in plan:
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
        return [got[k] for k in plan]

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
        self.min_samples = 1 if dist is None else dist[1]
        while True:
            if dist is None:
                items = self.next_batch()
            else:
                rank = dist[0]
                items = self.next_batch() if rank == 0 else None
                plan = _broadcast(None if items is None else [(i.partition, i.offset) for i in items])
                if plan is None:
                    items = None
                elif rank != 0:
                    items = self._fetch_planned(plan)
            if items is None:
                return
            if self.dlq is not None and self.dlq.count:
                self.dlq.producer.flush()  # dead letters are durable before their offsets count as consumed
            samples = [i for i in items if i.sample is not None]
            if dist is not None:
                samples = samples[dist[0] :: dist[1]]
            if not samples:
                continue  # only dead letters: their offsets ride along with the next batch
            batch: dict[str, Any] = dict(collate([s.sample for s in samples], self.pad_id))  # type: ignore[misc]
            batch["meta"] = {
                "offsets": dict(self.positions),
                "samples": [[s.partition, s.offset, s.sample.sample_id] for s in samples],  # type: ignore[union-attr]
                "batch_samples": sum(i.sample is not None for i in items),  # over all ranks
            }
            yield batch


def _distributed() -> tuple[int, int] | None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if world > 1:
            return torch.distributed.get_rank(), world
    return None


def _broadcast(plan: list[tuple[int, int]] | None) -> list[tuple[int, int]] | None:
    box = [plan]
    torch.distributed.broadcast_object_list(box, src=0)  # in-cluster control message, never on the wire
    return box[0]


# ---- Lightning data module ------------------------------------------------------------------------


class KafkaTrainData(L.LightningDataModule):
    """Owns the TrainStream and the trained offsets that go into each checkpoint."""

    def __init__(self, stream_kwargs: dict[str, Any], dlq_topic: str | None = None) -> None:
        super().__init__()
        self.stream_kwargs = stream_kwargs  # TrainStream keyword arguments (kafka, topic, policy, ...)
        self.dlq_topic = dlq_topic
        self.trained: dict[int, int] = {}  # next offset per partition after the last trained batch
        self.trained_samples = 0  # samples trained so far, across restarts
        self.resumed_from: dict[int, int] | None = None  # offsets restored from a checkpoint
        self.stream: TrainStream | None = None
        self._producer: RecordProducer | None = None

    def train_dataloader(self) -> DataLoader:
        if self.stream is None:
            dlq = None
            if self.dlq_topic is not None:
                self._producer = RecordProducer(self.stream_kwargs["kafka"])
                dlq = DeadLetterWriter(self._producer, self.dlq_topic, component="trainer")
            resume = dict(self.resumed_from) if self.resumed_from is not None else None
            # Lightning's SIGTERM handler only flags the trainer and acts between batches; the
            # stream polls the flag so that a trainer waiting for samples stops too.
            self.stream = TrainStream(**self.stream_kwargs, resume_offsets=resume, dlq=dlq,
                                      should_stop=lambda: bool(getattr(self.trainer, "received_sigterm", False)))
        # batch_size=None: the stream yields whole batches; one process reads Kafka (no workers).
        return DataLoader(self.stream, batch_size=None, num_workers=0)

    def mark_trained(self, meta: dict[str, Any]) -> None:
        """Called by the module inside training_step: these offsets are now part of the weights."""
        self.trained = {int(p): int(o) for p, o in meta["offsets"].items()}
        self.trained_samples += int(meta["batch_samples"])
        if self.stream is not None:
            self.stream.commit(self.trained)

    def state_dict(self) -> dict[str, Any]:
        topic = self.stream_kwargs["topic"]
        return {"topic": topic, "offsets": dict(self.trained), "trained_samples": self.trained_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        topic = self.stream_kwargs["topic"]
        if state.get("topic") != topic:
            raise KafkaLayerError(
                f"checkpoint was trained on {state.get('topic')!r}, not {topic!r}; "
                "use another checkpoint_dir or set trainer.resume=false"
            )
        self.trained = {int(p): int(o) for p, o in state["offsets"].items()}
        self.resumed_from = dict(self.trained)
        self.trained_samples = int(state.get("trained_samples", 0))

    def teardown(self, stage: str) -> None:
        if self.stream is not None:
            self.stream.commit(self.trained)
            self.stream.close()
            self.stream = None
        if self._producer is not None:
            self._producer.flush()

