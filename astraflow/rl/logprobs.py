"""Token log-probabilities and entropies from logits: the inputs of every policy loss.

Pure torch functions. Logits are upcast to float32 and normalised with `logsumexp`, so no
full log-softmax tensor is kept and bf16 logits lose no precision. Shapes use B (batch),
T (sequence) and V (vocabulary).
"""

from __future__ import annotations

import torch

from astraflow.errors import RLError


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Log-probability of each target under its logits.

    logits: [..., V]; targets: [...] integer ids. Returns float32 [...]:
    ``logits[target] - logsumexp(logits)``.
    """
    if logits.shape[:-1] != targets.shape:
        raise RLError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
    logits = logits.float()
    picked = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def sequence_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, temperatures: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token log-probabilities of a causal LM, aligned with `token_ids`.

    With `temperatures` [B] (each > 0), sequence b is scored under ``log_softmax(logits / T_b)``:
    the distribution its tokens were sampled from (before top-p, which the rollout node folds
    into the behaviour logprob), so the trainer's and the sampler's logprobs compare.

    logits: [B, T, V] from the model run on token_ids [B, T]. Position t holds
    ``log p(token_ids[:, t] | token_ids[:, :t])`` (from logits[:, t-1]); position 0, which has no
    context, holds 0. This is the layout of behaviour logprobs in a training sample, so the two
    compare index by index under the same loss mask.
    """
    if logits.dim() != 3 or logits.shape[:2] != token_ids.shape:
        raise RLError(f"expected logits [B, T, V] for token_ids [B, T], got {tuple(logits.shape)}")
    if temperatures is not None:
        logits = scale_logits(logits, temperatures)
    shifted = token_logprobs(logits[:, :-1], token_ids[:, 1:])
    return torch.nn.functional.pad(shifted, (1, 0), value=0.0)


def scale_logits(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """``logits / T`` per sequence: logits [B, T, V] (float32), temperatures [B], each > 0."""
    if temperatures.shape != logits.shape[:1]:
        raise RLError(f"temperatures {tuple(temperatures.shape)} do not match logits {tuple(logits.shape)}")
    if not bool((temperatures > 0).all()) or not bool(torch.isfinite(temperatures).all()):
        raise RLError("temperatures must be finite and > 0: greedy (T = 0) samples cannot be trained")
    return logits.float() / temperatures.to(device=logits.device, dtype=torch.float32)[:, None, None]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each categorical distribution: logits [..., V] -> float32 [...].

    Computed as ``logsumexp(z) - sum(softmax(z) * z)``, stable for large logits.
    """
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def token_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` and `entropy_from_logits` of the same logits, sharing one `logsumexp`.

    logits: [..., V]; targets: [...]. Returns float32 ``(logprobs, entropies)``, both [...]. The
    logprobs carry gradients; the entropies only with `entropy_grad` (an entropy bonus in the loss),
    otherwise they are computed without gradients, from detached logits (a metric).
    """
    if logits.shape[:-1] != targets.shape:
        raise RLError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        z, norm = (logits, lse) if entropy_grad else (logits.detach(), lse.detach())
        entropy = norm - (torch.exp(z - norm.unsqueeze(-1)) * z).sum(dim=-1)
    return picked - lse, entropy


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask` is set (0-dim tensor); 0 when the mask is empty."""
    keep = mask.bool()
    kept = torch.where(keep, values, torch.zeros_like(values))  # NaN at masked positions stays out
    return kept.sum() / keep.sum().clamp(min=1).to(kept.dtype)
