"""Off-policy corrections on hand-computed cases: dual clip, Dr. GRPO padding, TIS, MIS, M2PO,
staleness weights and drops, the spread metrics, and the degenerate inputs (ratio 0, ratio
infinite, every token masked)."""

from __future__ import annotations

import math

import pytest
import torch

from astraflow.errors import RLError
from astraflow.rl import PolicyLossConfig, policy_loss
from astraflow.rl.corrections import masked_is_weights, second_moment_mask, staleness_weights

pytestmark = pytest.mark.unit


def _one(ratio: float, adv: float, config: PolicyLossConfig, **kw: torch.Tensor) -> tuple[float, float, dict]:
    """Loss, d loss / d logprob and metrics of one token whose ratio pi / mu is `ratio`."""
    lp = torch.tensor([[math.log(ratio) - 1.0]], requires_grad=True)
    out = policy_loss(lp, torch.tensor([[-1.0]]), torch.tensor([adv]), torch.ones(1, 1), config, **kw)
    out.loss.backward()
    return out.loss.item(), lp.grad.item(), out.metrics


def test_dual_clip_caps_negative_advantage_loss_in_ppo_and_decoupled() -> None:
    # ratio 5, A = -1: PPO-clip's loss is 5 (unclipped: pessimistic); dual clip c = 3 caps it at 3.
    loss, grad, m = _one(5.0, -1.0, PolicyLossConfig(mode="ppo", dual_clip=None))
    assert loss == pytest.approx(5.0) and grad == pytest.approx(5.0)
    loss, grad, m = _one(5.0, -1.0, PolicyLossConfig(mode="ppo"))
    assert loss == pytest.approx(3.0) and grad == 0.0 and m["dual_clip_frac"] == 1.0 and m["clip_frac"] == 1.0
    # Positive advantages are untouched by the dual clip.
    assert _one(5.0, 1.0, PolicyLossConfig(mode="ppo"))[0] == pytest.approx(-1.2)
    # Decoupled: the proximal policy is mu here, the IS weight is 1; same cap.
    lp = torch.tensor([[math.log(5.0) - 1.0]], requires_grad=True)
    out = policy_loss(lp, torch.tensor([[-1.0]]), torch.tensor([-1.0]), torch.ones(1, 1),
                      PolicyLossConfig(mode="decoupled"), proximal_logprobs=torch.tensor([[-1.0]]))
    assert out.loss.item() == pytest.approx(3.0)


def test_dr_grpo_loss_does_not_depend_on_padding() -> None:
    lp = torch.tensor([[-1.0, -0.5, -0.2], [-0.3, -0.4, -0.6]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    adv = torch.tensor([1.0, -0.5])
    padded_lp = torch.nn.functional.pad(lp, (0, 5))
    padded_mask = torch.nn.functional.pad(mask, (0, 5))
    cfg = PolicyLossConfig(aggregation="seq_mean_token_sum_norm", max_tokens=16)
    a = policy_loss(lp, lp, adv, mask, cfg).loss.item()
    b = policy_loss(padded_lp, padded_lp, adv, padded_mask, cfg).loss.item()
    assert a == pytest.approx(b) and a == pytest.approx(-(2 * 1.0 - 0.5) / 16 / 2)
    with pytest.raises(RLError, match="max_tokens"):
        PolicyLossConfig(aggregation="seq_mean_token_sum_norm")


@pytest.mark.parametrize(("ratio", "adv", "loss", "grad"), [
    (0.5, 1.0, -0.5, -0.5),  # weight 0.5: -w A, gradient -w A
    (3.0, 1.0, -2.0, -2.0),  # truncated at cap 2
    (3.0, -1.0, 2.0, 2.0),
])
def test_tis_is_truncated_policy_gradient(ratio: float, adv: float, loss: float, grad: float) -> None:
    got_loss, got_grad, m = _one(ratio, adv, PolicyLossConfig(mode="tis", tis_cap=2.0))
    assert got_loss == pytest.approx(loss, rel=1e-5) and got_grad == pytest.approx(grad, rel=1e-5)
    assert m["is_truncated_frac"] == (1.0 if ratio > 2 else 0.0)


def test_mis_masks_outside_the_band() -> None:
    w, kept = masked_is_weights(torch.log(torch.tensor([0.4, 0.6, 1.5, 2.5])), torch.zeros(4), 2.0)
    assert kept.tolist() == [False, True, True, False]
    assert w.tolist() == pytest.approx([0.0, 0.6, 1.5, 0.0])
    loss, grad, m = _one(3.0, 1.0, PolicyLossConfig(mode="mis", tis_cap=2.0))
    assert loss == 0.0 and grad == 0.0 and m["is_masked_frac"] == 1.0
    loss, grad, _ = _one(1.5, 1.0, PolicyLossConfig(mode="mis", tis_cap=2.0))
    assert loss == pytest.approx(-1.5) and grad == pytest.approx(-1.5)


def test_second_moment_mask_drops_fewest_largest() -> None:
    log_r = torch.tensor([[0.1, -0.1, 1.0, 0.0], [0.5, 0.0, 0.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])  # 9.0 is padding: never counted
    # Kept squares: .01 .01 1 0 .25 0 0 (mean .181); dropping 1.0 leaves mean .045 > .04;
    # dropping .25 too leaves .02/5 = .004.
    kept = second_moment_mask(log_r, mask, 0.04)
    assert kept.tolist() == [[True, True, False, True], [False, True, True, False]]
    assert second_moment_mask(log_r, mask, 1.0).tolist() == mask.bool().tolist()
    assert not second_moment_mask(log_r, torch.zeros_like(mask), 0.04).any()


def test_m2po_loss_is_unclipped_ratio_on_kept_tokens() -> None:
    lp = torch.tensor([[math.log(1.1), math.log(4.0)]], requires_grad=True)
    out = policy_loss(lp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), PolicyLossConfig(mode="m2po"))
    out.loss.backward()
    # log 4 squared is 1.92 > 0.04: masked; 1.1 kept, unclipped (PPO would clip at 1.2 only above).
    assert out.loss.item() == pytest.approx(-1.1 / 2)
    assert lp.grad[0].tolist() == pytest.approx([-1.1 / 2, 0.0])
    assert out.metrics["is_masked_frac"] == 0.5


def test_staleness_weights_and_drop_rule() -> None:
    lags = torch.tensor([[0, 1, 2, 4, 9]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    w = staleness_weights(lags, mask, inverse=True, max_staleness=2)
    assert w[0].tolist() == pytest.approx([1.0, 1.0, 0.5, 0.0, 0.0])
    assert staleness_weights(lags, mask, inverse=False, max_staleness=None).tolist() == [[1, 1, 1, 1, 0]]
    cfg = PolicyLossConfig(mode="ppo", staleness_weight="inverse", max_staleness=2)
    lp = torch.zeros(1, 5)
    out = policy_loss(lp, lp, torch.tensor([1.0]), mask, cfg, token_lags=lags)
    assert out.loss.item() == pytest.approx(-(1 + 1 + 0.5 + 0) / 4)
    assert out.metrics["stale_dropped_frac"] == pytest.approx(0.25)
    with pytest.raises(RLError, match="token_lags"):
        policy_loss(lp, lp, torch.tensor([1.0]), mask, cfg)


@pytest.mark.parametrize("mode", ["ppo", "decoupled", "tis", "mis", "m2po"])
def test_degenerate_ratios_and_empty_masks_stay_finite(mode: str) -> None:
    cfg = PolicyLossConfig(mode=mode, tis_cap=2.0)
    # pi = 0 (log -inf), mu = 0 (ratio infinite), NaN logprob at a trained token's mu.
    lp = torch.tensor([[-float("inf"), -1.0, -1.0]], requires_grad=True)
    mu = torch.tensor([[-1.0, -float("inf"), float("nan")]])
    out = policy_loss(lp, mu, torch.tensor([1.0]), torch.ones(1, 3), cfg, proximal_logprobs=mu.nan_to_num(0.0))
    out.loss.backward()
    assert math.isfinite(out.loss.item()) and torch.isfinite(lp.grad).all()
    assert all(math.isfinite(v) for v in out.metrics.values())
    lp2 = torch.zeros(2, 3, requires_grad=True)
    empty = policy_loss(lp2, lp2.detach(), torch.ones(2), torch.zeros(2, 3), cfg)
    empty.loss.backward()
    assert empty.loss.item() == 0.0 and lp2.grad.abs().sum().item() == 0.0
    assert empty.metrics["tokens"] == 0.0 and empty.metrics["is_weight_std"] == 0.0


def test_spread_metrics_of_weights_and_log_mu_pi() -> None:
    lp = torch.tensor([[0.0, -1.0, -2.0]])
    mu = torch.tensor([[-1.0, -1.0, -1.0]])
    out = policy_loss(lp, mu, torch.tensor([1.0]), torch.tensor([[0, 1, 1]]), PolicyLossConfig(mode="tis", tis_cap=None))
    # kept tokens: log mu - log pi = 0, 1; weights pi/mu = 1, e^-1.
    assert out.metrics["log_mu_pi_mean"] == pytest.approx(0.5) and out.metrics["log_mu_pi_std"] == pytest.approx(0.5)
    assert out.metrics["log_mu_pi_max"] == pytest.approx(1.0)
    assert out.metrics["is_weight_mean"] == pytest.approx((1 + math.exp(-1)) / 2)
    assert out.metrics["is_weight_max"] == pytest.approx(1.0)
