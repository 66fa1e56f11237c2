"""The Lightning data module of the trainer: the Kafka stream, and what a checkpoint must hold of it.

`KafkaTrainData` owns the `trainers.data.TrainStream`, the offsets after the last trained batch
and the `SampleWindow` of trained sample ids; both go into every Lightning checkpoint
(`state_dict`) and come back before the dataloader exists on restart. After each optimizer step
`finish_step` releases the batch's records, or dead-letters them when the step was skipped.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from torch.utils.data import DataLoader

from astraflow.errors import KafkaLayerError
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.received import DeadLetterWriter, Received
from astraflow.rl.samples import NonFiniteStepError, SampleWindow
from trainers.data import TRAINER_PRODUCER, TrainStream, flush_patiently


class KafkaTrainData(L.LightningDataModule):
    """Owns the TrainStream, and the trained offsets and sample ids that go into each checkpoint."""

    def __init__(self, stream_kwargs: dict[str, Any], dlq_topic: str | None = None, dedup_window: int = 100_000) -> None:
        super().__init__()
        self.stream_kwargs = stream_kwargs  # TrainStream keyword arguments (kafka, topic, policy, ...)
        self.dlq_topic = dlq_topic
        self.trained: dict[int, int] = {}  # next offset per partition after the last trained batch
        self.trained_samples = 0  # samples trained so far, across restarts
        self.skipped_samples = 0  # samples of skipped (non-finite) steps, across restarts
        self.window = SampleWindow(dedup_window)  # ids of the samples trained last
        self.resumed_from: dict[int, int] | None = None  # offsets restored from a checkpoint
        self.newest_version: int | None = None  # newest published version (set by the publisher)
        self.stream: TrainStream | None = None
        self._producer: RecordProducer | None = None

    def train_dataloader(self) -> DataLoader:
        if self.stream is None:
            dlq = None
            if self.dlq_topic is not None:
                self._producer = RecordProducer(self.stream_kwargs["kafka"], **TRAINER_PRODUCER)
                dlq = DeadLetterWriter(self._producer, self.dlq_topic, component="trainer")
            resume = dict(self.resumed_from) if self.resumed_from is not None else None
            # Lightning's SIGTERM handler only flags the trainer and acts between batches; the
            # stream polls the flag so that a trainer waiting for samples stops too.
            self.stream = TrainStream(**self.stream_kwargs, resume_offsets=resume, dlq=dlq, window=self.window,
                                      should_stop=lambda: bool(getattr(self.trainer, "received_sigterm", False)))
            self.stream.newest_version = self.newest_version
            # The module warms up on the first batch's samples while the rest arrive (trainers.data).
            self.stream.on_partial = getattr(getattr(self.trainer, "lightning_module", None), "warm_up", None)
        # batch_size=None: the stream yields whole batches; one process reads Kafka (no workers).
        return DataLoader(self.stream, batch_size=None, num_workers=0)

    def mark_trained(self, meta: dict[str, Any]) -> None:
        """Called by the module inside training_step: these offsets and ids are now consumed."""
        self.trained = {int(p): int(o) for p, o in meta["offsets"].items()}
        self.trained_samples += int(meta["batch_samples"])
        self.window.extend(str(i) for _, _, i in meta["samples"])
        if self.stream is not None:
            self.stream.commit(self.trained)

    def finish_step(self, meta: dict[str, Any], skipped: str | None) -> None:
        """After the optimizer step of the batch `meta`: release its records; when the step was
        skipped (`skipped` says why), its samples go to the DLQ instead of counting as trained."""
        items = self.stream.settle(int(meta["seq"])) if self.stream is not None else []
        if skipped is None:
            return
        self.trained_samples -= int(meta["batch_samples"])
        self.skipped_samples += int(meta["batch_samples"])
        if self.stream is not None and self.stream.dlq is not None:
            for it in items:
                if it.msg is not None:
                    self.stream.dlq.send(Received.of(it.msg), NonFiniteStepError(skipped))
            flush_patiently(self.stream.dlq.producer, "dead letters of a skipped step")

    def state_dict(self) -> dict[str, Any]:
        topic = self.stream_kwargs["topic"]
        return {
            "topic": topic,
            "offsets": dict(self.trained),
            "trained_samples": self.trained_samples,
            "skipped_samples": self.skipped_samples,
            "window": self.window.dumps(),
        }

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
        self.skipped_samples = int(state.get("skipped_samples", 0))
        self.window = SampleWindow.loads(self.window.capacity, state.get("window", ""))
        if self.stream is not None:
            self.stream.window = self.window

    def teardown(self, stage: str) -> None:
        if self.stream is not None:
            self.stream.commit(self.trained)
            self.stream.close()
            self.stream = None
        if self._producer is not None:
            flush_patiently(self._producer, "dead letters")
