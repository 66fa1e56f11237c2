"""Policy-gradient losses for RL on LLMs: PPO-clip, GRPO, decoupled PPO and off-policy corrections.

Pure torch functions on per-token tensors, shapes B (sequences) x T (tokens); `mask` is 1 on
the tokens this policy generated and is trained on. `policy_loss` is the one entry point; its
`mode` picks how stale (off-policy) tokens are corrected (the weights and masks themselves are
in `astraflow.rl.corrections`, with their papers):

- ``"ppo"``: the behaviour policy mu (whose logprobs each sample carries) is the old policy:
  ``ratio = pi / mu`` clipped to ``[1 - eps_low, 1 + eps_high]`` (clip-higher when eps_high >
  eps_low), and for negative advantages the loss is capped at ``-dual_clip * A`` (dual-clip
  PPO, Ye et al. 2020), so one very stale token with a huge ratio cannot dominate.
- ``"decoupled"``: decoupled PPO (Hilton et al. 2022; AReaL, Fu et al. 2025). The clip acts on
  ``pi / pi_prox`` where pi_prox is the proximal policy, the trainer's weights before this
  batch's first optimizer step (`proximal_logprobs`; when not given, the current logprobs
  detached, which is exact for one optimizer step per batch and then makes the clip inert);
  each token is weighted by ``min(pi_prox / mu, tis_cap)``, detached. Dual clip as in ppo.
- ``"tis"``: truncated importance sampling without a trust region: the policy gradient
  ``min(pi / mu, tis_cap) * A * grad log pi`` (V-trace's truncated rho; Yao et al. 2025).
- ``"mis"``: masked importance sampling: the same with ``pi / mu`` outside ``[1/tis_cap,
  tis_cap]`` dropped instead of truncated.
- ``"m2po"``: M2PO (Zheng et al. 2025): no clip; ``ratio = pi / mu`` on the tokens kept by the
  second-moment mask (mean of ``log(pi/mu)^2`` over kept tokens <= `m2_threshold`).

In every mode, `token_lags` (versions behind the trainer per token) can weight each token by
``1 / max(1, lag)`` (`staleness_weight="inverse"`) and drop those beyond `max_staleness`.
Tokens masked by a correction stay in the normaliser (the batch's token count or sequence
count), so masking lowers the step instead of re-weighting the survivors.

GRPO is any of these with one advantage per sequence broadcast to its tokens (`grpo_loss`).
Aggregations: ``token_mean`` (sum over all tokens / number of tokens), ``seq_mean_token_mean``
(mean per sequence, then over sequences), ``seq_mean_token_sum_norm`` (Dr. GRPO: sum per
sequence / a constant `max_tokens`, then mean over sequences; `max_tokens` must be set, so the
loss does not depend on how much a batch is padded). Gradients flow only through the current
`logprobs` (and `entropy` when an entropy bonus is used); every other input is detached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astraflow.errors import RLError
from astraflow.rl.corrections import (
    LOG_RATIO_CLAMP,
    log_ratio,
    masked_is_weights,
    second_moment_mask,
    staleness_weights,
    truncated_is_weights,
)
from astraflow.rl.logprobs import masked_mean
from astraflow.rl.loss_config import Aggregation, KLEstimator, PolicyLossConfig

MIN_LOGPROB = -1e4  # a -inf logprob is read as this (finite, so differences and gradients stay finite)


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


def aggregation_count(mask: torch.Tensor, mode: Aggregation) -> torch.Tensor:
    """What `aggregate` divides by for `mask` [B, T] (float 0-dim): the trained tokens
    (``token_mean``), the sequences with a trained token (``seq_mean_token_mean``) or all B
    sequences (``seq_mean_token_sum_norm``). Summed over data-parallel ranks, it is the
    normaliser of the whole batch (`data_parallel_normaliser`)."""
    keep = mask.bool()
    if mode == "token_mean":
        return keep.sum().to(torch.float32)
    if mode == "seq_mean_token_mean":
        return keep.any(dim=-1).sum().to(torch.float32)
    if mode == "seq_mean_token_sum_norm":
        return torch.tensor(float(keep.shape[0]))
    raise RLError(f"unknown aggregation {mode!r}")


def data_parallel_normaliser(global_count: torch.Tensor | float, world_size: int) -> torch.Tensor:
    """The `normaliser` each of `world_size` data-parallel ranks passes to `aggregate` so that
    their losses, once the gradients are averaged over ranks (DDP's all-reduce, FSDP's
    reduce-scatter), give the gradient of the loss of the whole batch on one rank:
    ``mean_r(sum_r / (N / W)) = sum / N`` with N the `aggregation_count` summed over ranks
    (clamped at 1, as one rank's empty mask is)."""
    if world_size < 1:
        raise RLError(f"world_size must be >= 1, got {world_size}")
    count = torch.as_tensor(global_count, dtype=torch.float32).clamp(min=1.0)
    return count / float(world_size)


def aggregate(
    token_losses: torch.Tensor, mask: torch.Tensor, mode: Aggregation, max_tokens: int | None = None,
    normaliser: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Reduces token losses [B, T] under `mask` to a scalar (see the module docstring).

    ``seq_mean_token_mean`` averages over sequences that have at least one token;
    ``seq_mean_token_sum_norm`` averages over all B sequences, dividing each sum by the constant
    `max_tokens` (required), so a token weighs the same whatever the length of its sequence and
    however the batch is padded. `normaliser` replaces the count divided by (this batch's
    `aggregation_count`): a data-parallel rank passes `data_parallel_normaliser` so the mean is
    over the whole batch of every rank, not over its own share.
    """
    keep = mask.bool()
    m = keep.to(token_losses.dtype)
    # where(), not a product: a NaN or inf at a masked position must not leak into the sum.
    kept = torch.where(keep, token_losses, torch.zeros_like(token_losses))
    if mode == "token_mean":
        if normaliser is not None:
            return kept.sum() / normaliser
        return masked_mean(token_losses, keep)
    per_seq_sum = kept.sum(dim=-1)
    if mode == "seq_mean_token_mean":
        counts = m.sum(dim=-1)
        present = counts > 0
        per_seq = per_seq_sum / counts.clamp(min=1.0)
        return per_seq[present].sum() / (present.sum().clamp(min=1) if normaliser is None else normaliser)
    if mode == "seq_mean_token_sum_norm":
        if max_tokens is None:
            raise RLError("seq_mean_token_sum_norm needs max_tokens (a constant, not the padded length)")
        per_seq = per_seq_sum / float(max_tokens)
        return per_seq.mean() if normaliser is None else per_seq.sum() / normaliser
    raise RLError(f"unknown aggregation {mode!r}")


def ppo_clip_token_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float, dual_clip: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)`` and where a clip
    bound; with `dual_clip` c, a negative-advantage token's loss is also capped at ``-c A``."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    bound = clipped < unclipped
    if dual_clip is not None:
        cap = -dual_clip * advantages
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        bound = bound | dual
    return loss, bound


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
    token_lags: torch.Tensor | None = None,
    normaliser: torch.Tensor | float | None = None,
) -> PolicyLossOutput:
    """The policy loss of `config.mode` with optional staleness weights, KL and entropy terms.

    logprobs: [B, T] current policy, differentiable. behaviour_logprobs: [B, T] recorded at
    rollout. advantages: [B] (per sequence, GRPO) or [B, T]. mask: [B, T] bool or 0/1.
    proximal_logprobs, ref_logprobs, entropy: optional [B, T]; token_lags: optional int [B, T]
    (versions behind the trainer; needed by staleness_weight / max_staleness); normaliser: what
    every aggregated term is divided by instead of this batch's count (`aggregate`; a
    data-parallel rank's `data_parallel_normaliser`, so its metrics are its share). Returns the
    aggregated loss ``pg + kl_coef * kl - entropy_coef * entropy`` and metrics, among them the
    spread of the importance weights (``is_weight_*``, of the correction's weight) and of
    ``log mu - log pi`` (``log_mu_pi_*``) over the trained tokens of the batch.
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

    # Logprobs are <= 0 and finite in any valid sample (the trainer dead-letters others); here a
    # -inf becomes MIN_LOGPROB (its ratio then clamps at e^+-20) and a NaN behaviour logprob 0.
    current = kept(logprobs.clamp(min=MIN_LOGPROB))
    adv = kept(broadcast_advantages(advantages.detach(), keep))
    behaviour = kept(torch.nan_to_num(behaviour_logprobs.detach(), nan=0.0, posinf=0.0, neginf=MIN_LOGPROB))
    mode = config.mode
    metrics: dict[str, float] = {}
    if mode in ("ppo", "decoupled"):
        if mode == "decoupled":
            old = kept(proximal_logprobs.detach()) if proximal_logprobs is not None else current.detach()
            weights = kept(truncated_is_weights(old, behaviour, config.tis_cap))
        else:
            old, weights = behaviour, kept(torch.ones_like(logprobs))
        lr = (current - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = lr.exp()
        token_pg, clipped = ppo_clip_token_loss(ratio, adv, config.eps_low, config.eps_high, config.dual_clip)
        if config.dual_clip is not None:
            dual = (adv < 0) & (ratio > config.dual_clip)  # where the dual clip bounds (clip(r) <= 1 + eps < c)
            metrics["dual_clip_frac"] = masked_mean(dual.float(), keep).item()
    else:
        lr = (current - behaviour).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = lr.exp()
        # exp(lp - sg(lp)) is 1 in value with the gradient of log pi: -w A (value) and -w A grad log pi.
        score = (current - current.detach()).exp()
        if mode == "tis":
            weights = kept(truncated_is_weights(current, behaviour, config.tis_cap))
            token_pg = -adv * score
            clipped = (ratio.detach() > config.tis_cap) if config.tis_cap is not None else torch.zeros_like(keep)
        elif mode == "mis":
            w, inside = masked_is_weights(current, behaviour, float(config.tis_cap or 0.0))
            weights = kept(w)
            token_pg = -adv * score
            clipped = ~inside
        else:  # m2po
            m2_kept = second_moment_mask(lr.detach(), keep, config.m2_threshold)
            weights = kept(m2_kept.to(logprobs.dtype))
            token_pg = -ratio * adv
            clipped = ~m2_kept
        clipped = clipped & keep
    is_weights = weights
    if config.staleness_weight != "none" or config.max_staleness is not None:
        if token_lags is None:
            raise RLError("staleness_weight / max_staleness need token_lags: pass the versions behind the trainer per token")
        stale = staleness_weights(token_lags, keep, inverse=config.staleness_weight == "inverse",
                                  max_staleness=config.max_staleness)
        weights = weights * stale
        metrics["stale_dropped_frac"] = masked_mean((stale == 0).float(), keep).item()
    pg = aggregate(weights * token_pg, keep, config.aggregation, config.max_tokens, normaliser)
    loss = pg
    metrics.update(_clip_metrics(ratio.detach(), lr.detach(), adv, clipped, keep))
    metrics.update(_spread_metrics(is_weights, log_ratio(behaviour, current), keep))
    metrics["pg_loss"] = pg.item()
    if mode in ("decoupled", "tis"):
        raw = log_ratio(old if mode == "decoupled" else current, behaviour).exp()
        capped = (raw > config.tis_cap).float() if config.tis_cap is not None else zeros
        metrics["is_truncated_frac"] = masked_mean(capped, keep).item()
    if mode in ("mis", "m2po"):
        metrics["is_masked_frac"] = masked_mean(clipped.float(), keep).item()
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
            normaliser,
        )
        loss = loss + config.kl_coef * kl
        metrics["kl_ref"] = kl.item()
    if config.entropy_coef > 0.0 and entropy is None:
        raise RLError(
            "entropy_coef > 0 needs entropy: pass entropy_from_logits(logits) or set entropy_coef=0"
        )
    if entropy is not None:
        ent = aggregate(kept(entropy), keep, config.aggregation, config.max_tokens, normaliser)
        metrics["entropy"] = ent.item()
        if config.entropy_coef > 0.0:
            loss = loss - config.entropy_coef * ent
    metrics["loss"] = loss.item()
    return PolicyLossOutput(loss=loss, metrics=metrics)


def _spread_metrics(weights: torch.Tensor, log_mu_pi: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
    """Mean, std and max of the importance weights and of ``log mu - log pi`` over kept tokens."""
    out: dict[str, float] = {}
    for name, values in (("is_weight", weights.detach().float()), ("log_mu_pi", log_mu_pi.float())):
        v = values[keep]
        if v.numel() == 0:
            out.update({f"{name}_mean": 0.0, f"{name}_std": 0.0, f"{name}_max": 0.0})
            continue
        out[f"{name}_mean"] = v.mean().item()
        out[f"{name}_std"] = v.std(unbiased=False).item()
        out[f"{name}_max"] = v.abs().max().item() if name == "log_mu_pi" else v.max().item()
    return out


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
