"""Several optimizer steps per batch: decoupled PPO's proximal policy is the batch's starting weights.

With one step per batch the proximal policy equals the current one, so the clip never acts
(approx_kl and clip_frac are exactly 0). With `minibatches` x `ppo_epochs` steps, every step is
given the logprobs of the weights before the batch's first step, and from the second step on
the ratio pi / pi_prox moves away from 1 and the clip acts. A non-finite step ends its batch.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from astraflow.records import TrainSample
from astraflow.rl import sequence_logprobs
from trainers.batching import collate
from trainers.config import LossSettings, TrainerSettings
from trainers.module import PolicyTrainer, mean_metrics, rows

pytestmark = pytest.mark.unit
warnings.filterwarnings("ignore", module="lightning")




def _sample(i: int, adv: float) -> TrainSample:
    rng = np.random.default_rng(i)
    n, gen = 9, 5
    mask = np.r_[np.zeros(n - gen, np.uint8), np.ones(gen, np.uint8)]
    return TrainSample(
        f"s{i}", "t", "g", "p", "policy", rng.integers(3, 500, n, dtype=np.int32), mask,
        np.where(mask == 1, -rng.random(n) - 3.0, 0).astype(np.float32), np.where(mask == 1, 0, -1).astype(np.int32),
        adv, 0.5, 0,
    )


def _batch(advantages: list[float]) -> dict[str, Any]:
    return collate([_sample(i, a) for i, a in enumerate(advantages)])


def _fit(module: PolicyTrainer, batches: list[dict[str, Any]]) -> L.Trainer:
    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu")
    trainer.fit(module, DataLoader(batches, batch_size=None))
    return trainer


def test_one_step_per_batch_leaves_the_clip_inert(tiny: Path, one_thread: None) -> None:
    module = PolicyTrainer(tiny, LossSettings(mode="decoupled"), lr=5e-2)
    trainer = _fit(module, [_batch([1.0, -1.0, 2.0, -2.0])])
    assert trainer.global_step == 1 and module.last_metrics["optimizer_steps"] == 1.0
    assert module.last_metrics["approx_kl"] == 0.0 and module.last_metrics["clip_frac"] == 0.0


def test_every_step_of_a_batch_gets_the_proximal_logprobs_of_its_starting_weights(tiny: Path, one_thread: None) -> None:
    module = PolicyTrainer(tiny, LossSettings(mode="decoupled"), lr=5e-2, minibatches=2, ppo_epochs=2)
    start = copy.deepcopy(module.model)
    batch = _batch([1.0, -1.0, 2.0, -2.0])
    with torch.no_grad():
        expected = sequence_logprobs(start(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                                     batch["input_ids"], batch["temperatures"])
    given: list[torch.Tensor] = []
    compute = module.compute_loss

    def spy(b: dict[str, Any], proximal_logprobs: torch.Tensor | None = None) -> Any:
        assert proximal_logprobs is not None
        given.append(proximal_logprobs.clone())
        return compute(b, proximal_logprobs)

    module.compute_loss = spy  # type: ignore[method-assign]
    trainer = _fit(module, [batch])
    assert trainer.global_step == 4 and module.last_metrics["optimizer_steps"] == 4.0
    halves = torch.arange(4).chunk(2)
    assert len(given) == 4
    for got, half in zip(given, [*halves, *halves], strict=True):  # two passes over two minibatches
        trained = batch["loss_mask"][half]  # the only positions the trainer scores (0 elsewhere)
        torch.testing.assert_close(got[trained], expected[half][trained], rtol=0, atol=1e-6)
        assert not got[~trained].any()
    # from the second step on the current policy has moved away from the proximal one: the clip acts
    assert module.last_metrics["approx_kl"] > 0.0 and module.last_metrics["clip_frac"] > 0.0
    assert module.last_metrics["tokens"] == float(batch["loss_mask"].sum())  # the batch's, not one minibatch's


def test_a_non_finite_step_ends_its_batch_and_the_earlier_steps_stay(tiny: Path, one_thread: None) -> None:
    module = PolicyTrainer(tiny, LossSettings(mode="ppo"), lr=1e-3, minibatches=2, ppo_epochs=2)
    poisoned = _batch([1.0, -1.0, 2.0, -2.0])
    poisoned["advantages"][3] = float("nan")  # in the second minibatch
    before = {k: v.detach().clone() for k, v in module.model.named_parameters()}
    trainer = _fit(module, [poisoned])
    assert module.skipped_reason is not None and "optimizer step 2 of 4" in module.skipped_reason
    assert module.steps_skipped == 1 and module.last_metrics["step_skipped"] == 1.0
    assert module.last_metrics["optimizer_steps"] == 2.0
    assert any(not torch.equal(v, before[k]) for k, v in module.model.named_parameters())  # step 1 applied
    assert all(torch.isfinite(p).all() for p in module.model.parameters())
    assert {int(s["step"]) for s in trainer.optimizers[0].state.values()} == {1}  # AdamW stepped once


def test_rows_and_mean_metrics() -> None:
    batch = {**_batch([1.0, 2.0, 3.0]), "meta": {"seq": 1}}
    part = rows(batch, torch.tensor([0, 2]))
    assert "meta" not in part and part["advantages"].tolist() == [1.0, 3.0] and part["input_ids"].shape[0] == 2
    assert mean_metrics([{"loss": 1.0, "ratio_max": 2.0}, {"loss": 3.0, "ratio_max": 1.5}]) == {"loss": 2.0, "ratio_max": 2.0}


@pytest.mark.parametrize("bad", [{"minibatches": 0}, {"ppo_epochs": 0}, {"minibatches": 9, "batch_size": 8}, {"grad_clip": 0}])
def test_settings_refuse_impossible_step_counts(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        TrainerSettings(**bad)
