"""Lightning callbacks that connect the trainer to the dataflow and make it restartable.

- `PublishWeights`: a snapshot when training starts, then a version every K optimizer steps
  (and at the end); snapshots also on request from the control topic.
- `StepCheckpoint` + `AtomicCheckpointIO`: a checkpoint every N steps, at the end and on
  SIGTERM, written to a temporary file and renamed, so `kill -9` never leaves a torn file.
- `KafkaMetrics`: the module's step metrics and staleness histogram as Metric records.
- `TrainedLog`: an optional JSONL audit of which records each step trained.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from confluent_kafka import Consumer, TopicPartition
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from astraflow.config import KafkaSettings
from astraflow.errors import KafkaLayerError, SerdeError
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.topics import Topics
from astraflow.records import Control, Metric
from astraflow.serde import AvroSerde
from astraflow.weights.publish import CONTROL_APP, WeightPublisher, watermarks

_CKPT = re.compile(r"^step-(\d+)\.ckpt$")


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save to a temporary file in the same directory, fsync, then rename into place."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def newest_checkpoint(directory: Path) -> Path | None:
    """The checkpoint with the highest step in `directory` (complete by construction), or None."""
    if not directory.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _CKPT.match(p.name))]
    return max(found)[1] if found else None


class StepCheckpoint(L.Callback):
    """Checkpoint every `every` optimizer steps, at the end of training and on SIGTERM."""

    def __init__(self, directory: Path, every: int = 10, keep: int = 2) -> None:
        self.directory, self.every, self.keep = Path(directory), every, keep
        self._saved_step = -1

    def save(self, trainer: L.Trainer) -> None:
        step = trainer.global_step
        if step == self._saved_step or step == 0:
            return
        trainer.save_checkpoint(self.directory / f"step-{step:09d}.ckpt", weights_only=False)
        self._saved_step = step
        if trainer.is_global_zero:
            found = sorted((int(m.group(1)), p) for p in self.directory.iterdir() if (m := _CKPT.match(p.name)))
            for _, old in found[: -self.keep]:
                old.unlink(missing_ok=True)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step % self.every == 0:
            self.save(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.save(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # Lightning raises SIGTERMException only between batches, where weights and offsets agree.
        if isinstance(exception, SIGTERMException):
            self.save(trainer)


class SnapshotRequests:
    """Reads snapshot requests for one policy from the control topic (only those sent after start)."""

    def __init__(self, kafka: KafkaSettings, topics: Topics, policy: str) -> None:
        self.key = f"{CONTROL_APP}/{policy}.snapshot"
        self.serde = AvroSerde()
        self._consumer = Consumer({**kafka.client_config(), "group.id": "astraflow-trainer-control", "enable.auto.commit": False})
        try:
            _, high = watermarks(self._consumer, topics.control, 0)
            self._consumer.assign([TopicPartition(topics.control, 0, high)])
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


class PublishWeights(L.Callback):
    """Publishes the policy on its weights topic; see the module docstring."""

    def __init__(self, publisher: WeightPublisher, every: int = 1, requests: SnapshotRequests | None = None) -> None:
        self.publisher, self.every, self.requests = publisher, every, requests
        self._published_step = -1
        self._started = False  # the starting snapshot is out

    def _publish(self, trainer: L.Trainer, module: L.LightningModule, snapshot: bool = False) -> None:
        state = trainer.strategy.lightning_module_state_dict()  # full state on rank 0 (FSDP gathers)
        version = None
        if trainer.is_global_zero:
            if self.requests is not None and self.requests.pending():
                snapshot = True
            weights = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
            dm = trainer.datamodule
            manifest = self.publisher.publish(
                weights, trainer_step=trainer.global_step, trained_samples=getattr(dm, "trained_samples", 0), snapshot=snapshot
            )
            version = manifest.version
        version = trainer.strategy.broadcast(version, src=0)
        module.policy_version = int(version)
        self._published_step = trainer.global_step

    def _start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Receivers get this process's weights as a snapshot to start from.
        if trainer.is_global_zero:
            self.publisher.start()
        self._publish(trainer, pl_module, snapshot=True)
        self._started = True

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A fresh run publishes its starting weights before Lightning waits for the first batch
        # (it prefetches one before on_train_start), so followers have version 0 at once.
        # A resumed run waits for on_train_start: only then are the step counters restored.
        self._started = False
        if trainer.ckpt_path is None:
            self._start(trainer, pl_module)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._started:
            self._start(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step % self.every == 0 and trainer.global_step != self._published_step:
            self._publish(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step != self._published_step:
            self._publish(trainer, pl_module)
        self.publisher.close()
        if self.requests is not None:
            self.requests.close()


class KafkaMetrics(L.Callback):
    """Sends the module's `last_metrics` and `last_staleness` to the metrics topic."""

    def __init__(self, producer: RecordProducer, topics: Topics, policy: str, every: int = 1) -> None:
        self.producer, self.topic, self.policy, self.every = producer, topics.metrics, policy, every
        self.instance = f"{socket.gethostname()}-{os.getpid()}"

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if not trainer.is_global_zero or trainer.global_step % self.every:
            return
        labels = {"policy": self.policy, "step": str(trainer.global_step)}
        ts = int(time.time() * 1000)
        for name, value in getattr(pl_module, "last_metrics", {}).items():
            self.producer.send(self.topic, Metric(f"trainer.{name}", float(value), "trainer", self.instance, labels, ts), key=self.policy)
        for bucket, count in getattr(pl_module, "last_staleness", {}).items():
            m = Metric("trainer.staleness", float(count), "trainer", self.instance, {**labels, "bucket": bucket}, ts)
            self.producer.send(self.topic, m, key=self.policy)
        self.producer.poll(0)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.producer.flush()


class TrainedLog(L.Callback):
    """JSONL, one line per step: step, the records it trains and the offsets after it."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.run = f"{socket.gethostname()}-{os.getpid()}-{int(time.time())}"
        self._file: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        meta = batch.get("meta") if isinstance(batch, dict) else None
        if meta is None:
            return
        if self._file is None:
            path = self.path if trainer.world_size == 1 else self.path.with_suffix(f".rank{trainer.global_rank}.jsonl")
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a")  # noqa: SIM115 - kept open for the run, closed at the end
        line = {"run": self.run, "step": trainer.global_step + 1, "samples": meta["samples"], "offsets": meta["offsets"]}
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
