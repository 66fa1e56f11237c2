"""The trainer's warm-up while its first batch fills: the stream hands the first incomplete
batch to `on_partial` once, and the module's `warm_up` on it changes nothing the step trains."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from astraflow.config import KafkaSettings
from astraflow.records import TrainSample
from trainers.batching import BatchLimits, collate
from trainers.config import LossSettings
from trainers.data import TrainStream, _Item
from trainers.module import PolicyTrainer

pytestmark = pytest.mark.unit
warnings.filterwarnings("ignore", module="lightning")


def _sample(i: int, n: int = 8, gen: int = 4) -> TrainSample:
    rng = np.random.default_rng(i)
    mask = np.r_[np.zeros(n - gen, np.uint8), np.ones(gen, np.uint8)]
    return TrainSample(f"s{i}", "t", f"g{i // 2}", "p", "policy", rng.integers(3, 500, n, dtype=np.int32), mask,
                       np.where(mask == 1, -rng.random(n) - 3.0, 0).astype(np.float32),
                       np.where(mask == 1, 0, -1).astype(np.int32), float(rng.normal()), 0.5, 0)


class Scripted(TrainStream):
    """A stream whose records come in scripted waves (no broker): each poll delivers the next."""

    def __init__(self, waves: list[list[TrainSample]], batch_size: int) -> None:
        super().__init__(KafkaSettings(), "policy.train", "policy", limits=BatchLimits(batch_size), max_wait_s=600)
        self.waves, self.offset = waves, 0
        self.partial: list[dict[str, Any]] = []
        self.on_partial = self.partial.append

    def _fill(self, timeout_s: float) -> int:
        wave = self.waves.pop(0) if self.waves else []
        for s in wave:
            self._buffers[0].append(_Item(0, self.offset, s, len(s.token_ids), self.offset))
            self._buffered += 1
            self.offset += 1
        return len(wave)


def test_the_first_incomplete_batch_goes_to_on_partial_once() -> None:
    s = [_sample(i) for i in range(8)]
    stream = Scripted([[s[0], s[1]], [], [s[2], s[3]], [s[4]], [], [s[5], s[6], s[7]]], batch_size=4)
    first = stream.next_batch()
    assert [i.sample.sample_id for i in first] == ["s0", "s1", "s2", "s3"]
    assert len(stream.partial) == 1 and stream.partial[0]["input_ids"].shape[0] == 2  # s0 and s1, collated
    second = stream.next_batch()  # it waited again, after s4: no second call
    assert [i.sample.sample_id for i in second] == ["s4", "s5", "s6", "s7"] and len(stream.partial) == 1


def test_a_batch_complete_at_once_is_not_handed_over() -> None:
    stream = Scripted([[_sample(i) for i in range(4)]], batch_size=4)
    assert len(stream.next_batch()) == 4 and stream.partial == []



def _trained(tiny: Path, warm: bool) -> tuple[dict[str, torch.Tensor], PolicyTrainer]:
    torch.manual_seed(0)
    module = PolicyTrainer(tiny, LossSettings(mode="decoupled"), lr=1e-3)
    batches = [collate([_sample(i) for i in range(k, k + 4)]) for k in (0, 4)]
    if warm:
        module.warm_up(collate([_sample(i) for i in range(2)]))
        assert all(p.grad is None for p in module.model.parameters())
    L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              accelerator="cpu").fit(module, DataLoader(batches, batch_size=None))
    return {k: v.detach().clone() for k, v in module.model.named_parameters()}, module


def test_warm_up_changes_nothing_the_steps_train(tiny: Path, one_thread: None) -> None:
    cold, _ = _trained(tiny, warm=False)
    warm, module = _trained(tiny, warm=True)
    assert cold.keys() == warm.keys() and all(torch.equal(cold[k], warm[k]) for k in cold)
    assert module.warm_up_s is None  # reported with the first step, then cleared
