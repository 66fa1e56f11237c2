"""Policy-gradient losses for RL on LLMs: PPO-clip, GRPO, decoupled PPO with truncated IS.

Pure torch functions on per-token tensors, shapes B (sequences) x T (tokens); `mask` is 1 on
the tokens this policy generated and is trained on. `policy_loss` is the one entry point:

- mode ``"ppo"``: the behaviour policy (whose logprobs each sample carries, recorded by the
  rollout node) is the old policy. ``ratio = pi / pi_behaviour``, clipped to
  ``[1 - eps_low, 1 + eps_high]`` (asymmetric: "clip-higher" uses eps_high > eps_low).
- mode ``"decoupled"``: decoupled PPO (Hilton et al. 2022) / truncated importance sampling
  (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training").
  The ratio is taken against a proximal policy (the trainer's own logprobs before this update;
  when not given, the current logprobs detached, i.e. one optimizer step per batch), and each
  token is weighted by ``w = min(pi_proximal / pi_behaviour, tis_cap)``, detached. It corrects
  for stale rollouts and for inference/training numeric mismatch without letting rare tokens
  blow up the gradient.

GRPO is PPO-clip with one advantage per sequence broadcast to its tokens (`grpo_loss`).
Aggregations: ``token_mean`` (sum over all tokens / number of tokens), ``seq_mean_token_mean``
(mean per sequence, then over sequences), ``seq_mean_token_sum_norm`` (Dr. GRPO: sum per
sequence / a constant `max_tokens`, then mean over sequences). Gradients flow only through the
current `logprobs` (and `entropy` when an entropy bonus is used); every other input is detached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from astraflow.errors import RLError
from astraflow.rl.logprobs import masked_mean

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3"]
LOG_RATIO_CLAMP = 20.0  # log-ratios are clamped to +-this before exp, so one token cannot overflow


@dataclass(frozen=True, slots=True)
class PolicyLossConfig:
    """Settings of `policy_loss`; validated on construction."""

    mode: Literal["ppo", "decoupled"] = "ppo"  # old policy = behaviour ("ppo") or proximal + TIS
    eps_low: float = 0.2  # ratio clipped below at 1 - eps_low
    eps_high: float = 0.2  # ratio clipped above at 1 + eps_high (0.28 for DAPO clip-higher)
    aggregation: Aggregation = "token_mean"  # how token losses become one number
    max_tokens: int | None = None  # Dr. GRPO's constant; None means the padded length T
    tis_cap: float | None = 2.0  # truncation of the decoupled IS weight; None: no truncation
    kl_coef: float = 0.0  # weight of the KL penalty to the reference policy (needs ref_logprobs)
    kl_estimator: KLEstimator = "k3"  # k1: log-ratio, k2: half squared, k3: unbiased, non-negative
    entropy_coef: float = 0.0  # weight of the entropy bonus (needs entropy)

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps_low < 1.0 or self.eps_high < 0.0:
            raise RLError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {self.eps_low}, {self.eps_high}")
        if self.tis_cap is not None and self.tis_cap <= 0.0:
            raise RLError(f"tis_cap must be positive or None, got {self.tis_cap}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise RLError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        if self.aggregation not in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
            raise RLError(f"unknown aggregation {self.aggregation!r}")
        if self.mode not in ("ppo", "decoupled"):
            raise RLError(f"unknown mode {self.mode!r}: use 'ppo' or 'decoupled'")


@dataclass(slots=True)
class PolicyLossOutput:
    """The loss to backpropagate and detached metrics for logging."""

    loss: torch.Tensor  # 0-dim, differentiable
    metrics: dict[str, float]  # pg_loss, clip_frac, approx_kl, ratio_mean, is_weight_mean, ...


def broadcast_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token advantages [B, T]: sequence advantages [B] are repeated over tokens."""
    if advantages.dim() == 1 and advantages.shape[0] == mask.shape[0]:
        return advantages[:, None].expand(mask.shape)
    if advantages.shape == mask.shape:
        return advantages
    raise RLError(f"advantages {tuple(advantages.shape)} fit neither [B] nor [B, T] = {tuple(mask.shape)}")


def aggregate(
    token_losses: torch.Tensor, mask: torch.Tensor, mode: Aggregation, max_tokens: int | None = None
) -> torch.Tensor:
    """Reduces token losses [B, T] under `mask` to a scalar (see the module docstring).

    ``seq_mean_token_mean`` averages over sequences that have at least one token;
    ``seq_mean_token_sum_norm`` averages over all B sequences, dividing each sum by `max_tokens`
    (default T), so a token weighs the same whatever the length of its sequence.
    """
    keep = mask.bool()
    m = keep.to(token_losses.dtype)
    # where(), not a product: a NaN or inf at a masked position must not leak into the sum.
    kept = torch.where(keep, token_losses, torch.zeros_like(token_losses))
    if mode == "token_mean":
        return masked_mean(token_losses, keep)
    per_seq_sum = kept.sum(dim=-1)
    if mode == "seq_mean_token_mean":
        counts = m.sum(dim=-1)
        present = counts > 0
        per_seq = per_seq_sum / counts.clamp(min=1.0)
        return per_seq[present].sum() / present.sum().clamp(min=1)
    if mode == "seq_mean_token_sum_norm":
        return (per_seq_sum / float(max_tokens or mask.shape[-1])).mean()
    raise RLError(f"unknown aggregation {mode!r}")


def ppo_clip_token_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)`` and where the clip bound."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def truncated_is_weights(
    proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cap: float | None
) -> torch.Tensor:
    """Detached importance weights ``min(exp(proximal - behaviour), cap)``; no cap when None."""
    log_w = (proximal_logprobs - behaviour_logprobs).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    weights = log_w.exp()
    return weights if cap is None else weights.clamp(max=cap)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi.

    k1 = log(pi / pi_ref); k2 = (log(pi / pi_ref))^2 / 2; k3 = pi_ref/pi - 1 - log(pi_ref/pi)
    (unbiased and non-negative, Schulman 2020).
    """
    log_ratio = (logprobs - ref_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise RLError(f"unknown KL estimator {estimator!r}: use k1, k2 or k3")


def policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig = PolicyLossConfig(),
    *,
    proximal_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """PPO-clip / decoupled-PPO policy loss with optional KL and entropy terms.

    logprobs: [B, T] current policy, differentiable. behaviour_logprobs: [B, T] recorded at
    rollout. advantages: [B] (per sequence, GRPO) or [B, T]. mask: [B, T] bool or 0/1.
    proximal_logprobs, ref_logprobs, entropy: optional [B, T]. Returns the aggregated loss
    ``pg + kl_coef * kl - entropy_coef * entropy`` (each aggregated the same way) and metrics.
    """
    if logprobs.dim() != 2 or behaviour_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise RLError(
            f"logprobs {tuple(logprobs.shape)}, behaviour_logprobs {tuple(behaviour_logprobs.shape)} and "
            f"mask {tuple(mask.shape)} must all be [B, T]"
        )
    keep = mask.bool()
    zeros = torch.zeros_like(logprobs)

    def kept(values: torch.Tensor) -> torch.Tensor:
        """Zero at masked positions, so padding garbage (even NaN) reaches neither loss nor grads."""
        return torch.where(keep, values.to(logprobs.dtype), zeros)

    current = kept(logprobs)
    adv = kept(broadcast_advantages(advantages.detach(), keep))
    behaviour = kept(behaviour_logprobs.detach())
    if config.mode == "decoupled":
        old = kept(proximal_logprobs.detach()) if proximal_logprobs is not None else current.detach()
        weights = kept(truncated_is_weights(old, behaviour, config.tis_cap))
    else:
        old, weights = behaviour, torch.ones_like(logprobs)
    log_ratio = (current - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    token_pg, clipped = ppo_clip_token_loss(ratio, adv, config.eps_low, config.eps_high)
    pg = aggregate(weights * token_pg, keep, config.aggregation, config.max_tokens)
    loss = pg
    metrics = _clip_metrics(ratio.detach(), log_ratio.detach(), adv, clipped, keep)
    metrics["pg_loss"] = pg.item()
    if config.mode == "decoupled":
        raw = (old - behaviour).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        metrics["is_weight_mean"] = masked_mean(weights, keep).item()
        capped = (raw > config.tis_cap).float() if config.tis_cap is not None else zeros
        metrics["is_truncated_frac"] = masked_mean(capped, keep).item()
    if config.kl_coef > 0.0:
        if ref_logprobs is None:
            raise RLError(
                "kl_coef > 0 needs ref_logprobs: pass the reference model's logprobs or set kl_coef=0"
            )
        kl = aggregate(
            kl_penalty(current, kept(ref_logprobs.detach()), config.kl_estimator),
            keep,
            config.aggregation,
            config.max_tokens,
        )
        loss = loss + config.kl_coef * kl
        metrics["kl_ref"] = kl.item()
    if config.entropy_coef > 0.0 and entropy is None:
        raise RLError(
            "entropy_coef > 0 needs entropy: pass entropy_from_logits(logits) or set entropy_coef=0"
        )
    if entropy is not None:
        ent = aggregate(kept(entropy), keep, config.aggregation, config.max_tokens)
        metrics["entropy"] = ent.item()
        if config.entropy_coef > 0.0:
            loss = loss - config.entropy_coef * ent
    metrics["loss"] = loss.item()
    return PolicyLossOutput(loss=loss, metrics=metrics)


def grpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    sequence_advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig = PolicyLossConfig(),
    **optional: torch.Tensor | None,
) -> PolicyLossOutput:
    """GRPO: `policy_loss` with one advantage per sequence ([B]), broadcast to its tokens."""
    if sequence_advantages.dim() != 1:
        raise RLError(f"GRPO takes one advantage per sequence [B], got {tuple(sequence_advantages.shape)}")
    return policy_loss(logprobs, behaviour_logprobs, sequence_advantages, mask, config, **optional)


def _clip_metrics(
    ratio: torch.Tensor, log_ratio: torch.Tensor, adv: torch.Tensor, clipped: torch.Tensor, keep: torch.Tensor
) -> dict[str, float]:
    """Clip fractions, ratio statistics and approx KL(old || current) = mean((r - 1) - log r)."""
    if not keep.any():
        return {
            "clip_frac": 0.0,
            "clip_frac_low": 0.0,
            "clip_frac_high": 0.0,
            "approx_kl": 0.0,
            "ratio_mean": 1.0,
            "ratio_max": 1.0,
            "tokens": 0.0,
        }
    return {
        "clip_frac": masked_mean(clipped.float(), keep).item(),
        "clip_frac_low": masked_mean((clipped & (adv < 0)).float(), keep).item(),
        "clip_frac_high": masked_mean((clipped & (adv > 0)).float(), keep).item(),
        "approx_kl": masked_mean((ratio - 1.0) - log_ratio, keep).item(),
        "ratio_mean": masked_mean(ratio, keep).item(),
        "ratio_max": ratio[keep].max().item(),
        "tokens": float(keep.sum().item()),
    }
