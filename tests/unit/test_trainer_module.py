"""The Lightning module without a broker: batching, a smoke run, loss options and learning.

The learning test is the one that matters most: on a synthetic task with a fixed reward
(`trainers.synthetic`: reward = fraction of sampled tokens in a target set), on-policy GRPO
batches make the tiny model's mean reward rise, measured before and after on fixed prompts.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import yaml
from torch.utils.data import DataLoader, IterableDataset

from astraflow.config import load_config
from astraflow.records import TrainSample
from trainers.batching import BatchLimits, collate
from trainers.config import LossSettings, TrainRunConfig
from trainers.module import PolicyTrainer, staleness_histogram
from trainers.synthetic import make_samples, mean_reward

pytestmark = pytest.mark.unit
torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # settles TORCHINDUCTOR_CACHE_DIR before the leak guard
warnings.filterwarnings("ignore", module="lightning")

DOCS = Path(__file__).resolve().parents[2] / "docs" / "training.md"



def _sample(n: int, gen: int, adv: float = 1.0, version: int = 0) -> TrainSample:
    rng = np.random.default_rng(n * 7 + gen)
    mask = np.r_[np.zeros(n - gen, np.uint8), np.ones(gen, np.uint8)]
    return TrainSample(
        f"s{n}-{gen}", "t", "g", "p", "policy", rng.integers(3, 500, n, dtype=np.int32), mask,
        np.where(mask == 1, -rng.random(n) - 3.0, 0).astype(np.float32), np.where(mask == 1, version, -1).astype(np.int32),
        adv, 0.5, version,
    )


def _trainer(steps: int) -> L.Trainer:
    return L.Trainer(
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu",
    )


def test_collate_pads_right_and_never_trains_padding_or_position_zero() -> None:
    b = collate([_sample(6, 3), _sample(4, 4, adv=-1.0)], pad_id=0)
    assert b["input_ids"].shape == (2, 6) and b["input_ids"][1, 4:].tolist() == [0, 0]
    assert b["attention_mask"].tolist() == [[1] * 6, [1, 1, 1, 1, 0, 0]]
    assert b["loss_mask"].tolist() == [[False, False, False, True, True, True], [False, True, True, True, False, False]]
    assert b["advantages"].tolist() == [1.0, -1.0] and b["behaviour_logprobs"][1, 4:].tolist() == [0.0, 0.0]


def test_batch_limits_by_samples_and_token_budget() -> None:
    by_count = BatchLimits(batch_size=2)
    assert by_count.fits(1, 10, 500) and not by_count.fits(2, 10, 5)
    by_tokens = BatchLimits(batch_size=100, token_budget=64)
    assert by_tokens.fits(3, 16, 16) and not by_tokens.fits(4, 16, 8)  # 5 x 16 > 64
    assert not by_tokens.fits(1, 16, 40)  # 2 x 40 > 64
    assert by_tokens.fits(0, 0, 1000)  # an oversized sample still trains, alone


def test_staleness_histogram_buckets() -> None:
    hist = staleness_histogram(10, torch.tensor([10, 9, 8, 7, 5, 2, 12]))
    assert hist == {"0": 2, "1": 1, "2": 1, "3": 1, "4-7": 1, "8+": 1}


def test_smoke_a_few_steps_change_the_parameters(tiny: Path, one_thread: None) -> None:
    module = PolicyTrainer(tiny, LossSettings(mode="ppo"), lr=1e-3)
    before = {k: v.detach().clone() for k, v in module.model.named_parameters()}
    batches = [collate([_sample(8, 4, a), _sample(7, 3, -a)]) for a in (1.0, 0.5, 2.0)]
    _trainer(3).fit(module, DataLoader(batches, batch_size=None))
    changed = [k for k, v in module.model.named_parameters() if not torch.equal(v, before[k])]
    assert len(changed) == len(before)
    assert np.isfinite(module.last_metrics["loss"]) and module.last_metrics["tokens"] == 7.0  # 4 + 3 generated


@pytest.mark.parametrize(
    "loss",
    [
        LossSettings(mode="decoupled", aggregation="seq_mean_token_mean", kl_coef=0.1, entropy_coef=0.01),
        LossSettings(mode="ppo", aggregation="seq_mean_token_sum_norm", max_tokens=16, kl_coef=0.05, kl_estimator="k1"),
    ],
)
def test_loss_options_report_their_metrics(tiny: Path, loss: LossSettings) -> None:
    module = PolicyTrainer(tiny, loss, lr=1e-3)
    assert "_ref" not in dict(module.named_children()) and not any(k.startswith("_ref") for k in module.state_dict())
    value, metrics = module.compute_loss(collate([_sample(8, 4, 1.0), _sample(6, 2, -1.0)]))
    value.backward()
    for key in ("loss", "pg_loss", "clip_frac", "kl_ref", "entropy", "reward", "approx_kl"):
        assert np.isfinite(metrics[key]), key
    assert metrics["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any step
    assert ("is_truncated_frac" in metrics) == (loss.mode == "decoupled")
    assert metrics["token_staleness_mean"] == 0.0 and metrics["token_staleness_max"] == 0.0  # version-0 samples, trainer at 0
    for key in ("is_weight_mean", "is_weight_std", "log_mu_pi_mean", "log_mu_pi_std", "log_mu_pi_max"):
        assert np.isfinite(metrics[key]), key  # the spread of the IS weights and of log mu - log pi, every batch


class _OnPolicy(IterableDataset):
    """Fresh GRPO batches sampled from the module's current weights, one per step."""

    def __init__(self, module: PolicyTrainer) -> None:
        self.module = module

    def __iter__(self):
        for i in range(10_000):
            yield collate(make_samples(self.module.model, prompts=4, group_size=8, seed=i + 1))



def test_learning_mean_reward_rises_on_a_fixed_reward_task(tiny: Path, one_thread: None) -> None:
    torch.manual_seed(0)
    module = PolicyTrainer(tiny, LossSettings(mode="decoupled"), lr=1e-2)
    before = mean_reward(module.model)
    _trainer(15).fit(module, DataLoader(_OnPolicy(module), batch_size=None))
    after = mean_reward(module.model)
    print(f"\nlearning: mean reward {before:.3f} -> {after:.3f} after 15 GRPO steps")
    assert 0.15 < before < 0.35  # a random policy hits the target set ~1/4 of the time
    assert after > before + 0.2


def test_docs_example_config_parses(tmp_path: Path) -> None:
    block = re.search(r"```yaml\n(.*?)```", DOCS.read_text(), re.S)
    assert block, "docs/training.md should show an example config"
    path = tmp_path / "train.yaml"
    path.write_text(block.group(1))
    cfg = load_config(path, [], env={}, model=TrainRunConfig)
    assert cfg.trainer == TrainRunConfig.model_validate(yaml.safe_load(block.group(1))).trainer
    assert cfg.trainer.publish_every_steps >= 1


def test_dr_grpo_loss_of_a_sample_does_not_depend_on_its_batch_padding(tiny: Path) -> None:
    """seq_mean_token_sum_norm divides by a constant (max_seq_len by default), so the loss of a
    batch is the mean of its samples' losses, whatever the longest sample padded them to."""
    module = PolicyTrainer(tiny, LossSettings(aggregation="seq_mean_token_sum_norm"), max_seq_len=64)
    assert module.loss_config.max_tokens == 64
    short, long = _sample(5, 3, 1.0), _sample(12, 4, -1.0)
    with torch.no_grad():
        alone = [module.compute_loss(collate([s]))[0].item() for s in (short, long)]
        together = module.compute_loss(collate([short, long]))[0].item()
    assert together == pytest.approx(sum(alone) / 2, rel=1e-5)
