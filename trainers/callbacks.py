"""Lightning pieces that connect the trainer to the dataflow; publication is in `publishing`.

- `AtomicCheckpointIO` + `save_checkpoint`: checkpoints written to a temporary file, fsynced and
  renamed (and the directory fsynced), so `kill -9` never leaves a torn file; `prepare_checkpoint`
  takes the state at once and writes it later (the publication's background thread).
- `SnapshotRequests`: snapshot requests for this policy from the `snapshot_requests` topic.
- `KafkaMetrics`: the module's metrics and staleness histogram of every `every`-th batch as
  Metric records (best effort: a broker outage delays them, never stops training).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from confluent_kafka import TopicPartition
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

from astraflow.config import KafkaSettings
from astraflow.errors import KafkaLayerError, ProduceError, SerdeError
from astraflow.kafka.clients import RecordProducer, reader, watermarks
from astraflow.kafka.topics import Topics, reader_group
from astraflow.records import Control, Metric
from astraflow.serde import AvroSerde
from astraflow.weights.versions import CONTROL_APP

log = logging.getLogger(__name__)

_CKPT = re.compile(r"^step-(\d+)\.ckpt$")


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save to a temporary file in the same directory, fsync, then rename into place.

    While `deferred` is a list (see `prepare_checkpoint`), a save copies the checkpoint's tensors
    to the CPU and appends the write to that list instead of writing: training may then change
    the weights and optimizer state while the copy is written."""

    def __init__(self) -> None:
        super().__init__()
        self.deferred: list[Callable[[], None]] | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if self.deferred is not None:
            copy = apply_to_collection(checkpoint, torch.Tensor, _cpu_copier())
            self.deferred.append(lambda: self._write(copy, Path(path)))
            return
        self._write(checkpoint, Path(path))

    @staticmethod
    def _write(checkpoint: dict[str, Any], path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)  # the rename itself survives a power cut
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _cpu_copier() -> Callable[[torch.Tensor], torch.Tensor]:
    """Copies tensors to the CPU; one copy per tensor seen twice (tied weights stay tied in the file)."""
    seen: dict[tuple[Any, ...], torch.Tensor] = {}

    def copy(t: torch.Tensor) -> torch.Tensor:
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if key not in seen:
            seen[key] = t.detach().to("cpu", copy=True)
        return seen[key]

    return copy


def newest_checkpoint(directory: Path) -> Path | None:
    """The checkpoint with the highest step in `directory` (complete by construction), or None."""
    if not directory.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _CKPT.match(p.name))]
    return max(found)[1] if found else None


def save_checkpoint(trainer: L.Trainer, directory: Path, keep: int = 2) -> Path:
    """Write `step-<global_step>.ckpt` (complete state: weights, optimizer, loops, data module,
    callbacks) atomically into `directory`; keep the newest `keep` checkpoints."""
    return prepare_checkpoint(trainer, directory, keep)()


def prepare_checkpoint(trainer: L.Trainer, directory: Path, keep: int = 2) -> Callable[[], Path]:
    """Take the state of `save_checkpoint` now; the function returned writes it (and prunes the
    old ones). Through an `AtomicCheckpointIO` the state taken is a CPU copy, so training may go
    on before the write; a strategy that writes by other means (FSDP) has written it here already."""
    directory = Path(directory)
    path = directory / f"step-{trainer.global_step:09d}.ckpt"
    io = getattr(trainer.strategy, "checkpoint_io", None)
    jobs: list[Callable[[], None]] = []
    if isinstance(io, AtomicCheckpointIO):
        io.deferred = jobs
    try:
        trainer.save_checkpoint(path, weights_only=False)
    finally:
        if isinstance(io, AtomicCheckpointIO):
            io.deferred = None
    zero = trainer.is_global_zero

    def write() -> Path:
        for job in jobs:
            job()
        if zero:
            found = sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := _CKPT.match(p.name)))
            for _, old in found[:-keep]:
                old.unlink(missing_ok=True)
        return path

    return write


class SnapshotRequests:
    """Reads snapshot requests for one policy from the `snapshot_requests` topic (only those sent after start)."""

    def __init__(self, kafka: KafkaSettings, topics: Topics, policy: str) -> None:
        self.key = f"{CONTROL_APP}/{policy}.snapshot"
        self.serde = AvroSerde.for_kafka(kafka)
        self._consumer = reader(kafka, reader_group("trainer_control"))
        try:
            _, high = watermarks(self._consumer, topics.snapshot_requests, 0)
            self._consumer.assign([TopicPartition(topics.snapshot_requests, 0, high)])
        except KafkaLayerError:
            self._consumer.close()
            self._consumer = None  # no control topic: nobody can ask

    def pending(self) -> bool:
        """Whether a snapshot was requested since the last call."""
        if self._consumer is None:
            return False
        asked = False
        for msg in self._consumer.consume(100, 0):
            if msg.error() is None and msg.key() == self.key.encode():
                try:
                    asked |= isinstance(self.serde.loads(msg.value()), Control)
                except SerdeError:  # a bad control record is simply not a request
                    continue
        return asked

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()


class KafkaMetrics(L.Callback):
    """Sends the module's `last_metrics` and `last_staleness` to the metrics topic (and to each of
    `observers`, e.g. the trainer's own /metrics endpoint)."""

    def __init__(self, producer: RecordProducer, topics: Topics, policy: str, every: int = 1,
                 observers: list[Callable[[Metric], None]] | None = None) -> None:
        self.producer, self.topic, self.policy, self.every = producer, topics.metrics, policy, every
        self.instance = f"{socket.gethostname()}-{os.getpid()}"
        self._batches = 0
        self.observers = list(observers or [])

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._batches += 1
        if not trainer.is_global_zero or self._batches % self.every:
            return
        labels = {"policy": self.policy, "step": str(trainer.global_step)}
        ts = int(time.time() * 1000)
        out = [Metric(f"trainer.{name}", float(value), "trainer", self.instance, labels, ts)
               for name, value in getattr(pl_module, "last_metrics", {}).items()]
        out += [Metric("trainer.staleness", float(count), "trainer", self.instance, {**labels, "bucket": bucket}, ts)
                for bucket, count in getattr(pl_module, "last_staleness", {}).items()]
        for m in out:
            self.producer.send(self.topic, m, key=self.policy)
            for observe in self.observers:
                observe(m)
        self.producer.poll(0)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        try:
            self.producer.flush(30.0)
        except ProduceError as exc:  # metrics are best effort; training is over anyway
            log.warning("some trainer metrics were not delivered: %s", exc)
