"""Per-row token sampling with the behaviour logprob a trainer corrects for.

The logprob recorded for each token is its log-probability under the distribution it was
sampled from: `log_softmax(logits / temperature)` renormalised over the top-p nucleus, i.e.
minus the log of the kept mass (plain `log_softmax(logits)` for greedy decoding). The trainer
scores the same tokens with `log_softmax(logits / temperature)`, the temperature coming with
each sample.
"""

from __future__ import annotations

import torch


def sample_tokens(
    logits: torch.Tensor, temps: torch.Tensor, top_ps: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits` [B, V] and its behaviour logprob, both on the CPU.

    Row b samples from ``softmax(logits / temps[b])`` truncated to its top-p nucleus (the
    smallest set of most likely tokens whose mass reaches top_ps[b]) and renormalised; the
    logprob returned is of that distribution (``log_softmax(logits / T) - log(kept mass)``).
    A temperature <= 0 decodes greedily and returns ``log_softmax(logits)`` of the argmax.
    """
    greedy = temps <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    probs = logp.exp()
    if bool((top_ps < 1.0).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_ps[:, None]
        kept_mass = (sorted_p * keep).sum(-1)
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        nucleus = (top_ps < 1.0) & ~greedy
        logp = logp - torch.where(nucleus, kept_mass.clamp(min=1e-30).log(), torch.zeros_like(kept_mass))[:, None]
    sampled = _inverse_cdf(probs.cpu(), generator).to(logits.device)
    tokens = torch.where(greedy, logits.argmax(-1), sampled)
    return tokens.cpu(), logp.gather(-1, tokens[:, None].to(logp.device)).squeeze(-1).cpu()


def _inverse_cdf(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of `probs` [B, V] (rows need not sum to 1): the first token whose
    cumulative mass exceeds u * total, u ~ U[0, 1). A token of mass 0 is never drawn (its
    cumulative mass equals its predecessor's). Forty times faster than `torch.multinomial` for
    one draw from a small batch on a CPU, which matters once per decoding step."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand((probs.shape[0], 1), generator=generator, dtype=torch.float64) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    over = idx >= probs.shape[-1]  # rounding at the very top: take the likeliest token instead
    return torch.where(over, probs.argmax(-1), idx.clamp(max=probs.shape[-1] - 1))
