"""Off-policy corrections for stale rollouts: importance weights, masks and staleness weights.

Pure torch functions on per-token tensors [B, T]; `astraflow.rl.losses.policy_loss` combines
them into one loss per `PolicyLossConfig.mode`. Notation: pi is the policy being trained (its
current logprobs), pi_prox the proximal policy (the trainer's weights before this batch's
first optimizer step), mu the behaviour policy that sampled the tokens (its logprobs are
recorded by the rollout node, post-temperature). Every output here is detached: weights and
masks scale the loss, gradients flow only through pi.

- `truncated_is_weights`: ``min(exp(log a - log b), cap)``, the truncated importance ratio of
  IMPALA's V-trace (Espeholt et al. 2018) and of TIS (Yao et al. 2025, "Your Efficient RL
  Framework Secretly Brings You Off-Policy RL Training").
- `masked_is_weights`: the ratio where it lies in ``[1/cap, cap]``, 0 elsewhere (masked
  importance sampling, MIS: the token is dropped instead of truncated; Liu, Li et al. 2025,
  "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch").
- `second_moment_mask`: M2PO's mask (Zheng et al. 2025, "Prosperity before Collapse: How Far
  Can Off-Policy RL Reach with Stale Data on LLMs?"): drop the tokens with the largest squared
  log-ratio, fewest first, until the mean squared log-ratio of the kept tokens is at most the
  threshold. It bounds the second moment of the weights of the whole batch instead of clipping
  each token, so a stale batch keeps most of its tokens.
- `staleness_weights`: a per-token weight from how many versions behind the trainer each token
  is: ``1 / max(1, lag)`` (the learning rate divided by the staleness, as in Zhang et al. 2016,
  "Staleness-aware Async-SGD for Distributed Deep Learning"), and 0 beyond `max_staleness`
  (the drop rule: a token older than the limit teaches nothing, however long it queued).
"""

from __future__ import annotations

import torch

from astraflow.errors import RLError

LOG_RATIO_CLAMP = 20.0  # log-ratios are clamped to +-this before exp, so one token cannot overflow


def log_ratio(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``log a - log b`` from logprobs, detached, clamped to +-LOG_RATIO_CLAMP; NaN becomes 0
    (a NaN ratio must not slip through a comparison as 'kept')."""
    diff = (a - b).detach()
    return torch.nan_to_num(diff, nan=0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def truncated_is_weights(numerator: torch.Tensor, behaviour: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Detached importance weights ``min(exp(numerator - behaviour), cap)``; no cap when None."""
    weights = log_ratio(numerator, behaviour).exp()
    return weights if cap is None else weights.clamp(max=cap)


def masked_is_weights(numerator: torch.Tensor, behaviour: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """MIS: (weights, kept) where ``r = exp(numerator - behaviour)``; ``kept = 1/cap <= r <= cap``
    and the weight is r where kept, 0 elsewhere."""
    if cap <= 1.0:
        raise RLError(f"masked importance sampling needs cap > 1, got {cap}")
    ratio = log_ratio(numerator, behaviour).exp()
    kept = (ratio <= cap) & (ratio >= 1.0 / cap)
    return torch.where(kept, ratio, torch.zeros_like(ratio)), kept


def second_moment_mask(log_ratios: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """M2PO: the tokens (bool [B, T], a subset of `mask`) kept so that the mean of
    ``log_ratios**2`` over them is at most `threshold`, dropping the largest first and as few
    as possible. With no token over the threshold on average, the mask is returned unchanged."""
    if threshold < 0.0:
        raise RLError(f"the M2PO threshold must be >= 0, got {threshold}")
    keep = mask.bool()
    squares = torch.nan_to_num(log_ratios.detach().float(), nan=LOG_RATIO_CLAMP) ** 2
    values = squares[keep]
    n = values.numel()
    if n == 0 or values.mean().item() <= threshold:
        return keep.clone()
    order = torch.argsort(values, descending=True)
    ordered = values[order]
    # Mean of the kept tokens after dropping the k largest, for k = 0 .. n-1.
    suffix = torch.flip(torch.cumsum(torch.flip(ordered, [0]), 0), [0])  # suffix[k] = sum(ordered[k:])
    means = suffix / torch.arange(n, 0, -1, dtype=suffix.dtype)
    fits = torch.nonzero(means <= threshold)
    drop = int(fits[0].item()) if fits.numel() else n  # none fits (threshold 0, all non-zero): drop all
    kept_flat = torch.ones(n, dtype=torch.bool)
    kept_flat[order[:drop]] = False
    out = torch.zeros_like(keep)
    out[keep] = kept_flat
    return out


def staleness_weights(
    lags: torch.Tensor, mask: torch.Tensor, *, inverse: bool, max_staleness: int | None
) -> torch.Tensor:
    """Per-token weights from `lags` (versions behind the trainer, int [B, T]): ``1 / max(1, lag)``
    when `inverse` (else 1), and 0 where ``lag > max_staleness``. Masked positions get 0."""
    lag = lags.clamp(min=0).to(torch.float32)
    w = 1.0 / lag.clamp(min=1.0) if inverse else torch.ones_like(lag)
    if max_staleness is not None:
        w = torch.where(lag > max_staleness, torch.zeros_like(w), w)
    return torch.where(mask.bool(), w, torch.zeros_like(w))
