"""The trainer writes a version's checkpoint and publishes the version in the background while its
next step trains (`trainers.publishing.DurablePublication`), without a broker: a stand-in
publisher with the `WeightPublisher` calls the callback uses records what it was handed and when,
and the checkpoint IO records its writes.

- the next step trains (its optimizer step included) while the checkpoint is being written;
- the checkpoint holds the state of its own step, not the weights the next step changed, and the
  version sent is exactly those weights: one set of weights per number;
- the next checkpoint is written only once the version before it is committed, and versions
  commit in order;
- a failed publication is raised in the trainer's thread before anything later is checkpointed.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from astraflow.errors import KafkaLayerError
from astraflow.models.tiny import init_tiny
from astraflow.records import TrainSample
from astraflow.weights.publish import PublishSettings
from trainers.batching import collate
from trainers.callbacks import AtomicCheckpointIO
from trainers.config import LossSettings
from trainers.module import PolicyTrainer
from trainers.publishing import DurablePublication, TrainedSampleLog

warnings.filterwarnings("ignore", module="lightning")


def _batch(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(4):
        n, gen = 10, 4
        mask = np.r_[np.zeros(n - gen, np.uint8), np.ones(gen, np.uint8)]
        out.append(TrainSample(
            f"s-{seed}-{i}", "t", "g", "p", "policy", rng.integers(3, 500, n, dtype=np.int32), mask,
            np.where(mask == 1, -2.0, 0.0).astype(np.float32), np.where(mask == 1, 0, -1).astype(np.int32),
            float(rng.normal()), 1.0, 0,
        ))
    return collate(out)


class StandInPublisher:
    """Records each publication, and in which thread it was sent; fails the one of `fail_at`."""

    policy = "policy"

    def __init__(self, events: list[tuple[str, int]], fail_at: int | None = None) -> None:
        self.settings = PublishSettings("float32")
        self.encoder = SimpleNamespace(next_version=0)
        self.committed = None
        self.events, self.fail_at = events, fail_at
        self.sent: dict[int, dict[str, torch.Tensor]] = {}
        self.threads: dict[int, str] = {}

    def start(self) -> None:
        return None

    def publish(self, state: dict[str, Any], *, version: int, **_: Any) -> SimpleNamespace:
        self.events.append(("send", version))
        self.threads[version] = threading.current_thread().name
        if version == self.fail_at:
            raise KafkaLayerError(f"version {version} could not be committed")
        self.sent[version] = {k: v.clone() for k, v in state.items()}
        self.encoder.next_version = version + 1
        self.events.append(("committed", version))
        return SimpleNamespace(version=version)

    def close(self) -> None:
        return None


class RecordedIO(AtomicCheckpointIO):
    """Records each checkpoint written; `held[step]`: an event that write waits for first (10 s at most)."""

    def __init__(self, events: list[tuple[str, int]]) -> None:
        super().__init__()
        self.events = events
        self.held: dict[int, threading.Event] = {}
        self.released: dict[int, bool] = {}

    def _write(self, checkpoint: dict[str, Any], path: Path) -> None:  # type: ignore[override]
        step = int(path.name.removeprefix("step-").removesuffix(".ckpt"))
        if step in self.held:
            self.released[step] = self.held[step].wait(10)
        AtomicCheckpointIO._write(checkpoint, path)
        self.events.append(("checkpoint", step))


class Steps(L.Callback):
    """Listed before the publication callback: marks each step trained before it publishes."""

    def __init__(self) -> None:
        self.trained: dict[int, threading.Event] = {k: threading.Event() for k in range(1, 5)}
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.weights[trainer.global_step] = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}
        self.trained[trainer.global_step].set()


def _fit(tmp_path: Path, publisher: StandInPublisher, io: RecordedIO, steps: Steps) -> DurablePublication:
    tiny = init_tiny(tmp_path / "tiny", vocab_size=512, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    module = PolicyTrainer(tiny, LossSettings(mode="ppo"), lr=1e-2)
    durable = DurablePublication(publisher, tmp_path / "ckpt", publish_every=1, checkpoint_every=10, keep=10,  # type: ignore[arg-type]
                                 sample_log=TrainedSampleLog(tmp_path / "trained.jsonl"))
    trainer = L.Trainer(
        max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        accelerator="cpu", callbacks=[steps, durable], plugins=[io],
    )
    trainer.fit(module, DataLoader([_batch(1), _batch(2), _batch(3)], batch_size=None))
    return durable


def test_a_version_goes_out_while_the_next_step_trains_and_is_the_checkpointed_weights(tmp_path: Path, one_thread: None) -> None:
    events: list[tuple[str, int]] = []
    publisher, io, steps = StandInPublisher(events), RecordedIO(events), Steps()
    io.held[1] = steps.trained[2]  # step 1's checkpoint is written only once step 2 has trained
    durable = _fit(tmp_path, publisher, io, steps)

    assert io.released[1], "step 2 did not train while the checkpoint of step 1 was being written"
    assert publisher.threads[1] != threading.current_thread().name
    assert sorted(publisher.sent) == [0, 1, 2, 3] and durable.version == 3 and not durable.pending
    assert [v for e, v in events if e == "committed"] == [0, 1, 2, 3]
    for k in (1, 2, 3):  # the checkpoint of step k is durable before version k is sent
        assert events.index(("checkpoint", k)) < events.index(("send", k))
    for k in (2, 3):  # and written only once version k - 1 is committed
        assert events.index(("committed", k - 1)) < events.index(("checkpoint", k))
    for k in (1, 2, 3):  # version k is exactly the weights of step k, as its checkpoint holds them
        ckpt = torch.load(tmp_path / "ckpt" / f"step-{k:09d}.ckpt", weights_only=False)
        promise = ckpt["callbacks"]["DurablePublication"]
        assert promise["version"] == k and promise["pending"] and ckpt["global_step"] == k
        weights = {n.removeprefix("model."): t for n, t in ckpt["state_dict"].items()}
        sent = publisher.sent[k]
        assert sent and all(torch.equal(t, weights[n]) and torch.equal(t, steps.weights[k][n]) for n, t in sent.items())
    assert any(not torch.equal(t, steps.weights[2][n]) for n, t in publisher.sent[1].items())  # step 2 changed them


def test_a_failed_background_publication_stops_the_trainer_before_the_next_checkpoint(tmp_path: Path, one_thread: None) -> None:
    events: list[tuple[str, int]] = []
    publisher = StandInPublisher(events, fail_at=2)
    with pytest.raises(KafkaLayerError, match="version 2"):
        _fit(tmp_path, publisher, RecordedIO(events), Steps())
    assert ("checkpoint", 2) in events and ("checkpoint", 3) not in events
    assert not (tmp_path / "ckpt" / f"step-{3:09d}.ckpt").exists()


def test_a_resumed_run_is_reconciled_after_its_restore_never_before(tmp_path: Path) -> None:
    """FSDP's restore comes after `on_fit_start`, when `trainer.ckpt_path` is still None: a run that
    resumes must not be reconciled there (with its initial weights), and a restore after the
    reconciliation is refused rather than silently leaving the callback's decisions stale."""
    from astraflow.errors import ModelError

    saved = {"version": 2, "pending": True, "unpublished": [["s-1", 2, 0, 7]], "batches": 2}
    durable = DurablePublication(None, tmp_path / "ckpt", sample_log=TrainedSampleLog(tmp_path / "log"),  # type: ignore[arg-type]
                                 resuming=True)
    durable.on_fit_start(SimpleNamespace(ckpt_path=None), None)  # type: ignore[arg-type]  # would need a publisher
    durable.load_state_dict(saved)
    assert (durable.version, durable.pending, durable.unpublished) == (2, True, [["s-1", 2, 0, 7]])
    durable._started = True  # what `reconcile` leaves
    with pytest.raises(ModelError, match="restored after the trainer reconciled"):
        durable.load_state_dict(saved)
