"""Policy losses on hand-made tensors: PPO-clip, GRPO, aggregation, decoupled PPO / TIS, KL, metrics."""

from __future__ import annotations

import math

import pytest
import torch

from astraflow.errors import RLError
from astraflow.rl import (
    PolicyLossConfig,
    aggregate,
    broadcast_advantages,
    grpo_loss,
    kl_penalty,
    policy_loss,
    truncated_is_weights,
)

pytestmark = pytest.mark.unit


def _lp(values: list[list[float]], grad: bool = True) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=grad)


def test_ratio_one_gives_minus_mean_advantage() -> None:
    logprobs = _lp([[-1.0, -2.0, -3.0], [-0.5, -0.7, -0.9]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = grpo_loss(logprobs, logprobs.detach().clone(), torch.tensor([1.0, -0.5]), mask)
    assert out.loss.item() == pytest.approx(-(1.0 + 1.0 - 0.5) / 3)
    assert out.metrics["clip_frac"] == 0.0
    assert out.metrics["approx_kl"] == pytest.approx(0.0)
    assert out.metrics["tokens"] == 3.0


@pytest.mark.parametrize(
    ("ratio", "adv", "expected", "clipped"),
    [
        (1.5, 1.0, -1.2, True),  # A > 0, ratio above 1 + eps: clipped, no gradient
        (0.5, 1.0, -0.5, False),  # A > 0, ratio below 1 - eps: unclipped (pessimistic min)
        (0.5, -1.0, 0.8, True),  # A < 0, ratio below 1 - eps: clipped
        (1.5, -1.0, 1.5, False),  # A < 0, ratio above 1 + eps: unclipped
    ],
)
def test_ppo_clip_cases(ratio: float, adv: float, expected: float, clipped: bool) -> None:
    logprobs = _lp([[math.log(ratio) - 1.0]])
    out = policy_loss(logprobs, torch.tensor([[-1.0]]), torch.tensor([adv]), torch.ones(1, 1))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    assert out.metrics["clip_frac"] == (1.0 if clipped else 0.0)
    assert (logprobs.grad.abs().item() == 0.0) is clipped


def test_asymmetric_clip_uses_eps_high_above() -> None:
    logprobs, behaviour = _lp([[math.log(1.25)]]), torch.zeros(1, 1)
    symmetric = policy_loss(logprobs, behaviour, torch.tensor([1.0]), torch.ones(1, 1))
    higher = policy_loss(
        logprobs, behaviour, torch.tensor([1.0]), torch.ones(1, 1), PolicyLossConfig(eps_high=0.28)
    )
    assert symmetric.loss.item() == pytest.approx(-1.2)
    assert higher.loss.item() == pytest.approx(-1.25)
    low = policy_loss(
        _lp([[math.log(0.75)]]),
        behaviour,
        torch.tensor([-1.0]),
        torch.ones(1, 1),
        PolicyLossConfig(eps_low=0.2, eps_high=0.28),
    )
    assert low.loss.item() == pytest.approx(0.8)
    assert low.metrics["clip_frac_low"] == 1.0 and low.metrics["clip_frac_high"] == 0.0


def test_masked_positions_are_ignored_even_with_garbage() -> None:
    mask = torch.tensor([[1, 1, 0, 0]])
    clean = policy_loss(
        _lp([[-1.0, -2.0, 0.0, 0.0]]),
        torch.tensor([[-1.1, -1.9, 0.0, 0.0]]),
        torch.tensor([[1.0, 2.0, 0.0, 0.0]]),
        mask,
    )
    dirty_lp = _lp([[-1.0, -2.0, float("nan"), 50.0]])
    dirty = policy_loss(
        dirty_lp,
        torch.tensor([[-1.1, -1.9, -1e9, float("inf")]]),
        torch.tensor([[1.0, 2.0, float("nan"), 1e9]]),
        mask,
    )
    dirty.loss.backward()
    assert dirty.loss.item() == pytest.approx(clean.loss.item())
    assert torch.isfinite(dirty_lp.grad).all()
    assert dirty_lp.grad[0, 2:].abs().sum().item() == 0.0


def test_aggregation_modes_differ_as_expected() -> None:
    losses = torch.tensor([[1.0, 0.0, 0.0, 0.0], [3.0, 3.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    assert aggregate(losses, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(losses, mask, "seq_mean_token_mean").item() == pytest.approx((1 + 3) / 2)
    with pytest.raises(RLError, match="max_tokens"):
        aggregate(losses, mask, "seq_mean_token_sum_norm")
    assert aggregate(losses, mask, "seq_mean_token_sum_norm", max_tokens=8).item() == pytest.approx(
        (1 / 8 + 9 / 8) / 2
    )
    empty_row = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]])
    assert aggregate(losses, empty_row, "seq_mean_token_mean").item() == pytest.approx(1.0)


def test_aggregation_in_policy_loss_changes_weighting() -> None:
    logprobs = _lp([[-1.0, 0.0, 0.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -1.0])
    loss = {
        mode: policy_loss(
            logprobs, logprobs.detach(), adv, mask, PolicyLossConfig(aggregation=mode, max_tokens=3)
        ).loss.item()
        for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
    }
    assert loss["token_mean"] == pytest.approx(-(1 - 3) / 4)
    assert loss["seq_mean_token_mean"] == pytest.approx(0.0)
    assert loss["seq_mean_token_sum_norm"] == pytest.approx(-(1 / 3 - 3 / 3) / 2)


def test_tis_weights_are_truncated_at_cap() -> None:
    weights = truncated_is_weights(torch.log(torch.tensor([3.0, 0.5, 1.5])), torch.zeros(3), 2.0)
    assert weights.tolist() == pytest.approx([2.0, 0.5, 1.5])
    assert truncated_is_weights(torch.tensor([math.log(3.0)]), torch.zeros(1), None).item() == pytest.approx(
        3.0
    )


def test_decoupled_loss_weights_by_truncated_behaviour_ratio() -> None:
    behaviour = torch.log(torch.tensor([[0.1, 0.4]]))
    proximal = torch.log(torch.tensor([[0.3, 0.2]]))  # pi_prox / pi_behaviour = 3 (capped to 2) and 0.5
    logprobs = proximal.clone().requires_grad_(True)  # current == proximal: ratio 1
    cfg = PolicyLossConfig(mode="decoupled", tis_cap=2.0)
    out = policy_loss(
        logprobs, behaviour, torch.tensor([1.0]), torch.ones(1, 2), cfg, proximal_logprobs=proximal
    )
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-(2.0 + 0.5) / 2)
    assert logprobs.grad[0].tolist() == pytest.approx([-1.0, -0.25])
    assert out.metrics["is_truncated_frac"] == pytest.approx(0.5)
    uncapped = policy_loss(
        proximal,
        behaviour,
        torch.tensor([1.0]),
        torch.ones(1, 2),
        PolicyLossConfig(mode="decoupled", tis_cap=None),
        proximal_logprobs=proximal,
    )
    assert uncapped.loss.item() == pytest.approx(-(3.0 + 0.5) / 2)


def test_decoupled_without_proximal_uses_current_policy() -> None:
    logprobs = _lp([[math.log(0.6)]])
    out = policy_loss(
        logprobs,
        torch.log(torch.tensor([[0.2]])),
        torch.tensor([2.0]),
        torch.ones(1, 1),
        PolicyLossConfig(mode="decoupled", tis_cap=2.0),
    )
    assert out.loss.item() == pytest.approx(-2.0 * 2.0)  # weight min(3, 2) times advantage, ratio 1
    assert out.metrics["ratio_mean"] == pytest.approx(1.0)


def test_gradient_flows_only_through_current_logprobs() -> None:
    logprobs = _lp([[-1.0, -2.0]])
    behaviour, proximal, ref = _lp([[-1.2, -1.8]]), _lp([[-1.1, -1.9]]), _lp([[-1.5, -1.5]])
    adv = torch.tensor([0.7], requires_grad=True)
    cfg = PolicyLossConfig(mode="decoupled", kl_coef=0.1)
    out = policy_loss(
        logprobs, behaviour, adv, torch.ones(1, 2), cfg, proximal_logprobs=proximal, ref_logprobs=ref
    )
    out.loss.backward()
    assert logprobs.grad is not None and logprobs.grad.abs().sum() > 0
    assert behaviour.grad is None and proximal.grad is None and ref.grad is None and adv.grad is None


def test_kl_estimators_and_kl_term() -> None:
    logprobs, ref = torch.log(torch.tensor([[0.5]])), torch.log(torch.tensor([[0.25]]))
    assert kl_penalty(logprobs, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_penalty(logprobs, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_penalty(logprobs, ref, "k3").item() == pytest.approx(0.5 - 1 + math.log(2))
    out = policy_loss(
        logprobs,
        logprobs,
        torch.tensor([0.0]),
        torch.ones(1, 1),
        PolicyLossConfig(kl_coef=0.1),
        ref_logprobs=ref,
    )
    assert out.loss.item() == pytest.approx(0.1 * (0.5 - 1 + math.log(2)))
    assert out.metrics["kl_ref"] == pytest.approx(0.5 - 1 + math.log(2))


def test_entropy_bonus_lowers_loss() -> None:
    logprobs = _lp([[-1.0, -1.0]])
    entropy = torch.tensor([[2.0, 4.0]])
    out = policy_loss(
        logprobs,
        logprobs.detach(),
        torch.tensor([0.0]),
        torch.tensor([[1, 0]]),
        PolicyLossConfig(entropy_coef=0.01),
        entropy=entropy,
    )
    assert out.metrics["entropy"] == pytest.approx(2.0)
    assert out.loss.item() == pytest.approx(-0.02)


def test_token_advantages_and_broadcast() -> None:
    mask = torch.ones(2, 3)
    assert broadcast_advantages(torch.tensor([1.0, 2.0]), mask).tolist() == [[1.0] * 3, [2.0] * 3]
    token_adv = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 3.0]])
    assert broadcast_advantages(token_adv, mask) is token_adv
    with pytest.raises(RLError):
        broadcast_advantages(torch.ones(3), mask)
    with pytest.raises(RLError):
        grpo_loss(torch.zeros(2, 3), torch.zeros(2, 3), token_adv, mask)


def test_approx_kl_metric_matches_formula() -> None:
    out = policy_loss(
        torch.tensor([[math.log(2.0)]]), torch.zeros(1, 1), torch.tensor([0.0]), torch.ones(1, 1)
    )
    assert out.metrics["approx_kl"] == pytest.approx((2.0 - 1.0) - math.log(2.0))
    assert out.metrics["ratio_max"] == pytest.approx(2.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"eps_low": 1.0},
        {"eps_high": -0.1},
        {"tis_cap": 0.0},
        {"max_tokens": 0},
        {"aggregation": "sum"},
        {"mode": "vtrace"},
        {"aggregation": "seq_mean_token_sum_norm"},  # Dr. GRPO without its constant
        {"dual_clip": 1.0},
        {"mode": "mis", "tis_cap": 1.0},
        {"mode": "mis", "tis_cap": None},
        {"m2_threshold": -0.1},
        {"max_staleness": -1},
        {"staleness_weight": "exp"},
    ],
)
def test_invalid_config_raises(kwargs: dict) -> None:
    with pytest.raises(RLError):
        PolicyLossConfig(**kwargs)


def test_missing_inputs_raise_helpful_errors() -> None:
    lp = torch.zeros(1, 2)
    with pytest.raises(RLError, match="ref_logprobs"):
        policy_loss(lp, lp, torch.ones(1), torch.ones(1, 2), PolicyLossConfig(kl_coef=0.1))
    with pytest.raises(RLError, match="entropy"):
        policy_loss(lp, lp, torch.ones(1), torch.ones(1, 2), PolicyLossConfig(entropy_coef=0.1))
    with pytest.raises(RLError, match=r"\[B, T\]"):
        policy_loss(lp, torch.zeros(1, 3), torch.ones(1), torch.ones(1, 2))
